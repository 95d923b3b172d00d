"""The simulated answers' shapes: SGLang's /generate and the OpenAI routes, whole or as stream chunks."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from sglang_p2p_lb import payload

from .config import SimConfig

TOKEN_TEXT = " tok"


class Replies:
    """Builds the answer objects of one worker; every generated token is TOKEN_TEXT with id 1000 + position."""

    def __init__(self, cfg: SimConfig, cached: dict[str, int]) -> None:
        self.cfg = cfg
        self._cached = cached  # rid -> cached tokens its prefill reported (the worker fills it)

    def _meta(self, rid: str, i: int, prompt: int, step: int, last: bool, in_logprobs: list[Any] | None, body: dict[str, Any]) -> dict[str, Any]:
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

    def chunk(self, route: str, body: dict[str, Any], rid: str, i: int, prompt: int, step: int, last: bool, batch: bool, created: int,
              in_logprobs: list[Any] | None) -> dict[str, Any]:
        """Stream chunk of item `i` after `step` tokens."""
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

    def _usage(self, sizes: list[int], n_out: int) -> dict[str, int]:
        p, c = sum(sizes), n_out * len(sizes)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def usage_chunk(self, route: str, rid: str, sizes: list[int], n_out: int, created: int) -> dict[str, Any]:
        """The OpenAI stream's closing usage chunk (stream_options.include_usage)."""
        obj = "text_completion" if route == payload.COMPLETIONS else "chat.completion.chunk"
        return {"id": rid, "object": obj, "created": created, "model": self.cfg.model, "choices": [], "usage": self._usage(sizes, n_out)}

    def abort_chunk(self, route: str, rid: str, msg: str, created: int) -> dict[str, Any]:
        """The stream chunk of a request that failed after its headers were sent."""
        if route == payload.GENERATE:
            return {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": {"type": "abort", "message": msg, "status_code": 500}}}
        return {"error": {"message": msg, "type": "InternalServerError", "code": 500}}

    def final(self, route: str, body: dict[str, Any], rid: str, sizes: list[int], n_out: int, batch: bool, created: int,
              in_logprobs: list[Any] | None) -> dict[str, Any] | list[dict[str, Any]]:
        """The whole answer of a request that did not stream."""
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


def dumps(obj: Any) -> str:
    """JSON text by orjson, for aiohttp's json_response."""
    return orjson.dumps(obj).decode()


def error(status: int, message: str) -> web.Response:
    """An error answer as SGLang's HTTP server shapes it."""
    # SGLang's HTTP server answers errors as {"error": {"message", "type", "code"}} (ORJSONResponse)
    return web.Response(
        status=status,
        body=orjson.dumps({"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalServerError", "code": status}}),
        content_type="application/json",
    )
