"""Hardening findings as behaviour: keys on admin routes, slowloris, stalled workers, wrong types, safe retries.

All on 127.0.0.1 against simulated workers (in-process, or a simworker process where SIGSTOP is needed).
"""

import asyncio
import time

import orjson
import pytest

from lb_harness import ADMIN, ADMIN_KEY, cluster, run, sim_process, wait_until
from sglang_p2p_lb import auth
from sglang_p2p_lb.auth import AuthConfig
from sglang_p2p_lb.health import HealthConfig
from sglang_p2p_lb.proxy import ProxyConfig
from sglang_p2p_lb.workers import Worker
from simworker import SimConfig, SimWorker

GEN = {"text": "a b c", "sampling_params": {"max_new_tokens": 2}}


# ------------------------------------------------------------------ keys
def test_rogue_decode_refused_without_admin_key_and_accepted_with_it():
    async def body():
        rogue = SimWorker(SimConfig(role="decode", decode_ms_per_token=1.0))
        await rogue.start()
        try:
            new = {"url": rogue.url, "role": "decode"}
            # no admin key configured: admin routes are off, whatever the caller sends
            async with cluster(1, 1) as c:
                for headers in (None, ADMIN):
                    status, _, out = await c.post("/workers", new, headers=headers)
                    assert status == 403 and "--admin-api-key" in out["error"]["message"]
                assert (await c.post("/flush_cache", None, raw=b""))[0] == 403
                async with c.http.delete(c.url + "/workers", params={"url": c.decodes[0].url}) as r:
                    assert r.status == 403
                for _ in range(4):
                    assert (await c.post("/generate", GEN))[0] == 200
                assert rogue.stats.requests == 0 and len(c.lb.pool.all("decode")) == 1
                assert c.prefills[0].stats.flushes == 0
            # a key configured: a wrong or missing key is 401, the right one is accepted
            async with cluster(1, 1, auth=AuthConfig.from_keys([ADMIN_KEY], None)) as c:
                for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
                    status, _, _ = await c.post("/workers", new, headers=headers)
                    assert status == 401
                assert rogue.stats.requests == 0 and len(c.lb.pool.all("decode")) == 1
                status, _, out = await c.post("/workers", new, headers=ADMIN)
                assert status == 200 and out["worker"]["url"] == rogue.url
                assert len(c.lb.pool.all("decode")) == 2
        finally:
            await rogue.stop()

    run(body)


def test_client_api_key_gates_data_routes_but_not_health():
    async def body():
        async with cluster(1, 1, auth=AuthConfig.from_keys([ADMIN_KEY], "client-key")) as c:
            status, _, out = await c.post("/generate", GEN)
            assert status == 401 and "--api-key" in out["error"]["message"]
            assert (await c.post("/generate", GEN, headers={"Authorization": "Bearer nope"}))[0] == 401
            assert (await c.post("/generate", GEN, headers={"Authorization": "Bearer client-key"}))[0] == 200
            assert (await c.get("/v1/models"))[0] == 401
            assert (await c.get("/health"))[0] == 200 and (await c.get("/metrics"))[0] == 200
            # the client key does not open admin routes
            assert (await c.post("/flush_cache", None, raw=b"", headers={"Authorization": "Bearer client-key"}))[0] == 401
            assert c.prefills[0].stats.requests == 1

    run(body)


def test_key_parsing_and_startup_warnings():
    assert auth.parse_control_plane_keys(["k1:CI:admin:sk-a", "k2:ro:user:sk-b,sk-c"]) == ["sk-a", "sk-c"]
    with pytest.raises(ValueError):
        auth.parse_control_plane_keys(["a:b"])
    cfg = AuthConfig.from_keys(["sk-a"], None)
    assert auth.verdict(cfg, "POST", "/workers", "Bearer sk-a") is None
    assert auth.verdict(cfg, "POST", "/workers", "Basic sk-a")[0] == 401
    assert auth.verdict(AuthConfig(), "DELETE", "/workers", "Bearer sk-a")[0] == 403
    assert auth.verdict(AuthConfig(), "POST", "/generate", None) is None
    assert auth.startup_warnings(AuthConfig(), "127.0.0.1") == [] and auth.startup_warnings(AuthConfig(), "::1") == []
    warns = auth.startup_warnings(AuthConfig(), "0.0.0.0")
    assert len(warns) == 2 and "admin key" in warns[0]
    assert auth.startup_warnings(AuthConfig.from_keys(["a"], "b"), "0.0.0.0") == []


# ------------------------------------------------------------------ slowloris
async def _open(port: int, data: bytes):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


