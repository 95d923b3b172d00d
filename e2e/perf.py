"""Timing step: the same workload through p2pnccl and Mooncake PD pairs, at concurrency 1, 16 and 64.

    python3 -m e2e.perf --models DIR --out results.json --logs DIR [--backends p2pnccl,mooncake]
                        [--genai-bench-bin DIR]

Model: ``llama-anchor`` (32 layers, 128 KiB of KV per token), the shape of the usual
Mooncake PD baseline (a Llama-3-8B), so the figures can be set beside published ones. Both pairs run at once (prefill on
GPU 0, decode on GPU 1, one LB each) and are loaded one after the other. Per run: TTFT p50/p99 seen by the
client (streaming ``/generate`` through the LB), output tokens per second, and the prefill's mean KV transfer
time per request, read from SGLang's ``sglang:kv_transfer_latency_ms`` histogram before and after the run.
Then, if genai-bench is there, a genai-bench sweep through each LB (``python -m bench.sweep``).

``--gpus 1`` (run_all.sh --gpus 1): every server on GPU 0, both backends on Mooncake tcp (config.py says why),
and the pairs one after the other, each alone on the GPU (two pairs' KV pools do not fit one GPU). A backend
an earlier call on this machine measured to the end (same flags) keeps its result, so when one call has no
time left for the second pair, ``run_all.sh --gpus 1 --phase perf`` again measures only that one.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import client, config, promparse, results, stats
from .servers import Server, Stack, exit_on_sigterm, failure_report

MODEL = "llama-anchor"
BASE_PORT = {"p2pnccl": 32000, "mooncake": 32100}
PROMPT_TOKENS = (1024, 4096)
CONCURRENCY = (1, 16, 64)
OUTPUT_TOKENS = 32
GENAI_SCENARIO = "e2e=D(1024,32)"
PAIR_RESERVE_S = 240  # single GPU: what one more pair needs to start (~100 s) and run its load (a guess)


def requests_for(concurrency: int) -> int:
    """At least 16 requests, and 2 per user at high concurrency, so p99 has something to stand on."""
    return max(16, 2 * concurrency)


def scrape(url: str) -> Optional[promparse.HistogramTotals]:
    text = promparse.fetch(url)
    return None if text is None else promparse.histogram_totals(text, promparse.KV_TRANSFER_LATENCY)


def load_runs(backend: str, prefill: Server, lb: Server, deadline: float,
              sink: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """One row per (prompt length, concurrency); each row also goes to ``sink`` as soon as it is measured."""
    rows: list[dict[str, Any]] = []
    sink = [] if sink is None else sink
    # warm-up: first requests pay for NCCL communicator / Mooncake connection setup and Triton compiles
    asyncio.run(client.closed_loop(lb.url, client.random_prompts(4, 512, seed=99), 2, 4))
    for plen in PROMPT_TOKENS:
        for c in CONCURRENCY:
            if time.monotonic() > deadline:
                rows.append({"backend": backend, "prompt_tokens": plen, "concurrency": c, "skipped": "deadline"})
                sink.append(rows[-1])
                continue
            prompts = client.random_prompts(requests_for(c), plen, seed=1000 * plen + c)
            before = scrape(prefill.url)
            records, wall = asyncio.run(client.closed_loop(lb.url, prompts, c, OUTPUT_TOKENS))
            after = scrape(prefill.url)
            row = {"backend": backend, "prompt_tokens": plen, "output_tokens": OUTPUT_TOKENS, "concurrency": c,
                   **stats.summarize_run(records, wall),
                   "kv_transfer_ms_mean": _round(promparse.mean_between(before, after))}
            rows.append(row)
            sink.append(row)
            print(f"perf {backend} in={plen} c={c}: ttft p50 {row['ttft_ms_p50']} p99 {row['ttft_ms_p99']} ms, "
                  f"kv {row['kv_transfer_ms_mean']} ms, {row['output_throughput']} tok/s, "
                  f"failed {row['num_failed']}", flush=True)
    return rows


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def genai_bench(backend: str, lb: Server, models_dir: Path, tools_bin: Path, out: Path,
                timeout_s: float) -> dict[str, Any]:
    """bench.sweep with genai-bench only, through the LB; its rows (sweep.json) or the reason there are none."""
    cmd = [sys.executable, "-m", "bench.sweep", "--target", lb.url, "--tokenizer", str(models_dir / MODEL),
           "--model", MODEL, "--tool", "genai-bench", "--scenarios", GENAI_SCENARIO,
           "--concurrency", ",".join(map(str, CONCURRENCY)), "--requests-per-user", "1", "--min-requests", "16",
           "--max-minutes-per-run", "2", "--tools-bin", str(tools_bin), "--out", str(out)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "command": " ".join(cmd)}
    if p.returncode != 0:
        return {"status": "failed", "command": " ".join(cmd), "stderr": p.stderr[-2000:]}
    doc = json.loads((out / "sweep.json").read_text())
    return {"status": "ok", "rows": doc.get("rows", doc)}


def done_backends(previous: dict[str, Any], flags: list[str]) -> dict[str, dict[str, Any]]:
    """Single-GPU mode: backends an earlier call measured to the end with the same flags (status ok, every
    load run done), with their rows, so a later call need not measure them again."""
    if previous.get("gpus") != 1 or previous.get("flags") != flags:
        return {}
    out = {}
    for b, status in previous.get("backends", {}).items():
        runs = [r for r in previous.get("runs", []) if r.get("backend") == b]
        if status.get("status") == "ok" and runs and not any("skipped" in r for r in runs):
            gb = previous.get("genai_bench", {})
            out[b] = {"status": status, "runs": runs, "genai_bench": gb.get(b) if isinstance(gb.get(b), dict) else None}
    return out


def run(models_dir: Path, logs: Path, backends: list[str], tools_bin: Optional[Path], deadline: float,
        res: Optional[dict[str, Any]] = None, gpus: int = 2,
        previous: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Fills ``res`` in place as it goes (the caller writes it even if the step is stopped)."""
    res = {} if res is None else res
    flags = config.perf_flags(gpus, config.gpu_mem_mib() if gpus == 1 else None)
    res.update(model=MODEL, flags=flags, gpus=gpus, transports={b: config.transport_info(b, gpus, "perf") for b in backends},
               prompt_tokens=list(PROMPT_TOKENS), output_tokens=OUTPUT_TOKENS, concurrency=list(CONCURRENCY),
               backends={}, runs=[], genai_bench={}, launch_s=0.0)
    if not (tools_bin and (tools_bin / "genai-bench").exists()):
        res["genai_bench"] = {"status": "skipped", "reason": f"no genai-bench under {tools_bin}"}
        tools_bin = None
    pairs = {b: config.pd_pair(MODEL, models_dir / MODEL, b, BASE_PORT[b], flags, gpus, "perf") for b in backends}
    groups = [list(backends)]
    if gpus == 1:
        res["note"] = f"{config.SINGLE_GPU_NOTE}; the two PD pairs ran one after the other, each alone on the GPU"
        kept = done_backends(previous or {}, flags)
        for b in backends:
            if b in kept:
                res["backends"][b] = {**kept[b]["status"], "from_earlier_call": True}
                res["runs"] += kept[b]["runs"]
                if tools_bin and kept[b]["genai_bench"] is not None:
                    res["genai_bench"][b] = kept[b]["genai_bench"]
        groups = [[b] for b in backends if b not in kept]
    for i, group in enumerate(groups):
        if deadline - time.monotonic() < 120:  # not even a launch fits: say so, a later call measures it
            for b in group:
                res["backends"][b] = {"status": "not_run", "reason": "no time left in this call; "
                                      "run_all.sh --gpus 1 --phase perf again measures it"}
            continue
        # genai-bench of an earlier pair leaves the later pairs time to start and run their load
        measure(group, pairs, models_dir, logs, tools_bin, deadline, res,
                genai_reserve_s=PAIR_RESERVE_S * (len(groups) - 1 - i))
    return res


