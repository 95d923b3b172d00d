"""The backend's own write paths across two GPUs against the one copy they should match.

    python bench/transfer/xfer_bench.py [--machine NAME] [--out PATH] [--sections plan,ipc,nccl,interference,fixed]
                                        [--budget-s 400] [--case-s 0.25] [--programs 16,32,66,132] [--quick]
                                        [--shapes mha_p1,...] [--tokens 4096,...] [--dests contiguous,runs4,...]

Two spawned processes: the prefill on cuda:0 drives, the decode on cuda:1 (cuda:0 on a one-GPU host) answers
over a pipe (allocates and exports its pools, zeroes pages, hashes pages, receives NCCL chunks). Cases: MHA with
128 KiB of KV a token (64 regions of 2 KiB a token) at page sizes 1 and 16, MLA (61 layers x 576 bf16) at page
size 64; 128, 1k, 4k and 16k tokens; contiguous and scattered pages (bench/transfer/xfer_cases.py). `--shapes` and
`--tokens` take a subset; `--dests` adds `runs<N>` destinations, the pages in N runs of the decode's pool (N spans
a region: a long prompt's chunks from SGLang's page-1 allocator), which also the interference loop then writes.

- `ipc`: `CudaIpcTransport.write_pages` (the same-host path the prefill takes for whole pages: checks, one
  launch, synchronise), with the SM kernel (`kernel`) and with the copy engines (`copy_engine`,
  SGLANG_P2P_COPY_ENGINE=on), host time from call to return, against ONE cudaMemcpyPeerAsync of the same bytes
  between contiguous buffers (CUDA-event time; `ratio` = peer / write). After each mode the decode hashes its
  destination pages and compares them with the prefill's source pages (every byte counts). With two GPUs the
  4k/16k MHA page-16 and MLA cases run again with the decode's pool on the prefill's GPU (`same_gpu`, against
  one device-to-device copy). `rule` says which mode won each case and where the crossover lies (what
  engine/copy/ce_plan.py's thresholds are set from). `--interleave` times the `--ipc-modes` in turn, one write of
  each a round (each mode's own write checked first), and each mode's write step by step: for an A/B of two
  routes whose difference is smaller than what drifts between two blocks of repetitions. `--idle-ms` sleeps
  before each of those writes, so each finds the GPUs and the link idle, as a request at concurrency 1 does.
- `nccl`: `PairSender.send` -> `PairReceiver` over NCCL (fused gather, staging slots, fused scatter), timed
  from send() to the decode's last scatter, against ONE contiguous NCCL send of the same bytes on the same
  pair communicator.
- `interference`: a bf16 matmul loop on the prefill GPU's default stream, alone and while a thread writes the
  16k MHA page-16 request back to back (kernel, copy engines, NCCL).
- `--programs LIST` (with `ipc` or `interference`): the kernel's grid bounded to each value in turn
  (SGLANG_P2P_IPC_PROGRAMS; the default is span_copy.default_programs: one an SM for these cases), for the 4k and
  16k MHA page-16 cases (`--programs-case SHAPE:TOKENS` picks others, e.g. mha_p1:1024 with --dests runs64 for
  serving's page-1 chunks in short runs), on every --dests: write time, GB/s and ratio as in `ipc`, and the
  matmul's slowdown during back-to-back writes as in `interference`. How many SMs NVLink's ~380 GB/s needs
  against what they cost the forward pass.
- `fixed`: where a 128-token request's time goes (MLA page 64 and MHA page 16, scattered): host planning
  (checks and address translation), descriptor upload (CUDA events), launch (host time of the queueing call),
  sync (host wait), the control message (msgspec encoding of the aux row and Status, and one way over a local
  socket); the whole write and its step before the copy under the default route (split), the rest also for the copy
  engines and the NCCL path. Then a 4k-token contiguous request on each route: the whole write against its copy's
  GPU time alone, the difference being the host time around the copy.
- `plan`: host planning alone, no device: how the per-chunk host work grows with pages and layers.

Writes one JSON (default bench/results/xfer_<machine>.json) with the machine named, and prints a table per
section. Without CUDA it says so and exits 0 having measured nothing; `--quick` runs the whole driver on CPU
instead (the shared-memory stand-in of CUDA IPC from tests/support, the tcp transport for the NCCL path, small
pools), which is what tests/bench/test_xfer_bench.py runs. Every section stops starting cases once
`--budget-s` is spent (those are listed as skipped); the defaults end in about 2-3 minutes on two H100s.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # run as a script: the repository root holds `bench` and `sglang_p2p_backend`
    sys.path.insert(0, _ROOT)

from bench.transfer import xfer_cases as xc  # noqa: E402
from bench.transfer.gpu_names import gpu_slugs, picked  # noqa: E402
from bench.transfer.host_profile import host_profile, profile_rows, render as render_profile  # noqa: E402
from bench.transfer.interference import beside_writes, during_writes  # noqa: E402
from bench.transfer.pair import SAFE_ENV, collect, expect, guarded, service_gil_switch  # noqa: E402
from sglang_p2p_backend.engine.config import COPY_ENGINE_MODES  # noqa: E402

SESSION = "127.0.0.1:17035"
IO_TIMEOUT = 120.0
INTERFERENCE_CASE = ("mha_p16", 16384)
FIXED_SHAPES = ("mla_p64", "mha_p16")
#: `fixed` also splits a contiguous request of this many tokens (or the largest measured below it) into its copy's
#: GPU time and the host time around it, on both routes
LARGE_FIXED_TOKENS = 4096
PHASE_TOKENS = (1024, 4096)  # nccl_phases: a one-chunk and a several-chunk request at the default slots
PHASE_PROFILE_CALLS = 30  # nccl_phases: send() under cProfile this many times
SAME_GPU = (("mha_p16", 4096), ("mha_p16", 16384), ("mla_p64", 4096), ("mla_p64", 16384))
#: --programs measures this shape's requests of these sizes by default (2 GiB at 16k: the interference case);
#: --programs-case picks others (serving's page-1 chunks in short runs: mha_p1:1024 with --dests runs64)
PROGRAMS_CASE = ("mha_p16", (4096, 16384))
IPC_MODES = ("kernel", "copy_engine")
#: what each ipc mode sets SGLANG_P2P_COPY_ENGINE to; `split` (--ipc-modes) cuts a chunk by its page runs
TRANSPORT_MODE = {"kernel": "off", "copy_engine": "on", "split": "split"}
#: cases with more copy-engine spans than this get fewer repetitions (a batch of ~1M spans takes long)
MANY_SPANS = 1 << 16


def engine_spans(mode: str, spans: int) -> int:
    """The spans an ipc row's write gives the copy engines one by one, which bound its repetitions (`budget`): all
    of them under `copy_engine`; none under `kernel` or `split` (split hands the engines only long runs, at most
    CE_MAX_SPANS_BATCHED spans a chunk; its row's `spans` counts the kernel's too). Until 2026-11-30 split's rows
    were held to the few repetitions of the copy engines' (10 against the kernel's 42-100)."""
    return spans if mode == "copy_engine" else 0
PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


# -- both processes ------------------------------------------------------------------------------------------

class Dev:
    """One process's device: CUDA (events) or CPU (--quick: perf_counter for every clock)."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def gpu_seconds(self, fn: Callable[[], Any], stream=None) -> float:
        """Device time of the work `fn` queues (CUDA events on `stream`, default the current one), or its
        host time on CPU."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        torch = self.torch
        stream = stream or torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        with torch.cuda.stream(stream):  # work `fn` queues on the current stream lands between the events
            fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e-3


def _catch(errors: list, fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
        errors.append(e)


def host_seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def host_timeline(steps: list[tuple[str, Callable[[], Any]]], budget: xc.Budget, copier: Any = None) -> dict:
    """Median host microseconds of each step of one write, each from the end of the step before: `steps` are
    (name, fn) run in order, the name marking the fn's end; `copier` (a PageCopier) marks its own steps inside
    (its `trace`). Where a write's fixed host time goes, step by step, without a profiler's overhead."""
    marks: list[tuple[str, int]] = []
    durations: dict[str, list[float]] = {}

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter_ns()))

    def one() -> float:
        marks.clear()
        t0 = time.perf_counter_ns()
        if copier is not None:
            copier.trace = mark
        try:
            for name, fn in steps:
                fn()
                mark(name)
        finally:
            if copier is not None:
                copier.trace = None
        prev = t0
        for name, t in marks:
            durations.setdefault(name, []).append((t - prev) / 1e3)
            prev = t
        return (prev - t0) / 1e9

    budget.run(one)
    return {name: round(float(np.median(v)), 1) for name, v in durations.items()}


def _steps(steps: dict) -> str:
    return ", ".join(f"{name} {us:.1f}" for name, us in steps.items())


def _call_then_sync(call: Callable[[], Any], stream, calls: list, syncs: list) -> Callable[[], float]:
    """One timed round: host time of `call` (its launches) into `calls`, then of the stream's sync into `syncs`."""
    def one() -> float:
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        stream.synchronize()
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        syncs.append(t2 - t1)
        return t2 - t0

    return one


def _shape(d: dict) -> xc.Shape:
    return xc.Shape(**d)


def programs_tokens(tokens, case_tokens=PROGRAMS_CASE[1]) -> list[int]:
    """The request sizes --programs measures: the programs case's (`case_tokens`), or with --quick (small pools,
    none of those sizes) the largest there is, so the CPU run still walks the section."""
    return [t for t in tokens if t in case_tokens] or [max(tokens)]


def parse_programs_case(raw: str) -> tuple[str, tuple[int, ...]]:
    """--programs-case SHAPE:TOKENS (e.g. mha_p1:1024,4096): the shape and request sizes --programs measures."""
    name, _, sizes = raw.partition(":")
    if name.strip() not in {sh.name for sh in xc.SHAPES}:
        raise argparse.ArgumentTypeError(f"{raw!r}: the shape is one of {', '.join(sh.name for sh in xc.SHAPES)}")
    tokens = tuple(_positive_ints(sizes, "request sizes in tokens like mha_p1:1024,4096"))
    if not tokens:
        raise argparse.ArgumentTypeError(f"{raw!r}: give request sizes in tokens like mha_p1:1024,4096")
    return name.strip(), tokens


