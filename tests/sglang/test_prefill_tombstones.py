"""A room's end that reaches the prefill before its sender or its destinations (a tombstone in `concluded`), when
the scheduler's thread starts the sender, or the decode's destinations land, between the control thread's check
and the tombstone: the room is still failed, or the decode still told, exactly once.

The interleaving is forced: the table the check reads runs the other thread's step at the moment it is read."""

import types

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.adapter.bounded import Bounded
from sglang_p2p_backend.adapter.prefill import PrefillKVManager

pytestmark = pytest.mark.sglang

ROOM = 71


class StepOnFirstRead(dict):
    """A table whose first `get`/`in` of ROOM answers from before `step()` runs, then runs it: the other thread
    acting right after the check."""

    def __init__(self, step):
        super().__init__()
        self.step, self.read = step, False

    def _first(self) -> bool:
        first, self.read = not self.read, True
        return first

    def __contains__(self, key) -> bool:
        before = super().__contains__(key)
        if key == ROOM and self._first():
            self.step()
        return before

    def get(self, key, default=None):
        before = super().get(key, default)
        if key == ROOM and self._first():
            self.step()
        return before


def manager(**tables) -> types.SimpleNamespace:
    """The prefill manager's tombstone logic on tables of its own (no sockets, no SGLang scheduler)."""
    mgr = types.SimpleNamespace(concluded=Bounded(16), owned_rooms=set(), transfer_infos={}, request_status={},
                                failed=[], told=[], slots=types.SimpleNamespace(worked=lambda infos: None),
                                kv_released=None)
    mgr.__dict__.update(tables)
    mgr._owns = lambda session, room, what: True
    mgr._fail_room = lambda room, reason, **kw: mgr.failed.append((room, reason))
    mgr._notify_decode = lambda room, status, reason="", *a, **kw: mgr.told.append((room, status, reason))
    for name in ("_fail_or_bury", "room_started", "notify_aborted"):
        setattr(mgr, name, getattr(PrefillKVManager, name).__get__(mgr))
    return mgr


def test_a_decode_refusal_racing_the_senders_start_fails_the_room_once():
    def start_sender() -> None:  # the scheduler's thread: Common sets the status, then the sender calls room_started
        mgr.request_status[ROOM] = KVPoll.Bootstrapping
        mgr.room_started(ROOM)  # finds no tombstone yet

    mgr = manager()
    mgr.request_status = StepOnFirstRead(start_sender)
    assert mgr._fail_or_bury(ROOM, "decode rank d refused: page size", "d")
    assert mgr.failed == [(ROOM, "decode rank d refused: page size")]
    assert ROOM not in mgr.concluded


def test_a_tombstone_found_by_the_sender_fails_the_room_once():
    mgr = manager()
    assert mgr._fail_or_bury(ROOM, "decode rank d refused: page size", "d")
    assert mgr.failed == [] and ROOM in mgr.concluded
    mgr.request_status[ROOM] = KVPoll.Bootstrapping
    mgr.room_started(ROOM)
    assert mgr.failed == [(ROOM, "decode rank d refused: page size")] and ROOM not in mgr.concluded


def test_a_prefill_abort_racing_the_decodes_destinations_tells_the_decode():
    def destinations_land() -> None:  # the control thread: _on_metadata saw no tombstone and kept them
        mgr.transfer_infos[ROOM] = {"d": object()}

    mgr = manager()
    mgr.transfer_infos = StepOnFirstRead(destinations_land)
    mgr.notify_aborted(ROOM)
    assert mgr.told == [(ROOM, KVPoll.Failed, "Aborted on prefill by AbortReq")]
    assert ROOM not in mgr.concluded
