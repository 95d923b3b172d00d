"""smg's PD features in the LB: separate prefill/decode policies, DP-rank fields for DP-attention prefills,
admission control (bounded queue, bounded wait, 429/503) and the circuit breaker with half-open probes.
Pure logic on Worker objects and a fake clock; behaviour through real HTTP against simulated workers."""

from __future__ import annotations

import asyncio
import random

import orjson

from lb_harness import ADMIN, cluster, run, wait_until

from sglang_p2p_lb.cli import build_parser, config_from_args
from sglang_p2p_lb.circuit import BreakerConfig, CircuitBreaker
from sglang_p2p_lb.policy import LoadAwarePolicy, PairContext, RoundRobinPolicy, SplitPolicy
from sglang_p2p_lb.policy_registry import make_pd_policy
from sglang_p2p_lb.proxy import ProxyConfig
from sglang_p2p_lb.workers import Worker

GEN = {"text": "hello world " * 20, "sampling_params": {"max_new_tokens": 2}}


def _p(i: int, node: str = "") -> Worker:
    return Worker(f"http://10.0.0.{i}:30000", "prefill", 8998, node=node or f"n{i}")


def _d(i: int, node: str = "") -> Worker:
    return Worker(f"http://10.0.1.{i}:30000", "decode", node=node or f"d{i}")


# ----------------------------------------------------------------------------- separate policies
def test_split_policy_takes_each_side_from_its_own_policy():
    ps, ds = [_p(0), _p(1), _p(2)], [_d(0), _d(1)]
    ds[0].inflight_reqs = [9]  # far beyond load_aware's tolerance: the decode policy must avoid it
    ps[0].inflight_tokens = [50_000]  # round robin ignores load: it still gets its turn
    pol = SplitPolicy(RoundRobinPolicy(), LoadAwarePolicy(rng=random.Random(0)))
    picks = [pol.choose(ps, ds, PairContext()) for _ in range(6)]
    assert [c.prefill.url for c in picks] == [w.url for w in ps] * 2
    assert {c.decode.url for c in picks} == {ds[1].url}


def test_split_policy_decode_pair_preference_uses_the_chosen_prefill():
    ps, ds = [_p(0, "a"), _p(1, "b")], [_d(0, "a"), _d(1, "b")]
    pol = SplitPolicy(RoundRobinPolicy(), LoadAwarePolicy(rng=random.Random(0)))
    for _ in range(4):  # equal loads: the decode on the prefill's node wins
        c = pol.choose(ps, ds, PairContext())
        assert c.prefill.node == c.decode.node


def test_make_pd_policy_falls_back_to_policy():
    assert make_pd_policy("load_aware").name == "load_aware"
    assert make_pd_policy("load_aware", "load_aware", None).name == "load_aware"  # same on both sides: pair scoring kept
    assert make_pd_policy("load_aware", "cache_aware", None).name == "prefill=cache_aware,decode=load_aware"
    assert make_pd_policy("random", None, "power_of_two").name == "prefill=random,decode=power_of_two"


def test_cli_flags_for_pd_features():
    argv = ["--prefill", "http://127.0.0.1:1", "8998", "--decode", "http://127.0.0.1:2", "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
            "--max-concurrent-requests", "8", "--queue-size", "0", "--queue-timeout-secs", "5", "--cb-failure-threshold", "4", "--cb-success-threshold", "2",
            "--cb-timeout-duration-secs", "7", "--cb-window-duration-secs", "9", "--dp-aware"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.prefill_policy, cfg.decode_policy) == ("cache_aware", "power_of_two")
    assert (cfg.proxy.max_concurrent, cfg.proxy.queue_size, cfg.proxy.queue_timeout) == (8, 0, 5.0)
    assert cfg.breaker == BreakerConfig(failure_threshold=4, success_threshold=2, timeout=7.0, window=9.0, max_probes=1, enabled=True)
    assert config_from_args(build_parser().parse_args(argv[:5])).proxy.max_concurrent >= 4096  # -1: derived, as smg
    assert not config_from_args(build_parser().parse_args(argv[:5] + ["--disable-circuit-breaker"])).breaker.enabled
    for bad, msg in ((["--queue-size", "-1"], "--queue-size must be >= 0"), (["--queue-timeout-secs", "0"], "--queue-timeout-secs must be > 0"),
                     (["--cb-failure-threshold", "0"], "--cb-failure-threshold must be >= 1"), (["--cb-timeout-duration-secs", "nan"], "must be > 0")):
        try:
            config_from_args(build_parser().parse_args(argv[:5] + bad))
        except ValueError as e:
            assert msg in str(e)
        else:
            raise AssertionError(f"{bad} accepted")


