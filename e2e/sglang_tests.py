"""Run SGLang's own PD tests (the ones its wheel ships that fit two GPUs and a tiny model) with p2pnccl.

    python3 -m e2e.sglang_tests --sglang-root DIR --model DIR --out results.json --logs DIR

SGLang's PD fixture picks the transfer backend from ``SGLANG_TEST_PD_DISAGG_BACKEND``; here it is ``p2pnccl``
and the fixture's LB (``sglang_router.launch_router --mini-lb``) is our LB through ``e2e/shims``. The model,
and the server flags this host needs, come in through the ``e2e.sglang_pd_plugin`` pytest plugin. Each test
file runs in its own pytest process with a time limit, so one hang costs one file, not the step.

``--gpus 1``: the fixture puts decode on ``--base-gpu-id 1``; the appended EXTRA_ARGS_1GPU put it back on GPU 0
(argparse keeps the last value) and cap both servers' KV pools, because the fixture starts prefill and decode
at the same moment on the one GPU, and uncapped each would size its pool from memory the other is taking.
p2pnccl then runs on its Mooncake tcp transport (config.BACKEND_ENV_1GPU); without Mooncake importable every
file is reported skipped with that reason, not run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from . import config, results
from .servers import exit_on_sigterm, record_pid

# (file, seconds it is expected to need), in order of value per minute: each test class launches its own
# P/D pair (~1.5 min with the tiny model) and tears it down (~10 s)
TEST_FILES = (
    ("sglang/test/manual/disaggregation/test_disaggregation_chunked_prefill_abort.py", 150),  # 1 class
    ("sglang/test/manual/disaggregation/test_disaggregation_peer_liveness_abort.py", 300),  # 2 classes, failure injection
)
DONE = ("passed", "failed", "error")  # a file with any of these outcomes has run; a later call skips it
EXTRA_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch",
              "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
              "--mem-fraction-static", "0.3"]
EXTRA_ARGS_1GPU = ["--base-gpu-id", "0", "--max-total-tokens", "131072"]  # prompts of ~28k tokens + 4k out fit
SHIMS = Path(__file__).resolve().parent / "shims"


def extra_args(gpus: int) -> list[str]:
    return [*EXTRA_ARGS, *EXTRA_ARGS_1GPU] if gpus == 1 else list(EXTRA_ARGS)


def mooncake_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("mooncake") is not None


def parse_junit(text: str) -> list[dict[str, Any]]:
    """One entry per test case of a pytest --junitxml file: id, outcome, seconds, first line of the reason."""
    out = []
    for tc in ET.fromstring(text).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "").strip().splitlines()[0][:300] if (
                    el.get("message") or el.text) else ""
                break
        out.append({"id": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                    "seconds": round(float(tc.get("time") or 0), 1), "message": message})
    return out


def test_env(model: Path, gpus: int = 2, backend: str = "p2pnccl") -> dict[str, str]:
    env = {**os.environ, **config.COMMON_ENV, **config.backend_env(backend, gpus, "sglang_tests")}
    env.pop("SGLANG_IS_IN_CI", None)  # in CI mode the fixture forces mooncake + RDMA devices
    env.update(SGLANG_TEST_PD_DISAGG_BACKEND=backend, E2E_TEST_MODEL=str(model),
               E2E_TEST_EXTRA_ARGS=shlex.join(extra_args(gpus)),
               PYTHONPATH=os.pathsep.join([str(SHIMS), env.get("PYTHONPATH", "")]))
    return env


def run_file(path: Path, model: Path, logs: Path, timeout_s: float, gpus: int = 2,
             backend: str = "p2pnccl") -> dict[str, Any]:
    junit = logs / f"{path.stem}.junit.xml"
    log = logs / f"{path.stem}.log"
    cmd = [sys.executable, "-m", "pytest", "-p", "e2e.sglang_pd_plugin", "-p", "no:cacheprovider", "-v",
           "-o", "timeout=0", f"--junitxml={junit}", str(path)]
    t0 = time.monotonic()
    with open(log, "w") as f:
        # SGLang's fixture starts its servers and LB with plain Popen, so they share pytest's process group:
        # one killpg ends them all when the file runs out of time
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=test_env(model, gpus, backend),
                             start_new_session=True)
        record_pid(p.pid)
        try:
            rc: Any = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "timeout"
    entry: dict[str, Any] = {"file": str(path.name), "rc": rc, "seconds": round(time.monotonic() - t0, 1)}
    entry["tests"] = parse_junit(junit.read_text()) if junit.exists() else []
    if not entry["tests"]:
        entry["log_tail"] = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
    return entry


def already_run(previous: dict[str, Any], gpus: int = 2) -> dict[str, dict[str, Any]]:
    """Files an earlier call on this machine (in the same GPU mode) ran to an outcome, by file name."""
    if previous.get("gpus", 2) != gpus:
        return {}
    return {f["file"]: f for f in previous.get("files", []) if any(t["outcome"] in DONE for t in f.get("tests", []))}


def run(sglang_root: Path, model: Path, logs: Path, deadline: float,
        previous: dict[str, Any] | None = None, res: dict[str, Any] | None = None, gpus: int = 2) -> dict[str, Any]:
    """Run the test files that fit before the deadline; files an earlier call already ran keep their result.
    Fills ``res`` in place as it goes (the caller writes it even if the step is stopped)."""
    logs.mkdir(parents=True, exist_ok=True)
    done = already_run(previous or {}, gpus)
    res = {} if res is None else res
    res.update(backend="p2pnccl", model=model.name, extra_server_args=extra_args(gpus), gpus=gpus,
               transport=config.transport_info("p2pnccl", gpus, "sglang_tests"),
               lb="sglang_p2p_lb (as sglang_router.launch_router)", files=[])
    skip_reason = ""
    if gpus == 1:
        res["note"] = config.SINGLE_GPU_NOTE
        if not mooncake_importable():
            skip_reason = ("one GPU: p2pnccl needs its Mooncake transport (NCCL rejects two ranks on one GPU) and "
                           "Mooncake is not importable here (carry .bundle/extras.tar.xz)")
    for rel, expected_s in TEST_FILES:
        left = deadline - time.monotonic()
        path = sglang_root / rel
        if path.name in done:
            res["files"].append(done[path.name])
            continue
        if skip_reason:
            res["files"].append({"file": path.name, "rc": "skipped", "tests": [
                {"id": f"{path.stem}::*", "outcome": "skipped", "seconds": 0, "message": skip_reason}]})
        elif not path.exists():
            res["files"].append({"file": path.name, "rc": "missing", "tests": []})
        elif left < expected_s:
            res["files"].append({"file": path.name, "rc": f"not run: needs ~{expected_s} s, {int(left)} s left "
                                 "(run_all.sh --phase sglang-tests runs it)", "tests": []})
        else:
            res["files"].append(run_file(path, model, logs, left - 10, gpus))
        print(f"sglang test {path.name}: {res['files'][-1]['rc']}", flush=True)
    res["summary"] = summary(res["files"])
    return res


LIVENESS = "sglang/test/manual/disaggregation/test_disaggregation_peer_liveness_abort.py"
REPEATED_TEST = "test_peer_failures_abort_without_hanging"


def repeated_liveness_file(sglang_root: Path, logs: Path, runs: int) -> Path:
    """A test module that runs SGLang's `test_peer_failures_abort_without_hanging` `runs` times against one
    launch of its P/D pair (its class's setUpClass): each run is 36 requests under injected KVPoll.Failed; then
    the file's other class (clean generate and explicit abort by rid) once."""
    path = logs / f"test_liveness_x{runs}.py"
    path.write_text(
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('sglang_liveness', {str(sglang_root / LIVENESS)!r})\n"
        "_m = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_m)\n"
        # no module-level name may hold SGLang's classes: pytest collects every TestCase subclass it finds
        "class TestRepeated(_m.TestDisaggregationPeerLivenessAbort):\n"
        "    pass\n\n\n"
        "class TestCleanRecovery(_m.TestDisaggregationPeerLivenessCleanRecovery):\n"
        "    pass\n\n\n"
        f"for _i in range({runs}):\n"
        f"    setattr(TestRepeated, f'test_run_{{_i:02d}}', _m.TestDisaggregationPeerLivenessAbort.{REPEATED_TEST})\n"
        f"TestRepeated.{REPEATED_TEST} = None  # only the numbered copies run\n"
    )
    return path


def run_repeated(sglang_root: Path, model: Path, logs: Path, deadline: float, runs: int, backend: str,
                 gpus: int) -> dict[str, Any]:
    """Pass rate of the liveness test over `runs` runs for one backend, plus SGLang's chunked-prefill abort test."""
    logs.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"backend": backend, "gpus": gpus, "transport": config.transport_info(backend, gpus, "sglang_tests"),
                           "model": model.name, "extra_server_args": extra_args(gpus), "files": []}
    for path in (repeated_liveness_file(sglang_root, logs, runs), sglang_root / TEST_FILES[0][0]):
        left = deadline - time.monotonic()
        if left < 120:
            res["files"].append({"file": path.name, "rc": f"not run: {int(left)} s left", "tests": []})
            continue
        res["files"].append(run_file(path, model, logs, left - 10, gpus, backend))
        print(f"sglang test {path.name} ({backend}): {res['files'][-1]['rc']}", flush=True)
    runs_done = [t for t in res["files"][0]["tests"] if "test_run_" in t["id"]]
    res["repeated"] = {"test": REPEATED_TEST, "runs": len(runs_done),
                       "passed": sum(t["outcome"] == "passed" for t in runs_done), "asked": runs}
    res["summary"] = summary(res["files"])
    return res


