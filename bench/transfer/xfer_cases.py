"""What bench/transfer/xfer_bench.py measures, as data: the KV shapes and request sizes to measure, the page
ids of each case, the repetition budget, the targets, and the table.

Pure (numpy only, no device), so the case list, the ids and the verdicts are tested on CPU
(tests/bench/test_xfer_bench.py); the driver only runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A KV pool: `regions` layer regions of `token_bytes` a token, pages of `page` tokens."""

    name: str
    regions: int
    token_bytes: int
    page: int

    @property
    def item(self) -> int:
        """Bytes of one page of one region."""
        return self.page * self.token_bytes

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def nbytes(self, tokens: int) -> int:
        return self.pages(tokens) * self.item * self.regions


#: the shapes: MHA with 128 KiB of KV a token (32 layers x K, V x 8 heads x 128 bf16 = 64 regions of
#: 2 KiB a token) at page sizes 1 and 16; MLA (DeepSeek-V3: 61 layers x 576 bf16) at page size 64
SHAPES = (Shape("mha_p1", 64, 2048, 1), Shape("mha_p16", 64, 2048, 16), Shape("mla_p64", 61, 1152, 64))
TOKENS = (128, 1024, 4096, 16384)
DESTS = ("contiguous", "scattered")
#: --dests also takes `mixed`: three quarters of the pages in 4 long runs, the last quarter single pages apart, the
#: shape a page-1 pool fragmented by mixed traffic gives a long prompt (SGLANG_P2P_COPY_ENGINE=split's case)
MIXED = "mixed"
MIXED_RUNS = 4
#: --dests also takes `runs<N>`: the pages land in N runs of the decode's pool, apart (SGLang's allocator at page
#: size 1 after a while hands out a few long runs: a chunk of N runs a region is N spans a region)
RUNS_PREFIX = "runs"
#: --quick on CPU: the same driver on small pools (three regions, short pages)
QUICK_SHAPES = (Shape("mha_p1", 4, 256, 1), Shape("mha_p16", 4, 256, 16), Shape("mla_p64", 3, 144, 64))
QUICK_TOKENS = (128, 1024)

#: the figures each verdict of the benchmark compares against
TARGETS = {
    "ipc_ratio_min": 0.85,  # cross-GPU write of >= 4k tokens against one cudaMemcpyPeer of the same bytes
    "ipc_4k_max_ms": 1.7,
    "ipc_16k_max_ms": 6.5,
    "small_request_max_us": 300.0,  # 128 tokens end to end (write + aux row and Status on the control channel)
    "interference_max": 0.02,  # matmul on the prefill GPU slowed at most 2% during transfers
    "nccl_ratio_min": 0.85,  # NCCL path against one contiguous NCCL send at 4k
    "same_gpu_ratio_min": 0.8,  # same GPU, the whole write against one device-to-device copy
}


@dataclass(frozen=True)
class Case:
    shape: Shape
    tokens: int
    dest: str

    @property
    def name(self) -> str:
        return f"{self.shape.name}_{self.tokens}_{self.dest}"


def run_count(dest: str) -> int:
    """N of a `runs<N>` destination; 0 for the others. Raises ValueError for a name that is neither."""
    if dest in DESTS or dest == MIXED:
        return 0
    n = dest[len(RUNS_PREFIX):]
    if not dest.startswith(RUNS_PREFIX) or not n.isdigit() or int(n) < 1:
        raise ValueError(f"destination {dest!r}: choose contiguous, scattered, mixed or runs<N> (N >= 1, e.g. runs4)")
    return int(n)


def cases(shapes=SHAPES, tokens=TOKENS, dests=DESTS) -> list[Case]:
    """Every (shape, tokens, destination) case, shape-major so one pool serves a shape's cases."""
    return [Case(s, t, d) for s in shapes for t in tokens for d in dests]


def pool_pages(shape: Shape, tokens=TOKENS) -> tuple[int, int]:
    """(prefill pages, decode pages) of a shape's pools: the largest request, and twice it on the decode so
    scattered destinations have room."""
    n = shape.pages(max(tokens))
    return n, 2 * n


