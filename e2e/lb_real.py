"""Our LB in front of 2 prefill + 2 decode real SGLang servers on one GPU: policies, workloads, then faults.

    python3 -m e2e.lb_real --models DIR --out FILE --logs DIR [--duration S] [--policies a,b,...]
    (bash e2e/run_all.sh --gpus 1 --phase lb runs it with the bundle, environment and time budget set up)

Four ``llama-tiny`` servers share GPU 0 (KV pools capped so they fit), p2pnccl over real NCCL: each server
names a host of its own (NCCL_HOSTID, sglang_p2p_backend.testing.launch.one_gpu_env), so NCCL moves pages
through its socket transport on loopback (e2e/config.py says why). The radix cache stays on. For each policy
(load_aware, prefix_aware, random, round_robin) a fresh LB runs two open-loop workloads against cold caches
(every server's /flush_cache first): a bursty mixed one (skewed prompt lengths, 3x bursts) and a shared-prefix
one (multi-turn chats over a few long few-shot prompts). Per run: TTFT p50/p99, E2E p99, output tok/s, the
cache hit rate (sum of meta_info.cached_tokens over prompt_tokens of the answers) and errors. Then, under
the bursty load through a prefix_aware LB, a prefill and a decode get SIGKILL mid-run; the client errors are
counted, both are restarted, and the LB must take them back (healthy again and selected for new requests).
Writes one JSON (``--out``). The workload generators and the summary are pure and tested on CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from . import client, config
from .servers import Server, Stack, exit_on_sigterm, failure_report
from .stats import RequestRecord, percentile, summarize_run

MODEL = "llama-tiny"
BASE_PORT = 33000  # prefills 33000-33001 (bootstrap +10), decodes 33002-33003, LBs from 33020
POLICIES = ("load_aware", "prefix_aware", "random", "round_robin")
# four servers on one GPU: each pool capped (config.py explains SGLang's sizing); radix cache on
FLAGS = [*config.BASE_FLAGS, "--mem-fraction-static", "0.2", "--max-total-tokens", "131072", "--random-seed", "0"]
VOCAB_LOW, VOCAB_HIGH = 3, 4000  # token ids below 3 are the tiny tokenizer's special tokens


@dataclass(frozen=True)
class Req:
    at: float  # seconds after the start of the run
    input_ids: list[int]
    max_new_tokens: int


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def bursty_mixed(duration: float, rate: float, seed: int = 0, short_median: int = 300, long_min: int = 2000,
                 long_max: int = 6000, output_max: int = 64) -> list[Req]:
    """Poisson arrivals, 3x rate for the last quarter of every 4 s; 85% short prompts (lognormal, median 300),
    15% long (uniform 2k-6k); each asks for output_max / 4 to output_max tokens (16-64)."""
    rng = random.Random(seed)
    calm = rate / (0.75 + 3 * 0.25)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(calm * (3.0 if (t % 4.0) >= 3.0 else 1.0))
        if t >= duration:
            return out
        n = rng.randint(long_min, long_max) if rng.random() < 0.15 else max(8, int(rng.lognormvariate(math.log(short_median), 0.6)))
        out.append(Req(t, _ids(rng, n), rng.randint(max(1, output_max // 4), output_max)))


def shared_prefix(duration: float, conversations_per_s: float, seed: int = 0, n_prefixes: int = 6, prefix_len: int = 2000,
                  turns: int = 4, question: int = 100, answer: int = 50, gap: float = 2.0, output: int = 32) -> list[Req]:
    """Multi-turn chats over a few long few-shot prefixes (weights 1/(k+1)); each turn resends the history and
    asks for `output` tokens."""
    rng = random.Random(seed)
    prefixes = [_ids(random.Random(seed * 1000 + k), prefix_len) for k in range(n_prefixes)]
    weights = [1.0 / (k + 1) for k in range(n_prefixes)]
    out: list[Req] = []
    t = 0.0
    while True:
        t += rng.expovariate(conversations_per_s)
        if t >= duration:
            return sorted(out, key=lambda r: r.at)
        history = list(prefixes[rng.choices(range(n_prefixes), weights)[0]])
        for k in range(turns):
            if t + k * gap >= duration:
                break
            history += _ids(rng, question)
            out.append(Req(t + k * gap, list(history), output))
            history += _ids(rng, answer)


@dataclass(frozen=True)
class Answer:
    """One request as the client saw it."""

    record: RequestRecord
    prompt_tokens: int
    cached_tokens: int
    sent_at: float  # seconds after the start of the run


def summarize(answers: Sequence[Answer], wall_s: float) -> dict[str, Any]:
    """e2e.stats' figures plus E2E p99 and the cache hit rate (cached / prompt tokens of the good answers)."""
    recs = [a.record for a in answers]
    good = [a for a in answers if a.record.ok]
    e2e = [a.record.e2e_s for a in good if a.record.e2e_s is not None]
    prompt = sum(a.prompt_tokens for a in good)
    p99 = percentile(e2e, 99)
    return {
        **summarize_run(recs, wall_s),
        "e2e_ms_p99": None if p99 is None else round(p99 * 1e3, 3),
        "prompt_tokens": prompt,
        "cached_tokens": sum(a.cached_tokens for a in good),
        "cache_hit_rate": round(sum(a.cached_tokens for a in good) / prompt, 4) if prompt else None,
    }