def test_split_policies_over_http_and_dp_ranks_for_a_policy_without_ranks():
    """round_robin names no DP rank: the LB still tells both sides the rank (the room's), and the DP-attention
    prefill's ranks all get requests; the decode side is power_of_two's."""

    async def body():
        async with cluster(2, 1, prefill_sim=[{"dp_size": 4}, {"dp_size": 1}], prefill_policy="round_robin", decode_policy="power_of_two") as c:
            assert c.lb.policy.name == "prefill=round_robin,decode=power_of_two"
            # rooms are random: 40 requests leave a DP rank without one with probability 4 * (3/4)^40 ~ 4e-5
            for _ in range(80):
                assert (await c.post("/generate", GEN))[0] == 200
            assert [p.stats.requests for p in c.prefills] == [40, 40]
            bodies = c.prefills[0].stats.bodies
            assert all(b["routed_dp_rank"] == b["disagg_prefill_dp_rank"] == b["bootstrap_room"] % 4 for b in bodies)
            assert {b["routed_dp_rank"] for b in bodies} == {0, 1, 2, 3}
            assert all("routed_dp_rank" not in b and "disagg_prefill_dp_rank" not in b for b in c.prefills[1].stats.bodies)
            rooms = {b["bootstrap_room"]: b["disagg_prefill_dp_rank"] for b in bodies}
            dbs = [b for b in c.decodes[0].stats.bodies if b["bootstrap_room"] in rooms]
            # the decode keeps its first 64 bodies (sim keep_bodies): round_robin alternates, so 32 are prefill 0's
            assert len(dbs) == 32 and all(b["disagg_prefill_dp_rank"] == rooms[b["bootstrap_room"]] for b in dbs)
            assert c.prefills[0].stats.dp_mismatch == 0 and c.decodes[0].stats.bootstrap_failures == 0

    run(body)


# ----------------------------------------------------------------------------- admission control
ONE_SLOT_ONE_QUEUED = ProxyConfig(max_concurrent=1, queue_size=1, queue_timeout=20.0, request_timeout=20.0)


async def _fill_slot_and_queue(c) -> tuple[asyncio.Task, asyncio.Task]:
    """One request on the worker, a second one waiting in the LB's queue."""
    first = asyncio.create_task(c.post("/generate", GEN))
    assert await wait_until(lambda: c.prefills[0].stats.requests == 1)
    second = asyncio.create_task(c.post("/generate", GEN))
    assert await wait_until(lambda: c.lb.dispatcher.admission.queued == 1)
    assert c.prefills[0].stats.requests == 1  # the queued one has not reached a worker
    return first, second


def test_admission_queues_then_429_when_the_queue_is_full():
    async def body():
        async with cluster(1, 1, sim={"prefill_base_ms": 800}, proxy=ONE_SLOT_ONE_QUEUED) as c:
            first, second = await _fill_slot_and_queue(c)
            async with c.http.post(c.url + "/generate", json=GEN) as r:
                out = await r.json()
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                assert "--max-concurrent-requests 1" in out["error"]["message"] and "--queue-size" in out["error"]["message"]
            assert (await first)[0] == 200 and (await second)[0] == 200  # the queued one ran after the first
            assert c.prefills[0].stats.requests == 2
            assert c.lb.dispatcher.admission.inflight == 0 and c.lb.dispatcher.admission.queued == 0
            status, metrics = await c.get("/metrics")
            assert b'sglang_p2p_lb_rejected_total{reason="queue_full"} 1.0' in metrics

    run(body)


