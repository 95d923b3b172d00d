"""The simulated server: its HTTP routes, the prefill's slots and bootstrap server, the decode's pacing."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from sglang_p2p_lb import payload, sse

from .config import SimConfig
from .prompts import max_new_tokens, per_item, prompt_sizes
from .radix import RadixModel
from .replies import Replies, dumps, error
from .rooms import RoomRegistry


@dataclass
class RankState:
    """Load of one DP rank, reported by /get_load and /v1/loads."""

    waiting_reqs: int = 0
    running_reqs: int = 0
    waiting_tokens: int = 0
    used_tokens: int = 0
    slots: asyncio.Semaphore | None = None


@dataclass
class Stats:
    """What the worker saw, for tests: served by /stats, cleared by /admin's reset."""

    requests: int = 0
    by_route: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    missing_bootstrap: int = 0
    bootstrap_failures: int = 0
    dp_mismatch: int = 0
    flushes: int = 0
    prompt_tokens: int = 0  # prefill: prompt tokens prefilled, and how many of them came from the cache
    cached_tokens: int = 0
    health_checks: int = 0
    liveness_checks: int = 0  # answers to /model_info, SGLang's scheduler-free route the LB probes for liveness
    load_polls: int = 0
    rooms: list[int] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    keep_bodies: int = 64


