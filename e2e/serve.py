"""Serving benchmark on one GPU host: p2pnccl next to SGLang's NIXL (and Mooncake) backend, same servers, same load.

    python3 -m e2e.serve --models DIR --out FILE --logs DIR [--backends p2pnccl,nixl] [--modes nograph,graph]
                         [--cells 1024x1,1024x16,...] [--reps 3] [--extra mooncake:1024x1,1024x64,...]
                         [--decode-gpu 1] [--max-total-tokens N] [--chunked-prefill-size N] [--profile]
                         [--machine NAME]

Every backend gets one prefill server and, per CUDA-graph mode, one decode server with an LB in front (our LB,
the same binary for every backend: with one prefill and one decode it only forwards). All servers run on GPU 0
(``--decode-gpu 1``: the decodes on GPU 1, as on a two-GPU host, where the KV crosses NVLink) at once and are
loaded one at a time, so every backend sees the same host state; each repetition visits the
cells in the same order and, per cell, the backends in an order rotated by repetition. Per run: TTFT p50/p99,
TPOT p50, E2E p50 and output tokens/s seen by the client (streaming /generate), the prefill's own
``sglang:kv_transfer_latency_ms`` (mean over the run), the decode's step time by running batch size (its log),
and the CPU seconds of every thread of both schedulers (``/proc``; Python thread names from py-spy).

``--profile``: before the measured repetitions (it doubles as warm-up), each backend's no-graph pair runs a
concurrency-1 4k-prompt run and a concurrency-64 1k run with ``py-spy record`` attached to both schedulers;
the collapsed stacks are summarised per thread into the results.

Modes: ``nograph`` (decode without CUDA graphs, the CPU-bound launch loop), ``graph`` (decode CUDA graphs up to
batch 64, as deployed; the prefill runs without graphs in both). Flags: the anchor setup (llama-anchor, 128 KiB of
KV a token, page size 1, triton attention, --max-total-tokens 65536). The results file is rewritten after every
run, so a call stopped at its deadline keeps what it measured.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

from . import client, config, decode_log, procstat, promparse, results, room_times, stats
from .servers import Server, Stack, exit_on_sigterm, failure_report

MODEL = "llama-anchor"
MAX_TOTAL_TOKENS = 65536
BASE_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--skip-server-warmup",
              "--enable-metrics", "--log-level", "info", "--mem-fraction-static", "0.7",
              "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--cuda-graph-backend-prefill", "disabled",
              "--sleep-on-idle", "--decode-log-interval", "20"]
# --decode-log-interval 20 (SGLang's default 40): the decode's step time at equal batch is read from these lines
# (decode_log.py), and at concurrency 16 a run gave only 1-5 intervals a batch size, so one run moved the ratio to
# NIXL's from 1.02 to 1.38 (serve_report's range without one run, session 35); twice the lines, the same for
# every backend
# --sleep-on-idle: a fully idle scheduler (no batch, nothing in a PD queue) waits on its sockets instead of
# spinning a core. Every backend's servers stay up while one is measured; without it their idle schedulers
# (and NIXL's progress threads) kept 8-9 of the host's 16 cores busy and the same server's TPOT at
# concurrency 1 swung between 19 and 42 ms from one run to the next.
MODE_FLAGS = {"nograph": ["--cuda-graph-backend-decode", "disabled"], "graph": ["--cuda-graph-max-bs-decode", "64"]}
BACKEND_ENV = {
    "p2pnccl": {"SGLANG_P2P_TRANSPORT": "auto"},  # auto: the CUDA IPC path for a decode on the same host
    # the same with Python's own 5 ms GIL switch interval in both schedulers (the A/B of SGLANG_P2P_GIL_SWITCH_MS)
    "p2pnccl-gil5": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_GIL_SWITCH_MS": "0"},
    # every same-host chunk on the SM copy kernel (before 2026-11-28 auto sent DeepSeek-shaped chunks, 61 spans of
    # 1-5 MiB, there; now those of 2 MiB spans and more take the copy engines across GPUs)
    "p2pnccl-kernel": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_COPY_ENGINE": "off"},
    # auto's copy-engine thresholds lowered further: 1k-token DeepSeek-shaped chunks (61 spans of 1.1 MiB) and
    # pages in up to 4 runs a layer take the copy engines too
    "p2pnccl-ce": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_CE_MIN_SPAN_KIB": "1024",
                   "SGLANG_P2P_CE_MAX_SPANS": "256"},
    # the page kernel's grid bounded to one program an SM of an H100/H200 (132): at page size 1 the default runs 4 an
    # SM, and on 2 x H200 the prefill's forward stage ran 2-5% longer at 16k prompts than with NIXL while the
    # kernel wrote the previous chunk's KV (docs/serving.md); one an SM slowed a matmul 24-42% instead of 90-102%
    "p2pnccl-grid132": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_IPC_PROGRAMS": "132"},
    # auto's span cap at 1,024 at its 2 MiB mean span: a 16k prompt's chunks that SGLang's page-1 allocator hands
    # out in a few runs a layer (hundreds of spans of MiBs) take the copy engines instead of the kernel, which takes
    # SMs from the next chunk's forward beside it (2 x H200, 2026-11-29: forward 3% longer than NIXL's). The
    # default since those runs (ce_plan.CE_MAX_SPANS_BATCHED), so now the same as p2pnccl; kept so that their
    # results' name still launches what they ran
    "p2pnccl-spans1024": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_CE_MAX_SPANS": "1024"},
    # the page kernel's grid bounded to 32 programs (a quarter of an H200's SMs): in mixed 16k and 1k cells the
    # page-1 pool fragments, 36-48% of the bytes took the kernel for short spans and the prefill's forward ran 12-17%
    # longer than with NIXL (2 x H200, session 29); the kernel wrote faster than NIXL, so there is time to trade
    "p2pnccl-grid32": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_IPC_PROGRAMS": "32"},
    # each chunk cut by its page runs: the long runs to the copy engines, only the short ones to the kernel
    # (ce_plan.split_runs). In those cells the kernel took 59% of the bytes, whole chunks left to it for their mean
    # span or span count, and a matmul beside it lost ~20% whatever its grid (2 x H200, session 30). The default
    # since session 32's runs (engine/config.py), so now the same as p2pnccl; kept so that their results' name
    # still launches what they ran
    "p2pnccl-split": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_COPY_ENGINE": "split"},
    # the route rule before session 32: each chunk whole to the copy engines or to the kernel, by its mean span and
    # span count (ce_plan.choose)
    "p2pnccl-auto": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_COPY_ENGINE": "auto"},
    # p2pnccl with each room's transfer steps logged by the prefill (SGLANG_P2P_ROOM_TIMES, adapter/room_times.py;
    # `room_times_ms` in the results): where SGLang's KV time of a 4k request at concurrency 1, 4.1-5.0 ms against a
    # 1.6 ms write in the transfer benchmark (2 x H200, session 36), goes
    "p2pnccl-times": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ROOM_TIMES": "1"},
    # the same with the GIL switch interval at 0.1 ms instead of 0.5: each time a transfer worker wakes (its queue,
    # the copy's end) it waits up to that long for a scheduler thread that runs Python without pause
    "p2pnccl-times-gil01": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ROOM_TIMES": "1",
                            "SGLANG_P2P_GIL_SWITCH_MS": "0.1"},
    # room times with the copy queued by the transfer worker, as before session 37 (SGLANG_P2P_IPC_LAUNCH=worker),
    # beside `p2pnccl-times`, where SGLang's scheduler thread queues it (the default since)
    "p2pnccl-times-worker": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ROOM_TIMES": "1",
                             "SGLANG_P2P_IPC_LAUNCH": "worker"},
    # room times with the copy engines' thresholds of a decode on another GPU (2 MiB spans, 64 a chunk) also into
    # the prefill's own GPU: a one-GPU host then routes a 4k request's chunk (64 spans of 8 MiB) as two GPUs do.
    # Session 38's one-GPU runs of it gave a request alone the kernel; since then SGLANG_P2P_ALONE_KERNEL leaves a
    # decode on the prefill's own GPU to the rule, so on one GPU it now routes as `p2pnccl-times-ce-rule` does
    "p2pnccl-times-ce": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ROOM_TIMES": "1", "SGLANG_P2P_CE_MIN_SPAN_KIB": "2048",
                         "SGLANG_P2P_CE_MAX_SPANS": "64"},
    # the same with every chunk routed by the rule, as before session 38 (SGLANG_P2P_ALONE_KERNEL=0): a request alone
    # on its prefill gives its chunk to the copy engines too
    "p2pnccl-times-ce-rule": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ROOM_TIMES": "1",
                              "SGLANG_P2P_CE_MIN_SPAN_KIB": "2048", "SGLANG_P2P_CE_MAX_SPANS": "64",
                              "SGLANG_P2P_ALONE_KERNEL": "0"},
    # p2pnccl and its room times with a request alone routed by the rule too (SGLANG_P2P_ALONE_KERNEL=0), as before
    # session 38: across GPUs its 4k chunk then takes the copy engines, whose batch call held SGLang's thread 0.5 ms
    "p2pnccl-rule": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ALONE_KERNEL": "0"},
    "p2pnccl-times-rule": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ROOM_TIMES": "1", "SGLANG_P2P_ALONE_KERNEL": "0"},
    # p2pnccl and its room times with each room concluded by the transfer worker woken for its last copy
    # (SGLANG_P2P_CONCLUDE_IN_POLL=0), as before session 39, beside SGLang's poll concluding it (the default since)
    "p2pnccl-wconclude": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_CONCLUDE_IN_POLL": "0"},
    "p2pnccl-times-wconclude": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_ROOM_TIMES": "1",
                                "SGLANG_P2P_CONCLUDE_IN_POLL": "0"},
    # plain p2pnccl with the copy queued by the transfer worker (SGLANG_P2P_IPC_LAUNCH=worker), as before session 37
    "p2pnccl-worker": {"SGLANG_P2P_TRANSPORT": "auto", "SGLANG_P2P_IPC_LAUNCH": "worker"},
    "nixl": {},  # SGLang's default NIXL backend: UCX, which picks cuda_ipc between two processes of one GPU
    "mooncake": {"MC_INTRANODE_NVLINK": "true", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"},
}
BASE_PORT = {"p2pnccl": 33000, "nixl": 33100, "mooncake": 33200, "p2pnccl-gil5": 33300, "p2pnccl-kernel": 33400,
             "p2pnccl-ce": 33500, "p2pnccl-grid132": 33600, "p2pnccl-spans1024": 33700, "p2pnccl-grid32": 33800,
             "p2pnccl-split": 33900, "p2pnccl-auto": 34000, "p2pnccl-times": 34100, "p2pnccl-times-gil01": 34200,
             "p2pnccl-times-worker": 34300, "p2pnccl-worker": 34400, "p2pnccl-times-ce": 34500,
             "p2pnccl-times-ce-rule": 34600, "p2pnccl-rule": 34700, "p2pnccl-times-rule": 34800,
             "p2pnccl-wconclude": 34900, "p2pnccl-times-wconclude": 35000}
#: a variant's --disaggregation-transfer-backend: each p2pnccl-* is p2pnccl with other knobs
TRANSFER_BACKEND = {name: "p2pnccl" for name in BACKEND_ENV if name.startswith("p2pnccl-")}
OUTPUT_TOKENS = 64
DEFAULT_CELLS = "1024x1,1024x16,1024x64,4096x1,4096x16,4096x64"


def requests_for(concurrency: int, rounds: int = 2) -> int:
    """Closed loop: 6 requests alone (3 per round), `rounds` rounds of users at higher concurrency. Two rounds
    are mostly the arrival burst; more give steadier medians for the same cells."""
    return 3 * rounds if concurrency == 1 else rounds * concurrency


def parse_cells(text: str) -> list[tuple[int, int]]:
    cells = []
    for item in filter(None, text.split(",")):
        plen, _, conc = item.partition("x")
        cells.append((int(plen), int(conc)))
    return cells


def server_flags(max_total_tokens: int, chunked_prefill_size: int = 0) -> list[str]:
    """Every server's flags: BASE_FLAGS with the KV pool cap (128 KiB a token: 65,536 are 8 GiB; a 16k-token prompt
    at concurrency 16 needs 262,144 on the decode, which only a GPU of its own holds beside two others) and, when
    given, the prefill chunk (0: SGLang's default, 8,192 tokens on an H100 or H200). A prompt longer than the
    chunk is prefilled in several, and SGLang's `kv_transfer_latency_ms` then differs by backend: NIXL and p2pnccl
    time a request from its first chunk queued, which holds the later chunks' forward passes, while SGLang times
    Mooncake from its last chunk's queueing; a chunk at least the prompt's length makes the figure the transfer's."""
    flags = config.with_flag(BASE_FLAGS, "--max-total-tokens", max_total_tokens)
    return [*flags, "--chunked-prefill-size", str(chunked_prefill_size)] if chunked_prefill_size else flags


class Pair:
    """One backend's prefill, and per mode its decode and LB."""

    def __init__(self, backend: str, models: Path, modes: list[str], decode_gpu: int = 0,
                 max_total_tokens: int = MAX_TOTAL_TOKENS, chunked_prefill_size: int = 0):
        base = BASE_PORT[backend]
        flags = server_flags(max_total_tokens, chunked_prefill_size)
        env = {**config.COMMON_ENV, **BACKEND_ENV[backend]}
        self.backend = backend
        transfer = TRANSFER_BACKEND.get(backend, backend)
        self.prefill = Server(f"serve-{backend}-prefill", base, "prefill", models / MODEL, backend=transfer,
                              bootstrap_port=base + 9, args=[*flags, *MODE_FLAGS["nograph"]], env=env)
        self.decode: dict[str, Server] = {}
        self.lb: dict[str, Server] = {}
        for i, mode in enumerate(modes):
            d = Server(f"serve-{backend}-decode-{mode}", base + 1 + 2 * i, "decode", models / MODEL, backend=transfer,
                       args=[*flags, *MODE_FLAGS[mode]], env=env, gpu=decode_gpu)
            self.decode[mode] = d
            self.lb[mode] = Server(f"serve-{backend}-lb-{mode}", base + 2 + 2 * i, "lb", lb_prefill=self.prefill,
                                   lb_decode=d, args=["--policy", "random"])

    @property
    def prefills(self) -> list[Server]:
        return [self.prefill]

    def servers(self) -> list[Server]:
        return [self.prefill, *self.decode.values()]


def pool_tokens(server: Server) -> Optional[int]:
    """The KV pool a server really got (SGLang sizes it from the memory free at its start: servers that start
    side by side must all reach the --max-total-tokens cap, or the backends are not compared alike)."""
    try:
        with urllib.request.urlopen(server.url + "/get_server_info", timeout=10) as r:
            info = json.loads(r.read().decode())
    except Exception:
        return None
    for doc in (info, *(info.get("internal_states") or [])):
        if isinstance(doc, dict) and doc.get("max_total_num_tokens"):
            return int(doc["max_total_num_tokens"])
    return None


_NAMES: dict[int, dict[int, str]] = {}


def _thread_names(pid: Optional[int], pyspy: Optional[str]) -> dict[int, str]:
    """Python thread names of a scheduler, asked of py-spy once per process (a dump takes a moment)."""
    if not pid:
        return {}
    if pid not in _NAMES:
        _NAMES[pid] = procstat.python_thread_names(pid, pyspy)[0]
    return _NAMES[pid]


#: SGLang's time per request in each stage of its path (`stage` label: the prefill's bootstrap, forward and KV
#: transfer, the decode's bootstrap, waiting and transferred, ...), observed with --enable-metrics
STAGE_HISTOGRAM = "sglang:per_stage_req_latency_seconds"


def stage_totals(texts: list[Optional[str]]) -> dict[str, promparse.HistogramTotals]:
    """Several servers' per-stage histograms and waiting-queue time (`queue_time`, `promparse.QUEUE_TIME`: without
    it a prefill's queue shows nowhere; on a decode it equals `decode_waiting`) (their /metrics texts; None: no
    answer) summed stage by stage."""
    out: dict[str, promparse.HistogramTotals] = {}
    for text in filter(None, texts):
        stages = promparse.histogram_totals_by(text, STAGE_HISTOGRAM, "stage")
        queue = promparse.histogram_totals(text, promparse.QUEUE_TIME)
        if queue is not None:
            stages["queue_time"] = queue
        for stage, t in stages.items():
            out[stage] = promparse.total([out.get(stage), t])
    return out


def stage_means_ms(before: dict[str, promparse.HistogramTotals],
                   after: dict[str, promparse.HistogramTotals]) -> dict[str, float]:
    """Each stage's mean time in ms over the requests that passed it between two snapshots (stages none passed
    are left out): where a request's time went, the same way for every backend."""
    means = {k: promparse.mean_between(before.get(k), v) for k, v in after.items()}
    return {k: round(1e3 * m, 3) for k, m in sorted(means.items()) if m is not None}


def per_prefill(before: list[tuple[Optional[float], dict[str, promparse.HistogramTotals]]],
                after: list[tuple[Optional[float], dict[str, promparse.HistogramTotals]]]) -> list[dict[str, Any]]:
    """Each prefill's requests during a run and its own stage means (queue, forward, transfer): with several
    prefills behind the LB, whether one of them made the run's queue (requests None: no counter read)."""
    out = []
    for (n0, st0), (n1, st1) in zip(before, after):
        out.append({"requests": None if n0 is None or n1 is None else round(n1 - n0),
                    "stages_ms": stage_means_ms(st0, st1)})
    return out


class Probe:
    """What one run measures beside the client: KV transfer time, decode step times, scheduler CPU by thread."""

    def __init__(self, pair: Pair, mode: str, pyspy: Optional[str]):
        self.pair, self.mode, self.pyspy = pair, mode, pyspy
        self.procs = {role: procstat.scheduler_pid(s.proc.pid) if s.proc else None
                      for role, s in (("prefill", pair.prefill), ("decode", pair.decode[mode]))}
        self.names = {role: _thread_names(pid, pyspy) for role, pid in self.procs.items()}

    def _snapshot(self) -> tuple[Optional[promparse.HistogramTotals], dict[str, dict[str, promparse.HistogramTotals]],
                                 list[tuple[Optional[float], dict[str, promparse.HistogramTotals]]]]:
        """One /metrics read of every server: the prefills' KV transfer histogram summed, SGLang's per-stage
        request latency (`STAGE_HISTOGRAM`), the prefills' summed and the decode's, and each prefill's own
        (requests so far, stages)."""
        prefills = [promparse.fetch(p.url) for p in self.pair.prefills]
        kv = promparse.total([promparse.histogram_totals(t, promparse.KV_TRANSFER_LATENCY) for t in prefills if t])
        each = [(promparse.sample_total(t, "sglang:num_requests_total") if t else None, stage_totals([t]))
                for t in prefills]
        return kv, {"prefill": stage_totals(prefills),
                    "decode": stage_totals([promparse.fetch(self.pair.decode[self.mode].url)])}, each

    def __enter__(self) -> "Probe":
        self.kv0, self.st0, self.each0 = self._snapshot()
        self.log0 = decode_log.offset(self.pair.decode[self.mode].log)
        self.prefill_log0 = [decode_log.offset(p.log) for p in self.pair.prefills]
        self.cpu0 = {role: procstat.thread_cpu(pid) if pid else {} for role, pid in self.procs.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu1 = {role: procstat.thread_cpu(pid) if pid else {} for role, pid in self.procs.items()}
        self.kv1, self.st1, self.each1 = self._snapshot()
        self.log_text = decode_log.read_since(self.pair.decode[self.mode].log, self.log0)
        self.prefill_text = "".join(decode_log.read_since(p.log, start)
                                    for p, start in zip(self.pair.prefills, self.prefill_log0))

    def figures(self) -> dict[str, Any]:
        kv = promparse.mean_between(self.kv0, self.kv1)
        return {
            "kv_ms": None if kv is None else round(kv, 3),
            "stages_ms": {role: stage_means_ms(self.st0[role], self.st1[role]) for role in self.st1},
            "prefills": per_prefill(self.each0, self.each1),
            "decode_steps": decode_log.summarize(decode_log.step_times(self.log_text)),
            "room_times_ms": room_times.summarize(room_times.parse(self.prefill_text)),
            "cpu": {role: procstat.cpu_between(self.cpu0[role], self.cpu1[role],
                                               {**procstat.os_thread_names(pid), **self.names[role]} if pid else {})[:8]
                    for role, pid in self.procs.items()},
        }


def tpot_ms_p50(records: list[stats.RequestRecord]) -> Optional[float]:
    """Per request (E2E - TTFT) / (output tokens - 1), then the median."""
    per = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in records
           if r.ok and r.ttft_s is not None and r.e2e_s is not None and r.output_tokens > 1]
    return round(1e3 * statistics.median(per), 3) if per else None


def alone_ttfts_ms(records: list[stats.RequestRecord], conc: int) -> Optional[list[Optional[float]]]:
    """At concurrency 1, every request's TTFT in the order sent (None: failed): a slower prefill or pair behind the
    LB's rotation shows as a pattern the p50 of a few requests hides. None at higher concurrency."""
    if conc != 1:
        return None
    return [None if r.ttft_s is None or not r.ok else round(1e3 * r.ttft_s, 1) for r in records]


#: whose code a scheduler thread is in, in a profile taken during a measured run (`one_run(record=...)`)
PROFILE_MARKERS = ("sglang_p2p_backend/", "sglang/srt/disaggregation/", "nixl", "mooncake")
#: seconds of py-spy during a measured run: the run's first seconds, where its load is (runs last 5-30 s)
RECORD_S = 4


class Recording(NamedTuple):
    """How `one_run` records the first prefill scheduler with py-spy: for `seconds` at `rate` samples a second;
    `gil`: only the thread that holds the GIL (each thread's samples are then its share of the GIL); `native`:
    with the C frames under the Python ones (where a runtime call spends its time)."""

    seconds: float = RECORD_S
    rate: int = 200
    gil: bool = False
    native: bool = False


def one_run(pair: Pair, mode: str, plen: int, conc: int, seed: int, pyspy: Optional[str],
            rounds: int = 2, record: Optional[Path] = None, how: Recording = Recording(),
            output_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    """One closed-loop run through the pair's LB, `output_tokens` an answer. `record`: where py-spy (non-blocking)
    writes the first prefill scheduler's stacks during the run's first seconds, as `how` says; the row gets
    `pyspy_prefill` (per thread, the samples within our plugin, SGLang's disaggregation code and the peers'
    modules)."""
    prompts = client.random_prompts(requests_for(conc, rounds), plen, seed=seed)
    with Probe(pair, mode, pyspy) as probe:
        err = None
        if record is not None:
            pid = probe.procs.get("prefill")
            err = (procstat.record(pid, pyspy, how.seconds, record, rate=how.rate, gil=how.gil, native=how.native)
                   if pid else "no scheduler process found")
        records, wall = asyncio.run(client.closed_loop(pair.lb[mode].url, prompts, conc, output_tokens))
    s = stats.summarize_run(records, wall)
    row = {"ttft_p50_ms": s["ttft_ms_p50"], "ttft_p99_ms": s["ttft_ms_p99"], "tpot_p50_ms": tpot_ms_p50(records),
           "e2e_p50_ms": s["e2e_ms_p50"], "output_tok_s": s["output_throughput"], "failed": s["num_failed"],
           "errors": s["errors"], **({"ttfts_ms": alone_ttfts_ms(records, conc)} if conc == 1 else {}),
           **probe.figures()}
    if record is not None:
        err = err or procstat.wait_record(record)
        row["pyspy_prefill"] = {"error": err} if err else procstat.samples_within(record.read_text(), PROFILE_MARKERS)[:4]
        if how.gil:
            row["pyspy_prefill_gil"] = True
    return row


def profile(pair: Pair, logs: Path, pyspy: Optional[str]) -> list[dict[str, Any]]:
    """The no-graph pair under two loads with py-spy on both schedulers (also the warm-up)."""
    out = []
    for plen, conc, n in ((4096, 1, 2), (1024, 64, 64)):
        seconds = 8
        files = {}
        for role, server in (("prefill", pair.prefill), ("decode", pair.decode["nograph"])):
            pid = procstat.scheduler_pid(server.proc.pid) if server.proc else None
            path = logs / f"pyspy-{pair.backend}-{role}-{plen}x{conc}.txt"
            err = procstat.record(pid, pyspy, seconds, path) if pid else "no scheduler process found"
            files[role] = (path, err)
        prompts = client.random_prompts(n, plen, seed=7 + plen + conc)
        with Probe(pair, "nograph", pyspy) as probe:
            records, wall = asyncio.run(client.closed_loop(pair.lb["nograph"].url, prompts, conc, 4 * OUTPUT_TOKENS))
        row: dict[str, Any] = {"backend": pair.backend, "input_len": plen, "concurrency": conc,
                               "tpot_p50_ms": tpot_ms_p50(records), **probe.figures()}
        for role, (path, err) in files.items():
            err = err or procstat.wait_record(path)
            row[f"pyspy_{role}"] = {"error": err} if err else procstat.summarize_collapsed(path.read_text())[:6]
        out.append(row)
        print(f"serve profile {pair.backend} {plen}x{conc}: tpot {row['tpot_p50_ms']} ms, "
              f"decode cpu {row['cpu']['decode'][:3]}", flush=True)
    return out


def median_spread(values: list[Optional[float]]) -> dict[str, Optional[float]]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def summarize_cells(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "output_tok_s", "kv_ms")
    return [{k: c[k] for k in ("backend", "input_len", "concurrency", "cuda_graph")}
            | {key: median_spread([r.get(key) for r in c["reps"]]) for key in keys} for c in cells]


def run(models: Path, logs: Path, out: Path, backends: list[str], modes: list[str], cells: list[tuple[int, int]],
        reps: int, extra: dict[str, list[tuple[int, int]]], do_profile: bool, machine: str, pyspy: Optional[str],
        deadline: float, rounds: int = 2, decode_gpu: int = 0, max_total_tokens: int = MAX_TOTAL_TOKENS,
        chunked_prefill_size: int = 0, profiled: frozenset[tuple[int, int]] = frozenset(),
        how: Recording = Recording(), output_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    """`profiled`: cells whose first repetition records each backend's prefill scheduler with py-spy (`one_run`,
    as `how` says); `output_tokens` an answer in the measured runs."""
    res: dict[str, Any] = {"machine": machine, "model": MODEL, "flags": server_flags(max_total_tokens, chunked_prefill_size),
                           "mode_flags": MODE_FLAGS, "gpus": {"prefill": 0, "decode": decode_gpu},
                           "backend_env": {b: BACKEND_ENV[b] for b in [*backends, *extra]},
                           "output_tokens": output_tokens, "requests": {str(c): requests_for(c, rounds) for _, c in cells},
                           "lb": "sglang_p2p_lb --policy random (one prefill, one decode: forwards only)",
                           "cells": [], "profile": [], "servers": {}}
    save = lambda: results.write_json(out, res)  # noqa: E731
    pairs = {b: Pair(b, models, modes, decode_gpu, max_total_tokens, chunked_prefill_size) for b in [*backends, *extra]}
    with Stack(logs) as stack:
        ready = start(stack, pairs, res, save)
        warm_up(ready, modes, cells)
        if do_profile and "nograph" in modes:
            for b in backends:
                if b in ready:
                    res["profile"] += profile(ready[b], logs, pyspy)
                    save()
        measure(ready, modes, cells, backends, extra, reps, res, save, pyspy, deadline, rounds,
                (logs if pyspy else None, profiled), how, output_tokens)
    return res


def start(stack: Stack, pairs: dict[str, Any], res: dict[str, Any], save: Any) -> dict[str, Any]:
    """Every backend's servers at once, then its LBs; returns the backends that came up (res["servers"] says
    why the others did not). A pair is a `Pair` or anything with its attributes (e2e/shape_serve.py)."""
    t0 = time.monotonic()
    everything = [s for p in pairs.values() for s in p.servers()]
    stack.launch(everything, lanes=3)
    res["launch_s"] = round(time.monotonic() - t0, 1)
    ready = {}
    for b, p in pairs.items():
        failed = failure_report(p.servers())
        for lb in p.lb.values():
            if not failed and not stack.launch_lb(lb):
                failed = failure_report([lb]) or {lb.name: lb.log_tail()}
        res["servers"][b] = {"status": "failed", "errors": failed} if failed else {
            "status": "ok", "pool_tokens": {s.name: pool_tokens(s) for s in p.servers()}}
        if not failed:
            ready[b] = p
    save()
    return ready


def warm_up(ready: dict[str, Any], modes: list[str], cells: Sequence[tuple[int, int]] = ()) -> None:
    """Triton compiles, CUDA graphs' first replays, transfer engines' first connections; then one short round of
    each loaded cell to be measured (`cells`: its prompt length and concurrency, 8 tokens an answer), so the
    batch shapes those runs form are not first met in the first repetition (on 2026-11-28 every backend's
    figures rose from the first repetition to the last, by more than the backends differed)."""
    loaded = sorted({(plen, conc) for plen, conc in cells if conc > 1})
    for p in ready.values():
        for mode in modes:
            asyncio.run(client.closed_loop(p.lb[mode].url, client.random_prompts(8, 4096, seed=5), 4, 8))
            asyncio.run(client.closed_loop(p.lb[mode].url, client.random_prompts(16, 1024, seed=6), 16, 8))
            for plen, conc in loaded:
                asyncio.run(client.closed_loop(p.lb[mode].url, client.random_prompts(conc, plen, seed=7 + conc), conc, 8))


def measure(ready: dict[str, Any], modes: list[str], cells: list[tuple[int, int]], backends: list[str],
            extra: dict[str, list[tuple[int, int]]], reps: int, res: dict[str, Any], save: Any,
            pyspy: Optional[str], deadline: float, rounds: int = 2,
            record: tuple[Optional[Path], frozenset[tuple[int, int]]] = (None, frozenset()),
            how: Recording = Recording(), output_tokens: int = OUTPUT_TOKENS) -> None:
    """Every cell `reps` times, the backends of a cell in an order rotated by repetition; res["cells"] and
    res["summary"] grow (and are saved) after every run, res["stopped"] says where a deadline cut it short.

    A run starts only if the longest earlier run of its cell (any backend) still fits before `deadline`: a
    run killed at the step's own limit would be lost whole, with the time it took. `record`: (folder, cells):
    the first repetition of each of those cells profiles every backend's first prefill (`one_run`, as `how` says)."""
    table: dict[tuple, dict[str, Any]] = {}
    took: dict[tuple, float] = {}  # (mode, prompt, concurrency) -> the longest run of that cell so far (s)
    folder, profiled = record
    plan = [(mode, plen, conc, backends) for mode in modes for plen, conc in cells]
    plan += [(mode, plen, conc, [b]) for b, bc in extra.items() for mode in modes for plen, conc in bc]
    for rep in range(reps):
        for mode, plen, conc, group in plan:
            if rep > 0 and len(group) == 1 and group[0] in extra:
                continue  # the extra column runs once
            order = [b for b in group if b in ready]
            k = rep % max(1, len(order))
            for b in order[k:] + order[:k]:
                expect = took.get((mode, plen, conc), 0.0)
                if time.monotonic() + expect > deadline:
                    res["stopped"] = (f"deadline in repetition {rep}: {b} {plen}x{conc} not started (its cell's runs "
                                      f"took up to {expect:.0f} s)")
                    save()
                    return
                key = (b, plen, conc, mode)
                cell = table.setdefault(key, {"backend": b, "input_len": plen, "concurrency": conc,
                                              "cuda_graph": mode == "graph", "reps": []})
                if cell not in res["cells"]:
                    res["cells"].append(cell)
                t0 = time.monotonic()
                path = folder / f"pyspy-{b}-prefill-{mode}-{plen}x{conc}.txt" if (
                    folder is not None and rep == 0 and (plen, conc) in profiled) else None
                try:
                    r = one_run(ready[b], mode, plen, conc, seed=1000 * plen + conc + 7919 * rep, pyspy=pyspy,
                                rounds=rounds, record=path, how=how, output_tokens=output_tokens)
                except SystemExit as e:  # the step's SIGTERM (servers.exit_on_sigterm): the file says where
                    res["stopped"] = f"killed (exit {e.code}) in repetition {rep} during {b} {plen}x{conc}: that run is lost"
                    save()
                    raise
                took[(mode, plen, conc)] = max(expect, time.monotonic() - t0)
                cell["reps"].append(r)
                res["summary"] = summarize_cells(res["cells"])
                save()
                print(f"serve rep {rep} {mode} {b} {plen}x{conc}: ttft p50 {r['ttft_p50_ms']} tpot "
                      f"{r['tpot_p50_ms']} e2e {r['e2e_p50_ms']} ms, {r['output_tok_s']} tok/s, kv {r['kv_ms']} ms,"
                      f" failed {r['failed']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--backends", default="p2pnccl,nixl")
    ap.add_argument("--modes", default="nograph,graph")
    ap.add_argument("--cells", default=DEFAULT_CELLS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="closed-loop rounds of users a run (requests = rounds x "
                    "concurrency)")
    ap.add_argument("--extra", default="", help="BACKEND:CELLS, run once per mode (e.g. mooncake:1024x1,1024x64)")
    ap.add_argument("--decode-gpu", type=int, default=0, help="the decodes' GPU (1 on a two-GPU host: the KV crosses "
                    "NVLink); the prefills stay on GPU 0")
    ap.add_argument("--max-total-tokens", type=int, default=MAX_TOTAL_TOKENS, help="every server's KV pool cap "
                    "(128 KiB a token); raise it for 16k-token prompts where a GPU holds fewer servers")
    ap.add_argument("--chunked-prefill-size", type=int, default=0, help="every server's prefill chunk in tokens (0: "
                    "SGLang's default); at least the longest prompt makes kv_transfer_latency_ms the transfer's alone")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--machine", default="unknown")
    ap.add_argument("--pyspy", default="", help="py-spy executable (profile and thread names)")
    ap.add_argument("--profile-cells", default="", help="cells (e.g. 1024x64) whose first repetition records each "
                    "backend's prefill scheduler with py-spy for a few seconds (`pyspy_prefill` in the run)")
    ap.add_argument("--profile-gil", action="store_true", help="with --profile-cells: sample only the thread that "
                    "holds the GIL, so each thread's samples are its share of the GIL")
    ap.add_argument("--profile-seconds", type=float, default=RECORD_S, help="with --profile-cells: seconds of py-spy "
                    "from the run's start")
    ap.add_argument("--profile-rate", type=int, default=Recording.rate, help="with --profile-cells: samples a second")
    ap.add_argument("--profile-native", action="store_true", help="with --profile-cells: the C frames too (py-spy "
                    "--native: which runtime call a step spends its time in)")
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, help="tokens an answer in the measured runs "
                    "(1: the prefill and the KV transfer are most of each request)")
    a = ap.parse_args(argv)
    extra = {}
    for item in filter(None, a.extra.split(";")):
        b, _, cells = item.partition(":")
        extra[b] = parse_cells(cells)
    exit_on_sigterm()
    a.logs.mkdir(parents=True, exist_ok=True)
    res = run(a.models, a.logs, a.out, a.backends.split(","), a.modes.split(","), parse_cells(a.cells), a.reps, extra,
              a.profile, a.machine, a.pyspy or None, config.deadline_from_env(), a.rounds, a.decode_gpu,
              a.max_total_tokens, a.chunked_prefill_size, frozenset(parse_cells(a.profile_cells)),
              Recording(a.profile_seconds, a.profile_rate, a.profile_gil, a.profile_native), a.output_tokens)
    bad = [b for b, s in res["servers"].items() if s.get("status") != "ok"]
    print(json.dumps({"servers": res["servers"], "stopped": res.get("stopped")}, default=str)[:2000], flush=True)
    return 1 if bad or res.get("stopped") else 0


if __name__ == "__main__":
    sys.exit(main())
