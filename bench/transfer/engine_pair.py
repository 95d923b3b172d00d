"""The engine's own data path between two processes: `PairSender` -> `PairReceiver` with the fused copier and
the staging pool, over NCCL on two GPUs (rank 0 on cuda:0 is the prefill, rank 1 on cuda:1 the decode) or over
the tcp transport on CPU. The control channel is a multiprocessing queue carrying the engine's own encoded
messages in order (in the product it is the ordered ZMQ socket; nothing else differs).

Each case moves `n` scattered pages of every layer region; the decode checks every destination page against
the prefill's seeded contents and that no other page changed, and both sides time send() to the moment the
decode's receiver has scattered the last chunk (CLOCK_MONOTONIC is shared by the processes of one host).
Used by tests/gpu/test_engine_pipeline_nccl.py (byte-exact cases) and `python -m bench.transfer.engine_pair`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

from bench.transfer.pair import pair_device, service_gil_switch
from bench.transfer.published_rooms import PublishedRooms, QueuedScatters
from bench.transfer.xfer_cases import phase_offsets
from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.wire import messages
from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.pair.pipeline import PairReceiver, PairSender
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.transport import two_sided_transport
from sglang_p2p_backend.engine.transport.base import TransportError

SENTINEL = 0x5A
WARMUP_ROOM = 7000  # rep 0's room; rep k sends room WARMUP_ROOM + k


@dataclass(frozen=True)
class Case:
    layout: str  # "mla": 61 regions of 576 bf16 a token; "mha": K and V of 32 layers, 8 heads x 128 bf16
    page_size: int
    tokens: int
    reps: int = 1
    slot_mb: int = 128
    first_mb: int = 0  # the sender's first-chunk cap (SGLANG_P2P_FIRST_CHUNK_MB; 0: every chunk a whole slot)
    #: a fault (tests): on the last repetition the prefill's sends after this many raise, as a send on a dead
    #: channel does, after its chunk's header went out: the decode's receive for it never completes (0: none)
    fail_send_at: int = 0

    @property
    def regions(self) -> int:
        return 61 if self.layout == "mla" else 64

    @property
    def item_len(self) -> int:
        return self.page_size * (576 * 2 if self.layout == "mla" else 8 * 128 * 2)

    @property
    def pages(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def pool_pages(self) -> int:
        return 2 * self.pages + 8


def _ids(case: Case, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(case.pool_pages)[: case.pages].astype(np.int32)


def _pool(case: Case, device: torch.device, seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.full((case.pool_pages, case.item_len), SENTINEL, dtype=torch.uint8, device=device) for _ in range(case.regions)]
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(0, 256, (case.pool_pages, case.item_len), dtype=torch.uint8, device=device, generator=g) for _ in range(case.regions)]


def _fail_sends_after(sender: PairSender, n: int) -> None:
    """The sender's channel from its (n+1)th send on raises, as a send on a channel the peer left does."""
    comm, count = sender.comm, [0]
    real = comm.send

    def send(buf, *args, **kwargs):
        count[0] += 1
        if count[0] > n:
            raise TransportError("the prefill stops sending (test fault)")
        return real(buf, *args, **kwargs)

    comm.send = send


def _transport(device: torch.device):
    return two_sided_transport("auto", device, "127.0.0.1", EngineConfig.from_env())


def _prefill(device, cases, ctrl, results, io_timeout, trace=False):
    transport = _transport(device)
    out = []
    for ci, case in enumerate(cases):
        pool = _pool(case, device, seed=1000 + ci)
        staging = StagingPool(transport.alloc_staging, case.slot_mb << 20, EngineConfig.staging_slots)
        sender = PairSender(transport=transport, staging=staging, copier=PageCopier([pool]), local_session="prefill:0",
                            control=lambda m: ctrl.put(messages.encode(m)), connect_timeout=60, io_timeout=io_timeout,
                            first_chunk=case.first_mb << 20)
        src, dst = _ids(case, 1), _ids(case, 2)
        times, events = [], []
        if trace:
            sender.trace = lambda step, room: events.append(("prefill", step, room, time.monotonic()))
        for rep in range(case.reps + 1):  # rep 0 warms up (channel creation, first launches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.monotonic()
            faulty = bool(case.fail_send_at) and rep == case.reps
            if faulty:
                _fail_sends_after(sender, case.fail_send_at)
            try:
                sender.send(WARMUP_ROOM + rep, 0, [src], [dst])
            except TransportError:
                if not faulty:
                    raise
            ctrl.put(("mark", ci, rep))
            # a faulty repetition lands once the decode's receive passed its deadline and the channel settled
            landed = results.get(timeout=io_timeout * (3 if faulty else 1))
            if rep:
                times.append(landed - t0)
        sender.close()
        staging.close()
        out.append({"times": times, "events": events})
    transport.close()
    return out


