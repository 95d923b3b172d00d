"""Decode-side ordering: a prefill's final status waits for every announced chunk to land."""

from sglang_p2p_backend.engine.pair.arrivals import ArrivalTracker


def tracker():
    applied = []
    return ArrivalTracker(lambda room, rank, ok, reason: applied.append((room, rank, ok, reason))), applied


def test_success_waits_for_announced_chunks():
    t, applied = tracker()
    t.announce(7, 0, "p:1")
    t.announce(7, 0, "p:1")
    t.landed(7, 0, None)
    t.final(7, 0, True, "")
    assert applied == []
    t.landed(7, 0, None)
    assert applied == [(7, 0, True, "")] and t.pending() == 0


def test_status_without_chunks_applies_at_once():
    t, applied = tracker()
    t.final(8, 1, True, "")
    assert applied == [(8, 1, True, "")]


def test_a_failed_chunk_fails_the_room_once_and_swallows_the_late_success():
    t, applied = tracker()
    for _ in range(3):
        t.announce(9, 0, "p:1")
    t.landed(9, 0, "pair channel broke")
    t.final(9, 0, True, "")
    t.landed(9, 0, None)
    t.landed(9, 0, None)
    assert applied == [(9, 0, False, "pair channel broke")] and t.pending() == 0


def test_failure_status_applies_before_chunks_land():
    t, applied = tracker()
    t.announce(10, 0, "p:1")
    t.final(10, 0, False, "aborted on prefill")
    assert applied == [(10, 0, False, "aborted on prefill")]
    t.landed(10, 0, None)
    assert t.pending() == 0 and len(applied) == 1


def test_peer_lost_fails_only_its_rooms_with_chunks_in_flight():
    t, applied = tracker()
    t.announce(11, 0, "p:1")
    t.announce(12, 0, "p:2")
    t.peer_lost("p:1", "prefill p:1 died")
    assert applied == [(11, 0, False, "prefill p:1 died")]


def test_ranks_are_tracked_separately():
    t, applied = tracker()
    t.announce(13, 0, "p:1")
    t.final(13, 1, True, "")
    assert applied == [(13, 1, True, "")]
