"""1P1D transfer demo: a prefill-role and a decode-role process move a realistic KV layout with p2pnccl
through SGLang's own classes, then the decode checks every byte. Prints the rate and the verdict.

Default: DeepSeek-V3's MLA layout (61 layers, 576 bf16 values a token), 4096-token requests, page size 64.
On CPU the pools live in host memory and the `tcp` transport moves them; with two CUDA GPUs the pools go to
cuda:0 (prefill) and cuda:1 (decode) and `auto` picks NCCL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from sglang_p2p_backend.testing.launch import run_pair


def build_plan(ns: argparse.Namespace, gpus: int) -> dict:
    pages_per_req = -(-ns.tokens // ns.page_size)
    pool = {
        "layout": ns.layout,
        "num_layers": ns.layers,
        "head_dim": 576 if ns.layout == "mla" else 128,
        "kv_heads": 8,
        "page_size": ns.page_size,
        "num_pages": pages_per_req * ns.requests + 2,
    }
    plan = {
        "pool": pool,
        "requests": [{"room": 1000 + i, "tokens": ns.tokens, "chunk_pages": ns.chunk_pages} for i in range(ns.requests)],
        "deadline_s": ns.deadline,
    }
    if gpus >= 2:
        plan["pool_overrides"] = {"prefill": {"device": "cuda:0"}, "decode": {"device": "cuda:1"}}
    return plan


def machine(gpus: int) -> dict:
    import os
    import platform
    from importlib import metadata

    import torch

    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "sglang": metadata.version("sglang"), "python": platform.python_version()}
    if gpus:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="p2pnccl 1P1D transfer demo through SGLang's KV manager classes")
    ap.add_argument("--layout", choices=("mla", "mha"), default="mla")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--chunk-pages", type=int, default=1 << 30, help="pages per send() (chunked prefill)")
    ap.add_argument("--deadline", type=float, default=300)
    ap.add_argument("--json", help="also write the results here")
    ns = ap.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = build_plan(ns, gpus)
    where = "cuda:0 -> cuda:1 (NCCL)" if gpus >= 2 else "host memory (tcp transport)"
    print(f"p2pnccl demo: {ns.requests} x {ns.tokens} tokens, {ns.layout.upper()} {ns.layers} layers, page {ns.page_size}, {where}")
    result = run_pair(plan, timeout=ns.deadline + 120)
    p, d = result["prefill"], result["decode"]
    if not p or not d:
        print(f"a role died: exit codes {result['returncodes']}; logs in {result['workdir']}")
        return 1
    ok = True
    times, total, starts, ends = [], 0, [], []
    for room, pr in p["requests"].items():
        dr = d["requests"][room]
        good = pr["status"] == dr["status"] == "Success" and dr.get("num_bad_pages") == 0 and dr.get("aux_room_ok")
        ok &= bool(good)
        if pr["status"] == "Success":
            times.append(pr["transfer_s"])
            total += pr["bytes"]
            starts.append(pr["first_send_at"])
            ends.append(pr["success_at"])
        detail = f"{pr['bytes'] / 2**20:.0f} MiB in {pr['transfer_s'] * 1e3:.1f} ms" if pr["status"] == "Success" else pr.get("reason")
        print(f"  room {room}: prefill {pr['status']}, decode {dr['status']}, bad pages {dr.get('num_bad_pages')}: {detail}")
    ok &= d["untouched_violations"] == []
    if times:
        window = max(ends) - min(starts)
        print(f"rate: {total / window / 1e9:.2f} GB/s ({total / 2**20:.0f} MiB from the first send() to the last "
              f"Success, {window * 1e3:.0f} ms); per request send() -> Success median {statistics.median(times) * 1e3:.1f} ms")
    print("verification:", "every destination page byte-exact, no other page touched" if ok else "FAILED")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"machine": machine(gpus), "argv": sys.argv[1:], "plan": plan, "ok": ok, "result": result}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
