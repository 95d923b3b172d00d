"""Pacing the waits for a pair's transfers, on CPU: `LinkPace` (the rate a link showed, when its queue ends),
`Deadline`'s first sleep until the expected end, and the receiver's first pause. The NCCL transport's use of
them (timing events, `expected_end` on each completion) runs in tests/gpu/test_nccl_transport.py."""

from __future__ import annotations

import collections
import itertools

import pytest

pytest.importorskip("torch")

from sglang_p2p_backend.engine import waiting  # noqa: E402
from sglang_p2p_backend.engine.pair import pipeline  # noqa: E402
from sglang_p2p_backend.engine.transport.link_pace import LinkPace  # noqa: E402


def test_the_fastest_recent_rate_sets_when_the_queue_ends():
    pace = LinkPace(window=3)
    assert pace.rate() is None and pace.expect(0.0, 10**8) is None  # nothing taught yet: no estimate
    pace.observe(4096, 1e-6)  # small: launch latency, not bandwidth
    pace.observe(10**9, 20.0)  # 50 MB/s: a connect or a late peer, not a link
    assert pace.rate() is None
    pace.observe(10**8, 0.5)  # 200 MB/s (a wait for the peer in it)
    pace.observe(10**8, 0.1)  # 1 GB/s: the link
    assert pace.rate() is None  # two operations: not trusted yet (one of them may have waited for its peer)
    pace.observe(10**8, 0.4)
    assert pace.rate() == pytest.approx(1e9)
    # two operations queued at t=10: the second ends after the first
    assert pace.expect(10.0, 10**8) == pytest.approx(10.1)
    assert pace.expect(10.0, 2 * 10**8) == pytest.approx(10.3)
    assert pace.expect(20.0, 10**8) == pytest.approx(20.1)  # the queue drained meanwhile
    for _ in range(3):  # the 1 GB/s operation leaves the window
        pace.observe(10**8, 0.2)
    assert pace.rate() == pytest.approx(5e8)



class _Clock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(round(s, 9))
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(waiting.time, "monotonic", c.monotonic)
    monkeypatch.setattr(waiting.time, "sleep", c.sleep)
    return c


def test_a_wait_sleeps_until_the_expected_end_then_polls_finely(clock):
    """One sleep until the expected end, then a poll every 20 us for FINE_AFTER_S (1 ms: the work is due), then
    the doubling of any other wait."""
    d = waiting.Deadline(5.0, expected_end=100.004)
    while clock.now < 100.005 - 1e-9:
        d.pause()
    for _ in range(3):
        d.pause()
    fine = clock.sleeps[1:-3]
    assert clock.sleeps[0] == 0.004 and set(fine) == {20e-6}
    assert len(fine) * 20e-6 == pytest.approx(waiting.Deadline.FINE_AFTER_S, abs=25e-6)
    assert clock.sleeps[-3:] == [20e-6, 40e-6, 80e-6]


def test_an_expected_end_past_or_beyond_the_deadline(clock):
    d = waiting.Deadline(5.0, expected_end=99.0)  # already past: overdue, fine polls for FINE_AFTER_S, then doubling
    while clock.now < 100.0 + waiting.Deadline.FINE_AFTER_S:
        d.pause()
    d.pause()
    d.pause()
    assert set(clock.sleeps[:-2]) == {20e-6} and clock.sleeps[-2:] == [20e-6, 40e-6]
    clock.sleeps.clear()
    d = waiting.Deadline(0.002, expected_end=clock.now + 60.0)  # never sleeps past the deadline
    d.pause()
    assert clock.sleeps == [pytest.approx(0.002)] and d.left() <= 0
    clock.sleeps.clear()
    d = waiting.Deadline(5.0, expected_end=clock.now + 60.0)  # nor longer than PACED_MAX_S on an estimate
    d.pause()
    d.pause()
    assert clock.sleeps == [pytest.approx(waiting.Deadline.PACED_MAX_S), 20e-6]
    clock.sleeps.clear()
    d = waiting.Deadline(1.0)  # no estimate: as before
    for _ in range(7):
        d.pause()
    assert clock.sleeps == [20e-6, 40e-6, 80e-6, 160e-6, 320e-6, 500e-6, 500e-6]


class _Done:
    def __init__(self, expected_end):
        self.expected_end = expected_end


def test_a_receiver_polls_finely_after_its_paced_wait_then_backs_off(clock):
    """The receiver with a chunk posted: asleep until the chunk's expected end (a header would wake it), then a
    look every 20 us for FINE_AFTER_S, then the doubling up to 0.5 ms; once the chunk is seen done it lands and
    the receiver waits for its next item."""
    # the clock moves only when a wait says so: the schedule of looks is tested, not the machine's scheduling (a
    # 20 us sleep took milliseconds on the 2-core CI machine under load, and one fine look fitted the window)
    timeouts: list = []
    expected = clock.monotonic() + 0.002

    class _Queue:
        def get(self, timeout=None):
            if timeout is None:
                return "next item"
            timeouts.append(timeout)
            clock.sleep(timeout)
            raise pipeline.queue.Empty

    class _Completion:
        expected_end = expected

        def done(self):  # late: 6 ms after its expected end
            return clock.monotonic() > expected + 0.006

    class _Rx:
        _queue = _Queue()
        _wait_schedule = pipeline.PairReceiver._wait_schedule

        def __init__(self):
            self._posted = collections.deque([pipeline._Posted(None, None, None, _Completion(), None,
                                                               clock.monotonic() + 60)])
            self._landed = collections.deque()
            self._taken_back = collections.deque()

        def _progress(self):  # the chunk lands (and is reported: no scatter) once its receive is done
            if self._posted[0].done.done():
                self._posted.clear()
                return True
            return False

    assert pipeline.PairReceiver._next_item(_Rx()) == "next item"
    assert timeouts[0] == pytest.approx(0.002, abs=1e-9)
    first, most = waiting.Deadline.FIRST_S, waiting.Deadline.MAX_S
    fine = list(itertools.takewhile(lambda t: t == first, timeouts[1:]))
    # a look every 20 us for the whole fine window once the chunk is due, not one
    assert len(fine) * first == pytest.approx(waiting.Deadline.FINE_AFTER_S, abs=2 * first)
    backoff = timeouts[1 + len(fine):]
    assert backoff[0] == 2 * first and backoff == sorted(backoff) and backoff[-1] == most


def test_a_receiver_first_waits_until_its_chunk_should_have_landed(clock):
    # the stand-in clock: on a loaded 2-core machine the real one moved 1.2 ms between `now` and the first
    # pause, and the 3 ms expected end looked 1.8 ms away
    now = clock.monotonic()

    def first_pause(done) -> float:
        return pipeline._landing_wait(pipeline._Posted(None, None, None, done, None, now + 60)).next_pause()

    assert first_pause(_Done(now + 0.003)) == pytest.approx(0.003, abs=5e-4)
    assert first_pause(_Done(now + 9.0)) == waiting.Deadline.PACED_MAX_S  # an estimate gone wrong
    assert first_pause(_Done(now - 1.0)) == waiting.Deadline.FIRST_S  # overdue: poll at once
    assert first_pause(_Done(None)) == waiting.Deadline.FIRST_S  # no estimate (tcp, a first chunk)
    assert first_pause(object()) == waiting.Deadline.FIRST_S  # a completion without one