def _abort_of(item: dict[str, Any]) -> Optional[str]:
    if "error" in item:
        return json.dumps(item["error"])[:200]
    fr = (item.get("meta_info") or {}).get("finish_reason")
    return json.dumps(fr)[:200] if isinstance(fr, dict) and fr.get("type") == "abort" else None


async def one(session: Any, url: str, req: Req, t_start: float) -> Answer:
    body = client.generate_payload(req.input_ids, req.max_new_tokens, logprobs=False, stream=True)
    t0 = time.perf_counter()
    sent = t0 - t_start
    ttft, last, err = None, {}, ""
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                err = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for item in client._sse_items(resp):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    err = _abort_of(item) or err
                    last = item
    except Exception as e:  # a failed request is a data point, not the end of the run
        err = f"{type(e).__name__}: {e}"[:200]
    meta = last.get("meta_info") or {}
    ok = not err and bool(meta)
    rec = RequestRecord(ok=ok, ttft_s=ttft if ok else None, e2e_s=time.perf_counter() - t0,
                        output_tokens=int(meta.get("completion_tokens") or 0) if ok else 0, error=err or ("" if ok else "empty answer"))
    return Answer(rec, int(meta.get("prompt_tokens") or len(req.input_ids)), int(meta.get("cached_tokens") or 0), sent)


async def open_loop(url: str, reqs: Sequence[Req], timeout_s: float = 120.0) -> tuple[list[Answer], float]:
    """Send each request at its time whatever the others do; returns the answers and the wall time."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t0 = time.perf_counter()

        async def fire(r: Req) -> Answer:
            await asyncio.sleep(max(0.0, r.at - (time.perf_counter() - t0)))
            return await one(s, url, r, t0)

        answers = await asyncio.gather(*(fire(r) for r in reqs))
        return list(answers), time.perf_counter() - t0


# ----------------------------------------------------------------------------- servers
def servers(models: Path) -> tuple[list[Server], list[Server]]:
    model = models / MODEL
    prefills, decodes = [], []
    for i in range(2):
        name = f"lb-prefill{i}"
        env = {**config.COMMON_ENV, "SGLANG_P2P_TRANSPORT": "nccl", **_one_gpu_env(name)}
        prefills.append(Server(name, BASE_PORT + i, "prefill", model, gpu=0, backend="p2pnccl", bootstrap_port=BASE_PORT + 10 + i, args=list(FLAGS), env=env))
    for i in range(2):
        name = f"lb-decode{i}"
        env = {**config.COMMON_ENV, "SGLANG_P2P_TRANSPORT": "nccl", **_one_gpu_env(name)}
        decodes.append(Server(name, BASE_PORT + 2 + i, "decode", model, gpu=0, backend="p2pnccl", args=list(FLAGS), env=env))
    return prefills, decodes


def _one_gpu_env(name: str) -> dict[str, str]:
    from sglang_p2p_backend.testing.launch import one_gpu_env  # an NCCL_HOSTID of its own per process

    return one_gpu_env(name)


def lb_server(policy: str, port: int, prefills: Sequence[Server], decodes: Sequence[Server], admin_key: str) -> Server:
    """Our LB over every pair: Server's LB command names the first prefill and decode, the rest go in args."""
    extra = ["--policy", policy, "--admin-api-key", admin_key]
    for p in prefills[1:]:
        extra += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes[1:]:
        extra += ["--decode", d.url]
    return Server(f"lb-{policy}", port, "lb", lb_prefill=prefills[0], lb_decode=decodes[0], args=extra)


def _get_json(url: str, headers: Optional[dict] = None) -> Any:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def flush_all(workers: Sequence[Server]) -> None:
    for w in workers:
        try:
            urllib.request.urlopen(urllib.request.Request(w.url + "/flush_cache", method="POST"), timeout=30).read()
        except Exception:
            pass  # a server still busy refuses; the run notes the cache state in its hit rate


