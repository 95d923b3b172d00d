"""How the simulator reads a request: prompt tokens by its counting rule (the package docstring states it),
max new tokens, and the bootstrap fields per batch item.
"""

from __future__ import annotations

from typing import Any

from sglang_p2p_lb import payload

CHAT_TOKENS_PER_MESSAGE = 4


def count_text_tokens(text: str) -> int:
    """Tokens of a text: one per whitespace-separated word, at least one."""
    return max(1, len(text.split()))


def prompt_sizes(route: str, body: dict[str, Any]) -> list[int]:
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


def token_seqs(route: str, body: dict[str, Any]) -> list[list[Any]]:
    """Per-item prompt tokens by the simulator's counting rule (words, ids, 4 role tokens per message)."""
    def words(t: str) -> list[Any]:
        return t.split() or [""]

    if route == payload.GENERATE:
        n = payload.generate_batch_size(body)
        if body.get("text") is not None:
            return [words(t) for t in ([body["text"]] if n is None else body["text"])]
        if body.get("input_ids") is not None:
            return [list(x) for x in ([body["input_ids"]] if n is None else body["input_ids"])]
        return [[0] * s for s in prompt_sizes(route, body)]  # embeddings: no reuse modelled
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


def max_new_tokens(route: str, body: dict[str, Any]) -> int:
    """Tokens to generate per item (SGLang's default 16); raises payload.BadRequest when not a count."""
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


def per_item(v: Any, n: int, step: int = 0) -> list[Any]:
    """A bootstrap field as a per-item list; a scalar room expands to room + i as SGLang's io_struct does."""
    if isinstance(v, list):
        return list(v)
    if step and isinstance(v, int):
        return [v + i for i in range(n)]
    return [v] * n
