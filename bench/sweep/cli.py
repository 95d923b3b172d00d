"""Command line of the sweep: ``python -m bench.sweep --target URL --tokenizer DIR ...``.

``--launch-sim`` starts simulated prefill/decode workers and the LB on 127.0.0.1 first (CI smoke and demo);
``--replot OUT`` re-reads a finished sweep's raw output (e.g. with other SLOs).  Exit status 2 and one
``error:`` line for anything a person must fix (unreachable target, missing tokenizer, missing tool).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
from contextlib import nullcontext
from pathlib import Path

from .driver import TOOLS, SweepConfig, replot, run_sweep
from .errors import SweepError
from .local_stack import REPO, local_stack
from .preflight import normalize_url
from .scenarios import NAMED, Scenario, parse_concurrency, parse_scenarios
from .slo import Slo


DEFAULT_SCENARIOS = "short,mid,long"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="base URL of the running LB or server, e.g. http://10.0.0.1:8000")
    where.add_argument("--launch-sim", action="store_true",
                       help="start simulated P/D workers + the LB on 127.0.0.1 and sweep them")
    where.add_argument("--replot", type=Path, metavar="OUT", help="rebuild CSV/JSON/plots of a finished sweep")
    ap.add_argument("--tokenizer", help="local folder with the served model's tokenizer; 'local' builds a small "
                    "offline one (default with --launch-sim)")
    ap.add_argument("--scenarios",
                    help=f"comma list of {', '.join(f'{k}={v.genai_bench_spec}' for k, v in NAMED.items())} "
                    f"or NAME=D(in,out) (default: {DEFAULT_SCENARIOS}; with --replot: the sweep's own)")
    ap.add_argument("--concurrency", default="1-256", help="e.g. 1,2,4 or the power-of-two range 1-256 (default)")
    ap.add_argument("--tool", choices=[*TOOLS, "both"], default="both")
    ap.add_argument("--model", help="model name sent in requests (default: first id of the target's /v1/models)")
    ap.add_argument("--requests-per-user", type=int, default=4,
                    help="requests per run = max(--min-requests, this x concurrency) (default: %(default)s)")
    ap.add_argument("--min-requests", type=int, default=16, help="(default: %(default)s)")
    ap.add_argument("--max-minutes-per-run", type=int, default=10, help="genai-bench's time cap per run")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT SLO in seconds (default: %(default)s)")
    ap.add_argument("--slo-itl-ms", type=float, default=50.0, help="ITL SLO in ms (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="output folder (default: bench/results/sweep_<UTC time>)")
    ap.add_argument("--tools-bin", type=Path, default=REPO / ".venv-bench" / "bin",
                    help="folder with genai-bench and evalscope (default: %(default)s, then PATH)")
    ap.add_argument("--genai-bench-args", default="", help="extra arguments for genai-bench benchmark")
    ap.add_argument("--evalscope-args", default="", help="extra arguments for evalscope perf")
    ap.add_argument("--sim-args", default="", help="extra flags for both simulated workers (--launch-sim)")
    ap.add_argument("--dry-run", action="store_true", help="print the tool command lines, send nothing")
    return ap


def scenarios_of(out: Path) -> list[Scenario]:
    """The scenarios a finished sweep recorded in its sweep.json (names genai-bench's output lacks)."""
    try:
        meta = json.loads((out / "sweep.json").read_text())["meta"]
        return [Scenario(**s) for s in meta["scenarios"]]
    except (OSError, KeyError, TypeError, ValueError):
        raise SweepError(f"{out / 'sweep.json'} has no scenario list: pass --scenarios as in the sweep") from None


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        slo = Slo(ttft_s=a.slo_ttft_s, itl_s=a.slo_itl_ms / 1e3)
        if a.replot:
            scenarios = parse_scenarios(a.scenarios) if a.scenarios else scenarios_of(a.replot)
            for p in replot(a.replot, scenarios, slo):
                print(p)
            return 0
        out = a.out or REPO / "bench" / "results" / f"sweep_{dt.datetime.now(dt.timezone.utc):%Y%m%d_%H%M%S}"
        cfg = SweepConfig(
            target="", out=out, tokenizer=a.tokenizer or ("local" if a.launch_sim else None),
            scenarios=parse_scenarios(a.scenarios or DEFAULT_SCENARIOS), concurrency=parse_concurrency(a.concurrency),
            tools=list(TOOLS) if a.tool == "both" else [a.tool], model=a.model,
            api_key=os.environ.get("OPENAI_API_KEY") or "dummy",
            requests_per_user=a.requests_per_user, min_requests=a.min_requests,
            max_minutes_per_run=a.max_minutes_per_run, slo=slo, tools_bin=a.tools_bin,
            genai_bench_args=a.genai_bench_args, evalscope_args=a.evalscope_args, dry_run=a.dry_run,
            command=shlex.join(["python -m bench.sweep", *(sys.argv[1:] if argv is None else argv)]),
        )
        stack = (local_stack(out / "logs" / "stack", sim_args=a.sim_args.split())
                 if a.launch_sim and not a.dry_run else nullcontext("http://127.0.0.1:0"))
        with stack as url:
            cfg.target = normalize_url(url if a.launch_sim else a.target)
            paths = run_sweep(cfg)
    except (SweepError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0