class LB:
    """One of our LB processes, started through the Stack so it is always stopped."""

    def __init__(self, stack: Stack, policy: str, port: int, prefills, decodes, admin_key: str) -> None:
        self.server = lb_server(policy, port, prefills, decodes, admin_key)
        self.stack, self.url, self.admin = stack, f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {admin_key}"}

    def __enter__(self) -> "LB":
        if not self.stack.launch_lb(self.server):
            raise RuntimeError(f"LB did not come up: {self.server.log_tail()}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server.alive():
            os.killpg(self.server.proc.pid, signal.SIGTERM)
            self.server.proc.wait(20)

    def workers(self) -> list[dict[str, Any]]:
        return _get_json(self.url + "/workers", self.admin)["workers"]


def run_policies(stack: Stack, prefills, decodes, policies: Sequence[str], duration: float, admin_key: str, seed: int) -> dict:
    loads = {"bursty_mixed": bursty_mixed(duration, 16.0, seed), "shared_prefix": shared_prefix(duration, 3.0, seed)}
    out: dict[str, Any] = {"workloads": {k: {"requests": len(v), "duration_s": duration} for k, v in loads.items()}}
    for k, policy in enumerate(policies):
        res: dict[str, Any] = {}
        with LB(stack, policy, BASE_PORT + 20 + k, prefills, decodes, admin_key) as lb:
            for name, reqs in loads.items():
                flush_all(prefills + decodes)
                answers, wall = asyncio.run(open_loop(lb.url, reqs))
                res[name] = summarize(answers, wall)
                print(f"[lb_real] {policy} {name}: {res[name]}", flush=True)
        out[policy] = res
    return out


def run_faults(stack: Stack, prefills, decodes, duration: float, admin_key: str, seed: int, restart_timeout: float) -> dict:
    """SIGKILL prefill 0 at 1/3 and decode 0 at 2/3 of a bursty run; restart both; the LB must take them back."""
    reqs = bursty_mixed(duration, 16.0, seed + 1)
    victims = [(duration / 3, prefills[0]), (2 * duration / 3, decodes[0])]
    with LB(stack, "prefix_aware", BASE_PORT + 29, prefills, decodes, admin_key) as lb:
        async def killer() -> list[float]:
            t0, at = time.perf_counter(), []
            for when, s in victims:
                await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
                os.killpg(s.proc.pid, signal.SIGKILL)
                at.append(round(time.perf_counter() - t0, 2))
            return at

        async def both():
            return await asyncio.gather(open_loop(lb.url, reqs), killer())

        (answers, wall), killed_at = asyncio.run(both())
        errors = [a for a in answers if not a.record.ok]
        # restart both (the Stack keeps them for the final stop) and wait for the LB to re-admit them
        for _, s in victims:
            stack.servers.remove(s)
        up = stack.launch([s for _, s in victims], timeout_s=restart_timeout)
        deadline = time.monotonic() + 60
        back = {}
        while time.monotonic() < deadline:
            back = {w["url"]: w["healthy"] for w in lb.workers()}
            if all(back.get(s.url) for _, s in victims):
                break
            time.sleep(1.0)
        before = {w["url"]: w["selected"] for w in lb.workers()}
        after_answers, _ = asyncio.run(open_loop(lb.url, bursty_mixed(5.0, 8.0, seed + 2)))
        after = {w["url"]: w["selected"] for w in lb.workers()}
        return {
            "killed": [{"server": s.name, "at_s": t} for (_, s), t in zip(victims, killed_at)],
            "run": summarize(answers, wall),
            "client_errors": len(errors),
            "errors_by_time": [round(a.sent_at, 2) for a in errors][:50],
            "restarted": [s.name for s in up],
            "taken_back": {s.name: bool(back.get(s.url)) for _, s in victims},
            "selected_after_restart": {s.name: after.get(s.url, 0) - before.get(s.url, 0) for _, s in victims},
            "after_restart": summarize(after_answers, 5.0),
        }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--logs", type=Path, required=True)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of each workload run (8 runs + the fault run)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-faults", action="store_true")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    admin_key = os.urandom(16).hex()
    prefills, decodes = servers(args.models)
    doc: dict[str, Any] = {"model": MODEL, "flags": FLAGS, "transport": "p2pnccl over NCCL, socket transport on loopback (one GPU, NCCL_HOSTID per server)",
                           "servers": "2 prefill + 2 decode on GPU 0", "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.monotonic()
    with Stack(args.logs) as stack:
        up = stack.launch(prefills + decodes, lanes=config.CHECK_LANES_1GPU)
        doc["launch_s"] = round(time.monotonic() - t0, 1)
        if len(up) < 4:
            doc["error"] = failure_report(prefills + decodes)
        else:
            doc["policies"] = run_policies(stack, prefills, decodes, args.policies.split(","), args.duration, admin_key, args.seed)
            if not args.skip_faults:
                doc["faults"] = run_faults(stack, prefills, decodes, args.duration, admin_key, args.seed, restart_timeout=180)
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"[lb_real] wrote {args.out}", flush=True)
    return 0 if "error" not in doc and all(k in doc for k in ("policies",)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
