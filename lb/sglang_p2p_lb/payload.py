"""Request-body inspection shared by the LB and the simulator: validation, batch size, prompt size.

Kept free of I/O so it is unit-testable; the LB turns a `BadRequest` into a 400 with its reason.
"""

from __future__ import annotations

from typing import Any

import orjson

# SGLang routes that carry a generation request and so go through PD dispatch.
GENERATE = "generate"
COMPLETIONS = "v1/completions"
CHAT = "v1/chat/completions"
ROUTES = (GENERATE, COMPLETIONS, CHAT)

# A real tokenizer is not available to the LB; ~4 UTF-8 bytes per token is the usual rule of
# thumb for BPE vocabularies on English text and code, close enough to rank prefill queues.
BYTES_PER_TOKEN = 4
# Chat templates add a few tokens per message (role markers); the exact number is model specific.
CHAT_TOKENS_PER_MESSAGE = 4


class BadRequest(ValueError):
    """A client error: the message is returned to the client as the 4xx reason."""


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def generate_batch_size(body: dict[str, Any]) -> int | None:
    """Batch size of a native `/generate` body, None for a single request (mini_lb's rule).

    Raises BadRequest when the body has no usable prompt field or a malformed one.
    """
    text = body.get("text")
    if text is not None:
        if isinstance(text, str):
            return None
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return len(text)
        raise BadRequest("'text' must be a string or a non-empty list of strings")
    ids = body.get("input_ids")
    if ids is not None:
        if _is_int_list(ids) and ids:
            return None
        if isinstance(ids, list) and ids and all(_is_int_list(x) and x for x in ids):
            return len(ids)
        raise BadRequest("'input_ids' must be a non-empty list of ints or a non-empty list of such lists")
    if body.get("input_embeds") is not None:
        emb = body["input_embeds"]
        # input_embeds is [seq][hidden] for one request, [batch][seq][hidden] for a batch
        if isinstance(emb, list) and emb and isinstance(emb[0], list) and emb[0] and isinstance(emb[0][0], list):
            return len(emb)
        return None
    raise BadRequest("a /generate body needs 'text', 'input_ids' or 'input_embeds'")


def _text_tokens(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


def chat_texts(messages: Any) -> list[str]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    texts = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("each message must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        elif content is not None:
            raise BadRequest("message 'content' must be a string or a list of parts")
    return texts


def prompt_tokens(route: str, body: dict[str, Any]) -> int:
    """Estimated prompt tokens of a request (summed over a batch); validates the prompt field."""
    if route == GENERATE:
        generate_batch_size(body)
        text = body.get("text")
        if text is not None:
            return sum(_text_tokens(t) for t in ([text] if isinstance(text, str) else text))
        ids = body.get("input_ids")
        if ids is not None:
            return len(ids) if _is_int_list(ids) else sum(len(x) for x in ids)
        emb = body["input_embeds"]
        return len(emb) if generate_batch_size(body) is None else sum(len(x) for x in emb)
    if route == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return _text_tokens(prompt)
        if _is_int_list(prompt) and prompt:
            return len(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return sum(_text_tokens(p) for p in prompt)
        if isinstance(prompt, list) and prompt and all(_is_int_list(p) and p for p in prompt):
            return sum(len(p) for p in prompt)
        raise BadRequest("'prompt' must be a string, a list of strings, or token ids")
    if route == CHAT:
        texts = chat_texts(body.get("messages"))
        return sum(_text_tokens(t) if t else 0 for t in texts) + CHAT_TOKENS_PER_MESSAGE * len(body["messages"])
    raise BadRequest(f"unknown route {route!r}")


def is_stream(body: dict[str, Any]) -> bool:
    """True when the client asked for a streamed response; rejects non-boolean values."""
    s = body.get("stream", False)
    if not isinstance(s, bool):
        raise BadRequest("'stream' must be a boolean")
    return s


def wants_logprobs(route: str, body: dict[str, Any]) -> bool:
    """mini_lb merges prefill input logprobs into the decode answer when `return_logprob` is set."""
    return route == GENERATE and bool(body.get("return_logprob", False))
