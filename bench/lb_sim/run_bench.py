"""LB simulation benchmark: this LB's policies against mini_lb (random), sgl-router 0.3.2 and smg 1.13.

Everything runs on 127.0.0.1. The P/D servers are `simworker` processes, which STAND IN FOR
GPU SERVERS (prefill time grows with prompt length, decode speed falls with running requests, decode
waits for the prefill's KV "transfer"). Three scenarios:

* `policies`: a (P3x3)D4-shaped set (3 prefill servers, 1 decode server), skewed prompt lengths and bursty
  arrivals at 80% of the prefill capacity; TTFT p50/p99 and prefill load skew (max over mean of each
  prefill's time-averaged outstanding tokens, sampled from the workers' own /v1/loads every 100 ms).
* `overhead`: zero-latency 1P1D; the latency the LB adds = p50 through the LB minus p50 of a client that
  does the PD dispatch itself (both legs concurrently, same bootstrap fields).
* `throughput`: zero-latency decode streaming as fast as it can; tokens per second one LB process passes.
* `prefix`: multi-turn chats over a dozen long few-shot prompts (Zipf-popular) on 2 prefills with a radix
  cache each + 1 decode; cache hit rate (the prefills' own counters) and TTFT per policy.

Writes bench/results/lb_sim_<host>.json and .png. Peer routers run from their own virtualenvs
(`--sglang-router-python`, `--smg-bin`; see docs/lb.md); missing ones are skipped and noted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import SharedPrefixSpec, WorkloadSpec, generate, mean_prompt, mean_shared_prefix_prompt, prompt_text, shared_prefix  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
# the simulated worker is a package at the repository root, outside the installed project
SIM_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
PEER_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "note": "shared machine; other jobs were running"}


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict | None = None, log: str | None = None) -> subprocess.Popen:
        out = open(log, "w") if log else subprocess.DEVNULL
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(self.procs):
            self.stop(p)


def wait_http(url: str, timeout: float = 60.0, ok=(200,)) -> None:
    import requests

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if requests.get(url, timeout=1).status_code in ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def start_sims(procs: Procs, n_p: int, n_d: int, knobs: list[str]) -> tuple[list[tuple[str, int]], list[str]]:
    prefills, decodes = [], []
    for role, n in (("prefill", n_p), ("decode", n_d)):
        for _ in range(n):
            port = free_port()
            argv = [sys.executable, "-m", "simworker", "--role", role, "--host", "127.0.0.1", "--port", str(port), *knobs]
            if role == "prefill":
                bp = free_port()
                argv += ["--bootstrap-port", str(bp)]
                prefills.append((f"http://127.0.0.1:{port}", bp))
            else:
                decodes.append(f"http://127.0.0.1:{port}")
            procs.start(argv, env=SIM_ENV)
    for u in [p for p, _ in prefills] + decodes:
        wait_http(u + "/health")
    return prefills, decodes


def lb_argv(kind: str, policy: str, prefills, decodes, port: int, args) -> list[str] | None:
    workers = []
    for url, bp in prefills:
        workers += ["--prefill", url, str(bp)]
    for url in decodes:
        workers += ["--decode", url]
    common = [*workers, "--host", "127.0.0.1", "--port", str(port)]
    if kind == "ours":
        tree = getattr(args, "tree_flags", []) if policy in ("prefix_aware", "cache_aware") else []
        return [sys.executable, "-m", "sglang_p2p_lb", *common, "--policy", policy, "--log-level", "warning", *tree]
    prom = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if kind == "mini_lb":
        return None if not args.sglang_router_python else [args.sglang_router_python, "-m", "sglang_router.launch_router", "--mini-lb", "--pd-disaggregation", *common]
    if kind == "sgl-router":
        return None if not args.sglang_router_python else [args.sglang_router_python, "-m", "sglang_router.launch_router", "--pd-disaggregation", *common, *prom, "--policy", policy, "--log-level", "warn"]
    if kind == "smg":
        if not args.smg_bin:
            return None
        pol = ["--prefill-policy", "bucket", "--decode-policy", "round_robin"] if policy == "bucket" else ["--policy", policy]
        return [args.smg_bin, "launch", "--pd-disaggregation", *common, *prom, "--disable-tokenizer-autoload", *pol, "--log-level", "warn"]
    raise ValueError(kind)


async def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Ready when a tiny streamed request goes through (peers register workers asynchronously)."""
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            try:
                async with s.post(url + "/generate", json={"text": "ready", "sampling_params": {"max_new_tokens": 1}}, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        await r.read()
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"LB at {url} never served a request")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


