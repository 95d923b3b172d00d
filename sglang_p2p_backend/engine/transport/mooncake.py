"""One-sided transport over Mooncake Transfer Engine: the prefill writes merged page runs straight into the
decode's registered KV / aux / state memory.

One `MooncakeTransport` per process side (prefill or decode rank) owns one Mooncake `TransferEngine`:
- created with `P2PHANDSHAKE` metadata (no metadata service): its session id is `host:rpc_port`, where the
  engine picks the RPC port itself; that string travels in the registration message;
- protocol `tcp` (anywhere, CPU included) or `rdma` (clusters; NICs from SGLang's `--disaggregation-ib-device`
  string). Mooncake's `protocol` argument does not select the transport (it auto-discovers RDMA unless
  `MC_FORCE_TCP` is set), so `tcp` sets `MC_FORCE_TCP` for the engine's initialisation and `rdma` refuses a
  machine without RDMA devices instead of silently running over TCP;
- `write` sends one chunk (all layer regions' runs) as consecutive batches of at most `max_batch` descriptors:
  Mooncake's TCP transport rejects more than 1024 queued transfers per peer, and large RDMA batches time out;
  writes to one peer are serialised so concurrent chunks cannot overflow that queue together;
- a failed write marks the peer's session failed: later writes to it fail at once (no timeout per chunk)
  until `peer_registered(session)` says the peer registered again, or `retry_after_s` (the adapter passes
  SGLANG_P2P_PEER_TIMEOUT) has passed: by then a dead peer has been noticed and forgotten, so a peer still
  there gets its next write tried. A transient fault (a link flap, a peer's memory registered anew after SGLang's
  release/resume) would otherwise end a live pair for good. A tried write that fails again doubles the skip (at
  most `MAX_RETRY_FACTOR` times `retry_after_s`), so a peer whose heartbeats go on while its data path hangs
  takes a transfer worker for a timed-out write ever more rarely; one that lands clears the mark. Sessions are
  named by the peers (a restarted decode has a new one), so this bookkeeping is bounded: a peer's lock lives
  only while writes to it run or wait, its failure mark goes when `forget_peer(session)` says the peer is gone,
  and only the `MAX_FAILED_SESSIONS` most recent marks are kept.
Page runs become (src, dst, len) descriptors in `engine/copy/plan.py` (`copy_descriptors`); this module only moves them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Iterator, Mapping, Optional, Sequence

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.transport.base import OneSidedTransport, TransportError
from sglang_p2p_backend.engine.transport.select import rdma_devices

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
#: Mooncake's TCP per-peer queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER default): a bigger batch fails
MAX_BATCH_DESCRIPTORS = 1024
#: Mooncake clamps its transfer timeout to at least 5 s
MIN_TRANSFER_TIMEOUT_S = 5
#: failure marks kept at most (twice SGLANG_P2P_MAX_PEERS' default): a mark pushed out only costs its peer one
#: more failing write (within the transfer timeout) before it is marked again
MAX_FAILED_SESSIONS = 1024
#: seconds a failure mark skips writes to its session: SGLANG_P2P_PEER_TIMEOUT's default (the adapter passes the
#: setting itself)
RETRY_AFTER_S = EngineConfig.peer_timeout
#: each tried write that fails again doubles the skip, up to this many times `retry_after_s`
MAX_RETRY_FACTOR = 8
#: the clock of failure marks (tests replace it)
_now = time.monotonic
# Mooncake reads MC_* variables from the process environment at construction/initialisation; this lock keeps
# two engines being built at once from seeing each other's temporary settings.
_ENV_LOCK = threading.Lock()


def batch_bounds(n: int, max_batch: int) -> list[tuple[int, int]]:
    """[start, end) index ranges that cut `n` descriptors into batches of at most `max_batch`."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return [(i, min(i + max_batch, n)) for i in range(0, n, max_batch)]


def ib_devices_for_gpu(ib_device: Optional[str], gpu_id: int) -> str:
    """Mooncake's `device_name` for one GPU from SGLang's `--disaggregation-ib-device` value.

    Accepts what SGLang accepts: "mlx5_0,mlx5_1" (all GPUs), a JSON object {"0": "mlx5_0", ...}, or the path
    of a .json file holding that object. Empty or None means "let Mooncake pick" ("").
    """
    text = (ib_device or "").strip()
    if not text:
        return ""
    if text.endswith(".json"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read IB device map {ib_device!r}: {e}") from e
    elif not text.startswith("{"):
        return ",".join(d.strip() for d in text.split(",") if d.strip())
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"IB device map {ib_device!r} is not valid JSON: {e}") from e
    if not isinstance(mapping, dict) or not all(str(k).isdigit() and isinstance(v, str) for k, v in mapping.items()):
        raise ValueError(f"IB device map {ib_device!r} must map GPU ids to device strings")
    devices = {int(k): v for k, v in mapping.items()}
    if gpu_id not in devices:
        raise ValueError(f"IB device map {ib_device!r} has no entry for GPU {gpu_id} (has {sorted(devices)})")
    return ",".join(d.strip() for d in devices[gpu_id].split(",") if d.strip())


