"""End-to-end smoke sweep: simulated prefill + decode + the project's LB on 127.0.0.1, both tools, concurrency
1 and 2, a handful of requests (about 30 s on 2 cores), then the outputs are parsed and the PNGs checked.

Runs the real entry point (``bench/sweep/run.sh``) the way a user does, in the tools' own venv.
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from bench.sweep.records import COLUMNS, read_csv

pytestmark = pytest.mark.slow

PLOTS = ("throughput_vs_concurrency", "ttft_vs_concurrency", "itl_tpot_vs_concurrency", "goodput_vs_concurrency")


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def run_sweep(repo: Path, bench_env: dict[str, str]) -> Runner:
    def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(repo / "bench/sweep/run.sh"), *args], capture_output=True, text=True,
                              env=bench_env, timeout=timeout, stdin=subprocess.DEVNULL)
    return run


@pytest.fixture(scope="module")
def smoke_out(bench_python: Path, repo: Path, run_sweep: Runner, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (repo / "simworker" / "__main__.py").exists():
        pytest.fail("simworker/ missing: the smoke sweep needs the simulated workers")
    out = tmp_path_factory.mktemp("sweep") / "out"
    p = run_sweep(["--launch-sim", "--scenarios", "smoke", "--concurrency", "1,2",
              "--min-requests", "4", "--requests-per-user", "2", "--out", str(out)])
    assert p.returncode == 0, f"sweep failed:\n{p.stdout}\n{p.stderr}"
    return out


def test_smoke_sweep_rows_are_complete_and_sane(smoke_out: Path) -> None:
    rows = read_csv(smoke_out / "sweep.csv")
    assert sorted((r.tool, r.concurrency) for r in rows) == [
        ("evalscope", 1), ("evalscope", 2), ("genai-bench", 1), ("genai-bench", 2)]
    for r in rows:
        assert r.scenario == "smoke" and r.num_failed == 0 and r.num_requests >= 4
        assert r.mean_output_tokens == 8, r  # ignore_eos: every answer has the requested length
        assert 0 < r.ttft_ms_p50 <= r.ttft_ms_p99 < 2000
        assert 0 < r.itl_ms_p50 < 1000 and 0 < r.tpot_ms_p50 < 1000
        assert r.output_throughput > 0 and r.input_throughput > 0 and r.request_throughput > 0
        # evalscope rounds its run time to 0.1 ms, so its throughput and our goodput differ by rounding
        assert 0 <= r.slo_attainment <= 1 and r.goodput_tok_s <= r.output_throughput * 1.01
    doc = json.loads((smoke_out / "sweep.json").read_text())
    assert doc["columns"] == COLUMNS and len(doc["rows"]) == 4
    assert doc["meta"]["slo"] == {"ttft_s": 2.0, "itl_s": 0.05} and doc["meta"]["model"]
    # the tools' own output is kept next to ours, and no real key can leak (a dummy one was used)
    assert list((smoke_out / "raw" / "genai-bench").rglob("*_num_concurrency_1_*.json"))
    assert list((smoke_out / "raw" / "evalscope" / "smoke").glob("c2/parallel_2_number_4/benchmark_data.db"))


def test_smoke_sweep_plots_are_real_pngs(smoke_out: Path) -> None:
    for name in PLOTS:
        w, h = _png_size(smoke_out / "plots" / f"{name}.png")
        assert w >= 1000 and h >= 400  # two tool panels side by side at 110 dpi


def test_replot_with_a_stricter_slo_lowers_goodput(smoke_out: Path, run_sweep: Runner, tmp_path: Path) -> None:
    before = {(r.tool, r.concurrency): r for r in read_csv(smoke_out / "sweep.csv")}
    smoke_out = Path(shutil.copytree(smoke_out, tmp_path / "copy"))  # leave the shared sweep untouched
    # an ITL SLO below any possible inter-token gap: no request can meet it
    p = run_sweep(["--replot", str(smoke_out), "--slo-itl-ms", "0.001"])  # scenarios come from sweep.json
    assert p.returncode == 0, p.stderr
    after = read_csv(smoke_out / "sweep.csv")
    assert {(r.tool, r.concurrency) for r in after} == set(before)
    assert all(r.slo_attainment == 0 and r.goodput_tok_s == 0 for r in after)
    assert all(r.output_throughput == before[(r.tool, r.concurrency)].output_throughput for r in after)
    assert json.loads((smoke_out / "sweep.json").read_text())["meta"]["slo"]["itl_s"] == pytest.approx(1e-6)


def test_unreachable_target_through_the_real_entry_point(bench_python: Path, run_sweep: Runner, dead_url: str,
                                                         tmp_path: Path) -> None:
    p = run_sweep(["--target", dead_url, "--tokenizer", "local", "--out", str(tmp_path / "o")], timeout=60)
    assert p.returncode == 2 and "unreachable" in p.stderr and "Traceback" not in p.stderr
