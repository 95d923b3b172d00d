"""The prefill's pair-channel offers (engine/pair/channels.py): an offer counts only the answer of the decode it
was made to, once, with a cap no larger than the one offered (what this rank's communicator budget admitted);
anything else is dropped or refused without blocking the control thread that delivers it. No transport: the
sender and the control channel are stand-ins, the budget is the real one."""

import re
import threading

import pytest

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.pair.channels import PairChannels
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.engine.wire import messages as wire

PREFILL, DECODE, OTHER = "10.0.0.1:1000", "10.0.0.2:2000", "10.0.0.3:3000"


class Sender:
    """Stands for PairSender: records the cap it was opened with and what it sent."""

    def __init__(self):
        self.comm, self.opened, self.sent = None, [], []

    def open(self, cap):
        self.opened.append(cap)
        self.comm = object()

    def send(self, room, *args, **kwargs):
        self.sent.append(room)


class Control:
    """Stands for ControlChannel: each offer sent goes to `on_offer(channels, offer)`, which answers it."""

    def __init__(self, on_offer):
        self.on_offer, self.offers = on_offer, []

    def send(self, endpoint, msg, block=True):
        if isinstance(msg, wire.CommOffer):
            self.offers.append((endpoint, msg))
            self.on_offer(endpoint, msg)


def channels(on_offer, caps=(8, 4)):
    ch = PairChannels(None, None, None, None, PREFILL, EngineConfig(nccl_caps=caps, connect_timeout=1.0))
    ch.control = Control(lambda endpoint, offer: on_offer(ch, endpoint, offer))
    sender = ch.senders[DECODE] = Sender()
    return ch, sender


def send(ch):
    ch.send(DECODE, 7, 0, [], [], next_seq=lambda: 0, alive=lambda: True)


def later(fn, *args):
    """Run on another thread, as the control thread would deliver answers (the old code blocked it)."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def deliver(ch, *answers):
    """Answers from the control thread, in order; whether it got through them without blocking."""
    control = later(lambda: [ch.answered(a) for a in answers])
    control.join(timeout=1)
    return not control.is_alive()


def test_an_answer_from_another_decode_neither_refuses_nor_sizes_the_offer():
    def on_offer(ch, endpoint, offer):
        assert endpoint == DECODE
        # another registered decode guesses the sequential offer id: a refusal, then a lean cap
        deliver(ch, wire.CommAnswer(OTHER, offer.offer, -1, "no room"), wire.CommAnswer(OTHER, offer.offer, 2))
        later(ch.answered, wire.CommAnswer(DECODE, offer.offer, 4))  # the real answer follows

    ch, sender = channels(on_offer)
    send(ch)
    assert sender.opened == [4] and sender.sent == [7]
    assert ch.dropped_answers == 2 and ch._offers == {}


@pytest.mark.parametrize("answer,needle", [
    (0, "answered cap 0 (NCCL's default channels) to an offer of cap 8"),
    (16, "answered cap 16 to an offer of cap 8"),
])
def test_a_cap_above_the_offer_is_refused_naming_both_and_frees_the_budget(answer, needle):
    def on_offer(ch, endpoint, offer):
        assert offer.cap == 8  # what this rank's budget admitted
        deliver(ch, wire.CommAnswer(DECODE, offer.offer, answer))

    ch, sender = channels(on_offer)
    with pytest.raises(TransportError, match=re.escape(f"decode rank {DECODE} {needle}")):
        send(ch)
    # nothing opened with buffers the budget never admitted, and the admission is given back
    assert sender.opened == [] and ch.budget.used_mb() == 0 and DECODE not in ch.budget.pool


@pytest.mark.parametrize("caps,answer,opened", [((8, 4), 8, 8), ((8, 4), 1, 1), ((None, 8), 0, None), ((None, 8), 8, 8)])
def test_a_cap_within_the_offer_opens_the_channel(caps, answer, opened):
    ch, sender = channels(lambda ch, endpoint, offer: ch.answered(wire.CommAnswer(DECODE, offer.offer, answer)), caps)
    send(ch)
    assert sender.opened == [opened] and DECODE in ch.budget.pool


def test_duplicate_and_late_answers_are_dropped_without_blocking_the_control_thread():
    blocked = []

    def on_offer(ch, endpoint, offer):
        # the decode answers twice before the worker (still here, sending its offer) reads either
        answer = wire.CommAnswer(DECODE, offer.offer, 4)
        blocked.append(not deliver(ch, answer, answer))

    ch, sender = channels(on_offer)
    send(ch)
    assert blocked == [False], "a second answer blocked the control thread"
    offer = ch.control.offers[0][1].offer
    assert deliver(ch, wire.CommAnswer(DECODE, offer, 4))  # after the offer concluded
    assert sender.opened == [4] and ch.dropped_answers == 2 and ch._offers == {}
