"""The NCCL communicator pool policy: caps follow the peer count, LRU eviction, budget never exceeded."""

from __future__ import annotations

import json
import random

import pytest

from sglang_p2p_backend.engine.pair.comm_pool import ANCHOR_COST, Admission, CommCost, CommPool


def open_peer(pool: CommPool, peer, max_cap=None):
    d = pool.admit(peer, max_cap)
    if d.action is Admission.OPEN:
        pool.opened(peer)
    return d


def test_few_peers_get_full_speed_many_get_lean():
    pool = CommPool(2048)
    assert [open_peer(pool, p).cap for p in range(2)] == [16, 16]
    assert pool.fair_cap(15) == 16  # 15 x 134 MB fits 2 GB
    assert pool.fair_cap(16) == 8
    assert pool.fair_cap(40) == 4
    assert pool.fair_cap(500) == 4  # the leanest, even when that no longer fits
    assert ANCHOR_COST.mb_of(4) <= 40  # the target for a lean communicator


def test_reuse_touches_lru_and_keeps_cap():
    pool = CommPool(300)
    for p in "ab":
        open_peer(pool, p)
    d = pool.admit("a")
    assert d.action is Admission.REUSE and d.cap == pool.cap_of("a")
    assert list(pool.live()) == ["b", "a"]


def test_fat_idle_communicators_are_closed_when_peers_grow():
    pool = CommPool(300)  # two at cap 16 (268 MB) fit; three want cap 8, and 32 MB are free
    open_peer(pool, "a")
    open_peer(pool, "b")
    assert pool.live() == {"a": 16, "b": 16}
    d = pool.admit("c")
    assert d.action is Admission.OPEN and d.cap == 8 and d.victims == ("a",)
    pool.opened("c")
    assert pool.used_mb <= 300


def test_busy_communicators_are_never_evicted_and_lean_cap_is_used():
    pool = CommPool(300)
    for p in "ab":
        open_peer(pool, p)
        pool.acquire(p)
    d = pool.admit("c")  # 2 x 134 used, 32 MB free: neither 16 nor 8 fit, no idle victim: the leanest
    assert d.action is Admission.NO_FIT
    assert "use RDMA or wait" in d.reason
    pool.release("a")
    d = pool.admit("c")
    assert d.action is Admission.OPEN and d.victims == ("a",)
    assert "a" not in pool.live() and pool.used_mb <= 300


def test_leaner_cap_before_eviction():
    pool = CommPool(250)
    assert open_peer(pool, "a").cap == 16
    assert open_peer(pool, "b").cap == 8  # two at 16 would not fit
    pool.acquire("a")
    pool.acquire("b")
    d = pool.admit("c")  # fair cap 8 for 3 peers, 46 MB free, nothing idle: cap 4 fits without eviction
    assert d.action is Admission.OPEN and d.cap == 4 and d.victims == ()


def test_failed_open_frees_the_reservation():
    pool = CommPool(200)
    d = pool.admit("a")
    assert d.action is Admission.OPEN and pool.used_mb > 0
    pool.failed("a")
    assert pool.used_mb == 0 and pool.live() == {}


def test_opening_reservation_is_not_evicted():
    pool = CommPool(140)
    assert pool.admit("a").action is Admission.OPEN  # not yet opened
    assert pool.admit("b").action is Admission.NO_FIT or "a" in pool.live()
    assert "a" in pool.live()


def test_max_cap_from_the_other_rank_and_settled_cap():
    pool = CommPool(4096)
    d = pool.admit("p", max_cap=4)
    assert d.cap == 4
    pool.opened("p")
    d = pool.admit("q")
    pool.opened("q", cap=8)  # the other rank could only afford 8
    assert pool.cap_of("q") == 8 and pool.used_mb == ANCHOR_COST.mb_of(4) + ANCHOR_COST.mb_of(8)


def test_max_comms_limits_live_communicators():
    pool = CommPool(10_000, max_comms=2)
    open_peer(pool, "a")
    open_peer(pool, "b")
    d = pool.admit("c")
    assert d.action is Admission.OPEN and d.victims == ("a",)


