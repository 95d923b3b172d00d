"""PD dispatch of one generation request: pick a pair, send both legs at once, pass the decode answer back.

Per attempt: the prefill and decode requests start concurrently. The client sees nothing until the decode
has produced its first SSE event (streaming) or its whole body; until then a failed leg cancels the other
leg. The request is retried on a new pair with a new room, excluding the worker that failed, only where
that is safe: the connection was refused or reset, the worker answered 503, the decode's first event
is an abort (its KV never arrived: the retry excludes that attempt's prefill, and the decode only where
another can serve), or health checks found a leg's worker stopped (Worker.notify_stalled: its legs are
closed, so a resumed worker aborts them). A 4xx or any other 5xx is the worker's verdict on
this request and is returned as is: a deterministic 500 would fail on every pair. A first-byte timeout is
not retried either (the worker answers its probes, so it may still be working on it). Bounded waits:
`first_byte_timeout` for the prefill answer and the decode's first streamed event, `idle_stream_timeout`
between streamed chunks, and a stopped worker's requests end at once (retried, or a 504 mid-stream).
Once bytes have reached the client they pass through unchanged (except the mini_lb logprob merge when
`return_logprob` is set). A client that disconnects cancels both legs: aiohttp
cancels the handler and closing the upstream responses closes their connections, which SGLang treats as
an abort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable

import aiohttp
import orjson
from aiohttp import web

from . import logprobs, payload, sse
from .admission import Admission
from .bootstrap import build_bodies
from .decision_log import DecisionLog
from .health import record_failure, record_success
from .metrics import Metrics
from .policy import Choice, PairContext, Policy
from .workers import Lease, Worker, WorkerPool

log = logging.getLogger(__name__)

# 503 is SGLang's "not ready / overloaded, try elsewhere"; every other status is the worker's answer
RETRYABLE_STATUS = frozenset({503})
JSON_HEADERS = {"Content-Type": "application/json"}
# A decode answer the logprob merge cannot use comes back with every such request: each cause is logged
# at most once per this many seconds, with a count of the ones not logged.
UNMERGED_LOG_INTERVAL = 60.0
UNENCODABLE = f"the merged answer cannot be encoded: nested deeper than the {payload.MAX_NESTING} levels orjson writes"


@dataclass(frozen=True)
class ProxyConfig:
    request_timeout: float = 1800.0
    connect_timeout: float = 5.0
    # A 128k-token prompt queued behind others on a busy prefill can take minutes before its first token;
    # 300 s is ~10x that and still bounds a hung scheduler well inside request_timeout.
    first_byte_timeout: float = 300.0
    # Between two streamed chunks; a decode that retracts requests under KV pressure pauses for a while.
    idle_stream_timeout: float = 120.0
    body_timeout: float = 60.0  # the whole request body; a request counts in flight only once it is read
    max_retries: int = 2
    max_concurrent: int = 4096
    queue_size: int = 100  # requests waiting for a slot beyond max_concurrent (then 429)
    queue_timeout: float = 60.0  # longest wait for a slot (then 503)
    passive_failure_threshold: int = 3
    poll_max_age: float = 10.0
    channel_ttl: float = 600.0
    dp_fields: bool = True


@dataclass
class LegFailure:
    """Why an attempt failed before anything reached the client; `status`/`body` echo the upstream answer."""

    side: str
    worker: Worker
    reason: str
    status: int | None = None
    body: bytes = b""
    content_type: str = "application/json"
    retryable: bool = False
    code: int = 502  # status of the LB's own answer when there is no upstream body to pass on
    worker_fault: bool = False  # counts against the worker's circuit breaker (transport error, timeout, 5xx)
    # the decode aborted before its first token: its KV never came, which is the pair's prefill (or the transfer)
    # failing more often than the decode, so the retry leaves out that prefill first (`_dispatch`)
    kv_missing: bool = False


def safe_to_retry(e: BaseException) -> bool:
    """Refused or reset connections: the request never ran or its worker is gone. Timeouts are not."""
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return False
    return isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError))


def _status_failure(side: str, w: Worker, status: int, raw: bytes, content_type: str) -> LegFailure:
    return LegFailure(side, w, f"status {status}: {raw[:300]!r}", status, raw, content_type, retryable=status in RETRYABLE_STATUS, worker_fault=status >= 500)


def _transport_failure(side: str, w: Worker, e: BaseException) -> LegFailure:
    timeout = isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError))
    return LegFailure(side, w, f"{type(e).__name__}: {e}", retryable=safe_to_retry(e), code=504 if timeout else 502, worker_fault=True)


def error_response(status: int, message: str, kind: str | None = None) -> web.Response:
    """Errors in SGLang's shape, {"error": {"message", "type", "code"}}."""
    kind = kind or ("BadRequestError" if status < 500 else "ServiceUnavailableError" if status == 503 else "BadGatewayError")
    return web.Response(status=status, body=orjson.dumps({"error": {"message": message, "type": kind, "code": status}}), headers=JSON_HEADERS)