def _positive_ints(raw: str, what: str) -> list[int]:
    values = [p.strip() for p in raw.split(",") if p.strip()]
    if not all(v.isdigit() and int(v) >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{raw!r}: give {what}")
    return [int(v) for v in values]


def parse_programs(raw: str) -> list[int]:
    """--programs: comma-separated grid bounds, each >= 1 (empty: none, only the default grid)."""
    return _positive_ints(raw, "program counts >= 1 like 16,32,66,132")


def parse_slot_mib(raw: str) -> list[int]:
    """--slot-mib: comma-separated staging slot sizes in MiB, each >= 1 (empty: only the configured one)."""
    return _positive_ints(raw, "slot sizes in MiB >= 1 like 256,512")


def parse_ipc_modes(raw: str) -> list[str]:
    """--ipc-modes: comma-separated routes the ipc and interference sections time, of kernel, copy_engine, split."""
    modes = [x.strip() for x in raw.split(",") if x.strip()]
    if not modes or any(m not in TRANSPORT_MODE for m in modes):
        raise argparse.ArgumentTypeError(f"{raw!r}: give ipc modes of {', '.join(TRANSPORT_MODE)} like kernel,split")
    return modes


def parse_first_chunk_mib(raw: str) -> list[int]:
    """--first-chunk-mib: comma-separated first-chunk caps in MiB, each >= 0 (0: no ramp; empty: the configured)."""
    try:
        vals = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        vals = [-1]
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{raw!r}: give first-chunk caps in MiB >= 0 like 0,16,64")
    return vals


@dataclass
class PreparedWrite:
    """One ipc case ready to time: the write itself, what its destination pages must hash to, its span count
    in each mode and the reference copy of the same bytes."""

    case: xc.Case
    gpu: int
    dst_ids: np.ndarray
    want: np.ndarray
    spans: dict  # mode -> spans
    write: Callable[[], Any]
    ref: dict
    #: write_pages' arguments (the steps of --interleave)
    args: tuple = ()


def pool_hash(regions, ids: np.ndarray, trace: Callable[[str], None] = lambda what: None) -> np.ndarray:
    """Hashes of pages `ids` over every region (the same on either side and device; engine/copy/page_hash.py).
    `trace(step)` is called first: a CUDA error left pending by earlier work shows there, before the hash's
    kernels raise it."""
    from sglang_p2p_backend.engine.copy import page_hash  # after _setup: it imports torch

    trace("pool_hash")
    return page_hash.pool_hash(regions, ids).cpu().numpy()


def _setup(quick: bool, gpu: int):
    """torch and the device of this process; --quick installs the shared-memory stand-in of CUDA IPC. The GIL
    switch interval is the service's (SGLANG_P2P_GIL_SWITCH_MS, as the KV manager sets it): the decode's receiver
    thread and its pipe reader take turns with the GIL as a scheduler's threads do."""
    os.environ.update(SAFE_ENV)
    service_gil_switch()
    import torch

    if quick:
        tests = str(Path(_ROOT) / "tests")
        if tests not in sys.path:
            sys.path.append(tests)
        from support.shm_ipc import ShmBackend

        from sglang_p2p_backend.engine.transport import cuda_ipc

        backend = ShmBackend()
        cuda_ipc.use_backend(backend)
        return torch, torch.device("cpu"), backend
    torch.cuda.set_device(gpu)
    return torch, torch.device("cuda", gpu), None


def _child(fn, rank: int, conn, results, cfg: dict) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(cfg["budget_s"] + 150, exit=False)  # a hang shows where it waits
    try:
        results.put((rank, True, fn(conn, cfg)))
    except BaseException:  # report everything, the parent decides
        results.put((rank, False, traceback.format_exc()))


# -- decode: a server over the pipe -----------------------------------------------------------------------------

class Decode:
    def __init__(self, conn, cfg: dict):
        self.torch, self.dev, self.shm = _setup(cfg["quick"], cfg["decode_gpu"])
        self.conn, self.cfg = conn, cfg
        self.pool: list = []
        self.nccl = None  # (transport, staging, receiver, errors)
        self.transport = None
        self.ref_buf = None
        #: the rooms of the NCCL path, each publishing the destinations of the last `publish`: the receiver checks
        #: each chunk against its room as the decode adapter does (published_rooms.py)
        self.rooms = None

    def _alloc(self, shape: xc.Shape, pages: int, gpu: int) -> list:
        torch = self.torch
        self.pool = []
        torch.cuda.empty_cache() if self.dev.type == "cuda" else None
        if self.shm is not None:
            return [self.shm.allocate(pages * shape.item).view(pages, shape.item).zero_() for _ in range(shape.regions)]
        dev = torch.device("cuda", gpu)
        return [torch.zeros((pages, shape.item), dtype=torch.uint8, device=dev) for _ in range(shape.regions)]

    def pool_cmd(self, shape: dict, pages: int, gpu: int):
        import msgspec

        from sglang_p2p_backend.engine.transport.cuda_ipc import export_regions

        shape = _shape(shape)
        self.pool = self._alloc(shape, pages, gpu)
        device = self.pool[0].device
        if device.type == "cuda":
            self.torch.cuda.synchronize(device)
        export = export_regions([(t.data_ptr(), t.numel()) for t in self.pool], device)
        return ("pool", msgspec.msgpack.encode(export), [t.data_ptr() for t in self.pool])

    def zero(self, ids):
        idx = self.torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.pool[0].device)
        for t in self.pool:
            t.index_fill_(0, idx, 0)
        if self.dev.type == "cuda":
            # the fills done before the answer: the prefill's next write must land after them, not under them
            # (--interleave's one checked write a mode met 2 GiB of fills still running on 1 x H200)
            self.torch.cuda.synchronize(self.pool[0].device)
        return ("ok",)

    def nccl_start(self, slot_bytes: int, slots: int, overlap: bool = True):
        from bench.transfer.published_rooms import QueuedScatters
        from sglang_p2p_backend.engine.config import EngineConfig
        from sglang_p2p_backend.engine.copy.copier import PageCopier
        from sglang_p2p_backend.engine.pair.pipeline import PairReceiver
        from sglang_p2p_backend.engine.pair.staging import StagingPool
        from sglang_p2p_backend.engine.transport import two_sided_transport

        if self.transport is None:
            self.transport = two_sided_transport("auto", self.pool[0].device, "127.0.0.1", EngineConfig.from_env())
        self.nccl_stop()
        staging = StagingPool(self.transport.alloc_staging, slot_bytes, slots)
        errors: list[str] = []
        copier = PageCopier([self.pool])
        # SGLANG_P2P_DEVICE_SCATTER as the decode adapter runs it (every room wanted here)
        receiver = PairReceiver(transport=self.transport, staging=staging, copier=copier,
                                peer_session="prefill:0", wanted=lambda room: True,
                                on_chunk=lambda room, rank, err: errors.append(err) if err else None,
                                connect_timeout=IO_TIMEOUT, io_timeout=IO_TIMEOUT, overlap=overlap,
                                check=lambda header: self.check(header, copier.item_lens, slot_bytes),
                                **QueuedScatters().receiver_args())
        self.nccl = (staging, receiver, errors)
        return ("ok",)

    def publish(self, ids):
        """The destinations of the rooms that follow (one request's pages, as the decode publishes them)."""
        from bench.transfer.published_rooms import PublishedRooms

        self.rooms = PublishedRooms(ids)
        return ("ok",)

    def check(self, header, item_lens, slot_bytes):
        """A chunk's checks as the decode adapter makes them; before any `publish`, no room waits for KV."""
        from sglang_p2p_backend.engine.wire import checks

        if self.rooms is None:
            return checks.chunk_header(header, item_lens, slot_bytes, None)
        return self.rooms.check(header, item_lens, slot_bytes)

    def nccl_stop(self):
        if self.nccl is not None:
            staging, receiver, _ = self.nccl
            receiver.close()
            staging.close()
            self.nccl = None
        return ("ok",)

    def trace(self, on: bool):
        """The receiver's steps, timed (PairReceiver.trace) from now on; switched off, the steps recorded."""
        receiver = self.nccl[1]
        if on:
            self.trace_rows = []
            rows = self.trace_rows
            receiver.trace = lambda step, room: rows.append(("decode", step, room, time.monotonic()))
            return ("ok",)
        receiver.trace = None
        return ("trace", self.trace_rows)

    def _on_receiver(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the receiver's thread once everything queued before it was handled; its value."""
        done: "queue.Queue[object]" = queue.Queue()
        self.nccl[1].submit(lambda: done.put(fn()))
        return done.get(timeout=IO_TIMEOUT)

    def profile(self, on: bool, calls: int = 1):
        """The receiver thread's host time under cProfile from now on (enabled on that thread: cProfile profiles
        the thread that enables it); switched off, its rows per one of `calls` requests."""
        if on:
            self.recv_prof = cProfile.Profile()
            self._on_receiver(self.recv_prof.enable)
            return ("ok",)
        self._on_receiver(self.recv_prof.disable)
        return ("profile", profile_rows(self.recv_prof, calls, top=16))

    def mark(self):
        return ("landed", self._on_receiver(time.monotonic), list(self.nccl[2][:3]))

    def ref_recv(self, nbytes: int):
        """One contiguous receive of `nbytes` on the receiver's pair channel (it is idle between cases)."""
        comm = self.nccl[1].comm
        if self.ref_buf is None or self.ref_buf.numel() < nbytes:
            self.ref_buf = None
            self.ref_buf = self.transport.alloc_staging(nbytes)
        comm.recv(self.ref_buf[:nbytes]).wait(IO_TIMEOUT)
        if comm.stream is not None:
            comm.stream.synchronize()
        return ("landed", time.monotonic(), [])

    def serve(self) -> dict:
        from sglang_p2p_backend.engine.wire import messages

        served = 0
        while True:
            msg = expect(self.conn, ("pool", "zero", "hash", "nccl_start", "nccl_stop", "ctrl", "mark", "ref",
                                     "trace", "profile", "publish", "echo", "done"), IO_TIMEOUT * 3)
            kind, args = msg[0], msg[1:]
            served += 1
            if kind == "done":
                self.nccl_stop()
                if self.shm is not None:  # --quick: the stand-in's shared segments go with this process
                    self.pool = []
                    self.shm.close()
                return {"commands": served, "device": str(self.dev), "gil_switch_ms": sys.getswitchinterval() * 1e3}
            if kind == "ctrl":  # the prefill's control message for the pair channel: no answer, in order
                self.nccl[1].submit(messages.decode(args[0]))
                continue
            if kind == "echo":
                self.conn.send(("echo", args[0]))
                continue
            reply = {"pool": self.pool_cmd, "zero": self.zero, "nccl_start": self.nccl_start,
                     "nccl_stop": self.nccl_stop, "mark": self.mark, "ref": self.ref_recv, "trace": self.trace,
                     "profile": self.profile,
                     "publish": self.publish,
                     "hash": lambda ids: ("hash", pool_hash(self.pool, ids))}[kind](*args)
            self.conn.send(reply)


def decode_main(conn, cfg):
    return guarded(lambda c, f: Decode(c, f).serve(), conn, cfg)


# -- prefill: the driver ---------------------------------------------------------------------------------------

class Prefill:
    def __init__(self, conn, cfg: dict):
        self.torch, self.dev_t, _ = _setup(cfg["quick"], cfg["prefill_gpu"])
        self.dev = Dev(self.torch, self.dev_t)
        self.conn, self.cfg = conn, cfg
        self.deadline = time.monotonic() + cfg["budget_s"]
        self.skipped: list[str] = []
        self.out: dict = {"ipc": [], "same_gpu": [], "nccl": [], "nccl_phases": [], "interference": [], "fixed_cost": {}, "programs": []}
        self._refs: dict = {}
        self.rt = None
        if self.dev.cuda:
            from sglang_p2p_backend.engine.transport.cuda_ipc import CudaBackend

            self.rt = CudaBackend().rt

    # -- helpers
    def ask(self, *msg, want: str = "ok"):
        self.conn.send(msg)
        return expect(self.conn, (want,), IO_TIMEOUT)

    def budget(self, spans: int = 0) -> xc.Budget:
        if spans > MANY_SPANS:
            return xc.Budget(self.cfg["case_s"], min_reps=3, max_reps=10, warmup=1)
        return xc.Budget(self.cfg["case_s"], min_reps=5, max_reps=self.cfg["max_reps"])

    def time_left(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.skipped.append(what)
        return False

    def alloc_pool(self, shape: xc.Shape, pages: int) -> list:
        torch = self.torch
        g = torch.Generator(device=self.dev_t).manual_seed(35)
        return [torch.randint(0, 256, (pages, shape.item), dtype=torch.uint8, device=self.dev_t, generator=g)
                for _ in range(shape.regions)]

    def reference(self, nbytes: int, gpu: int) -> dict:
        """ONE copy of `nbytes` between contiguous buffers into the decode's GPU: cudaMemcpyPeerAsync (CUDA
        events and host call-to-sync), or a torch copy on CPU."""
        key = (nbytes, gpu)
        if key in self._refs:
            return self._refs[key]
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.dev_t).fill_(7)
        if not self.dev.cuda:
            dst = torch.empty_like(src)
            t = self.budget().run(lambda: host_seconds(lambda: dst.copy_(src)))
            self._refs[key] = {"what": "torch copy_ (CPU)", "gpu_us": xc.stats_us(t), "host_us": xc.stats_us(t)}
            return self._refs[key]
        import ctypes

        dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", gpu))
        stream = torch.cuda.Stream(device=self.dev_t)
        fn = self.rt.cudaMemcpyPeerAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        src_gpu = self.dev_t.index
        if gpu != src_gpu:  # direct peer copies over NVLink, as the mapped write has
            with torch.cuda.device(self.dev_t):
                code = self.rt.cudaDeviceEnablePeerAccess(ctypes.c_int(gpu), ctypes.c_uint(0))
            if code == PEER_ACCESS_ALREADY_ENABLED:
                # the mapping enabled it already. The runtime also records the refusal as this thread's last
                # error, and torch's next kernel launch check would raise it ("peer access is already
                # enabled", the 2 x H100 failure): reset it, as torch does after its own enable
                self.rt.cudaGetLastError()
            elif code:
                raise RuntimeError(f"cudaDeviceEnablePeerAccess({gpu}) failed: error {code}")

        def copy() -> None:
            code = fn(dst.data_ptr(), gpu, src.data_ptr(), src_gpu, nbytes, stream.cuda_stream)
            if code:
                raise RuntimeError(f"cudaMemcpyPeerAsync failed: error {code}")

        self.dev.sync()
        ev = self.budget().run(lambda: self.dev.gpu_seconds(copy, stream))
        host = self.budget().run(lambda: host_seconds(lambda: (copy(), stream.synchronize())))
        del src, dst
        self._refs[key] = {"what": f"cudaMemcpyPeerAsync cuda:{src_gpu} -> cuda:{gpu}", "gpu_us": xc.stats_us(ev),
                           "host_us": xc.stats_us(host)}
        return self._refs[key]

    # -- the same-host write path
    def map_pool(self, shape: xc.Shape, dst_pages: int, gpu: int):
        import msgspec

        from sglang_p2p_backend.engine.wire import messages

        _, blob, ptrs = self.ask("pool", shape.__dict__, dst_pages, gpu, want="pool")
        export = msgspec.msgpack.decode(blob, type=messages.IpcExport)
        # mapped from a thread of its own, as the prefill's control thread maps a decode in SGLang: what the
        # runtime leaves as that thread's last CUDA error stays out of this (measuring) thread
        failed: list = []
        seen = [("before the mapping", self.last_error())]
        t = threading.Thread(target=lambda: _catch(failed, self.tr.open_peer, SESSION, export))
        t.start()
        t.join()
        if failed:
            raise failed[0]
        seen.append(("mapped (in another thread)", self.last_error()))
        if self.dev.cuda:
            self.torch.cuda.synchronize(self.dev_t)
            seen.append(("after a synchronize", self.last_error()))
            # pinned and pageable copies apart: a CUDA error the mapping left pending shows at the first step
            # that checks the runtime's last error
            probe = self.torch.zeros(4, dtype=self.torch.int64)
            probe.pin_memory().to(self.dev_t, non_blocking=True)
            self.torch.cuda.synchronize(self.dev_t)
            seen.append(("after a pinned copy to the GPU", self.last_error()))
            probe.to(self.dev_t)
            seen.append(("after a pageable copy to the GPU", self.last_error()))
            try:  # a first kernel here: a runtime error left behind by the mapping shows now, named
                self.torch.zeros(1, device=self.dev_t).add_(1)
                seen.append(("first kernel", "ran"))
            except Exception as e:  # noqa: BLE001 - recorded, and the run goes on (torch's check reset it)
                seen.append(("first kernel", str(e).splitlines()[0]))
        print(f"[xfer] mapping the decode's pool on cuda:{gpu}: {seen}", flush=True)
        self.out.setdefault("mapping_errors", []).append(seen)
        return ptrs

    def trace(self, step: str) -> None:
        """Record (and print) a CUDA runtime error left pending at `step`, without resetting it: the next torch
        kernel launch would raise it far from its cause (on 2 x H100 a "peer access is already enabled" that the
        reference copy's own enable left behind did so)."""
        code = self.last_error()
        if code:
            self.out.setdefault("cuda_errors", []).append((step, code))
            print(f"[xfer] CUDA error {code} pending at {step}", flush=True)

    def last_error(self) -> int:
        """The CUDA runtime's last error of this thread, not reset (0 on CPU)."""
        return int(self.rt.cudaPeekAtLastError()) if self.rt is not None else 0

    def ipc_prepare(self, case: xc.Case, pool: list, dst_ptrs: list, dst_pages: int, gpu: int) -> PreparedWrite:
        from sglang_p2p_backend.engine.copy.ce_plan import page_chunk_shape, page_spans, split_runs, thresholds
        from sglang_p2p_backend.engine.copy.plan import page_runs

        shape = case.shape
        src_pages = pool[0].shape[0]
        src_ids, dst_ids = xc.page_ids(case, src_pages, dst_pages)
        want = pool_hash(pool, src_ids, self.trace)
        bases, items = [t.data_ptr() for t in pool], [shape.item] * shape.regions
        plan = self.tr.plan_pages(SESSION, bases, dst_ptrs, items, src_ids, dst_ids, src_pages, dst_pages)
        spans = {"copy_engine": int(page_spans(*plan)[2].size), "kernel": page_chunk_shape(src_ids, dst_ids, items)[0]}
        # split's pieces at the shipped thresholds across GPUs: its copy-engine runs and kernel runs, a span a region
        limit, min_span = thresholds()
        cut = split_runs(page_runs(src_ids, dst_ids)[:, 2], items, min_span, limit)
        spans["split"] = (cut.picked.size + cut.kernel_runs) * shape.regions
        args = (SESSION, bases, dst_ptrs, items, src_ids, dst_ids, src_pages, dst_pages)
        write = lambda: self.tr.write_pages(*args)  # noqa: E731
        return PreparedWrite(case, gpu, dst_ids, want, spans, write, self.reference(shape.nbytes(case.tokens), gpu),
                             args)

    def ipc_write(self, w: PreparedWrite, mode: str) -> dict:
        """Time `w`'s write in `mode` (into zeroed pages), then check every destination page it wrote."""
        self.ask("zero", w.dst_ids)
        self.tr.copy_engine = TRANSPORT_MODE[mode]
        times = self.budget(engine_spans(mode, w.spans[mode])).run(lambda: host_seconds(w.write))
        return self._ipc_row(w, mode, times, self._bad_pages(w))

    def _bad_pages(self, w: PreparedWrite) -> int:
        """How many of `w`'s destination pages do not hold the source's bytes now."""
        _, got = self.ask("hash", w.dst_ids, want="hash")
        return int(np.count_nonzero(got != w.want))

    def _ipc_row(self, w: PreparedWrite, mode: str, times: list[float], bad_pages: int) -> dict:
        case, spans = w.case, w.spans[mode]
        nbytes = case.shape.nbytes(case.tokens)
        t = xc.stats_us(times)
        return {"case": case.name, "shape": case.shape.name, "tokens": case.tokens, "dest": case.dest,
                "mode": mode, "decode_gpu": w.gpu, "bytes": nbytes, "pages": int(w.dst_ids.size),
                "spans": spans, "mean_span": nbytes / max(spans, 1), "write_us": t,
                "write_gbps": nbytes / t["p50"] / 1e3, "ref": w.ref,
                "ratio": xc.ratio(w.ref["gpu_us"]["p50"], t["p50"]), "bad_pages": bad_pages}

    def ipc_case(self, case: xc.Case, pool: list, dst_ptrs: list, dst_pages: int, gpu: int) -> list[dict]:
        w = self.ipc_prepare(case, pool, dst_ptrs, dst_pages, gpu)
        modes = self.cfg.get("ipc_modes", IPC_MODES)
        if self.cfg.get("interleave"):
            rows = self.ipc_interleaved(w, modes) if self.time_left(f"ipc {case.name} interleaved (gpu {gpu})") else []
        else:
            rows = [self.ipc_write(w, mode) for mode in modes if self.time_left(f"ipc {case.name} {mode} (gpu {gpu})")]
        self.tr.copy_engine = "off"
        return rows

    def ipc_interleaved(self, w: PreparedWrite, modes: Sequence[str]) -> list[dict]:
        """--interleave: `w`'s write in each of `modes` in turn, one write a mode a round, so whatever drifts while a
        case runs (clocks, another process) weighs on every mode alike; each mode's bytes checked after a write of
        its own into zeroed pages first, and its write step by step after (`route_steps`). Session 34 had `split`
        117-450 us slower than the kernel on chunks where both launch the same kernel, each timed in a block of its
        own after the other's."""
        modes = list(dict.fromkeys(modes))
        bad = {}
        for mode in modes:
            self.ask("zero", w.dst_ids)
            self.tr.copy_engine = TRANSPORT_MODE[mode]
            w.write()
            bad[mode] = self._bad_pages(w)
        times: dict[str, list[float]] = {m: [] for m in modes}
        idle, idled = self.cfg.get("idle_ms", 0.0) / 1e3, {m: 0 for m in modes}

        def one_round() -> float:
            spent = 0.0
            for m in modes:
                self.tr.copy_engine = TRANSPORT_MODE[m]
                if idle:  # --idle-ms: the GPUs and the link left idle first, as between requests at concurrency 1
                    time.sleep(idle)
                    idled[m] += 1
                times[m].append(host_seconds(w.write))
                spent += times[m][-1]
            return spent

        b = self.budget(max(engine_spans(m, w.spans[m]) for m in modes))
        b.run(one_round)
        rows = []
        for m in modes:
            row = self._ipc_row(w, m, times[m][b.warmup:], bad[m])
            row["interleaved"] = True
            row["idle_ms"], row["idle_waits"] = self.cfg.get("idle_ms", 0.0), idled[m]
            if self.dev.cuda:
                row["steps_us"] = self.route_steps(w.args, m)
            rows.append(row)
        return rows

    # -- the kernel's grid
    def programs_section(self, shape: xc.Shape, pool: list, dst_ptrs: list, dst_pages: int) -> None:
        """--programs: each PROGRAMS_CASE request with the page kernel's grid bounded to each value (on CPU the
        stand-in has no grid: the rows only walk the driver)."""
        gpu = self.cfg["decode_gpu"]
        if self.dev.cuda:  # the grid every other row ran with, for comparison
            from sglang_p2p_backend.engine.transport.cuda_ipc import backend

            from sglang_p2p_backend.engine.copy.span_copy import default_programs

            sms = backend()._copiers(self.dev_t).pages.sms  # noqa: SLF001
            # the kernel's loop step: a page of a region up to 8 KiB (MHA page 16: 32 KiB items, 8 KiB steps; page 1:
            # 2 KiB, 4 programs an SM)
            self.out["programs_default"] = default_programs(sms, min(8 * 1024, shape.item))
        for tokens in programs_tokens(self.cfg["tokens"], self.cfg["programs_case"][1]):
            for dest in self.cfg["dests"]:
                case = xc.Case(shape, tokens, dest)
                w: Optional[PreparedWrite] = None
                for n in self.cfg["programs"]:
                    if not self.time_left(f"programs {case.name} {n}"):
                        continue
                    w = w or self.ipc_prepare(case, pool, dst_ptrs, dst_pages, gpu)
                    self.out["programs"].append(self.programs_row(w, n))
        self.tr.programs = None

    def programs_row(self, w: PreparedWrite, programs: int) -> dict:
        """The kernel's write time with its grid bounded to `programs`, then a matmul's slowdown beside it."""
        self.tr.programs = programs
        row = self.ipc_write(w, "kernel")
        beside = self.interference("kernel", w.write, row["bytes"])
        row.update({k: v for k, v in beside.items() if k != "mode"}, programs=programs)
        return row

    # -- the NCCL path
    def nccl_open(self, pool: list, overlap: bool, slot_bytes: int, first_chunk: Optional[int] = None):
        """A pair channel's sender with staging slots of `slot_bytes` on both ends (a chunk is one slot at most),
        its transfers' first chunks capped at `first_chunk` bytes (None: SGLANG_P2P_FIRST_CHUNK_MB)."""
        from sglang_p2p_backend.engine.config import EngineConfig
        from sglang_p2p_backend.engine.copy.copier import PageCopier
        from sglang_p2p_backend.engine.pair.pipeline import PairSender
        from sglang_p2p_backend.engine.pair.staging import StagingPool
        from sglang_p2p_backend.engine.transport import two_sided_transport
        from sglang_p2p_backend.engine.wire import messages

        cfg = EngineConfig.from_env()
        if getattr(self, "two_sided", None) is None:
            self.two_sided = two_sided_transport("auto", self.dev_t, "127.0.0.1", cfg)
        self.ask("nccl_start", slot_bytes, cfg.staging_slots, overlap)
        self.staging = StagingPool(self.two_sided.alloc_staging, slot_bytes, cfg.staging_slots)
        self.sender = PairSender(transport=self.two_sided, staging=self.staging, copier=PageCopier([pool]),
                                 local_session="prefill:0",
                                 control=lambda m: self.conn.send(("ctrl", messages.encode(m))),
                                 connect_timeout=IO_TIMEOUT, io_timeout=IO_TIMEOUT, overlap=overlap,
                                 first_chunk=cfg.first_chunk_bytes if first_chunk is None else first_chunk)
        self.room = 1000

    def nccl_close(self):
        self.sender.close()
        self.staging.close()
        self.ask("nccl_stop")

    def nccl_send(self, src_ids, dst_ids, sync: bool = True, prof: Optional[cProfile.Profile] = None) -> float:
        """send() to the decode's last scatter (CLOCK_MONOTONIC is shared by the processes of a host); `sync`
        first waits for everything queued on this GPU (not while the interference loop runs beside it); `prof`
        profiles send() alone."""
        self.room += 1
        if sync:
            self.dev.sync()
        t0 = time.monotonic()
        if prof is not None:
            prof.enable()
        try:
            self.sender.send(self.room, 0, [src_ids], [dst_ids])
        finally:
            if prof is not None:
                prof.disable()
        _, landed, errors = self.ask("mark", want="landed")
        if errors:
            raise RuntimeError(f"the decode's receiver failed chunks: {errors}")
        return landed - t0

    def nccl_ref(self, nbytes: int) -> float:
        """ONE contiguous send of `nbytes` on the same pair channel, to the decode's receive completing."""
        if getattr(self, "ref_send", None) is None or self.ref_send.numel() < nbytes:
            self.ref_send = None
            self.ref_send = self.two_sided.alloc_staging(nbytes)
        comm = self.sender.comm
        self.conn.send(("ref", nbytes))
        t0 = time.monotonic()
        comm.send(self.ref_send[:nbytes]).wait(IO_TIMEOUT)
        _, landed, _ = expect(self.conn, ("landed",), IO_TIMEOUT)
        return landed - t0

    def nccl_case(self, case: xc.Case, pool: list, dst_pages: int) -> Optional[dict]:
        if not self.time_left(f"nccl {case.name}"):
            return None
        src_ids, dst_ids = xc.page_ids(case, pool[0].shape[0], dst_pages)
        want = pool_hash(pool, src_ids)
        self.ask("zero", dst_ids)
        self.ask("publish", dst_ids)
        times = self.budget().run(lambda: self.nccl_send(src_ids, dst_ids))
        _, got = self.ask("hash", dst_ids, want="hash")
        nbytes = case.shape.nbytes(case.tokens)
        ref = self.budget().run(lambda: self.nccl_ref(nbytes))
        w, r = xc.stats_us(times), xc.stats_us(ref)
        return {"case": case.name, "shape": case.shape.name, "tokens": case.tokens, "dest": case.dest,
                "bytes": nbytes, "send_us": w, "send_gbps": nbytes / w["p50"] / 1e3, "contiguous_send_us": r,
                "ratio": xc.ratio(r["p50"], w["p50"]), "bad_pages": int(np.count_nonzero(got != want))}

    def nccl_phases(self, case: xc.Case, pool: list, dst_pages: int) -> Optional[dict]:
        """Where one request's time goes on the NCCL path, as deployed (the channel of the last pass): every step
        of every chunk on both ends (PairSender / PairReceiver's trace), the median offset from send()'s start."""
        if not self.time_left(f"nccl phases {case.name}"):
            return None
        src_ids, dst_ids = xc.page_ids(case, pool[0].shape[0], dst_pages)
        self.ask("publish", dst_ids)
        events: list = []
        self.sender.trace = lambda step, room: events.append(("prefill", step, room, time.monotonic()))
        self.ask("trace", True)
        try:
            times = self.budget().run(lambda: self.nccl_send(src_ids, dst_ids))
        finally:
            self.sender.trace = None
            _, theirs = self.ask("trace", False, want="trace")
        # each end's host time, function by function: the prefill's in send(), the decode's receiver thread over
        # the same requests (the time a thread waits is in its sleeps and queue gets)
        prof = cProfile.Profile()
        self.ask("profile", True)
        try:
            for _ in range(PHASE_PROFILE_CALLS):
                self.nccl_send(src_ids, dst_ids, prof=prof)
        finally:
            _, recv_rows = self.ask("profile", False, PHASE_PROFILE_CALLS, want="profile")
        return {"case": case.name, "bytes": case.shape.nbytes(case.tokens), "chunks_slot_mib": self.staging.slot_bytes >> 20,
                "send_us": xc.stats_us(times), "phases_us": xc.phase_offsets(events + [tuple(e) for e in theirs]),
                "send_profile": profile_rows(prof, PHASE_PROFILE_CALLS, top=16), "recv_profile": recv_rows}

    # -- interference
    def cpu_loop(self) -> Callable[[], float]:
        """On CPU (--quick): a small float32 matmul loop's host time, the stand-in of the GPU loop."""
        torch = self.torch
        a = torch.randn(256, 256)
        b = torch.randn_like(a)

        def loop() -> float:
            t0 = time.perf_counter()
            for _ in range(20):
                a.matmul(b)
            return time.perf_counter() - t0

        return loop

    def interference(self, label: str, write: Callable[[], Any], nbytes: int) -> dict:
        """The matmul loop on a stream of its own of the prefill GPU (a forward pass beside the transfers; the
        transfer thread's copies wait for the work on ITS current stream only, so they overlap it), launched
        and as a CUDA graph (interference.py), alone and beside back-to-back writes."""
        if self.dev.cuda:
            r = beside_writes(self.torch, self.dev_t, write, reps=5, join_timeout=IO_TIMEOUT)
        else:
            c = during_writes(self.cpu_loop(), write, reps=5, join_timeout=IO_TIMEOUT)
            a, b = float(np.median(c.alone)), float(np.median(c.busy))
            r = {"matmul_ms_alone": a * 1e3, "matmul_ms_during": b * 1e3, "slowdown": b / a - 1,
                 "slowdown_graph": None, "writes_during": c.writes, "wall_s": c.wall_s, "error": c.error}
        r["write_gbps_during"] = r["writes_during"] * nbytes / r.pop("wall_s") / 1e9
        return {"mode": label, **r}

    # -- fixed cost of one small request
    def fixed_ipc(self, shape: xc.Shape, pool: list, dst_ptrs: list, dst_pages: int) -> dict:
        from sglang_p2p_backend.engine.copy.ce_plan import page_spans
        from sglang_p2p_backend.engine.transport.cuda_ipc import backend
        from sglang_p2p_backend.engine.wire import messages

        torch = self.torch
        case = xc.Case(shape, 128, "scattered")
        src_pages = pool[0].shape[0]
        src_ids, dst_ids = xc.page_ids(case, src_pages, dst_pages)
        bases, items = [t.data_ptr() for t in pool], [shape.item] * shape.regions
        args = (SESSION, bases, dst_ptrs, items, src_ids, dst_ids, src_pages, dst_pages)
        b = self.budget()
        b.max_reps, b.min_reps = max(b.max_reps, 200), 50
        out: dict = {"case": case.name, "pages": int(src_ids.size), "regions": shape.regions}
        out["plan_us"] = xc.stats_us(b.run(lambda: host_seconds(lambda: self.tr.plan_pages(*args))))
        # the whole write as the service takes it: the default route (split), which leaves these pages to the kernel
        self.tr.copy_engine = out["mode"] = COPY_ENGINE_MODES[0]
        out["write_us"] = xc.stats_us(b.run(lambda: host_seconds(lambda: self.tr.write_pages(*args))))
        out["write_profile"] = host_profile(lambda: self.tr.write_pages(*args))
        self.tr.copy_engine = "off"
        plan = self.tr.plan_pages(*args)
        if self.dev.cuda:
            c = backend()._copiers(self.dev_t)  # noqa: SLF001 - the path write_pages takes
            pages, stream = c.pages, c.stream
            launch, sync = [], []

            def one() -> None:
                backend().ordered(self.dev_t)
                pages.copy(*plan, stream)

            b.run(_call_then_sync(one, stream, launch, sync))
            out["stage_upload_launch_host_us"] = xc.stats_us(launch)
            out["sync_host_us"] = xc.stats_us(sync)
            n = 2 * int(src_ids.size) + 4 * shape.regions
            host = torch.empty(n, dtype=torch.int64).pin_memory()
            devbuf = torch.empty(n, dtype=torch.int64, device=self.dev_t)
            out["upload_gpu_us"] = xc.stats_us(b.run(lambda: self.dev.gpu_seconds(
                lambda: devbuf.copy_(host, non_blocking=True), stream)))

            def kernel() -> float:  # upload + kernel on the GPU, queued behind a sleep so host time is hidden
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(2_000_000)
                return self.dev.gpu_seconds(lambda: pages.copy(*plan, stream), stream)

            out["upload_kernel_gpu_us"] = xc.stats_us(b.run(kernel))
            engines = backend().copy_engines()
            spans = page_spans(*plan)
            out["ce_abi"] = engines.abi
            out["ce_plan_us"] = xc.stats_us(b.run(lambda: host_seconds(
                lambda: page_spans(*self.tr.plan_pages(*args)))))
            ce_call, ce_sync = [], []

            def ce_one() -> None:
                backend().queue_copy_engines(c, *spans)

            b.run(_call_then_sync(ce_one, stream, ce_call, ce_sync))
            out["ce_call_host_us"], out["ce_sync_host_us"] = xc.stats_us(ce_call), xc.stats_us(ce_sync)
            out["ce_spans"] = int(spans[2].size)
            self.tr.copy_engine = "on"
            out["ce_write_us"] = xc.stats_us(b.run(lambda: host_seconds(lambda: self.tr.write_pages(*args))))
            self.tr.copy_engine = "off"
            out["steps_us"] = self.write_timelines(args)
        aux = messages.AuxData(SESSION, 7, 3, [bytes(64)])
        status = messages.Status(SESSION, 7, 0, 2)
        out["control_encode_us"] = xc.stats_us(b.run(lambda: host_seconds(
            lambda: (messages.encode(aux), messages.encode(status)))))

        def echo() -> float:
            t0 = time.perf_counter()
            self.conn.send(("echo", messages.encode(status)))
            expect(self.conn, ("echo",), IO_TIMEOUT)
            return (time.perf_counter() - t0) / 2

        out["control_one_way_us"] = xc.stats_us(b.run(echo))
        # what the prefill spends on a 128-token request before Status is on its way: the write, then the aux
        # row and Status encoded and sent (two messages)
        out["end_to_end_us"] = (out["write_us"]["p50"] + out["control_encode_us"]["p50"]
                                + 2 * out["control_one_way_us"]["p50"])
        return out

    def write_timelines(self, args: tuple) -> dict:
        """Both routes of `write_pages(*args)` as the transport takes them, step by step (`host_timeline`): the
        checks and translation, the grid and the default route's plan (split: the kernel's whole chunk for these
        requests) or the copy-engine spans, the wait for the forward's stream, the
        kernel's launch (inside it: the pinned ids and table, the device and stream set, the upload queued, the
        Triton launch) or the copy-engine call, and the wait for the copy."""
        from sglang_p2p_backend.engine.copy.ce_plan import page_chunk_shape, page_spans
        from sglang_p2p_backend.engine.copy.plan import page_runs, run_breaks
        from sglang_p2p_backend.engine.transport.cuda_ipc import backend

        c = backend()._copiers(self.dev_t)  # noqa: SLF001 - the path write_pages takes
        box: dict = {}
        kernel = self._kernel_steps(args, box, split=True)
        shared = dict(kernel)  # the checks, the wait for the forward's stream and for the copy: the same on both

        def rule() -> None:  # what copy_pages finds of the ids for the per-chunk rule, on either route
            p = box["plan"]
            box["breaks"] = run_breaks(p.src_ids, p.dst_ids)
            box["shape"] = page_chunk_shape(p.src_ids, p.dst_ids, p.item_bytes, box["breaks"])

        def spans() -> None:
            rule()
            p = box["plan"]
            box["spans"] = page_spans(*p, runs=page_runs(p.src_ids, p.dst_ids, box["breaks"]))

        def ce_call() -> None:
            backend().queue_copy_engines(c, *box["spans"])

        ce = [("planned", shared["planned"]), ("spans", spans), ("waited", shared["waited"]), ("called", ce_call),
              ("synchronized", shared["synchronized"])]
        return {"kernel": host_timeline(kernel, self.budget(), copier=c.pages),
                "copy_engine": host_timeline(ce, self.budget())}

    def _kernel_steps(self, args: tuple, box: dict, split: bool) -> list[tuple[str, Callable[[], Any]]]:
        """`host_timeline`'s steps of a `write_pages(*args)` the kernel copies whole: the checks and translation,
        the grid and (`split`) split's plan, the wait for the forward's stream, the launch, the wait for the copy;
        `box` keeps what one step hands the next."""
        from sglang_p2p_backend.engine.transport.cuda_ipc import backend

        c = backend()._copiers(self.dev_t)  # noqa: SLF001 - the path write_pages takes

        def plan() -> None:
            box["plan"] = self.tr.plan_pages(*args)

        def route() -> None:  # what write_pages does between the plan and the copy
            p, same = box["plan"], self.tr._same_gpu(SESSION)  # noqa: SLF001
            box["grid"] = self.tr._grid(same, p.item_bytes)  # noqa: SLF001
            if split:
                box["route"] = self.tr.split_route(p, same)

        return [("planned", plan), ("routed", route), ("waited", lambda: backend().ordered(self.dev_t)),
                ("returned", lambda: c.pages.copy(*box["plan"], c.stream, box["grid"])),
                ("synchronized", lambda: c.ops.synchronize(c.stream.cuda_stream))]

    def route_steps(self, args: tuple, mode: str) -> dict:
        """`mode`'s write of `args` step by step (`_kernel_steps`) where it launches the kernel alone: always under
        `kernel`, under `split` where its plan leaves the whole chunk to the kernel; {} otherwise."""
        from sglang_p2p_backend.engine.transport.cuda_ipc import backend

        if mode == "split":
            p = self.tr.plan_pages(*args)
            if self.tr.split_route(p, self.tr._same_gpu(SESSION)).engines_take_any:  # noqa: SLF001
                return {}
        elif mode != "kernel":
            return {}
        return host_timeline(self._kernel_steps(args, {}, split=mode == "split"), self.budget(),
                             copier=backend()._copiers(self.dev_t).pages)  # noqa: SLF001

    def fixed_large(self, shape: xc.Shape, pool: list, dst_ptrs: list, dst_pages: int) -> dict:
        """What a 4k-token contiguous request's write spends beside the copy: on each route, the whole
        `write_pages` (host time from call to return) against the same copy's GPU time alone (queued behind a
        sleep, so no host time shows in it); `host_us` is the difference, where the 0.85-of-the-link target is
        lost at 4k. With the write under cProfile. On CPU (--quick) only the writes are timed."""
        from sglang_p2p_backend.engine.copy.ce_plan import page_spans
        from sglang_p2p_backend.engine.transport.cuda_ipc import backend

        torch = self.torch
        src_pages = pool[0].shape[0]
        tokens = max([t for t in self.cfg["tokens"] if t <= LARGE_FIXED_TOKENS] or [0])
        case = xc.Case(shape, tokens, "contiguous")
        if not tokens or shape.pages(tokens) > min(src_pages, dst_pages):
            return {}
        src_ids, dst_ids = xc.page_ids(case, src_pages, dst_pages)
        bases, items = [t.data_ptr() for t in pool], [shape.item] * shape.regions
        args = (SESSION, bases, dst_ptrs, items, src_ids, dst_ids, src_pages, dst_pages)
        plan = self.tr.plan_pages(*args)
        out: dict = {"case": case.name, "mib": shape.nbytes(tokens) / 2**20}
        gpu_copies: dict[str, Callable[[], Any]] = {}
        if self.dev.cuda:
            c = backend()._copiers(self.dev_t)  # noqa: SLF001 - the path write_pages takes
            pages, stream, engines, spans = c.pages, c.stream, backend().copy_engines(), page_spans(*plan)
            grid = self.tr._grid(self.tr._same_gpu(SESSION), plan.item_bytes)  # noqa: SLF001 - the grid write_pages passes
            gpu_copies = {"kernel": lambda: pages.copy(*plan, stream, grid),
                          "copy_engine": lambda: engines.copy(*spans, stream.cuda_stream)}
        for mode in IPC_MODES:
            self.tr.copy_engine = "off" if mode == "kernel" else "on"
            b = self.budget()
            row: dict = {"write_us": xc.stats_us(b.run(lambda: host_seconds(lambda: self.tr.write_pages(*args))))}
            if mode in gpu_copies:
                copy = gpu_copies[mode]

                def gpu() -> float:
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time ahead: the launch's host time hides
                    with torch.cuda.device(self.dev_t):
                        return self.dev.gpu_seconds(copy, stream)

                row["gpu_us"] = xc.stats_us(b.run(gpu))
                row["host_us"] = row["write_us"]["p50"] - row["gpu_us"]["p50"]
                row["write_profile"] = host_profile(lambda: self.tr.write_pages(*args), calls=30)
            out[mode] = row
        self.tr.copy_engine = "off"
        if self.dev.cuda:
            for mode, steps in self.write_timelines(args).items():
                out[mode]["steps_us"] = steps
        return out

    def fixed_nccl_plan(self, shape: xc.Shape) -> dict:
        from sglang_p2p_backend.engine.config import EngineConfig
        from sglang_p2p_backend.engine.copy.plan import plan_chunks
        from sglang_p2p_backend.engine.pair.pipeline import _segment_msg
        from sglang_p2p_backend.engine.wire import messages

        case = xc.Case(shape, 128, "scattered")
        src_ids, dst_ids = xc.page_ids(case, *xc.pool_pages(shape, self.cfg["tokens"]))
        slot = EngineConfig.from_env().slot_bytes

        def plan() -> None:
            for c in plan_chunks([[shape.item] * shape.regions], [len(src_ids)], slot):
                segs = [_segment_msg(s, [dst_ids]) for s in c.segments]
                messages.encode(messages.ChunkHeader("prefill:0", 1, 7, 0, 0, c.nbytes, segs))

        return {"case": case.name, "plan_and_header_us": xc.stats_us(self.budget().run(lambda: host_seconds(plan)))}

    # -- the run
    def run(self) -> dict:
        from sglang_p2p_backend.engine.transport.cuda_ipc import CudaIpcTransport

        sections = self.cfg["sections"]
        self.tr = CudaIpcTransport(self.dev_t)
        two_gpus = self.cfg["decode_gpu"] != self.cfg["prefill_gpu"]
        for shape_d in self.cfg["shapes"]:
            shape = _shape(shape_d)
            src_pages, dst_pages = xc.pool_pages(shape, self.cfg["tokens"])
            pool = self.alloc_pool(shape, src_pages)
            shape_cases = [c for c in xc.cases([shape], self.cfg["tokens"], self.cfg["dests"])]
            if {"ipc", "fixed", "interference"} & sections:
                dst_ptrs = self.map_pool(shape, dst_pages, self.cfg["decode_gpu"])
                if "ipc" in sections:
                    for case in shape_cases:
                        self.out["ipc"].extend(self.ipc_case(case, pool, dst_ptrs, dst_pages, self.cfg["decode_gpu"]))
                if "fixed" in sections and shape.name in FIXED_SHAPES and self.time_left(f"fixed {shape.name}"):
                    self.out["fixed_cost"][shape.name] = self.fixed_ipc(shape, pool, dst_ptrs, dst_pages)
                    self.out["fixed_cost"][shape.name]["nccl"] = self.fixed_nccl_plan(shape)
                    if self.time_left(f"fixed {shape.name} {LARGE_FIXED_TOKENS}"):
                        self.out["fixed_cost"][shape.name]["large"] = self.fixed_large(shape, pool, dst_ptrs, dst_pages)
                if "interference" in sections and shape.name == self.cfg["interference_shape"]:
                    tokens = max(t for t in self.cfg["tokens"] if t <= INTERFERENCE_CASE[1])
                    for dest in self.cfg["dests"]:
                        case = xc.Case(shape, tokens, dest)
                        s_ids, d_ids = xc.page_ids(case, src_pages, dst_pages)
                        bases, items = [t.data_ptr() for t in pool], [shape.item] * shape.regions
                        for mode in self.cfg.get("ipc_modes", IPC_MODES):
                            if not self.time_left(f"interference {case.name} {mode}"):
                                continue
                            self.tr.copy_engine = TRANSPORT_MODE[mode]
                            row = self.interference(mode, lambda: self.tr.write_pages(
                                SESSION, bases, dst_ptrs, items, s_ids, d_ids, src_pages, dst_pages),
                                shape.nbytes(tokens))
                            row["case"] = case.name
                            self.out["interference"].append(row)
                        self.tr.copy_engine = "off"
                if self.cfg["programs"] and shape.name == self.cfg["programs_case"][0] and {"ipc", "interference"} & sections:
                    self.programs_section(shape, pool, dst_ptrs, dst_pages)
                self.tr.forget_peer(SESSION)
                if "ipc" in sections and two_gpus:
                    same = [c for c in shape_cases if (shape.name, c.tokens) in SAME_GPU]
                    if same:
                        dst_ptrs = self.map_pool(shape, dst_pages, self.cfg["prefill_gpu"])
                        for case in same:
                            self.out["same_gpu"].extend(
                                self.ipc_case(case, pool, dst_ptrs, dst_pages, self.cfg["prefill_gpu"]))
                        self.tr.forget_peer(SESSION)
            if "nccl" in sections and (two_gpus or not self.dev.cuda):
                # the decode's pool of this shape on its own GPU (the same-GPU pass above replaced it)
                self.map_pool(shape, dst_pages, self.cfg["decode_gpu"])
                self.tr.forget_peer(SESSION)
                # each case without the engine's overlap (gather / scatter beside the transfer), then with it, as
                # deployed: that channel stays open for the interference loop below
                # --slot-mib: then with the overlap at each other slot size (fewer, larger chunks a request);
                # --first-chunk-mib: at each other first-chunk cap (rows named by it; the configured one's are not)
                from sglang_p2p_backend.engine.config import EngineConfig

                env_cfg = EngineConfig.from_env()
                default_slot = env_cfg.slot_bytes
                self.out["nccl_slot_mib_default"] = default_slot >> 20
                self.out["nccl_first_chunk_mib_default"] = env_cfg.first_chunk_mb
                passes = [(False, default_slot, None), *((True, mib << 20, None) for mib in self.cfg["slot_mib"]
                                                         if mib << 20 != default_slot),
                          *((True, default_slot, mib) for mib in self.cfg.get("first_chunk_mib", [])
                            if mib != env_cfg.first_chunk_mb), (True, default_slot, None)]
                for i, (overlap, slot, first_mib) in enumerate(passes):
                    self.nccl_open(pool, overlap, slot, None if first_mib is None else first_mib << 20)
                    named = {} if first_mib is None else {"first_chunk_mib": first_mib}
                    for case in shape_cases:
                        row = self.nccl_case(case, pool, dst_pages)
                        if row:
                            self.out["nccl"].append({**row, "overlap": overlap, "slot_mib": slot >> 20, **named})
                    if i < len(passes) - 1:
                        self.nccl_close()
                for case in shape_cases:  # the steps of a request of one and of several chunks, as deployed
                    if case.tokens in PHASE_TOKENS and case.dest == "scattered":
                        row = self.nccl_phases(case, pool, dst_pages)
                        if row:
                            self.out["nccl_phases"].append(row)
                if "interference" in sections and shape.name == self.cfg["interference_shape"] and self.time_left("interference nccl"):
                    tokens = max(t for t in self.cfg["tokens"] if t <= INTERFERENCE_CASE[1])
                    case = xc.Case(shape, tokens, "scattered")
                    s_ids, d_ids = xc.page_ids(case, src_pages, dst_pages)
                    self.ask("publish", d_ids)
                    row = self.interference("nccl", lambda: self.nccl_send(s_ids, d_ids, sync=False),
                                           shape.nbytes(tokens))
                    row["case"] = case.name
                    self.out["interference"].append(row)
                self.nccl_close()
            elif "nccl" in sections and shape_d is self.cfg["shapes"][0]:
                self.skipped.append("nccl: needs two GPUs (NCCL cannot join two ranks of one GPU on one host)")
            del pool
            if self.dev.cuda:
                self.torch.cuda.empty_cache()
        self.tr.close()  # unmapped before the decode frees its pools
        if getattr(self, "two_sided", None) is not None:
            self.two_sided.close()
        self.conn.send(("done",))
        self.out["skipped"] = self.skipped
        self.out["gil_switch_ms"] = sys.getswitchinterval() * 1e3  # this process's, as the service sets it
        return self.out


def prefill_main(conn, cfg):
    return guarded(lambda c, f: Prefill(c, f).run(), conn, cfg)


# -- host planning alone ----------------------------------------------------------------------------------------

def plan_section(shapes, tokens, reps_s: float, dests=xc.DESTS) -> list[dict]:
    """Per-request host planning of each path, no device and no memory behind the addresses: the IPC page
    write's checks and translation, `split`'s route (across GPUs), the copy-engine spans, the one-sided descriptors, the NCCL chunk plan and
    headers. Also MLA at 4k scattered with 8 to 128 layers."""
    import types

    from sglang_p2p_backend.engine.config import EngineConfig
    from sglang_p2p_backend.engine.copy.ce_plan import page_chunk_shape, page_spans, route_split, thresholds
    from sglang_p2p_backend.engine.copy.plan import copy_descriptors, plan_chunks
    from sglang_p2p_backend.engine.copy.span_copy import plan_tiles
    from sglang_p2p_backend.engine.pair.pipeline import _segment_msg
    from sglang_p2p_backend.engine.transport.cuda_ipc import CudaIpcTransport, RegionTable
    from sglang_p2p_backend.engine.wire import messages
    from sglang_p2p_backend.engine.wire.messages import IpcRegion

    slot = EngineConfig().slot_bytes
    limit, min_span = thresholds()
    rows = []
    extra = [xc.Case(xc.Shape(f"mla_p64_{n}layers", n, 1152, 64), 4096, "scattered") for n in (8, 32, 128)]
    for case in xc.cases(shapes, tokens, dests) + extra:
        shape = case.shape
        src_pages, dst_pages = xc.pool_pages(shape, tokens)
        src_ids, dst_ids = xc.page_ids(case, src_pages, dst_pages)
        stride = 1 << 34  # addresses only: regions far apart, nothing is read
        src_bases = [(1 << 44) + r * stride for r in range(shape.regions)]
        dst_bases = [(1 << 45) + r * stride for r in range(shape.regions)]
        items = [shape.item] * shape.regions
        tr = CudaIpcTransport(None)
        regions = [IpcRegion(ptr=b, alloc=i, offset=0, length=dst_pages * shape.item) for i, b in enumerate(dst_bases)]
        tr._peers[SESSION] = types.SimpleNamespace(  # noqa: SLF001 - a mapping without memory behind it
            table=RegionTable.build(regions, [(1 << 46) + i * stride for i in range(shape.regions)]), close=lambda: None)
        budget = xc.Budget(reps_s, min_reps=3, max_reps=200, warmup=1)

        def t(fn) -> dict:
            return xc.stats_us(budget.run(lambda: host_seconds(fn)))

        plan = tr.plan_pages(SESSION, src_bases, dst_bases, items, src_ids, dst_ids, src_pages, dst_pages)
        spans = page_spans(*plan)
        desc = copy_descriptors(src_bases, dst_bases, items, src_ids, dst_ids)

        def nccl() -> None:
            for c in plan_chunks([items], [len(src_ids)], slot):
                segs = [_segment_msg(s, [dst_ids]) for s in c.segments]
                messages.encode(messages.ChunkHeader("prefill:0", 1, 7, 0, 0, c.nbytes, segs))

        rows.append({
            "case": case.name, "regions": shape.regions, "pages": int(src_ids.size), "bytes": shape.nbytes(case.tokens),
            "ipc_plan_pages_us": t(lambda: tr.plan_pages(SESSION, src_bases, dst_bases, items, src_ids, dst_ids,
                                                         src_pages, dst_pages)),
            "ce_rule_us": t(lambda: page_chunk_shape(src_ids, dst_ids, items)),
            # split's plan (the default route; CudaIpcTransport.split_route under the thresholds across GPUs, after
            # its first use): the step between the checks and the copy
            "split_route_us": t(lambda: route_split(plan.src_ids, plan.dst_ids, plan.item_bytes, min_span, limit)),
            "ce_spans_us": t(lambda: page_spans(*plan)), "ce_spans": int(spans[2].size),
            "onesided_descriptors_us": t(lambda: copy_descriptors(src_bases, dst_bases, items, src_ids, dst_ids)),
            "descriptors": int(desc[2].size),
            "span_tiles_us": t(lambda: plan_tiles(*desc)),
            "nccl_plan_and_headers_us": t(nccl),
            "nccl_chunks": len(plan_chunks([items], [len(src_ids)], slot)),
        })
    return rows


# -- driver ----------------------------------------------------------------------------------------------------

def machine_name() -> str:
    """'nvidia-h100-80gb-hbm3-x2' from nvidia-smi, or the CPU's description without GPUs."""
    gpus = gpu_slugs()
    if not gpus:
        return f"cpu-{os.cpu_count()}core"
    return gpus[0] + (f"-x{len(gpus)}" if len(gpus) > 1 else "")


def meta(torch, quick: bool) -> dict:
    m = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick,
         "cpus": os.cpu_count(), "argv": sys.argv[1:],
         "env": {k: os.environ.get(k) for k in (*SAFE_ENV, "SGLANG_P2P_STAGING_MB", "SGLANG_P2P_STAGING_SLOTS",
                                                "SGLANG_P2P_DEVICE_SCATTER", "NCCL_CUMEM_ENABLE")}}
    if torch.cuda.is_available():
        m["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            m["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                           timeout=20).stdout
        except (OSError, subprocess.SubprocessError) as e:
            m["topology"] = f"unavailable: {e}"
    return m


