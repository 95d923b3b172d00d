"""Clear errors before any request: unreachable target, missing tokenizer, missing tools; the local tokenizer."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from bench.sweep.cli import main
from bench.sweep.errors import SweepError
from bench.sweep.make_tokenizer import build
from bench.sweep.preflight import check_target, check_tokenizer, find_tool, normalize_url


@pytest.fixture
def models_server() -> Iterator[str]:
    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": "deepseek-v3"}]}).encode()
                self.send_response(200)
            else:
                body = b"not found"
                self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_target_model_ids(models_server: str) -> None:
    assert check_target(models_server) == ["deepseek-v3"]
    assert normalize_url(models_server + "/v1/") == models_server


def test_unreachable_target_is_one_clear_error(dead_url: str) -> None:
    with pytest.raises(SweepError, match="unreachable.*start the LB"):
        check_target(dead_url, timeout_s=2)
    with pytest.raises(SweepError, match="not an http"):
        normalize_url("127.0.0.1:8000")


def test_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="no tokenizer"):
        check_tokenizer(None)
    with pytest.raises(SweepError, match="does not exist.*never downloads"):
        check_tokenizer("deepseek-ai/DeepSeek-V3")  # a hub id, not a folder
    with pytest.raises(SweepError, match="holds no tokenizer"):
        check_tokenizer(str(tmp_path))


def test_local_tokenizer_builds_and_round_trips(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    d = build(tmp_path / "tok", vocab_size=1024)
    assert check_tokenizer(str(d)) == d.resolve()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["chat_template"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    text = "The quick brown fox answers 42 questions."
    ids = tok.encode(text).ids
    assert tok.get_vocab_size() == 1024 and 4 < len(ids) < len(text) and tok.decode(ids) == text
    # same corpus, same merges: the file is reproducible on every machine
    assert (build(tmp_path / "again", vocab_size=1024) / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()


def test_missing_tool_names_the_install_script(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="install_tools.sh"):
        find_tool("genai-bench-that-does-not-exist", tmp_path)


def test_cli_exit_2_and_one_line_for_unreachable_target(dead_url: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--target", dead_url, "--tokenizer", "local", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: target") and "unreachable" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_cli_missing_tokenizer(models_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--target", models_server, "--out", str(tmp_path / "o")])
    assert rc == 2 and "no tokenizer" in capsys.readouterr().err


def test_cli_dry_run_prints_both_tools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("genai-bench", "evalscope"):  # stand-ins: a dry run only needs them to exist
        (tools / name).write_text("#!/bin/sh\nexit 1\n")
        (tools / name).chmod(0o755)
    tok = build(tmp_path / "tok", vocab_size=512)
    rc = main(["--target", "http://127.0.0.1:9", "--tokenizer", str(tok), "--scenarios", "short,long",
               "--concurrency", "1-4", "--tools-bin", str(tools), "--dry-run", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("genai-bench benchmark") == 1  # 1, 2, 4 share the minimum request count
    assert out.count("evalscope perf") == 2 * 3
    assert "--api-key ***" in out
