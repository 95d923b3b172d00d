"""What the Mooncake transport keeps per peer session (engine/transport/mooncake.py) stays bounded: sessions are
named by the peers and a restarted decode comes back under a new one, so per-session locks and failure marks
must not grow by one per restart. Runs without Mooncake: a stand-in engine takes the transport's calls."""

import threading
import time

import pytest

from sglang_p2p_backend.engine.transport import mooncake
from sglang_p2p_backend.engine.transport.base import TransportError


class Engine:
    """Stands for Mooncake's TransferEngine: writes to `dead` sessions fail; records how many writes to one
    session overlap (the transport serialises them)."""

    dead: set = set()

    def __init__(self):
        self.calls, self.active, self.overlap = [], {}, 0
        self._lock = threading.Lock()

    def initialize(self, host, metadata, protocol, devices):
        return 0

    def get_rpc_port(self):
        return 17000

    def batch_transfer_sync_write(self, session, src, dst, lengths):
        with self._lock:
            self.calls.append(session)
            self.active[session] = self.active.get(session, 0) + 1
            self.overlap = max(self.overlap, self.active[session])
        time.sleep(0.002)
        with self._lock:
            self.active[session] -= 1
        return -1 if session in self.dead else 0


@pytest.fixture
def transport(monkeypatch):
    monkeypatch.setattr(mooncake, "_import_engine_class", lambda: Engine)
    monkeypatch.setattr(Engine, "dead", set())
    t = mooncake.MooncakeTransport("tcp", "127.0.0.1")
    yield t
    t.close()


def write(t, session):
    t.write(session, [4096], [8192], [64])


def test_a_forgotten_peer_leaves_no_failure_mark(transport):
    Engine.dead.add("10.0.0.2:17001")
    with pytest.raises(TransportError, match="10.0.0.2:17001 failed"):
        write(transport, "10.0.0.2:17001")
    assert list(transport.failed_sessions()) == ["10.0.0.2:17001"]
    transport.forget_peer("10.0.0.2:17001")  # its decode died: the mark goes with it
    assert transport.failed_sessions() == {}
    with pytest.raises(TransportError, match="batch write returned -1"):  # tried again, not skipped
        write(transport, "10.0.0.2:17001")
    assert transport._engine.calls == ["10.0.0.2:17001"] * 2


def test_failure_marks_stay_bounded_across_decode_restarts(transport):
    # each restart of a decode is a new Mooncake session whose writes fail once its process is gone
    restarts = mooncake.MAX_FAILED_SESSIONS + 50
    Engine.dead.update(f"10.0.0.2:{20000 + i}" for i in range(restarts))
    for i in range(restarts):
        with pytest.raises(TransportError):
            write(transport, f"10.0.0.2:{20000 + i}")
    failed = transport.failed_sessions()
    assert len(failed) == mooncake.MAX_FAILED_SESSIONS
    assert f"10.0.0.2:{20000 + restarts - 1}" in failed and "10.0.0.2:20000" not in failed  # the oldest go first


def test_peer_locks_live_only_while_writes_run_and_still_serialise_a_peer(transport):
    sessions = [f"10.0.0.{i}:17001" for i in range(2, 6)]
    barrier = threading.Barrier(8)

    def writer(session):
        barrier.wait()
        for _ in range(10):
            write(transport, session)

    threads = [threading.Thread(target=writer, args=(s,)) for s in sessions * 2]  # two writers a peer
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert transport._engine.overlap == 1  # never two writes to one peer at once
    assert len(transport._engine.calls) == 80
    assert transport._peer_locks == {}  # nothing left behind for peers nobody writes to
    for i in range(100):  # a stream of sessions written once each
        write(transport, f"10.0.1.{i}:17001")
    assert transport._peer_locks == {}


def test_a_marked_session_is_skipped_for_retry_after_then_tried_and_cleared_when_it_answers(monkeypatch):
    """A live decode whose write failed once (a link flap, its memory registered anew after a release/resume) is
    not lost for good: its writes are skipped for `retry_after_s`, then tried; one that fails again doubles the
    skip (up to MAX_RETRY_FACTOR times), one that lands clears the mark."""
    monkeypatch.setattr(mooncake, "_import_engine_class", lambda: Engine)
    monkeypatch.setattr(Engine, "dead", {"10.0.0.2:17001"})
    clock = [100.0]
    monkeypatch.setattr(mooncake, "_now", lambda: clock[0])
    t = mooncake.MooncakeTransport("tcp", "127.0.0.1", retry_after_s=8.0)
    try:
        with pytest.raises(TransportError, match="batch write returned -1"):
            write(t, "10.0.0.2:17001")
        clock[0] += 7.5
        with pytest.raises(TransportError, match=r"failed 7\.5s ago \(batch write returned -1.*for 0\.5s more"):
            write(t, "10.0.0.2:17001")
        assert t._engine.calls == ["10.0.0.2:17001"]  # skipped: the network untouched
        skips = []
        for _ in range(5):  # tried after each skip, failing again: 16, 32, 64, 64, 64 s
            clock[0] += 100.0
            with pytest.raises(TransportError, match="batch write returned -1"):
                write(t, "10.0.0.2:17001")
            skips.append(t._failed["10.0.0.2:17001"][2])  # noqa: SLF001
        assert skips == [16.0, 32.0, 64.0, 64.0, 64.0]
        clock[0] += 63.9
        with pytest.raises(TransportError, match="skipped"):
            write(t, "10.0.0.2:17001")
        assert t._engine.calls == ["10.0.0.2:17001"] * 6
        Engine.dead.clear()  # the fault is gone
        clock[0] += 0.2
        write(t, "10.0.0.2:17001")  # tried, lands, and the mark goes with it
        assert t.failed_sessions() == {}
        write(t, "10.0.0.2:17001")
        Engine.dead.add("10.0.0.2:17001")  # failing again later starts from retry_after_s
        with pytest.raises(TransportError, match="batch write returned -1"):
            write(t, "10.0.0.2:17001")
        assert t._failed["10.0.0.2:17001"][2] == 8.0  # noqa: SLF001
    finally:
        t.close()