def test_admission_no_queue_and_queue_timeout():
    async def body():
        proxy = ProxyConfig(max_concurrent=1, queue_size=0, request_timeout=20.0)
        async with cluster(1, 1, sim={"prefill_base_ms": 500}, proxy=proxy) as c:
            first = asyncio.create_task(c.post("/generate", GEN))
            assert await wait_until(lambda: c.prefills[0].stats.requests == 1)
            status, _, out = await c.post("/generate", GEN)
            assert status == 429 and "no queue (--queue-size 0)" in out["error"]["message"]
            assert (await first)[0] == 200
        proxy = ProxyConfig(max_concurrent=1, queue_size=4, queue_timeout=0.3, request_timeout=20.0)
        async with cluster(1, 1, sim={"prefill_base_ms": 3000}, proxy=proxy) as c:
            first = asyncio.create_task(c.post("/generate", GEN))
            assert await wait_until(lambda: c.prefills[0].stats.requests == 1)
            status, _, out = await c.post("/generate", GEN)
            assert status == 503 and "--queue-timeout-secs 0.3" in out["error"]["message"]
            assert c.lb.dispatcher.admission.queued == 0 and c.prefills[0].stats.requests == 1
            first.cancel()

    run(body)


def test_admission_client_that_leaves_the_queue_frees_its_place():
    async def body():
        async with cluster(1, 1, sim={"prefill_base_ms": 800}, proxy=ONE_SLOT_ONE_QUEUED) as c:
            first, gone = await _fill_slot_and_queue(c)
            gone.cancel()  # the client disconnects while queued
            assert await wait_until(lambda: c.lb.dispatcher.admission.queued == 0)
            third = asyncio.create_task(c.post("/generate", GEN))  # takes the freed place instead of a 429
            assert await wait_until(lambda: c.lb.dispatcher.admission.queued == 1)
            assert (await first)[0] == 200 and (await third)[0] == 200
            assert c.prefills[0].stats.requests == 2
            assert await wait_until(lambda: c.lb.dispatcher.admission.inflight == 0)

    run(body)


# ----------------------------------------------------------------------------- circuit breaker
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_half_opens_probes_and_closes():
    clk = Clock()
    cb = CircuitBreaker(BreakerConfig(failure_threshold=3, success_threshold=2, timeout=10.0, window=5.0, max_probes=1), clk)
    cb.record_failure()
    cb.record_failure()
    clk.t += 6.0  # past the window: the count starts again
    cb.record_failure()
    cb.record_failure()
    assert cb.current() == "closed" and cb.allows()
    cb.record_success()  # a success in between resets the count
    for _ in range(3):
        cb.record_failure()
    assert cb.current() == "open" and not cb.allows()
    clk.t += 9.9
    assert not cb.allows()
    clk.t += 0.2
    assert cb.current() == "half_open" and cb.allows()
    t1 = cb.begin()
    assert t1 is not None and not cb.allows()  # one probe at a time
    cb.end(t1, True)
    assert cb.current() == "half_open" and cb.allows()
    cb.end(cb.begin(), True)
    assert cb.current() == "closed" and cb.begin() is None


def test_breaker_half_open_failure_reopens_and_stale_probe_is_ignored():
    clk = Clock()
    cb = CircuitBreaker(BreakerConfig(failure_threshold=1, success_threshold=1, timeout=10.0, max_probes=2), clk)
    cb.record_failure()
    clk.t += 10.0
    a, b = cb.begin(), cb.begin()
    assert not cb.allows()
    cb.end(a, False)  # a probe failed: open again for a full timeout
    assert cb.current() == "open" and cb.opened_at == clk.t
    cb.end(b, None)  # the other probe, from before the transition, changes nothing
    assert cb.probes == 0 and cb.current() == "open"
    cb.readmit()  # health checks saw the worker answer again: probe at once
    assert cb.current() == "half_open" and cb.allows()
    cb.end(cb.begin(), None)  # a probe that says nothing (a 4xx) frees its slot, closes nothing
    assert cb.current() == "half_open" and cb.probes == 0
    disabled = CircuitBreaker(BreakerConfig(failure_threshold=1, enabled=False), clk)
    disabled.record_failure()
    assert disabled.allows() and disabled.begin() is None