def verdicts(result: dict) -> dict:
    """Each of the transfer targets (xfer_cases.py): True / False, or None where the run measured nothing for it."""
    t = xc.TARGETS
    ipc = [r for r in result.get("ipc", []) if r["tokens"] >= 4096]

    def best(rows, key="write_us"):
        by: dict = {}
        for r in rows:
            by[r["case"]] = min(by.get(r["case"], float("inf")), r[key]["p50"])
        return by

    out: dict = {"verified": all(r["bad_pages"] == 0 for k in ("ipc", "same_gpu", "nccl", "programs")
                                 for r in result.get(k, []))}
    if ipc:
        b = best(ipc)
        out["ipc_ratio"] = all((r["ratio"] or 0) >= t["ipc_ratio_min"] for r in ipc if r["write_us"]["p50"] == b[r["case"]])
        out["ipc_4k_ms"] = all(v / 1e3 <= t["ipc_4k_max_ms"] for k, v in b.items() if "_4096_" in k)
        out["ipc_16k_ms"] = all(v / 1e3 <= t["ipc_16k_max_ms"] for k, v in b.items() if "_16384_" in k)
    fixed = result.get("fixed_cost", {})
    if fixed:
        out["small_request_us"] = all(f["end_to_end_us"] <= t["small_request_max_us"] for f in fixed.values())
    inter = result.get("interference", [])
    if inter:
        out["interference"] = {r["mode"] + ":" + r["case"]: r["slowdown"] <= t["interference_max"] for r in inter}
    slot = result.get("nccl_slot_mib_default")  # as deployed: the overlap on, the configured slots
    nccl = [r for r in result.get("nccl", []) if r["tokens"] == 4096 and r.get("overlap", True)
            and r.get("slot_mib", slot) == slot and "first_chunk_mib" not in r]
    if nccl:
        out["nccl_ratio_4k"] = all((r["ratio"] or 0) >= t["nccl_ratio_min"] for r in nccl)
    same = result.get("same_gpu", [])
    if same:
        b = best(same)
        out["same_gpu_ratio"] = all((r["ratio"] or 0) >= t["same_gpu_ratio_min"] for r in same
                                    if r["write_us"]["p50"] == b[r["case"]])
    return out