def summary(files: list[dict[str, Any]]) -> dict[str, int]:
    outcomes = [t["outcome"] for f in files for t in f["tests"]]
    return {k: outcomes.count(k) for k in ("passed", "failed", "error", "skipped")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-root", type=Path, required=True, help="folder holding the sglang package")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--logs", type=Path, required=True)
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=None, help="default: E2E_GPUS, else 2")
    ap.add_argument("--repeat", type=int, default=0, help="run the liveness test this many times (pass rate)")
    ap.add_argument("--backend", default="p2pnccl", help="with --repeat: p2pnccl or mooncake")
    a = ap.parse_args(argv)
    if a.repeat:
        exit_on_sigterm()
        res = run_repeated(a.sglang_root, a.model, a.logs, config.deadline_from_env(), a.repeat, a.backend,
                           a.gpus or config.gpus_from_env())
        results.write_json(a.out, res)
        return 0
    previous = json.loads(a.out.read_text()) if a.out.exists() else {}
    exit_on_sigterm()
    res: dict[str, Any] = {}
    try:
        run(a.sglang_root, a.model, a.logs, config.deadline_from_env(), previous, res, a.gpus or config.gpus_from_env())
    finally:
        res["summary"] = summary(res.get("files", []))
        results.write_json(a.out, res)
    missing = any(f["rc"] in ("missing", "skipped") for f in res["files"])  # a skipped file is not a pass
    return 0 if res["summary"]["failed"] == res["summary"]["error"] == 0 and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