def _decode(device, cases, ctrl, results, io_timeout, trace=False):
    transport = _transport(device)
    verdicts = []
    for ci, case in enumerate(cases):
        pool = _pool(case, device, seed=None)
        staging = StagingPool(transport.alloc_staging, case.slot_mb << 20, EngineConfig.staging_slots)
        errors: list[str] = []
        copier, rooms = PageCopier([pool]), PublishedRooms(_ids(case, 2))  # every room: the case's destinations
        counted = QueuedScatters()
        receiver = PairReceiver(transport=transport, staging=staging, copier=copier, peer_session="prefill:0",
                                wanted=lambda room: True, on_chunk=lambda room, rank, err: err and errors.append(err),
                                connect_timeout=60, io_timeout=io_timeout,
                                check=lambda h, c=copier, s=staging, r=rooms: r.check(h, c.item_lens, s.slot_bytes),
                                **counted.receiver_args())
        events: list = []
        if trace:
            receiver.trace = lambda step, room: events.append(("decode", step, room, time.monotonic()))
        for _ in range(case.reps + 1):
            while True:
                item = ctrl.get(timeout=io_timeout)
                if isinstance(item, tuple):  # the prefill's send() returned: time once everything before it landed
                    receiver.submit(lambda: results.put(time.monotonic()))
                    break
                receiver.submit(messages.decode(item))
        done = threading.Event()
        receiver.submit(done.set)
        done.wait(io_timeout)
        src_pool = _pool(case, device, seed=1000 + ci)
        src, dst = _ids(case, 1), _ids(case, 2)
        bad = bad_others = 0
        others = torch.ones(case.pool_pages, dtype=torch.bool, device=device)
        others[torch.from_numpy(dst.astype(np.int64)).to(device)] = False
        for s_t, d_t in zip(src_pool, pool):
            want = s_t[torch.from_numpy(src.astype(np.int64)).to(device)]
            got = d_t[torch.from_numpy(dst.astype(np.int64)).to(device)]
            bad += int((want != got).any(dim=1).sum())
            bad_others += int((d_t[others] != SENTINEL).any(dim=1).sum())
        receiver.close()
        # how many rooms' destination lists went to the device (once a room where the scatter takes device ids);
        # `bad_others`: pages outside every room's destinations that changed (must never happen, faults included)
        verdicts.append({"bad_pages": bad + bad_others, "bad_others": bad_others, "errors": errors[:3],
                         "events": events, "rooms": rooms.published, "room_uploads": receiver.room_ids.uploads,
                         "queued": counted.queued, "ended": counted.ended, "slots_in_use": staging.in_use})
        staging.close()
    transport.close()
    return verdicts


def _worker(rank, cases, ctrl, results, out_q, io_timeout, trace=False):
    service_gil_switch()
    device = torch.device("cuda", pair_device(rank)) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        body = _prefill if rank == 0 else _decode
        out_q.put((rank, body(device, cases, ctrl, results, io_timeout, trace)))
    except BaseException as e:  # report, so the parent never waits on a dead worker
        out_q.put((rank, f"{type(e).__name__}: {e}"))


def run_cases(cases: list[Case], io_timeout: float = 60.0, trace: bool = False) -> tuple[list, list]:
    """Run the cases; returns (per-case send->landed seconds, per-case decode verdicts). `trace`: both ends'
    steps of every chunk timed (PairSender / PairReceiver's trace), each verdict's `phases_us` the median offset
    of each from send()'s start over the timed repetitions (the warm-up left out)."""
    ctx = mp.get_context("spawn")
    ctrl, results, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, cases, ctrl, results, out_q, io_timeout, trace)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + io_timeout * (2 + sum(c.reps + 1 for c in cases))
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            rank, value = out_q.get(timeout=1)
            got[rank] = value
        except queue.Empty:
            # give up only on a rank that ended without a result (one that finished posted it first)
            if any(not p.is_alive() and r not in got for r, p in enumerate(procs)) and out_q.empty():
                time.sleep(1)
                if out_q.empty():
                    break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    for rank in (0, 1):
        if not isinstance(got.get(rank), list):
            raise RuntimeError(f"rank {rank} failed: {got.get(rank, 'no result')}")
    verdicts = got[1]
    for mine, theirs in zip(got[0], verdicts):
        events = [e for e in mine["events"] + theirs.pop("events") if e[2] != WARMUP_ROOM]
        if trace:
            theirs["phases_us"] = phase_offsets(events)
    return [c["times"] for c in got[0]], verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description="engine pipeline figures: send() to the decode's last scatter")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", default="128,1024,4096,16384", help="request sizes, comma-separated")
    ap.add_argument("--layouts", default="mla,mha", help="mla, mha or both")
    ap.add_argument("--page-sizes", default="1,64", help="comma-separated")
    ap.add_argument("--trace", action="store_true",
                    help="time every step of every chunk on both ends; print each case's timeline")
    ns = ap.parse_args()
    cases = [Case(layout, ps, tokens, reps=ns.reps) for layout in ns.layouts.split(",")
             for ps in map(int, ns.page_sizes.split(",")) for tokens in map(int, ns.tokens.split(","))]
    cases = [c for c in cases if not (c.page_size == 1 and c.tokens > 4096)]
    times, verdicts = run_cases(cases, trace=ns.trace)
    rows = []
    for case, ts, v in zip(cases, times, verdicts):
        nbytes = case.pages * case.item_len * case.regions
        p50 = statistics.median(ts)
        rows.append({**asdict(case), "bytes": nbytes, "p50_s": p50, "p99_s": max(ts), "gbps_p50": nbytes / p50 / 1e9,
                     "bad_pages": v["bad_pages"], "errors": v["errors"], "phases_us": v.get("phases_us")})
        print(f"{case.layout} page {case.page_size:>2} {case.tokens:>6} tokens {nbytes / 2**20:8.1f} MiB: "
              f"p50 {p50 * 1e3:8.3f} ms  {nbytes / p50 / 1e9:7.1f} GB/s  bad pages {v['bad_pages']}", flush=True)
        for name, us in v.get("phases_us", []):
            print(f"    {name:<28}{us:>10.1f} us")
    machine = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "torch": torch.__version__, "nccl_split": os.environ.get("SGLANG_P2P_NCCL_SPLIT", "0")}
    with open(ns.out, "w") as f:
        json.dump({"machine": machine, "what": "engine PairSender -> PairReceiver, send() to last scatter",
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
