"""Bytes/s of MHA transfers with different attention TP against equal TP, over the tcp transport on CPU.

`python -m bench.hetero_tp [--out bench/results/hetero_tp_tcp_cpu-2core-dev.json]`

The engine's own two-sided path (`PairSender` -> tcp -> `PairReceiver`, staging, copier, chunk checks), one
process, a thread per receiver; the control channel is a direct in-order hand-off of the engine's messages.
A Llama-3-8B-like pool slice (K and V of 8 layers, 8 KV heads x 128 bf16, page size 16) moves the same
request's KV three ways: TP 1 -> 1 (whole pages), TP 1 -> 2 (one prefill rank sends each of two decode ranks
its 4 heads) and TP 2 -> 1 (two prefill ranks each write their 4 heads into one decode rank's rows). The same
KV bytes cross in every case; what is reported per case: bytes/s, number of chunk messages and their mean
size (head slices are packed into the same large chunks, not sent per page or per head), and that every
decode page holds exactly the expected heads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time

import numpy as np
import torch

from sglang_p2p_backend.engine.wire.checks import chunk_layout
from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.copy.heads import heads_per_rank, pair_heads
from sglang_p2p_backend.engine.copy.memory import Region, page_views
from sglang_p2p_backend.engine.wire.messages import ChunkHeader
from sglang_p2p_backend.engine.pair.pipeline import PairReceiver, PairSender
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.transport.tcp import TcpTransport

LAYERS, HEADS, HEAD_BYTES, PAGE = 8, 8, 128 * 2, 16
SLOT = 4 << 20
CPU = torch.device("cpu")


def model_kv(pages: int) -> list[torch.Tensor]:
    """Every head of every region: (pages, page rows, heads, head bytes)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (pages, PAGE, HEADS, HEAD_BYTES), dtype=torch.uint8, generator=g) for _ in range(2 * LAYERS)]


def rank_pool(kv: list[torch.Tensor], tp: int, rank: int, fill: bool) -> list[torch.Tensor]:
    n = heads_per_rank(HEADS, tp)
    if fill:
        return [t[:, :, rank * n : (rank + 1) * n].reshape(t.shape[0], -1).clone() for t in kv]
    return [torch.full((kv[0].shape[0], PAGE * n * HEAD_BYTES), 0xA5, dtype=torch.uint8) for _ in kv]


def views(pool: list[torch.Tensor]):
    return [page_views([Region(t.data_ptr(), t.numel(), t.shape[1]) for t in pool], CPU)]


def run_case(src_tp: int, dst_tp: int, pages: int, kv: list[torch.Tensor], transport: TcpTransport) -> dict:
    src_pools = [rank_pool(kv, src_tp, p, True) for p in range(src_tp)]
    dst_pools = [rank_pool(kv, dst_tp, d, False) for d in range(dst_tp)]
    rng = np.random.default_rng(0)
    src_ids = rng.permutation(pages).astype(np.int32)
    dst_ids = rng.permutation(pages).astype(np.int32)
    chunks: list[int] = []
    pairs = []
    for d in range(dst_tp):
        for p in range(src_tp):
            if (src_tp >= dst_tp and p // (src_tp // dst_tp) != d) or (src_tp < dst_tp and d // (dst_tp // src_tp) != p):
                continue
            ph = pair_heads(total=HEADS, page_size=PAGE, src_tp=src_tp, src_rank=p, dst_tp=dst_tp, dst_rank=d)
            landed = threading.Event()
            copier = PageCopier(views(dst_pools[d]))
            kv_heads = ph.dst if ph is not None else None

            def check(h: ChunkHeader, copier=copier, kv_heads=kv_heads):
                chunks.append(h.nbytes)
                return chunk_layout(h, copier.item_lens, SLOT, kv_heads=kv_heads)

            receiver = PairReceiver(
                transport=transport, staging=StagingPool(transport.alloc_staging, SLOT, 2), copier=copier,
                peer_session=f"prefill:{p}", wanted=lambda room: True, on_chunk=lambda *a: None,
                connect_timeout=10, io_timeout=30, check=check)
            sender = PairSender(
                transport=transport, staging=StagingPool(transport.alloc_staging, SLOT, 2),
                copier=PageCopier(views(src_pools[p])), local_session=f"prefill:{p}", control=receiver.submit,
                connect_timeout=10, io_timeout=30)
            pairs.append((sender, receiver, ph, landed))
    # channels up before the clock starts (a pair channel lives across requests)
    for sender, receiver, ph, landed in pairs:
        sender.open()
    start = time.perf_counter()
    threads = [threading.Thread(target=s.send, args=(1, 0, [src_ids], [dst_ids]), kwargs={"heads": ph}) for s, _, ph, _ in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, receiver, _, landed in pairs:
        receiver.submit(landed.set)
    for *_, landed in pairs:
        landed.wait(60)
    seconds = time.perf_counter() - start
    for sender, receiver, *_ in pairs:
        sender.close()
        receiver.close()
    exact = True
    n = heads_per_rank(HEADS, dst_tp)
    for d, pool in enumerate(dst_pools):
        for r, t in enumerate(pool):
            want = kv[r][torch.from_numpy(src_ids.astype(np.int64)), :, d * n : (d + 1) * n].reshape(pages, -1)
            exact &= torch.equal(t[torch.from_numpy(dst_ids.astype(np.int64))], want)
    nbytes = sum(chunks)
    return {"prefill_tp": src_tp, "decode_tp": dst_tp, "pages": pages, "bytes": nbytes, "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9, "chunks": len(chunks), "mean_chunk_mb": nbytes / len(chunks) / 2**20,
            "byte_exact": bool(exact)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=160, help="pages of the request (each 16 x 8 x 256 B per region)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="bench/results/hetero_tp_tcp_cpu-2core-dev.json")
    ap.add_argument("--machine", default="developer VM, 2 CPU cores")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    kv = model_kv(ns.pages)
    transport = TcpTransport(io_timeout=30)
    rows = []
    try:
        for src_tp, dst_tp in [(1, 1), (1, 2), (2, 1)]:
            runs = [run_case(src_tp, dst_tp, ns.pages, kv, transport) for _ in range(ns.repeat)]
            best = dict(runs[0])
            best["gb_per_s_median"] = statistics.median(r["gb_per_s"] for r in runs)
            best["gb_per_s_runs"] = [round(r["gb_per_s"], 3) for r in runs]
            best["byte_exact"] = all(r["byte_exact"] for r in runs)
            del best["seconds"], best["gb_per_s"]
            rows.append(best)
            print(f"TP {src_tp} -> {dst_tp}: {best['bytes'] / 2**20:.0f} MiB in {best['chunks']} chunks of "
                  f"{best['mean_chunk_mb']:.2f} MiB, median {best['gb_per_s_median']:.2f} GB/s over {ns.repeat} runs "
                  f"({best['gb_per_s_runs']}), byte-exact: {best['byte_exact']}", flush=True)
    finally:
        transport.close()
    out = {"bench": "hetero_tp", "transport": "tcp (loopback, one process)", "machine": ns.machine,
           "host": platform.node(), "cpus": os.cpu_count(), "load_average_1m_at_end": os.getloadavg()[0],
           "pool": {"layers": LAYERS, "kv_heads": HEADS, "head_bytes": HEAD_BYTES, "page_size": PAGE,
                    "staging_slot_bytes": SLOT},
           "note": "same KV bytes in every case; each decode rank checked byte for byte against its heads",
           "cases": rows}
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
