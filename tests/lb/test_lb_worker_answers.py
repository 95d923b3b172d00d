"""What the LB does with answers it cannot use: request bodies nested deeper than it can forward, and worker
answers (`/v1/loads`, `/get_load`, `/get_server_info`) of the wrong type, out of range, or from a worker
that replaced a removed one. All over real HTTP on 127.0.0.1, the workers' answers from a stand-in server."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
from aiohttp import web

from lb_harness import ADMIN, ADMIN_KEY, cluster, run, serve_local
from sglang_p2p_lb import health, loads
from sglang_p2p_lb.auth import AuthConfig

ADMIN_AUTH = AuthConfig.from_keys([ADMIN_KEY], None)
MAX_DP_SIZE = 1024  # health.MAX_DP_SIZE
MAX_NESTING = 254  # payload.MAX_NESTING: what orjson writes


class StandIn:
    """A worker that answers the LB's probes and polls with whatever the test sets: `info` for
    /get_server_info, `loads` (raw bytes, or 404 for a server without /v1/loads) and `legacy` for /get_load."""

    def __init__(self, info: dict | None = None) -> None:
        self.info: dict = info or {}
        self.loads: bytes | int = orjson.dumps({"loads": [{"dp_rank": 0}]})
        self.legacy: bytes = b"[]"
        self.hang_health = False
        self._release = asyncio.Event()  # ends hung answers, so that stop() does not wait for them
        self.health_hits = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _health(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        if self.hang_health:
            await self._release.wait()
        return web.Response()

    async def _answer(self, body: bytes | int) -> web.Response:
        if isinstance(body, int):
            return web.Response(status=body)
        return web.Response(body=body, content_type="application/json")

    async def start(self) -> "StandIn":
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", lambda r: self._answer(b"{}"))
        app.router.add_get("/get_server_info", lambda r: self._answer(orjson.dumps(self.info)))
        app.router.add_get("/v1/loads", lambda r: self._answer(self.loads))
        app.router.add_get("/get_load", lambda r: self._answer(self.legacy))
        self._runner, self.url = await serve_local(app)
        return self

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()


# ------------------------------------------------------------------ request bodies
def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


GEN_ROUTES = [
    ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 2}, "extra": '),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 2, "extra": '),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "extra": '),
]


@pytest.mark.parametrize("path, head", GEN_ROUTES, ids=[r for r, _ in GEN_ROUTES])
def test_body_nested_deeper_than_the_lb_can_forward_is_a_400(path, head):
    # orjson reads 1024 levels but writes 254: a body between the two was a 500 when the LB re-encoded it
    async def body():
        async with cluster(1, 1) as c:
            for depth in (300, 1000):
                status, _, out = await c.post(path, None, raw=head + _nested(depth) + b"}")
                assert status == 400 and "nested" in out["error"]["message"], (depth, status, out)
            assert c.prefills[0].stats.requests == 0 and c.decodes[0].stats.requests == 0
            # deep but within what can be forwarded: served
            status, _, _ = await c.post(path, None, raw=head + _nested(MAX_NESTING - 1) + b"}")  # the body's own object is one level
            assert status == 200

    run(body)


# ------------------------------------------------------------------ load answers
BAD_LOADS = [
    pytest.param(b'{"loads": [1]}', id="not-objects"),
    pytest.param(b'{"loads": [{"dp_rank": 0}, {"dp_rank": "1"}]}', id="mixed-rank-types"),
    pytest.param(b'{"loads": [{"dp_rank": 3}]}', id="rank-out-of-range"),
    pytest.param(b'{"loads": [{"dp_rank": 0}, {"dp_rank": 0}]}', id="rank-twice"),
    pytest.param(b'{"loads": [{"num_running_reqs": "3"}]}', id="string-count"),
    pytest.param(b'{"loads": [{"num_waiting_uncached_tokens": "7"}]}', id="string-tokens"),
    pytest.param(b'{"loads": [{"num_waiting_reqs": -1}]}', id="negative-count"),
    pytest.param(b'{"loads": [{"token_usage": true}]}', id="bool-usage"),
    pytest.param(b'{"loads": [{"max_total_num_tokens": 1e300, "num_total_tokens": 1}]}', id="huge-capacity"),
    pytest.param(b'{"loads": "all"}', id="loads-not-a-list"),
    pytest.param(b"[" * 5000 + b"]" * 5000, id="nested-5000"),
    pytest.param(b"not json", id="not-json"),
]


def _warnings(caplog, url: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and url in r.getMessage()]


@pytest.mark.parametrize("bad", BAD_LOADS)
def test_malformed_load_answer_is_no_sample_logged_once_and_never_a_500(bad, caplog):
    async def body():
        w = await StandIn().start()
        try:
            async with cluster(1, 1, auth=ADMIN_AUTH, load_poll_interval=0.02) as c:
                w.loads = bad
                status, _, out = await c.post("/workers", {"url": w.url, "role": "decode"}, headers=ADMIN)
                assert status == 200 and out["worker"]["healthy"] is True, out
                added = c.lb.pool.get("decode", w.url)
                await asyncio.sleep(0.3)  # about 15 poll rounds
                assert added.polled is None
                # one warning for the bad answer, not one a poll; no traceback from the poll loop
                assert len(_warnings(caplog, w.url)) == 1, _warnings(caplog, w.url)
                assert not [r for r in caplog.records if r.exc_info]
                # a good answer is used again, and the next bad one is news again
                w.loads = orjson.dumps({"loads": [{"dp_rank": 0, "num_running_reqs": 5}]})
                await asyncio.sleep(0.2)
                assert added.polled is not None and added.polled.reqs == [5.0]
                w.loads = bad
                await asyncio.sleep(0.2)
                assert len(_warnings(caplog, w.url)) == 2
        finally:
            await w.stop()

    caplog.set_level(logging.INFO, logger="sglang_p2p_lb")
    run(body)


@pytest.mark.parametrize("bad", [b"[1]", b'[{"dp_rank": 0, "num_reqs": "2"}]', b'[{"dp_rank": [0]}]'])
def test_malformed_legacy_load_answer_is_no_sample_and_never_a_500(bad, caplog):
    async def body():
        w = await StandIn().start()
        try:
            async with cluster(1, 1, auth=ADMIN_AUTH, load_poll_interval=0.02) as c:
                w.loads, w.legacy = 404, bad  # a server without /v1/loads: the LB falls back to /get_load
                status, _, _ = await c.post("/workers", {"url": w.url, "role": "prefill", "bootstrap_port": 8998}, headers=ADMIN)
                assert status == 200
                await asyncio.sleep(0.2)
                assert c.lb.pool.get("prefill", w.url).polled is None
                assert len(_warnings(caplog, w.url)) == 1
                assert not [r for r in caplog.records if r.exc_info]
        finally:
            await w.stop()

    caplog.set_level(logging.INFO, logger="sglang_p2p_lb")
    run(body)


def test_load_parsers_check_every_field():
    good = {"loads": [{"dp_rank": 1, "num_running_reqs": 2, "token_usage": 0.5}, {"dp_rank": 0}]}
    assert loads.parse_v1_loads(good)[1] == [0.0, 2.0]
    for bad in ({"loads": [1]}, {"loads": []}, {"loads": [{"dp_rank": 0}, {"dp_rank": None}]}, {"loads": [{"token_usage": "0.5"}]}):
        with pytest.raises(loads.BadLoad):
            loads.parse_v1_loads(bad)
    with pytest.raises(loads.BadLoad, match="num_tokens"):
        loads.parse_legacy_load([{"num_tokens": float(2**60)}])


# ------------------------------------------------------------------ DP size
@pytest.mark.parametrize("reported", [MAX_DP_SIZE + 1, 100_000, "8", 0])
def test_dp_size_beyond_the_bound_is_refused_and_logged_once(reported, caplog):
    async def body():
        w = await StandIn({"enable_dp_attention": True, "dp_size": reported}).start()
        try:
            async with cluster(1, 1, auth=ADMIN_AUTH) as c:
                status, _, out = await c.post("/workers", {"url": w.url, "role": "decode"}, headers=ADMIN)
                assert status == 200 and out["worker"]["dp_size"] == 1, out
                added = c.lb.pool.get("decode", w.url)
                assert len(added.inflight_reqs) == 1
                for _ in range(3):  # not read again at every check, so not logged again
                    assert await c.lb.health.check(added)
                msgs = _warnings(caplog, w.url)
                assert len(msgs) == 1 and "dp_size" in msgs[0], msgs
        finally:
            await w.stop()

    caplog.set_level(logging.INFO, logger="sglang_p2p_lb")
    run(body)


def test_dp_size_within_the_bound_is_used():
    assert health.MAX_DP_SIZE == MAX_DP_SIZE

    async def body():
        w = await StandIn({"enable_dp_attention": True, "dp_size": MAX_DP_SIZE}).start()
        try:
            async with cluster(1, 1, auth=ADMIN_AUTH) as c:
                status, _, out = await c.post("/workers", {"url": w.url, "role": "decode"}, headers=ADMIN)
                assert status == 200 and out["worker"]["dp_size"] == MAX_DP_SIZE
        finally:
            await w.stop()

    run(body)


# ------------------------------------------------------------------ a worker that replaces a removed one
def _reuse_id_of(monkeypatch, old: Any, new_url: str) -> None:
    """Make health.py see the worker at `new_url` under `old`'s id, as CPython does when it allocates the new
    Worker where the removed one was (it often does: same size, freed just before)."""
    real_id = id
    monkeypatch.setattr(health, "id", lambda o: real_id(old) if getattr(o, "url", None) == new_url else real_id(o), raising=False)


def test_worker_added_after_a_removed_one_has_its_dp_size_read(monkeypatch):
    async def body():
        a = await StandIn({"enable_dp_attention": False}).start()
        b = await StandIn({"enable_dp_attention": True, "dp_size": 2}).start()
        try:
            async with cluster(1, 1, auth=ADMIN_AUTH) as c:
                assert (await c.post("/workers", {"url": a.url, "role": "decode"}, headers=ADMIN))[0] == 200
                _reuse_id_of(monkeypatch, c.lb.pool.get("decode", a.url), b.url)
                async with c.http.delete(c.url + "/workers", params={"url": a.url}, headers=ADMIN) as r:
                    assert r.status == 200
                status, _, out = await c.post("/workers", {"url": b.url, "role": "decode"}, headers=ADMIN)
                assert status == 200 and out["worker"]["dp_size"] == 2, out
                _, listing = await c.get("/workers")
                assert [w["dp_size"] for w in listing["workers"] if w["url"] == b.url] == [2]
        finally:
            await a.stop()
            await b.stop()

    run(body)


def test_worker_added_while_a_removed_ones_probe_hangs_is_probed(monkeypatch):
    async def body():
        a, b = await StandIn().start(), await StandIn().start()
        try:
            async with cluster(1, 1, auth=ADMIN_AUTH) as c:
                assert (await c.post("/workers", {"url": a.url, "role": "decode"}, headers=ADMIN))[0] == 200
                old = c.lb.pool.get("decode", a.url)
                a.hang_health = True
                c.lb.health.probe_round()  # a's health probe now waits (up to its 25 s timeout)
                await asyncio.sleep(0.1)
                _reuse_id_of(monkeypatch, old, b.url)
                async with c.http.delete(c.url + "/workers", params={"url": a.url}, headers=ADMIN) as r:
                    assert r.status == 200
                assert (await c.post("/workers", {"url": b.url, "role": "decode"}, headers=ADMIN))[0] == 200
                hits = b.health_hits
                c.lb.health.probe_round()
                await asyncio.sleep(0.2)
                assert b.health_hits == hits + 1  # probed, not taken for a's probe still in flight
        finally:
            await a.stop()
            await b.stop()

    run(body)
