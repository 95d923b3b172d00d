"""Process bodies of the two-GPU tests (spawned, so they live in an importable module, not in the test file).

Rank 0 is the prefill on cuda:0, rank 1 the decode on cuda:1. Pools hold seeded random bytes made on the CPU,
so the decode can rebuild exactly what the prefill holds and compare every byte of its pool after a transfer.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch

from bench.transfer.kv import LAYOUTS, Layout, chunk_ranges, pick_pages
from bench.transfer.loops import PipelinedReceiver, PipelinedSender, StagingSlots, wait_event
from bench.transfer.pair import connect_pair
from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.copy.gather_cuda import FusedGather
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.engine.transport.nccl import NcclPairComm, NcclTransport


def _transport() -> NcclTransport:
    # configured like the backend's, so SGLANG_P2P_NCCL_SPLIT=1 (or _STREAM_PRIORITY=high) runs these tests with it
    return NcclTransport.from_config(EngineConfig.from_env())


POOL_TOKENS = 768  # divisible by every page size tested
IO_TIMEOUT = 60.0


def _random_pool(layout: Layout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.regions, POOL_TOKENS * layout.token_bytes), generator=g, dtype=torch.uint8)


def _shaped(whole: torch.Tensor, layout: Layout, page_size: int) -> torch.Tensor:
    return whole.view(layout.regions, POOL_TOKENS // page_size, page_size * layout.token_bytes)


def _case_plan(layout: Layout, page_size: int, chunked: bool, seed: int):
    pages = POOL_TOKENS // page_size
    n = max(2, (pages * 5) // 8)
    src_ids = pick_pages(pages, n, seed)
    dst_ids = pick_pages(pages, n, seed + 1)
    page_bytes = layout.page_bytes(page_size)
    budget = page_bytes * max(1, n // 3) if chunked else page_bytes * n
    return src_ids, dst_ids, chunk_ranges(n, page_bytes, budget), budget


def move_pages(rank: int, comm: NcclPairComm, layout: Layout, page_size: int, chunked: bool, seed: int,
               late_prefill: bool = True) -> Optional[dict]:
    """One request over `comm`; the decode returns its byte-exact verdict, the prefill None.

    The prefill's pages are written by a delayed "prefill" kernel on another stream and the send is told to
    wait for its event, so a gather that ran early would ship stale bytes and fail the comparison."""
    dev = comm.device
    src_ids, dst_ids, ranges, budget = _case_plan(layout, page_size, chunked, seed)
    src_cpu = _random_pool(layout, seed + 10)
    slots = StagingSlots(comm, budget, 2)
    if rank == 0:
        pool = torch.zeros_like(src_cpu, device=dev)
        shaped = _shaped(pool, layout, page_size)
        fused = FusedGather([[shaped[r] for r in range(layout.regions)]])
        ready = None
        if late_prefill:
            prefill = torch.cuda.Stream(device=dev)
            real = src_cpu.to(dev)
            torch.cuda.synchronize(dev)
            with torch.cuda.stream(prefill):
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the pages are final
                pool.copy_(real)
                ready = torch.cuda.Event()
                ready.record(prefill)
        else:
            pool.copy_(src_cpu.to(dev))
        PipelinedSender(comm, fused, slots).send(src_ids, ranges, ready=ready).wait(IO_TIMEOUT)
        return None
    dst_cpu = _random_pool(layout, seed + 20)
    pool = dst_cpu.to(dev)
    shaped = _shaped(pool, layout, page_size)
    fused = FusedGather([[shaped[r] for r in range(layout.regions)]])
    wait_event(PipelinedReceiver(comm, fused, slots).recv(dst_ids, ranges), IO_TIMEOUT)
    expected = _shaped(dst_cpu.clone(), layout, page_size)
    expected[:, torch.from_numpy(dst_ids)] = _shaped(src_cpu, layout, page_size)[:, torch.from_numpy(src_ids)]
    got = shaped.cpu()
    bad_pages = (got != expected).flatten(2).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    return {"equal": not bad_pages, "bad_pages": bad_pages[:10], "chunks": len(ranges), "pages": len(dst_ids)}


def transfer_cases(rank: int, conn, cases: list) -> dict:
    """Every case `(layout, page_size, chunked, cap)` in order, over one communicator per cap."""
    tr = _transport()
    comms: dict = {}
    out = {}
    for i, (layout, ps, chunked, cap) in enumerate(cases):
        if cap not in comms:
            comms[cap] = connect_pair(tr, conn, rank, 60, max_ctas=cap)
        out[(layout, ps, chunked, cap)] = move_pages(rank, comms[cap], LAYOUTS[layout], ps, chunked, seed=1000 + 37 * i)
    for c in comms.values():
        c.close()
    return out


# -- a peer killed mid-transfer ------------------------------------------------------------------------------

CHUNK = 256 << 20  # larger than NCCL's buffers: a send cannot finish without its receiver
N_CHUNKS = 6


def victim(rank: int, conn, _unused=None) -> None:
    """Joins, moves the first chunks, then dies (SIGKILL, no cleanup) with chunks in flight."""
    tr = _transport()
    comm = connect_pair(tr, conn, rank, 60, max_ctas=16)
    buf = tr.alloc_staging(CHUNK)
    ops = [comm.send(buf) if rank == 0 else comm.recv(buf) for _ in range(3)]
    ops[1].wait(IO_TIMEOUT)
    os.kill(os.getpid(), signal.SIGKILL)


def survivor(rank: int, conn_victim, conn_next, fail_timeout: float) -> dict:
    """Moves N_CHUNKS with the victim (which dies after ~2): the wait must fail within `fail_timeout` (plus the
    abort), then a fresh communicator with the replacement peer must move a request byte-exact."""
    tr = _transport()
    free0 = torch.cuda.mem_get_info(tr.device)[0]
    comm = connect_pair(tr, conn_victim, rank, 60, max_ctas=16)
    buf = tr.alloc_staging(CHUNK)
    ops = [comm.send(buf) if rank == 0 else comm.recv(buf) for _ in range(N_CHUNKS)]
    t0 = time.monotonic()
    error = None
    try:
        ops[-1].wait(fail_timeout)
    except TransportError as e:
        error = str(e)
    failed_after = time.monotonic() - t0
    aborted = comm.aborted
    split = comm.blocking_ops
    later_ops_fail = True
    try:  # the broken channel refuses new work instead of hanging
        comm.send(buf[:1]) if rank == 0 else comm.recv(buf[:1])
        later_ops_fail = False
    except TransportError:
        pass
    del comm, ops
    verdict = _one_request_over_fresh_comm(tr, conn_next, rank)
    del buf
    torch.cuda.empty_cache()
    return {"split": split, "error": error, "failed_after_s": failed_after, "aborted": aborted, "later_ops_fail": later_ops_fail,
            "next": verdict, "free_delta_mb": (free0 - torch.cuda.mem_get_info(tr.device)[0]) / 1e6}


def _one_request_over_fresh_comm(tr: NcclTransport, conn, rank: int) -> Optional[dict]:
    """A new communicator with the (recovered) peer, one request over it; both ranks return the decode's verdict."""
    comm = connect_pair(tr, conn, rank, 60, max_ctas=16)
    verdict = move_pages(rank, comm, LAYOUTS["mla"], 16, True, seed=4242, late_prefill=False)
    if rank == 0:
        conn.send(None)
        verdict = conn.recv()
    else:
        conn.recv()
        conn.send(verdict)
    comm.close()
    return verdict


