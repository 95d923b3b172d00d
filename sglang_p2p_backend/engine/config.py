"""Engine settings: the one place the environment is read (the knobs the README lists, and the few variables of
NCCL and Mooncake the engine's choices depend on). `EngineConfig.from_env()` reads them all once, at start, and
fails naming the variable and what it accepts; the engine's objects take the values as arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

TRANSPORT_VAR = "SGLANG_P2P_TRANSPORT"
AUTO = "auto"
#: the values of SGLANG_P2P_TRANSPORT: `auto` or a forced transport (engine/transport/select.py)
TRANSPORTS = (AUTO, "cudaipc", "nccl", "mooncake", "tcp")
#: the values of SGLANG_P2P_COPY_ENGINE (engine/copy/ce_plan.py), the first the default
COPY_ENGINE_MODES = ("split", "auto", "off", "on")  # the first is the default
#: SGLANG_P2P_IPC_LAUNCH: which thread queues a same-host copy (EngineConfig.ipc_launch); the first is the default
IPC_LAUNCH_MODES = ("scheduler", "worker")
#: SGLANG_P2P_NCCL_CAPS by default; 16 channels already reach contiguous speed on H200 NVLink
DEFAULT_CAPS: tuple[Optional[int], ...] = (16, 8, 4, 2)


class ConfigError(ValueError):
    pass


def parse_transport(raw: Optional[str]) -> str:
    """A SGLANG_P2P_TRANSPORT value, normalised (unset or empty: auto)."""
    name = (raw or "").strip().lower() or AUTO
    if name not in TRANSPORTS:
        raise ConfigError(f"{TRANSPORT_VAR}={raw!r} is not one of {', '.join(TRANSPORTS)}")
    return name


def parse_caps(raw: Optional[str]) -> tuple[Optional[int], ...]:
    """SGLANG_P2P_NCCL_CAPS, e.g. "16,8,4,2" ("default" = NCCL's own channel count, None)."""
    if not raw or not raw.strip():
        return DEFAULT_CAPS
    caps: list[Optional[int]] = []
    for part in raw.split(","):
        part = part.strip().lower()
        if part == "default":
            caps.append(None)
        elif part.isdigit() and int(part) > 0:
            caps.append(int(part))
        else:
            raise ConfigError(f"SGLANG_P2P_NCCL_CAPS={raw!r}: give channel counts like 16,8,4,2 (or 'default')")
    return tuple(caps)


def _number(name: str, default: Optional[float], cast=float):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a {'whole ' if cast is int else ''}number") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be positive")
    return value


def _non_negative(name: str, default: float, cast=float) -> float:
    raw = os.environ.get(name, "").strip()
    if raw in ("", "0"):
        return default if raw == "" else cast(0)
    return _number(name, default, cast)


