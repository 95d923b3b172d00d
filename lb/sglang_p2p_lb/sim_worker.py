"""Simulated SGLang PD worker. It STANDS IN FOR GPU SERVERS in the LB's tests and benchmarks; it runs no model.

One process plays one SGLang server in prefill or decode disaggregation mode and serves the HTTP surface
a router touches: `/generate` (text or input_ids, single or batch, streamed or not), `/v1/completions`,
`/v1/chat/completions` (OpenAI shapes, streaming with usage), `/v1/models`, `/health`, `/health_generate`,
`/get_server_info`, `/get_model_info`, `/get_load` (legacy list) and `/v1/loads` (SGLang 0.5.23 shape),
`/flush_cache`, plus `/stats` and `POST /admin` (fault injection) for tests.

Timing model (the knobs are command-line flags):
* prefill: each DP rank is a FIFO with `--prefill-concurrency` slots; a request holds a slot for
  `prefill_base_ms + prompt_tokens * prefill_ms_per_token` (compute bound, so a long prompt delays the
  requests queued behind it), then its KV is "transferred" (`transfer_ms`) and the prefill answers with
  one generated token, as SGLang's prefill does.
* decode: needs `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (400 otherwise) and does what a real
  decode does with them: it asks the prefill's bootstrap server for the room. The prefill worker runs that
  bootstrap server on `--bootstrap-port` with one route, `GET /wait_room?room=R[&dp_rank=K]`, a long poll
  that answers 200 once the prefill with that room has transferred its KV, 500 when that prefill failed or
  was cancelled, 409 when `dp_rank` is not the rank holding the room, 408 after `--bootstrap-timeout`.
  Then it emits `max_new_tokens` tokens, one every `decode_ms_per_token * (1 + decode_slowdown *
  (running - 1))` ms, so decode speed falls with the requests running on that DP rank.
* DP attention (`--dp-size N`): the prefill rank is `routed_dp_rank` when given, else `bootstrap_room % N`
  (SGLang's `follow_bootstrap_room`); a `routed_dp_rank` that contradicts the room fails the request with
  400, as SGLang 0.5.23 does. A decode rank is `routed_dp_rank` when given, else round robin.

Radix cache (`--prefix-cache-tokens N`, off by default): each prefill DP rank models SGLang's radix cache
as an LRU prefix tree of `--page-tokens` pages (prefix_tree.py) holding at most N tokens. When a request
gets its slot, the pages of its prompt already cached are skipped (prefill time counts only the uncached
tokens, at least one), and its pages are inserted after the prefill. The prefill reports
`num_waiting_uncached_tokens` accordingly, counts `prompt_tokens` / `cached_tokens` in `/stats`, and the
decode's answer carries the prefill's `meta_info.cached_tokens` (passed through the bootstrap server).

Token counting (deterministic, documented so tests can compute it): `input_ids` count one token per id;
text counts one token per whitespace-separated word (at least 1); a chat request counts its message texts
plus 4 tokens per message. Every generated token is the text " tok" with id 1000 + position.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from . import payload, sse
from .prefix_tree import PrefixTree, block_hashes

MODEL = "sim-model"
TOKEN_TEXT = " tok"
CHAT_TOKENS_PER_MESSAGE = 4


@dataclass
class SimConfig:
    role: str = "prefill"
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int | None = None
    dp_size: int = 1
    prefill_base_ms: float = 2.0
    prefill_ms_per_token: float = 0.05
    prefill_concurrency: int = 1
    transfer_ms: float = 0.0
    decode_ms_per_token: float = 10.0
    decode_slowdown: float = 0.01
    kv_capacity_tokens: int = 1_000_000
    max_running_requests: int = 4096
    bootstrap_timeout: float = 30.0
    prefix_cache_tokens: int = 0  # radix cache capacity per prefill DP rank; 0: no cache
    page_tokens: int = 16
    model: str = MODEL
    record_output: bool = False  # keep the exact bytes of each answer (tests compare pass-through)


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
    load_polls: int = 0
    rooms: list[int] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    keep_bodies: int = 64


class RoomRegistry:
    """Prefill-side record of KV transfers, read by decodes through the bootstrap server."""

    def __init__(self, ttl: float = 300.0) -> None:
        self._rooms: dict[int, tuple[asyncio.Event, list[Any]]] = {}
        self._ttl = ttl

    def _entry(self, room: int) -> tuple[asyncio.Event, list[Any]]:
        if room not in self._rooms:
            # [status, dp_rank, created, cached tokens]; status None until the prefill ends
            self._rooms[room] = (asyncio.Event(), [None, None, time.monotonic(), 0])
        return self._rooms[room]

    def finish(self, room: int, ok: bool, rank: int, cached: int = 0) -> None:
        ev, st = self._entry(room)
        st[0], st[1], st[3] = ("ok" if ok else "failed"), rank, cached
        ev.set()

    def cached(self, room: int) -> int:
        return self._rooms[room][1][3] if room in self._rooms else 0

    async def wait(self, room: int, timeout: float) -> tuple[str, int | None]:
        ev, st = self._entry(room)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            return "timeout", None
        return st[0], st[1]

    def expire(self) -> None:
        cutoff = time.monotonic() - self._ttl
        for room in [r for r, (_, st) in self._rooms.items() if st[2] < cutoff]:
            del self._rooms[room]


def count_text_tokens(text: str) -> int:
    return max(1, len(text.split()))


def _prompt_sizes(route: str, body: dict[str, Any]) -> list[int]:
    """Per-item prompt tokens by the simulator's rule; raises payload.BadRequest on bad input."""
    if route == payload.GENERATE:
        n = payload.generate_batch_size(body)
        if body.get("text") is not None:
            texts = [body["text"]] if n is None else body["text"]
            return [count_text_tokens(t) for t in texts]
        if body.get("input_ids") is not None:
            return [len(body["input_ids"])] if n is None else [len(x) for x in body["input_ids"]]
        emb = body["input_embeds"]
        return [len(emb)] if n is None else [len(x) for x in emb]
    payload.prompt_tokens(route, body)  # validation only
    if route == payload.COMPLETIONS:
        p = body["prompt"]
        if isinstance(p, str):
            return [count_text_tokens(p)]
        if isinstance(p[0], int):
            return [len(p)]
        return [count_text_tokens(x) if isinstance(x, str) else len(x) for x in p]
    msgs = body["messages"]
    words = sum(count_text_tokens(t) for t in payload.chat_texts(msgs) if t.strip())
    return [words + CHAT_TOKENS_PER_MESSAGE * len(msgs)]