def page_ids(case: Case, src_pages: int, dst_pages: int, seed: int = 35) -> tuple[np.ndarray, np.ndarray]:
    """(source ids, destination ids), int64. Contiguous: pages 0..n-1 into a run starting a quarter into the
    decode's pool. Scattered: distinct random pages on both sides (what SGLang's allocator hands out after a
    while), seeded per case. runs<N>: pages 0..n-1 into N runs of near-equal length at random places of the
    decode's pool, at least one page apart, in order. mixed: pages 0..n-1 into `MIXED_RUNS` runs holding three
    quarters of them and single pages between the runs, every run and single one page apart, in order."""
    n = case.shape.pages(case.tokens)
    if n > src_pages or n > dst_pages:
        raise ValueError(f"{case.name}: {n} pages do not fit pools of {src_pages} / {dst_pages}")
    runs = run_count(case.dest)
    if runs:
        runs = min(runs, n)
        free = dst_pages - n - (runs - 1)
        if free < 0:
            raise ValueError(f"{case.name}: {n} pages in {runs} runs do not fit a pool of {dst_pages}")
        rng = np.random.default_rng(seed + 1000 * case.tokens + runs)
        lens = np.full(runs, n // runs, dtype=np.int64)
        lens[: n % runs] += 1
        # run i starts after the i runs before it, i one-page gaps and a sorted share of the free pages
        starts = np.sort(rng.integers(0, free + 1, size=runs)) + np.arange(runs) + np.concatenate(([0], np.cumsum(lens)[:-1]))
        dst = np.concatenate([np.arange(s, s + k, dtype=np.int64) for s, k in zip(starts, lens)])
        return np.arange(n, dtype=np.int64), dst
    if case.dest == MIXED:
        return np.arange(n, dtype=np.int64), _mixed(n, dst_pages, case.name)
    if case.dest == "contiguous":
        start = min(dst_pages // 4, dst_pages - n)
        return np.arange(n, dtype=np.int64), np.arange(start, start + n, dtype=np.int64)
    rng = np.random.default_rng(seed + 1000 * case.tokens + len(case.shape.name) + case.shape.page)
    return (rng.choice(src_pages, size=n, replace=False).astype(np.int64),
            rng.choice(dst_pages, size=n, replace=False).astype(np.int64))


def _mixed(n: int, dst_pages: int, name: str) -> np.ndarray:
    """`mixed`'s destination ids: run i (of MIXED_RUNS, near-equal, 3n/4 pages in all) then its share of the single
    pages, each segment one page after the one before."""
    singles = n // 4
    runs = min(MIXED_RUNS, n - singles)
    lens = np.full(runs, (n - singles) // runs, dtype=np.int64)
    lens[: (n - singles) % runs] += 1
    seg = np.concatenate([np.concatenate(([k], np.ones(len(part), np.int64)))
                          for k, part in zip(lens, np.array_split(np.arange(singles), runs))])
    if n + seg.size - 1 > dst_pages:
        raise ValueError(f"{name}: {n} pages in {seg.size} pieces one page apart do not fit a pool of {dst_pages}")
    starts = np.concatenate(([0], np.cumsum(seg + 1)[:-1]))
    return np.concatenate([np.arange(a, a + k, dtype=np.int64) for a, k in zip(starts, seg)])


@dataclass
class Budget:
    """Repetitions within a time budget: at least `min_reps`, at most `max_reps`, and no more once `seconds`
    of timed calls have gone by (a 2 GiB case takes tens of reps, a 128-token one hundreds)."""

    seconds: float
    min_reps: int = 5
    max_reps: int = 200
    warmup: int = 2

    def run(self, fn: Callable[[], float]) -> list[float]:
        """Call `fn` (which returns its own duration in seconds) warmup + reps times; the timed durations."""
        for _ in range(self.warmup):
            fn()
        times: list[float] = []
        spent = 0.0
        while len(times) < self.max_reps and (len(times) < self.min_reps or spent < self.seconds):
            t = fn()
            times.append(t)
            spent += t
        return times


def stats_us(times_s: list[float]) -> dict:
    a = np.asarray(times_s, dtype=np.float64) * 1e6
    if not a.size:
        return {"p50": float("nan"), "p99": float("nan"), "min": float("nan"), "n": 0}
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "min": float(a.min()),
            "n": int(a.size)}


def crossover(rows: list[dict]) -> dict:
    """From the IPC rows (one per case and mode, with `mean_span` and `write_us`), where the copy engines beat
    the kernel: the smallest mean span and the largest span count of a case they won, and every case's
    winner. What `ce_plan.CE_MIN_MEAN_SPAN_BYTES` / `CE_MAX_SPANS_BATCHED` should be set from."""
    by_case: dict[str, dict] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["mode"]] = r
    winners, won_spans, won_mean, lost_mean = {}, [], [], []
    for name, modes in by_case.items():
        k, c = modes.get("kernel"), modes.get("copy_engine")
        if not k or not c or not c.get("write_us") or not k.get("write_us"):
            continue
        ce_wins = c["write_us"]["p50"] < k["write_us"]["p50"]
        winners[name] = "copy_engine" if ce_wins else "kernel"
        (won_mean if ce_wins else lost_mean).append(c["mean_span"])
        if ce_wins:
            won_spans.append(c["spans"])
    return {"winner": winners,
            "min_mean_span_won": min(won_mean) if won_mean else None,
            "max_mean_span_lost": max(lost_mean) if lost_mean else None,
            "max_spans_won": max(won_spans) if won_spans else None}


@dataclass
class Table:
    """Fixed-width text table."""

    columns: list[tuple[str, int]]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *values) -> None:
        self.rows.append([_fmt(v) for v in values])

    def render(self) -> str:
        head = "".join(f"{n:>{w}}" if i else f"{n:<{w}}" for i, (n, w) in enumerate(self.columns))
        lines = [head, "-" * len(head)]
        for row in self.rows:
            lines.append("".join(f"{v:>{w}}" if i else f"{v:<{w}}" for i, (v, (_, w)) in enumerate(zip(row, self.columns))))
        return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def phase_offsets(events: list[tuple[str, str, int, float]]) -> list[tuple[str, float]]:
    """Where a request's time goes on the two-sided path: `events` are (end, step, room, monotonic time) from
    both ends' traces (PairSender / PairReceiver), one clock for the two processes of a host. Per request (room)
    every step's offset from the sender's `start` in us, the k-th time a step recurs (one per chunk) named
    "end step k"; returned as the median over the requests, in the order of those medians (a timeline).
    Requests without a `start` (a trace switched on mid-request) are left out."""
    by_room: dict[int, list[tuple[str, str, float]]] = {}
    for end, step, room, t in events:
        by_room.setdefault(room, []).append((end, step, t))
    offsets: dict[str, list[float]] = {}
    for evs in by_room.values():
        start = next((t for end, step, t in evs if end == "prefill" and step == "start"), None)
        if start is None:
            continue
        seen: dict[tuple[str, str], int] = {}
        for end, step, t in sorted(evs, key=lambda e: e[2]):
            k = seen.get((end, step), 0)
            seen[(end, step)] = k + 1
            offsets.setdefault(f"{end} {step} {k}", []).append((t - start) * 1e6)
    medians = [(name, round(float(np.median(v)), 1)) for name, v in offsets.items()]
    return sorted(medians, key=lambda kv: kv[1])


