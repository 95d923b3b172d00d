"""Request-body inspection shared by the LB and the simulator: validation, batch size, prompt size.

Kept free of I/O so it is unit-testable; the LB turns a `BadRequest` into a 400 with its reason.
"""

from __future__ import annotations

from array import array
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


# orjson reads JSON nested up to 1024 levels but writes at most 254, and the LB re-encodes every body it
# forwards: anything deeper is refused when read, the client's 400 rather than the LB's 500 at dispatch.
MAX_NESTING = 254


class BadRequest(ValueError):
    """A client error: the message is returned to the client as the 4xx reason."""


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object, nested at most MAX_NESTING levels."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    # fewer opening brackets than the limit cannot nest beyond it: most bodies skip the trial encoding
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING:
        try:
            orjson.dumps(body)
        except orjson.JSONEncodeError as e:
            raise BadRequest(f"request body is nested too deeply: at most {MAX_NESTING} levels of arrays and objects ({e})") from None
    return body


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _is_matrix(x: Any) -> bool:
    """A non-empty list of non-empty lists of numbers (one request's input_embeds)."""
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(r, list) and r and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r) for r in x)
    )


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
        if _is_matrix(emb):
            return None
        if isinstance(emb, list) and emb and all(_is_matrix(x) for x in emb):
            return len(emb)
        raise BadRequest("'input_embeds' must be a non-empty [seq][hidden] list of numbers, or a list of such for a batch")
    raise BadRequest("a /generate body needs 'text', 'input_ids' or 'input_embeds'")


def _text_tokens(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


def chat_texts(messages: Any) -> list[str]:
    """The text of every message and text part, in order; names the offending field on a wrong type."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    texts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise BadRequest(f"'messages[{i}].content[{j}]' must be an object")
                text = part.get("text")
                if text is not None and not isinstance(text, str):
                    raise BadRequest(f"'messages[{i}].content[{j}].text' must be a string")
                if text:
                    texts.append(text)
        elif content is not None:
            raise BadRequest(f"'messages[{i}].content' must be a string or a list of parts")
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


# Fields the LB reads or that every route shares, with the types SGLang accepts. Checked up front so a
# wrong type is the client's 400 naming the field, never a TypeError (a 500) inside the LB.
_NUMBER = (int, float)
_COMMON_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "stream": ((bool,), "a boolean"),
    "return_logprob": ((bool, list), "a boolean (or a list of booleans for a batch)"),
    "model": ((str,), "a string"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "n": ((int,), "an integer"),
    "temperature": (_NUMBER, "a number"),
    "top_p": (_NUMBER, "a number"),
    "stream_options": ((dict,), "an object"),
    "rid": ((str, list), "a string or a list of strings"),
}


def _type_ok(v: Any, types: tuple[type, ...]) -> bool:
    # bool is an int in Python but not in JSON schemas: True is no max_tokens
    return isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


def check_fields(route: str, body: dict[str, Any]) -> None:
    """Raise BadRequest naming the first field of a known name with a wrong type (null means absent)."""
    for name, (types, what) in _COMMON_FIELDS.items():
        v = body.get(name)
        if v is not None and not _type_ok(v, types):
            raise BadRequest(f"'{name}' must be {what}, got {type(v).__name__}")
    so = body.get("stream_options")
    if isinstance(so, dict) and so.get("include_usage") is not None and not isinstance(so["include_usage"], bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean")
    sp = body.get("sampling_params")
    if sp is None:
        return
    items = sp if isinstance(sp, list) and route == GENERATE else [sp]
    for k, item in enumerate(items):
        where = "sampling_params" if items is not sp else f"sampling_params[{k}]"
        if not isinstance(item, dict):
            raise BadRequest(f"'{where}' must be an object")
        for name in ("max_new_tokens", "min_new_tokens", "n"):
            v = item.get(name)
            if v is not None and not _type_ok(v, (int,)):
                raise BadRequest(f"'{where}.{name}' must be an integer, got {type(v).__name__}")
        for name in ("temperature", "top_p", "top_k"):
            v = item.get(name)
            if v is not None and not _type_ok(v, _NUMBER):
                raise BadRequest(f"'{where}.{name}' must be a number, got {type(v).__name__}")


def is_stream(body: dict[str, Any]) -> bool:
    """True when the client asked for a streamed response; rejects non-boolean values."""
    s = body.get("stream", False)
    if not isinstance(s, bool):
        raise BadRequest("'stream' must be a boolean")
    return s


def prompt_key(route: str, body: dict[str, Any]) -> bytes:
    """The prompt as bytes for prefix matching: UTF-8 text, or 4 bytes per token id (first item of a batch).

    Only prefixes are compared, so any stable encoding works; a chat is its messages' roles and texts in
    order, which is what the chat template puts first. Call after validation (prompt_tokens).
    """
    if route == GENERATE:
        text, ids = body.get("text"), body.get("input_ids")
        if text is not None:
            return (text if isinstance(text, str) else text[0]).encode()
        if ids is not None:
            first = ids if _is_int_list(ids) else ids[0]
            return array("I", (i & 0xFFFFFFFF for i in first)).tobytes()
        return b""
    if route == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt.encode()
        first = prompt if _is_int_list(prompt) else prompt[0]
        return first.encode() if isinstance(first, str) else array("I", (i & 0xFFFFFFFF for i in first)).tobytes()
    parts = []
    for m in body["messages"]:
        content = m.get("content")
        text = content if isinstance(content, str) else "".join(p.get("text") or "" for p in content or [])
        parts.append(f"<{m['role']}>{text}")
    return "".join(parts).encode()


def wants_logprobs(route: str, body: dict[str, Any]) -> bool:
    """mini_lb merges prefill input logprobs into the decode answer when `return_logprob` is set."""
    return route == GENERATE and bool(body.get("return_logprob", False))
