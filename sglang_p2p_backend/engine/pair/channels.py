"""The two-sided pair channels of one rank, both sides: `PairChannels` on the prefill (one `PairSender` per
decode rank, opened within the communicator budget after an offer/answer with the decode, aborted when the peer
dies or refuses a chunk) and `PairReceivers` on the decode (one `PairReceiver` per prefill rank, admitted within
its own budget when the prefill offers a channel, dropped when the prefill closes it or dies).

Only the prefill closes pair channels (engine/pair/comm_budget.py): its own victims when admitting a new one, idle
ones a decode asks it to release (CommRelease). Senders belong to the transfer worker that owns the peer;
other threads only abort a sender's channel (thread-safe on every transport), never replace it. Each receiver
is a thread of its own; the decode's control thread only queues work on it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable, Dict, Iterable, Optional, Sequence

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.pair.comm_budget import CommBudget, NoRoom, cap_from_wire, cap_to_wire
from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.wire.control import ControlChannel, ControlError
from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.copy.heads import PairHeads
from sglang_p2p_backend.engine.copy.state_slices import StatePlan
from sglang_p2p_backend.engine.pair.pipeline import ChunkDone, PairReceiver, PairSender
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.transport.base import TransportError, TwoSidedTransport
from sglang_p2p_backend.engine.wire.checks import ChunkVerdict

logger = logging.getLogger(__name__)


#: best-effort control send of the decode side: (session, message, block) -> whether it went out
Send = Callable[[str, wire.Message, bool], bool]


class _Offer:
    """A pair-channel offer waiting for its answer: whom it was made to and the cap offered (wire form), so an
    answer from anyone else, or one above what this rank's budget admitted, is never acted on."""

    __slots__ = ("session", "cap", "answers")

    def __init__(self, session: str, cap: int):
        self.session = session
        self.cap = cap
        #: one answer at most: a duplicate is dropped (put_nowait), never blocks the control thread
        self.answers: "queue.Queue[wire.CommAnswer]" = queue.Queue(1)


def answer_problem(offered: int, answered: int) -> Optional[str]:
    """Why an answer's cap (wire form: -1 no room, 0 NCCL's default) cannot be used for an offer of `offered`,
    or None. A decode may only lower the cap: 0 (NCCL's default buffers, the most memory) only answers an offer
    of 0; anything else lies in 1..offered."""
    if answered < 0:
        return None  # no room: the caller reads the reason
    if offered == 0 or 1 <= answered <= offered:
        return None
    what = "0 (NCCL's default channels)" if answered == 0 else str(answered)
    return f"answered cap {what} to an offer of cap {offered}; a decode may only answer a cap in 1..{offered}"