#: chunk_steps' columns: (name, later step, earlier step), both of the same chunk; "end step" names as
#: phase_offsets gives them, the chunk's index appended
CHUNK_STEPS = (
    ("hop", "decode header", "prefill handed"),  # the header from the prefill's hand-off to the receiver taking it
    ("p_gather", "prefill gather", "prefill handed"),  # the prefill queueing the chunk's gather
    ("p_post", "prefill post", "prefill gather"),  # the prefill posting its send
    ("d_post", "decode post", "decode slot"),  # the decode posting its receive
    ("d_check", "decode checked", "decode post"),  # the header's checks
    ("d_ready", "decode readied", "decode checked"),  # readying the scatter (ids on the device, the launch's args)
    ("d_launch", "decode launched", "decode landed"),  # launching the scatter once the bytes are in
)


def chunk_steps(phases_us: list[tuple[str, float]]) -> list[dict]:
    """`phase_offsets`' timeline as each chunk's step durations in us (CHUNK_STEPS; None where a step is missing),
    and `link_wait`: how long after the previous chunk landed both ends had posted this one (positive: the link
    had nothing to move for about that long; negative: the receive was posted ahead). Durations between medians,
    so a step may come out slightly negative."""
    t = dict(phases_us)
    rows = []
    k = 0
    while f"decode header {k}" in t or f"prefill header {k}" in t:
        row: dict = {"chunk": k}
        for name, later, earlier in CHUNK_STEPS:
            a, b = t.get(f"{later} {k}"), t.get(f"{earlier} {k}")
            row[name] = None if a is None or b is None else round(a - b, 1)
        posts, landed = (t.get(f"decode post {k}"), t.get(f"prefill post {k}")), t.get(f"decode landed {k - 1}")
        row["link_wait"] = (None if k == 0 or landed is None or None in posts
                            else round(max(posts) - landed, 1))
        rows.append(row)
        k += 1
    return rows


def ratio(reference_us: Optional[float], measured_us: Optional[float]) -> Optional[float]:
    """reference / measured (1.0 = as fast as the reference); None when either is missing."""
    if not reference_us or not measured_us:
        return None
    return reference_us / measured_us