def measure(backends: list[str], pairs: dict[str, tuple[Server, Server, Server]], models_dir: Path, logs: Path,
            tools_bin: Optional[Path], deadline: float, res: dict[str, Any], genai_reserve_s: float = 0.0) -> None:
    """Start the pairs of ``backends`` together, load each through its LB, then genai-bench; stop them."""
    with Stack(logs) as stack:
        t0 = time.monotonic()
        stack.launch([s for b in backends for s in pairs[b][:2]])
        res["launch_s"] = round(res.get("launch_s", 0.0) + time.monotonic() - t0, 1)
        ready = {}
        for b in backends:
            p, d, lb = pairs[b]
            failed = failure_report([p, d])
            if not failed and not stack.launch_lb(lb):
                failed = failure_report([lb]) or {lb.name: lb.log_tail()}
            res["backends"][b] = {"status": "failed", "errors": failed} if failed else {"status": "ok"}
            if not failed:
                ready[b] = (p, lb)
        for b, (p, lb) in ready.items():
            load_runs(b, p, lb, deadline, sink=res["runs"])
        if tools_bin:
            for b, (_, lb) in ready.items():
                left = deadline - genai_reserve_s - time.monotonic()
                if left < 60:
                    res["genai_bench"][b] = {"status": "skipped", "reason": "deadline"}
                    continue
                res["genai_bench"][b] = genai_bench(b, lb, models_dir, tools_bin, logs / f"genai-bench-{b}", left)


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--backends", default="p2pnccl,mooncake")
    ap.add_argument("--genai-bench-bin", type=Path, help="folder with a genai-bench executable")
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=None, help="default: E2E_GPUS, else 2")
    a = ap.parse_args(argv)
    gpus = a.gpus or config.gpus_from_env()
    previous: dict[str, Any] = {}
    if gpus == 1 and a.out.exists():
        try:
            previous = json.loads(a.out.read_text())
        except ValueError:
            previous = {}
    exit_on_sigterm()
    res: dict[str, Any] = {}
    try:
        run(a.models, a.logs, a.backends.split(","), a.genai_bench_bin, config.deadline_from_env(), res, gpus, previous)
    finally:
        results.write_json(a.out, res)
    return 0 if all(v.get("status") == "ok" for v in res["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