def replacement(rank: int, conn) -> Optional[dict]:
    """The recovered peer: joins the survivor's fresh communicator and moves one request."""
    return _one_request_over_fresh_comm(_transport(), conn, rank)


# -- the link's pace -----------------------------------------------------------------------------------------

PACE_BYTES = 64 << 20
PACE_OPS = 8


def paced_ops(rank: int, conn) -> dict:
    """PACE_OPS transfers of PACE_BYTES over one communicator, each waited for: connect()'s probe was the untimed
    first operation, the first three transfers teach the rate, later ones carry the time they should end; every
    transfer byte-exact."""
    tr = _transport()
    comm = connect_pair(tr, conn, rank, 60)
    buf = torch.empty(PACE_BYTES, dtype=torch.uint8, device=comm.device)
    out = {"expected": [], "late_s": [], "equal": True, "rate": None}
    for i in range(PACE_OPS):
        with torch.cuda.stream(comm.stream):  # the fill on the stream the send is ordered after (the caller's)
            if rank == 0:
                buf.fill_(i + 1)
            done = comm.send(buf) if rank == 0 else comm.recv(buf)
        out["expected"].append(done.expected_end is not None)
        done.wait(IO_TIMEOUT)
        if done.expected_end is not None:
            out["late_s"].append(time.monotonic() - done.expected_end)
        if rank == 1:
            out["equal"] = out["equal"] and bool((buf == i + 1).all().item())
    out["rate"] = comm.pace.rate()
    comm.close()
    return out


# -- posts ordered after the caller's stream -----------------------------------------------------------------

ORDER_BYTES = 8 << 20
ORDER_ROUNDS = 3


def ordered_posts(rank: int, conn) -> dict:
    """Each round the prefill fills the buffer on a stream of its own behind ~20 ms of GPU sleep and sends from
    that stream; the decode zeroes its buffer the same way behind a sleep and receives from its stream. A send
    not ordered after its caller's stream would ship the previous round's bytes, a receive not ordered after
    its caller's stream would have its bytes zeroed after they landed. Then a post from the channel's own
    stream (no ordering to queue) still lands byte-exact."""
    tr = _transport()
    comm = connect_pair(tr, conn, rank, 60)
    dev = comm.device
    caller = torch.cuda.Stream(device=dev)
    buf = torch.zeros(ORDER_BYTES, dtype=torch.uint8, device=dev)
    got = []
    for i in range(ORDER_ROUNDS + 1):
        torch.cuda.synchronize(dev)
        own = i == ORDER_ROUNDS
        with torch.cuda.stream(comm.stream if own else caller):
            if not own:
                torch.cuda._sleep(40_000_000)
            if rank == 0:
                buf.fill_(i + 1)
            else:
                buf.zero_()
            done = comm.send(buf) if rank == 0 else comm.recv(buf)
        done.wait(IO_TIMEOUT)
        if rank == 1:
            values = torch.unique(buf).tolist()
            got.append(values)
    comm.close()
    return {"got": got}