class SimWorker:
    """The simulated server: build with a SimConfig, then `await start()`; `await stop()` ends it."""

    def __init__(self, cfg: SimConfig) -> None:
        if cfg.role not in ("prefill", "decode"):
            raise ValueError("role must be 'prefill' or 'decode'")
        self.cfg = cfg
        self.ranks = [RankState(slots=asyncio.Semaphore(cfg.prefill_concurrency)) for _ in range(cfg.dp_size)]
        self.rooms = RoomRegistry()
        self.radix = RadixModel(cfg.prefix_cache_tokens, cfg.page_tokens)
        self._cached: dict[str, int] = {}  # decode: rid -> cached tokens its prefill reported
        self.replies = Replies(cfg, self._cached)
        self.stats = Stats()
        self.healthy = True
        self.fail_next = 0
        self.fail_status = 500
        self.hang_next = 0
        self.pause_after_first = 0  # decode: stop writing (but keep the stream open) after the first token
        self.health_delay = 0.0
        # /model_info waits: the next answers take these (one each), then every answer model_info_delay (a busy
        # HTTP process, e.g. one parsing a 50 MB body, answers nothing for a while)
        self.model_info_delays: list[float] = []
        self.model_info_delay = 0.0
        self._rr = itertools.count()
        self._ids = itertools.count()
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self._gen_tokens = 0
        self._t0 = time.monotonic()
        self._expire_task: asyncio.Task | None = None
        self.outputs: dict[str, bytearray] = {}

    # ---------------------------------------------------------------- lifecycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        r = app.router
        for route in payload.ROUTES:
            r.add_post("/" + route, self._handler(route))
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/get_load", self.get_load)
        r.add_get("/v1/loads", self.v1_loads)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_get("/stats", self.get_stats)
        r.add_get("/metrics", self.metrics)
        r.add_post("/admin", self.admin)
        return app

    def bootstrap_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/wait_room", self.wait_room)
        app.router.add_get("/health", self.health)
        return app

    async def _serve(self, app: web.Application, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels the handler, as SGLang aborts the request
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.host, port)
        await site.start()
        self._runners.append(runner)
        return runner.addresses[0][1]

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=5))
        self.cfg.port = await self._serve(self.app(), self.cfg.port)
        if self.cfg.role == "prefill":
            self.cfg.bootstrap_port = await self._serve(self.bootstrap_app(), self.cfg.bootstrap_port or 0)
        self._expire_task = asyncio.create_task(self._expire_loop())

    async def stop(self) -> None:
        if self._expire_task:
            self._expire_task.cancel()
        for runner in self._runners:
            await runner.cleanup()
        if self._session:
            await self._session.close()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(30)
            self.rooms.expire()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    # ---------------------------------------------------------------- info routes
    async def health(self, request: web.Request) -> web.Response:
        self.stats.health_checks += 1
        if self.health_delay:  # SGLang's /health waits for scheduler output, up to 20 s in a long prefill
            await asyncio.sleep(self.health_delay)
        return web.Response(status=200 if self.healthy else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        elapsed = max(1e-3, time.monotonic() - self._t0)
        return web.json_response(
            {
                "model_path": self.cfg.model,
                "served_model_name": self.cfg.model,
                "disaggregation_mode": self.cfg.role,
                "disaggregation_bootstrap_port": self.cfg.bootstrap_port,
                "dp_size": self.cfg.dp_size,
                "enable_dp_attention": self.cfg.dp_size > 1,
                "simulated": True,
                "internal_states": [{"last_gen_throughput": self._gen_tokens / elapsed, "avg_spec_accept_length": None}],
            },
            dumps=dumps,
        )

    async def model_info(self, request: web.Request) -> web.Response:
        self.stats.liveness_checks += 1
        delay = self.model_info_delays.pop(0) if self.model_info_delays else self.model_info_delay
        if delay:
            await asyncio.sleep(delay)
        return web.json_response({"model_path": self.cfg.model, "tokenizer_path": self.cfg.model, "is_generation": True})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "sglang", "root": self.cfg.model, "max_model_len": 32768}]}
        )

    def _rank_loads(self) -> list[dict[str, Any]]:
        out = []
        for i, st in enumerate(self.ranks):
            out.append(
                {
                    "dp_rank": i,
                    "num_running_reqs": st.running_reqs,
                    "num_waiting_reqs": st.waiting_reqs,
                    "num_waiting_uncached_tokens": st.waiting_tokens,
                    "num_used_tokens": st.used_tokens,
                    "num_total_tokens": st.used_tokens,
                    "max_total_num_tokens": self.cfg.kv_capacity_tokens,
                    "max_running_requests": self.cfg.max_running_requests,
                    "token_usage": st.used_tokens / self.cfg.kv_capacity_tokens,
                    "gen_throughput": 0.0,
                }
            )
        return out

    async def get_load(self, request: web.Request) -> web.Response:
        self.stats.load_polls += 1
        return web.json_response(
            [
                {"dp_rank": d["dp_rank"], "num_reqs": d["num_running_reqs"] + d["num_waiting_reqs"], "num_waiting_reqs": d["num_waiting_reqs"],
                 "num_tokens": d["num_waiting_uncached_tokens"] + d["num_used_tokens"]}
                for d in self._rank_loads()
            ]
        )

    async def v1_loads(self, request: web.Request) -> web.Response:
        self.stats.load_polls += 1
        return web.json_response({"timestamp": time.time(), "version": "sim", "accelerator": None, "num_accelerators": 1, "loads": self._rank_loads()})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.stats.flushes += 1
        self.radix.flush()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")

    def metrics_text(self) -> str:
        """SGLang's load gauges in Prometheus text, one sample per DP rank: waiting (for a prefill slot, or on a
        decode for the KV) and running (prefilling, or decoding), as the ranks count them for /get_load."""
        lines = []
        for name, attr, what in (("sglang:num_queue_reqs", "waiting_reqs", "waiting"), ("sglang:num_running_reqs", "running_reqs", "running")):
            lines += [f"# HELP {name} The number of {what} requests.", f"# TYPE {name} gauge"]
            lines += [f'{name}{{dp_rank="{i}",model_name="{self.cfg.model}"}} {float(getattr(st, attr))}' for i, st in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    async def get_stats(self, request: web.Request) -> web.Response:
        st = {k: v for k, v in self.stats.__dict__.items()}
        st["ranks"] = self._rank_loads()
        return web.json_response(st, dumps=dumps)

    async def admin(self, request: web.Request) -> web.Response:
        """Fault injection: {"healthy": bool, "fail_next": n, "fail_status": s, "hang_next": n, "pause_after_first": n, "reset": true}."""
        body = await request.json()
        if "healthy" in body:
            self.healthy = bool(body["healthy"])
        self.fail_next = int(body.get("fail_next", self.fail_next))
        self.fail_status = int(body.get("fail_status", self.fail_status))
        self.hang_next = int(body.get("hang_next", self.hang_next))
        self.pause_after_first = int(body.get("pause_after_first", self.pause_after_first))
        if body.get("reset"):
            self.stats = Stats()
        return web.json_response({"ok": True})

    # ---------------------------------------------------------------- bootstrap server (prefill)
    async def wait_room(self, request: web.Request) -> web.Response:
        try:
            room = int(request.query["room"])
            timeout = float(request.query.get("timeout", self.cfg.bootstrap_timeout))
            want_rank = request.query.get("dp_rank")
        except (KeyError, ValueError):
            return web.json_response({"error": "room must be an integer"}, status=400)
        status, rank = await self.rooms.wait(room, timeout)
        if status == "timeout":
            return web.json_response({"error": f"room {room} not transferred within {timeout}s"}, status=408)
        if status != "ok":
            return web.json_response({"error": f"prefill of room {room} failed"}, status=500)
        if want_rank is not None and int(want_rank) != rank:
            return web.json_response({"error": f"room {room} is held by prefill dp rank {rank}, not {want_rank}"}, status=409)
        return web.json_response({"status": "ok", "dp_rank": rank, "cached_tokens": self.rooms.cached(room)})

    # ---------------------------------------------------------------- generation
    def _handler(self, route: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._generate(route, request)

        return handle

    async def _generate(self, route: str, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        self.stats.by_route[route] = self.stats.by_route.get(route, 0) + 1
        try:
            body = payload.parse_json_object(await request.read())
            sizes = prompt_sizes(route, body)
            max_new = max_new_tokens(route, body)
            stream = payload.is_stream(body)
        except payload.BadRequest as e:
            return error(400, str(e))
        if len(self.stats.bodies) < self.stats.keep_bodies:
            self.stats.bodies.append(body)
        n = len(sizes)
        host, port = per_item(body.get("bootstrap_host"), n), per_item(body.get("bootstrap_port"), n)
        rooms = per_item(body.get("bootstrap_room"), n, step=1)
        if any(r is None for r in rooms) or any(h is None for h in host) or (self.cfg.role == "decode" and any(p is None for p in port)):
            self.stats.missing_bootstrap += 1
            return error(400, "bootstrap_host, bootstrap_port and bootstrap_room are required in disaggregation mode")
        if not (len(host) == len(port) == len(rooms) == n):
            return error(400, f"bootstrap fields must have batch length {n}")
        self.stats.rooms.extend(rooms)
        if self.fail_next > 0:
            self.fail_next -= 1
            self.stats.failed += 1
            # like an HTTP-layer error in SGLang, no KV sender is created: the decode is not told
            return error(self.fail_status, "injected failure")
        if self.hang_next > 0:
            self.hang_next -= 1
            await asyncio.sleep(3600)
        routed = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if routed is not None and not (isinstance(routed, int) and 0 <= routed < self.cfg.dp_size):
            return error(400, f"routed_dp_rank {routed!r} out of range for dp_size {self.cfg.dp_size}")
        rid = f"sim-{self.cfg.port}-{next(self._ids)}"
        try:
            if self.cfg.role == "prefill":
                return await self._prefill(route, request, body, rid, sizes, rooms, routed, stream)
            return await self._decode(route, request, body, rid, sizes, max_new, host, port, rooms, routed, stream)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise

    async def _prefill(self, route, request, body, rid, sizes, rooms, routed, stream) -> web.StreamResponse:
        dp = self.cfg.dp_size
        ranks = [r % dp for r in rooms] if routed is None else [routed] * len(rooms)
        if routed is not None and any(r % dp != routed for r in rooms):
            self.stats.dp_mismatch += 1
            for room in rooms:
                self.rooms.finish(room, False, routed)
            return error(400, f"routed_dp_rank {routed} contradicts follow_bootstrap_room (room % {dp})")
        rank = ranks[0]
        st = self.ranks[rank]
        tokens = sum(sizes)
        hashes = self.radix.hashes(route, body)
        waiting = tokens - sum(self.radix.hits(hashes, sizes, rank))  # the estimate at arrival
        hits = [0] * len(sizes)
        ok = False
        st.waiting_reqs += 1
        st.waiting_tokens += waiting
        queued = True
        try:
            async with st.slots:
                st.waiting_reqs -= 1
                st.running_reqs += 1
                queued = False
                hits = self.radix.hits(hashes, sizes, rank)  # what the cache holds when it is scheduled
                try:
                    await asyncio.sleep((self.cfg.prefill_base_ms + (tokens - sum(hits)) * self.cfg.prefill_ms_per_token) / 1000)
                finally:
                    st.running_reqs -= 1
                    st.waiting_tokens -= waiting
                self.radix.insert(hashes, rank)
            if self.cfg.transfer_ms:
                await asyncio.sleep(self.cfg.transfer_ms / 1000)
            ok = True
        finally:
            if queued:  # cancelled while waiting for a slot
                st.waiting_reqs -= 1
                st.waiting_tokens -= waiting
            # a cancelled or failed prefill fails its rooms, so the decode side learns at once
            for room, rk, hit in zip(rooms, ranks, hits):
                self.rooms.finish(room, ok, rk, hit)
        self.stats.completed += 1
        self.stats.prompt_tokens += tokens
        self.stats.cached_tokens += sum(hits)
        logprobs = [[[-1.0, 100 + i, None] for i in range(s)] for s in sizes] if body.get("return_logprob") else None
        return await self._respond(route, request, body, rid, sizes, 1, stream, logprobs, first_token_wait=None)

    async def _decode(self, route, request, body, rid, sizes, max_new, host, port, rooms, routed, stream) -> web.StreamResponse:
        rank = routed if routed is not None else next(self._rr) % self.cfg.dp_size
        want = body.get("disagg_prefill_dp_rank")
        assert self._session is not None

        async def kv_ready() -> str | None:
            async def one(h, p, room) -> str | None:
                url = f"http://{h}:{p}/wait_room"
                q = {"room": str(room), "timeout": str(self.cfg.bootstrap_timeout)}
                if want is not None:
                    q["dp_rank"] = str(want)
                try:
                    async with self._session.get(url, params=q, timeout=aiohttp.ClientTimeout(total=self.cfg.bootstrap_timeout + 5)) as r:
                        if r.status == 200:
                            self._cached[rid] = self._cached.get(rid, 0) + (await r.json()).get("cached_tokens", 0)
                            return None
                        return f"{r.status} {(await r.text())[:200]}"
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    return f"bootstrap server {h}:{p} unreachable: {e!r}"

            errs = await asyncio.gather(*(one(h, p, room) for h, p, room in zip(host, port, rooms)))
            errs = [e for e in errs if e]
            if errs:
                self.stats.bootstrap_failures += 1
                return "Failed to get kvcache from prefill instance, it might be dead: " + errs[0]
            return None

        try:
            return await self._respond(route, request, body, rid, sizes, max_new, stream, None, first_token_wait=kv_ready, rank=rank)
        finally:
            self._cached.pop(rid, None)

    # ---------------------------------------------------------------- writing the answer
    async def _respond(self, route, request, body, rid, sizes, n_out, stream, in_logprobs, first_token_wait, rank: int = 0):
        """Generate `n_out` tokens per item (decode pacing when first_token_wait is set) and write them."""
        n = len(sizes)
        batch = route == payload.GENERATE and payload.generate_batch_size(body) is not None
        created = int(time.time())
        resp: web.StreamResponse | None = None
        rec = self.outputs.setdefault(rid, bytearray()) if self.cfg.record_output else None

        async def write(data: bytes) -> None:
            if rec is not None:
                rec.extend(data)
            await resp.write(data)

        if stream:
            # SGLang's StreamingResponse sends its headers before the first token
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
        if first_token_wait is not None:
            self.ranks[rank].waiting_reqs += n
            try:
                err = await first_token_wait()
            finally:
                self.ranks[rank].waiting_reqs -= n
            if err is not None:
                if resp is None:
                    return error(500, err)
                await write(sse.event(self.replies.abort_chunk(route, rid, err, created)))
                await write(sse.DONE)
                return resp
        st = self.ranks[rank]
        decoding = first_token_wait is not None
        kv = sum(sizes)
        if decoding:
            st.running_reqs += n
            st.used_tokens += kv
        try:
            for step in range(1, n_out + 1):
                if decoding and step == 2 and self.pause_after_first > 0:
                    self.pause_after_first -= 1
                    await asyncio.sleep(3600)
                if decoding and step > 1:
                    slow = 1 + self.cfg.decode_slowdown * max(0, st.running_reqs - 1)
                    await asyncio.sleep(self.cfg.decode_ms_per_token * slow / 1000)
                    st.used_tokens += n
                    kv += n
                self._gen_tokens += n
                if resp is not None:
                    last = step == n_out
                    for i in range(n):
                        await write(sse.event(self.replies.chunk(route, body, rid, i, sizes[i], step, last, batch, created, in_logprobs)))
        finally:
            if decoding:
                st.running_reqs -= n
                st.used_tokens -= kv
        if resp is not None:
            if n_out == 0:
                for i in range(n):
                    await write(sse.event(self.replies.chunk(route, body, rid, i, sizes[i], 0, True, batch, created, in_logprobs)))
            if route != payload.GENERATE and (body.get("stream_options") or {}).get("include_usage"):
                await write(sse.event(self.replies.usage_chunk(route, rid, sizes, n_out, created)))
            await write(sse.DONE)
            await resp.write_eof()
            self.stats.completed += decoding
            return resp
        self.stats.completed += decoding
        data = orjson.dumps(self.replies.final(route, body, rid, sizes, n_out, batch, created, in_logprobs))
        if rec is not None:
            rec.extend(data)
        return web.Response(body=data, content_type="application/json")
