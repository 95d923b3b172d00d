"""Host time of one chunk's fused gather and scatter enqueue, piece by piece, on one GPU.

The NCCL path's per-step trace (xfer_bench `nccl_phases`) showed 0.2-0.36 ms of host time between a send()'s
start and its gather being queued, and as long again on the decode before its scatter's kernel ran, for a
1k-token chunk whose kernel takes ~0.1 ms. This times the pieces of `FusedGather.gather_chunk` one by one
(the page ids to the device, the Triton launch) next to a plain torch launch, and profiles the whole call.

    python bench/transfer/gather_host.py [--tokens 1024] [--reps 200] [--out PATH]

Each repetition waits for the GPU first, so a piece is timed on an idle queue, as a request's first chunk is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: the repository root holds `bench` and `sglang_p2p_backend`
    sys.path.insert(0, _ROOT)

from bench.transfer import xfer_cases as xc  # noqa: E402
from bench.transfer.host_profile import host_profile, render  # noqa: E402

from sglang_p2p_backend.engine.copy.copier import PageCopier  # noqa: E402
from sglang_p2p_backend.engine.copy.plan import plan_chunks  # noqa: E402


def host_us(fn: Callable[[], object], reps: int, sync: bool = True) -> dict:
    """Median and p90 of `fn`'s host time in microseconds, the GPU idle before each call when `sync`."""
    times = []
    for i in range(reps + 3):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        if i >= 3:
            times.append(dt)
    torch.cuda.synchronize()
    a = np.asarray(times) * 1e6
    return {"p50": float(np.median(a)), "p90": float(np.percentile(a, 90))}


def gpu_us(fn: Callable[[], object], reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return float(np.median(out))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gather_host: no CUDA device here: nothing measured (the fused gather is the CUDA path)")
        return 0
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    shape = xc.SHAPES[0]  # mha_p1: 64 regions of 2 KiB a token
    pages = shape.pages(max(xc.TOKENS))
    whole = torch.zeros((shape.regions, 2 * pages, shape.item), dtype=torch.uint8, device=dev)
    views = [whole[r] for r in range(shape.regions)]
    copier = PageCopier([views])
    fused = copier._fused
    case = xc.Case(shape, ns.tokens, "scattered")
    src, _ = xc.page_ids(case, pages, 2 * pages)
    chunks = plan_chunks(copier.item_lens, [len(src)], 256 << 20)
    chunk = chunks[0]
    staging = torch.empty(chunk.nbytes, dtype=torch.uint8, device=dev)
    table = fused.groups[0]
    word = table.word
    stage_words = staging.view(torch.int64)
    dev_ids = fused._ids(table, src, 0, shape.regions)
    small = torch.zeros(16, device=dev)
    pinned = torch.empty(len(src), dtype=torch.int64, pin_memory=True)
    dev_buf = torch.empty(len(src), dtype=torch.int64, device=dev)

    def ids_prealloc():
        pinned.numpy()[:] = src
        dev_buf.copy_(pinned, non_blocking=True)

    readied = copier.prepare_scatter(chunk, [src], staging)
    pieces = {
        "gather_chunk (whole enqueue)": lambda: copier.gather(chunk, [src], staging),
        "scatter_chunk (whole enqueue)": lambda: copier.scatter(chunk, [src], staging),
        # the receiver's split: readied when the receive is posted, launched when the chunk landed
        "  prepare_scatter (at the post)": lambda: copier.prepare_scatter(chunk, [src], staging),
        "  its launch (at landing)": readied,
        "_ids: numpy -> pin_memory() -> device": lambda: fused._ids(table, src, 0, shape.regions),
        "  np.asarray + min/max (range check)": lambda: (lambda p: (p.min(), p.max()))(np.asarray(src, dtype=np.int64)),
        "  torch.from_numpy().pin_memory()": lambda: torch.from_numpy(src).pin_memory(),
        "  pinned.to(device, non_blocking)": lambda: pinned.to(dev, non_blocking=True),
        "ids into preallocated pinned + copy_": ids_prealloc,
        "_launch (Triton, ids on the device)": lambda: fused._launch(table, 0, shape.regions, word, stage_words,
                                                                    dev_ids, len(src), False),
        "torch launch (small add_)": lambda: small.add_(1),
        "torch.cuda.Event() + record": lambda: torch.cuda.Event().record(),
    }
    result = {"machine": torch.cuda.get_device_name(dev), "torch": torch.__version__, "tokens": ns.tokens,
              "chunk_bytes": chunk.nbytes, "host_us": {}, "unsynced_host_us": {}}
    for name, fn in pieces.items():
        result["host_us"][name] = host_us(fn, ns.reps)
        print(f"{name:44s} p50 {result['host_us'][name]['p50']:8.1f} us  p90 {result['host_us'][name]['p90']:8.1f} us")
    for name in ("gather_chunk (whole enqueue)", "_launch (Triton, ids on the device)", "  its launch (at landing)"):
        # back to back, the GPU busy: what a chunk after the first sees
        result["unsynced_host_us"][name] = host_us(pieces[name], ns.reps, sync=False)
        print(f"{name:44s} back to back p50 {result['unsynced_host_us'][name]['p50']:8.1f} us")
    result["gather_gpu_us"] = gpu_us(pieces["gather_chunk (whole enqueue)"])
    print(f"gather kernel + ids on the GPU: {result['gather_gpu_us']:.1f} us for {chunk.nbytes >> 20} MiB")
    prof = host_profile(pieces["gather_chunk (whole enqueue)"], calls=100, top=15)
    result["gather_profile"] = prof
    print("cProfile of gather_chunk, own time per call:")
    print("\n".join(render(prof, limit=15)))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
