"""The `nccl` two-sided transport: one 2-rank NCCL communicator per (prefill rank, decode rank) pair.

Each pair communicator (`NcclPairComm`) has its own CUDA stream, a channel cap fixed at init through NCCL's
per-communicator `ncclConfig_t` (`minCTAs = maxCTAs = cap`; never NCCL_MAX_NCHANNELS / NCCL_MAX_CTAS, which
NCCL reads once per process and would also slow SGLang's own TP collectives), and is non-blocking
(`config.blocking = 0`): init, launches and waits are polled against a deadline and a stuck pair is torn down
with `ncclCommAbort`, so a dead peer never hangs the calling thread.

The ctypes binding of libnccl is `nccl_lib.py`.

Launch cost (measured on two H200s, bench/results/transfer_nvidia-h200-x2.json): every op on a non-blocking
communicator is launched by a fresh NCCL thread, ~170-250 us of host time per send/recv against ~40 us on a
blocking one, which caps a 64 MiB-chunk pipeline near 210 GB/s. `split_blocking=True` (EngineConfig.nccl_split,
the backend's default; SGLANG_P2P_NCCL_SPLIT=0 turns it off) keeps the non-blocking communicator for init,
connection and abort, and runs the ops on a blocking child split off it (`splitShare=1`: same channels and
buffers): on 4 x H200 it took each post from ~0.35-0.45 ms to ~0.15 ms and a 1k-token request from 2.0 to 1.35
ms, and a peer killed mid-transfer still failed its op in time (docs/nccl.md). `high_priority`
(SGLANG_P2P_NCCL_STREAM_PRIORITY=high) puts the pair stream at the top CUDA priority so the NCCL kernel's CTAs
are not queued behind a gather that becomes ready at the same moment.

Ordering rule: `send`/`recv` are ordered after the work already queued on the caller's current CUDA stream
(as torch.distributed does), and `Completion.event` lets another stream wait for them without a host sync.
Issuing gather/scatter on `comm.stream` itself (as a serial pipeline does) is the special case where that
wait is a no-op; a pipelined caller gathers on its own stream and the send waits for exactly that work.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
import time
import weakref
from typing import Optional, Sequence

import torch

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.copy.stream_ops import CudaCallError, StreamOps, cuda_libraries
from sglang_p2p_backend.engine.waiting import Deadline
from sglang_p2p_backend.engine.transport.base import Completion, PairComm, TransportError, TwoSidedTransport
from sglang_p2p_backend.engine.transport.link_pace import LinkPace
from sglang_p2p_backend.engine.transport.nccl_lib import (
    NCCL_IN_PROGRESS,
    NCCL_SUCCESS,
    NCCL_UINT8,
    NcclConfig,
    NcclLibrary,
    NcclUniqueId,
)

logger = logging.getLogger(__name__)


def pack_unique_id(raw: bytes, max_ctas: Optional[int]) -> bytes:
    """The id that travels on the control channel: the ncclUniqueId plus the channel cap both ranks must use
    (a mismatch would make the ranks split messages over different channels and hang)."""
    return b"NCL1" + struct.pack("<i", max_ctas or 0) + raw


def unpack_unique_id(uid: bytes) -> tuple[bytes, Optional[int]]:
    if len(uid) != 136 or uid[:4] != b"NCL1":
        raise TransportError(f"not an nccl pair id ({len(uid)} bytes): prefill and decode use different transports")
    (cap,) = struct.unpack("<i", uid[4:8])
    return uid[8:], (cap or None)


def _own_stream(device: torch.device, high_priority: bool = False) -> tuple[torch.cuda.Stream, Optional[int]]:
    """A CUDA stream of this pair alone. torch.cuda.Stream() hands out a pool of 32 streams round-robin, which
    would make unrelated pairs queue behind each other (and a stuck pair stall another), so the stream is
    created with the CUDA runtime; returns (stream, raw handle to destroy) or a pooled stream if that fails.

    `high_priority`: the block scheduler then places the NCCL kernel's CTAs before those of a gather or scatter
    that became ready at the same moment (a gather grid covers every SM and would otherwise delay the send
    until it drains)."""
    try:
        rt, _ = cuda_libraries()
        handle = ctypes.c_void_p()
        least, greatest = ctypes.c_int(), ctypes.c_int()
        with torch.cuda.device(device):
            if rt.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)) != 0:
                raise OSError("cudaDeviceGetStreamPriorityRange failed")
            priority = greatest.value if high_priority else least.value
            # 1 = cudaStreamNonBlocking: no implicit sync with the legacy default stream
            if rt.cudaStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(1), ctypes.c_int(priority)) != 0:
                raise OSError("cudaStreamCreateWithPriority failed")
        return torch.cuda.ExternalStream(handle.value, device=device), handle.value
    except (OSError, AttributeError) as e:
        logger.warning("nccl transport: no dedicated CUDA stream (%s); using torch's stream pool", e)
        return torch.cuda.Stream(device=device), None


def _destroy_stream(handle: Optional[int]) -> None:
    if handle is None:
        return
    # the runtime frees it once queued work finishes; the stream must not be used afterwards
    cuda_libraries()[0].cudaStreamDestroy(ctypes.c_void_p(handle))


class NcclCompletion(Completion):
    """An operation queued on a pair's stream: done when the event after it has fired. `expected_end`: the
    monotonic time it should be done (the pair's LinkPace), which its waiters sleep until before polling."""

    def __init__(self, comm: "NcclPairComm", event: torch.cuda.Event, what: str, start: Optional[torch.cuda.Event] = None,
                 nbytes: int = 0, expected_end: Optional[float] = None):
        self.comm = comm
        self.event = event
        self.what = what
        self.expected_end = expected_end
        self._start = start  # timing event before the operation, until its time taught the pair's pace
        self._nbytes = nbytes

    def _learn(self) -> None:
        """Once the event fired: the operation's GPU time to the pair's pace (once)."""
        start, self._start = self._start, None
        if start is not None:
            try:
                self.comm.pace.observe(self._nbytes, start.elapsed_time(self.event) / 1e3)
            except RuntimeError:  # a timing the driver cannot give teaches nothing; the wait itself is done
                pass

    def done(self) -> bool:
        if self.comm.aborted:
            return True
        if self.event.query():
            self._learn()
            return True
        return False

    def wait(self, timeout: float) -> None:
        poll = Deadline(timeout, self.expected_end)
        while not self.event.query():
            self.comm.raise_if_broken(self.what)
            if poll.left() <= 0:
                reason = f"{self.what} not done after {timeout:.1f}s (peer dead or stalled)"
                self.comm.abort(reason)
                raise TransportError(f"{reason}; pair channel {self.comm.name} aborted")
            poll.pause()
        self.comm.raise_if_broken(self.what)
        self._learn()


class NcclPairComm(PairComm):
    """One 2-rank non-blocking NCCL communicator with its own stream. Rank 0 sends, rank 1 receives (either
    direction works). Calls are serialised by a lock; abort may come from any thread."""

    def __init__(self, lib: NcclLibrary, handle: int, rank: int, device: torch.device, max_ctas: Optional[int],
                 high_priority: bool = False):
        self.lib = lib
        #: the communicator operations go to; `owned` are torn down in order (a split child before its parent)
        self.handle = handle
        self.owned = [handle]
        self.blocking_ops = False
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.max_ctas = max_ctas
        self.stream, stream_handle = _own_stream(device, high_priority)
        # the gather/scatter beside the transfers: a stream of this pair too (a pooled one could be another
        # pair's, and a gather queued behind that pair's receive would wait on its peer)
        self.side_stream, side_handle = _own_stream(device)
        # the streams go when this object does: after an abort from another thread the owner may still queue a
        # kernel on them, which must not hit a destroyed handle
        weakref.finalize(self, _destroy_stream, stream_handle)
        weakref.finalize(self, _destroy_stream, side_handle)
        #: a post's ordering after its caller's stream and its device switch, one runtime call each (torch's
        #: `wait_stream` and device guard cost tens of microseconds a post: bench/transfer/nccl_post.py); used
        #: under `_lock` only, so the pair's threads share it
        rt, drv = cuda_libraries()
        self._ops = StreamOps(rt, device, drv=drv)
        self._stream_ptr = ctypes.c_void_p(self.stream.cuda_stream)
        self.name = f"{handle:#x}(rank {rank}, cap {max_ctas or 'default'})"
        #: when the operations queued on `stream` should end, from the rate the link has shown (link_pace.py)
        self.pace = LinkPace()
        self._lock = threading.Lock()
        self._abort_reason = ""
        self._released = False

    @property
    def aborted(self) -> bool:
        return bool(self._abort_reason)

    def raise_if_broken(self, what: str) -> None:
        if self._abort_reason:
            raise TransportError(f"{what}: pair channel {self.name} aborted: {self._abort_reason}")
        err = self.lib.async_error(self.handle)
        if err not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            text = self.lib.error_text(err, self.handle)
            self.abort(text)
            raise TransportError(f"{what}: NCCL reported {text}; pair channel {self.name} aborted")

    def _settle(self, code: int, what: str, poll: Deadline) -> None:
        """After a call on a non-blocking communicator: wait until NCCL has queued the work (ncclInProgress means
        a helper thread is still launching or connecting); abort when that takes past the deadline."""
        self.lib.check(code, what, self.handle)
        while code == NCCL_IN_PROGRESS:
            code = self.lib.async_error(self.handle)
            if code == NCCL_IN_PROGRESS:
                if poll.left() <= 0:
                    raise TransportError(f"{what} could not start within the deadline (peer not connecting)")
                poll.pause()
        self.lib.check(code, what, self.handle)

    def _post(self, bufs: Sequence[torch.Tensor], send: bool, timeout: float) -> NcclCompletion:
        fn = self.lib.lib.ncclSend if send else self.lib.lib.ncclRecv
        nbytes = sum(b.numel() for b in bufs)
        what = f"{'send' if send else 'recv'} of {nbytes} bytes in {len(bufs)} message(s)"
        for b in bufs:
            if b.device != self.device or b.dtype != torch.uint8 or not b.is_contiguous():
                raise TransportError(f"{what}: nccl moves contiguous uint8 tensors on {self.device}, got {b.device} {b.dtype}")
        # on a non-blocking communicator NCCL's helper thread launches the op in ~0.1-0.2 ms: polls every
        # Deadline.FIRST_S from the start (an end "expected" now) see that within tens of microseconds, where
        # doubling steps saw it up to one step (0.16-0.32 ms by then) late
        poll = Deadline(timeout, expected_end=time.monotonic())
        ops = self._ops
        with self._lock:
            self.raise_if_broken(what)
            start: Optional[torch.cuda.Event] = None
            try:
                prev = ops.enter()
                try:
                    ops.after_current(self._stream_ptr.value)
                    # only operations large enough to teach the pace are timed (LinkPace.min_bytes): not
                    # connect()'s one-byte probe, the first operation, whose time is also the connection's
                    if nbytes >= self.pace.min_bytes:
                        start = torch.cuda.Event(enable_timing=True)
                        start.record(self.stream)
                    if len(bufs) == 1:
                        b = bufs[0]
                        code = fn(ctypes.c_void_p(b.data_ptr()), b.numel(), NCCL_UINT8, self.peer, self.handle,
                                  self._stream_ptr)
                    else:
                        self.lib.check(self.lib.lib.ncclGroupStart(), "ncclGroupStart")
                        for b in bufs:
                            self.lib.check(
                                fn(ctypes.c_void_p(b.data_ptr()), b.numel(), NCCL_UINT8, self.peer, self.handle,
                                   self._stream_ptr),
                                what,
                                self.handle,
                            )
                        code = self.lib.lib.ncclGroupEnd()
                    self._settle(code, what, poll)
                    event = torch.cuda.Event(enable_timing=start is not None)
                    event.record(self.stream)
                finally:
                    ops.leave(prev)
            except CudaCallError as e:  # the ordering or the device switch: CUDA itself failed here
                self._abort_locked(str(e))
                raise TransportError(f"{what}: {e}; pair channel {self.name} aborted") from e
            except TransportError as e:
                self._abort_locked(str(e))
                raise
            expected_end = self.pace.expect(time.monotonic(), nbytes)
        # keep the buffers alive until the op is done: the caller may drop its slice views
        c = NcclCompletion(self, event, what, start, nbytes, expected_end)
        c.bufs = list(bufs)  # type: ignore[attr-defined]
        return c

    def send(self, buf: torch.Tensor, timeout: float = 30.0) -> NcclCompletion:
        return self._post([buf], True, timeout)

    def recv(self, buf: torch.Tensor, timeout: float = 30.0) -> NcclCompletion:
        return self._post([buf], False, timeout)

    def send_batch(self, bufs: Sequence[torch.Tensor], timeout: float = 30.0) -> NcclCompletion:
        """Several messages as one NCCL group (one kernel); the peer posts `recv_batch` of the same sizes."""
        return self._post(list(bufs), True, timeout)

    def recv_batch(self, bufs: Sequence[torch.Tensor], timeout: float = 30.0) -> NcclCompletion:
        return self._post(list(bufs), False, timeout)

    def _abort_locked(self, reason: str) -> None:
        if self._released:
            return
        self._released = True
        self._abort_reason = reason or "aborted"
        with torch.cuda.device(self.device):
            # abort raises the device-side abort flag, so kernels waiting on a dead peer exit; it is local
            for h in self.owned:
                code = self.lib.lib.ncclCommAbort(h)
                if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                    logger.warning("ncclCommAbort of %s: %s", self.name, self.lib.error_text(code))

    def abort(self, reason: str = "aborted by the owner") -> None:
        """Tear down now, without the peer; idempotent and safe from any thread (ops in flight fail)."""
        # no lock wait: an op stuck in _settle holds the lock; abort flags make it return quickly
        if self._released:
            return
        if self._lock.acquire(timeout=1.0):
            try:
                self._abort_locked(reason)
            finally:
                self._lock.release()
        else:  # another thread is inside NCCL for this comm; abort is designed to stop it
            self._abort_locked(reason)

    def close(self, timeout: float = 5.0) -> None:
        """Orderly release once queued work has finished; falls back to abort. Local: needs nothing from the peer."""
        if self._released:
            return
        done = torch.cuda.Event()
        with self._lock:
            done.record(self.stream)
        poll = Deadline(timeout)
        while not done.query() and poll.left() > 0:
            poll.pause()
        with self._lock:
            if self._released:
                return
            if not done.query():
                self._abort_locked(f"close: work still queued after {timeout:.1f}s")
                return
            self._released = True
            self._abort_reason = "closed"
            with torch.cuda.device(self.device):
                for h in self.owned:
                    code = self.lib.lib.ncclCommDestroy(h)
                    if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                        logger.warning("ncclCommDestroy of %s: %s", self.name, self.lib.error_text(code))


class NcclTransport(TwoSidedTransport):
    """Makes pair communicators on one CUDA device. `max_ctas` is the default channel cap for new pair ids
    (None = NCCL's default); the comm pool passes a per-pair cap to `new_unique_id` instead."""

    name = "nccl"

    def __init__(
        self,
        device: Optional[torch.device] = None,
        max_ctas: Optional[int] = None,
        *,
        blocking: bool = False,
        split_blocking: bool = False,
        high_priority: bool = False,
        library: Optional[NcclLibrary] = None,
    ):
        if not torch.cuda.is_available():
            raise TransportError("nccl transport needs a CUDA device")
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_ctas = max_ctas
        # blocking communicators are for baselines only: their init cannot time out
        self.blocking = blocking
        # operations on a blocking child split off the non-blocking communicator (see connect)
        self.split_blocking = split_blocking and not blocking
        self.high_priority = high_priority
        self.lib = library or NcclLibrary.get()

    @classmethod
    def from_config(cls, config: EngineConfig, device: Optional[torch.device] = None) -> "NcclTransport":
        """The transport with the configured NCCL knobs: split, stream priority, which libnccl."""
        return cls(device, split_blocking=config.nccl_split, high_priority=config.nccl_high_priority,
                   library=NcclLibrary.get(config.nccl_library))

    def new_unique_id(self, max_ctas: Optional[int] = -1) -> bytes:  # type: ignore[override]
        cap = self.max_ctas if max_ctas == -1 else max_ctas
        uid = NcclUniqueId()
        with torch.cuda.device(self.device):
            self.lib.check(self.lib.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return pack_unique_id(bytes(uid), cap)

    def _finish_init(self, code: int, handle: int, poll: Deadline, what: str, abort: bool) -> None:
        """Poll a non-blocking init or split (its progress shows on `handle`) to the deadline; on failure abort
        `handle` if asked (a split's parent is aborted by its PairComm instead), then raise."""
        while code == NCCL_IN_PROGRESS:
            code = self.lib.async_error(handle)
            if code == NCCL_IN_PROGRESS:
                if poll.left() <= 0:
                    if abort:
                        self.lib.lib.ncclCommAbort(handle)
                    raise TransportError(f"{what}: peer did not join before the deadline")
                poll.pause()
        if code != NCCL_SUCCESS:
            text = self.lib.error_text(code, handle)
            if abort:
                self.lib.lib.ncclCommAbort(handle)
            raise TransportError(f"{what} failed: {text}")

    def connect(self, unique_id: bytes, rank: int, timeout: float) -> NcclPairComm:
        """Init a non-blocking 2-rank communicator (so a dead peer times out), connect it with a one-byte probe,
        and with `split_blocking` split a blocking child off it that shares its channels and buffers: each op on
        a non-blocking communicator is launched from a fresh NCCL thread (~250 us measured on H200), on the
        blocking child it is an ordinary launch. The child's connections are the parent's, so no op on it ever
        waits for the peer on the host; abort tears both down."""
        raw, cap = unpack_unique_id(unique_id)
        if rank not in (0, 1):
            raise TransportError(f"pair rank must be 0 (prefill) or 1 (decode), got {rank}")
        poll = Deadline(timeout)
        uid = NcclUniqueId.from_buffer_copy(raw)
        cfg = NcclConfig.make(blocking=self.blocking, max_ctas=cap, split_share=self.split_blocking)
        handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            code = self.lib.lib.ncclCommInitRankConfig(ctypes.byref(handle), 2, uid, rank, ctypes.byref(cfg))
            if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS) or not handle.value:
                raise TransportError(f"ncclCommInitRankConfig failed: {self.lib.error_text(code)}")
            self._finish_init(code, handle.value, poll, f"pair channel init as rank {rank}", abort=True)
        comm = NcclPairComm(self.lib, handle.value, rank, self.device, cap, self.high_priority)
        try:
            # one-byte exchange now: NCCL connects a peer's channels on the first op (~ms to 100s of ms), which
            # belongs inside the connect deadline, not in the first request's latency
            self._probe(comm, rank, poll)
            if self.split_blocking:
                child = ctypes.c_void_p()
                child_cfg = NcclConfig.make(blocking=True, max_ctas=cap)
                try:
                    self._split(handle.value, child, child_cfg, rank, poll)
                except TransportError:
                    comm.abort("split failed")  # joins NCCL's split job, which may still write `child`
                    if child.value:
                        self.lib.lib.ncclCommAbort(child.value)
                    raise
                comm.owned.insert(0, child.value)
                comm.handle = child.value
                comm.blocking_ops = True
                self._probe(comm, rank, poll)  # channels are shared with the parent: returns at once
        except TransportError:
            comm.abort("connect failed")
            raise
        return comm

    def _split(self, parent: int, child: ctypes.c_void_p, cfg: NcclConfig, rank: int, poll: Deadline) -> None:
        """ncclCommSplit of a non-blocking parent returns ncclSuccess while the split still runs in an NCCL thread
        (seen on 2.28.9: the group's ncclInProgress is swallowed); the thread stores the child pointer when it
        ends, so poll for the pointer, then for the child's own init result."""
        with torch.cuda.device(self.device):
            code = self.lib.lib.ncclCommSplit(parent, 0, rank, ctypes.byref(child), ctypes.byref(cfg))
        self.lib.check(code, "ncclCommSplit")
        while not child.value:
            err = self.lib.async_error(parent)
            if err not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                raise TransportError(f"blocking child split failed: {self.lib.error_text(err, parent)}")
            if poll.left() <= 0:
                raise TransportError("blocking child split: peer did not join before the deadline")
            poll.pause()
        self._finish_init(self.lib.async_error(child.value), child.value, poll, "blocking child init", abort=False)

    @staticmethod
    def _probe(comm: NcclPairComm, rank: int, poll: Deadline) -> None:
        probe = torch.zeros(1, dtype=torch.uint8, device=comm.device)
        with torch.cuda.stream(comm.stream):
            op = comm.send(probe, poll.left()) if rank == 0 else comm.recv(probe, poll.left())
            op.wait(max(poll.left(), 0.001))

    def alloc_staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
