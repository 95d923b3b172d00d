"""Stopped and busy workers: what is retried, what is ejected, and the last worker of a role kept in rotation.

A stopped worker (SIGSTOP) still completes TCP handshakes (the kernel does) but answers nothing; a busy one
(an HTTP process parsing a 50 MB body) looks the same for a while. Only the streak tells them apart.
"""

import asyncio
import time

import pytest

from lb_harness import cluster, run, sim_process, wait_until
from sglang_p2p_lb.health import HealthConfig
from sglang_p2p_lb.proxy import ProxyConfig
from sglang_p2p_lb.workers import Worker

GEN = {"text": "a b c", "sampling_params": {"max_new_tokens": 2}}


def _ejections(c) -> str:
    return "".join(line for line in c.lb.metrics.render().decode().splitlines() if line.startswith("sglang_p2p_lb_worker_ejections_total{"))


@pytest.mark.serial
def test_frozen_prefill_costs_no_client_error():
    """One of two prefills SIGSTOPped: every request, streamed or not, that waited on it is sent again to the
    other prefill with a new room (nothing had reached its client); the frozen one is ejected."""

    async def body():
        hc = HealthConfig(interval=0.2, timeout=5.0, liveness_timeout=0.4, timeout_failure_threshold=2, success_threshold=1)
        # long first-byte bounds: only stall detection can move these requests in time
        proxy = ProxyConfig(max_retries=2, request_timeout=30, first_byte_timeout=30, idle_stream_timeout=30)
        with sim_process("prefill") as frozen:
            async with cluster(1, 1, policy="round_robin", health=hc, proxy=proxy) as c:
                p = c.lb.pool.add(Worker(frozen.url, "prefill", frozen.bootstrap_port))
                assert await frozen.answering(c.http)
                assert await wait_until(lambda: p.consecutive_successes > 0)
                frozen.freeze()
                reqs = [{**GEN, "stream": i % 2 == 0} for i in range(20)]
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(c.post("/generate", r) for r in reqs))
                elapsed = time.perf_counter() - t0
                assert [o[0] for o in outs] == [200] * 20, [o[2] for o in outs if o[0] != 200]
                for r, (_, raw, out) in zip(reqs, outs):
                    if r["stream"]:
                        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
                    else:
                        assert out["text"] == " tok tok"
                assert c.prefills[0].stats.completed == 20
                # two timed-out probes (about 2 x (0.2 + 0.4) s), then the retry; slack for a loaded machine
                assert elapsed < 6.0, elapsed
                assert p.healthy is False and "stopped or hung" in p.last_error
                assert 'sglang_p2p_lb_retries_total{side="prefill"}' in c.lb.metrics.render().decode()
                # the decode legs that waited for the frozen prefill's KV were closed, not left waiting
                assert await wait_until(lambda: c.decodes[0].stats.cancelled >= 1)
                assert await wait_until(lambda: c.lb.dispatcher.inflight == 0)

    run(body)


def test_frozen_decode_before_its_first_byte_is_retried_on_the_other_decode():
    async def body():
        hc = HealthConfig(interval=0.05, timeout=5.0, liveness_timeout=0.2, timeout_failure_threshold=1)
        async with cluster(1, 2, policy="round_robin", health=hc, proxy=ProxyConfig(request_timeout=30, first_byte_timeout=30)) as c:
            stuck = c.decodes[0]  # round_robin's first pick
            stuck.hang_next = 1
            task = asyncio.create_task(c.post("/generate", GEN))
            assert await wait_until(lambda: stuck.stats.requests == 1)
            stuck.model_info_delay = 5.0  # and now its liveness probes hang too: stopped
            status, _, out = await task
            assert status == 200 and out["text"] == " tok tok"
            assert c.decodes[1].stats.completed == 1
            w = c.lb.pool.get("decode", stuck.url)
            assert w.healthy is False and w.inflight_reqs == [0]  # ejected (the other decode is a spare), leg closed

    run(body)


def test_prefill_stall_after_its_answer_does_not_fail_the_request():
    """A non-streamed answer comes only when the decode is done; a prefill that stops after handing its KV
    over no longer concerns the request."""

    async def body():
        hc = HealthConfig(interval=0.05, timeout=5.0, liveness_timeout=0.1, timeout_failure_threshold=1)
        async with cluster(1, 1, sim={"decode_ms_per_token": 5}, health=hc) as c:
            task = asyncio.create_task(c.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 300}}))
            assert await wait_until(lambda: c.prefills[0].stats.completed == 1)
            c.prefills[0].model_info_delay = c.prefills[0].health_delay = 5.0  # it stops answering
            p = c.lb.pool.get("prefill", c.prefills[0].url)
            assert await wait_until(lambda: p.consecutive_timeouts >= 1)
            assert not task.done()  # the stall was seen while the decode still generated
            status, _, out = await task
            assert p.degraded  # the only prefill: kept in rotation
            assert status == 200 and out["text"] == " tok" * 300

    run(body)