def _is_abort_event(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    if "error" in obj:
        return True
    fr = (obj.get("meta_info") or {}).get("finish_reason") if isinstance(obj.get("meta_info"), dict) else None
    return isinstance(fr, dict) and fr.get("type") == "abort"


def _abort_status(obj: Any) -> int:
    """The status an abort event carries (SGLang puts it in finish_reason.status_code), 500 if none."""
    fr = (obj.get("meta_info") or {}).get("finish_reason") if isinstance(obj.get("meta_info"), dict) else None
    code = fr.get("status_code") if isinstance(fr, dict) else (obj.get("error") or {}).get("code") if isinstance(obj.get("error"), dict) else None
    return code if isinstance(code, int) else 500


def leg_outcome(task: asyncio.Task) -> bool | None:
    """What a finished leg says about its worker, for the circuit breaker: True, False, or None (nothing:
    cancelled because the other leg failed, or the request's own fault)."""
    if task.cancelled() or task.exception() is not None:
        return None
    out = task.result()
    if isinstance(out, LegFailure):
        return False if out.worker_fault else None
    return True


def parse_prefill_answer(raw: bytes) -> Any:
    """A prefill answer as JSON: a plain body, or for a stream the last event per batch index."""
    raw = raw.strip()
    if not raw.startswith(b"data:"):
        return orjson.loads(raw) if raw else None
    events, _ = sse.split_events(raw + sse.EVENT_SEP)
    by_index: dict[int, Any] = {}
    for ev in events:
        obj = sse.event_payload(ev)
        if isinstance(obj, dict):
            by_index[obj.get("index", 0)] = obj
    if not by_index:
        return None
    return by_index[0] if list(by_index) == [0] else [by_index[i] for i in sorted(by_index)]


class Dispatcher:
    def __init__(self, pool: WorkerPool, policy: Policy, session: aiohttp.ClientSession, cfg: ProxyConfig, metrics: Metrics,
                 decisions: DecisionLog | None = None) -> None:
        self.pool, self.policy, self.session, self.cfg, self.metrics = pool, policy, session, cfg, metrics
        self.decisions = decisions  # --decision-log: every choice and what the policy saw
        self.inflight = 0
        self.admission = Admission(cfg.max_concurrent, cfg.queue_size, cfg.queue_timeout)
        self._background: set[asyncio.Task] = set()
        self._unmerged_log: dict[str, tuple[float, int]] = {}  # cause -> (when last logged, not logged since)

    # ------------------------------------------------------------------ entry point
    async def handle(self, route: str, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            parsed = await self._read_body(route, request)
            if isinstance(parsed, web.Response):
                return self._done(route, t0, parsed)
            # only a fully read, valid request takes a slot: slow senders cannot starve real requests
            refused = await self.admission.acquire()
            if refused is not None:
                self.metrics.rejected.labels(refused.reason).inc()
                resp = error_response(refused.status, refused.message, "TooManyRequestsError" if refused.status == 429 else None)
                resp.headers["Retry-After"] = str(refused.retry_after)
                return self._done(route, t0, resp)
            self.inflight += 1
            self.metrics.inflight.inc()
            try:
                resp = await self._dispatch(route, request, *parsed, t0)
            finally:
                self.inflight -= 1
                self.metrics.inflight.dec()
                self.admission.release()
            return self._done(route, t0, resp)
        except asyncio.CancelledError:
            self.metrics.disconnects.inc()
            self.metrics.requests.labels(route, "499").inc()
            raise

    async def _read_body(self, route: str, request: web.Request) -> tuple | web.Response:
        """(body, stream, tokens, batch, prompt key) of a valid request, or the 4xx answer."""
        try:
            async with asyncio.timeout(self.cfg.body_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            self.metrics.rejected.labels("too_large").inc()
            return error_response(413, f"request body too large: {e.text}")
        except TimeoutError:
            self.metrics.rejected.labels("body_timeout").inc()
            resp = error_response(408, f"request body not received within {self.cfg.body_timeout:g}s", "RequestTimeoutError")
            resp.force_close()  # the rest of the body never comes: do not linger for it
            return resp
        try:
            body = payload.parse_json_object(raw)
            payload.check_fields(route, body)
            stream = payload.is_stream(body)
            tokens = payload.prompt_tokens(route, body)
            batch = payload.generate_batch_size(body) if route == payload.GENERATE else None
            key = payload.prompt_key(route, body)
        except payload.BadRequest as e:
            self.metrics.rejected.labels("bad_request").inc()
            return error_response(400, str(e))
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # a shape the validators missed is still the client's malformed body, never the LB's 500
            log.warning("unexpected body shape on /%s: %s: %s", route, type(e).__name__, e)
            self.metrics.rejected.labels("bad_request").inc()
            return error_response(400, f"malformed request body: {type(e).__name__}: {e}")
        return body, stream, tokens, batch, key

    def _done(self, route: str, t0: float, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(route, str(resp.status)).inc()
        self.metrics.duration.labels(route).observe(time.perf_counter() - t0)
        return resp

    def choose(self, exclude_p: set[str], exclude_d: set[str], tokens: int = 0, key: bytes = b"") -> Choice | str:
        ps = self.pool.routable("prefill", exclude_p) or self._last_resort("prefill", exclude_p)
        ds = self.pool.routable("decode", exclude_d) or self._last_resort("decode", exclude_d)
        if not ps or not ds:
            missing = "prefill" if not ps else "decode"
            total = len(self.pool.all(missing))  # type: ignore[arg-type]
            return f"no healthy {missing} worker available ({total} registered, {len(exclude_p if not ps else exclude_d)} failed for this request)"
        ctx = PairContext(frozenset(self.pool.live_channels(self.cfg.channel_ttl)), self.cfg.poll_max_age, tokens=tokens, prompt=key)
        choice = self.policy.choose(ps, ds, ctx)
        if self.decisions is not None:
            self.decisions.record(choice, ps, ds, ctx)
        return choice

    def _last_resort(self, role: str, exclude: set[str]) -> list[Worker]:
        """No worker of a role is routable (all ejected, removed or with an open circuit): try the ejected
        ones rather than refuse (a restarted server serves before health checks re-admit it; a dead one
        refuses the connection at once and the request moves on). A worker that already failed this
        request stays out."""
        # not a stalled one (its liveness probe times out): that one would hold the request until a timeout
        ws = [w for w in self.pool.all(role) if w.url not in exclude and w.consecutive_timeouts == 0]  # type: ignore[arg-type]
        if ws:
            self.metrics.last_resort.labels(role).inc()
        return ws

    async def _dispatch(self, route, request, body, stream, tokens, batch, key, t0) -> web.StreamResponse:
        exclude_p: set[str] = set()
        exclude_d: set[str] = set()
        # decodes whose KV never came: left out where another decode can serve, kept where none other can
        # (3P1D's one decode would otherwise leave no pair for the retry)
        avoid_d: set[str] = set()
        last: LegFailure | None = None
        for attempt in range(self.cfg.max_retries + 1):
            choice = self.choose(exclude_p, exclude_d | avoid_d, tokens, key)
            if isinstance(choice, str) and avoid_d:
                choice = self.choose(exclude_p, exclude_d, tokens, key)
            if isinstance(choice, str):
                if last is not None:
                    break
                self.metrics.rejected.labels("no_worker").inc()
                return error_response(503, choice)
            final = attempt == self.cfg.max_retries
            out = await self._attempt(route, request, body, stream, tokens, batch, choice, t0)
            if not isinstance(out, LegFailure):
                return out
            last = out
            self.metrics.upstream_errors.labels(out.side, str(out.status or "transport")).inc()
            log.warning("attempt %d: %s leg on %s failed: %s", attempt + 1, out.side, out.worker.url, out.reason)
            if not out.retryable:
                break
            if out.kv_missing:
                exclude_p.add(choice.prefill.url)
                avoid_d.add(out.worker.url)
            else:
                (exclude_p if out.side == "prefill" else exclude_d).add(out.worker.url)
            if not final:
                self.metrics.retries.labels(out.side).inc()
        assert last is not None
        return self._failure_response(last)

    def _failure_response(self, f: LegFailure) -> web.Response:
        if f.status is not None and f.body:
            # the upstream's own answer (what mini_lb would have returned), status and body unchanged
            return web.Response(status=f.status, body=f.body, headers={"Content-Type": f.content_type})
        return error_response(f.code if f.status is None else f.status, f"{f.side} worker {f.worker.url} failed: {f.reason}")

    # ------------------------------------------------------------------ one attempt
    async def _attempt(self, route, request, body, stream, tokens, batch, choice: Choice, t0: float):
        p, d = choice.prefill, choice.decode
        p_body, d_body, rooms = build_bodies(body, choice, batch, self.cfg.dp_fields)
        p_data = orjson.dumps(p_body)
        d_data = p_data if d_body is p_body else orjson.dumps(d_body)
        p_rank = choice.prefill_rank if choice.prefill_rank is not None else rooms[0] % p.dp_size
        lease = Lease(p, d, p_rank, choice.decode_rank or 0, tokens, batch or 1, choice.prefill_tokens)
        self.pool.note_channel(p, d)
        want_prefill_body = payload.wants_logprobs(route, body)
        p_task = asyncio.create_task(self._prefill_leg(route, p, p_data, lease, want_prefill_body))
        d_task = asyncio.create_task(self._decode_open(route, d, d_data, stream))
        for w, task in ((p, p_task), (d, d_task)):
            # exactly one outcome per leg, even for a task cancelled before it ran
            ticket = w.breaker.begin()
            task.add_done_callback(lambda t, w=w, ticket=ticket: w.breaker.end(ticket, leg_outcome(t)))
        loop = asyncio.get_running_loop()
        stalled: asyncio.Future = loop.create_future()

        def on_stall(w: Worker, why: str) -> None:
            # a prefill that has answered handed its KV over: its stall no longer concerns this request
            if not stalled.done() and not (w is p and p_task.done()):
                stalled.set_result((w, why))

        p.stall_watchers.add(on_stall)
        d.stall_watchers.add(on_stall)
        opened: _Opened | None = None
        try:
            first_byte = await self._first_byte(p_task, d_task, stalled, stream, p, d)
            if first_byte is not None:
                return first_byte
            d_out = d_task.result()
            if isinstance(d_out, LegFailure):
                return d_out
            opened = d_out
            p.stall_watchers.discard(on_stall)  # the decode has its KV; the prefill no longer matters
            if stream:
                return await self._stream(route, request, p_task, opened.resp, opened.first, lease, want_prefill_body, t0)
            data = await self._merge_logprobs(p_task, opened.first, lease) if want_prefill_body else opened.first
            self.metrics.ttfb.labels(route).observe(time.perf_counter() - t0)
            return web.Response(status=opened.resp.status, body=data, headers={"Content-Type": opened.resp.headers.get("Content-Type", "application/json")})
        finally:
            p.stall_watchers.discard(on_stall)
            d.stall_watchers.discard(on_stall)
            if not d_task.done():
                d_task.cancel()
            elif opened is None and not d_task.cancelled() and isinstance(d_task.result(), _Opened):
                d_task.result().resp.close()
            if opened is not None:
                opened.resp.release()
            lease.release_decode()
            if not p_task.done():
                if opened is not None:
                    self._keep(p_task)  # the decode got its KV, so the prefill is finishing on its own
                else:
                    p_task.cancel()

    async def _first_byte(self, p_task, d_task, stalled, stream: bool, p: Worker, d: Worker) -> LegFailure | None:
        """Wait until the decode leg has its first event (stream) or body; a LegFailure ends the attempt.

        Bounded by first_byte_timeout for the prefill's answer and, when streaming, the decode's first
        event (a non-streamed decode answers only when it has generated everything: request_timeout).
        """
        loop = asyncio.get_running_loop()
        deadline: float | None = loop.time() + self.cfg.first_byte_timeout
        pending = {p_task, d_task}
        while d_task in pending:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(pending | {stalled}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if stalled in done:
                w, why = stalled.result()
                w.breaker.record_failure()
                # nothing reached the client and both legs are closed next: another pair can serve it
                return LegFailure(w.role, w, f"worker stopped answering ({why})", code=504, retryable=True)
            if p_task in done and isinstance(p_task.result(), LegFailure):
                return p_task.result()  # fail fast: the decode would wait for KV that never comes
            if not done:
                late = p if p_task in pending else d if stream else None
                if late is None:
                    deadline = None  # prefill answered; a non-streamed decode is bounded by request_timeout
                    continue
                self._note_failure(late, f"no answer within --first-byte-timeout-secs {self.cfg.first_byte_timeout:g}")
                late.breaker.record_failure()  # its leg is cancelled next, which by itself counts as nothing
                return LegFailure(late.role, late, f"no {'answer' if late is p else 'first token'} within {self.cfg.first_byte_timeout:g}s (first-byte timeout)", code=504)
        return None

    def _keep(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefill_leg(self, route: str, w: Worker, data: bytes, lease: Lease, want_body: bool) -> bytes | LegFailure:
        t = time.perf_counter()
        try:
            async with self.session.post(f"{w.url}/{route}", data=data, headers=JSON_HEADERS) as r:
                raw = await r.read()
                if r.status != 200:
                    return _status_failure("prefill", w, r.status, raw, r.headers.get("Content-Type", "application/json"))
                if not raw.startswith(b"data:") or (ev := sse.event_payload(raw.split(sse.EVENT_SEP, 1)[0])) is None or not _is_abort_event(ev):
                    w.observe_latency((time.perf_counter() - t) * 1000.0 / max(1, lease.tokens))
                    record_success(w, 1 << 30)
                    return raw if want_body else b""
                return LegFailure("prefill", w, f"prefill aborted: {raw[:300]!r}", 500, raw, retryable=not 400 <= _abort_status(ev) < 500)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._passive_failure(w, e)
            return _transport_failure("prefill", w, e)
        finally:
            lease.release_prefill()

    async def _decode_open(self, route: str, w: Worker, data: bytes, stream: bool):
        """Open the decode leg; returns its response with the first event (stream) or whole body."""
        try:
            r = await self.session.post(f"{w.url}/{route}", data=data, headers=JSON_HEADERS)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._passive_failure(w, e)
            return _transport_failure("decode", w, e)
        if r.status == 200:
            record_success(w, 1 << 30)  # resets the passive failure count, never re-admits by itself
        try:
            if r.status != 200 or not stream:
                raw = await r.read()
                if r.status != 200:
                    r.release()
                    return _status_failure("decode", w, r.status, raw, r.headers.get("Content-Type", "application/json"))
                return _Opened(r, raw)
            buf = b""
            while sse.EVENT_SEP not in buf:
                chunk = await r.content.readany()
                if not chunk:
                    break
                buf += chunk
            first = buf.split(sse.EVENT_SEP, 1)[0]
            ev = sse.event_payload(first)
            if _is_abort_event(ev):
                rest = await r.read()
                r.release()
                # an abort before the first token means the KV never arrived (a prefill or transfer
                # failure): safe to retry on another pair, unless the worker called it the client's fault
                code = _abort_status(ev)
                return LegFailure("decode", w, f"decode aborted before its first token: {first[:300]!r}", 500, buf + rest, "text/event-stream",
                                  retryable=not 400 <= code < 500, kv_missing=True)
            return _Opened(r, buf)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            r.close()
            self._passive_failure(w, e)
            return _transport_failure("decode", w, e)
        except BaseException:
            r.close()
            raise

    def _passive_failure(self, w: Worker, e: BaseException) -> None:
        # only transport errors count: a 5xx may be the request's fault, a refused connection is not
        if isinstance(e, (aiohttp.ClientConnectionError, OSError)) and not isinstance(e, aiohttp.ServerTimeoutError):
            self._note_failure(w, f"request transport error: {type(e).__name__}: {e}")

    def _note_failure(self, w: Worker, reason: str) -> None:
        if record_failure(w, reason, self.cfg.passive_failure_threshold, self.pool.has_spare(w)):
            self.metrics.ejections.labels(w.role).inc()

    async def _prefill_answer(self, p_task: asyncio.Task, lease: Lease) -> Any:
        try:
            raw = await asyncio.wait_for(asyncio.shield(p_task), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(raw, LegFailure) or not raw:
            return None
        try:
            return parse_prefill_answer(raw)
        except (ValueError, TypeError) as e:  # not JSON, or events whose "index" is a list or of mixed types
            self._unmerged(lease.p, "the prefill answer is unusable", e)
            return None

    # The merge decodes the decode's answer, adds the prefill's input logprobs and encodes it again. When it
    # cannot (not JSON, an odd shape, or nested deeper than orjson writes: it reads 1024 levels but writes
    # 254), the decode's answer is forwarded unchanged rather than answered with a 502: it is the whole
    # generation, status and all, and lacks only the prompt's logprobs, which a client can ask again for;
    # a 502 would throw away tokens the decode already generated (and a stream cannot be given one anyway).
    async def _merge_logprobs(self, p_task: asyncio.Task, data: bytes, lease: Lease) -> bytes:
        pre = await self._prefill_answer(p_task, lease)
        d = lease.d
        if pre is None:
            return data
        try:
            merged = logprobs.merge(pre, orjson.loads(data))
        except orjson.JSONDecodeError as e:
            self._unmerged(d, "the decode answer is not JSON", e)
            return data
        try:
            return orjson.dumps(merged)
        except orjson.JSONEncodeError as e:
            self._unmerged(d, UNENCODABLE, e)
            return data

    def _unmerged(self, w: Worker, cause: str, e: BaseException) -> None:
        """An answer goes out without the prefill's input logprobs: logged once per cause and interval."""
        now = time.monotonic()
        last, skipped = self._unmerged_log.get(cause, (None, 0))
        if last is not None and now - last < UNMERGED_LOG_INTERVAL:
            self._unmerged_log[cause] = (last, skipped + 1)
            return
        self._unmerged_log[cause] = (now, 0)
        more = f"; {skipped} more since it was last logged" if skipped else ""
        log.warning("return_logprob: %s (%s %s); the decode answer is forwarded without the prefill's input logprobs: %s: %s%s",
                    cause, w.role, w.url, type(e).__name__, str(e)[:200], more)

    async def _stream(self, route, request, p_task, d_resp: aiohttp.ClientResponse, first: bytes, lease: Lease, merge: bool, t0: float) -> web.StreamResponse:
        out = web.StreamResponse(status=d_resp.status, headers={"Content-Type": d_resp.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
        why: list[str] = []

        def on_stall(w: Worker, reason: str) -> None:
            why.append(f"worker stopped answering ({reason})")
            d_resp.close()  # wakes the pending read with a connection error

        lease.d.stall_watchers.add(on_stall)
        try:
            await _to_client(out.prepare(request))
            if merge:
                pre = logprobs.prefill_items_by_index(await self._prefill_answer(p_task, lease))
                await self._stream_merged(out, d_resp, first, pre, lease.d)
            else:
                await _to_client(out.write(first))
                self.metrics.ttfb.labels(route).observe(time.perf_counter() - t0)
                async for chunk in self._chunks(d_resp):
                    await _to_client(out.write(chunk))
            await _to_client(out.write_eof())
        except _ClientGone:
            # the client went away while we wrote: a cancellation (handle() counts the disconnect), both legs closed
            raise asyncio.CancelledError from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # the decode died or stalled mid-stream; the status line is gone, so end with an error event
            reason = why[0] if why else f"no data for {self.cfg.idle_stream_timeout:g}s (idle-stream timeout)" if isinstance(e, TimeoutError) else type(e).__name__
            log.warning("decode %s failed mid-stream: %s", lease.d.url, reason)
            self.metrics.upstream_errors.labels("decode", "midstream").inc()
            try:
                await _to_client(out.write(sse.event({"error": {"message": f"decode worker {lease.d.url} failed mid-stream: {reason}", "code": 504 if why or isinstance(e, TimeoutError) else 502}})))
                await _to_client(out.write_eof())
            except _ClientGone:
                raise asyncio.CancelledError from None
        finally:
            lease.d.stall_watchers.discard(on_stall)
            d_resp.close()
        return out

    async def _chunks(self, d_resp: aiohttp.ClientResponse):
        """The decode's streamed bytes as they come; TimeoutError after idle_stream_timeout without any."""
        idle = self.cfg.idle_stream_timeout
        while True:
            async with asyncio.timeout(idle):
                chunk = await d_resp.content.readany()
            if not chunk:
                return
            yield chunk

    async def _stream_merged(self, out: web.StreamResponse, d_resp, first: bytes, pre: dict[int, Any], d: Worker) -> None:
        buf = first
        async for chunk in self._chunks(d_resp):
            buf += chunk
            events, buf = sse.split_events(buf)
            for ev in events:
                await _to_client(out.write(self._merge_event(ev, pre, d)))
        events, rest = sse.split_events(buf)
        for ev in events:
            await _to_client(out.write(self._merge_event(ev, pre, d)))
        if rest:
            await _to_client(out.write(rest))

    def _merge_event(self, ev: bytes, pre: dict[int, Any], d: Worker) -> bytes:
        """One streamed event with the prefill's input logprobs merged in, or as it came (`_merge_logprobs`)."""
        obj = sse.event_payload(ev)
        if not isinstance(obj, dict) or not pre:
            return ev + sse.EVENT_SEP
        try:
            item = pre.get(obj.get("index", 0))
        except TypeError as e:  # an "index" that is a list or an object
            self._unmerged(d, "a decode event's \"index\" is not a number", e)
            return ev + sse.EVENT_SEP
        logprobs.merge_item(item, obj)
        try:
            return sse.event(obj)
        except orjson.JSONEncodeError as e:
            self._unmerged(d, UNENCODABLE, e)
            return ev + sse.EVENT_SEP

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        if self.decisions is not None:
            self.decisions.close()


class _ClientGone(Exception):
    """A write to the client failed: it went away. Not an upstream error, whatever aiohttp raised."""


async def _to_client(write: Awaitable[Any]) -> None:
    """One write of the streamed answer (or its prepare, or its end), a failure to write turned into `_ClientGone`:
    aiohttp raises a write to a closing client connection as ClientConnectionResetError, which is an
    aiohttp.ClientError as well as a ConnectionResetError, so by type alone it reads like the decode leg failing."""
    try:
        await write
    except ConnectionError as e:
        raise _ClientGone from e


@dataclass
class _Opened:
    resp: aiohttp.ClientResponse
    first: bytes