def _token_seqs(route: str, body: dict[str, Any]) -> list[list[Any]]:
    """Per-item prompt tokens by the simulator's counting rule (words, ids, 4 role tokens per message)."""
    def words(t: str) -> list[Any]:
        return t.split() or [""]

    if route == payload.GENERATE:
        n = payload.generate_batch_size(body)
        if body.get("text") is not None:
            return [words(t) for t in ([body["text"]] if n is None else body["text"])]
        if body.get("input_ids") is not None:
            return [list(x) for x in ([body["input_ids"]] if n is None else body["input_ids"])]
        return [[0] * s for s in _prompt_sizes(route, body)]  # embeddings: no reuse modelled
    if route == payload.COMPLETIONS:
        p = body["prompt"]
        items = [p] if isinstance(p, str) or isinstance(p[0], int) else p
        return [words(x) if isinstance(x, str) else list(x) for x in items]
    seq: list[Any] = []
    for m in body["messages"]:
        c = m.get("content")
        text = c if isinstance(c, str) else " ".join(x.get("text") or "" for x in c or [])
        seq += [f"<{m['role']}>"] * CHAT_TOKENS_PER_MESSAGE + (text.split() if text.strip() else [])
    return [seq]


def _max_new_tokens(route: str, body: dict[str, Any]) -> int:
    if route == payload.GENERATE:
        sp = body.get("sampling_params") or {}
        if isinstance(sp, list):
            sp = sp[0] if sp else {}
        n = sp.get("max_new_tokens", 16)
    else:
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise payload.BadRequest("max_new_tokens / max_tokens must be a non-negative integer")
    return n


def _as_list(v: Any, n: int, step: int = 0) -> list[Any]:
    """A bootstrap field as a per-item list; a scalar room expands to room + i as SGLang's io_struct does."""
    if isinstance(v, list):
        return list(v)
    if step and isinstance(v, int):
        return [v + i for i in range(n)]
    return [v] * n


