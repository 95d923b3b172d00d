"""Poll the workers' own load endpoints: SGLang 0.5.23's `/v1/loads`, falling back to the legacy `/get_load`.

Only the part of a polled load that this LB did not dispatch is used (see Worker.prefill_load), so a
poll never double-counts our own in-flight requests and a stale poll never hides them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson

from .workers import Worker, WorkerPool

log = logging.getLogger(__name__)

V1_LOADS = "/v1/loads?include=core"
LEGACY = "/get_load"


Parsed = tuple[list[float], list[float], float, "tuple[float, float] | None"]

#: largest count (tokens, requests) taken from a worker: 2^53, beyond which a float no longer counts in ones
MAX_COUNT = float(2**53)
#: largest KV use fraction taken from a worker (over 1: more asked for than the pool holds)
MAX_USAGE = 100.0


class BadLoad(ValueError):
    """A load answer the LB cannot use; the message names the field."""


def _number(x: dict, key: str, limit: float) -> float:
    """Field `key` of one rank's entry as a float in [0, limit]; absent or null is 0."""
    v = x.get(key)
    if v is None:
        return 0.0
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= limit:
        raise BadLoad(f"{key} {v!r} is not a number in [0, {limit:g}]")
    return float(v)


def _by_rank(entries: Any, what: str) -> list[dict]:
    """A non-empty list of one object per DP rank, ordered by its `dp_rank` (absent: its position). Ranks
    must be 0..n-1 each once: a worker that says otherwise cannot be matched to our ranks."""
    if not isinstance(entries, list) or not entries:
        raise BadLoad(f"{what} is not a non-empty list")
    ranks = []
    for i, x in enumerate(entries):
        if not isinstance(x, dict):
            raise BadLoad(f"{what}[{i}] is not an object")
        r = x.get("dp_rank", i)
        if not isinstance(r, int) or isinstance(r, bool):
            raise BadLoad(f"{what}[{i}].dp_rank {r!r} is not an integer")
        ranks.append(r)
    if sorted(ranks) != list(range(len(entries))):
        raise BadLoad(f"{what} dp_rank values {sorted(ranks)[:8]} are not 0..{len(entries) - 1}, each once")
    return [x for _, x in sorted(zip(ranks, entries), key=lambda t: t[0])]


def parse_v1_loads(doc: Any) -> Parsed:
    """(queued prompt tokens, requests, KV usage) per rank from a `/v1/loads` answer, and the KV demand in
    tokens with the pool's capacity, summed over ranks (`num_total_tokens`: the KV in use plus what requests
    queued for pages will take, so a decode whose prealloc queue is long reads as over-full, which its
    `token_usage` never says). BadLoad where a field has the wrong type or is out of range."""
    loads = _by_rank(doc.get("loads") if isinstance(doc, dict) else None, "loads")
    tokens = [_number(x, "num_waiting_uncached_tokens", MAX_COUNT) for x in loads]
    reqs = [_number(x, "num_running_reqs", MAX_COUNT) + _number(x, "num_waiting_reqs", MAX_COUNT) for x in loads]
    usage = [_number(x, "token_usage", MAX_USAGE) for x in loads]
    capacity = sum(_number(x, "max_total_num_tokens", MAX_COUNT) for x in loads)
    demand = sum(_number(x, "num_total_tokens", MAX_COUNT) for x in loads)
    kv = (demand, capacity) if capacity > 0 and all("num_total_tokens" in x for x in loads) else None
    return tokens, reqs, sum(usage) / len(usage), kv


def parse_legacy_load(doc: Any) -> Parsed:
    """Same from the older `/get_load` list (`num_reqs`, `num_tokens` per rank; no KV demand)."""
    doc = _by_rank([doc] if isinstance(doc, dict) else doc, "get_load")
    return [_number(x, "num_tokens", MAX_COUNT) for x in doc], [_number(x, "num_reqs", MAX_COUNT) for x in doc], 0.0, None


class LoadPoller:
    def __init__(self, pool: WorkerPool, session: aiohttp.ClientSession, interval: float, timeout: float = 2.0) -> None:
        self.pool, self.session, self.interval, self.timeout = pool, session, interval, timeout
        self._legacy: set[str] = set()

    async def _get(self, w: Worker, path: str) -> tuple[int, Any]:
        async with self.session.get(w.url + path, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
            # orjson, not r.json(): the json module raises RecursionError on deeply nested answers
            return r.status, (orjson.loads(await r.read()) if r.status == 200 else None)

    async def poll(self, w: Worker) -> bool:
        """One poll of w; True when it gave a load sample. Never raises on what the worker answers."""
        try:
            if w.url not in self._legacy:
                status, doc = await self._get(w, V1_LOADS)
                if status == 404:
                    self._legacy.add(w.url)
                else:
                    parsed = parse_v1_loads(doc) if status == 200 else None
            if w.url in self._legacy:
                status, doc = await self._get(w, LEGACY)
                parsed = parse_legacy_load(doc) if status == 200 else None
        except (BadLoad, orjson.JSONDecodeError) as e:
            w.note_answer()
            self._bad_answer(w, f"{type(e).__name__}: {e}")
            return False
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False
        w.note_answer()  # whatever it said, it answered: not stopped (health.py counts on this)
        if parsed is None:
            return False
        if w.load_error:
            w.load_error = ""
            log.info("%s worker %s answers its load endpoint usably again", w.role, w.url)
        w.record_poll(*parsed)
        return True

    def _bad_answer(self, w: Worker, reason: str) -> None:
        """No load sample from w; said once when its answers turn bad, not at every poll (every second)."""
        if not w.load_error:
            log.warning("%s worker %s: unusable load answer, its polled load is not used until it answers well: %s", w.role, w.url, reason[:300])
        w.load_error = reason

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.pool if w.healthy))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_all()
            except Exception:
                log.exception("load poll round failed")
