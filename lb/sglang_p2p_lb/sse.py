"""Server-sent-events framing as SGLang writes it: `data: <json>\\n\\n`, ending with `data: [DONE]\\n\\n`."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
EVENT_SEP = b"\n\n"


def event(obj: Any) -> bytes:
    """One SSE event carrying `obj` as compact JSON (the bytes SGLang's servers emit)."""
    return b"data: " + orjson.dumps(obj) + EVENT_SEP


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Split a byte buffer into complete events (each without its trailing blank line) and the rest."""
    parts = buf.split(EVENT_SEP)
    return parts[:-1], parts[-1]


def event_payload(ev: bytes) -> Any | None:
    """The JSON object of one `data: {...}` event, None for `[DONE]`, comments or non-JSON data."""
    ev = ev.strip()
    if not ev.startswith(b"data:"):
        return None
    data = ev[5:].strip()
    if data == b"[DONE]" or not data:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
