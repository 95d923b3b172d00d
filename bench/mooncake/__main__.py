"""CLI of the Mooncake microbenchmark: `python -m bench.mooncake [--protocol tcp] [--machine NAME]`.

Prints one JSON line per case and writes bench/results/mooncake_<protocol>_<machine>.json naming the machine,
the Mooncake build and the settings. Figures hold only for the machine named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
from importlib import metadata
from pathlib import Path

from .cases import LAYOUTS, MODES, cases, pool_tokens
from .run import run_layout

RESULTS = Path(__file__).resolve().parent.parent / "results"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def machine_info(name: str) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem_kb = next((int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    dists = [d for d in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")
             if _version(d)]
    return {
        "name": name, "hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
        "mem_gib": round(mem_kb / 2**20, 1), "kernel": platform.release(), "python": platform.python_version(),
        "mooncake": {d: _version(d) for d in dists},
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp")
    ap.add_argument("--host", default="127.0.0.1", help="address both engines bind (loopback for tcp on one machine)")
    ap.add_argument("--ib-device", default="", help="RDMA devices, as SGLang's --disaggregation-ib-device")
    ap.add_argument("--layouts", default="mla,mha")
    ap.add_argument("--page-sizes", type=ints, default=[1, 16, 64])
    ap.add_argument("--tokens", type=ints, default=[128, 1024, 4096])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-descriptors", type=int, default=70000, help="skip cases with more (tcp: ~40 us each)")
    ap.add_argument("--timeout", type=int, default=60, help="Mooncake transfer timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--machine", default=None, help="name of this machine in the results (default: hostname)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/mooncake_<protocol>_<machine>.json)")
    args = ap.parse_args()

    machine = args.machine or socket.gethostname()
    layouts = [x for x in args.layouts.split(",") if x]
    modes = [x for x in args.modes.split(",") if x]
    tokens = pool_tokens(max(args.tokens), max(args.page_sizes))
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()  # other work on a shared machine shows up here and in the spread of times_ms
    rows = []
    for name in layouts:
        rows += run_layout(LAYOUTS[name], cases([name], args.page_sizes, args.tokens, modes), tokens, args)
    result = {
        "bench": "mooncake page-run batch writes, prefill process -> decode process",
        "machine": machine_info(machine),
        "protocol": args.protocol,
        "date": started.isoformat(timespec="seconds"),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)} | {"pool_tokens": tokens},
        "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "results": rows,
    }
    out = Path(args.out) if args.out else RESULTS / f"mooncake_{args.protocol}_{machine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
