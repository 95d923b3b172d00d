"""A discrete-event MODEL of a PD cluster that replays a workload through the LB's real policy objects.

It is a simulator, not a measurement: no HTTP, no processes, no GPUs. Time is simulated, so a 14 s run takes a
fraction of a second and is deterministic for a seed. What it models (each a knob of `Hw`):

* the LB: the policy objects of `sglang_p2p_lb` (prefix_aware, cache_aware, load_aware, random) with the LB's
  own `Lease` accounting (a prefill's outstanding work is released when its leg ends, after the KV is sent)
  and its latency EWMA; no load polling (the real prefills' waiting queues were empty in the runs it mirrors);
* a prefill (SGLang's PD prefill, `optimistic_prefill_attempts` 0): a request waits in the bootstrap queue until
  its decode has allocated its pages, then in the waiting queue; the scheduler puts everything waiting (up to
  `max_prefill_tokens` uncached tokens) into one forward batch of `batch_ms + uncached / prefill_tok_per_ms +
  cached_ms_per_1k x cached / 1000` ms; a radix cache (LRU, `prefill_cache_tokens`) decides what is cached;
  after the batch each request's whole KV (all its prompt tokens) is sent by one sender per (prefill, decode)
  pair, in order (SGLANG_P2P_WORKERS shards decode peers over its queues, so one decode's rooms are serial),
  `send_ms + tokens x kv_bytes / bw` each;
* a decode: a KV pool of `decode_pool_tokens`; requests are admitted FIFO once their prompt + output fits
  (pages held from then on, through the transfer, until the last token); steps of `step_ms + per_req_ms x B +
  per_ctx_ms_per_1k x context / 1000`; a request whose KV arrived joins at the next step and streams its first
  token at that step's end (TTFT), then one token a step.

Shaped after the 3P1D shared_prefix runs of 2026-11-28 on 4 x H200 (llama-anchor, 128 KiB of KV a token, prefill
pools 98,304 tokens, decode 458,752; `e2e/lb_compare.py`'s workload, seeds 0-2 are that file's repetitions).
The send bandwidth, the batch and step costs are guesses (see `Hw`), so the model says which way a routing
choice moves the queues and by how much under stated costs, never what a GPU run will measure.

    python bench/lb_sim/pd_model.py --topology 3p1d --workload shared_prefix --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import random
import statistics
import sys
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "lb"), str(ROOT)]

from sglang_p2p_lb.policy import LoadAwarePolicy, PairContext, RandomPolicy  # noqa: E402
from sglang_p2p_lb.prefix_policy import CacheAwarePolicy, PrefixAwarePolicy, PrefixParams  # noqa: E402
from sglang_p2p_lb.prefix_tree import PrefixTree, block_hashes  # noqa: E402
from sglang_p2p_lb.workers import Lease, Worker  # noqa: E402

TOKENS_PER_BLOCK = 16  # 64-byte blocks of 4-byte token ids: the LB's blocks and the model's cache pages alike


@dataclass(frozen=True)
class Hw:
    """The model's costs. Defaults: llama-8B-shaped on H200, no CUDA graphs (the runs' flags); guesses where
    marked. prefill_tok_per_ms: the runs' measured capacity without hits (298k tokens/s over 3 prefills)."""

    prefill_tok_per_ms: float = 100.0
    batch_ms: float = 6.0  # guess: a forward's fixed cost without CUDA graphs
    cached_ms_per_1k: float = 0.15  # guess: attention reading 1k cached tokens for one request
    max_prefill_tokens: int = 16384
    prefill_cache_tokens: int = 98304
    kv_bytes_per_token: int = 128 * 1024
    send_gbps: float = 100.0  # guess: one prefill's KV sends to one decode, serial (GB/s)
    send_ms: float = 0.5
    decode_pool_tokens: int = 458752
    # guesses, set so that the one decode of the 3P1D shared_prefix runs keeps up on average (~50 running, as its
    # gauge read 16-49 there): at per_ctx_ms_per_1k 0.15-0.18 it runs out of pages instead, and then every policy's
    # TTFT is the same (the decode admits in arrival order whoever sent the request)
    step_ms: float = 25.0  # a decode step's fixed cost without CUDA graphs
    per_req_ms: float = 0.05
    per_ctx_ms_per_1k: float = 0.1  # reading 1k tokens of context in a step
    lb_ms: float = 1.0  # the LB and HTTP, each way

    def send_time(self, tokens: int) -> float:
        return self.send_ms + tokens * self.kv_bytes_per_token / (self.send_gbps * 1e6)