def test_measured_tables_decode_pays_more_and_lean_decode_needs_cap_2():
    from sglang_p2p_backend.engine.pair.comm_pool import H200_COST, H200_COST_NO_CUMEM

    for table in (H200_COST, H200_COST_NO_CUMEM):
        for cap in (2, 4, 8, 16, None):
            assert table["decode"].mb_of(cap) > table["prefill"].mb_of(cap)
    assert H200_COST["prefill"].mb_of(4) <= 40 and H200_COST["decode"].mb_of(2) <= 40
    pool = CommPool(2048, ladder=(16, 8, 4, 2), cost=H200_COST["decode"])
    assert pool.fair_cap(96) == 2  # a decode GPU of 96P144D runs 96 lean communicators in 2 GB


def test_cost_interpolates_and_loads_bench_json(tmp_path):
    assert ANCHOR_COST.mb_of(6) == pytest.approx((38 + 70) / 2)
    path = tmp_path / "r.json"
    rows = [{"cap": 4, "mb": 70, "mb_prefill": 36, "mb_decode": 70, "gbps": 130},
            {"cap": None, "mb": 540, "mb_prefill": 250, "mb_decode": 540, "gbps": 360}]
    path.write_text(json.dumps({"comm_cost": rows}))
    cost = CommCost.from_bench(str(path))
    assert cost.mb_of(4) == 70 and cost.mb_of(None) == 540 and cost.gbps[4] == 130
    assert CommCost.from_bench(str(path), side="prefill").mb_of(4) == 36


@pytest.mark.parametrize(
    "side, peers, budget_mb",
    [("prefill GPU of 96P144D", 144, 2048), ("decode GPU of 96P144D", 96, 2048), ("prefill, small budget", 144, 512)],
)
def test_96p144d_peer_set_stays_within_budget(side, peers, budget_mb):
    """One GPU of a 96P x 144D deployment: every request picks a peer (some hot), up to 8 transfers in
    flight. The pool never exceeds its budget, never fails a request for memory (NO_FIT only while every
    communicator is busy or opening), and runs lean (<= 40 MB) communicators once the peer set is large."""
    rng = random.Random(1234)
    pool = CommPool(budget_mb)
    hot = list(range(8))
    in_flight: list = []
    no_fit = opened = evicted = 0
    for step in range(20_000):
        if in_flight and (len(in_flight) >= 8 or rng.random() < 0.5):
            pool.release(in_flight.pop(rng.randrange(len(in_flight))))
        peer = rng.choice(hot) if rng.random() < 0.5 else rng.randrange(peers)
        d = pool.admit(peer)
        if d.action is Admission.NO_FIT:
            idle = [p for p in pool.live() if p not in in_flight]
            assert not idle, f"{side}: refused with idle communicators {idle[:5]}"
            no_fit += 1
            continue
        if d.action is Admission.OPEN:
            for v in d.victims:
                assert v not in in_flight
            evicted += len(d.victims)
            opened += 1
            pool.opened(peer)
        pool.acquire(peer)
        in_flight.append(peer)
        assert pool.used_mb <= budget_mb + 1e-9, (side, step, pool.used_mb)
    live_caps = list(pool.live().values())
    assert len(live_caps) * ANCHOR_COST.mb_of(4) <= budget_mb
    assert max(ANCHOR_COST.mb_of(c) for c in live_caps) <= 40 or len(live_caps) * 134 <= budget_mb
    assert no_fit < 100, f"{side}: {no_fit} refusals"
    assert opened > peers // 2 and evicted > 0


def test_decode_side_admission_never_evicts():
    pool = CommPool(300)
    open_peer(pool, "a")
    open_peer(pool, "b")
    d = pool.admit("c", evict=False)  # the evicting pool would close "a" (see above); the decode may not
    assert d.action is Admission.NO_FIT and d.victims == ()
    assert set(pool.live()) == {"a", "b"}


def test_would_admit_commits_nothing():
    pool = CommPool(300)
    open_peer(pool, "a")
    open_peer(pool, "b")
    before = (pool.live(), pool.used_mb)
    d = pool.would_admit("c")
    assert d.action is Admission.OPEN and d.victims == ("a",)
    assert (pool.live(), pool.used_mb) == before
    assert pool.idle("a") and not pool.idle("c")


def test_a_channel_the_pool_did_not_admit_is_still_counted():
    pool = CommPool(1000)
    pool.opened("x", 4)
    assert pool.live() == {"x": 4} and pool.used_mb == ANCHOR_COST.mb_of(4)
