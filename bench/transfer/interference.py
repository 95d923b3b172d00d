"""A compute loop timed alone and while a thread writes KV back to back: what a transfer path costs the forward
passes running beside it on the same GPU.

The loop (`matmul_loop`) runs in two forms. Launched kernel by kernel, as a forward pass without CUDA graphs is,
its time counts the GPU's contention (SMs, memory, copy engines) and any gap the launching thread leaves while
it waits for the GIL the writer holds. Captured once as a CUDA graph and replayed, it has no launches to delay:
what is left is the contention on the GPU alone. The difference between the two is host-side."""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional


def matmul_loop(torch: Any, device: Any, *, iters: int = 200, n: int = 4096, graph: bool = False) -> Callable[[], float]:
    """A bf16 n x n matmul loop on a stream of its own of CUDA `device` (a forward pass beside the transfers;
    writes are ordered after their caller's stream only, so they overlap it). Returns a call that runs the loop
    once and gives its GPU time in seconds (CUDA events on that stream). `graph`: the loop captured once as a
    CUDA graph and replayed."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))  # a, b made on the current stream
    replay: Optional[Callable[[], Any]] = None
    if graph:
        with torch.cuda.stream(stream):
            torch.matmul(a, b, out=out)  # cuBLAS's handle and workspace before the capture
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
            for _ in range(iters):
                torch.matmul(a, b, out=out)
        replay = g.replay  # the bound method keeps the graph alive as long as the loop

    def loop() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            if replay is not None:
                replay()
            else:
                for _ in range(iters):
                    torch.matmul(a, b, out=out)
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    return loop


@dataclass
class Interference:
    alone: list  # what `loop()` returned, alone
    busy: list  # and while the writes ran
    writes: int  # writes completed while `busy` was measured
    wall_s: float  # how long `busy` took
    error: Optional[str]  # the writer's traceback, if a write raised


def during_writes(loop: Callable[[], float], write: Callable[[], Any], reps: int,
                  join_timeout: Optional[float] = None) -> Interference:
    """`loop()` once to warm up, `reps` times alone, then `reps` times while a daemon thread calls `write()`
    back to back (given 50 ms to start)."""
    loop()
    alone = [loop() for _ in range(reps)]
    stop, writes, failure = threading.Event(), [0], []

    def writer() -> None:
        try:
            while not stop.is_set():
                write()
                writes[0] += 1
        except BaseException:  # noqa: BLE001 - reported to the caller
            failure.append(traceback.format_exc())

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    busy = [loop() for _ in range(reps)]
    wall = time.perf_counter() - t0
    stop.set()
    t.join(join_timeout)
    return Interference(alone, busy, writes[0], wall, failure[0] if failure else None)


def beside_writes(torch: Any, device: Any, write: Callable[[], Any], *, reps: int = 5, iters: int = 200,
                  join_timeout: Optional[float] = None) -> dict:
    """The matmul loop launched kernel by kernel, then as a graph, each alone and beside back-to-back `write()`s:
    medians in ms, the slowdowns (`slowdown` launched, `slowdown_graph` graphed), the writes done and the
    seconds they took beside the launched loop, the writer's first error."""
    out: dict = {"matmul_iters": iters}
    for prefix, graph in (("matmul", False), ("graph", True)):
        r = during_writes(matmul_loop(torch, device, iters=iters, graph=graph), write, reps, join_timeout)
        alone, busy = float(statistics.median(r.alone)), float(statistics.median(r.busy))
        out[f"{prefix}_ms_alone"], out[f"{prefix}_ms_during"] = alone * 1e3, busy * 1e3
        out["slowdown_graph" if graph else "slowdown"] = busy / alone - 1
        if not graph:
            out.update(writes_during=r.writes, wall_s=r.wall_s)
        out["error"] = out.get("error") or r.error
    return out
