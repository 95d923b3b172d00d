"""Poll the workers' own load endpoints: SGLang 0.5.23's `/v1/loads`, falling back to the legacy `/get_load`.

Only the part of a polled load that this LB did not dispatch is used (see Worker.prefill_load), so a
poll never double-counts our own in-flight requests and a stale poll never hides them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from .workers import Worker, WorkerPool

log = logging.getLogger(__name__)

V1_LOADS = "/v1/loads?include=core"
LEGACY = "/get_load"


Parsed = tuple[list[float], list[float], float, "tuple[float, float] | None"]


def parse_v1_loads(doc: Any) -> Parsed | None:
    """(queued prompt tokens, requests, KV usage) per rank from a `/v1/loads` answer, and the KV demand in
    tokens with the pool's capacity, summed over ranks (`num_total_tokens`: the KV in use plus what requests
    queued for pages will take, so a decode whose prealloc queue is long reads as over-full, which its
    `token_usage` never says), or None where the answer lacks them."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    loads = sorted((x for x in loads if isinstance(x, dict)), key=lambda x: x.get("dp_rank", 0))
    tokens = [float(x.get("num_waiting_uncached_tokens", 0) or 0) for x in loads]
    reqs = [float((x.get("num_running_reqs", 0) or 0) + (x.get("num_waiting_reqs", 0) or 0)) for x in loads]
    usage = [float(x.get("token_usage", 0.0) or 0.0) for x in loads]
    capacity = sum(float(x.get("max_total_num_tokens", 0) or 0) for x in loads)
    kv = None
    if capacity > 0 and all("num_total_tokens" in x for x in loads):
        kv = (sum(float(x.get("num_total_tokens", 0) or 0) for x in loads), capacity)
    return tokens, reqs, sum(usage) / len(usage), kv


def parse_legacy_load(doc: Any) -> Parsed | None:
    """Same from the older `/get_load` list (`num_reqs`, `num_tokens` per rank; no KV demand)."""
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list) or not doc or not all(isinstance(x, dict) for x in doc):
        return None
    doc = sorted(doc, key=lambda x: x.get("dp_rank", 0))
    return [float(x.get("num_tokens", 0) or 0) for x in doc], [float(x.get("num_reqs", 0) or 0) for x in doc], 0.0, None


class LoadPoller:
    def __init__(self, pool: WorkerPool, session: aiohttp.ClientSession, interval: float, timeout: float = 2.0) -> None:
        self.pool, self.session, self.interval, self.timeout = pool, session, interval, timeout
        self._legacy: set[str] = set()

    async def _get(self, w: Worker, path: str) -> tuple[int, Any]:
        async with self.session.get(w.url + path, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
            return r.status, (await r.json(content_type=None) if r.status == 200 else None)

    async def poll(self, w: Worker) -> bool:
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
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False
        w.note_answer()  # whatever it said, it answered: not stopped (health.py counts on this)
        if parsed is None:
            return False
        w.record_poll(*parsed)
        return True

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.pool if w.healthy))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_all()
            except Exception:
                log.exception("load poll round failed")
