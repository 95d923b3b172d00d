"""A stand-in for an SGLang server (or an LB in front of one) on 127.0.0.1, for CPU tests of the e2e client code.

    python fake_sglang.py --port N [--shift NATS] [--delay-pool S] [--corrupt-file PATH]

/generate answers greedily and deterministically from the prompt (so two instances agree token for token),
streams cumulative meta_info like SGLang (with prompt_tokens and a toy cached_tokens), and ``--shift`` adds a logprob offset from the 3rd token on: what
a wrong KV looks like; so does ``--corrupt-file`` while that file exists (the decode's test-only KV fault). /metrics exposes sglang:kv_transfer_latency_ms, one observation of 2 ms per request.
It prints "Memory pool end" like SGLang once it is about to serve (after --delay-pool seconds).
"""
import argparse
import json
import os
import time

from aiohttp import web

STATE = {"n": 0, "heads": set()}


def answer(prompt, n_new, shift):
    seed = sum(prompt) if isinstance(prompt, list) else len(prompt)
    ids = [(seed * 31 + i * 7) % 4000 + 3 for i in range(n_new)]
    lps = [-0.1 * (i % 5) - (shift if i >= 2 else 0.0) for i in range(n_new)]
    return ids, lps


def meta(ids, lps, k, prompt_tokens=0, cached_tokens=0):
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids[:k], lps[:k])],
            "output_top_logprobs": [[[lp, t, None], [lp - 1.0, t + 1, None]] for t, lp in zip(ids[:k], lps[:k])],
            "completion_tokens": k, "finish_reason": {"type": "length"} if k == len(ids) else None}


def make_app(shift, corrupt_file=None, refuse_memory=False):
    async def health(_):
        return web.Response(text="ok")

    async def generate(req):
        body = await req.json()
        prompt = body.get("input_ids", body.get("text"))
        wrong_kv = corrupt_file is not None and os.path.exists(corrupt_file)
        ids, lps = answer(prompt, body["sampling_params"]["max_new_tokens"], shift + (0.5 if wrong_kv else 0.0))
        STATE["n"] += 1
        # a toy prefix cache: the first 16 prompt tokens count as cached once a prompt began with them
        head = tuple(prompt[:16]) if isinstance(prompt, list) else prompt[:16]
        cached = min(16, len(prompt) - 1) if head in STATE["heads"] else 0
        STATE["heads"].add(head)
        info = dict(prompt_tokens=len(prompt), cached_tokens=cached)
        if not body.get("stream"):
            return web.json_response({"text": "x" * len(ids), "meta_info": meta(ids, lps, len(ids), **info)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for k in range(1, len(ids) + 1):
            item = {"text": "x" * k, "meta_info": meta(ids, lps, k, **info)}
            await resp.write(f"data: {json.dumps(item)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(_):
        n = STATE["n"]
        return web.Response(text=f'sglang:kv_transfer_latency_ms_sum{{tp_rank="0"}} {2.0 * n}\n'
                                 f'sglang:kv_transfer_latency_ms_count{{tp_rank="0"}} {float(n)}\n')

    async def memory(req):  # SGLang's release/resume_memory_occupation: the tag list, in order of the calls
        body = await req.json()
        if req.app["refuse_memory"]:
            return web.json_response({"error": "release_memory_occupation should be called only when server is idle."},
                                     status=400)
        STATE.setdefault("memory", []).append((req.path, body.get("tags")))
        return web.json_response({})

    async def memory_calls(_):
        return web.json_response(STATE.get("memory", []))

    app = web.Application()
    app["refuse_memory"] = refuse_memory
    app.router.add_post("/release_memory_occupation", memory)
    app.router.add_post("/resume_memory_occupation", memory)
    app.router.add_get("/memory_calls", memory_calls)
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    app.router.add_get("/metrics", metrics)
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--shift", type=float, default=0.0)
    ap.add_argument("--delay-pool", type=float, default=0.0)
    ap.add_argument("--corrupt-file")
    ap.add_argument("--refuse-memory", action="store_true")
    a = ap.parse_args()
    time.sleep(a.delay_pool)
    print("Memory pool end. (fake)", flush=True)
    web.run_app(make_app(a.shift, a.corrupt_file, a.refuse_memory), host="127.0.0.1", port=a.port, print=None)