def _choice(name: str, allowed: tuple[str, ...]) -> str:
    """One of `allowed` (the first when unset or empty)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or allowed[0]
    if value not in allowed:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    transport: str = AUTO  # SGLANG_P2P_TRANSPORT: one of TRANSPORTS
    #: SGLANG_P2P_STAGING_MB, SGLANG_P2P_STAGING_SLOTS: staging per rank and direction, split into slots (chunks
    #: in flight per rank). Three slots of 128 MiB: a transfer overlapping its chunks holds two, and a slot stays
    #: for another peer's transfer (engine/pair/staging.py: try_acquire)
    staging_mb: int = 384
    staging_slots: int = 3
    connect_timeout: float = 30.0  # SGLANG_P2P_CONNECT_TIMEOUT: joining a pair channel
    io_timeout: float = 30.0  # SGLANG_P2P_IO_TIMEOUT: one chunk's send/receive, a staging wait
    workers: int = 4  # SGLANG_P2P_WORKERS: prefill transfer queues (peers are sharded over them)
    peer_timeout: float = 8.0  # SGLANG_P2P_PEER_TIMEOUT: a peer silent this long is dead, its rooms fail
    max_peers: int = 512  # SGLANG_P2P_MAX_PEERS: registered peers and control sockets a rank keeps at most
    tombstone_s: float = 60.0  # SGLANG_P2P_TOMBSTONE_S: how long a concluded room's late messages are answered
    #: SGLANG_P2P_FAILURE_HOLD_S: how long a decode holds a room it failed while a prefill may still write its
    #: pages one-sided, waiting for the prefill's word that no write is in flight (adapter/failure_hold.py)
    failure_hold_s: float = 30.0
    #: SGLANG_P2P_GIL_SWITCH_MS: the scheduler process's GIL switch interval at most (0: Python's own, 5 ms).
    #: The backend's threads release the GIL on every CUDA sync and socket wait and need it back within
    #: the interval while the scheduler's main thread runs Python (docs/serving.md measures it)
    gil_switch_ms: float = 0.5
    nccl_budget_mb: float = 4096.0  # SGLANG_P2P_NCCL_BUDGET_MB: what one GPU may spend on extra pair communicators
    nccl_caps: tuple[Optional[int], ...] = DEFAULT_CAPS  # SGLANG_P2P_NCCL_CAPS: caps the pool steps down through
    #: NCCL_CUMEM_ENABLE, NCCL's own (not "0"): SGLang sets 0 (legacy IPC buffers, about twice the memory a
    #: communicator) unless symmetric memory is on, so the pool costs communicators with the matching table
    nccl_cumem: bool = True
    #: SGLANG_P2P_NCCL_SPLIT (1, the default): operations on a blocking child communicator split off the
    #: non-blocking one (init and abort stay non-blocking); 0: every launch goes through NCCL's helper thread
    nccl_split: bool = True
    nccl_high_priority: bool = False  # SGLANG_P2P_NCCL_STREAM_PRIORITY=high: pair streams at the top priority
    #: SGLANG_P2P_OVERLAP=0: each chunk's gather (prefill) or scatter (decode) no longer overlaps the transfer
    #: of the next one on NCCL channels (engine/pair/pipeline.py); on, a pair end takes a second staging slot
    #: when one is free
    overlap: bool = True
    #: SGLANG_P2P_DEVICE_SCATTER=1: with the overlap, the decode queues each chunk's scatter on the GPU behind its
    #: receive when it readies it, instead of launching it once its thread sees the bytes landed; a room failed
    #: meanwhile turns Failed only once its queued scatters ended (engine/pair/pipeline.py, adapter/decode.py).
    #: Off until measured across GPUs
    device_scatter: bool = False
    #: SGLANG_P2P_FIRST_CHUNK_MB: a two-sided transfer of more than one staging slot starts with a chunk of at most
    #: this many MiB and doubles up to a slot (engine/copy/plan.py's `ramp_caps`), so the link starts after a short
    #: gather; 0 (the default): every chunk a whole slot. Off because it lost on 2 x H200 at every cap tried (16-64
    #: MiB: the extra chunks cost more than the shorter head saved; docs/nccl.md, session 30)
    first_chunk_mb: int = 0
    #: SGLANG_P2P_COPY_ENGINE: how the same-host path copies a chunk: `split` (the default; per page run: a chunk's
    #: long runs to the copy engines, its short ones to the kernel, ce_plan.split_runs), `auto` (the whole chunk one
    #: way, by ce_plan.choose's rule), `off` (the SM copy kernel) or `on` (the GPU's copy engines,
    #: cudaMemcpyBatchAsync). `split` is the default since it served as fast as NIXL or faster with decode steps no
    #: slower, where `auto` left 40-57% of the bytes to the kernel (2 x H200, docs/serving.md, session 32)
    copy_engine: str = COPY_ENGINE_MODES[0]
    #: SGLANG_P2P_CE_MIN_SPAN_KIB / SGLANG_P2P_CE_MAX_SPANS: the copy engines' thresholds (`split`: a page run whose
    #: span is at least this long, at most this many spans a chunk; `auto`: a chunk whose mean span is at least this
    #: long and has at most this many spans), for any destination; None:
    #: ce_plan's (2 MiB and 1,024 spans across GPUs, 16 MiB and 64 spans into the prefill's own GPU). Lower, the copy engines also
    #: take chunks they copy somewhat slower than the kernel, still without the prefill's SMs
    ce_min_span_kib: Optional[int] = None
    ce_max_spans: Optional[int] = None
    #: SGLANG_P2P_IPC_PROGRAMS: the grid bound of the same-host page-copy kernel (engine/copy/span_copy.py's
    #: PageCopier); None: span_copy.default_programs (about 8 KiB in flight an SM, one program an SM for pages of
    #: 32 KiB and up); bench/transfer/xfer_bench.py --programs measures write time against what the grid takes
    #: from the forward pass beside it
    ipc_programs: Optional[int] = None
    #: SGLANG_P2P_IPC_LAUNCH: which thread queues a same-host chunk's copy. `scheduler` (the default): SGLang's
    #: scheduler thread, as it hands the chunk over, and the transfer worker only waits for it and sends Status
    #: (a chunk that cannot go so, the worker copies). `worker`: the worker does both. A worker woken from sleep
    #: took 0.6-0.9 ms of a 4k request's 3.4 ms KV time in service to take the chunk and queue it, at 5-9x the
    #: host time of the same write in the transfer benchmark (2 x H200, docs/serving.md, session 37)
    ipc_launch: str = IPC_LAUNCH_MODES[0]
    #: SGLANG_P2P_ALONE_KERNEL=1 (the default): under `split` and `auto` the last chunk of the only request on a
    #: prefill rank, bound for a decode on another GPU, goes whole to the SM copy kernel, since no forward pass runs
    #: beside its copy then (a decode on the same GPU may run its steps there: the rule stands); the copy
    #: engines' host time for a 4k request's 64 spans (0.5-0.7 ms on SGLang's thread, against ~0.1 ms to queue the
    #: kernel) is what a request alone waits for (docs/serving.md, session 38). 0: every chunk by the rule
    alone_kernel: bool = True
    #: SGLANG_P2P_CONCLUDE_IN_POLL=1 (the default): a room whose last chunk SGLang's thread queued is concluded (aux
    #: row, Success, Status) by SGLang's own poll of its sender once that copy has run, not by the worker woken for
    #: it, which took 1.1-1.3 ms to notice a 0.35 ms copy on one GPU: its wake-up, then the GIL SGLang's thread holds
    #: (docs/serving.md, sessions 38 and 39). 0: the worker concludes every room
    conclude_in_poll: bool = True
    #: SGLANG_P2P_NCCL_SO_PATH, else SGLang's own SGLANG_NCCL_SO_PATH (one variable points both at another
    #: libnccl); None: the libnccl.so.2 torch loaded
    nccl_library: Optional[str] = None
    #: MC_FORCE_TCP, Mooncake's own switch: Mooncake stays off the RDMA devices, so `auto` counts none
    mooncake_force_tcp: bool = False
    #: SGLANG_P2P_TEST_CORRUPT_KV_FILE, tests only: while this file exists the decode zeroes a page of every room
    #: before its Success (adapter/kv_fault.py), the negative control of the end-to-end checks
    test_corrupt_kv_file: Optional[str] = None
    #: SGLANG_P2P_TEST_KV_DIGEST=1, tests only: each side logs a digest of every room's KV pages at its Success
    #: (the prefill of the pages it sent, the decode of the pages it holds; adapter/kv_digest.py), which the
    #: end-to-end checks compare by room; costs a synchronous hash of the room's pages on the pool's device
    test_kv_digest: bool = False
    #: SGLANG_P2P_ROOM_TIMES=1: the prefill logs each room's transfer steps, as milliseconds from its first chunk
    #: queued, when SGLang's poll first sees its Success (adapter/room_times.py): where SGLang's
    #: kv_transfer_latency_ms goes beyond the write; one INFO line a request
    room_times: bool = False

    @property
    def ce_min_span_bytes(self) -> Optional[int]:
        return None if self.ce_min_span_kib is None else self.ce_min_span_kib << 10

    @property
    def first_chunk_bytes(self) -> int:
        return self.first_chunk_mb << 20

    @property
    def slot_bytes(self) -> int:
        return max(1, (self.staging_mb << 20) // self.staging_slots)

    @classmethod
    def from_env(cls) -> "EngineConfig":
        env = os.environ
        return cls(
            transport=parse_transport(env.get(TRANSPORT_VAR)),
            staging_mb=_number("SGLANG_P2P_STAGING_MB", cls.staging_mb, int),
            staging_slots=_number("SGLANG_P2P_STAGING_SLOTS", cls.staging_slots, int),
            connect_timeout=_number("SGLANG_P2P_CONNECT_TIMEOUT", cls.connect_timeout),
            io_timeout=_number("SGLANG_P2P_IO_TIMEOUT", cls.io_timeout),
            workers=_number("SGLANG_P2P_WORKERS", cls.workers, int),
            peer_timeout=_number("SGLANG_P2P_PEER_TIMEOUT", cls.peer_timeout),
            max_peers=_number("SGLANG_P2P_MAX_PEERS", cls.max_peers, int),
            tombstone_s=_number("SGLANG_P2P_TOMBSTONE_S", cls.tombstone_s),
            failure_hold_s=_number("SGLANG_P2P_FAILURE_HOLD_S", cls.failure_hold_s),
            gil_switch_ms=_non_negative("SGLANG_P2P_GIL_SWITCH_MS", cls.gil_switch_ms),
            nccl_budget_mb=_non_negative("SGLANG_P2P_NCCL_BUDGET_MB", cls.nccl_budget_mb),
            nccl_caps=parse_caps(env.get("SGLANG_P2P_NCCL_CAPS")),
            nccl_cumem=env.get("NCCL_CUMEM_ENABLE", "").strip() != "0",
            nccl_split=_choice("SGLANG_P2P_NCCL_SPLIT", ("1", "0")) == "1",
            nccl_high_priority=_choice("SGLANG_P2P_NCCL_STREAM_PRIORITY", ("normal", "high")) == "high",
            overlap=_choice("SGLANG_P2P_OVERLAP", ("1", "0")) == "1",
            device_scatter=_choice("SGLANG_P2P_DEVICE_SCATTER", ("0", "1")) == "1",
            first_chunk_mb=_non_negative("SGLANG_P2P_FIRST_CHUNK_MB", cls.first_chunk_mb, int),
            copy_engine=_choice("SGLANG_P2P_COPY_ENGINE", COPY_ENGINE_MODES),
            ce_min_span_kib=_number("SGLANG_P2P_CE_MIN_SPAN_KIB", cls.ce_min_span_kib, int),
            ce_max_spans=_number("SGLANG_P2P_CE_MAX_SPANS", cls.ce_max_spans, int),
            ipc_programs=_number("SGLANG_P2P_IPC_PROGRAMS", cls.ipc_programs, int),
            ipc_launch=_choice("SGLANG_P2P_IPC_LAUNCH", IPC_LAUNCH_MODES),
            alone_kernel=_choice("SGLANG_P2P_ALONE_KERNEL", ("1", "0")) == "1",
            conclude_in_poll=_choice("SGLANG_P2P_CONCLUDE_IN_POLL", ("1", "0")) == "1",
            nccl_library=env.get("SGLANG_P2P_NCCL_SO_PATH") or env.get("SGLANG_NCCL_SO_PATH") or None,
            mooncake_force_tcp=env.get("MC_FORCE_TCP", "").strip().lower() in ("1", "true", "yes", "on"),
            test_corrupt_kv_file=env.get("SGLANG_P2P_TEST_CORRUPT_KV_FILE") or None,
            test_kv_digest=_choice("SGLANG_P2P_TEST_KV_DIGEST", ("0", "1")) == "1",
            room_times=_choice("SGLANG_P2P_ROOM_TIMES", ("0", "1")) == "1",
        )
