"""The full PD path over each CPU transport: SGLang's KV manager classes in a prefill and a decode process
(`testing.launch.run_pair`, the PD suite's driver), the same plan over the two-sided `tcp` transport and over
Mooncake's one-sided `tcp` protocol, every destination page checked byte for byte.

`python -m bench.mooncake.pd_path [--machine NAME] [--repeats N] [--device cuda:0]` writes
bench/results/mooncake_pd_<machine>.json (or --out). `--device cuda:N` puts both roles' pools on that GPU and runs
only the `mooncake` case (the CUDA build of Mooncake copies GPU memory through host buffers over tcp; the `tcp`
two-sided transport moves host buffers only); the results name the device. On CPU the roles see no GPU
(CUDA_VISIBLE_DEVICES=""), because on a GPU host the plugin would take host pools for GPU ones.
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


def plan_for(chunk_pages: int, device: str = "cpu") -> dict:
    pages = -(-TOKENS // PAGE)
    return {
        "pool": {"layout": "mla", "num_layers": 61, "head_dim": 576, "page_size": PAGE, "num_pages": pages * REQUESTS + 2,
                 "device": device},
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


def transports_for(device: str) -> dict[str, dict[str, str]]:
    """The cases one device runs, with each case's environment for both roles."""
    if device == "cpu":
        return {name: {**env, "CUDA_VISIBLE_DEVICES": ""} for name, env in TRANSPORT_ENV.items()}
    if not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    return {"mooncake": dict(TRANSPORT_ENV["mooncake"])}


def device_info(device: str) -> dict:
    """The pools' device as the results name it (GPU model and memory from torch on CUDA)."""
    info: dict = {"pools": device}
    if device.startswith("cuda"):
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda,
                    protocol="Mooncake tcp (GPU memory staged through host buffers)")
        try:
            props = torch.cuda.get_device_properties(torch.device(device).index or 0)
            info.update(name=props.name, total_mib=props.total_memory // 2**20)
        except (AssertionError, RuntimeError) as e:  # no usable GPU here: the rows say why the roles died
            info["error"] = str(e)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="pools of both roles: cpu (default) or cuda:N (mooncake case only)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default=None, help="keep each pair's plan, results and role logs under this folder")
    ap.add_argument("--timeout", type=float, default=420, help="seconds one pair may take")
    args = ap.parse_args(argv)
    machine = args.machine or socket.gethostname()
    cases = transports_for(args.device)
    out = Path(args.out) if args.out else RESULTS / f"mooncake_pd_{machine}.json"
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    rows: list[dict] = []
    for chunk_pages in (1 << 30, 8):
        plan = plan_for(chunk_pages, args.device)
        for rep in range(args.repeats):
            for name, env in cases.items():
                workdir = None
                if args.logs:
                    workdir = os.path.join(args.logs, f"{name}-chunk{min(chunk_pages, 9999)}-rep{rep}")
                    os.makedirs(workdir, exist_ok=True)
                row = {"transport": name, "device": args.device, "chunk_pages": chunk_pages, "repeat": rep,
                       **summarise(run_pair(plan, timeout=args.timeout, env=env, workdir=workdir))}
                print(json.dumps(row), flush=True)
                rows.append(row)
                write(out, machine, args.device, cases, started, load_before, rows)  # a killed run keeps what it measured
    print(f"wrote {out}")
    return 0 if rows and all(r.get("ok") for r in rows) else 1  # a failed pair fails the run (run_all.sh step)


def write(out: Path, machine: str, device: str, cases: dict, started: str, load_before: tuple, rows: list[dict]) -> None:
    where = "CPU transport" if device == "cpu" else f"transport, pools on {device}"
    result = {
        "bench": f"PD path (SGLang KV manager classes, two processes) per {where}",
        "machine": machine_info(machine),
        "device": device_info(device),
        "date": started,
        "plan": {"pool": plan_for(1, device)["pool"], "requests": REQUESTS, "tokens": TOKENS,
                 "chunk_pages": [1 << 30, 8], "transports": list(cases)},
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
