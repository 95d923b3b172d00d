"""Deferred decode KV release on the prefill: a decode's ABORT, the room's writes in flight, the held ACK.

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
from typing import Callable, Container, Dict, List, Optional

from sglang.srt.disaggregation.common.conn import CommonKVManager

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
        # orders "a write of room r starts" against "r is aborted, ACK if nothing is in flight"
        self._lock = threading.Lock()
        # SGLang's private per-room count of transfers in flight: its `_maybe_ack_drained_abort` sends the held
        # ACK only when the room's count is zero, and `update_status` clears it when a room id is reused, so
        # the counts must live there (and exist only where deferred release does)
        self._in_flight: Optional[Dict[int, int]] = sglang._staging_outstanding if self.enabled else None

    def begin(self, room: int) -> None:
        """A transfer task of `room` starts: counted before the task checks the room is alive."""
        if self._in_flight is not None:
            with self._lock:
                self._in_flight[room] += 1

    def end(self, room: int) -> None:
        """A transfer task of `room` ended; the last one of an aborted room sends the held ACKs."""
        if self._in_flight is None:
            return
        with self._lock:
            left = self._in_flight.get(room, 0) - 1
            if left > 0:
                self._in_flight[room] = left
            else:
                self._in_flight.pop(room, None)
        if left <= 0:
            self._sglang._maybe_ack_drained_abort(room)  # pops the targets: at most one ACK per abort

    def poison(self, room: int) -> None:
        """A write into the decode's pages failed in a way that cannot prove it stopped (a Mooncake batch
        may still run after its sync call returned an error): never ACK; the decode falls back to its
        release timeout."""
        if self.enabled:
            with self._lock:
                self._sglang.poison_deferred_ack_room(room)

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
