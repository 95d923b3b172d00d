"""Checks run before any request is sent: the target answers, the tokenizer is a local folder, the tools exist.

Each failure is a SweepError whose message says what to do, so an unreachable LB or a missing tokenizer
ends in one line instead of a tool's traceback minutes later.
"""
from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from .errors import SweepError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def normalize_url(url: str) -> str:
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise SweepError(f"--target {url!r} is not an http(s) URL such as http://127.0.0.1:8000")
    return url.rstrip("/").removesuffix("/v1")


def check_target(base_url: str, timeout_s: float = 5.0) -> list[str]:
    """Model ids the target serves ([] if it has no /v1/models); SweepError when nothing answers."""
    last: Exception | None = None
    for path in ("/v1/models", "/health"):
        try:
            with urllib.request.urlopen(base_url + path, timeout=timeout_s) as resp:
                body = resp.read()
            if path == "/v1/models":
                try:
                    return [m["id"] for m in json.loads(body).get("data", []) if "id" in m]
                except (ValueError, AttributeError, TypeError):
                    return []
            return []
        except urllib.error.HTTPError:
            # it answered (e.g. 404 on a route the LB does not forward): reachable; try the next route
            last = None
            continue
        except (urllib.error.URLError, OSError) as e:
            last = e
            break
    if last is not None:
        reason = getattr(last, "reason", last)
        raise SweepError(
            f"target {base_url} is unreachable ({reason}); start the LB / server first, "
            f"or check --target (it must be the LB's or server's base URL, e.g. http://HOST:8000)"
        )
    return []


def check_tokenizer(path: str | None) -> Path:
    if not path:
        raise SweepError(
            "no tokenizer: pass --tokenizer DIR with the served model's tokenizer files (e.g. the model path), "
            "or --tokenizer local to build a small offline one (loopback / simulated workers only)"
        )
    p = Path(path).expanduser()
    if not p.is_dir():
        raise SweepError(
            f"tokenizer folder {path!r} does not exist; the sweep runs offline and never downloads from a hub: "
            f"copy the model's tokenizer files into a local folder, or build one with "
            f"`python -m bench.sweep.make_tokenizer DIR`"
        )
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise SweepError(f"{p} holds no tokenizer ({' / '.join(TOKENIZER_FILES)} missing)")
    return p.resolve()


def find_tool(name: str, tools_bin: Path | None) -> str:
    candidates = [tools_bin / name] if tools_bin else []
    found = next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None) or shutil.which(name)
    if not found:
        raise SweepError(
            f"{name} not found{f' in {tools_bin}' if tools_bin else ''} nor on PATH; "
            f"install the benchmark tools with `bash bench/sweep/install_tools.sh` (creates .venv-bench/)"
        )
    return found
