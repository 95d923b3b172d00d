"""A room's writes in flight on the prefill: a failure reaches the decode only after them; a decode's ABORT and the
ACK deferred decode KV release holds.

A decode frees a failed room's pages at once (only its own aborts are held, below), so a failure this rank
tells a decode of (`after_drain`) goes out once no write of the room is in flight: a same-host copy or Mooncake
write still running would land in pages the decode has handed to another request.

With SGLang 0.5.23+'s SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE, a decode that aborts a room keeps its
pages until every prefill rank ACKs that no write into them is in flight. Here each transfer task of a room is
counted while it runs (`begin`/`end`); an ABORT fails the room and registers the decode's ACK target, and the
ACK goes out once the count is zero: at once, or when the room's last task ends. A write that failed in a way
that cannot prove it stopped poisons the room: no ACK ever, the decode falls back to its release timeout.
Without the setting (or on 0.5.17, which has none of it) an ABORT only fails the room and nothing is counted.

The counts, targets and poison set are SGLang's (CommonKVManager's deferred-ACK machinery decides when an ACK
may go); this object is the one place that updates them, under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Callable, Container, Dict, List, Optional

from sglang.srt.disaggregation.common.conn import CommonKVManager

from sglang_p2p_backend.adapter.bounded import Bounded

try:  # deferred decode KV release (SGLang 0.5.23+); 0.5.17 has none of it and keeps the plain abort path
    from sglang.srt.disaggregation.common.conn import AbortNotification
except ImportError:
    AbortNotification = None

logger = logging.getLogger(__name__)


class DeferredRelease:
    """`sglang`: the manager whose deferred-ACK machinery this drives. `registered`: the live decode ranks.
    `fail_or_bury(room, reason, decode)`: fail the room here, or when its sender is created if it is not yet;
    False when that decode rank does not own the room (the role dropped the abort).
    `drop(kind, peer, detail)`: count and log a dropped message."""

    def __init__(
        self,
        sglang: CommonKVManager,
        registered: Container[str],
        fail_or_bury: Callable[[int, str, str], bool],
        drop: Callable[[str, str, str], None],
    ):
        self.enabled = AbortNotification is not None and bool(getattr(sglang, "enable_deferred_decode_kv_release", False))
        self._sglang = sglang
        self._registered = registered
        self._fail_or_bury = fail_or_bury
        self._drop = drop
        # orders "a write of room r starts" against "r is aborted, ACK if nothing is in flight"; reentrant: an
        # abort fails the room under it, which asks `after_drain` to tell the room's other decode ranks
        self._lock = threading.RLock()
        # SGLang's private per-room count of transfers in flight where deferred release exists: its
        # `_maybe_ack_drained_abort` sends the held ACK only when the room's count is zero, and `update_status`
        # clears it when a room id is reused, so the counts must live there
        self._in_flight: Dict[int, int] = sglang._staging_outstanding if self.enabled else defaultdict(int)
        self._after: Dict[int, List[Callable[[], None]]] = {}
        #: rooms with a write that could not prove it stopped (what `poison` records, with or without SGLang's set)
        self._unsettled: Dict[int, bool] = Bounded(1 << 12)

    def begin(self, room: int) -> None:
        """A transfer task of `room` starts: counted before the task checks the room is alive."""
        with self._lock:
            self._in_flight[room] += 1

    def end(self, room: int) -> None:
        """A transfer task of `room` ended; the last one runs what waited for the room to drain (and, for an
        aborted room, sends the held ACKs)."""
        with self._lock:
            left = self._in_flight.get(room, 0) - 1
            if left > 0:
                self._in_flight[room] = left
            else:
                self._in_flight.pop(room, None)
            waiting = self._after.pop(room, []) if left <= 0 else []
        for run in waiting:
            run()
        if left <= 0 and self.enabled:
            self._sglang._maybe_ack_drained_abort(room)  # pops the targets: at most one ACK per abort

    def wait_drained(self, timeout_s: float) -> List[int]:
        """Wait until no transfer task is in flight, at most `timeout_s`; the rooms still in flight then."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:  # a list at once: SGLang's own table (deferred release) changes outside this lock
                busy = sorted(r for r, n in list(self._in_flight.items()) if n > 0)
            if not busy or time.monotonic() >= deadline:
                return busy
            time.sleep(0.005)

    def after_drain(self, room: int, run: Callable[[], None]) -> None:
        """`run` now if no transfer task of `room` is in flight, else when the last one ends."""
        with self._lock:
            if self._in_flight.get(room, 0) > 0:
                self._after.setdefault(room, []).append(run)
                return
        run()

    def poison(self, room: int) -> None:
        """A write into the decode's pages failed in a way that cannot prove it stopped (a Mooncake batch
        may still run after its sync call returned an error): never ACK; the decode falls back to its
        release timeout (and a decode holding a failure of its own, its bound: `unsettled`)."""
        with self._lock:
            self._unsettled[room] = True
            if self.enabled:
                self._sglang.poison_deferred_ack_room(room)

    def unsettled(self, room: int) -> bool:
        """Whether a write into `room`'s decode pages failed without proof that it stopped."""
        return room in self._unsettled

    def on_abort(self, frames: List[bytes], sender: Optional[str]) -> None:
        """A decode rank aborted a room (SGLang's ABORT frames): fail it here (or remember it, if this rank has
        not started it). With deferred release the decode holds the room's pages until this rank ACKs; the ACK
        goes out once no write of the room is in flight (now, or when its last task ends: `end`)."""
        target = None
        try:
            if AbortNotification is not None:
                note = AbortNotification.from_zmq(frames)
                if note is None:
                    raise ValueError("not an AbortNotification")
                room, who = note.room, f"{note.decode_ip}:{note.decode_port}"
                if self.enabled:
                    target = note.deferred_ack_target()  # None for a decode that did not arm (no generation)
            else:
                room, who = int(frames[1]), f"{frames[2].decode()}:{frames[3].decode()}"
        except (IndexError, ValueError, UnicodeDecodeError) as e:
            self._drop("malformed", sender or "?", f"ABORT frames: {e}")
            return
        if who not in self._registered or sender != who:
            self._drop("unregistered", sender or who, f"ABORT of room {room} not from a registered decode rank")
            return
        # under the lock: a task that starts after this block sees Failed before its first write, one that
        # started before it is counted in flight, so the ACK waits for it
        with self._lock:
            if not self._fail_or_bury(room, f"Aborted by decode rank {who}", who):
                return  # another decode rank's room: dropped by the role
            if target is not None:
                self._sglang.register_deferred_ack_target(room, target)
        if target is not None:
            self._sglang._maybe_ack_drained_abort(room)