def _ints(values: Sequence[int]) -> list[int]:
    """Plain Python ints for the pybind call (plan.py hands numpy arrays)."""
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


def session_name(host: str, rpc_port: int) -> str:
    """The session id Mooncake's P2P handshake answers to (it brackets IPv6 hosts the same way)."""
    return f"[{host}]:{rpc_port}" if ":" in host and not host.startswith("[") else f"{host}:{rpc_port}"


@contextlib.contextmanager
def _scoped_env(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables for the duration of the block, then restore them."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        try:
            for k, v in values.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _import_engine_class() -> type:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        hint = (
            "install the system package libibverbs1 (Debian/Ubuntu: apt-get install -y libibverbs1)"
            if "ibverbs" in str(e)
            else "pip install mooncake-transfer-engine (CUDA hosts) or mooncake-transfer-engine-non-cuda (CPU)"
        )
        raise TransportError(f"Mooncake Transfer Engine cannot be imported ({e}); {hint}") from e
    return TransferEngine


class MooncakeTransport(OneSidedTransport):
    """`OneSidedTransport` over one Mooncake TransferEngine (see module docstring).

    `hostname` is the address peers reach this process at (its session id's host); `ib_device` and `gpu_id`
    pick the NICs for rdma; a batch that makes no progress fails after `transfer_timeout_s` plus one second
    per GiB of the batch (Mooncake's rule), so a hung peer costs at most that per chunk, once.
    """

    name = "mooncake"

    def __init__(
        self,
        protocol: str = "tcp",
        hostname: str = "127.0.0.1",
        ib_device: Optional[str] = None,
        gpu_id: int = 0,
        transfer_timeout_s: int = 30,
        max_batch: int = MAX_BATCH_DESCRIPTORS,
        max_failed: int = MAX_FAILED_SESSIONS,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"Mooncake protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.protocol = protocol
        self.max_batch = max_batch
        self.transfer_timeout_s = max(MIN_TRANSFER_TIMEOUT_S, int(transfer_timeout_s))
        self._lock = threading.Lock()
        #: session -> [its lock, writers holding or waiting for it]: removed when the last one leaves
        self._peer_locks: dict[str, list] = {}
        #: session -> (why writes to it failed, when: `_now()`, seconds skipped from then), oldest first, at most
        #: `max_failed`
        self._failed: "OrderedDict[str, tuple[str, float, float]]" = OrderedDict()
        self._max_failed = max(1, int(max_failed))
        self.retry_after_s = float(retry_after_s)
        self._registered: dict[int, int] = {}
        self._closed = False
        self.device_name = self._device_name(protocol, ib_device, gpu_id)
        engine_cls = _import_engine_class()
        env = {
            "MC_TRANSFER_TIMEOUT": str(self.transfer_timeout_s),
            # tcp: keep Mooncake off the NICs even where there are some; rdma: never let a stray setting demote it
            "MC_FORCE_TCP": "1" if protocol == "tcp" else None,
        }
        with _scoped_env(env):
            self._engine = engine_cls()
            rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, self.device_name)
        if rc != 0:
            raise TransportError(
                f"Mooncake initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, {self.device_name!r}) "
                f"returned {rc}: check the host address and, for rdma, the device names"
            )
        self._session = session_name(hostname, self._engine.get_rpc_port())
        logger.info("Mooncake %s engine up, session %s, devices %r", protocol, self._session, self.device_name)

    @staticmethod
    def _device_name(protocol: str, ib_device: Optional[str], gpu_id: int) -> str:
        """tcp ignores NICs; rdma needs RDMA devices on the machine, and the named ones must be among them."""
        if protocol == "tcp":
            return ""
        present = rdma_devices()
        if not present:
            raise TransportError("Mooncake protocol 'rdma' needs RDMA devices and this machine has none "
                                 "(/sys/class/infiniband is empty); use protocol 'tcp'")
        wanted = ib_devices_for_gpu(ib_device, gpu_id)
        missing = [d for d in wanted.split(",") if d and d not in present]
        if missing:
            raise TransportError(f"RDMA devices {missing} from the IB device setting are not on this machine (has {present})")
        return wanted

    # -- OneSidedTransport ------------------------------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        engine = self._live_engine()
        # SGLang's pools can list the same buffer twice (e.g. shared draft layers) and empty regions; like
        # SGLang's Mooncake backend, register each non-empty base once.
        new: dict[int, int] = {}
        for addr, length in regions:
            if length <= 0 or addr in self._registered or addr in new:
                continue
            new[addr] = length
        if not new:
            return
        rc = engine.batch_register_memory(list(new), list(new.values()))
        if rc != 0:
            raise TransportError(f"Mooncake batch_register_memory of {len(new)} regions ({sum(new.values())} B) returned {rc}")
        self._registered.update(new)

    def session_id(self) -> str:
        return self._session

    def write(self, session: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        if not len(src) == len(dst) == len(lengths):
            raise ValueError(f"descriptor lists differ in length: {len(src)} src, {len(dst)} dst, {len(lengths)} lengths")
        engine = self._live_engine()
        with self._peer_lock(session):
            mark = self._failed.get(session)
            if mark is not None:
                ago = _now() - mark[1]
                if ago < mark[2]:
                    raise TransportError(f"Mooncake session {session} failed {ago:.1f}s ago ({mark[0]}); skipped until "
                                         f"the peer registers again or for {mark[2] - ago:.1f}s more")
            src, dst, lengths = _ints(src), _ints(dst), _ints(lengths)
            keep = [i for i, n in enumerate(lengths) if n]
            if len(keep) != len(lengths):  # an empty region yields zero-length descriptors; Mooncake needs none
                src, dst, lengths = [src[i] for i in keep], [dst[i] for i in keep], [lengths[i] for i in keep]
            bounds = batch_bounds(len(src), self.max_batch)
            for k, (a, b) in enumerate(bounds):
                t0 = time.monotonic()
                rc = engine.batch_transfer_sync_write(session, src[a:b], dst[a:b], lengths[a:b])
                if rc != 0:
                    cause = (
                        f"batch write returned {rc} after {time.monotonic() - t0:.2f}s on batch {k + 1}/{len(bounds)} "
                        f"({b - a} descriptors, {sum(lengths[a:b])} B): peer dead or unreachable, destination not "
                        f"registered there, or timeout ({self.transfer_timeout_s}s)"
                    )
                    self._mark_failed(session, cause)
                    raise TransportError(f"Mooncake write to {session} failed: {cause}")
            if mark is not None and bounds:
                self._clear_mark(session, "answered a write again")

    def unregister(self) -> None:
        self._unregister(self._live_engine())

    def _unregister(self, engine: Any) -> None:
        if self._registered:
            rc = engine.batch_unregister_memory(list(self._registered))
            if rc != 0:
                logger.warning("Mooncake batch_unregister_memory of %d regions returned %d", len(self._registered), rc)
            self._registered.clear()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._unregister(self._engine)
        # dropping the last reference runs the engine's destructor: closes segments, stops its listener threads
        self._engine = None

    # -- peer bookkeeping ---------------------------------------------------------------------------------------

    def peer_registered(self, session: str) -> None:
        """The peer (re-)registered: clear a failure mark so writes to it are tried again."""
        self._clear_mark(session, "registered again")

    def forget_peer(self, session: str) -> None:
        """The peer at Mooncake `session` is gone (dead, released, replaced): drop its failure mark. A restarted
        peer registers under a new session, so without this every restart would leave one behind."""
        with self._lock:
            self._failed.pop(session, None)

    def failed_sessions(self) -> dict[str, str]:
        """Sessions marked failed (skipped for a while after the mark: `_mark_failed`), with the cause."""
        with self._lock:
            return {session: mark[0] for session, mark in self._failed.items()}

    def probe(self, session: str) -> bool:
        """True if the peer answers Mooncake's handshake probe. Blocking and unbounded against a hung (not dead)
        peer (about a minute seen), so never call it on a transfer path."""
        return self._live_engine().send_probe(session) == 0

    # -- internals -----------------------------------------------------------------------------------------------

    def _live_engine(self):  # the Mooncake TransferEngine; a local reference keeps it alive through a call
        engine = self._engine
        if self._closed or engine is None:
            raise TransportError("Mooncake transport is closed")
        return engine

    @contextlib.contextmanager
    def _peer_lock(self, session: str) -> Iterator[None]:
        """Hold the peer's write lock. It is counted while held or waited for and dropped with its last user,
        so the table holds only peers written to now (at most one per writing thread)."""
        with self._lock:
            entry = self._peer_locks.get(session)
            if entry is None:
                entry = self._peer_locks[session] = [threading.Lock(), 0]
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0 and self._peer_locks.get(session) is entry:
                    del self._peer_locks[session]

    def _clear_mark(self, session: str, why: str) -> None:
        with self._lock:
            if self._failed.pop(session, None) is not None:
                logger.info("Mooncake session %s %s; writes to it resume", session, why)

    def _mark_failed(self, session: str, cause: str) -> None:
        """Mark `session` failed now: skipped for `retry_after_s`, or twice its last skip where it was marked
        already (the write tried after it failed too), up to MAX_RETRY_FACTOR times."""
        with self._lock:
            last = self._failed.get(session)
            skip = self.retry_after_s if last is None else min(2 * last[2], MAX_RETRY_FACTOR * self.retry_after_s)
            self._failed[session] = (cause, _now(), skip)
            self._failed.move_to_end(session)
            while len(self._failed) > self._max_failed:
                self._failed.popitem(last=False)

    def __enter__(self) -> "MooncakeTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
