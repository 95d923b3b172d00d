"""Pair-selection policies (policy.py) and the load bookkeeping they read (workers.py): pure, no I/O."""

import random
import time

from sglang_p2p_lb.policy import LoadAwarePolicy, PairContext, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from sglang_p2p_lb.policy_registry import make_policy
from sglang_p2p_lb.workers import Lease, Worker, WorkerPool

CTX = PairContext()


def P(i, node=None, dp=1):
    return Worker(f"http://10.0.0.{i}:30000", "prefill", 8998, node=node or f"n{i}", dp_size=dp)


def D(i, node=None, dp=1):
    return Worker(f"http://10.0.1.{i}:30000", "decode", node=node or f"d{i}", dp_size=dp)


def test_load_aware_picks_least_outstanding_prefill_tokens():
    ps, ds = [P(1), P(2), P(3)], [D(1)]
    Lease(ps[0], ds[0], 0, 0, 5000, 1)
    Lease(ps[1], ds[0], 0, 0, 300, 1)
    Lease(ps[2], ds[0], 0, 0, 2000, 1)
    c = LoadAwarePolicy(rng=random.Random(0)).choose(ps, ds, CTX)
    assert c.prefill is ps[1]


def test_lease_counts_at_dispatch_and_releases_each_side_once():
    p, d = P(1), D(1)
    lease = Lease(p, d, 0, 0, 700, 2)
    assert p.prefill_load(0) == 700 and d.decode_load(0) == 2
    lease.release_prefill()
    lease.release_prefill()
    assert p.prefill_load(0) == 0 and d.decode_load(0) == 2
    lease.release()
    assert d.decode_load(0) == 0 and p.inflight_reqs == [0]


def test_polled_load_counts_only_foreign_work_and_expires():
    p = P(1)
    Lease(p, D(1), 0, 0, 1000, 1)
    # the server reports 1500 queued tokens while we have 1000 in flight: 500 are someone else's
    p.record_poll([1500.0], [2.0], 0.0)
    assert p.prefill_load(0) == 1500
    # we dispatch 200 more after the poll: counted locally at once (the since-poll credit)
    Lease(p, D(1), 0, 0, 200, 1)
    assert p.prefill_load(0) == 1700
    # a stale poll is ignored
    assert p.prefill_load(0, max_age=10.0, now=time.monotonic() + 11) == 1200
    # a poll with another DP size than the server reported is not used
    p.record_poll([1.0, 2.0], [0.0, 0.0], 0.0)
    assert p.polled.tokens == [1500.0]


def test_pair_affinity_wins_only_when_loads_are_close():
    pol = LoadAwarePolicy(rng=random.Random(0))
    pa, pb = P(1, node="hostA"), P(2, node="hostB")
    d = D(1, node="hostB")
    # equal loads: the prefill on the decode's node is preferred
    assert pol.choose([pa, pb], [d], CTX).prefill is pb
    # hostB's prefill is busy by far more than the tolerance: load wins over affinity
    Lease(pb, D(9), 0, 0, 4000, 1)
    assert pol.choose([pa, pb], [d], CTX).prefill is pa
    # within the tolerance (<= 256 tokens or 10%) affinity still wins
    Lease(pa, D(9), 0, 0, 3900, 1)
    assert pol.choose([pa, pb], [d], CTX).prefill is pb


def test_pair_with_live_channel_preferred_among_equals():
    pol = LoadAwarePolicy(rng=random.Random(1))
    ps, ds = [P(1), P(2)], [D(1), D(2)]
    ctx = PairContext(live_channels=frozenset({(ps[1].url, ds[0].url)}))
    for _ in range(5):
        c = pol.choose(ps, ds, ctx)
        assert (c.prefill, c.decode) == (ps[1], ds[0])


def test_decode_choice_by_running_requests_and_kv_usage():
    pol = LoadAwarePolicy(rng=random.Random(0))
    p = P(1)
    d1, d2 = D(1), D(2)
    for _ in range(6):
        Lease(P(7), d1, 0, 0, 10, 1)
    assert pol.choose([p], [d1, d2], CTX).decode is d2
    # d2 idle by count but its KV is 95% full (polled): d1 is cheaper
    d2.record_poll([0.0], [0.0], 0.95)
    assert pol.choose([p], [d1, d2], CTX).decode is d1


def test_v1_loads_gives_the_decode_kv_demand_with_queued_requests_and_legacy_does_not():
    from sglang_p2p_lb.loads import parse_legacy_load, parse_v1_loads

    doc = {"loads": [{"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 2, "token_usage": 0.9,
                      "num_total_tokens": 150_000, "max_total_num_tokens": 100_000},
                     {"dp_rank": 0, "num_running_reqs": 1, "token_usage": 0.5,
                      "num_total_tokens": 50_000, "max_total_num_tokens": 100_000}]}
    tokens, reqs, usage, kv = parse_v1_loads(doc)
    assert reqs == [1.0, 5.0] and usage == 0.7 and kv == (200_000.0, 200_000.0)
    del doc["loads"][0]["num_total_tokens"]  # a server that does not say: no demand, usage only
    assert parse_v1_loads(doc)[3] is None
    assert parse_legacy_load([{"num_reqs": 2, "num_tokens": 10}])[3] is None