async def stream_request(s: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, float | None, float, int]:
    """(status, ttft, e2e, data events) of one streamed request."""
    t0 = time.perf_counter()
    ttft = None
    events = 0
    async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        buf = b""
        async for chunk in r.content.iter_any():
            if ttft is None and r.status == 200:
                buf += chunk
                if b"data: {" in buf and b"\n\n" in buf:
                    ttft = time.perf_counter() - t0
            events += chunk.count(b"data: {")
        return r.status, ttft, time.perf_counter() - t0, events


async def sample_prefill_loads(s: aiohttp.ClientSession, prefills, samples: list, stop: asyncio.Event) -> None:
    async def one(url):
        try:
            async with s.get(url + "/v1/loads", timeout=aiohttp.ClientTimeout(total=1)) as r:
                doc = await r.json(content_type=None)
                return sum(x["num_waiting_uncached_tokens"] for x in doc["loads"])
        except Exception:
            return None

    while not stop.is_set():
        vals = await asyncio.gather(*(one(u) for u, _ in prefills))
        if None not in vals:
            samples.append(vals)
        await asyncio.sleep(0.1)


def skew_stats(samples: list[list[float]]) -> dict:
    if not samples:
        return {"skew_time_avg": None, "skew_instant_mean": None}
    n = len(samples[0])
    avg = [statistics.fmean(s[i] for s in samples) for i in range(n)]
    m = statistics.fmean(avg)
    inst = [max(s) / statistics.fmean(s) for s in samples if statistics.fmean(s) > 0]
    return {
        "mean_outstanding_tokens": [round(a, 1) for a in avg],
        "skew_time_avg": round(max(avg) / m, 3) if m > 0 else None,
        "skew_instant_mean": round(statistics.fmean(inst), 3) if inst else None,
    }


async def fire_schedule(lb_url: str, times: list[float], bodies: list[bytes], prefills) -> tuple[list, list]:
    """Send each body at its time (open loop); (status, ttft, e2e, events) per request and load samples."""
    samples: list = []
    stop = asyncio.Event()
    out: list = []
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        sampler = asyncio.create_task(sample_prefill_loads(s, prefills, samples, stop))
        t0 = time.perf_counter()

        async def fire(at, body):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                out.append(await stream_request(s, lb_url + "/generate", body))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                out.append((-1, None, 0.0, 0))

        await asyncio.gather(*(fire(at, b) for at, b in zip(times, bodies)))
        stop.set()
        await sampler
    return out, samples


def latency_stats(out: list) -> dict:
    ok = [o for o in out if o[0] == 200 and o[1] is not None]
    ttft = [o[1] for o in ok]
    return {
        "requests": len(out),
        "ok": len(ok),
        "errors": len(out) - len(ok),
        "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1) if ttft else None,
        "ttft_p90_ms": round(pct(ttft, 90) * 1000, 1) if ttft else None,
        "ttft_p99_ms": round(pct(ttft, 99) * 1000, 1) if ttft else None,
        "ttft_mean_ms": round(statistics.fmean(ttft) * 1000, 1) if ttft else None,
        "e2e_p50_ms": round(pct([o[2] for o in ok], 50) * 1000, 1) if ok else None,
    }


async def run_load(lb_url: str, reqs, prefills, seed: int) -> dict:
    rng = random.Random(seed)
    bodies = [orjson.dumps({"text": prompt_text(r.words, rng), "sampling_params": {"max_new_tokens": r.max_new_tokens, "ignore_eos": True}, "stream": True}) for r in reqs]
    out, samples = await fire_schedule(lb_url, [r.at for r in reqs], bodies, prefills)
    return {**latency_stats(out), **skew_stats(samples)}


async def prefill_stats(prefills, reset: bool = False) -> list[dict]:
    """The simulated prefills' own counters (and, with reset, a cold cache and zeroed counters)."""
    async with aiohttp.ClientSession() as s:
        out = []
        for url, _ in prefills:
            if reset:
                await (await s.post(url + "/flush_cache")).read()
                await (await s.post(url + "/admin", json={"reset": True})).read()
            async with s.get(url + "/stats") as r:
                out.append(await r.json())
        return out


async def run_chat_load(lb_url: str, turns, prefills, max_new_tokens: int) -> dict:
    await prefill_stats(prefills, reset=True)
    bodies = [orjson.dumps({"text": r.text, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}, "stream": True}) for r in turns]
    out, samples = await fire_schedule(lb_url, [r.at for r in turns], bodies, prefills)
    st = await prefill_stats(prefills)
    prompt, cached = sum(x["prompt_tokens"] for x in st), sum(x["cached_tokens"] for x in st)
    served = [x["completed"] for x in st]
    return {
        **latency_stats(out),
        "cache_hit_rate": round(cached / prompt, 3) if prompt else None,
        "prefill_requests": served,
        **skew_stats(samples),
    }