@pytest.mark.serial
def test_slowloris_sockets_do_not_block_real_requests():
    async def body():
        proxy = ProxyConfig(max_concurrent=4, body_timeout=2.0, request_timeout=20)
        async with cluster(1, 1, proxy=proxy, header_timeout=2.0) as c:
            port = c.lb.cfg.port
            t0 = time.perf_counter()
            partial_headers = [await _open(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le") for _ in range(10)]
            head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"text\": "
            partial_bodies = [await _open(port, head) for _ in range(10)]
            await asyncio.sleep(0.2)
            # ten slow bodies are being read, none counts against the 4 slots
            assert c.lb.dispatcher.inflight == 0
            results = await asyncio.gather(*(c.post("/generate", GEN) for _ in range(4)))
            assert [r[0] for r in results] == [200] * 4
            assert time.perf_counter() - t0 < 2.0  # served while every slow socket was still open

            async def answer(reader) -> bytes:
                return await asyncio.wait_for(reader.read(), 5.0)  # until the LB closes the connection

            heads = await asyncio.gather(*(answer(r) for r, _ in partial_headers))
            bodies = await asyncio.gather(*(answer(r) for r, _ in partial_bodies))
            elapsed = time.perf_counter() - t0
            assert heads == [b""] * 10  # closed without an answer
            assert all(b.startswith(b"HTTP/1.1 408") and b"not received within 2s" in b for b in bodies)
            assert elapsed < 6.0  # 2 s timeouts, 1 s of lingering after the 408, slack
            for _, w in partial_headers + partial_bodies:
                w.close()
            assert c.prefills[0].stats.requests == 4

    run(body)


# ------------------------------------------------------------------ stalled workers
@pytest.mark.serial
def test_sigstopped_only_decode_answers_clear_504s_and_stays_in_rotation():
    """The only decode stops (SIGSTOP) but accepts connections: the requests waiting on it get a clear 504
    within the stall bound, and it stays in rotation (degraded): ejecting it would leave no decode at all."""

    async def body():
        hc = HealthConfig(interval=0.3, timeout=5.0, liveness_timeout=0.5, timeout_failure_threshold=1, failure_threshold=3, success_threshold=1)
        # a long first-byte / idle bound, so only stall detection can end the requests in time
        proxy = ProxyConfig(max_retries=0, request_timeout=60, first_byte_timeout=60, idle_stream_timeout=60)
        bound = hc.interval + hc.liveness_timeout + 1.5  # one probe interval + one probe timeout, plus slack
        with sim_process("decode", "--decode-ms-per-token", "5") as proc:
            async with cluster(1, 0, health=hc, proxy=proxy) as c:
                d = c.lb.pool.add(Worker(proc.url, "decode"))
                assert await proc.answering(c.http)
                assert await wait_until(lambda: d.consecutive_successes > 0)
                long = {"text": "x", "sampling_params": {"max_new_tokens": 100000}}
                streams, firsts = [], []
                for _ in range(4):
                    r = await c.http.post(c.url + "/generate", data=orjson.dumps({**long, "stream": True}))
                    firsts.append(await r.content.readuntil(b"\n\n"))
                    streams.append(r)
                plain = [asyncio.create_task(c.post("/generate", long)) for _ in range(3)]
                await asyncio.sleep(0.2)
                proc.freeze()
                t0 = time.perf_counter()
                tails = await asyncio.gather(*(asyncio.wait_for(r.read(), 5.0) for r in streams))
                outs = await asyncio.wait_for(asyncio.gather(*plain), 5.0)
                assert time.perf_counter() - t0 < bound
                assert all(f.startswith(b"data: {") for f in firsts)
                assert all(b"stopped answering" in t and b'"code":504' in t for t in tails)
                assert [o[0] for o in outs] == [504] * 3 and all("stopped answering" in o[2]["error"]["message"] for o in outs)
                assert d.healthy and d.degraded and "stopped or hung" in d.last_error
                assert await wait_until(lambda: c.lb.dispatcher.inflight == 0)
                # still tried, and answered with the same clear 504 at its next timed-out probe, not held
                t0 = time.perf_counter()
                status, _, out = await c.post("/generate", GEN)
                assert status == 504 and "stopped answering" in out["error"]["message"]
                assert time.perf_counter() - t0 < bound
                for r in streams:
                    r.release()
                proc.thaw()
                assert await wait_until(lambda: not d.degraded, 5)  # back to healthy once it answers again
                assert (await c.post("/generate", GEN))[0] == 200
                assert "worker_ejections_total{" not in c.lb.metrics.render().decode()

    run(body)


def test_slow_health_answer_is_not_a_stall():
    """SGLang's /health waits for scheduler output (seconds in a long prefill): only liveness timeouts eject."""

    async def body():
        hc = HealthConfig(interval=0.1, timeout=5.0, liveness_timeout=0.3, failure_threshold=3, success_threshold=1)
        async with cluster(1, 1, sim={"decode_ms_per_token": 5}, health=hc) as c:
            for w in c.prefills + c.decodes:
                w.health_delay = 1.0
            long = {"text": "x", "sampling_params": {"max_new_tokens": 300}, "stream": True}
            status, raw, _ = await c.post("/generate", long)  # ~1.5 s of streaming while /health lags 1 s
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and b"error" not in raw
            assert all(w.healthy for w in c.lb.pool)
            assert sum(w.stats.health_checks for w in c.prefills + c.decodes) >= 2

    run(body)


def test_first_byte_timeout_bounds_a_hung_decode_without_health_checks():
    async def body():
        async with cluster(1, 1, proxy=ProxyConfig(max_retries=2, first_byte_timeout=0.5, request_timeout=20)) as c:
            c.decodes[0].hang_next = 1
            t = time.perf_counter()
            status, _, out = await c.post("/generate", {**GEN, "stream": True})
            assert 0.4 < time.perf_counter() - t < 3.0
            assert status == 504 and "first-byte timeout" in out["error"]["message"]
            assert c.decodes[0].stats.requests == 1  # a timeout is not retried

    run(body)


def test_idle_stream_timeout_ends_a_silent_stream():
    async def body():
        async with cluster(1, 1, proxy=ProxyConfig(idle_stream_timeout=0.3, request_timeout=20)) as c:
            c.decodes[0].pause_after_first = 1
            t = time.perf_counter()
            status, raw, _ = await c.post("/generate", {**GEN, "stream": True})
            assert status == 200 and time.perf_counter() - t < 3.0
            assert b"idle-stream timeout" in raw and raw.count(b"data: {") == 2  # first token, then the error event

    run(body)


# ------------------------------------------------------------------ wrong types
def test_wrong_types_give_400_naming_the_field():
    cases = [
        ("/generate", {"input_embeds": 5}, "'input_embeds'"),
        ("/generate", {"input_embeds": [[1, "x"]]}, "'input_embeds'"),
        ("/generate", {"text": "a", "sampling_params": "fast"}, "'sampling_params'"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "8"}}, "'sampling_params.max_new_tokens'"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{"temperature": "hot"}, {}]}, "'sampling_params[0].temperature'"),
        ("/generate", {"input_ids": [1, "2"]}, "'input_ids'"),
        ("/generate", {"text": "a", "return_logprob": "yes"}, "'return_logprob'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "'messages[0].content[0].text'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [7]}]}, "'messages[0].content[0]'"),
        ("/v1/chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, "'messages[0]'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "'messages[0].content'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, "'max_tokens'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": 1}}, "'stream_options.include_usage'"),
        ("/v1/completions", {"prompt": 5}, "'prompt'"),
        ("/v1/completions", {"prompt": "a", "temperature": "0.5"}, "'temperature'"),
        ("/v1/completions", {"prompt": "a", "max_tokens": True}, "'max_tokens'"),
    ]

    async def body():
        async with cluster(1, 1) as c:
            for path, req, field in cases:
                status, _, out = await c.post(path, req)
                assert status == 400 and field in out["error"]["message"], (path, req, status, out)
            assert c.prefills[0].stats.requests == 0 and c.decodes[0].stats.requests == 0
            assert "bad_request" in c.lb.metrics.render().decode()

    run(body)