def tables(result: dict) -> str:
    parts = []
    for key, title in (("ipc", "write_pages vs one cudaMemcpyPeer"), ("same_gpu", "same GPU vs one D2D copy")):
        rows = result.get(key, [])
        if not rows:
            continue
        if key == "ipc":  # cross-GPU on a two-GPU host; a one-GPU host runs it into the same GPU
            title += f", decode on cuda:{','.join(sorted({str(r.get('decode_gpu')) for r in rows}))}"
        tb = xc.Table([("case", 30), ("mode", 13), ("MiB", 8), ("spans", 9), ("write us", 10), ("p99 us", 9),
                       ("GB/s", 7), ("ref us", 9), ("ratio", 7), ("bad", 5)])
        for r in rows:
            tb.add(r["case"], r["mode"], r["bytes"] / 2**20, r["spans"], r["write_us"]["p50"], r["write_us"]["p99"],
                   r["write_gbps"], r["ref"]["gpu_us"]["p50"], r["ratio"], r["bad_pages"])
        idle = f", {rows[0]['idle_ms']:g} ms idle before each write" if rows[0].get("idle_ms") else ""
        turn = f" (modes in turn, --interleave{idle})" if rows[0].get("interleaved") else ""
        parts.append(f"== {key}: {title}{turn}\n"
                     f"{tb.render()}")
        for r in rows:
            if r.get("steps_us"):
                parts.append(f"  {r['case']} {r['mode']} steps (us, median): {_steps(r['steps_us'])}")
    if result.get("nccl"):
        # the minimum beside the p50: on a shared host the p50s of one case moved ~10% between runs of the same
        # code (docs/nccl.md, session 28), the minimums less; an A/B wants both, and runs in turn
        first = result.get("nccl_first_chunk_mib_default", "-")
        tb = xc.Table([("case", 30), ("overlap", 8), ("slot MiB", 9), ("1st MiB", 8), ("MiB", 8), ("send us", 10),
                       ("min us", 9), ("p99 us", 9), ("GB/s", 7), ("contig us", 10), ("ratio", 7), ("bad", 5)])
        for r in result["nccl"]:
            tb.add(r["case"], "on" if r.get("overlap", True) else "off", r.get("slot_mib", "-"),
                   r.get("first_chunk_mib", first), r["bytes"] / 2**20,
                   r["send_us"]["p50"], r["send_us"]["min"], r["send_us"]["p99"], r["send_gbps"],
                   r["contiguous_send_us"]["p50"], r["ratio"], r["bad_pages"])
        parts.append(f"== nccl: PairSender -> PairReceiver vs one contiguous NCCL send\n{tb.render()}")
    for r in result.get("nccl_phases", []):
        lines = [f"  {name:<28}{us:>10.1f} us" for name, us in r["phases_us"]]
        parts.append(f"== nccl phases of {r['case']} ({r['bytes'] / 2**20:.0f} MiB, {r['chunks_slot_mib']} MiB slots, "
                     f"send() to landed p50 {r['send_us']['p50']:.0f} us): median offset from send()'s start\n"
                     + "\n".join(lines))
        steps = xc.chunk_steps(r["phases_us"])
        if steps:
            cols = (*(c[0] for c in xc.CHUNK_STEPS), "link_wait")
            tb = xc.Table([("chunk", 6)] + [(name, 10) for name in cols])
            for row in steps:
                tb.add(row["chunk"], *("-" if row[c] is None else f"{row[c]:.0f}" for c in cols))
            parts.append(f"== each chunk's steps of {r['case']} (us; xfer_cases.CHUNK_STEPS)\n{tb.render()}")
        if r.get("send_profile"):
            parts.append(f"== send() of {r['case']} under cProfile, by own time a call\n"
                         + "\n".join(render_profile(r["send_profile"], limit=16)))
        if r.get("recv_profile"):
            parts.append(f"== the decode's receiver thread over the same requests of {r['case']} under cProfile, "
                         f"by own time a request\n" + "\n".join(render_profile(r["recv_profile"], limit=16)))
    if result.get("interference"):
        tb = xc.Table([("case", 30), ("mode", 13), ("alone ms", 10), ("during ms", 10), ("slowdown", 10),
                       ("graphed", 9), ("writes", 8), ("GB/s", 7)])
        for r in result["interference"]:
            graphed = r.get("slowdown_graph")
            tb.add(r["case"], r["mode"], r["matmul_ms_alone"], r["matmul_ms_during"], 100 * r["slowdown"],
                   float("nan") if graphed is None else 100 * graphed, r["writes_during"], r["write_gbps_during"])
        parts.append("== interference: matmul loop on the prefill GPU (slowdown in %; graphed: the loop as one CUDA "
                     f"graph, no launches the writer's thread can delay)\n{tb.render()}")
    if result.get("programs"):
        parts.append(programs_table(result["programs"], result.get("programs_default")))
    for name, f in result.get("fixed_cost", {}).items():
        keys = [k for k in f if k.endswith("_us") and isinstance(f[k], dict) and "p50" in f[k]]
        lines = [f"  {k:<30}{f[k]['p50']:>10.1f} us p50 {f[k]['p99']:>10.1f} us p99" for k in keys]
        lines.append(f"  {'end_to_end_us (write + aux + Status)':<30}{f['end_to_end_us']:>10.1f} us")
        lines.append(f"  nccl plan + headers {f['nccl']['plan_and_header_us']['p50']:.1f} us")
        if f.get("write_profile"):
            lines += ["  write_pages under cProfile, by own time a call:", *render_profile(f["write_profile"])]
        for mode, steps in (f.get("steps_us") or {}).items():
            lines.append(f"  {mode} write step by step (us, each from the one before): {_steps(steps)}")
        large = f.get("large") or {}
        for mode in IPC_MODES:
            r = large.get(mode)
            if not r:
                continue
            gpu = f"GPU {r['gpu_us']['p50']:.1f} us, host around it {r['host_us']:.1f} us" if "gpu_us" in r else "no GPU"
            lines.append(f"  {large['case']} ({large['mib']:.0f} MiB) {mode}: write {r['write_us']['p50']:.1f} us p50, {gpu}")
            if r.get("steps_us"):
                lines.append(f"    step by step (us, each from the one before): {_steps(r['steps_us'])}")
            if r.get("write_profile"):
                lines += [f"    {mode} write under cProfile, by own time a call:", *render_profile(r["write_profile"])]
        parts.append(f"== fixed cost of {f['case']} ({f['pages']} pages x {f['regions']} regions)\n" + "\n".join(lines))
    if result.get("plan"):
        tb = xc.Table([("case", 34), ("pages", 7), ("ipc plan", 10), ("ce rule", 9), ("split", 8), ("ce spans", 10),
                       ("#spans", 8), ("descr", 10), ("tiles", 10), ("nccl", 9)])
        for r in result["plan"]:
            split = r["split_route_us"]["p50"] if "split_route_us" in r else "-"  # results before 2026-11-30
            tb.add(r["case"], r["pages"], r["ipc_plan_pages_us"]["p50"], r["ce_rule_us"]["p50"], split,
                   r["ce_spans_us"]["p50"], r["ce_spans"], r["onesided_descriptors_us"]["p50"],
                   r["span_tiles_us"]["p50"], r["nccl_plan_and_headers_us"]["p50"])
        parts.append(f"== plan: host planning alone, us p50\n{tb.render()}")
    if result.get("rule"):
        parts.append(f"== rule (copy engines vs kernel): {json.dumps({k: v for k, v in result['rule'].items() if k != 'winner'})}")
    if result.get("skipped"):
        parts.append("== skipped: " + "; ".join(result["skipped"]))
    return "\n\n".join(parts)