def test_one_slow_liveness_probe_ejects_nothing():
    """Busy servers (a 50 MB body): one /model_info probe of a prefill and of the only decode times out."""

    async def body():
        hc = HealthConfig(interval=0.1, timeout=5.0, liveness_timeout=0.2, recovery_interval=0.05)  # default thresholds
        async with cluster(2, 1, health=hc) as c:
            busy = [c.prefills[0], c.decodes[0]]
            for w in busy:
                w.model_info_delays = [0.6, 0.6]  # two slow probes in a row: still below the threshold (3)
            assert await wait_until(lambda: not any(w.model_info_delays for w in busy))  # both under way
            outs = await asyncio.gather(*(c.post("/generate", GEN) for _ in range(4)))
            assert [o[0] for o in outs] == [200] * 4
            assert await wait_until(lambda: all(w.stats.liveness_checks >= 4 for w in busy))
            assert _ejections(c) == ""
            assert all(w.healthy and not w.degraded for w in c.lb.pool)
            assert (await c.post("/generate", GEN))[0] == 200

    run(body)


def test_busy_worker_answering_its_load_endpoint_is_not_ejected():
    async def body():
        hc = HealthConfig(interval=0.1, timeout=10.0, liveness_timeout=0.3, timeout_failure_threshold=2)
        async with cluster(2, 1, policy="round_robin", health=hc, load_poll_interval=0.05) as c:
            busy = c.prefills[0]
            # every liveness probe times out and /health is held, but /v1/loads still answers
            busy.model_info_delay = busy.health_delay = 5.0
            assert await wait_until(lambda: busy.stats.liveness_checks >= 4 and busy.stats.load_polls >= 10)
            w = c.lb.pool.get("prefill", busy.url)
            assert _ejections(c) == "" and w.healthy and not w.degraded
            for _ in range(4):
                assert (await c.post("/generate", GEN))[0] == 200
            assert busy.stats.completed == 2

    run(body)


def test_last_worker_of_a_role_is_kept_in_rotation_as_degraded():
    async def body():
        hc = HealthConfig(interval=0.05, timeout=1.0, failure_threshold=2, success_threshold=2)
        async with cluster(1, 2, health=hc) as c:
            ws = [c.lb.pool.get("decode", d.url) for d in c.decodes]
            for d in c.decodes:
                d.healthy = False  # /health says 503; the server still serves requests
            assert await wait_until(lambda: sorted(w.state for w in ws) == ["degraded", "ejected"])
            kept = next(w for w in ws if w.state == "degraded")
            status, health = await c.get("/health")
            assert status == 200 and health["status"] == "degraded" and health["degraded_decode"] == 1
            listing = {w["url"]: w for w in (await c.get("/workers"))[1]["workers"]}
            assert listing[kept.url]["state"] == "degraded" and listing[kept.url]["healthy"] is True
            assert f'sglang_p2p_lb_worker_degraded{{role="decode",url="{kept.url}"}} 1.0' in c.lb.metrics.render().decode()
            for _ in range(3):
                assert (await c.post("/generate", GEN))[0] == 200
            assert c.lb.pool.get("decode", kept.url) is kept and kept.selected == 3
            assert "last_resort_total{" not in c.lb.metrics.render().decode()
            # the ejected one recovers: now a spare exists, so the failing one is ejected in its turn
            gone = next(w for w in ws if w is not kept)
            c.worker_for(gone.url).healthy = True
            assert await wait_until(lambda: gone.state == "healthy" and kept.state == "ejected")
            c.worker_for(kept.url).healthy = True
            assert await wait_until(lambda: kept.state == "healthy")
            assert (await c.get("/health"))[1]["status"] == "ok"

    run(body)


def test_cli_health_flags_smg_names_and_limits():
    from sglang_p2p_lb.cli import build_parser, config_from_args

    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    smg = ["--health-failure-threshold", "4", "--health-success-threshold", "3", "--health-check-timeout-secs", "6", "--health-check-interval-secs", "7"]
    hc = config_from_args(build_parser().parse_args(base + smg)).health
    assert (hc.failure_threshold, hc.success_threshold, hc.timeout, hc.interval) == (4, 3, 6.0, 7.0)
    assert config_from_args(build_parser().parse_args(base)).health.timeout_failure_threshold == 3  # one slow probe ejects nothing
    bad = [("--health-failure-threshold", "0"), ("--health-success-threshold", "0"), ("--health-timeout-failure-threshold", "0"),
           ("--passive-failure-threshold", "0"), ("--health-check-timeout-secs", "0"), ("--health-check-interval-secs", "-1"),
           ("--health-liveness-timeout-secs", "nan")]
    for flag, value in bad:
        with pytest.raises(ValueError, match=flag):
            config_from_args(build_parser().parse_args(base + [flag, value]))