@dataclass
class Req:
    rid: int
    at: float
    ids: list[int]
    out: int
    prompt: bytes = b""
    hashes: list[int] = field(default_factory=list)
    # filled as it goes
    prefill: int = -1
    decode: int = -1
    lease: Optional[Lease] = None
    cached: int = 0
    t_dispatch: float = 0.0
    t_admitted: float = -1.0
    t_forward: float = -1.0
    t_sent: float = -1.0
    t_first: float = -1.0
    emitted: int = 0

    @property
    def tokens(self) -> int:
        return len(self.ids)


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._q, (t, self._n, fn))

    def run(self) -> None:
        while self._q:
            t, _, fn = heapq.heappop(self._q)
            self.now = t
            fn()


class Prefill:
    def __init__(self, sim: Sim, hw: Hw, idx: int, worker: Worker, on_sent: Callable[[Req], None]) -> None:
        self.sim, self.hw, self.idx, self.w, self.on_sent = sim, hw, idx, worker, on_sent
        self.cache = PrefixTree(max(1, hw.prefill_cache_tokens // TOKENS_PER_BLOCK))
        self.waiting: list[Req] = []
        self.busy = False
        # one sender per decode peer (SGLANG_P2P_WORKERS shards peers over its queues; one peer's rooms stay in order)
        self.send_q: dict[int, deque[Req]] = {}
        self.sending: set[int] = set()
        self.batches: list[tuple[int, int]] = []  # (requests, uncached tokens) per forward
        self.requests = self.prompt_tokens = self.cached_tokens = 0
        self.busy_ms = self.send_busy_ms = 0.0
        self.send_waits: list[float] = []

    def bootstrapped(self, r: Req) -> None:
        self.waiting.append(r)
        self._schedule()

    def _schedule(self) -> None:
        if self.busy or not self.waiting:
            return
        batch, budget = [], self.hw.max_prefill_tokens
        while self.waiting:
            r = self.waiting[0]
            hit = min(self.cache.match(r.hashes, 0) * TOKENS_PER_BLOCK, r.tokens - 1)
            if batch and r.tokens - hit > budget:
                break
            self.waiting.pop(0)
            r.cached = hit
            budget -= r.tokens - hit
            batch.append(r)
        uncached = sum(r.tokens - r.cached for r in batch)
        cached = sum(r.cached for r in batch)
        ms = self.hw.batch_ms + uncached / self.hw.prefill_tok_per_ms + self.hw.cached_ms_per_1k * cached / 1000
        self.busy = True
        self.busy_ms += ms
        self.batches.append((len(batch), uncached))
        def done() -> None:
            self.busy = False
            for r in batch:
                self.cache.insert(r.hashes, 0)
                self.cache.evict()
                r.t_forward = self.sim.now
                self.requests += 1
                self.prompt_tokens += r.tokens
                self.cached_tokens += r.cached
                self.send_q.setdefault(r.decode, deque()).append(r)
            for d in list(self.send_q):
                self._send(d)
            self._schedule()

        self.sim.at(self.sim.now + ms / 1000, done)

    def _send(self, d: int) -> None:
        q = self.send_q.get(d)
        if d in self.sending or not q:
            return
        r = q.popleft()
        self.send_waits.append(self.sim.now - r.t_forward)
        ms = self.hw.send_time(r.tokens)
        self.sending.add(d)
        self.send_busy_ms += ms

        def sent() -> None:
            self.sending.discard(d)
            r.t_sent = self.sim.now
            self.on_sent(r)
            self._send(d)

        self.sim.at(self.sim.now + ms / 1000, sent)


class Decode:
    def __init__(self, sim: Sim, hw: Hw, worker: Worker, prefills: Sequence[Prefill], on_first: Callable[[Req], None],
                 on_done: Callable[[Req], None]) -> None:
        self.sim, self.hw, self.w, self.prefills = sim, hw, worker, prefills
        self.on_first, self.on_done = on_first, on_done
        self.free = hw.decode_pool_tokens
        self.prealloc: deque[Req] = deque()
        self.arrived: list[Req] = []  # KV landed, joins at the next step
        self.running: list[Req] = []
        self.stepping = False
        self.samples: list[tuple[int, int, int]] = []  # (running, waiting for pages, pages held waiting for KV)
        self.held_no_kv = 0

    def arrive(self, r: Req) -> None:
        self.prealloc.append(r)
        self._admit()

    def _admit(self) -> None:
        while self.prealloc and self.prealloc[0].tokens + self.prealloc[0].out <= self.free:
            r = self.prealloc.popleft()
            self.free -= r.tokens + r.out
            r.t_admitted = self.sim.now
            self.held_no_kv += 1
            p = self.prefills[r.prefill]
            self.sim.at(self.sim.now + self.hw.lb_ms / 1000, lambda p=p, r=r: p.bootstrapped(r))

    def kv_arrived(self, r: Req) -> None:
        self.held_no_kv -= 1
        self.arrived.append(r)
        self._step()

    def _step(self) -> None:
        if self.stepping or not (self.running or self.arrived):
            return
        joining, self.arrived = self.arrived, []
        batch = self.running + joining
        ctx = sum(r.tokens + r.emitted for r in batch)
        ms = self.hw.step_ms + self.hw.per_req_ms * len(batch) + self.hw.per_ctx_ms_per_1k * ctx / 1000
        self.stepping = True
        self.samples.append((len(batch), len(self.prealloc), self.held_no_kv))

        def done() -> None:
            self.stepping = False
            still = []
            for r in batch:
                r.emitted += 1
                if r.emitted == 1:
                    self.on_first(r)
                if r.emitted >= r.out:
                    self.free += r.tokens + r.out
                    self.on_done(r)
                else:
                    still.append(r)
            self.running = still
            self._admit()
            self._step()

        self.sim.at(self.sim.now + ms / 1000, done)


# ----------------------------------------------------------------------------- policies and workloads
class SmgCacheAware(CacheAwarePolicy):
    """smg's cache_aware as its current source has it (lightseekorg/smg model_gateway/src/policies/cache_aware.rs,
    2026-06 on): a match share above the threshold goes to the matched worker; otherwise to the fewest requests in
    flight, then the fewest routed so far, then the first (our CacheAwarePolicy takes the smallest tree there).
    smg counts a prefill's request until the whole answer ends; here until its KV is sent (Lease), a little less."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.processed: dict[str, int] = {}

    def choose(self, prefills, decodes, ctx):
        from sglang_p2p_lb.policy import Choice, decode_cost
        from sglang_p2p_lb.prefix_policy import cached_share, imbalanced, request_load

        self.maybe_evict(prefills)
        hashes = block_hashes(ctx.prompt)
        loads = [request_load(w, ctx) for w in prefills]
        by_load = lambda k: (loads[k], self.processed.get(prefills[k].url, 0), k)  # noqa: E731
        if not hashes or imbalanced(loads, self.prefix.balance_abs_threshold, self.prefix.balance_rel_threshold):
            i = min(range(len(prefills)), key=by_load)
        else:
            shares = [cached_share(self.tree.match(hashes, (w.url, 0)), len(ctx.prompt)) for w in prefills]
            best = max(range(len(prefills)), key=lambda k: (shares[k], self.rng.random()))
            i = best if shares[best] > self.prefix.cache_threshold else min(range(len(prefills)), key=by_load)
        if hashes:
            self.tree.insert(hashes, (prefills[i].url, 0))
        self.processed[prefills[i].url] = self.processed.get(prefills[i].url, 0) + 1
        dc = [decode_cost(w, ctx, self.kv_weight) for w in decodes]
        j = min(range(len(decodes)), key=lambda k: (dc[k][1], self.rng.random()))
        return Choice(prefills[i], decodes[j], None, dc[j][0])


def make_policy(name: str, seed: int, clock: Callable[[], float], tree_blocks: int) -> Any:
    """`ours:prefix_aware[:c<share>]`, `ours:load_aware`, `ours:cache_aware` (the LB's model of smg's),
    `model:smg_cache_aware` (smg's current rule, SmgCacheAware), `random`.
    Ours gets the tree flags lb_compare passes (max tree size a prefill's cache, 1 s eviction)."""
    rng = random.Random(seed)
    kind, _, rest = name.partition(":")
    policy, _, opt = rest.partition(":")
    if name == "random":
        return RandomPolicy(rng)
    if policy == "load_aware":
        return LoadAwarePolicy(rng=rng)
    if policy == "prefix_aware":
        cost = float(opt[1:]) if opt.startswith("c") else 0.0
        return PrefixAwarePolicy(PrefixParams(max_tree_size=tree_blocks, eviction_interval=1.0, cached_cost=cost), rng=rng, clock=clock)
    if policy == "cache_aware":  # smg's defaults: no trim within a run
        return CacheAwarePolicy(PrefixParams(), rng=rng, clock=clock)
    if policy == "smg_cache_aware":
        return SmgCacheAware(PrefixParams(), rng=rng, clock=clock)
    raise ValueError(f"unknown policy {name!r}")


def workload(name: str, seed: int, duration: float) -> list[Req]:
    """The requests lb_compare sends (its shared_prefix at 30 conversations/s on 4k prefixes, 8 output tokens;
    its long_prefix at 30.5 conversations/s on 10 x 12k prefixes), seed = lb_compare's --seed + repetition."""
    from e2e import lb_compare

    wp = lb_compare.WorkloadParams(chat_rate=30.0, chat_prefix=4000, chat_output=8, long_rate=30.483)
    reqs = lb_compare.make_workload(name, duration, seed, wp)
    out = []
    for i, r in enumerate(reqs):
        prompt = array("I", r.input_ids).tobytes()
        out.append(Req(i, r.at, r.input_ids, r.max_new_tokens, prompt, block_hashes(prompt)))
    return out


def run(policy_name: str, reqs: Sequence[Req], hw: Hw, n_p: int, n_d: int, seed: int = 0) -> dict[str, Any]:
    sim = Sim()
    reqs = [dataclasses.replace(r, prefill=-1, decode=-1, lease=None, cached=0, t_admitted=-1.0, t_forward=-1.0, t_sent=-1.0,
                                t_first=-1.0, emitted=0) for r in reqs]
    pws = [Worker(f"http://10.0.0.{i + 1}:30000", "prefill", 8998, node="n") for i in range(n_p)]
    dws = [Worker(f"http://10.0.1.{i + 1}:30000", "decode", node="n") for i in range(n_d)]
    policy = make_policy(policy_name, seed, lambda: sim.now, hw.prefill_cache_tokens * 4 // 64)
    ttft: list[tuple[float, float]] = []

    def on_sent(r: Req) -> None:
        assert r.lease is not None
        r.lease.release_prefill()
        pws[r.prefill].observe_latency((sim.now - r.t_dispatch) * 1000.0 / max(1, r.tokens))
        decodes[r.decode].kv_arrived(r)

    def on_first(r: Req) -> None:
        r.t_first = sim.now + hw.lb_ms / 1000
        ttft.append((r.at, r.t_first - r.at))

    def on_done(r: Req) -> None:
        assert r.lease is not None
        r.lease.release_decode()

    prefills = [Prefill(sim, hw, i, w, on_sent) for i, w in enumerate(pws)]
    decodes = [Decode(sim, hw, w, prefills, on_first, on_done) for w in dws]

    def dispatch(r: Req) -> None:
        c = policy.choose(pws, dws, PairContext(tokens=r.tokens, prompt=r.prompt, now=sim.now))
        r.prefill, r.decode = pws.index(c.prefill), dws.index(c.decode)
        r.t_dispatch = sim.now
        r.lease = Lease(c.prefill, c.decode, c.prefill_rank or 0, c.decode_rank or 0, r.tokens, 1, c.prefill_tokens)
        # both legs leave at once; the decode's prealloc admits it, then the prefill's bootstrap completes
        sim.at(sim.now + hw.lb_ms / 1000, lambda: decodes[r.decode].arrive(r))

    for r in reqs:
        sim.at(r.at + hw.lb_ms / 1000, lambda r=r: dispatch(r))
    sim.run()
    return summarize(reqs, ttft, prefills, decodes)


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else float("nan")


def summarize(reqs: Sequence[Req], ttft: Sequence[tuple[float, float]], prefills: Sequence[Prefill], decodes: Sequence[Decode]) -> dict[str, Any]:
    t = [x for _, x in ttft]
    n = sum(p.requests for p in prefills)
    prompt = sum(p.prompt_tokens for p in prefills)
    dur = max(r.at for r in reqs)
    per_sec: dict[int, list[float]] = {}
    for at, x in ttft:
        per_sec.setdefault(int(at), []).append(x)
    waits = {"pages_ms": [1e3 * (r.t_admitted - r.at) for r in reqs],
             "prefill_ms": [1e3 * (r.t_forward - r.t_admitted) for r in reqs],
             "send_ms": [1e3 * (r.t_sent - r.t_forward) for r in reqs],
             "decode_ms": [1e3 * (r.t_first - r.t_sent) for r in reqs]}
    d0 = decodes[0]
    return {
        "requests": len(reqs),
        "ttft_ms_p50": round(1e3 * pct(t, 50), 1),
        "ttft_ms_p99": round(1e3 * pct(t, 99), 1),
        "hit_rate": round(sum(p.cached_tokens for p in prefills) / prompt, 4),
        "request_share": [round(p.requests / n, 3) for p in prefills],
        "prompt_token_share": [round(p.prompt_tokens / prompt, 3) for p in prefills],
        "prefill_request_share_max": round(max(p.requests for p in prefills) / n, 3),
        "batch_reqs_mean": [round(statistics.fmean(b for b, _ in p.batches), 2) if p.batches else 0 for p in prefills],
        "prefill_busy": [round(p.busy_ms / 1e3 / dur, 3) for p in prefills],
        "send_busy": [round(p.send_busy_ms / 1e3 / dur, 3) for p in prefills],
        "send_wait_ms_mean": [round(1e3 * statistics.fmean(p.send_waits), 2) if p.send_waits else 0 for p in prefills],
        "stage_ms_p50": {k: round(pct(v, 50), 1) for k, v in waits.items()},
        "stage_ms_mean": {k: round(statistics.fmean(v), 1) for k, v in waits.items()},
        "decode_running_mean": round(statistics.fmean(s[0] for s in d0.samples), 1),
        "decode_waiting_pages_mean": round(statistics.fmean(s[1] for s in d0.samples), 1),
        "decode_held_no_kv_mean": round(statistics.fmean(s[2] for s in d0.samples), 1),
        "seconds_p50_over_400ms": sum(1 for v in per_sec.values() if pct(v, 50) > 0.4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="3p1d", choices=("3p1d", "2p2d"))
    ap.add_argument("--workload", default="shared_prefix", choices=("shared_prefix", "long_prefix"))
    ap.add_argument("--policies", nargs="+", default=["ours:prefix_aware", "ours:prefix_aware:c0.25", "model:smg_cache_aware", "ours:cache_aware", "ours:load_aware", "random"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--duration", type=float, default=13.7)
    ap.add_argument("--hw", nargs="*", default=[], help="Hw overrides, e.g. send_gbps=50 step_ms=20")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    hw = Hw(**{k: type(getattr(Hw, k))(v) for k, v in (x.split("=", 1) for x in args.hw)})
    n_p, n_d = (3, 1) if args.topology == "3p1d" else (2, 2)
    out: dict[str, Any] = {"model": "bench/lb_sim/pd_model.py (a simulator)", "hw": dataclasses.asdict(hw), "topology": args.topology,
                           "workload": args.workload, "duration_s": args.duration, "runs": {}}
    for seed in args.seeds:
        reqs = workload(args.workload, seed, args.duration)
        for name in args.policies:
            res = run(name, reqs, hw, n_p, n_d, seed)
            out["runs"].setdefault(name, []).append({"seed": seed, **res})
            print(f"seed {seed} {name:26s} p50 {res['ttft_ms_p50']:7.1f} p99 {res['ttft_ms_p99']:7.1f} hit {res['hit_rate']:.3f} "
                  f"req share {res['request_share']} send busy {res['send_busy']} mean ms {res['stage_ms_mean']}", flush=True)
    print("\nmedians over seeds (TTFT ms; the largest request share of one prefill, per seed):")
    for name, rs in out["runs"].items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("ttft_ms_p50", "ttft_ms_p99", "hit_rate")}
        print(f"  {name:26s} p50 {med['ttft_ms_p50']:7.1f}  p99 {med['ttft_ms_p99']:7.1f}  hit {med['hit_rate']:.3f}  "
              f"share max {[r['prefill_request_share_max'] for r in rs]}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
