"""Faults and bad input end to end: retries, fail-fast, ejection/re-admission, 4xx reasons, disconnects."""

import asyncio
import time

import aiohttp
import orjson

from lb_harness import cluster, run, wait_until
from sglang_p2p_lb.health import HealthConfig
from sglang_p2p_lb.proxy import ProxyConfig

GEN = {"text": "a b c", "sampling_params": {"max_new_tokens": 2}}


def test_retry_on_another_prefill_after_503():
    async def body():
        async with cluster(2, 1, policy="round_robin") as c:
            c.prefills[0].fail_next, c.prefills[0].fail_status = 1, 503
            status, _, out = await c.post("/generate", GEN)
            assert status == 200 and out["text"] == " tok tok"
            assert c.prefills[0].stats.failed == 1 and c.prefills[1].stats.completed == 1
            # the first decode leg (waiting for KV that never comes) was cancelled, the retry completed
            assert await wait_until(lambda: c.decodes[0].stats.cancelled == 1)
            assert c.decodes[0].stats.completed == 1
            assert 'sglang_p2p_lb_retries_total{side="prefill"} 1.0' in c.lb.metrics.render().decode()

    run(body)


def test_dead_prefill_retried_then_ejected_passively():
    async def body():
        async with cluster(2, 1, policy="round_robin") as c:
            dead = c.prefills[0]
            await dead.stop()
            for _ in range(6):
                status, _, _ = await c.post("/generate", GEN)
                assert status == 200
            w = c.lb.pool.get("prefill", dead.url)
            assert w.healthy is False and "transport error" in w.last_error
            assert c.prefills[1].stats.completed == 6

    run(body)


def test_failed_prefill_fails_fast_and_cancels_decode():
    async def body():
        # the decode would wait 10 s for KV; without retries the client gets the prefill's error at once
        async with cluster(1, 1, proxy=ProxyConfig(max_retries=0, request_timeout=20)) as c:
            c.prefills[0].fail_next, c.prefills[0].fail_status = 1, 503
            t = time.perf_counter()
            status, _, out = await c.post("/generate", GEN)
            assert time.perf_counter() - t < 2.0
            assert status == 503 and out == {"error": {"message": "injected failure", "type": "InternalServerError", "code": 503}}
            assert await wait_until(lambda: c.decodes[0].stats.cancelled == 1)
            # both legs released their load
            assert [w.inflight_reqs for w in c.lb.pool] == [[0], [0]]

    run(body)


def test_prefill_4xx_returned_not_retried():
    async def body():
        async with cluster(2, 1) as c:
            for p in c.prefills:
                p.fail_next, p.fail_status = 1, 400
            status, _, out = await c.post("/generate", GEN)
            assert status == 400 and out["error"]["message"] == "injected failure"
            assert sum(p.stats.requests for p in c.prefills) == 1

    run(body)


