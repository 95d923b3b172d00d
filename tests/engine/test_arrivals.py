"""Decode-side ordering: a prefill's final status waits for every announced chunk to land, and for as many
chunks as its Success names to be announced."""

from sglang_p2p_backend.engine.pair.arrivals import ArrivalTracker


def tracker():
    applied = []
    return ArrivalTracker(lambda room, rank, ok, reason: applied.append((room, rank, ok, reason))), applied


def test_success_waits_for_announced_chunks():
    t, applied = tracker()
    t.announce(7, 0, "p:1")
    t.announce(7, 0, "p:1")
    t.landed(7, 0, None)
    t.final(7, 0, True, "", chunks=2)
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
    t.final(9, 0, True, "", chunks=3)
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


def test_a_success_that_overtook_its_last_headers_waits_for_them():
    """The Status came on a new socket while the evicted one still held the room's last header (and, for the
    second room, every header): Success only once they were announced and landed."""
    t, applied = tracker()
    t.announce(20, 0, "p:1")
    t.landed(20, 0, None)
    t.final(20, 0, True, "", chunks=2, peer="p:1")
    assert applied == [] and t.pending() == 1
    t.announce(20, 0, "p:1")
    assert applied == []
    t.landed(20, 0, None)
    assert applied == [(20, 0, True, "")] and t.pending() == 0
    t.final(21, 0, True, "", chunks=1, peer="p:1")
    assert applied == [(20, 0, True, "")] and t.pending() == 1
    t.announce(21, 0, "p:1")
    t.landed(21, 0, None)
    assert applied[-1] == (21, 0, True, "") and t.pending() == 0


def test_a_success_naming_fewer_chunks_than_arrived_fails_the_room():
    t, applied = tracker()
    for _ in range(3):
        t.announce(22, 0, "p:1")
    t.final(22, 0, True, "", chunks=2)
    assert [a[2] for a in applied] == [False] and "after 2 chunk(s), but 3 were announced" in applied[0][3]
    for _ in range(3):
        t.landed(22, 0, None)
    assert len(applied) == 1 and t.pending() == 0
    # one more header behind a Success still waiting for another: failed, never counted
    t.announce(23, 0, "p:1")
    t.final(23, 0, True, "", chunks=2)
    t.landed(23, 0, None)
    t.announce(23, 0, "p:1")
    t.announce(23, 0, "p:1")
    assert applied[1][:3] == (23, 0, False) and "after 2 chunk(s), but 3 were announced" in applied[1][3]
    t.landed(23, 0, None)
    t.landed(23, 0, None)
    assert len(applied) == 2 and t.pending() == 0


def test_a_held_success_fails_with_its_peer_and_is_forgotten_with_its_room():
    t, applied = tracker()
    t.final(24, 0, True, "", chunks=1, peer="p:1")
    t.final(25, 0, True, "", chunks=1, peer="p:2")
    t.peer_lost("p:1", "prefill p:1 died")
    assert applied == [(24, 0, False, "prefill p:1 died")]
    t.forget(25)  # SGLang cleared the room (its own timeout): nothing of it is kept
    assert t.pending() == 0 and len(applied) == 1
