"""The decode's registration with a prefill rank, against SGLang's thread sending to it meanwhile: what waits for
the prefill's answer goes out in order, after the confirmation, and nothing sent on SGLang's thread overtakes it or
is lost. (A frame that reaches the prefill before the confirmation does not carry a secret it knows yet: it is
dropped as a stranger's, and an ABORT so lost left the prefill's room to SGLang's bootstrap timeout.) The parts
around the two methods are small fakes."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from sglang_p2p_backend.adapter import decode
from sglang_p2p_backend.adapter.decode import DecodeKVManager, PrefillPeer
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.control import ControlError

PREFILL = "127.0.0.1:5000"


class Wire:
    """The control channel: every frame list sent, in order; `during_send` runs inside one send (once)."""

    def __init__(self) -> None:
        self.sent: list = []
        self.during_send = None
        self.blocking: list = []  # each send's `block`
        self.full: set = set()  # frames whose queue is full: a send that would wait fails (ControlError)

    def send_frames(self, endpoint, frames, block=True):
        hook, self.during_send = self.during_send, None
        if hook is not None:
            hook()
        self.blocking.append(block)
        if isinstance(frames[0], bytes) and frames[0] in self.full:
            raise ControlError(f"control message to {endpoint} not delivered: Resource temporarily unavailable")
        self.sent.append((endpoint, frames))

    def set_secret(self, endpoint, secret):
        pass


def manager(peer: PrefillPeer) -> SimpleNamespace:
    m = SimpleNamespace(prefills={PREFILL: peer}, _held_lock=threading.Lock(), control=Wire(), session="d:1",
                        incarnation=3, agreement=None, attn_tp_rank=0, watch=SimpleNamespace(forget=lambda s: None))
    m.send_to_prefill = lambda endpoint, frames, block=True: DecodeKVManager.send_to_prefill(m, endpoint, frames, block)
    m._release_held = lambda endpoint, p, state: DecodeKVManager._release_held(m, endpoint, p, state)
    m._heads_from = lambda msg: None
    m._control_send = lambda session, msg: m.control.send_frames(session, [msg])
    m.drop = lambda *a: pytest.fail(f"dropped: {a}")
    return m


def test_the_confirmation_goes_before_the_state_turns_and_the_held_frames_follow_it(monkeypatch):
    monkeypatch.setattr(decode, "differences", lambda *a: [])
    monkeypatch.setattr(decode, "pair_state_spans", lambda *a: ())
    peer = PrefillPeer("pending", 0.0)
    m = manager(peer)
    m.send_to_prefill(PREFILL, [b"ABORT", b"7"])  # SGLang's thread, before the answer: held
    assert m.control.sent == [] and peer.held == [[b"ABORT", b"7"]]
    states: list = []
    m.control.during_send = lambda: states.append(peer.state)  # the state as the confirmation goes out
    answer = SimpleNamespace(session=PREFILL, problem="", secret=b"s", agreement=None, attn_tp_rank=0,
                             prefill_rank=1, incarnation=9)
    DecodeKVManager._on_answer(m, answer)
    assert states == ["pending"], "the state turned before the confirmation went: SGLang's thread could overtake it"
    (to, heartbeat), second = m.control.sent[0], m.control.sent[1]
    assert to == PREFILL and isinstance(heartbeat[0], wire.Heartbeat) and second == (PREFILL, [b"ABORT", b"7"])
    assert peer.state == "accepted" and peer.held == [] and peer.prefill_rank == 1
    m.send_to_prefill(PREFILL, [b"ABORT", b"8"])  # after the answer: straight out
    assert m.control.sent[-1] == (PREFILL, [b"ABORT", b"8"])


def test_a_frame_sent_while_the_held_ones_go_out_waits_for_them_and_is_not_lost():
    peer = PrefillPeer("pending", 0.0)
    m = manager(peer)
    m.send_to_prefill(PREFILL, [b"held"])
    racer = threading.Thread(target=m.send_to_prefill, args=(PREFILL, [b"racer"]))
    m.control.during_send = racer.start  # SGLang's thread sends while the held frame is being sent
    m._release_held(PREFILL, peer, "accepted")
    racer.join(5)
    assert [f for _, f in m.control.sent] == [[b"held"], [b"racer"]]
    assert peer.held == []


def test_a_refusal_sends_the_held_frames_before_it_fails_the_rooms_so_the_prefill_fails_its_side():
    peer = PrefillPeer("pending", 0.0)
    m = manager(peer)
    events: list = []
    m._fail_rooms_served_by = lambda session, reason: events.append(("failed", session, reason))
    m._writer_gone = lambda session: None
    m.send_to_prefill(PREFILL, [b"RoomMetadata"])
    m.control.during_send = lambda: events.append(("sent", peer.state))
    DecodeKVManager._on_answer(m, SimpleNamespace(session=PREFILL, problem="layouts differ", secret=b"s"))
    assert peer.state == "refused" and m.control.sent == [(PREFILL, [b"RoomMetadata"])]
    # the metadata reaches the refusing prefill (which fails its side of the room) before this side fails it
    assert [e[0] for e in events] == ["sent", "failed"] and events[0][1] == "refused"
    assert "layouts differ" in events[1][2]


def test_the_held_frames_never_wait_for_room_under_the_lock_and_one_that_finds_its_queue_full_is_logged(caplog):
    """SGLang's thread waits for that lock in `send_to_prefill`: a held frame waiting there for a prefill that
    stopped reading would hold it too."""
    peer = PrefillPeer("pending", 0.0)
    m = manager(peer)
    for frames in ([b"first"], [b"stuck"], [b"third"]):
        m.send_to_prefill(PREFILL, frames)
    m.control.full = {b"stuck"}
    with caplog.at_level("WARNING", logger="sglang_p2p_backend.adapter.decode"):
        m._release_held(PREFILL, peer, "accepted")
    assert m.control.blocking == [False, False, False]
    assert [f for _, f in m.control.sent] == [[b"first"], [b"third"]]  # the rest still go, in order
    assert peer.held == [] and peer.state == "accepted"
    assert any("not delivered" in r.getMessage() for r in caplog.records)
    m.send_to_prefill(PREFILL, [b"later"])  # SGLang's own sends keep their blocking, bounded send
    assert m.control.blocking[-1] is True and m.control.sent[-1] == (PREFILL, [b"later"])