def test_decode_kv_demand_follows_what_was_dispatched_since_the_poll():
    d = D(1)
    d.record_poll([0.0], [0.0], 0.2, (20_000.0, 100_000.0))
    assert d.kv_usage() == 0.2
    leases = [Lease(P(7), d, 0, 0, 10_000, 1) for _ in range(5)]
    assert abs(d.kv_usage() - 0.7) < 1e-9  # 50k tokens asked for since the poll
    for lease in leases[:3]:
        lease.release()
    assert abs(d.kv_usage() - 0.4) < 1e-9
    # polled over-full (requests waiting for pages): above 1, and the pressure keeps growing past the knee
    d.record_poll([0.0], [0.0], 0.85, (138_000.0, 100_000.0))
    from sglang_p2p_lb.policy import kv_pressure

    assert d.kv_usage() > 1.3 and kv_pressure(1.38) > kv_pressure(1.0) > kv_pressure(0.95) > 18.99


def test_a_burst_between_polls_does_not_overfill_the_decode_that_looked_emptiest():
    # two decodes of 100k tokens polled at 20% and 50%; twelve 10k-token requests before the next poll. Counted
    # by requests alone the emptier one took 9 of them (110k asked of its 100k pool, 20 requests waiting for
    # pages in the 4 x H200 run); with the demand moved by each dispatch they end within one request's KV
    pol = LoadAwarePolicy(rng=random.Random(0))
    p, d1, d2 = P(1), D(1), D(2)
    d1.record_poll([0.0], [0.0], 0.2, (20_000.0, 100_000.0))
    d2.record_poll([0.0], [0.0], 0.5, (50_000.0, 100_000.0))
    for _ in range(12):
        c = pol.choose([p], [d1, d2], PairContext(tokens=10_000))
        Lease(c.prefill, c.decode, 0, 0, 10_000, 1)
    demand = [w.kv_usage() * 100_000 for w in (d1, d2)]
    assert max(demand) <= 100_000 and abs(demand[0] - demand[1]) <= 10_000, demand


def test_dp_rank_is_least_loaded_rank():
    p, d = P(1, dp=4), D(1, dp=2)
    for r in (0, 1, 3):
        Lease(p, D(8), r, 0, 1000, 1)
    Lease(P(8), d, 0, 0, 10, 3)
    c = LoadAwarePolicy().choose([p], [d], CTX)
    assert (c.prefill_rank, c.decode_rank) == (2, 1)


def test_latency_breaks_ties_between_equal_loads():
    pol = LoadAwarePolicy(rng=random.Random(0))
    ps = [P(1, node="x"), P(2, node="x")]
    ps[0].observe_latency(0.5)
    ps[1].observe_latency(0.1)
    assert pol.choose(ps, [D(1, node="y")], CTX).prefill is ps[1]


def test_load_aware_spreads_a_burst():
    # counting at dispatch means a burst does not herd onto one prefill between polls
    ps, ds = [P(i) for i in range(3)], [D(1)]
    pol = LoadAwarePolicy(rng=random.Random(0))
    for _ in range(30):
        c = pol.choose(ps, ds, CTX)
        Lease(c.prefill, c.decode, 0, 0, 1000, 1)
    assert [w.inflight_tokens[0] for w in ps] == [10000, 10000, 10000]


def test_simple_policies():
    ps, ds = [P(1), P(2), P(3)], [D(1), D(2)]
    rr = RoundRobinPolicy()
    picks = [rr.choose(ps, ds, CTX) for _ in range(6)]
    assert [c.prefill for c in picks] == ps * 2 and [c.decode for c in picks] == ds * 3
    rnd = RandomPolicy(random.Random(3))
    assert {rnd.choose(ps, ds, CTX).prefill.url for _ in range(60)} == {w.url for w in ps}
    Lease(ps[0], ds[0], 0, 0, 9000, 1)
    p2 = PowerOfTwoPolicy(random.Random(0))
    # with two candidates the loaded one never wins
    assert all(p2.choose(ps[:2], ds, CTX).prefill is ps[1] for _ in range(10))
    assert make_policy("random").name == "random"


def test_pool_add_remove_and_channels():
    pool = WorkerPool()
    p, d = pool.add(P(1)), pool.add(D(1))
    try:
        pool.add(P(1))
        raise AssertionError("duplicate accepted")
    except KeyError:
        pass
    pool.note_channel(p, d)
    assert pool.live_channels(60) == {(p.url, d.url)}
    assert pool.remove(p.url) == [p]
    assert pool.live_channels(60) == set() and pool.routable("prefill") == []