def test_decode_failure_retried_on_other_decode():
    async def body():
        async with cluster(1, 2, policy="round_robin") as c:
            c.decodes[0].fail_next, c.decodes[0].fail_status = 1, 503
            status, raw, _ = await c.post("/generate", {**GEN, "stream": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            assert c.decodes[0].stats.failed == 1 and c.decodes[1].stats.completed == 1

    run(body)


def test_kv_that_never_came_is_retried_on_another_prefill_with_the_only_decode():
    """A decode that aborts before its first token says its KV never came: the prefill's fault (here one whose
    request hangs, as a prefill killed just after it was picked, whose leg outlives the decode's wait). The
    retry goes to another prefill, with the same decode where it is the only one: excluding the decode would
    leave no pair, and the client would get the abort (3P1D's one decode)."""
    async def body():
        async with cluster(2, 1, sim={"bootstrap_timeout": 0.3}, policy="round_robin",
                           proxy=ProxyConfig(request_timeout=20.0, connect_timeout=2.0, first_byte_timeout=10.0)) as c:
            c.prefills[0].hang_next = 1
            status, raw, _ = await c.post("/generate", {**GEN, "stream": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and b"abort" not in raw, raw[:300]
            assert c.decodes[0].stats.bootstrap_failures == 1 and c.prefills[1].stats.completed == 1
            assert 'sglang_p2p_lb_retries_total{side="decode"} 1.0' in c.lb.metrics.render().decode()

    run(body)


def test_kv_that_never_came_twice_ends_with_the_decodes_abort():
    """Bounded: where every prefill's KV fails to come, the attempts end and the client gets the decode's own
    abort (status and body), not a hang."""
    async def body():
        async with cluster(2, 1, sim={"bootstrap_timeout": 0.2}, proxy=ProxyConfig(request_timeout=20.0, connect_timeout=2.0,
                                                                                  first_byte_timeout=10.0, max_retries=3)) as c:
            for p in c.prefills:
                p.hang_next = 5
            status, raw, _ = await c.post("/generate", {**GEN, "stream": True})
            assert status == 500 and b'"type":"abort"' in raw
            assert c.decodes[0].stats.bootstrap_failures == 2  # one attempt a prefill, then no pair was left

    run(body)


def test_ejection_and_readmission_by_health_checks():
    async def body():
        hc = HealthConfig(interval=0.05, timeout=1.0, failure_threshold=2, success_threshold=2)
        async with cluster(2, 1, health=hc) as c:
            sick = c.prefills[0]
            w = c.lb.pool.get("prefill", sick.url)
            sick.healthy = False
            assert await wait_until(lambda: not w.healthy)
            assert "returned 503" in w.last_error
            for _ in range(4):
                assert (await c.post("/generate", GEN))[0] == 200
            assert sick.stats.requests == 0 and c.prefills[1].stats.requests == 4
            assert (await c.get("/health"))[1]["healthy_prefill"] == 1
            sick.healthy = True
            assert await wait_until(lambda: w.healthy)
            assert 'sglang_p2p_lb_worker_ejections_total{role="prefill"} 1.0' in c.lb.metrics.render().decode()
            # with every prefill failing, the last one is kept in rotation (degraded) rather than ejected
            for p in c.prefills:
                p.healthy = False
            assert await wait_until(lambda: sorted(x.state for x in c.lb.pool.all("prefill")) == ["degraded", "ejected"])
            assert (await c.get("/health"))[1]["status"] == "degraded"
            assert (await c.post("/generate", GEN))[0] == 200
            # and when they are gone too, each is tried once (the ejected one as a last resort) and the
            # answer names the failure
            for p in c.prefills:
                await p.stop()
            status, _, out = await c.post("/generate", GEN)
            assert status == 502 and "ClientConnectorError" in out["error"]["message"], out
            assert 'sglang_p2p_lb_last_resort_total{role="prefill"} 1.0' in c.lb.metrics.render().decode()

    run(body)


def test_malformed_requests_get_4xx_with_reason():
    async def body():
        async with cluster(1, 1, max_body_bytes=4096) as c:
            cases = [
                ("/generate", b"{bad", 400, "not valid JSON"),
                ("/generate", b"[1]", 400, "must be a JSON object, got list"),
                ("/generate", b"", 400, "empty"),
                ("/generate", b'{"text": 5}', 400, "'text' must be a string"),
                ("/generate", b'{"text": "a", "stream": "yes"}', 400, "'stream' must be a boolean"),
                ("/v1/completions", b'{"model": "m"}', 400, "'prompt' must be"),
                ("/v1/chat/completions", b'{"messages": []}', 400, "'messages' must be a non-empty list"),
                ("/generate", orjson.dumps({"text": "x" * 5000}), 413, "too large"),
            ]
            for path, raw, want, reason in cases:
                status, _, out = await c.post(path, None, raw=raw)
                assert status == want and reason in out["error"]["message"], (path, raw[:40], status, out)
            async with c.http.get(c.url + "/generate") as r:
                assert r.status == 405
            assert c.prefills[0].stats.requests == 0 and c.decodes[0].stats.requests == 0

    run(body)


def test_concurrency_bound_without_queue_rejects_with_429():
    async def body():
        async with cluster(1, 1, sim={"prefill_base_ms": 500}, proxy=ProxyConfig(max_concurrent=1, queue_size=0)) as c:
            first = asyncio.create_task(c.post("/generate", GEN))
            assert await wait_until(lambda: c.prefills[0].stats.requests == 1)
            status, _, out = await c.post("/generate", GEN)
            assert status == 429 and "at capacity" in out["error"]["message"]
            assert (await first)[0] == 200

    run(body)


def test_client_disconnect_during_prefill_cancels_both_legs():
    async def body():
        async with cluster(1, 1, sim={"prefill_base_ms": 5000}) as c:
            task = asyncio.create_task(c.post("/generate", {**GEN, "stream": True}))
            assert await wait_until(lambda: c.prefills[0].stats.requests == 1 and c.decodes[0].stats.requests == 1)
            task.cancel()  # closes the client connection before any byte came back
            assert await wait_until(lambda: c.prefills[0].stats.cancelled == 1 and c.decodes[0].stats.cancelled == 1)
            assert await wait_until(lambda: c.lb.dispatcher.inflight == 0)
            assert [w.inflight_reqs for w in c.lb.pool] == [[0], [0]]
            assert c.prefills[0].ranks[0].waiting_reqs == 0

    run(body)


def test_client_disconnect_mid_stream_cancels_decode(caplog):
    async def body():
        async with cluster(1, 1, sim={"decode_ms_per_token": 5}) as c:
            req = {"text": "a", "sampling_params": {"max_new_tokens": 5000}, "stream": True}
            async with c.http.post(c.url + "/generate", data=orjson.dumps(req)) as r:
                assert r.status == 200
                first = await r.content.readuntil(b"\n\n")
                assert first.startswith(b"data: {")
                r.close()
            assert await wait_until(lambda: c.decodes[0].stats.cancelled == 1)
            assert c.decodes[0].stats.completed == 0
            assert await wait_until(lambda: c.lb.pool.all("decode")[0].inflight_reqs == [0])
            # the client went away: counted as a disconnect, not as the decode failing mid-stream (aiohttp raises
            # a write to a closing client as ClientConnectionResetError, an aiohttp.ClientError too)
            metrics = c.lb.metrics.render().decode()
            assert "sglang_p2p_lb_client_disconnects_total 1.0" in metrics
            assert 'sglang_p2p_lb_upstream_errors_total{reason="midstream",side="decode"}' not in metrics

    with caplog.at_level("WARNING"):
        run(body)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "failed mid-stream" in m or "Error handling request" in m], said


def test_health_generate_fails_when_no_pair_can_generate():
    async def body():
        async with cluster(1, 1, proxy=ProxyConfig(max_retries=0)) as c:
            c.decodes[0].fail_next = 1
            status, out = await c.get("/health_generate")
            assert status == 503 and "health generate failed with 500" in out["error"]["message"]

    run(body)


def test_hung_decode_bounded_by_request_timeout():
    async def body():
        async with cluster(1, 1, proxy=ProxyConfig(max_retries=0, request_timeout=1.0)) as c:
            c.decodes[0].hang_next = 1
            t = time.perf_counter()
            status, _, out = await c.post("/generate", GEN)
            assert 0.9 < time.perf_counter() - t < 5.0
            assert status == 504 and "decode worker" in out["error"]["message"] and "TimeoutError" in out["error"]["message"]
            assert [w.inflight_reqs for w in c.lb.pool] == [[0], [0]]

    run(body)


def test_a_write_to_a_closing_client_is_a_disconnect_not_a_decode_failure(monkeypatch, caplog):
    """aiohttp raises a write to a client connection that is closing as ClientConnectionResetError, an
    aiohttp.ClientError too: the stream must count it once as the client going away, not log and count the decode
    as failed mid-stream and then fail again writing it an error event (an unhandled error in aiohttp's log)."""
    from aiohttp import web
    from aiohttp.client_exceptions import ClientConnectionResetError

    real_write = web.StreamResponse.write
    writes = [0]

    lb_port = []

    async def write(self, data):
        req = getattr(self, "_req", None)
        if req is None or req.url.port not in lb_port:  # the simulated workers' answers: as they are
            return await real_write(self, data)
        writes[0] += 1
        if writes[0] >= 2:  # after the first event: the client's transport is closing
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await real_write(self, data)

    async def body():
        async with cluster(1, 1, sim={"decode_ms_per_token": 5}) as c:
            lb_port.append(int(c.url.rsplit(":", 1)[1]))
            monkeypatch.setattr(web.StreamResponse, "write", write)
            req = {"text": "a", "sampling_params": {"max_new_tokens": 5000}, "stream": True}
            async with c.http.post(c.url + "/generate", data=orjson.dumps(req)) as r:
                assert r.status == 200
                try:
                    await r.content.read()
                except aiohttp.ClientError:
                    pass  # the LB closed the connection: what it sent before is all there is
            assert await wait_until(lambda: c.decodes[0].stats.cancelled == 1)
            assert await wait_until(lambda: c.lb.pool.all("decode")[0].inflight_reqs == [0])
            metrics = c.lb.metrics.render().decode()
            assert "sglang_p2p_lb_client_disconnects_total 1.0" in metrics
            assert 'sglang_p2p_lb_upstream_errors_total{reason="midstream",side="decode"}' not in metrics
            assert writes[0] == 2  # no error event attempted after the failed write

    with caplog.at_level("WARNING"):
        run(body)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "failed mid-stream" in m or "Error handling request" in m], said
