"""The full PD path over each CPU transport: SGLang's KV manager classes in a prefill and a decode process
(`testing.launch.run_pair`, the PD suite's driver), the same plan over the two-sided `tcp` transport and over
Mooncake's one-sided `tcp` protocol, every destination page checked byte for byte.

`python -m bench.mooncake.pd_path [--machine NAME] [--repeats N]` writes bench/results/mooncake_pd_<machine>.json.
Per run: the rate from the first `send()` to the last Success and each request's `send()` -> Success time.
The plan matches the demo's default (sglang_p2p_backend/demo.py): DeepSeek-V3 MLA (61 layers, 1152 B a
token), page 64, 4 requests of 4096 tokens, pages scattered at random on both sides; once in one `send()` per
request and once chunked (8 pages a send, as chunked prefill does). Figures hold only for the machine named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
from pathlib import Path

from sglang_p2p_backend.testing.launch import run_pair

from .__main__ import RESULTS, machine_info

TRANSPORT_ENV = {
    "tcp": {"SGLANG_P2P_TRANSPORT": "tcp"},
    "mooncake": {"SGLANG_P2P_TRANSPORT": "mooncake", "MC_FORCE_TCP": "1", "GLOG_minloglevel": "2"},
}


REQUESTS, TOKENS, PAGE = 4, 4096, 64


def plan_for(chunk_pages: int) -> dict:
    pages = -(-TOKENS // PAGE)
    return {
        "pool": {"layout": "mla", "num_layers": 61, "head_dim": 576, "page_size": PAGE, "num_pages": pages * REQUESTS + 2},
        "requests": [{"room": 1000 + i, "tokens": TOKENS, "chunk_pages": chunk_pages} for i in range(REQUESTS)],
        "deadline_s": 300,
    }


def summarise(result: dict) -> dict:
    p, d = result["prefill"], result["decode"]
    if not p or not d:
        return {"ok": False, "error": f"a role died: {result['returncodes']} (logs in {result['workdir']})"}
    ok = d["untouched_violations"] == []
    times, starts, ends, total = [], [], [], 0
    for room, pr in p["requests"].items():
        dr = d["requests"][room]
        ok &= pr["status"] == dr["status"] == "Success" and dr.get("num_bad_pages") == 0 and bool(dr.get("aux_room_ok"))
        if pr["status"] == "Success":
            times.append(pr["transfer_s"])
            starts.append(pr["first_send_at"])
            ends.append(pr["success_at"])
            total += pr["bytes"]
    if not times:
        return {"ok": False, "error": "no request succeeded"}
    window = max(ends) - min(starts)
    return {
        "ok": bool(ok),
        "bytes": total,
        "window_ms": round(window * 1e3, 1),
        "GBps": round(total / window / 1e9, 3),
        "request_ms": [round(t * 1e3, 1) for t in times],
        "request_ms_median": round(statistics.median(times) * 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = args.machine or socket.gethostname()
    load_before = os.getloadavg()
    rows = []
    for chunk_pages in (1 << 30, 8):
        plan = plan_for(chunk_pages)
        for rep in range(args.repeats):
            for name, env in TRANSPORT_ENV.items():
                row = {"transport": name, "chunk_pages": chunk_pages, "repeat": rep, **summarise(run_pair(plan, timeout=420, env=env))}
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {
        "bench": "PD path (SGLang KV manager classes, two processes) per CPU transport",
        "machine": machine_info(machine),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "plan": {"pool": plan_for(1)["pool"], "requests": REQUESTS, "tokens": TOKENS, "chunk_pages": [1 << 30, 8]},
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "results": rows,
    }
    out = Path(args.out) if args.out else RESULTS / f"mooncake_pd_{machine}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