PREFIX_POLICIES = [("ours", p) for p in ("random", "round_robin", "load_aware", "cache_aware", "prefix_aware")] + [("smg", "cache_aware")]


async def scenario_prefix(procs: Procs, args) -> dict:
    """Shared-prefix chats on 2 prefills (radix cache each) + 1 decode: cache hit rate and TTFT per policy."""
    cache_tokens = args.prefix_cache_tokens
    knobs = ["--prefill-base-ms", "5", "--prefill-ms-per-token", str(args.prefill_ms_per_token), "--decode-ms-per-token", "5", "--decode-slowdown", "0.005",
             "--prefix-cache-tokens", str(cache_tokens), "--page-tokens", "16"]
    prefills, decodes = start_sims(procs, 2, 1, knobs)
    spec = SharedPrefixSpec(duration=args.duration)
    service_s = (5 + mean_shared_prefix_prompt(spec) * args.prefill_ms_per_token) / 1000
    capacity = 2 / service_s  # requests/s of the two prefills with no cache hit at all
    configs = [c for c in PREFIX_POLICIES if not args.only or c[0] in args.only or f"{c[0]}:{c[1]}" in args.only]
    # the LB's prefix tree sized like a prefill's cache (~5 bytes a simulated word, 64-byte blocks) and
    # trimmed every second, so what it believes cached is what still fits there
    args.tree_flags = ["--max-tree-size", str(cache_tokens * 5 // 64), "--eviction-interval-secs", "1"]
    runs = []
    for load in args.prefix_loads or [args.load]:
        rate = load * capacity
        turns = shared_prefix(spec, rate / spec.turns, seed=args.seed)
        info = {"workers": "2 prefill (radix cache each) + 1 decode", "sim_knobs": knobs, "tree_flags": args.tree_flags, "workload": asdict(spec),
                "mean_prompt_tokens": round(mean_shared_prefix_prompt(spec)), "uncached_capacity_rps": round(capacity, 2), "offered_load_uncached": load,
                "rate_rps": round(rate, 2), "requests": len(turns)}

        async def go(url, p):
            return await run_chat_load(url, turns, prefills, spec.max_new_tokens)

        runs.append({"setup": info, "results": await each_lb(procs, f"prefix@{load}", configs, prefills, decodes, args, go)})
    return {"runs": runs}


async def each_lb(procs: Procs, tag: str, configs, prefills, decodes, args, go) -> dict:
    """Run `go(url, proc)` through each (kind, policy) LB in turn; results by "kind:policy"."""
    results = {}
    for kind, policy in configs:
        name = f"{kind}:{policy}"
        print(f"[{tag}] {name} ...", flush=True)
        results[name] = await with_lb(procs, kind, policy, prefills, decodes, args, go)
        print(f"  {results[name]}", flush=True)
        await asyncio.sleep(1.0)
    return results


def lb_configs(args) -> list[tuple[str, str]]:
    configs = [("ours", p) for p in ("load_aware", "power_of_two", "round_robin", "random")]
    configs += [("mini_lb", "random"), ("sgl-router", "power_of_two")]
    configs += [("smg", p) for p in ("cache_aware", "round_robin", "power_of_two", "least_load", "bucket")]
    if args.only:
        configs = [c for c in configs if f"{c[0]}:{c[1]}" in args.only or c[0] in args.only]
    return configs


async def with_lb(procs: Procs, kind: str, policy: str, prefills, decodes, args, fn):
    port = free_port()
    argv = lb_argv(kind, policy, prefills, decodes, port, args)
    if argv is None:
        return {"skipped": "peer router not installed"}
    log = f"/tmp/lb_bench_{kind}_{policy}.log"
    p = procs.start(argv, env=PEER_ENV if kind != "ours" else None, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url)
        return await fn(url, p)
    except TimeoutError as e:
        return {"error": str(e), "log": log}
    finally:
        procs.stop(p)


async def scenario_policies(procs: Procs, args) -> dict:
    knobs = ["--prefill-base-ms", "5", "--prefill-ms-per-token", str(args.prefill_ms_per_token), "--decode-ms-per-token", "5", "--decode-slowdown", "0.005"]
    prefills, decodes = start_sims(procs, 3, 1, knobs)
    spec = WorkloadSpec(duration=args.duration)
    service_s = (5 + mean_prompt(spec) * args.prefill_ms_per_token) / 1000
    capacity = 3 / service_s
    rate = args.load * capacity
    reqs = generate(spec, rate, seed=args.seed)
    info = {"workers": "3 prefill + 1 decode (P3x3-D4 shape: 3 prefill servers, one decode server)", "sim_knobs": knobs, "workload": asdict(spec),
            "mean_prompt_tokens": round(mean_prompt(spec)), "prefill_capacity_rps": round(capacity, 2), "offered_load": args.load, "rate_rps": round(rate, 2), "requests": len(reqs)}
    async def go(url, p):
        return await run_load(url, reqs, prefills, args.seed)

    return {"setup": info, "results": await each_lb(procs, "policies", lb_configs(args), prefills, decodes, args, go)}


async def direct_pd(s: aiohttp.ClientSession, prefill, decode: str, body: dict, stream: bool):
    """What an ideal in-process LB does: both legs at once, bootstrap fields added."""
    b = orjson.dumps({**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill[1], "bootstrap_room": random.randrange(2**63)})
    t0 = time.perf_counter()

    async def leg(url):
        async with s.post(url + "/generate", data=b, headers={"Content-Type": "application/json"}) as r:
            if url == decode and stream:
                async for _ in r.content.iter_any():
                    return time.perf_counter() - t0
            await r.read()
            return time.perf_counter() - t0

    _, t = await asyncio.gather(leg(prefill[0]), leg(decode))
    return t


async def lb_request(s: aiohttp.ClientSession, url: str, body: dict, stream: bool) -> float:
    t0 = time.perf_counter()
    async with s.post(url + "/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
        if stream:
            async for _ in r.content.iter_any():
                t = time.perf_counter() - t0
                await r.read()
                return t
        await r.read()
    return time.perf_counter() - t0


async def scenario_overhead(procs: Procs, args) -> dict:
    knobs = ["--prefill-base-ms", "0", "--prefill-ms-per-token", "0", "--decode-ms-per-token", "0"]
    prefills, decodes = start_sims(procs, 1, 1, knobs)
    n = args.overhead_requests
    out = {}
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            body = {"text": "hello world", "sampling_params": {"max_new_tokens": 1}, "stream": stream}
            for _ in range(20):
                await direct_pd(s, prefills[0], decodes[0], body, stream)
            base = [await direct_pd(s, prefills[0], decodes[0], body, stream) for _ in range(n)]
            out[f"direct_{'stream' if stream else 'nonstream'}_p50_ms"] = round(pct(base, 50) * 1000, 3)
    for kind, policy in [("ours", "load_aware"), ("mini_lb", "random"), ("smg", "round_robin"), ("sgl-router", "round_robin")]:
        if args.only and kind not in args.only and f"{kind}:{policy}" not in args.only:
            continue

        async def go(url, p):
            res = {}
            async with aiohttp.ClientSession() as s:
                for stream in (False, True):
                    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 1}, "stream": stream}
                    for _ in range(20):
                        await lb_request(s, url, body, stream)
                    lat = [await lb_request(s, url, body, stream) for _ in range(n)]
                    tag = "stream" if stream else "nonstream"
                    res[f"{tag}_p50_ms"] = round(pct(lat, 50) * 1000, 3)
                    res[f"{tag}_p99_ms"] = round(pct(lat, 99) * 1000, 3)
                    res[f"added_{tag}_p50_ms"] = round(res[f"{tag}_p50_ms"] - out[f"direct_{tag}_p50_ms"], 3)
            return res

        print(f"[overhead] {kind}:{policy} ...", flush=True)
        out[f"{kind}:{policy}"] = await with_lb(procs, kind, policy, prefills, decodes, args, go)
        print(f"  {out[f'{kind}:{policy}']}", flush=True)
    return out


async def scenario_throughput(procs: Procs, args) -> dict:
    knobs = ["--prefill-base-ms", "0", "--prefill-ms-per-token", "0", "--decode-ms-per-token", "0"]
    prefills, decodes = start_sims(procs, 1, 1, knobs)
    # OpenAI streaming: one small delta event per token (SGLang's /generate repeats the whole text each event)
    conc, tokens, secs = 32, 1000, args.throughput_secs
    route = "/v1/completions"
    hdr = {"Content-Type": "application/json"}

    async def drive(target):
        count = 0
        end = time.perf_counter() + secs
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def worker():
                nonlocal count
                body = {"model": "sim-model", "prompt": "x", "max_tokens": tokens, "stream": True}
                while time.perf_counter() < end:
                    count += await target(s, body)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            return round(count / (time.perf_counter() - t0))

    async def via_direct(s, body):
        b = orjson.dumps({**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefills[0][1], "bootstrap_room": random.randrange(2**63)})
        async def p():
            async with s.post(prefills[0][0] + route, data=b, headers=hdr) as r:
                await r.read()
        async def d():
            async with s.post(decodes[0] + route, data=b, headers=hdr) as r:
                n = 0
                async for c in r.content.iter_any():
                    n += c.count(b"data: {")
                return n
        return (await asyncio.gather(p(), d()))[1]

    out = {"route": route, "streams": conc, "tokens_per_stream": tokens, "seconds": secs}
    print("[throughput] direct ...", flush=True)
    out["direct_tokens_per_s"] = await drive(via_direct)
    for kind, policy in [("ours", "load_aware"), ("mini_lb", "random"), ("smg", "round_robin")]:
        if args.only and kind not in args.only and f"{kind}:{policy}" not in args.only:
            continue

        async def go(url, p):
            async def via_lb(s, body):
                async with s.post(url + route, data=orjson.dumps(body), headers=hdr) as r:
                    n = 0
                    async for c in r.content.iter_any():
                        n += c.count(b"data: {")
                    return n
            return {"tokens_per_s": await drive(via_lb)}

        print(f"[throughput] {kind}:{policy} ...", flush=True)
        out[f"{kind}:{policy}"] = await with_lb(procs, kind, policy, prefills, decodes, args, go)
        print(f"  {out[f'{kind}:{policy}']}", flush=True)
    return out


def plot(doc: dict, path: Path) -> None:
    # SGLang's vendored folder (scripts/env.sh puts it on PYTHONPATH) shadows matplotlib's dateutil
    sys.path[:] = [p for p in sys.path if "/.deps/" not in p]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = {k: v for k, v in doc.get("policies", {}).get("results", {}).items() if v.get("ttft_p99_ms") is not None}
    if not res:
        return
    names = list(res)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = range(len(names))
    a1.bar([i - 0.2 for i in x], [res[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    a1.bar([i + 0.2 for i in x], [res[n]["ttft_p99_ms"] for n in names], 0.4, label="p99")
    a1.set_ylabel("TTFT (ms)")
    a1.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
    a1.legend()
    a1.set_title(f"TTFT at {doc['policies']['setup']['offered_load']:.0%} offered load (P3, D1 simulated)")
    a2.bar(list(x), [res[n]["skew_time_avg"] or 0 for n in names], color="tab:green")
    a2.axhline(1.2, color="red", ls="--", lw=1, label="target 1.2")
    a2.set_ylabel("prefill skew (max / mean outstanding tokens)")
    a2.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
    a2.legend()
    fig.suptitle(f"sglang-p2p-lb simulation on {doc['machine']['host']} ({doc['machine']['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=["policies", "overhead", "throughput"], help="policies, overhead, throughput, prefix (shared-prefix chats)")
    ap.add_argument("--only", nargs="*", default=None, help="limit to LB kinds or kind:policy names")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefix-cache-tokens", type=int, default=16000, help="prefix scenario: radix cache per simulated prefill")
    ap.add_argument("--prefix-loads", type=float, nargs="*", default=None, help="prefix scenario: offered loads (share of the uncached prefill capacity); default --load")
    ap.add_argument("--overhead-requests", type=int, default=300)
    ap.add_argument("--throughput-secs", type=float, default=8.0)
    ap.add_argument("--sglang-router-python", default=os.environ.get("SGLANG_ROUTER_PYTHON"), help="python of a venv with sglang-router==0.3.2")
    ap.add_argument("--smg-bin", default=os.environ.get("SMG_BIN"), help="smg executable of a venv with smg==1.13.0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default=None, help='what ran it, in words (e.g. "CPU, 2 cores, simulator")')
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"lb_sim_{platform.node() or 'host'}.json"
    doc: dict = json.loads(out.read_text()) if out.exists() else {}
    doc["machine"] = {**machine(), **({"label": args.label} if args.label else {})}
    doc["peers"] = {"sglang-router": "0.3.2" if args.sglang_router_python else None, "smg": "1.13.0" if args.smg_bin else None}
    procs = Procs()
    try:
        for sc in args.scenarios:
            fn = {"policies": scenario_policies, "overhead": scenario_overhead, "throughput": scenario_throughput, "prefix": scenario_prefix}[sc]
            doc[sc] = asyncio.run(fn(procs, args))
            procs.stop_all()
            doc["written"] = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write_text(json.dumps(doc, indent=1))
    finally:
        procs.stop_all()
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
