"""HTTP client side of the check: SGLang ``/generate`` (streaming and not) and a closed-loop load generator.

SGLang reports output logprobs as ``[logprob, token_id, text]`` triples in ``meta_info.output_token_logprobs``
and the top-k per position in ``meta_info.output_top_logprobs``. A streamed answer may carry them cumulatively
(every chunk repeats what came before) or per chunk; ``merge_stream_items`` accepts both.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any, Optional, Sequence

from .compare import Generation
from .stats import RequestRecord


def generation_from_meta(meta: dict[str, Any], text: str = "") -> Generation:
    toks = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    return Generation(
        output_ids=[int(t[1]) for t in toks],
        logprobs=[None if t[0] is None else float(t[0]) for t in toks],
        top_logprobs=[{int(e[1]): float(e[0]) for e in (pos or []) if e[0] is not None} for pos in tops],
        text=text,
        finish_reason=meta.get("finish_reason"),
        completion_tokens=meta.get("completion_tokens"),
    )


def merge_stream_items(items: Sequence[dict[str, Any]]) -> Generation:
    """One Generation from the streamed chunks of one request (cumulative or incremental logprob lists)."""
    if not items:
        return Generation([], [])
    last = items[-1]
    meta = last.get("meta_info", {})
    want = meta.get("completion_tokens")
    if want is None or len(meta.get("output_token_logprobs") or []) == want:
        return generation_from_meta(meta, last.get("text", ""))
    merged: dict[str, list] = {"output_token_logprobs": [], "output_top_logprobs": []}
    for it in items:
        m = it.get("meta_info", {})
        for k in merged:
            merged[k].extend(m.get(k) or [])
    return generation_from_meta({**meta, **merged}, "".join(it.get("text", "") for it in items))


def generate_payload(prompt: Any, max_new_tokens: int, *, logprobs: bool, stream: bool,
                     top_k: int = 5) -> dict[str, Any]:
    """``prompt`` is a list of token ids or a string."""
    body: dict[str, Any] = {
        "input_ids" if isinstance(prompt, list) else "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": stream,
    }
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=top_k)
    return body


async def _sse_items(resp: Any) -> Any:
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def generate(session: Any, base_url: str, body: dict[str, Any]) -> tuple[Generation, Optional[float], float]:
    """Send one /generate; returns (answer, seconds to the first streamed token or None, seconds in all)."""
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    async with session.post(base_url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        if not body.get("stream"):
            doc = await resp.json()
            return generation_from_meta(doc.get("meta_info", {}), doc.get("text", "")), None, time.perf_counter() - t0
        items = []
        async for item in _sse_items(resp):
            if ttft is None:
                ttft = time.perf_counter() - t0
            items.append(item)
    return merge_stream_items(items), ttft, time.perf_counter() - t0


def random_prompts(n: int, length: int, seed: int, vocab: int = 4096, low: int = 3) -> list[list[int]]:
    """Distinct random token-id prompts (ids below ``low`` are the tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(n)]


async def closed_loop(base_url: str, prompts: Sequence[list[int]], concurrency: int, max_new_tokens: int,
                      timeout_s: float = 120.0) -> tuple[list[RequestRecord], float]:
    """Send every prompt streaming with at most ``concurrency`` in flight; returns the records and wall time."""
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[RequestRecord] = []

    async def worker(session: Any) -> None:
        while not queue.empty():
            p = queue.get_nowait()
            body = generate_payload(p, max_new_tokens, logprobs=False, stream=True)
            t0 = time.perf_counter()
            try:
                gen, ttft, e2e = await generate(session, base_url, body)
                # without return_logprob there is no per-token list: the final chunk's count is the figure
                records.append(RequestRecord(ok=True, ttft_s=ttft, e2e_s=e2e,
                                             output_tokens=gen.completion_tokens or len(gen.output_ids)))
            except Exception as e:  # one failed request is a data point, not the end of the run
                records.append(RequestRecord(ok=False, ttft_s=None, e2e_s=time.perf_counter() - t0,
                                             output_tokens=0, error=f"{type(e).__name__}: {e}"[:200]))

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return records, time.perf_counter() - t0