class PairChannels:
    """Prefill side: the senders of this rank's pair channels, one per decode rank."""

    def __init__(
        self,
        transport: TwoSidedTransport,
        staging: StagingPool,
        copier: PageCopier,
        control: ControlChannel,
        session: str,
        config: EngineConfig,
    ):
        self.transport = transport
        self.staging = staging
        self.copier = copier
        self.control = control
        self.session = session
        self.config = config
        self.senders: Dict[str, PairSender] = {}
        self.budget = CommBudget.from_config(config, "prefill", self._evict)
        #: pending offers by id: one per worker opening a channel now, removed when its wait ends
        self._offers: Dict[int, _Offer] = {}
        self._offer_ids = itertools.count(1)
        #: answers dropped (unknown or finished offer, another decode's offer, a duplicate), for logs and tests
        self.dropped_answers = 0
        #: after a "no room" answer, a peer is not offered a channel again until then (auto picks Mooncake)
        self.no_room_until: Dict[str, float] = {}

    def admits(self, session: str) -> bool:
        """Would `session` get a channel now (auto's NCCL-budget input)?"""
        return time.monotonic() >= self.no_room_until.get(session, 0.0) and self.budget.fits(session)

    def answered(self, msg: wire.CommAnswer) -> None:
        """On the control thread: hand an answer to the worker waiting on its offer. Offer ids are sequential,
        so one decode could guess another's: an answer counts only from the session the offer was made to, and
        only once; anything else is dropped (the real answer, or the worker's timeout, still ends the wait)."""
        offer = self._offers.get(msg.offer)
        if offer is None:
            problem = f"CommAnswer to offer {msg.offer}, which is unknown or already answered"
        elif msg.session != offer.session:
            problem = f"CommAnswer to offer {msg.offer}, which was made to decode rank {offer.session}"
        else:
            try:
                offer.answers.put_nowait(msg)
                return
            except queue.Full:
                problem = f"second CommAnswer to offer {msg.offer}"
        self.dropped_answers += 1
        if self.dropped_answers <= 20 or self.dropped_answers % 1000 == 0:
            logger.warning("p2pnccl: dropped an answer of decode rank %s (#%d): %s", msg.session,
                           self.dropped_answers, problem)

    def released(self, session: str) -> None:
        """The decode is short of communicator memory: close our channel to it if idle."""
        if self.budget.close_if_idle(session):
            logger.info("p2pnccl: released the idle pair channel of decode rank %s (its budget is full)", session)

    def abort(self, session: str, generation: Optional[int], reason: str) -> None:
        """Abort the peer's channel (of `generation`, or whichever is up) from any thread: a worker blocked on
        it returns with an error and drops it; the next chunk opens a new one."""
        sender = self.senders.get(session)
        if sender is not None:
            sender.abort_channel(generation, reason)

    def reset(self, session: str) -> None:
        """On the worker that owns the peer: forget its sender and channel (re-registered or dead)."""
        sender = self.senders.pop(session, None)
        if sender is not None:
            sender.close()
        self.budget.closed(session)
        self.no_room_until.pop(session, None)

    def _sender(self, session: str) -> PairSender:
        sender = self.senders.get(session)
        if sender is None:
            sender = self.senders[session] = PairSender(
                transport=self.transport,
                staging=self.staging,
                copier=self.copier,
                local_session=self.session,
                control=lambda m, s=session: self.control.send(s, m),
                connect_timeout=self.config.connect_timeout,
                io_timeout=self.config.io_timeout,
                overlap=self.config.overlap,
                first_chunk=self.config.first_chunk_bytes,
            )
        return sender

    def _evict(self, session: str) -> None:
        """Close the idle pair channel of `session` for the pool (called with the pool's lock held, so the
        owning worker cannot start a transfer on it) and tell the decode, which drops its end in order."""
        sender = self.senders.get(session)
        generation = sender.close_channel() if sender is not None else None
        if generation is not None:
            try:
                self.control.send(session, wire.CommClosed(self.session, generation))
            except ControlError as e:
                logger.warning("p2pnccl: %s", e)

    def _open(self, session: str, sender: PairSender) -> None:
        """Admit a new pair channel in this rank's budget, agree its cap with the decode's budget, open it.
        Raises NoRoom when either side has no room now, TransportError when it cannot be opened."""
        decision = self.budget.admit(session)
        try:
            offer_id, offer = next(self._offer_ids), _Offer(session, cap_to_wire(decision.cap))
            self._offers[offer_id] = offer
            try:
                self.control.send(session, wire.CommOffer(self.session, offer_id, offer.cap))
                answer = offer.answers.get(timeout=self.config.connect_timeout)
            except queue.Empty:
                raise TransportError(
                    f"decode rank {session} did not answer the pair-channel offer within "
                    f"{self.config.connect_timeout:.0f}s (SGLANG_P2P_CONNECT_TIMEOUT)"
                ) from None
            finally:
                self._offers.pop(offer_id, None)
            if answer.cap < 0:
                raise NoRoom(f"decode rank {session}: {answer.reason}")
            # a cap above the offer (or NCCL's default) would take more memory than this rank's budget admitted
            problem = answer_problem(offer.cap, answer.cap)
            if problem is not None:
                raise TransportError(f"decode rank {session} {problem}")
            cap = cap_from_wire(answer.cap)
            sender.open(cap)
            self.budget.opened(session, cap)
        except BaseException:
            self.budget.closed(session)
            raise

    def send(self, session: str, room: int, prefill_rank: int, src: list, dst: list,
             next_seq: Callable[[], int], alive: Callable[[], bool], heads: Optional[PairHeads] = None,
             state: Sequence[Optional[StatePlan]] = ()) -> None:
        """Send over the peer's pair channel, opening one within the budget when it has none (or lost it)."""
        sender = self._sender(session)
        try:
            while alive():
                with self.budget.using(session) as live:
                    if live and sender.comm is not None:
                        sender.send(room, prefill_rank, src, dst, keep_going=alive, next_seq=next_seq, heads=heads,
                                    state=state)
                        return
                if live:  # the pool counts a channel the sender lost: forget it before opening a new one
                    self.budget.closed(session)
                self._open(session, sender)
        except TransportError:
            self.budget.closed(session)
            raise

    def close(self) -> None:
        for sender in list(self.senders.values()):
            sender.close()