def test_breaker_over_http_open_then_half_open_probe_closes_it():
    async def body():
        from sglang_p2p_lb.circuit import BreakerConfig as B

        async with cluster(2, 1, policy="round_robin", proxy=ProxyConfig(max_retries=0, request_timeout=20.0),
                           breaker=B(failure_threshold=2, success_threshold=2, timeout=0.5, window=60.0)) as c:
            bad = c.prefills[0]
            bad.fail_next, bad.fail_status = 1000, 500
            codes = [(await c.post("/generate", GEN))[0] for _ in range(4)]
            assert codes == [500, 200, 500, 200]  # round robin: the bad prefill's 500 is passed on
            status, workers = await c.get("/workers", ADMIN)
            state = {w["url"]: w["circuit"]["state"] for w in workers["workers"]}
            assert state[bad.url] == "open" and state[c.prefills[1].url] == "closed"
            # open: every request goes to the other prefill, no error reaches a client
            codes = [(await c.post("/generate", GEN))[0] for _ in range(4)]
            assert codes == [200] * 4 and bad.stats.requests == 2
            # half-open after the timeout: one probe, which fails -> open again
            await asyncio.sleep(0.6)
            codes = [(await c.post("/generate", GEN))[0] for _ in range(2)]
            assert sorted(codes) == [200, 500] and bad.stats.requests == 3
            assert c.lb.pool.get("prefill", bad.url).breaker.current() == "open"
            # the worker recovers: after the timeout two successful probes close the circuit
            bad.fail_next = 0
            await asyncio.sleep(0.6)
            for _ in range(6):
                assert (await c.post("/generate", GEN))[0] == 200
            assert c.lb.pool.get("prefill", bad.url).breaker.current() == "closed" and bad.stats.requests >= 5

    run(body)


# ----------------------------------------------------------------------------- last resort
def test_only_decode_ejected_is_still_tried_unless_stalled():
    """3P1D: the one decode was ejected (it died, then restarted); until health checks re-admit it, the LB
    sends to it rather than refusing every request. A decode whose liveness probe times out is not tried."""

    async def body():
        async with cluster(2, 1) as c:
            d = c.lb.pool.get("decode", c.decodes[0].url)
            d.healthy = False
            assert (await c.post("/generate", GEN))[0] == 200
            assert c.decodes[0].stats.requests == 1
            assert 'sglang_p2p_lb_last_resort_total{role="decode"} 1.0' in c.lb.metrics.render().decode()
            d.consecutive_timeouts = 1  # stalled: it would hold the request until a timeout
            status, _, out = await c.post("/generate", GEN)
            assert status == 503 and "no healthy decode worker available" in out["error"]["message"]
            assert c.decodes[0].stats.requests == 1

    run(body)


def test_ejected_worker_is_probed_faster_and_back_soon():
    """Health checks every 30 s, but an ejected worker is probed every 50 ms: once it answers it is back
    after two good probes, long before the next regular round."""

    async def body():
        from sglang_p2p_lb.health import HealthConfig

        hc = HealthConfig(interval=30.0, recovery_interval=0.05, success_threshold=2)
        async with cluster(2, 1, health=hc) as c:
            w = c.lb.pool.get("prefill", c.prefills[0].url)
            other = c.lb.pool.get("prefill", c.prefills[1].url)
            w.healthy = False  # as a passive ejection after its process died and came back
            assert await wait_until(lambda: w.healthy, 5.0)
            assert other.consecutive_successes == 0  # the healthy one waits for the regular round

    run(body)


def test_decision_log_records_each_choice_with_what_every_candidate_showed(tmp_path):
    """--decision-log: one line per routed request, naming the pair it went to and each candidate's load as the
    policy saw it then (the evidence a GPU run's routing is explained from)."""
    path = tmp_path / "decisions.jsonl"

    async def body():
        async with cluster(n_prefill=2, n_decode=2, decision_log=str(path)) as c:
            for i in range(6):
                status, _, _ = await c.post("/generate", {"text": "x" * (400 * (i + 1)), "sampling_params": {"max_new_tokens": 2}})
                assert status == 200
            return [w.url for w in c.prefills], [w.url for w in c.decodes]

    prefills, decodes = run(body)
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert len(lines) == 6
    for n, line in enumerate(lines, start=1):
        assert line["p"] in prefills and line["d"] in decodes and line["tokens"] == 100 * n
        assert [u for u, _ in line["prefills"]] == prefills and [u for u, _, _ in line["decodes"]] == decodes
        # one at a time: nothing else in flight when each was routed
        assert all(load == 0 for _, load in line["prefills"]) and all(run_ == 0 for _, run_, _ in line["decodes"])