def programs_table(rows: list[dict], default: Optional[int]) -> str:
    tb = xc.Table([("case", 30), ("programs", 9), ("write us", 10), ("p99 us", 9), ("GB/s", 7), ("ratio", 7),
                   ("alone ms", 10), ("during ms", 10), ("slowdown", 10), ("GB/s dur", 9), ("bad", 5)])
    for r in rows:
        tb.add(r["case"], r["programs"], r["write_us"]["p50"], r["write_us"]["p99"], r["write_gbps"], r["ratio"],
               r["matmul_ms_alone"], r["matmul_ms_during"], 100 * r["slowdown"], r["write_gbps_during"],
               r["bad_pages"])
    grid = f"the default grid of these cases: {default} programs" if default else "on CPU the stand-in has no grid"
    return f"== programs: kernel grid vs write time and matmul slowdown (slowdown in %; {grid})\n{tb.render()}"


SECTIONS = ("plan", "ipc", "nccl", "interference", "fixed")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--machine", help="name in the output (default: the GPUs' name and count from nvidia-smi)")
    ap.add_argument("--out", help="JSON path (default bench/results/xfer_<machine>.json)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=400.0, help="no case starts after this many seconds")
    ap.add_argument("--case-s", type=float, default=0.25, help="timed seconds per case and mode (at least 5 reps)")
    ap.add_argument("--max-reps", type=int, default=100)
    ap.add_argument("--programs", type=parse_programs, default=[], metavar="LIST",
                    help="comma-separated grid bounds of the page kernel to measure beside the default "
                         "(SGLANG_P2P_IPC_PROGRAMS), e.g. 16,32,66,132; needs section ipc or interference")
    ap.add_argument("--programs-case", type=parse_programs_case, default=PROGRAMS_CASE, metavar="SHAPE:TOKENS",
                    help=f"the shape and request sizes --programs measures (default "
                         f"{PROGRAMS_CASE[0]}:{','.join(map(str, PROGRAMS_CASE[1]))}), on every --dests")
    ap.add_argument("--slot-mib", type=parse_slot_mib, default=[], metavar="LIST",
                    help="staging slot sizes (MiB) to run the nccl cases at besides the default (SGLANG_P2P_STAGING_MB "
                         "over SGLANG_P2P_STAGING_SLOTS), overlap on, e.g. 256")
    ap.add_argument("--ipc-modes", type=parse_ipc_modes, default=list(IPC_MODES), metavar="LIST",
                    help="the same-host routes the ipc and interference sections time (default kernel,copy_engine; "
                         "split: SGLANG_P2P_COPY_ENGINE=split, e.g. with --dests mixed)")
    ap.add_argument("--interleave", action="store_true",
                    help="time the --ipc-modes of an ipc case in turn, one write each a round (not each in a block "
                         "of its own), and each one's steps")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="with --interleave: sleep this long before each timed write, so each finds the GPUs and the "
                         "link idle as a request at concurrency 1 does (SGLang's KV time of one 4k request was twice "
                         "the back-to-back write's on 2 x H200); pair it with --max-reps")
    ap.add_argument("--first-chunk-mib", type=parse_first_chunk_mib, default=[], metavar="LIST",
                    help="first-chunk caps (MiB; 0: every chunk a whole slot) to run the nccl cases at besides the "
                         "default (SGLANG_P2P_FIRST_CHUNK_MB), overlap on, the default slots, e.g. 0,16,64")
    ap.add_argument("--shapes", default="", help="comma-separated subset of the KV shapes (default all: "
                    f"{','.join(s.name for s in xc.SHAPES)})")
    ap.add_argument("--tokens", default="", help="comma-separated subset of the request sizes in tokens (default all)")
    ap.add_argument("--dests", default=",".join(xc.DESTS), help="where the pages land: contiguous, scattered and "
                    "runs<N> (N runs of the decode's pool, e.g. runs4: N spans a region)")
    ap.add_argument("--quick", action="store_true", help="CPU: the same driver with stand-ins and small pools")
    ns = ap.parse_args(argv)
    sections = set(picked(ap, ns.sections, SECTIONS, "sections"))
    if ns.idle_ms < 0 or (ns.idle_ms and not ns.interleave):
        ap.error(f"--idle-ms {ns.idle_ms:g}: give a non-negative time, with --interleave")
    dests = tuple(d.strip() for d in ns.dests.split(",") if d.strip())
    for d in dests:
        try:
            xc.run_count(d)
        except ValueError as e:
            ap.error(str(e))
    import torch

    cuda = torch.cuda.is_available() and not ns.quick
    if not cuda and not ns.quick:
        print("xfer_bench: skipped: no CUDA device here (torch.cuda.is_available() is False); nothing measured. "
              "--quick runs the same driver on CPU with stand-ins.")
        return 0
    machine = ns.machine or (machine_name() if cuda else f"cpu-{os.cpu_count()}core-quick")
    out_path = Path(ns.out or Path(_ROOT) / "bench" / "results" / f"xfer_{machine}.json")
    shapes, tokens = (xc.SHAPES, xc.TOKENS) if cuda else (xc.QUICK_SHAPES, xc.QUICK_TOKENS)
    if ns.shapes:
        keep = picked(ap, ns.shapes, tuple(s.name for s in shapes), "shapes")
        shapes = tuple(s for s in shapes if s.name in keep)
    if ns.tokens:
        keep_t = picked(ap, ns.tokens, tuple(str(t) for t in tokens), "tokens")
        tokens = tuple(t for t in tokens if str(t) in keep_t)
    names = [s.name for s in shapes]
    t0 = time.time()
    result: dict = {"machine": machine, "meta": meta(torch, ns.quick), "targets": xc.TARGETS}
    if "plan" in sections:  # host work alone: full-size shapes even with --quick (nothing is allocated)
        result["plan"] = plan_section(xc.SHAPES, xc.TOKENS, 0.02 if ns.quick else 0.05, dests)
    device_sections = sections - {"plan"}
    if device_sections:
        gpus = torch.cuda.device_count() if cuda else 0
        cfg = {"quick": not cuda, "prefill_gpu": 0, "decode_gpu": 1 if gpus >= 2 else 0, "budget_s": ns.budget_s,
               "case_s": ns.case_s, "max_reps": ns.max_reps, "sections": device_sections, "programs": ns.programs,
               "programs_case": list(ns.programs_case), "slot_mib": ns.slot_mib, "first_chunk_mib": ns.first_chunk_mib, "ipc_modes": ns.ipc_modes,
               "interleave": ns.interleave, "idle_ms": ns.idle_ms, "dests": dests,
               "interference_shape": INTERFERENCE_CASE[0] if INTERFERENCE_CASE[0] in names else names[0],
               "shapes": [s.__dict__ for s in shapes], "tokens": tokens}
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        results = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(prefill_main, 0, a, results, cfg), daemon=True),
                 ctx.Process(target=_child, args=(decode_main, 1, b, results, cfg), daemon=True)]
        for p in procs:
            p.start()
        got = collect(procs, results, (0, 1), timeout=ns.budget_s + 180)
        result.update(got[0])
        result["decode"] = got[1]
        result["rule"] = xc.crossover(result.get("ipc", []))
    result["meta"]["wall_s"] = time.time() - t0
    result["pass"] = verdicts(result)
    print(tables(result))
    print(f"\npass: {json.dumps(result['pass'])}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out_path} ({result['meta']['wall_s']:.0f} s)")
    return 0 if result["pass"]["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