# ------------------------------------------------------------------ retries
@pytest.mark.parametrize("status", [400, 404, 500])
def test_prefill_4xx_and_500_not_retried(status):
    async def body():
        async with cluster(2, 1, policy="round_robin") as c:
            for p in c.prefills:
                p.fail_next, p.fail_status = 1, status
            got, _, out = await c.post("/generate", GEN)
            assert got == status and out["error"]["message"] == "injected failure"
            assert sum(p.stats.requests for p in c.prefills) == 1

    run(body)


@pytest.mark.parametrize("status", [400, 500])
def test_decode_4xx_and_500_not_retried(status):
    async def body():
        async with cluster(1, 2, policy="round_robin") as c:
            for d in c.decodes:
                d.fail_next, d.fail_status = 1, status
            got, _, _ = await c.post("/generate", {**GEN, "stream": True})
            assert got == status
            assert sum(d.stats.requests for d in c.decodes) == 1

    run(body)


def test_refused_connection_and_503_are_retried():
    async def body():
        async with cluster(2, 2, policy="round_robin") as c:
            await c.prefills[0].stop()  # refused
            c.decodes[1].fail_next, c.decodes[1].fail_status = 1, 503
            for _ in range(4):
                assert (await c.post("/generate", GEN))[0] == 200
            # every request went through the live prefill; the 503 decode's attempt may have
            # finished its prefill before the retry, so that prefill can count one more
            assert c.prefills[1].stats.completed >= 4 and c.decodes[1].stats.failed == 1
            assert sum(d.stats.completed for d in c.decodes) == 4

    run(body)


def test_pooled_worker_connections_expire_before_sglangs_keep_alive():
    # a connection SGLang's uvicorn already closed (after SGLANG_TIMEOUT_KEEP_ALIVE, 5 s) must not be reused:
    # the request on it would fail with ServerDisconnectedError, and a started decode leg cannot be retried
    from sglang_p2p_lb.server import WORKER_KEEPALIVE_S

    sglang_keep_alive_s = 5
    assert 0 < WORKER_KEEPALIVE_S < sglang_keep_alive_s