class SimWorker:
    """The simulated server: build with a SimConfig, then `await start()`; `await stop()` ends it."""

    def __init__(self, cfg: SimConfig) -> None:
        if cfg.role not in ("prefill", "decode"):
            raise ValueError("role must be 'prefill' or 'decode'")
        self.cfg = cfg
        self.ranks = [RankState(slots=asyncio.Semaphore(cfg.prefill_concurrency)) for _ in range(cfg.dp_size)]
        self.rooms = RoomRegistry()
        pages = cfg.prefix_cache_tokens // max(1, cfg.page_tokens)
        self.radix = PrefixTree(pages) if pages else None  # one tenant per DP rank
        self._cached: dict[str, int] = {}  # decode: rid -> cached tokens its prefill reported
        self.stats = Stats()
        self.healthy = True
        self.fail_next = 0
        self.fail_status = 500
        self.hang_next = 0
        self.pause_after_first = 0  # decode: stop writing (but keep the stream open) after the first token
        self.health_delay = 0.0
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
            dumps=_dumps,
        )

    async def model_info(self, request: web.Request) -> web.Response:
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
        if self.radix:
            self.radix = PrefixTree(self.radix.max_size)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")

    async def get_stats(self, request: web.Request) -> web.Response:
        st = {k: v for k, v in self.stats.__dict__.items()}
        st["ranks"] = self._rank_loads()
        return web.json_response(st, dumps=_dumps)

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
            sizes = _prompt_sizes(route, body)
            max_new = _max_new_tokens(route, body)
            stream = payload.is_stream(body)
        except payload.BadRequest as e:
            return _error(400, str(e))
        if len(self.stats.bodies) < self.stats.keep_bodies:
            self.stats.bodies.append(body)
        n = len(sizes)
        host, port = _as_list(body.get("bootstrap_host"), n), _as_list(body.get("bootstrap_port"), n)
        rooms = _as_list(body.get("bootstrap_room"), n, step=1)
        if any(r is None for r in rooms) or any(h is None for h in host) or (self.cfg.role == "decode" and any(p is None for p in port)):
            self.stats.missing_bootstrap += 1
            return _error(400, "bootstrap_host, bootstrap_port and bootstrap_room are required in disaggregation mode")
        if not (len(host) == len(port) == len(rooms) == n):
            return _error(400, f"bootstrap fields must have batch length {n}")
        self.stats.rooms.extend(rooms)
        if self.fail_next > 0:
            self.fail_next -= 1
            self.stats.failed += 1
            # like an HTTP-layer error in SGLang, no KV sender is created: the decode is not told
            return _error(self.fail_status, "injected failure")
        if self.hang_next > 0:
            self.hang_next -= 1
            await asyncio.sleep(3600)
        routed = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if routed is not None and not (isinstance(routed, int) and 0 <= routed < self.cfg.dp_size):
            return _error(400, f"routed_dp_rank {routed!r} out of range for dp_size {self.cfg.dp_size}")
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
            return _error(400, f"routed_dp_rank {routed} contradicts follow_bootstrap_room (room % {dp})")
        rank = ranks[0]
        st = self.ranks[rank]
        tokens = sum(sizes)
        hashes = [block_hashes(seq, self.cfg.page_tokens) for seq in _token_seqs(route, body)] if self.radix else []
        waiting = tokens - sum(self._cache_hits(hashes, sizes, rank))  # the estimate at arrival
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
                hits = self._cache_hits(hashes, sizes, rank)  # what the cache holds when it is scheduled
                try:
                    await asyncio.sleep((self.cfg.prefill_base_ms + (tokens - sum(hits)) * self.cfg.prefill_ms_per_token) / 1000)
                finally:
                    st.running_reqs -= 1
                    st.waiting_tokens -= waiting
                for h in hashes:
                    self.radix.insert(h, rank)
                if self.radix:
                    self.radix.evict()
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

    def _cache_hits(self, hashes: list[list[int]], sizes: list[int], rank: int) -> list[int]:
        """Cached tokens per item; at least one token of each prompt is always computed, as in SGLang."""
        if not self.radix:
            return [0] * len(sizes)
        return [min(self.radix.match(h, rank) * self.cfg.page_tokens, max(0, s - 1)) for h, s in zip(hashes, sizes)]

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

    # ---------------------------------------------------------------- output shapes
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
                    return _error(500, err)
                await write(sse.event(self._abort_chunk(route, rid, err, created)))
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
                        await write(sse.event(self._chunk(route, body, rid, i, sizes[i], step, last, batch, created, in_logprobs)))
        finally:
            if decoding:
                st.running_reqs -= n
                st.used_tokens -= kv
        if resp is not None:
            if n_out == 0:
                for i in range(n):
                    await write(sse.event(self._chunk(route, body, rid, i, sizes[i], 0, True, batch, created, in_logprobs)))
            if route != payload.GENERATE and (body.get("stream_options") or {}).get("include_usage"):
                await write(sse.event(self._usage_chunk(route, rid, sizes, n_out, created)))
            await write(sse.DONE)
            await resp.write_eof()
            self.stats.completed += decoding
            return resp
        self.stats.completed += decoding
        data = orjson.dumps(self._final(route, body, rid, sizes, n_out, batch, created, in_logprobs))
        if rec is not None:
            rec.extend(data)
        return web.Response(body=data, content_type="application/json")

    def _meta(self, rid, i, prompt, step, last, in_logprobs, body):
        meta: dict[str, Any] = {
            "id": f"{rid}-{i}" if i else rid,
            "finish_reason": {"type": "length", "length": step} if last else None,
            "prompt_tokens": prompt,
            "completion_tokens": step,
            "cached_tokens": self._cached.get(rid, 0),
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = in_logprobs[i] if in_logprobs else [[-0.25, 7, None]]
            meta["output_token_logprobs"] = [[-0.5, 1000 + k, None] for k in range(step)]
        return meta

    def _chunk(self, route, body, rid, i, prompt, step, last, batch, created, in_logprobs):
        if route == payload.GENERATE:
            out = {"text": TOKEN_TEXT * step, "output_ids": [1000 + k for k in range(step)], "meta_info": self._meta(rid, i, prompt, step, last, in_logprobs, body)}
            if batch:
                out["index"] = i
            return out
        fin = "length" if last else None
        if route == payload.COMPLETIONS:
            choice = {"index": i, "text": TOKEN_TEXT if step else "", "logprobs": None, "finish_reason": fin}
            return {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model, "choices": [choice]}
        delta = {"role": "assistant", "content": TOKEN_TEXT} if step == 1 else {"content": TOKEN_TEXT if step else ""}
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": fin}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model, "choices": [choice]}

    def _usage(self, sizes, n_out):
        p, c = sum(sizes), n_out * len(sizes)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _usage_chunk(self, route, rid, sizes, n_out, created):
        obj = "text_completion" if route == payload.COMPLETIONS else "chat.completion.chunk"
        return {"id": rid, "object": obj, "created": created, "model": self.cfg.model, "choices": [], "usage": self._usage(sizes, n_out)}

    def _abort_chunk(self, route, rid, msg, created):
        if route == payload.GENERATE:
            return {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": {"type": "abort", "message": msg, "status_code": 500}}}
        return {"error": {"message": msg, "type": "InternalServerError", "code": 500}}

    def _final(self, route, body, rid, sizes, n_out, batch, created, in_logprobs):
        if route == payload.GENERATE:
            items = [
                {"text": TOKEN_TEXT * n_out, "output_ids": [1000 + k for k in range(n_out)], "meta_info": self._meta(rid, i, s, n_out, True, in_logprobs, body)}
                for i, s in enumerate(sizes)
            ]
            return items if batch else items[0]
        if route == payload.COMPLETIONS:
            choices = [{"index": i, "text": TOKEN_TEXT * n_out, "logprobs": None, "finish_reason": "length"} for i in range(len(sizes))]
            return {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model, "choices": choices, "usage": self._usage(sizes, n_out)}
        msg = {"role": "assistant", "content": TOKEN_TEXT * n_out}
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": self.cfg.model,
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": "length"}],
            "usage": self._usage(sizes, n_out),
        }


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _error(status: int, message: str) -> web.Response:
    # SGLang's HTTP server answers errors as {"error": {"message", "type", "code"}} (ORJSONResponse)
    return web.Response(
        status=status,
        body=orjson.dumps({"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalServerError", "code": status}}),
        content_type="application/json",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_p2p_lb.sim_worker", description="Simulated SGLang PD worker (stands in for a GPU server).")
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-port", type=int, default=None, help="prefill: port of the simulated bootstrap server (default: any free port)")
    p.add_argument("--dp-size", type=int, default=1, help="DP-attention ranks, each with its own queue")
    p.add_argument("--prefill-base-ms", type=float, default=SimConfig.prefill_base_ms)
    p.add_argument("--prefill-ms-per-token", type=float, default=SimConfig.prefill_ms_per_token)
    p.add_argument("--prefill-concurrency", type=int, default=SimConfig.prefill_concurrency, help="prefill slots per DP rank")
    p.add_argument("--transfer-ms", type=float, default=SimConfig.transfer_ms)
    p.add_argument("--decode-ms-per-token", type=float, default=SimConfig.decode_ms_per_token)
    p.add_argument("--decode-slowdown", type=float, default=SimConfig.decode_slowdown, help="relative slowdown per extra running request")
    p.add_argument("--kv-capacity-tokens", type=int, default=SimConfig.kv_capacity_tokens)
    p.add_argument("--bootstrap-timeout", type=float, default=SimConfig.bootstrap_timeout)
    p.add_argument("--prefix-cache-tokens", type=int, default=SimConfig.prefix_cache_tokens, help="prefill: radix cache capacity per DP rank in tokens (0: no cache)")
    p.add_argument("--page-tokens", type=int, default=SimConfig.page_tokens, help="prefill: radix cache page size")
    p.add_argument("--model", default=MODEL)
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(**{k: v for k, v in vars(args).items() if k in SimConfig.__dataclass_fields__})


async def _run(cfg: SimConfig) -> None:
    worker = SimWorker(cfg)
    await worker.start()
    extra = f" bootstrap {cfg.bootstrap_port}" if cfg.role == "prefill" else ""
    print(f"sim {cfg.role} worker on {worker.url}{extra}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(build_parser().parse_args(argv))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_run(cfg))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