class PairReceivers:
    """Decode side: the receivers of this rank's pair channels, one per prefill rank. The decode admits channels
    within its own budget but never closes one: the prefill owns the pair's traffic, so the decode asks it to
    release an idle channel instead (CommRelease)."""

    def __init__(
        self,
        transport: TwoSidedTransport,
        staging: StagingPool,
        copier: PageCopier,
        session: str,
        config: EngineConfig,
        send: Send,
        wanted: Callable[[int], bool],
        on_chunk: ChunkDone,
        check: Callable[[wire.ChunkHeader], ChunkVerdict],
        on_queued: Optional[Callable[[int], bool]] = None,
        on_ended: Callable[[int], None] = lambda room: None,
    ):
        self.transport = transport
        self.staging = staging
        self.copier = copier
        self.session = session
        self.config = config
        self.send = send
        #: whether a room still wants its chunks scattered
        self.wanted = wanted
        #: told each chunk a receiver handled (room, prefill rank, error or None)
        self.on_chunk = on_chunk
        #: a chunk header's checks against the room's published pages, on the receiver's thread
        self.check = check
        #: SGLANG_P2P_DEVICE_SCATTER: scatters queued on the GPU behind their receives, each counted for its room
        #: (`on_queued`, which refuses a room no longer wanted) until seen ended (`on_ended`); only where the
        #: caller counts them, since a room must not fail while one may still write its pages
        self.on_queued, self.on_ended = on_queued, on_ended
        self.receivers: Dict[str, PairReceiver] = {}
        self.budget = CommBudget.from_config(config, "decode")

    def offered(self, msg: wire.CommOffer) -> None:
        """A prefill wants a pair channel: answer the cap this rank's budget affords, or no room (and ask the
        least recently used prefill with an idle channel to release it, so a retry finds room)."""
        # a new offer replaces this prefill's channel (its receiver drops the old one at the CommInit)
        self.budget.closed(msg.session)
        try:
            decision = self.budget.admit(msg.session, cap_from_wire(msg.cap), evict=False)
            answer = wire.CommAnswer(self.session, msg.offer, cap_to_wire(decision.cap))
        except NoRoom as e:
            answer = wire.CommAnswer(self.session, msg.offer, -1, f"decode communicator budget full: {e}")
            others = [p for p in self.budget.idle_peers() if p != msg.session]
            if others:
                self.send(others[0], wire.CommRelease(self.session), True)
        self.send(msg.session, answer, True)

    def joined(self, msg: wire.CommInit) -> None:
        """The prefill opened a channel: its receiver joins it once the chunks queued before are handled."""
        self._receiver(msg.session).submit(msg)

    def chunk(self, msg: wire.ChunkHeader) -> None:
        """Queue an announced chunk on its prefill's receiver (its bytes follow on the pair channel)."""
        self.budget.touch(msg.session)
        self._receiver(msg.session).submit(msg)

    def closed_by_peer(self, msg: wire.CommClosed) -> None:
        """The prefill released a channel (its pool's eviction): dropped behind the chunks it sent on it."""
        receiver = self.receivers.get(msg.session)
        if receiver is not None:
            receiver.closed_by_peer(msg.generation)

    def after_queued(self, sessions: Iterable[str], done: Callable[[], None]) -> bool:
        """Call `done` once the receivers of `sessions` handled every chunk queued so far; False (and `done` is
        not called) when none of them has a receiver."""
        receivers = [self.receivers[s] for s in sessions if s in self.receivers]
        if not receivers:
            return False
        left, lock = [len(receivers)], threading.Lock()

        def drained() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done()

        for receiver in receivers:
            receiver.submit(drained)
        return True

    def peer_dead(self, session: str, reason: str) -> None:
        """The prefill is dead: abort its receiver's channel (a receive in flight fails now), release its budget."""
        receiver = self.receivers.pop(session, None)
        if receiver is not None:
            receiver.abort(reason)
        self.budget.closed(session)

    def close(self) -> None:
        for receiver in list(self.receivers.values()):
            receiver.close()

    def _receiver(self, session: str) -> PairReceiver:
        receiver = self.receivers.get(session)
        if receiver is None:
            receiver = self.receivers[session] = PairReceiver(
                transport=self.transport,
                staging=self.staging,
                copier=self.copier,
                peer_session=session,
                wanted=self.wanted,
                on_chunk=self.on_chunk,
                connect_timeout=self.config.connect_timeout,
                io_timeout=self.config.io_timeout,
                on_channel=lambda init, s=session: self._channel_changed(s, init),
                on_refused=lambda h, reason, s=session: self.send(
                    s, wire.ChunkRefused(self.session, h.generation, h.room, reason), False),
                check=self.check,
                overlap=self.config.overlap,
                device_scatter=self.config.device_scatter and self.on_queued is not None,
                on_queued=self.on_queued or (lambda room: True),
                on_ended=self.on_ended,
            )
        return receiver

    def _channel_changed(self, session: str, init: Optional[wire.CommInit]) -> None:
        """The receiver of `session` joined a channel (`init`) or dropped one (None): keep the budget true."""
        if init is None:
            self.budget.closed(session)
        else:
            self.budget.opened(session, cap_from_wire(init.cap) if init.cap >= 0 else -1)
