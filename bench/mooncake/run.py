"""Runs the Mooncake microbenchmark cases: this process is the prefill (writer), `peer.py` the decode.

Per layout: one source pool in this process and one decode pool in a child, both registered with Mooncake;
per case: descriptors from `engine.plan.copy_descriptors` (the engine's own run merging), one warm-up write
whose landed pages are checked byte for byte, then timed writes through `MooncakeTransport.write`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from sglang_p2p_backend.engine.copy.plan import copy_descriptors
from sglang_p2p_backend.engine.transport.mooncake import MooncakeTransport, batch_bounds

from .cases import Case, Layout, page_ids

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")


@dataclass
class Side:
    bases: list[int]
    view: np.ndarray  # (regions, pool_tokens * bytes_per_token) uint8 view of the pool


@contextmanager
def decode_peer(layout: Layout, region_bytes: int, protocol: str, host: str, ib_device: str) -> Iterator[tuple[str, Side]]:
    """A decode child whose pool lives in a shared file (tmpfs when there is one), torn down on exit."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=shm, prefix="mc_bench_") as f:
        f.truncate(layout.regions * region_bytes)
        env = dict(os.environ, GLOG_minloglevel="2")
        proc = subprocess.Popen(
            [sys.executable, PEER, f.name, str(layout.regions), protocol, host, ib_device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        try:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"decode peer exited with {proc.wait(timeout=10)} before registering")
            info = json.loads(line)
            mem = np.memmap(f.name, dtype=np.uint8, mode="r").reshape(layout.regions, region_bytes)
            yield info["session"], Side(info["bases"], mem)
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def descriptors(case: Case, src: Side, dst: Side, pool_tokens: int, rng: np.random.Generator):
    """(srcs, dsts, lens, src_ids, dst_ids) for one case."""
    pool_pages = pool_tokens // case.page_size
    src_ids, dst_ids = page_ids(case, pool_pages, rng)
    s, d, n = copy_descriptors(src.bases, dst.bases, [case.item_len] * case.layout.regions, src_ids, dst_ids)
    return s.tolist(), d.tolist(), n.tolist(), src_ids, dst_ids


def verify(case: Case, src: Side, dst: Side, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """The decode pages hold the prefill pages (every region), byte for byte."""
    for r in range(case.layout.regions):
        s = src.view[r].reshape(-1, case.item_len)[src_ids]
        d = dst.view[r].reshape(-1, case.item_len)[dst_ids]
        if not np.array_equal(s, d):
            raise AssertionError(f"{case}: region {r} differs after the write")


def time_case(t: MooncakeTransport, session: str, case: Case, src: Side, dst: Side, pool_tokens: int,
              iters: int, max_descriptors: int, rng: np.random.Generator) -> dict:
    srcs, dsts, lens, src_ids, dst_ids = descriptors(case, src, dst, pool_tokens, rng)
    row = {
        "layout": case.layout.name, "regions": case.layout.regions, "bytes_per_token": case.layout.bytes_per_token,
        "page_size": case.page_size, "tokens": case.tokens, "mode": case.mode, "pages": case.pages,
        "bytes": case.nbytes, "descriptors": len(srcs), "batches": len(batch_bounds(len(srcs), t.max_batch)),
    }
    if len(srcs) > max_descriptors:
        return row | {"skipped": f"{len(srcs)} descriptors > --max-descriptors {max_descriptors}"}
    t.write(session, srcs, dsts, lens)  # warm-up (first contact opens the segment) and correctness
    verify(case, src, dst, src_ids, dst_ids)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        t.write(session, srcs, dsts, lens)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return row | {
        "times_ms": [round(x * 1e3, 3) for x in times],
        "median_ms": round(med * 1e3, 3),
        "GBps": round(case.nbytes / med / 1e9, 3),
        "descriptors_per_s": round(len(srcs) / med),
        "us_per_descriptor": round(med / len(srcs) * 1e6, 2),
    }


def run_layout(layout: Layout, cases: list[Case], pool_tokens: int, args) -> list[dict]:
    region_bytes = pool_tokens * layout.bytes_per_token
    rng = np.random.default_rng(args.seed)
    pool = rng.integers(0, 256, (layout.regions, region_bytes), dtype=np.uint8)
    src = Side([pool.ctypes.data + i * region_bytes for i in range(layout.regions)], pool)
    rows = []
    with MooncakeTransport(args.protocol, args.host, ib_device=args.ib_device or None,
                           transfer_timeout_s=args.timeout) as t:
        t.register([(b, region_bytes) for b in src.bases])
        with decode_peer(layout, region_bytes, args.protocol, args.host, args.ib_device) as (session, dst):
            for case in cases:
                row = time_case(t, session, case, src, dst, pool_tokens, args.iters, args.max_descriptors, rng)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows
