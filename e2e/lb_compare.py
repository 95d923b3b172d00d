"""Our LB against SGLang's mini_lb and smg on the same PD servers: workloads, repetitions, kill -9, one JSON.

    python3 -m e2e.lb_compare --models DIR [--gpus 1|4] --topology 2p2d|3p1d --out FILE --logs DIR [--lbs ...] [--reps 3]
    python3 -m e2e.lb_compare --sim ...   (simulated workers, simworker, for a CPU proof run)
    (bash e2e/run_all.sh --gpus 1|4 --phase lb runs it with the bundle: E2E_LB_TOPOLOGY picks the topology)

The servers start once and every LB runs in front of the same ones. Where they run, the model and pools are
e2e/lb_layout.py's (it says why): ``--gpus 1``, llama-tiny on GPU 0, p2pnccl over NCCL with an NCCL_HOSTID
per server (as e2e/lb_real.py); ``--gpus 4``, one llama-anchor server per GPU, p2pnccl over CUDA IPC between
the GPUs, longer prompts, and request rates from the prefill capacity measured after the warm-up. The LBs:
* ``ours:<policy>``: sglang-p2p-lb (load_aware and prefix_aware by default);
* ``mini_lb``: sglang-router 0.3.2's ``python -m sglang_router.launch_router --pd-disaggregation --mini-lb``
  (what SGLang's PD docs and test fixture use; random pairs);
* ``smg:<policy>``: smg 1.13.0 ``python -m smg launch --pd-disaggregation`` (cache_aware and power_of_two),
  with its health checks every 2 s like ours (its default is 60 s).
A warm-up first runs every workload through a round-robin LB, so every server has compiled its kernels for
every shape before anything is measured. Then, per repetition, every LB in an order rotated by one each time
(fresh LB processes started side by side, so no LB keeps a prefix tree from a previous run), runs each
workload open-loop against cold caches (every server's /flush_cache first). Per run: TTFT p50/p99, E2E p99, output tok/s, cache hit
rate (meta_info.cached_tokens over prompt tokens), errors, TTFT p99 of the requests sent in the first ``--cold-s``
seconds (the caches being built) and of those sent after (the steady state), and the servers' own load as evidence of the LB's
decisions: every server's ``sglang:num_queue_reqs`` and ``sglang:num_running_reqs`` sampled from /metrics
every 0.5 s while the run is in flight (per server mean and max; per role the imbalance, the busiest server's
mean load over the mean); per LB and workload the median and the spread (min, max) over the repetitions. The workloads (e2e/lb_real.py's generators):
* ``bursty_mixed``: Poisson with 3x bursts, 85% short prompts, 15% 2k-6k (6k-14k on 4 GPUs);
* ``shared_prefix``: multi-turn chats over 6 few-shot prefixes of 2k tokens (4k on 4 GPUs);
* ``long_prefix``: 3-turn chats over 10 prefixes of 12k tokens, more than one prefill's radix cache holds
  (98k tokens) and less than two: a miss costs a 12k-token prefill, so routing for cache hits can show in
  TTFT. It shows best with ``--transport cudaipc``: over NCCL's loopback sockets the whole prompt's KV
  (24 MiB at 12k tokens) moves to the decode on a hit as on a miss, and that transfer, not the prefill,
  dominates TTFT on llama-tiny.
Faults: every LB runs at once, each with its own open-loop client at 1/n of the bursty rate; a prefill and
then a decode get SIGKILL, both restart; per LB the client errors, split into requests in flight at a kill,
requests sent while no server of the killed one's role was left (3P1D's only decode) and the rest (the target:
none), and, once both servers serve again, how long until the LB sends a request to each of them (a burst
through one LB at a time, attributed by the restarted servers' own request counters, counted from when both
answered /health to the start of the burst that reached the server).
The run time per workload is planned from the time left (E2E_DEADLINE_EPOCH) so that everything fits one
device call; what did not fit is named in the JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

from . import lb_layout, lb_real, promparse
from .config import with_flag
from .lb_layout import TOPOLOGIES, Layout
from .lb_real import Req
from .servers import kill_groups

DEFAULT_LBS = ("ours:load_aware", "ours:prefix_aware", "mini_lb", "smg:cache_aware", "smg:power_of_two")
WORKLOADS = ("bursty_mixed", "shared_prefix", "long_prefix")
PEER_HEALTH_INTERVAL = "2"  # smg checks every 60 s by default; ours every 2 s


# ----------------------------------------------------------------------------- LBs
@dataclass(frozen=True)
class LBSpec:
    kind: str  # ours | mini_lb | smg
    policy: str = ""
    workers: int = 1  # ours only: --workers (server processes on one port)
    cached_cost: float = 0.0  # ours only: --cached-token-cost

    @property
    def name(self) -> str:
        base = f"{self.kind}:{self.policy}" if self.policy else self.kind
        base = f"{base}:w{self.workers}" if self.workers > 1 else base
        return f"{base}:c{self.cached_cost:g}" if self.cached_cost else base


def _ours_option(item: str, opt: str) -> tuple[str, float]:
    """One `:w<N>` (our --workers) or `:c<share>` (our --cached-token-cost) of an `ours:` entry."""
    key, text = opt[:1], opt[1:]
    try:
        if key == "w" and int(text) >= 1:
            return "workers", int(text)
        if key == "c" and 0.0 <= float(text) <= 1.0:
            return "cached_cost", float(text)
    except ValueError:
        pass
    raise ValueError(f"LB {item!r}: ours takes a process count as :w<N> (N >= 1) and a cached-token cost as "
                     f":c<share> (0-1), e.g. ours:prefix_aware:c0.25")


def parse_lbs(text: str) -> list[LBSpec]:
    """`ours:<policy>[:w<N>][:c<share>]` (our --workers, --cached-token-cost), `smg:<policy>`, `mini_lb`,
    comma-separated."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        kind, _, rest = item.partition(":")
        policy, *opts = rest.split(":") if rest else ("",)
        if kind not in ("ours", "mini_lb", "smg") or (kind != "mini_lb" and not policy) or (kind == "mini_lb" and policy):
            raise ValueError(f"LB {item!r}: use ours:<policy>[:w<N>][:c<share>], smg:<policy> or mini_lb")
        if opts and kind != "ours":
            raise ValueError(f"LB {item!r}: only ours takes a process count (:w<N>) or a cached-token cost (:c<share>)")
        out.append(LBSpec(kind, policy, **dict(_ours_option(item, o) for o in opts)))
    return out


@dataclass(frozen=True)
class Peer:
    """How to start a peer router: the argv up to its own flags, and what its environment adds."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def bundle_peers(lb_dir: Path) -> dict[str, Peer]:
    """The peers of run_all.sh's lb.tar.xz: each folder on its own router's PYTHONPATH only."""
    base = os.environ.get("PYTHONPATH", "")
    peers = {}
    for kind, sub, module in (("mini_lb", "minilb", "sglang_router.launch_router"), ("smg", "smg", "smg")):
        if (lb_dir / sub).is_dir():
            peers[kind] = Peer((sys.executable, "-m", module), (("PYTHONPATH", f"{lb_dir / sub}:{base}" if base else str(lb_dir / sub)),))
    return peers


def venv_peers(sglang_router_python: Optional[str], smg_python: Optional[str]) -> dict[str, Peer]:
    """Peers installed in virtualenvs of their own (bench/lb_sim/install_peers.sh)."""
    peers = {}
    if sglang_router_python:
        peers["mini_lb"] = Peer((sglang_router_python, "-m", "sglang_router.launch_router"))
    if smg_python:
        peers["smg"] = Peer((smg_python, "-m", "smg"))
    return peers


TREE_POLICIES = ("prefix_aware", "cache_aware")


def tree_blocks(cache_tokens: int) -> int:
    """Our prefix tree's size for a prefill radix cache of `cache_tokens` tokens: token-id prompts are 4 bytes
    a token and a tree entry is a 64-byte block (docs/lb.md: size --max-tree-size like one prefill's cache)."""
    return max(1, cache_tokens * 4 // 64)


def lb_command(spec: LBSpec, prefills: Sequence[tuple[str, int]], decodes: Sequence[str], port: int, peers: dict[str, Peer],
               admin_key: str, prom_port: int = 0, tree: Optional[int] = None,
               decisions: Optional[Path] = None) -> Optional[tuple[list[str], dict[str, str]]]:
    """argv and extra environment of one LB over every prefill and decode; None when the peer is absent.
    `tree`: our tree policies' --max-tree-size (blocks), with a 1 s eviction interval, as docs/lb.md advises;
    `decisions`: where ours logs every routing decision (--decision-log)."""
    workers: list[str] = []
    for url, bp in prefills:
        workers += ["--prefill", url, str(bp)]
    for url in decodes:
        workers += ["--decode", url]
    common = [*workers, "--host", "127.0.0.1", "--port", str(port)]
    if spec.kind == "ours":
        sized = ["--max-tree-size", str(tree), "--eviction-interval-secs", "1"] if tree and spec.policy in TREE_POLICIES else []
        procs = ["--workers", str(spec.workers)] if spec.workers > 1 else []
        logged = ["--decision-log", str(decisions)] if decisions is not None else []
        cached = ["--cached-token-cost", f"{spec.cached_cost:g}"] if spec.cached_cost else []
        return [sys.executable, "-m", "sglang_p2p_lb", *common, "--policy", spec.policy, *sized, *procs, *logged, *cached,
                "--admin-api-key", admin_key, "--log-level", "warning"], {}
    peer = peers.get(spec.kind)
    if peer is None:
        return None
    if spec.kind == "mini_lb":
        return [*peer.argv, "--pd-disaggregation", "--mini-lb", *common], dict(peer.env)
    return [*peer.argv, "launch", "--pd-disaggregation", *common, "--policy", spec.policy, "--disable-tokenizer-autoload",
            "--health-check-interval-secs", PEER_HEALTH_INTERVAL, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
            "--log-level", "warn"], dict(peer.env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LBProc:
    """One LB process in a session of its own (ended with one killpg); ready once a request goes through.
    ``start`` only launches it (several LBs start side by side); entering the context waits until it serves."""

    def __init__(self, spec: LBSpec, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.spec, self.argv, self.env, self.port, self.log = spec, argv, env, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "LBProc":
        if self.proc is not None:
            return self
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write("$ " + " ".join(self.argv) + "\n")
            f.flush()
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)
        from .servers import record_pid

        record_pid(self.proc.pid)
        return self

    def __enter__(self) -> "LBProc":
        self.start()
        try:
            wait_ready(self.url, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Ready when a one-token request goes through (peers register their workers asynchronously)."""
    body = json.dumps({"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"LB exited with {proc.returncode} before serving")
        try:
            req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return
        except Exception as e:  # not up yet, or no worker registered yet
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.3)
    raise TimeoutError(f"LB at {url} never served a request ({last})")


# ----------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class WorkloadParams:
    bursty_rate: float = 32.0  # requests/s (mean over the bursts)
    short_median: int = 300  # bursty: 85% short prompts (lognormal) ...
    long_min: int = 2000  # ... and 15% long ones, uniform in [long_min, long_max]
    long_max: int = 6000
    bursty_output_max: int = 64  # ... each asking for a quarter of this to this many tokens (fewer: the decode keeps up)
    chat_rate: float = 6.0  # shared_prefix conversations/s, 4 turns each
    chat_prefix: int = 2000
    turn_gap: float = 1.0  # seconds between the turns of a conversation (runs are short)
    long_rate: float = 1.5  # long_prefix conversations/s, 3 turns each
    long_prefix: int = 12000
    long_prefixes: int = 10  # 10 x 12k tokens: more than one prefill's radix cache (98k tokens), less than two
    question: int = 100
    answer: int = 50
    chat_output: int = 32  # tokens each turn of shared_prefix and long_prefix asks for


def make_workload(name: str, duration: float, seed: int, wp: WorkloadParams) -> list[Req]:
    if name == "bursty_mixed":
        return lb_real.bursty_mixed(duration, wp.bursty_rate, seed, wp.short_median, wp.long_min, wp.long_max,
                                    wp.bursty_output_max)
    if name == "shared_prefix":
        return lb_real.shared_prefix(duration, wp.chat_rate, seed, prefix_len=wp.chat_prefix, question=wp.question, answer=wp.answer,
                                     gap=wp.turn_gap, output=wp.chat_output)
    if name == "long_prefix":
        return lb_real.shared_prefix(duration, wp.long_rate, seed + 7919, n_prefixes=wp.long_prefixes, prefix_len=wp.long_prefix,
                                     turns=3, question=wp.question, answer=wp.answer, gap=wp.turn_gap, output=wp.chat_output)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def mean_prompt(name: str, wp: WorkloadParams) -> float:
    """Mean prompt tokens of a workload's requests (a minute of it; the lengths do not depend on the rate)."""
    reqs = make_workload(name, 60.0, 0, wp)
    return sum(len(r.input_ids) for r in reqs) / len(reqs)


def calibrated(wp: WorkloadParams, capacity_tok_s: dict[str, float], loads: dict[str, float],
               max_rps: float) -> tuple[WorkloadParams, dict[str, Any]]:
    """`wp` with the rates lb_layout.rates derives from the measured capacities; unchanged when one is missing."""
    if not capacity_tok_s or min(capacity_tok_s.values()) <= 0:
        return wp, {"error": f"no capacity measured ({capacity_tok_s}): the default rates stay"}
    table = lb_layout.rates(capacity_tok_s, {wl: mean_prompt(wl, wp) for wl in capacity_tok_s}, loads, max_rps)
    fields = {lb_layout.RATE_FIELD[wl]: row[lb_layout.RATE_FIELD[wl]] for wl, row in table.items()}
    return dataclasses.replace(wp, **fields), table


# ----------------------------------------------------------------------------- servers
#: (requests, prompt tokens, cached prompt tokens[, KV transfer ms summed, KV transfers, KV transfer MB summed,
#: waiting-queue seconds summed, requests that left the waiting queue])
Counts = tuple[Optional[float], ...]
#: SGLang's counters of the prompt tokens a server took and of those its prefix cache held
TOKEN_COUNTERS = ("sglang:prompt_tokens_total", "sglang:cached_tokens_total")


class Cluster:
    """The PD servers every LB runs in front of: addresses, kill -9, restart, flush, request counters."""

    prefills: list[tuple[str, int]]
    decodes: list[str]

    def urls(self) -> list[str]:
        return [u for u, _ in self.prefills] + list(self.decodes)

    def url_of(self, role: str, i: int) -> str:
        return self.prefills[i][0] if role == "prefill" else self.decodes[i]

    def kill(self, role: str, i: int) -> None:
        raise NotImplementedError

    def restart(self, victims: Sequence[tuple[str, int]], timeout_s: float) -> list[str]:
        """Start the killed servers again, return the names that serve (blocks until then or the timeout)."""
        raise NotImplementedError

    def served(self, url: str) -> Optional[float]:
        """Requests the server has taken so far (its own counter), None when it does not answer."""
        raise NotImplementedError

    def load(self, url: str) -> Optional[LoadSample]:
        """The server's queue and running requests now (SGLang's gauges on /metrics, which simworker exports
        too); None when it does not answer in time or lacks them."""
        return parse_load(promparse.fetch(url, SAMPLE_TIMEOUT_S))

    def counts(self) -> dict[str, Counts]:
        """Every prefill's counters now: (requests, prompt tokens, cached prompt tokens); None for a counter the
        server does not export or when it does not answer (here: the request counter only)."""
        return {u: (self.served(u), None, None) for u, _ in self.prefills}

    def flush(self) -> None:
        lb_real.flush_all([_Url(u) for u in self.urls()])


@dataclass(frozen=True)
class _Url:
    url: str


def transport_env(transport: str, name: str) -> dict[str, str]:
    """nccl: NCCL over loopback sockets, an NCCL_HOSTID per server (e2e/config.py says why); cudaipc: the
    same-host copy kernel straight into the decode's pools, what SGLANG_P2P_TRANSPORT=auto picks on one host;
    auto: one server per GPU, p2pnccl's own choice (CUDA IPC between the GPUs of one host)."""
    if transport == "auto":
        return {"SGLANG_P2P_TRANSPORT": "auto"}
    if transport == "cudaipc":
        return {"SGLANG_P2P_TRANSPORT": "cudaipc"}
    if transport == "nccl":
        return {"SGLANG_P2P_TRANSPORT": "nccl", **lb_real._one_gpu_env(name)}
    raise ValueError(f"transport must be nccl, cudaipc or auto, got {transport!r}")


class SGLangCluster(Cluster):
    """Real SGLang servers placed as lb_layout.placement says, started through e2e.servers.Stack."""

    def __init__(self, stack: Any, model: Path, where: Sequence[tuple[str, int, int]], flags: Sequence[str], decode_flags: Sequence[str],
                 transport: str = "nccl") -> None:
        from . import config
        from .servers import Server

        self.stack = stack
        self.servers: dict[tuple[str, int], Any] = {}
        for role, i, gpu in where:
            name = f"lbc-{role}{i}"
            env = {**config.COMMON_ENV, **transport_env(transport, name)}
            port = lb_real.BASE_PORT + (i if role == "prefill" else 4 + i)
            args = list(flags if role == "prefill" else decode_flags)
            self.servers[(role, i)] = Server(name, port, role, model, gpu=gpu, backend="p2pnccl",
                                             bootstrap_port=port + 10 if role == "prefill" else None, args=args, env=env)
        self.prefills = [(s.url, s.bootstrap_port) for (r, _), s in self.servers.items() if r == "prefill"]
        self.decodes = [s.url for (r, _), s in self.servers.items() if r == "decode"]

    def launch(self, lanes: int) -> list[str]:
        up = self.stack.launch(list(self.servers.values()), lanes=lanes)
        return [s.name for s in up]

    def kill(self, role: str, i: int) -> None:
        s = self.servers[(role, i)]
        os.killpg(s.proc.pid, signal.SIGKILL)

    def restart(self, victims, timeout_s):
        servers = [self.servers[v] for v in victims]
        for s in servers:
            if s in self.stack.servers:
                self.stack.servers.remove(s)
        return [s.name for s in self.stack.launch(servers, timeout_s=timeout_s, lanes=len(servers))]

    def served(self, url):
        return self._counts(url)[0]

    def counts(self):
        return {u: self._counts(u) for u, _ in self.prefills}

    @staticmethod
    def _counts(url: str) -> Counts:
        """One /metrics read: (requests, prompt tokens, cached prompt tokens, KV transfer ms summed, KV transfers,
        KV transfer MB summed: the prefill's transfer-queue entry to completion, SGLang's histograms; the waiting
        queue's seconds summed and count, `promparse.QUEUE_TIME`); all None when it does not answer."""
        text = promparse.fetch(url, 5)
        if text is None:
            return (None,) * 8
        kv = promparse.histogram_totals(text, promparse.KV_TRANSFER_LATENCY)
        mb = promparse.histogram_totals(text, promparse.KV_TRANSFER_MB)
        queue = promparse.histogram_totals(text, promparse.QUEUE_TIME)
        return (promparse.sample_total(text, "sglang:num_requests_total") or 0.0,
                *(promparse.sample_total(text, name) for name in TOKEN_COUNTERS),
                None if kv is None else kv.sum, None if kv is None else kv.count, None if mb is None else mb.sum,
                None if queue is None else queue.sum, None if queue is None else queue.count)


class SimCluster(Cluster):
    """Simulated workers (simworker) as processes of their own, so kill -9 is real."""

    def __init__(self, n_p: int, n_d: int, knobs: Sequence[str], log_dir: Path) -> None:
        self.knobs, self.log_dir = list(knobs), log_dir
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.argv: dict[tuple[str, int], list[str]] = {}
        self.prefills, self.decodes = [], []
        for role, n in (("prefill", n_p), ("decode", n_d)):
            for i in range(n):
                port = free_port()
                argv = [sys.executable, "-m", "simworker", "--role", role, "--host", "127.0.0.1", "--port", str(port), *self.knobs]
                if role == "prefill":
                    bp = free_port()
                    argv += ["--bootstrap-port", str(bp)]
                    self.prefills.append((f"http://127.0.0.1:{port}", bp))
                else:
                    self.decodes.append(f"http://127.0.0.1:{port}")
                self.argv[(role, i)] = argv

    def _start(self, key: tuple[str, int]) -> None:
        log = self.log_dir / f"sim-{key[0]}{key[1]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            self.procs[key] = subprocess.Popen(self.argv[key], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait(self, keys, timeout_s: float) -> list[str]:
        end, up = time.monotonic() + timeout_s, []
        pending = list(keys)
        while pending and time.monotonic() < end:
            for k in list(pending):
                url = self.url_of(*k)
                try:
                    with urllib.request.urlopen(url + "/health", timeout=1) as r:
                        if r.status == 200:
                            up.append(f"sim-{k[0]}{k[1]}")
                            pending.remove(k)
                except OSError:
                    pass
            time.sleep(0.05)
        return up

    def launch(self, lanes: int = 1) -> list[str]:
        for k in self.argv:
            self._start(k)
        return self._wait(list(self.argv), 30)

    def kill(self, role, i):
        os.killpg(self.procs[(role, i)].pid, signal.SIGKILL)
        self.procs[(role, i)].wait(5)

    def restart(self, victims, timeout_s):
        for k in victims:
            self._start(k)
        return self._wait(list(victims), timeout_s)

    def served(self, url):
        try:
            with urllib.request.urlopen(url + "/stats", timeout=5) as r:
                return float(json.loads(r.read())["requests"])
        except Exception:
            return None

    def stop(self) -> None:
        kill_groups([p.pid for p in self.procs.values()])  # a server's children too, where its launcher went first
        for p in self.procs.values():
            p.wait(5)


# ----------------------------------------------------------------------------- server load (evidence)
QUEUE_GAUGE = "sglang:num_queue_reqs"  # SGLang's scheduler gauges (one sample per DP rank, summed)
RUNNING_GAUGE = "sglang:num_running_reqs"
#: PD's own queues, outside the two above: a prefill's requests waiting for their decode (bootstrap) or for their
#: KV to be sent (inflight), a decode's waiting for pages (prealloc) or for their KV to arrive (transfer)
PD_QUEUE_GAUGES = ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_inflight_queue_reqs",
                   "sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs")
#: their short names, in order, for each one's mean (`pd_queue_parts_mean`): summed, a prefill's requests waiting
#: for their decode's pages (bootstrap) read the same as those whose KV is being sent (inflight)
PD_QUEUE_PARTS = ("bootstrap", "inflight", "prealloc", "transfer")
SAMPLE_S = 0.5  # sampling period during a run
SAMPLE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class LoadSample:
    """One server's load at one instant: requests waiting in its queue and requests running."""

    queue: float
    running: float
    #: PD's queues summed (PD_QUEUE_GAUGES), None where the server exports none of them (not a missing sample)
    pd_queue: Optional[float] = None
    #: each of PD_QUEUE_GAUGES on its own (None for one the server does not export); () where it exports none
    pd_parts: tuple[Optional[float], ...] = ()


def parse_load(text: Optional[str]) -> Optional[LoadSample]:
    """The load gauges of one /metrics text; None (a missing sample) when the text or either gauge is absent,
    so a server that does not export them is not read as idle."""
    if text is None:
        return None
    queue, running = promparse.sample_total(text, QUEUE_GAUGE), promparse.sample_total(text, RUNNING_GAUGE)
    if queue is None or running is None:
        return None
    parts = tuple(promparse.sample_total(text, g) for g in PD_QUEUE_GAUGES)
    pd = [v for v in parts if v is not None]
    return LoadSample(queue, running, sum(pd) if pd else None, parts if pd else ())


class LoadSampler:
    """While a run is in flight (``with LoadSampler(...):``), `probe(url)` every `interval` s for every server,
    each server in a daemon thread of its own so that one slow to answer delays only its own samples; a probe
    that fails appends None (missing). The run never waits on it beyond the last probe's timeout."""

    def __init__(self, probe: Callable[[str], Optional[LoadSample]], urls: Sequence[str], interval: float = SAMPLE_S) -> None:
        self.probe, self.interval = probe, interval
        self.samples: dict[str, list[Optional[LoadSample]]] = {u: [] for u in urls}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(u,), daemon=True, name=f"load-{u}") for u in urls]

    def _loop(self, url: str) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                sample = self.probe(url)
            except Exception:  # evidence only: a probe must never end the run
                sample = None
            self.samples[url].append(sample)
            # a probe slower than the period skips the slots it overran rather than catching up in a burst
            due = max(due + self.interval, time.monotonic())
            self._stop.wait(max(0.0, due - time.monotonic()))

    def __enter__(self) -> "LoadSampler":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(SAMPLE_TIMEOUT_S + 1)


def server_load(samples: Sequence[Optional[LoadSample]]) -> dict[str, Any]:
    """One server's samples of a run: how many answered and how many were missing; mean and max of its queue,
    of its running requests and mean of both together (`load_mean`); the figures are None without samples."""
    ok = [x for x in samples if x is not None]
    out: dict[str, Any] = {"samples": len(ok), "missing": len(samples) - len(ok)}
    for key, xs in (("queue", [x.queue for x in ok]), ("running", [x.running for x in ok])):
        out[f"{key}_mean"] = round(statistics.fmean(xs), 3) if xs else None
        out[f"{key}_max"] = max(xs) if xs else None
    out["load_mean"] = round(statistics.fmean(x.queue + x.running for x in ok), 3) if ok else None
    pd = [x.pd_queue for x in ok if x.pd_queue is not None]
    out["pd_queue_mean"] = round(statistics.fmean(pd), 3) if pd else None
    out["pd_queue_max"] = max(pd) if pd else None
    parts = {}
    for k, name in enumerate(PD_QUEUE_PARTS):
        xs = [x.pd_parts[k] for x in ok if len(x.pd_parts) > k and x.pd_parts[k] is not None]
        if xs:
            parts[name] = round(statistics.fmean(xs), 3)
    out["pd_queue_parts_mean"] = parts or None
    return out


def imbalance(means: Sequence[Optional[float]]) -> Optional[float]:
    """Max over servers of their mean load divided by the mean over servers: 1.0 is even, n is one server of n
    taking all of it. Servers without samples (None) are left out; None when none has any; 1.0 when all idle."""
    xs = [m for m in means if m is not None]
    if not xs:
        return None
    avg = statistics.fmean(xs)
    return round(max(xs) / avg, 3) if avg > 0 else 1.0


def load_evidence(prefills: dict[str, Sequence[Optional[LoadSample]]], decodes: dict[str, Sequence[Optional[LoadSample]]],
                  interval_s: float = SAMPLE_S) -> dict[str, Any]:
    """A run's server-side evidence from each server's samples (by URL, in the cluster's order): per server
    `server_load` (under `server_load`), and for the run each role's imbalance and the largest prefill queue."""
    per_role = {role: [{"url": u, **server_load(xs)} for u, xs in by_url.items()] for role, by_url in (("prefill", prefills), ("decode", decodes))}
    out: dict[str, Any] = {f"{role}_imbalance": imbalance([x["load_mean"] for x in servers]) for role, servers in per_role.items()}
    out["prefill_queue_max"] = max((x["queue_max"] for x in per_role["prefill"] if x["queue_max"] is not None), default=None)
    out["decode_pd_queue_mean"] = decode_pd_queue(per_role["decode"])
    out["server_load"] = {"interval_s": interval_s, **per_role}
    return out


def prefill_shares(before: dict[str, Counts], after: dict[str, Counts]) -> dict[str, Any]:
    """What each prefill took during a run, from its counters before and after (None where one is missing):
    requests, prompt tokens and cached prompt tokens; and the largest share of the run's requests one prefill
    took (`prefill_request_share_max`: 1/n is even, 1.0 is all on one). The routing's concentration, for
    every LB alike, without its decision log. Where the prefill exports SGLang's KV transfer histograms, also
    its transfers' mean time from the transfer queue to done (`kv_transfer_ms_mean`: waiting behind its other
    sends included) and the GB/s that makes (`kv_transfer_gb_s`): whether a prefill that got more requests
    also sent more slowly; and where it exports `promparse.QUEUE_TIME`, its requests' mean wait for a first forward
    (`queue_ms_mean`): whether the routing made a prefill's queue, which its TTFT then carries."""
    per = []
    for url, b in before.items():
        a = after.get(url) or ()
        d = [None if i >= len(b) or i >= len(a) or b[i] is None or a[i] is None else max(0.0, a[i] - b[i]) for i in range(8)]
        row: dict[str, Any] = {"url": url, **dict(zip(("requests", "prompt_tokens", "cached_tokens"), d[:3]))}
        ms, n, mb, queue_s, queued = d[3:]
        if ms is not None and n:
            row["kv_transfer_ms_mean"] = round(ms / n, 2)
            row["kv_transfer_gb_s"] = round(mb / 1024 / (ms / 1e3), 2) if mb is not None and ms > 0 else None
        if queue_s is not None and queued:
            row["queue_ms_mean"] = round(1e3 * queue_s / queued, 2)
        per.append(row)
    reqs = [r["requests"] for r in per if r["requests"] is not None]
    total = sum(reqs)
    share = round(max(reqs) / total, 3) if reqs and total and len(reqs) == len(per) else None
    return {"prefill_request_share_max": share, "prefill_counts": per}


def decode_pd_queue(decodes: Sequence[dict[str, Any]]) -> Optional[float]:
    """Requests the decodes held in their PD queues (waiting for KV memory or for their transfer), summed over
    the decodes, mean over the run: how long requests wait for a decode rather than for a prefill or the LB."""
    xs = [x["pd_queue_mean"] for x in decodes if x.get("pd_queue_mean") is not None]
    return round(sum(xs), 3) if xs else None


def _server_text(x: dict[str, Any]) -> str:
    if not x["samples"]:
        return "-"
    return f"q {x['queue_mean']:.1f}/{x['queue_max']:g} r {x['running_mean']:.1f}/{x['running_max']:g}"


def evidence_line(run: dict[str, Any]) -> str:
    """One line of a run's server-side evidence: per server queue and running (mean/max), per role the imbalance."""
    load = run["server_load"]
    roles = [f"{role} [{', '.join(_server_text(x) for x in load[role])}] imbalance {run[f'{role}_imbalance']}" for role in ("prefill", "decode")]
    servers = load["prefill"] + load["decode"]
    missing = sum(x["missing"] for x in servers)
    return f"servers (queue q, running r: mean/max): {'; '.join(roles)}; {missing}/{missing + sum(x['samples'] for x in servers)} samples missing"


# ----------------------------------------------------------------------------- planning and figures
@dataclass(frozen=True)
class Plan:
    run_s: float
    workloads: tuple[str, ...]
    reps: int
    dropped: tuple[str, ...] = ()
    note: str = ""


def plan(budget_s: float, n_lbs: int, workloads: Sequence[str], reps: int, max_run_s: float, min_run_s: float,
         lb_start_s: float, run_overhead_s: float, fault_s: float, drain_frac: float = 0.0) -> Plan:
    """The longest run time per workload (up to max_run_s, in tenths of a second) that fits the budget; workloads
    are dropped from the end when not even min_run_s fits. A repetition's LBs start side by side (one
    lb_start_s per repetition); a run lasts run_s x (1 + drain_frac) (the queue a run leaves drains) plus
    run_overhead_s (cache flush, the last answers)."""
    kept = list(workloads)
    while kept:
        runs = n_lbs * len(kept) * reps
        left = budget_s - fault_s - reps * lb_start_s - runs * run_overhead_s
        run_s = min(max_run_s, math.floor(10 * left / (runs * (1 + drain_frac))) / 10)
        if run_s >= min_run_s:
            return Plan(run_s, tuple(kept), reps, tuple(w for w in workloads if w not in kept))
        kept.pop()
    return Plan(0.0, (), reps, tuple(workloads), f"{budget_s:.0f} s left: not even one {min_run_s:g} s run per LB fits")


FIGURES = ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p99", "output_throughput", "cache_hit_rate", "num_failed")
# the servers' side (load_evidence) and the cold/warm split of TTFT (cold_warm); absent from older results
EVIDENCE = ("prefill_imbalance", "prefill_queue_max", "decode_imbalance", "decode_pd_queue_mean",
            "ttft_ms_p99_cold", "ttft_ms_p99_warm", "prefill_request_share_max")
#: seconds at the start of a run whose requests count as cold: every run starts on flushed caches, and with
#: 12k-token prefixes the first miss of each one keeps the prefills busy for ~1-2 s (2026-11-28, x4 2P2D)
COLD_S = 3.0


def ttft_timeline(answers: Sequence[lb_real.Answer], bin_s: float = 1.0) -> list[list[float]]:
    """[second, answers, TTFT p50 ms, TTFT p99 ms] for each `bin_s` of the run by when the requests were sent (good
    answers only): where in a run its slow requests were, e.g. the cold start against the steady state."""
    bins: dict[int, list[float]] = {}
    for a in answers:
        if a.record.ok and a.record.ttft_s is not None:
            bins.setdefault(int(a.sent_at // bin_s), []).append(a.record.ttft_s * 1e3)
    return [[round(k * bin_s, 3), len(v), round(lb_real.percentile(v, 50), 1), round(lb_real.percentile(v, 99), 1)]
            for k, v in sorted(bins.items())]


def cold_warm(answers: Sequence[lb_real.Answer], cold_s: float) -> dict[str, Any]:
    """TTFT p99 of the good answers sent in the first `cold_s` seconds of the run and of those sent later: which
    part of a run's p99 is its caches being built, which the routing once they are."""
    out: dict[str, Any] = {"cold_s": cold_s}
    for part, keep in (("cold", lambda a: a.sent_at < cold_s), ("warm", lambda a: a.sent_at >= cold_s)):
        ttft = [a.record.ttft_s for a in answers if a.record.ok and a.record.ttft_s is not None and keep(a)]
        p99 = lb_real.percentile(ttft, 99)
        out[f"ttft_ms_p99_{part}"] = None if p99 is None else round(p99 * 1e3, 3)
        out[f"{part}_requests"] = len(ttft)
    return out


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread (min, max) of each figure and of the servers' evidence over the repetitions."""
    empty = [r for r in runs if not r.get("num_requests")]
    runs = [r for r in runs if r.get("num_requests")]
    out: dict[str, Any] = {"reps": len(runs), "empty_runs": len(empty)}
    for k in (*FIGURES, *EVIDENCE):
        xs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = {"median": round(statistics.median(xs), 4), "min": min(xs), "max": max(xs)} if xs else None
    return out


def _med(agg: dict, name: str, wl: str, fig: str) -> Optional[float]:
    cell = agg.get(name, {}).get(wl, {}).get(fig)
    return None if cell is None else cell["median"]


def targets(agg: dict[str, dict[str, Any]], workloads: Sequence[str]) -> list[dict[str, Any]]:
    """Our targets per workload, on the medians: our best TTFT p99 at least 20% below the best peer's,
    output tok/s no lower; on shared-prefix workloads a hit rate at least smg cache_aware's and a lower p50."""
    ours = [n for n in agg if n.startswith("ours:")]
    peers = [n for n in agg if not n.startswith("ours:")]
    out = []
    for wl in workloads:
        p99 = {n: _med(agg, n, wl, "ttft_ms_p99") for n in agg}
        tput = {n: _med(agg, n, wl, "output_throughput") for n in agg}
        ours_ok = [n for n in ours if p99[n] is not None]
        peers_ok = [n for n in peers if p99[n] is not None]
        if not ours_ok or not peers_ok:
            continue
        best_ours = min(ours_ok, key=lambda n: p99[n])
        best_peer = min(peers_ok, key=lambda n: p99[n])
        row = {"workload": wl, "ours": best_ours, "ours_ttft_p99": p99[best_ours], "best_peer": best_peer, "peer_ttft_p99": p99[best_peer],
               "p99_vs_peer": round(p99[best_ours] / p99[best_peer] - 1, 3) if p99[best_peer] else None}
        row["p99_met"] = row["p99_vs_peer"] is not None and row["p99_vs_peer"] <= -0.2
        warm = {n: _med(agg, n, wl, "ttft_ms_p99_warm") for n in agg}
        if warm[best_ours] is not None and any(warm[n] is not None for n in peers_ok):
            warm_peer = min((n for n in peers_ok if warm[n] is not None), key=lambda n: warm[n])
            row.update(warm_best_peer=warm_peer, ours_warm_p99=warm[best_ours], peer_warm_p99=warm[warm_peer],
                       warm_p99_vs_peer=round(warm[best_ours] / warm[warm_peer] - 1, 3) if warm[warm_peer] else None)
        top_peer_tput = max((tput[n] for n in peers_ok if tput[n] is not None), default=None)
        row["tput_met"] = top_peer_tput is not None and tput[best_ours] is not None and tput[best_ours] >= top_peer_tput
        if wl in ("shared_prefix", "long_prefix") and "smg:cache_aware" in agg:
            hit = {n: _med(agg, n, wl, "cache_hit_rate") for n in ("smg:cache_aware", *ours_ok)}
            p50 = {n: _med(agg, n, wl, "ttft_ms_p50") for n in ("smg:cache_aware", *ours_ok)}
            best_hit = max(ours_ok, key=lambda n: hit[n] or 0)
            row.update(ours_hit=best_hit, hit_rate=hit[best_hit], smg_hit_rate=hit["smg:cache_aware"], ttft_p50=p50[best_hit], smg_ttft_p50=p50["smg:cache_aware"])
            row["prefix_met"] = None not in (hit[best_hit], hit["smg:cache_aware"], p50[best_hit], p50["smg:cache_aware"]) and \
                hit[best_hit] >= hit["smg:cache_aware"] and p50[best_hit] < p50["smg:cache_aware"]
        out.append(row)
    return out


# ----------------------------------------------------------------------------- runs
def common_reps(runs: dict[str, dict[str, list]]) -> dict[str, int]:
    """Per workload, the repetitions every LB that ran it completed (runs are kept in repetition order)."""
    out: dict[str, int] = {}
    for by_wl in runs.values():
        for wl, rs in by_wl.items():
            if rs:
                out[wl] = min(out.get(wl, len(rs)), len(rs))
    return out


def summarize_compare(doc: dict[str, Any], workloads: Sequence[str]) -> None:
    """`aggregate` and `targets` from the runs in `doc`, over the repetitions every LB completed (a repetition
    cut short leaves its runs in `runs`, outside the medians: `reps_compared` says how many went in)."""
    runs = doc.get("runs") or {}
    n = common_reps(runs)
    agg = {name: {wl: aggregate(rs[: n[wl]]) for wl, rs in by_wl.items() if rs} for name, by_wl in runs.items() if any(by_wl.values())}
    doc.update(aggregate=agg, targets=targets(agg, workloads), reps_compared=n)


def in_flight_at(a: lb_real.Answer, times: Sequence[float]) -> bool:
    """Whether the request was sent before one of `times` (seconds into the run) and answered after it."""
    end = a.sent_at + (a.record.e2e_s or 0.0)
    return any(a.sent_at < t <= end for t in times)


T = TypeVar("T")


def rotated(specs: Sequence[T], rep: int) -> list[T]:
    """`specs` rotated left by `rep` (each one goes first once in len(specs) repetitions)."""
    k = rep % len(specs)
    return list(specs[k:]) + list(specs[:k])


class Harness:
    def __init__(self, cluster: Cluster, peers: dict[str, Peer], logs: Path, wp: WorkloadParams, client_timeout: float = 60.0, tree: Optional[int] = None,
                 sample_s: float = SAMPLE_S, cold_s: float = COLD_S) -> None:
        self.cluster, self.peers, self.logs, self.wp, self.client_timeout, self.tree = cluster, peers, logs, wp, client_timeout, tree
        self.sample_s, self.cold_s = sample_s, cold_s
        self.admin_key = os.urandom(16).hex()

    def lb(self, spec: LBSpec, tag: str) -> Optional[LBProc]:
        port = free_port()
        name = f"lb-{spec.name.replace(':', '-')}-{tag}"
        # ours logs its decisions beside its log (they travel back in the call's log archive): the evidence of
        # where each request went and what every server looked like to it then
        cmd = lb_command(spec, self.cluster.prefills, self.cluster.decodes, port, self.peers, self.admin_key, prom_port=free_port(),
                         tree=self.tree, decisions=self.logs / f"{name}-decisions.jsonl" if spec.kind == "ours" else None)
        if cmd is None:
            return None
        return LBProc(spec, cmd[0], cmd[1], port, self.logs / f"{name}.log")

    def warm_up(self, workloads: Sequence[str], seconds: float, calibrate_pool: int = 0) -> dict[str, Any]:
        """Every workload's shapes through every server (round robin), then cold caches again. With
        `calibrate_pool` (a prefill's pool in tokens) also the prefill capacity per workload (`capacity`)."""
        out: dict[str, Any] = {}
        proc = self.lb(LBSpec("ours", "round_robin"), "warmup")
        assert proc is not None
        with proc:
            for wl in workloads:
                answers, wall = asyncio.run(lb_real.open_loop(proc.url, make_workload(wl, seconds, 10_000, self.wp), self.client_timeout))
                out[wl] = lb_real.summarize(answers, wall)
            if calibrate_pool:
                out["capacity_tok_s"] = {wl: self.capacity(proc.url, wl, calibrate_pool) for wl in workloads}
        self.cluster.flush()
        return out

    def capacity(self, url: str, wl: str, pool_tokens: int) -> float:
        """Prefill tokens/s of the whole cluster at `wl`'s mean prompt length: a burst of fresh prompts (one output
        token each) sent at once on cold caches, their tokens over the time until the last answer."""
        length = round(mean_prompt(wl, self.wp))
        n = lb_layout.burst_size(len(self.cluster.prefills), length, pool_tokens)
        rng = random.Random(length)
        self.cluster.flush()
        answers, wall = asyncio.run(lb_real.open_loop(url, [Req(0.0, lb_real._ids(rng, length), 1) for _ in range(n)], self.client_timeout))
        ok = sum(1 for a in answers if a.record.ok)
        return round(ok * length / wall, 1) if ok == n else 0.0

    def compare(self, specs: Sequence[LBSpec], p: Plan, seed: int, doc: dict[str, Any], stop_at: float = float("inf"),
                lb_run_s: float = 0.0, rep_s_planned: float = 0.0, log: Callable[[str], None] = print) -> None:
        """Every repetition of every LB into `doc` as it goes (a run cut off by the step's timeout keeps what
        it has). A repetition starts only if it ends before `stop_at` (monotonic) at the length planned
        (`rep_s_planned`) or measured for an earlier one, whichever is longer; within one, no LB run starts
        that would end after `stop_at`, `lb_run_s` being its length."""
        runs: dict[str, dict[str, list]] = {s.name: {wl: [] for wl in p.workloads} for s in specs}
        order: list[list[str]] = []
        skipped: dict[str, str] = {}
        doc.update(order=order, runs=runs, skipped=skipped)
        rep_s = 0.0  # the longest repetition so far: runs that queue drain longer than the plan says
        for rep in range(p.reps):
            loads = {wl: make_workload(wl, p.run_s, seed + rep, self.wp) for wl in p.workloads}
            order.append([s.name for s in rotated(specs, rep)])
            need, left = max(rep_s, rep_s_planned, lb_run_s), stop_at - time.monotonic()
            if need > left:
                # a repetition only where every LB gets its turn: medians over unequal counts would favour
                # whichever LBs went first
                return self._cut(doc, p, f"out of time before rep {rep}: {need:.1f} s a repetition, {left:.1f} s left", log)
            rep_start = time.monotonic()
            # the rep's LBs start side by side (fresh processes, no prefix tree from an earlier rep) and run in turn
            procs = self._start_all([s for s in rotated(specs, rep) if s.name not in skipped], rep, skipped)
            try:
                for spec, proc in procs:
                    if time.monotonic() + lb_run_s > stop_at:
                        return self._cut(doc, p, f"out of time before rep {rep} of {spec.name}", log)
                    try:
                        with proc:
                            for wl, reqs in loads.items():
                                runs[spec.name][wl].append(self._run(proc.url, reqs))
                                s = runs[spec.name][wl][-1]
                                log(f"[lb_compare] rep {rep} {spec.name} {wl}: ttft p50/p99 {s['ttft_ms_p50']}/{s['ttft_ms_p99']} ms "
                                    f"(p99 cold/warm {s.get('ttft_ms_p99_cold')}/{s.get('ttft_ms_p99_warm')}), "
                                    f"hit {s['cache_hit_rate']}, failed {s['num_failed']}/{s['num_requests']}")
                                log(f"[lb_compare] rep {rep} {spec.name} {wl}: {evidence_line(s)}")
                    except (RuntimeError, TimeoutError) as e:
                        skipped[spec.name] = f"rep {rep}: {e}"
                        log(f"[lb_compare] {spec.name} rep {rep} did not run: {e}")
            finally:
                for _, proc in procs:
                    proc.__exit__()
            rep_s = max(rep_s, time.monotonic() - rep_start)
        summarize_compare(doc, p.workloads)

    def _cut(self, doc: dict[str, Any], p: Plan, why: str, log: Callable[[str], None]) -> None:
        doc["cut_short"] = why
        log(f"[lb_compare] {why}")
        summarize_compare(doc, p.workloads)

    def _start_all(self, specs: Sequence[LBSpec], rep: int, skipped: dict[str, str]) -> list[tuple[LBSpec, LBProc]]:
        """Launch every LB of a repetition; a peer that is not installed is noted in `skipped`."""
        out = []
        for spec in specs:
            proc = self.lb(spec, f"rep{rep}")
            if proc is None:
                skipped[spec.name] = "peer not installed (no lb.tar.xz / --*-python)"
            else:
                out.append((spec, proc.start()))
        return out

    def _run(self, url: str, reqs: Sequence[Req]) -> dict[str, Any]:
        """One open-loop run on cold caches, the servers' load sampled while it is in flight (load_evidence)."""
        self.cluster.flush()
        before = self.cluster.counts()
        with LoadSampler(self.cluster.load, self.cluster.urls(), self.sample_s) as sampler:
            answers, wall = asyncio.run(lb_real.open_loop(url, reqs, self.client_timeout))
        s = lb_real.summarize(answers, wall)
        s.update(prefill_shares(before, self.cluster.counts()))
        s["errors"] = s["errors"][:5]
        s.update(cold_warm(answers, self.cold_s), ttft_timeline=ttft_timeline(answers))
        s.update(load_evidence({u: sampler.samples[u] for u, _ in self.cluster.prefills},
                               {u: sampler.samples[u] for u in self.cluster.decodes}, self.sample_s))
        return s

    def faults(self, specs: Sequence[LBSpec], duration: float, rate: float, seed: int, restart_timeout: float, probe_s: float = 20.0,
               log: Callable[[str], None] = print, out: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """All LBs at once, each with its own client; SIGKILL prefill 0 then decode 0, restart both. Filled into
        `out` as it goes, so what a step's timeout cut off keeps what was measured."""
        procs = [(s, self.lb(s, "faults")) for s in specs]
        procs = [(s, p) for s, p in procs if p is not None]
        victims = [("prefill", 0), ("decode", 0)]
        kill_at = [duration / 5, 2 * duration / 5]
        started: list[LBProc] = []
        out = {} if out is None else out
        out["not_started"] = {}
        try:
            started += [p.start() for _, p in procs]  # side by side; each is waited for below
            for s, p in list(procs):
                try:
                    p.__enter__()
                except (RuntimeError, TimeoutError) as e:
                    out["not_started"][s.name] = str(e)[:300]
                    procs.remove((s, p))
            if not procs:
                return out
            per_lb = {s.name: make_workload("bursty_mixed", duration, seed + k, dataclasses.replace(self.wp, bursty_rate=rate / len(procs))) for k, (s, _) in enumerate(procs)}
            restarted: dict[str, Any] = {}

            def restart() -> None:
                restarted["names"] = self.cluster.restart(victims, restart_timeout)
                restarted["healthy_at"] = time.monotonic()

            async def drive():
                t0 = time.perf_counter()
                t0_mono = time.monotonic()
                killed = []

                async def killer():
                    for when, v in zip(kill_at, victims):
                        await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
                        self.cluster.kill(*v)
                        killed.append(round(time.perf_counter() - t0, 3))
                        log(f"[lb_compare] killed {v[0]} {v[1]} at {killed[-1]} s")
                    th = threading.Thread(target=restart, daemon=True)
                    th.start()
                    return th

                async def one_lb(name, url):
                    return name, await lb_real.open_loop(url, per_lb[name], self.client_timeout)

                res = await asyncio.gather(killer(), *(one_lb(s.name, p.url) for s, p in procs))
                return t0_mono, killed, res[0], dict(res[1:])

            t0_mono, killed, thread, results = asyncio.run(drive())
            out["killed"] = [{"role": r, "index": i, "at_s": t} for (r, i), t in zip(victims, killed)]
            # the errors are kept before the restart is waited for (a timeout there keeps them), then once more
            # with the restart's time (3P1D's window without a decode ends there)
            self._split_errors(out, results, killed, victims, None)
            thread.join(restart_timeout + 30)
            out["restarted"] = restarted.get("names", [])
            back_at = restarted["healthy_at"] - t0_mono if "healthy_at" in restarted else None
            if back_at is not None:
                out["restart_s"] = round(back_at - killed[-1], 1)
            self._split_errors(out, results, killed, victims, back_at)
            if len(restarted.get("names", [])) == len(victims):
                back = self.back_in_rotation(procs, [self.cluster.url_of(*v) for v in victims], probe_s, since=restarted["healthy_at"])
                for name, b in back.items():
                    out["per_lb"][name]["back_in_rotation_s"] = b
            return out
        finally:
            for p in started:
                p.__exit__()

    def _split_errors(self, out: dict[str, Any], results: dict[str, Any], killed: Sequence[float], victims: Sequence[tuple[str, int]],
                      back_at: Optional[float]) -> None:
        """Per LB the client errors: in flight at a kill, sent while no server of a killed one's role was left
        (until `back_at`, seconds into the run; None: not back), and the rest."""
        end = float("inf") if back_at is None else back_at
        # a killed server that was the only one of its role (3P1D's decode): nothing could serve meanwhile
        down = [(t, end) for (role, _), t in zip(victims, killed) if len(self.cluster.prefills if role == "prefill" else self.cluster.decodes) == 1]
        out["no_server_of_a_role_s"] = [[round(a, 2), None if b == float("inf") else round(b, 2)] for a, b in down]
        per_lb = out.setdefault("per_lb", {})
        for name, (answers, wall) in results.items():
            bad = [a for a in answers if not a.record.ok]
            none_up = [a for a in bad if not in_flight_at(a, killed) and any(lo <= a.sent_at <= hi for lo, hi in down)]
            per_lb.setdefault(name, {}).update({
                "requests": len(answers),
                "client_errors": len(bad),
                "errors_in_flight_at_a_kill": sum(1 for a in bad if in_flight_at(a, killed)),
                "errors_while_no_server_of_a_role": len(none_up),
                "errors_beyond_in_flight": sum(1 for a in bad if not in_flight_at(a, killed)) - len(none_up),
                "error_sent_at_s": [round(a.sent_at, 2) for a in bad][:40],
                "errors": sorted({a.record.error[:120] for a in bad})[:5],
                "run": {k: v for k, v in lb_real.summarize(answers, wall).items() if k != "errors"},
            })

    def back_in_rotation(self, procs, urls: Sequence[str], probe_s: float, burst: int = 12, seed: int = 0,
                         since: Optional[float] = None) -> dict[str, dict[str, Optional[float]]]:
        """Seconds from `since` (monotonic: when both restarted servers answered /health; default: now) until
        the start of the first burst through an LB that reached each restarted server (an upper bound).

        A burst of `burst` concurrent requests (distinct 400-token prompts) through one LB at a time, the LBs
        in turn: at zero load a load-aware LB rightly keeps to its fastest pair, so a lone probe would not
        show whether a server is back; a burst spreads over every server the LB routes to. The restarted
        servers' own request counters, read before and after each burst, say which LB reached them."""
        t0 = time.monotonic()
        ref = t0 if since is None else since
        rng = random.Random(seed)
        back: dict[str, dict[str, Optional[float]]] = {s.name: {u: None for u in urls} for s, _ in procs}
        while time.monotonic() - t0 < probe_s and any(v is None for b in back.values() for v in b.values()):
            for s, p in procs:
                if all(v is not None for v in back[s.name].values()):
                    continue
                before = {u: self.cluster.served(u) for u in urls}
                sent = time.monotonic()
                reqs = [Req(0.0, lb_real._ids(rng, 400), 8) for _ in range(burst)]
                asyncio.run(lb_real.open_loop(p.url, reqs, 15.0))
                time.sleep(0.05)  # a prefill counts a request when it finishes, just before its decode answers
                for u in urls:
                    after = self.cluster.served(u)
                    if back[s.name][u] is None and None not in (before[u], after) and after > before[u]:
                        back[s.name][u] = round(sent - ref, 2)
        return back


# ----------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, help="folder with the layout's model (real servers)")
    ap.add_argument("--gpus", type=int, choices=sorted(lb_layout.LAYOUTS), default=1, help="1: every server on GPU 0; 4: one server per GPU")
    ap.add_argument("--machine", default="", help="the machine's name for the results (run_all.sh: nvidia-h100-x4, ...)")
    ap.add_argument("--sim", action="store_true", help="simulated workers instead of SGLang (CPU proof run)")
    ap.add_argument("--sim-knobs", default="--prefill-ms-per-token 0.01 --decode-ms-per-token 1 --prefix-cache-tokens 4000",
                    help="simworker flags for --sim")
    ap.add_argument("--topology", choices=sorted(TOPOLOGIES), default="2p2d")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--logs", type=Path, required=True)
    ap.add_argument("--lbs", default=",".join(DEFAULT_LBS), help="comma-separated: ours:<policy>[:w<N>][:c<share>], mini_lb, smg:<policy>")
    ap.add_argument("--workloads", default=None, help="comma-separated, in the order the plan keeps them (default: the layout's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-run-s", type=float, default=20.0, help="longest run per workload; shorter when the budget asks")
    ap.add_argument("--cold-s", type=float, default=COLD_S, help="requests sent this early in a run count as cold "
                    "(ttft_ms_p99_cold / _warm: the caches being built, then the steady state)")
    ap.add_argument("--min-run-s", type=float, default=4.0)
    ap.add_argument("--warmup-s", type=float, default=4.0)
    ap.add_argument("--fault-s", type=float, default=12.0, help="load run of the fault phase (0: no fault phase)")
    ap.add_argument("--budget-s", type=float, default=None, help="default: until E2E_DEADLINE_EPOCH less a margin")
    ap.add_argument("--restart-timeout", type=float, default=150.0)
    ap.add_argument("--lb-start-s", type=float, default=2.5, help="planning: seconds until the LBs started side by side serve")
    ap.add_argument("--run-overhead-s", type=float, default=1.5, help="planning: flush and the tail of each run")
    ap.add_argument("--drain-frac", type=float, default=None, help="planning: a run's queue drains in this share of its length "
                    "(default 0.6 with --gpus 4, else 0)")
    ap.add_argument("--restart-s", type=float, default=60.0, help="planning: seconds for the killed servers to serve again")
    ap.add_argument("--bundle-lb", type=Path, default=None, help="lb.tar.xz unpacked (smg/, minilb/)")
    ap.add_argument("--sglang-router-python", default=None, help="python of a venv with sglang-router==0.3.2")
    ap.add_argument("--smg-python", default=None, help="python of a venv with smg==1.13.0")
    ap.add_argument("--prefill-max-total-tokens", type=int, default=None,
                    help="each prefill's KV pool, which is its radix cache (default: the layout's)")
    ap.add_argument("--decode-max-total-tokens", type=int, default=None)
    ap.add_argument("--transport", choices=("nccl", "cudaipc", "auto"), default=None,
                    help="how p2pnccl moves the KV (default: auto with --gpus 4, else $E2E_P2P_1GPU or nccl)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                    help="rates from the prefill capacity measured after the warm-up (default: on with --gpus 4)")
    ap.add_argument("--loads", default=",".join(f"{k}={v}" for k, v in lb_layout.LOADS.items()), help="calibrated load per workload")
    ap.add_argument("--max-rps", type=float, default=120.0, help="calibrated rates stop here (one client process, Python LBs)")
    ap.add_argument("--seed", type=int, default=0)
    for f in WorkloadParams.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None, help=f"default: the layout's, else {f.default}")
    args = ap.parse_args(argv)
    from .servers import Stack, exit_on_sigterm, failure_report

    exit_on_sigterm()
    layout: Layout = lb_layout.LAYOUTS[args.gpus]
    specs = parse_lbs(args.lbs)
    workloads = [w for w in (args.workloads or ",".join(layout.workloads)).split(",") if w]
    for w in workloads:
        make_workload(w, 0.0, 0, WorkloadParams())  # unknown names fail here, before any server starts
    peers = {**(bundle_peers(args.bundle_lb) if args.bundle_lb else {}), **venv_peers(args.sglang_router_python, args.smg_python)}
    preset = dict(layout.workload)
    wp = WorkloadParams(**{k: v if (v := getattr(args, k)) is not None else preset.get(k, f.default)
                           for k, f in WorkloadParams.__dataclass_fields__.items()})
    prefill_tokens = args.prefill_max_total_tokens or layout.prefill_tokens
    decode_tokens = args.decode_max_total_tokens or layout.decode_tokens
    transport = args.transport or (layout.transport if args.gpus > 1 else os.environ.get("E2E_P2P_1GPU") or layout.transport)
    # 4 GPUs: runs at a load that queues drained for 0.14-1.2 of their length (median 0.4) on 2026-11-27 (x4, 2P2D, 7.2 s)
    drain = args.drain_frac if args.drain_frac is not None else (0.6 if args.gpus > 1 else 0.0)
    calibrate = layout.calibrate if args.calibrate is None else args.calibrate
    n_p, n_d = TOPOLOGIES[args.topology]
    where = lb_layout.placement(args.topology, args.gpus)
    t_start = time.monotonic()
    deadline = float(os.environ["E2E_DEADLINE_EPOCH"]) if os.environ.get("E2E_DEADLINE_EPOCH") else None
    doc: dict[str, Any] = {"machine": args.machine, "gpus": args.gpus, "topology": args.topology, "sim": args.sim, "lbs": [s.name for s in specs],
                           "peers": sorted(peers), "workload_params": asdict(wp), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    with Stack(args.logs) as stack:
        if args.sim:
            cluster: Cluster = SimCluster(n_p, n_d, args.sim_knobs.split(), args.logs)
            doc["servers"] = f"{n_p} prefill + {n_d} decode simulated ({args.sim_knobs})"
        else:
            if args.models is None:
                ap.error("--models is needed without --sim")
            flags = with_flag(lb_real.FLAGS, "--mem-fraction-static", layout.mem_fraction)
            p_flags = _with_max_tokens(flags, prefill_tokens)
            d_flags = _with_max_tokens(flags, decode_tokens)
            cluster = SGLangCluster(stack, args.models / layout.model, where, p_flags, d_flags, transport)
            doc.update(model=layout.model, prefill_flags=p_flags, decode_flags=d_flags, servers=servers_text(where),
                       placement=[{"role": r, "index": i, "gpu": g} for r, i, g in where], transport=TRANSPORT_TEXT[transport],
                       pool_gib={"prefill": round(prefill_tokens * lb_layout.KV_BYTES_PER_TOKEN[layout.model] / 2**30, 2),
                                 "decode": round(decode_tokens * lb_layout.KV_BYTES_PER_TOKEN[layout.model] / 2**30, 2)})
        try:
            up = cluster.launch(lanes=layout.lanes)
            doc["launch_s"] = round(time.monotonic() - t_start, 1)
            if len(up) < n_p + n_d:
                doc["error"] = failure_report(list(cluster.servers.values())) if isinstance(cluster, SGLangCluster) else f"up: {up}"
            else:
                cache = prefill_tokens if not args.sim else _knob(args.sim_knobs.split(), "--prefix-cache-tokens")
                h = Harness(cluster, peers, args.logs, wp, tree=tree_blocks(cache) if cache else None, cold_s=args.cold_s)
                doc["ours_tree_blocks"] = h.tree
                doc["warmup"] = h.warm_up(workloads, args.warmup_s, calibrate_pool=(cache or prefill_tokens) if calibrate else 0)
                if calibrate:
                    loads = {k: float(v) for k, v in (x.split("=") for x in args.loads.split(","))}
                    h.wp, doc["rates"] = calibrated(wp, doc["warmup"]["capacity_tok_s"], loads, args.max_rps)
                    doc["workload_params"] = asdict(h.wp)
                    print(f"[lb_compare] rates: {doc['rates']}", flush=True)
                # what is left now, for the comparison and the fault phase
                budget = args.budget_s if args.budget_s is not None else ((deadline - time.time() - 20) if deadline else 600.0)
                # faults: the restart begins 2/5 into the load run; then the probes and the LBs' start
                fault_reserve = max(args.fault_s, 0.4 * args.fault_s + args.restart_s) + 10 + args.lb_start_s if args.fault_s > 0 else 0.0
                p = plan(budget, len(specs), workloads, args.reps, args.max_run_s, args.min_run_s, args.lb_start_s, args.run_overhead_s,
                         fault_reserve, drain)
                doc["plan"] = asdict(p)
                print(f"[lb_compare] plan: {doc['plan']}", flush=True)
                end = time.monotonic() + budget
                if p.workloads:
                    lb_run_s = args.lb_start_s + len(p.workloads) * (p.run_s * (1 + drain) + args.run_overhead_s)
                    rep_s = args.lb_start_s + len(specs) * (lb_run_s - args.lb_start_s)
                    h.compare(specs, p, args.seed, doc, stop_at=end - fault_reserve, lb_run_s=lb_run_s, rep_s_planned=rep_s)
                if args.fault_s > 0:
                    if end - time.monotonic() >= fault_reserve:
                        doc["faults"] = {}
                        h.faults(specs, args.fault_s, h.wp.bursty_rate, args.seed + 100, args.restart_timeout, out=doc["faults"])
                    else:
                        doc["faults"] = {"skipped": f"{end - time.monotonic():.0f} s left, the fault phase needs {fault_reserve:.0f}"}
        finally:
            if isinstance(cluster, SimCluster):
                cluster.stop()
            # also when the step's timeout ends the run (SIGTERM -> SystemExit): what ran is kept
            if "runs" in doc and "aggregate" not in doc:
                summarize_compare(doc, (doc.get("plan") or {}).get("workloads") or ())
            doc["wall_s"] = round(time.monotonic() - t_start, 1)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1))
            print(f"[lb_compare] wrote {args.out}", flush=True)
    return 0 if "error" not in doc and doc.get("aggregate") else 1


TRANSPORT_TEXT = {"nccl": "p2pnccl over NCCL, socket transport on loopback (one GPU, NCCL_HOSTID per server)",
                  "cudaipc": "p2pnccl over CUDA IPC (one GPU, copy kernel into the decode's pools)",
                  "auto": "p2pnccl, SGLANG_P2P_TRANSPORT=auto: CUDA IPC between the GPUs of one host"}


def servers_text(where: Sequence[tuple[str, int, int]]) -> str:
    """"2 prefill + 2 decode on GPU 0", or each server's GPU."""
    n_p = sum(1 for r, _, _ in where if r == "prefill")
    gpus = {g for _, _, g in where}
    if len(gpus) == 1:
        return f"{n_p} prefill + {len(where) - n_p} decode on GPU {gpus.pop()}"
    return ", ".join(f"{r} {i} on GPU {g}" for r, i, g in where)


def _knob(argv: Sequence[str], flag: str) -> Optional[int]:
    return int(argv[argv.index(flag) + 1]) if flag in argv else None


def _with_max_tokens(flags: Sequence[str], n: int) -> list[str]:
    return with_flag(flags, "--max-total-tokens", n)


if __name__ == "__main__":
    raise SystemExit(main())
