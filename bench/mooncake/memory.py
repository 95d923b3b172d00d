"""Memory per peer of the two transports: NCCL pair communicators against Mooncake one-sided writes.

`python -m bench.mooncake.memory [--peers 8] [--machine NAME]` writes bench/results/mooncake_memory_per_peer.json.

- NCCL: GPU memory of one extra 2-rank communicator by channel cap, as measured on two H200s (docs/nccl.md,
  `comm_pool.ANCHOR_COST`), plus the one-off cost of the first communicator in a process; multiplied out for
  the fan-outs a GPU sees (96P144D: a prefill GPU pairs with up to 144 decode GPUs, a decode GPU with 96).
- Mooncake: no GPU memory per peer. It writes from and into the KV pool SGLang already allocated, which is
  registered once per process (a memory registration pins pages and takes NIC translation entries; it
  allocates no GPU memory) whatever the number of peers. What a peer does cost is host memory (Mooncake's
  connection state: a TCP socket, or RDMA queue pairs, and segment metadata); this script measures that
  here: this process's RSS as it writes to 1, 2, ..., N decode processes over Mooncake `tcp`. RDMA's
  per-peer state is host memory too (QPs, completion queues); its size is not measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import socket
import statistics
from pathlib import Path

import numpy as np

from sglang_p2p_backend.engine.pair.comm_pool import ANCHOR_COST
from sglang_p2p_backend.engine.transport.mooncake import MooncakeTransport

from .__main__ import RESULTS, machine_info
from .cases import Layout
from .run import decode_peer

#: docs/nccl.md: "The first communicator in a process costs ~440-680 MB more (context, NCCL init)"
FIRST_COMM_EXTRA_MB = (440, 680)
FAN_OUTS = (1, 8, 16, 48, 96, 144)
#: a tiny pool is enough: the per-peer cost does not depend on the pool (registered once, up front)
PROBE = Layout("probe", 1, 4096)
PROBE_TOKENS = 64


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def mooncake_host_mb_per_peer(peers: int, host: str) -> dict:
    """RSS of a writer as each new decode peer receives its first (and a second) batch write."""
    region = PROBE_TOKENS * PROBE.bytes_per_token
    src = np.random.default_rng(0).integers(0, 256, region, dtype=np.uint8)
    rss = []
    with MooncakeTransport("tcp", host) as t, contextlib.ExitStack() as stack:
        t.register([(src.ctypes.data, region)])
        # warm the engine's own first-use allocations on one peer that is not counted
        warm, warm_side = stack.enter_context(decode_peer(PROBE, region, "tcp", host, ""))
        t.write(warm, [src.ctypes.data], [warm_side.bases[0]], [region])
        rss.append(rss_mb())
        for _ in range(peers):
            session, side = stack.enter_context(decode_peer(PROBE, region, "tcp", host, ""))
            for _ in range(2):
                t.write(session, [src.ctypes.data], [side.bases[0]], [region])
            if not np.array_equal(np.asarray(side.view[0]), src):
                raise AssertionError(f"peer {session}: the probe write did not land byte for byte")
            rss.append(rss_mb())
    deltas = [b - a for a, b in zip(rss, rss[1:])]
    return {
        "protocol": "tcp",
        "peers": peers,
        "rss_mb_after_each_peer": [round(x, 2) for x in rss],
        "mb_per_peer_median": round(statistics.median(deltas), 3),
        "mb_per_peer_mean": round((rss[-1] - rss[0]) / peers, 3),
    }


def nccl_table() -> dict:
    caps = sorted(ANCHOR_COST.mb, key=lambda c: -(c if c is not None else 1 << 30))
    return {
        "source": "docs/nccl.md: nvidia-h200-x2, NCCL 2.28.9, nvidia-smi after the first send; comm_pool.ANCHOR_COST",
        "gpu_mb_per_communicator": {_cap(c): ANCHOR_COST.mb[c] for c in caps},
        "send_recv_GBps": {_cap(c): ANCHOR_COST.gbps[c] for c in caps},
        "first_communicator_extra_mb": list(FIRST_COMM_EXTRA_MB),
    }


def _cap(c) -> str:
    return "default" if c is None else f"{c} channels"


def fan_out(nccl: dict, mooncake_host: dict) -> list[dict]:
    rows = []
    for n in FAN_OUTS:
        rows.append({
            "peers_per_gpu": n,
            "nccl_gpu_gb": {cap: round(n * mb / 1024, 2) for cap, mb in nccl["gpu_mb_per_communicator"].items()},
            "mooncake_gpu_gb": 0.0,
            "mooncake_host_mb_tcp": round(n * max(mooncake_host["mb_per_peer_median"], 0.0), 1),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=8, help="decode processes to measure Mooncake's per-peer cost with")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nccl = nccl_table()
    mooncake = mooncake_host_mb_per_peer(args.peers, args.host)
    result = {
        "bench": "memory per peer: NCCL pair communicators vs Mooncake one-sided writes",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine_for_mooncake_figures": machine_info(args.machine or socket.gethostname()),
        "nccl": nccl,
        "mooncake": {
            "gpu_mb_per_peer": 0.0,
            "why": "one-sided writes from the registered KV pool into the peer's registered KV pool: no staging, "
                   "no communicator; registration is once per process, not per peer, and allocates no GPU memory",
            "host_measured": mooncake,
        },
        "fan_out": fan_out(nccl, mooncake),
    }
    out = Path(args.out) if args.out else RESULTS / "mooncake_memory_per_peer.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["fan_out"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
