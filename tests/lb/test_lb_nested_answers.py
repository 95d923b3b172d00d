"""`return_logprob` answers the LB cannot merge: the decode's answer nested deeper than orjson writes (it
reads 1024 levels, writes 254). The LB forwards the decode's answer unchanged (logged once), never a 500 or
a broken stream; an ordinary answer still gets the prefill's input logprobs. Real HTTP on 127.0.0.1, both
workers stand-ins whose /generate answers are set by the test."""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import aiohttp
import orjson
from aiohttp import web

from lb_harness import run, serve_local
from sglang_p2p_lb.health import HealthConfig
from sglang_p2p_lb.proxy import ProxyConfig
from sglang_p2p_lb.server import LBConfig, LoadBalancer
from sglang_p2p_backend.testing.launch import free_port

DEPTH = 300  # between what orjson writes (254) and what it reads (1024)
PREFILL_LP = [[-0.1, 1, None], [-0.2, 2, None]]
DECODE_LP = [[-0.3, 3, None]]
REQUEST = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}


def _answer(text: str, extra: bytes = b"null", index: int = 0) -> bytes:
    """A /generate answer (or streamed event) with input logprobs; `extra` is spliced in as raw JSON."""
    head = orjson.dumps({"text": text, "index": index, "meta_info": {"id": "r", "input_token_logprobs": DECODE_LP}})
    return head[:-1] + b',"extra":' + extra + b"}"


def _deep(depth: int = DEPTH) -> bytes:
    return b"[" * depth + b"]" * depth


class Worker:
    """Answers /generate with `body` (plain JSON), or with `events` as SSE when the request streams."""

    def __init__(self, body: bytes, events: list[bytes] | None = None) -> None:
        self.body, self.events = body, events or [body]
        self.hits = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=self.body, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for ev in self.events:
            await out.write(b"data: " + ev + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def start(self) -> "Worker":
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", lambda r: web.Response())
        self._runner, self.url = await serve_local(app)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


PREFILL_ANSWER = orjson.dumps({"text": "", "meta_info": {"id": "r", "input_token_logprobs": PREFILL_LP}})


@contextlib.asynccontextmanager
async def pair(decode: Worker, prefill: Worker | None = None) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    prefill = await (prefill or Worker(PREFILL_ANSWER)).start()
    await decode.start()
    lb = LoadBalancer(LBConfig(prefills=[(prefill.url, free_port())], decodes=[decode.url], host="127.0.0.1", port=0,
                               health=HealthConfig(enabled=False), proxy=ProxyConfig(request_timeout=20.0, connect_timeout=2.0)))
    url = await lb.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    try:
        yield url, http
    finally:
        await http.close()
        await lb.stop()
        await prefill.stop()
        await decode.stop()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "return_logprob" in r.getMessage()]


def _no_traceback(caplog) -> None:
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]


def test_non_streaming_deep_answer_is_forwarded_unchanged_and_logged_once(caplog):
    deep = _answer("deep", _deep())
    assert orjson.loads(deep)  # what orjson reads, though not what it writes

    async def body():
        decode = Worker(deep)
        async with pair(decode) as (url, http):
            for _ in range(3):
                async with http.post(url + "/generate", json=REQUEST) as r:
                    assert r.status == 200, (r.status, (await r.read())[:300])
                    assert await r.read() == deep  # the decode's answer, byte for byte
            msgs = _warnings(caplog)
            assert len(msgs) == 1 and "nested deeper" in msgs[0], msgs  # once per cause, not per request
            _no_traceback(caplog)
            decode.body = _answer("ok", _deep(10))  # an ordinary answer still gets the prefill's input logprobs
            async with http.post(url + "/generate", json=REQUEST) as r:
                assert r.status == 200
                out = orjson.loads(await r.read())
            assert out["meta_info"]["input_token_logprobs"] == PREFILL_LP + DECODE_LP and out["extra"] == orjson.loads(_deep(10))

    caplog.set_level(logging.INFO, logger="sglang_p2p_lb")
    run(body)


def test_streaming_deep_event_is_forwarded_unchanged_and_the_stream_ends_well(caplog):
    first, deep, last = _answer("a"), _answer("b", _deep()), _answer("c")

    async def body():
        async with pair(Worker(first, [first, deep, last])) as (url, http):
            for _ in range(2):
                async with http.post(url + "/generate", json={**REQUEST, "stream": True}) as r:
                    assert r.status == 200
                    raw = await r.read()  # a stream cut by a traceback raises ClientPayloadError here
                events = raw.split(b"\n\n")
                assert events[-2:] == [b"data: [DONE]", b""], raw[-200:]
                got = [e.removeprefix(b"data: ") for e in events[:-2]]
                assert len(got) == 3 and got[1] == deep  # the deep event as the decode sent it
                for ev in (got[0], got[2]):  # the others merged as before
                    assert orjson.loads(ev)["meta_info"]["input_token_logprobs"] == PREFILL_LP + DECODE_LP
            msgs = _warnings(caplog)
            assert len(msgs) == 1 and "nested deeper" in msgs[0], msgs
            _no_traceback(caplog)

    caplog.set_level(logging.INFO, logger="sglang_p2p_lb")
    run(body)


ODD = orjson.dumps({"text": "x", "index": [0], "meta_info": {"input_token_logprobs": DECODE_LP}})  # "index" unhashable


def test_streamed_event_with_an_unhashable_index_is_forwarded_unchanged(caplog):
    async def body():
        async with pair(Worker(_answer("a"), [_answer("a"), ODD])) as (url, http):
            async with http.post(url + "/generate", json={**REQUEST, "stream": True}) as r:
                raw = await r.read()
            assert raw.split(b"\n\n")[1:] == [b"data: " + ODD, b"data: [DONE]", b""], raw[-200:]
            assert len(_warnings(caplog)) == 1
            _no_traceback(caplog)

    caplog.set_level(logging.INFO, logger="sglang_p2p_lb")
    run(body)


def test_streamed_prefill_answer_with_an_unhashable_index_leaves_the_decode_answer_as_is(caplog):
    async def body():
        async with pair(Worker(_answer("a")), prefill=Worker(ODD)) as (url, http):
            async with http.post(url + "/generate", json={**REQUEST, "stream": True}) as r:
                assert r.status == 200
                raw = await r.read()
            assert raw == b"data: " + _answer("a") + b"\n\ndata: [DONE]\n\n"
            msgs = _warnings(caplog)
            assert len(msgs) == 1 and "prefill" in msgs[0], msgs
            _no_traceback(caplog)

    caplog.set_level(logging.INFO, logger="sglang_p2p_lb")
    run(body)
