"""Host time of one post on a pair channel (`NcclPairComm.send` / `recv`, as deployed) against NCCL's own call.

The NCCL path's trace (docs/nccl.md) put ~90 us between a chunk's gather queued and its send posted on the
prefill, and a post on each end of every chunk of a request. This times, in two processes (GPUs 0 and 1, or
one GPU shared over loopback: the host side is the same, the bytes' speed is not):
- `post`: `comm.send(buf)` on rank 0 and `comm.recv(buf)` on rank 1, call to return, GPU idle before each;
- `raw`: `ncclSend` / `ncclRecv` alone on the channel's stream (what a post cannot do with less);
- the pieces around NCCL's call, each alone and without NCCL: the caller's stream, the ordering after it, the
  device guard, the stream context the pipeline posts under (torch's and `stream_ops.on_stream`), a timing event, the communicator's error query;
- a cProfile of the posts: the functions with the most own time a post.

    python bench/transfer/nccl_post.py [--mib 1,64] [--reps 200] [--out PATH] [--engine-root DIR]

`--engine-root` times another checkout's `sglang_p2p_backend` (the before of a change: run both in turn).
Without CUDA it prints that it measured nothing and exits 0.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import os
import platform
import sys
import time
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine_first(argv) -> None:
    """Put --engine-root (else this repository) first on sys.path, before the engine is imported."""
    root = _ROOT
    if "--engine-root" in argv:
        root = os.path.abspath(argv[argv.index("--engine-root") + 1])
    for p in (root, _ROOT):
        if p not in sys.path:
            sys.path.insert(0, p)
    if root != _ROOT:  # the checkout's engine ahead of this one's
        sys.path.remove(root)
        sys.path.insert(0, root)


def _us(times: list) -> dict:
    import numpy as np

    a = np.asarray(times) * 1e6
    return {"p50": float(np.median(a)), "p90": float(np.percentile(a, 90)), "n": int(a.size)}


def _timed(fn: Callable[[], object], reps: int) -> dict:
    """Host time of `fn` alone (no NCCL), back to back."""
    out = []
    for i in range(reps + 5):
        t = time.perf_counter()
        fn()
        if i >= 5:
            out.append(time.perf_counter() - t)
    return _us(out)


def _pieces(comm, reps: int) -> dict:
    """What a post does around NCCL's call, each piece alone."""
    import torch

    try:
        from sglang_p2p_backend.engine.copy.stream_ops import on_stream
    except ImportError:  # an engine from before it (--engine-root)
        on_stream = None

    dev = comm.device
    caller = torch.cuda.current_stream(dev)

    def guard():
        with torch.cuda.device(dev):
            pass

    def timing_event():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(comm.stream)

    def stream_context():
        with torch.cuda.stream(comm.stream):
            pass

    def on_stream_context():
        with on_stream(comm.stream):  # type: ignore[misc]
            pass

    return {
        "current_stream": _timed(lambda: torch.cuda.current_stream(dev), reps),
        "stream_context": _timed(stream_context, reps),
        **({"on_stream": _timed(on_stream_context, reps)} if on_stream is not None else {}),
        "wait_stream": _timed(lambda: comm.stream.wait_stream(caller), reps),
        "device_guard": _timed(guard, reps),
        "timing_event_record": _timed(timing_event, reps),
        "async_error_query": _timed(lambda: comm.lib.async_error(comm.handle), reps),
    }


def _raw(comm, buf, send: bool):
    """NCCL's call alone on the channel's stream; returns (host seconds, event to wait for)."""
    import torch

    from sglang_p2p_backend.engine.transport.nccl_lib import NCCL_UINT8

    fn = comm.lib.lib.ncclSend if send else comm.lib.lib.ncclRecv
    stream = ctypes.c_void_p(comm.stream.cuda_stream)
    ptr = ctypes.c_void_p(buf.data_ptr())
    t = time.perf_counter()
    code = fn(ptr, buf.numel(), NCCL_UINT8, comm.peer, comm.handle, stream)
    dt = time.perf_counter() - t
    comm.lib.check(code, "raw post", comm.handle)
    ev = torch.cuda.Event()
    ev.record(comm.stream)
    return dt, ev


def _rank(conn, rank: int, cfg: dict) -> dict:
    _engine_first(cfg["argv"])
    import torch

    from bench.transfer.host_profile import profile_rows
    from bench.transfer.pair import connect_pair
    from sglang_p2p_backend.engine.config import EngineConfig
    from sglang_p2p_backend.engine.transport.nccl import NcclTransport

    send = rank == 0
    transport = NcclTransport.from_config(EngineConfig.from_env())
    comm = connect_pair(transport, conn, rank)
    dev = comm.device
    out: dict = {"rank": rank, "split": bool(getattr(comm, "blocking_ops", False)), "sizes": {}}
    post = comm.send if send else comm.recv
    for mib in cfg["mib"]:
        buf = torch.zeros(int(mib * 2**20), dtype=torch.uint8, device=dev)
        reps = cfg["reps"] if mib <= 8 else max(10, cfg["reps"] // 10)
        posts, raws = [], []
        for i in range(reps + 5):  # the post and NCCL's call alone in turn, the GPU idle before each
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            c = post(buf, 60.0)
            dt = time.perf_counter() - t
            c.wait(60.0)
            torch.cuda.synchronize(dev)
            dr, ev = _raw(comm, buf, send)
            ev.synchronize()
            if i >= 5:
                posts.append(dt)
                raws.append(dr)
        prof = cProfile.Profile()  # apart from the timed posts: profiling slows what it watches
        for i in range(reps):
            torch.cuda.synchronize(dev)
            prof.enable()
            c = post(buf, 60.0)
            prof.disable()
            c.wait(60.0)
        profile = profile_rows(prof, reps, top=10)
        out["sizes"][str(mib)] = {"post_us": _us(posts), "raw_us": _us(raws), "profile": profile}
        del buf
    out["pieces"] = _pieces(comm, cfg["reps"])
    comm.close()
    return out


def rank_main(rank: int, conn, cfg: dict) -> dict:
    from bench.transfer.pair import guarded

    return guarded(_rank, conn, rank, cfg)


def _table(res: list) -> str:
    from bench.transfer.host_profile import render

    lines = []
    for r in res:
        side = "send (rank 0)" if r["rank"] == 0 else "recv (rank 1)"
        for mib, s in r["sizes"].items():
            lines.append(f"{side} {mib:>6} MiB: post p50 {s['post_us']['p50']:7.1f} us (p90 {s['post_us']['p90']:7.1f}), "
                         f"NCCL's call alone p50 {s['raw_us']['p50']:7.1f} us")
            lines += render(s["profile"], 6)
        lines.append("    pieces alone (p50 us): " + ", ".join(f"{k} {v['p50']:.1f}" for k, v in r["pieces"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="1,64", help="buffer sizes in MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--engine-root", default=None, help="another checkout whose sglang_p2p_backend is timed")
    ns = ap.parse_args(argv)
    _engine_first(argv)
    import torch

    if not torch.cuda.is_available():
        print("nccl_post: no CUDA device, nothing measured")
        return 0
    from bench.transfer.gpu_names import gpu_slugs
    from bench.transfer.pair import one_gpu_host, run_pair

    cfg = {"mib": [float(x) for x in ns.mib.split(",")], "reps": ns.reps, "argv": argv}
    res = run_pair(rank_main, (cfg,), timeout=600.0)
    print(_table(res))
    doc = {"machine": (gpu_slugs() or ["unknown-gpu"])[0], "one_gpu_loopback": one_gpu_host(),
           "engine_root": ns.engine_root or "this repository", "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ranks": res}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
