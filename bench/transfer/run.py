"""Transfer benchmark on two GPUs, one process per GPU: the nccl transport + fused gather/scatter against the
physical anchors, and the memory/bandwidth price of each extra NCCL communicator by channel cap.

    python -m bench.transfer.run --out bench/results [--quick]

Methods, each timed from the prefill's send() call to the decode's Success (last scatter or receive done),
over a monotonic clock both processes share:
- `engine`: pipelined fused gather -> send / recv -> fused scatter through staging slots (bench/transfer/loops.py);
- `contiguous`: one NCCL send of the same bytes from a contiguous buffer (the limit);
- `per_page`: one NCCL send per page and region straight into the destination page (blocking communicator);
- `per_page_group`: the same sends in one ncclGroupStart/End.
Mooncake Transfer Engine is not measured here (not installed on the GPU host image; see docs/nccl.md).
Writes `transfer_<machine>.json` and `.png` into --out; prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

import numpy as np

from .pair import SAFE_ENV, connect_pair, run_pair

GiB = 1 << 30
MiB = 1 << 20


def _machine(lib_version: int) -> dict:
    import torch

    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            return f"unavailable: {e}"

    return {
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "driver": sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[:1],
        "topology": sh(["nvidia-smi", "topo", "-m"]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": lib_version,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "env": {k: os.environ.get(k) for k in list(SAFE_ENV) + ["NCCL_CUMEM_ENABLE"]},
    }


def mode_name(cfg: dict) -> str:
    """Label of the transport variant a run measures (rows carry it)."""
    name = "split" if cfg.get("split") else "nonblocking"
    if cfg.get("high_priority"):
        name += "+prio"
    if cfg.get("gather_programs"):
        name += f"+grid{cfg['gather_programs']}"
    return name


class Side:
    """One rank's state: device, transports, pools and the lockstep helpers."""

    def __init__(self, rank: int, conn, cfg: dict):
        import torch

        from sglang_p2p_backend.engine.transport.nccl import NcclTransport

        self.torch = torch
        self.rank, self.conn, self.cfg = rank, conn, cfg
        self.dev = torch.device("cuda", rank)
        self.mode = mode_name(cfg)
        self.tr = NcclTransport(self.dev, split_blocking=bool(cfg.get("split")),
                                high_priority=bool(cfg.get("high_priority")))
        self.results: dict = {"transfers": [], "kernels": [], "errors": []}

    def log(self, *a) -> None:
        if self.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)

    def barrier(self) -> None:
        self.conn.send("barrier")
        got = self.conn.recv()
        assert got == "barrier", got

    def free_mb(self) -> float:
        self.torch.cuda.synchronize(self.dev)
        return self.torch.cuda.mem_get_info(self.dev)[0] / 1e6

    def timed(self, send_fn: Callable, recv_fn: Callable, iters: int, warmup: int = 2,
              post_first: bool = True) -> list[float]:
        """Seconds from send_fn() start (rank 0) to the receive event done (rank 1), per iteration. The decode
        posts its receives before the prefill starts (`post_first`), or while it runs: thousands of queued
        per-page receives would fill CUDA's launch queue and block the poster before it could say ready."""
        from .loops import wait_event

        times, self.last_issue = [], []
        for i in range(warmup + iters):
            if self.rank == 1:
                if not post_first:
                    self.conn.send("ready")
                ev = recv_fn()
                if post_first:
                    self.conn.send("ready")
                wait_event(ev, 60)
                self.conn.send(time.perf_counter())
            else:
                assert self.conn.recv() == "ready"
                t0 = time.perf_counter()
                send_fn()
                issued = time.perf_counter()
                t1 = self.conn.recv()
                if i >= warmup:
                    times.append(t1 - t0)
                    self.last_issue.append(issued - t0)
        return times

    def record(self, times: list[float], nbytes: int, **kw) -> Optional[dict]:
        if self.rank != 0 or not times:
            return None
        t = np.array(times)
        row = dict({"mode": self.mode}, **kw, bytes=nbytes, n=len(times), p50_us=float(np.percentile(t, 50) * 1e6),
                   p99_us=float(np.percentile(t, 99) * 1e6), min_us=float(t.min() * 1e6))
        row["gbps_p50"] = nbytes / (row["p50_us"] * 1e-6) / 1e9
        # host time of the prefill's send() call alone (launches; the transfer runs on after it)
        row["issue_p50_us"] = float(np.percentile(self.last_issue, 50) * 1e6) if self.last_issue else None
        self.results["transfers"].append(row)
        self.log(f"{kw}: {nbytes / 1e6:.1f} MB p50 {row['p50_us']:.0f} us p99 {row['p99_us']:.0f} us "
                 f"{row['gbps_p50']:.0f} GB/s")
        return row


def _comm_costs(side: Side, src, dst, caps, per_cap: int) -> list[dict]:
    """GPU memory per extra communicator (both ranks), its init time, 1 GiB bandwidth and 64 KiB latency."""
    rows = []
    for cap in caps:
        side.barrier()
        free0 = side.free_mb()
        t = time.perf_counter()
        comms = [connect_pair(side.tr, side.conn, side.rank, 60, max_ctas=cap) for _ in range(per_cap)]
        init_s = (time.perf_counter() - t) / per_cap
        mb = (free0 - side.free_mb()) / per_cap
        c = comms[0]
        big = side.timed(lambda: c.send(src[:GiB]), lambda: c.recv(dst[:GiB]).event, 5, 1)
        small = side.timed(lambda: c.send(src[: 64 << 10]), lambda: c.recv(dst[: 64 << 10]).event, 20, 3)
        issue = float(np.median(side.last_issue)) * 1e6 if side.rank == 0 else None
        for x in comms:
            x.close()
        leak = free0 - side.free_mb()
        side.conn.send((mb, leak))
        peer_mb, peer_leak = side.conn.recv()
        if side.rank == 0:
            row = {"cap": cap, "mode": side.mode, "mb": max(mb, peer_mb), "mb_prefill": mb, "mb_decode": peer_mb, "init_s": init_s,
                   "gbps": GiB / float(np.median(big)) / 1e9, "lat64k_us": float(np.median(small)) * 1e6,
                   "issue64k_us": issue,
                   "leak_mb": max(leak, peer_leak)}
            rows.append(row)
            side.log(f"cap {cap}: {row['mb']:.0f} MB/comm (P {mb:.0f}, D {peer_mb:.0f}), {row['gbps']:.0f} GB/s, "
                     f"64 KiB {row['lat64k_us']:.0f} us (send() call {issue:.0f} us), init {init_s:.2f} s, after close {row['leak_mb']:.1f} MB")
    return rows


def _bench_memory_only(rank: int, conn, cfg: dict) -> dict:
    side = Side(rank, conn, cfg)
    torch = side.torch
    buf = torch.empty(GiB, dtype=torch.uint8, device=side.dev)
    base = connect_pair(side.tr, conn, rank, 60, max_ctas=16)  # the first communicator pays NCCL's own setup
    rows = _comm_costs(side, buf, buf, cfg["caps"], cfg["per_cap"])
    base.close()
    return {"comm_cost": rows}


class Pools:
    """Source (rank 0) or destination (rank 1) KV pools of both layouts, pattern-filled."""

    def __init__(self, side: Side, layouts, pool_tokens: int):
        from .kv import alloc_pool, fill_pattern

        self.whole = {}
        for lay in layouts:
            whole, _ = alloc_pool(lay, 1, pool_tokens, side.dev)
            fill_pattern(whole, salt=1 if side.rank == 0 else 2)
            self.whole[lay.name] = whole

    def views(self, layout, page_size: int):
        w = self.whole[layout.name]
        shaped = w.view(layout.regions, w.shape[1] // page_size, page_size * layout.token_bytes)
        return shaped, [shaped[r] for r in range(layout.regions)]


def _engine_case(side: Side, pools: Pools, layout, ps: int, tokens: int, comm, slots, iters: int, seed: int,
                 method: str = "engine", extra: Optional[dict] = None) -> None:
    from sglang_p2p_backend.engine.copy.gather_cuda import FusedGather

    from .kv import chunk_ranges, pick_pages, verify_pages
    from .loops import PipelinedReceiver, PipelinedSender, wait_event

    torch = side.torch
    shaped, views = pools.views(layout, ps)
    n = max(1, tokens // ps)
    src_ids = pick_pages(shaped.shape[1], n, seed)
    dst_ids = pick_pages(shaped.shape[1], n, seed + 1)
    nbytes = n * layout.page_bytes(ps)
    ranges = chunk_ranges(n, layout.page_bytes(ps), slots.nbytes)
    fused = FusedGather([views], max_programs=side.cfg.get("gather_programs"))
    if side.rank == 0:
        sender = PipelinedSender(comm, fused, slots)
        times = side.timed(lambda: sender.send(src_ids, ranges), None, iters)
    else:
        receiver = PipelinedReceiver(comm, fused, slots)
        times = side.timed(None, lambda: receiver.recv(dst_ids, ranges), iters)
    ok = None
    if side.rank == 1:
        dev_dst = torch.from_numpy(dst_ids).to(side.dev)
        dev_src = torch.from_numpy(src_ids).to(side.dev)
        src_shape = (layout.regions, shaped.shape[1], shaped.shape[2])
        ok = verify_pages(shaped, dev_dst, dev_src, src_shape, salt=1)
    side.conn.send(ok)
    ok = ok if side.rank == 1 else side.conn.recv()
    if side.rank == 1:
        side.conn.recv()
    side.record(times, nbytes, method=method, layout=layout.name, page_size=ps, tokens=tokens, cap=comm.max_ctas,
                chunk_mb=slots.nbytes / MiB, slots=len(slots.bufs), chunks=len(ranges), verified=bool(ok),
                **(extra or {}))
    if side.rank == 0 and not ok:
        side.results["errors"].append(f"engine bytes wrong: {layout.name} ps {ps} tokens {tokens}")


def _contiguous_case(side: Side, comm, src, dst, nbytes: int, iters: int, method: str = "contiguous", **kw) -> None:
    times = side.timed(lambda: comm.send(src[:nbytes]), lambda: comm.recv(dst[:nbytes]).event, iters)
    side.record(times, nbytes, method=method, cap=comm.max_ctas, **kw)


def _per_page_case(side: Side, pools: Pools, layout, ps: int, tokens: int, comm, iters: int, grouped: bool) -> None:
    from .kv import pick_pages

    shaped, views = pools.views(layout, ps)
    n = max(1, tokens // ps)
    ids = pick_pages(shaped.shape[1], n, 7 if side.rank == 0 else 8)
    bufs = [views[r][int(p)] for r in range(layout.regions) for p in ids]
    if grouped:
        send, recv = (lambda: comm.send_batch(bufs)), (lambda: comm.recv_batch(bufs).event)
    else:
        def send():
            for b in bufs:
                comm.send(b)

        def recv():
            c = None
            for b in bufs:
                c = comm.recv(b)
            return c.event

    times = side.timed(send, recv, iters, warmup=1, post_first=False)
    side.record(times, n * layout.page_bytes(ps), method="per_page_group" if grouped else "per_page", mode="baseline",
                layout=layout.name, page_size=ps, tokens=tokens, cap=comm.max_ctas, messages=len(bufs))


def _kernels(side: Side, pools: Pools, layouts, page_sizes, token_counts) -> None:
    """Gather/scatter alone on rank 0: fused kernel vs one index_select per region."""
    from sglang_p2p_backend.engine.copy.gather_cuda import FusedGather

    from .kv import pick_pages

    torch = side.torch
    staging = torch.empty(max(t for t in token_counts) * max(l.page_bytes(1) for l in layouts),
                          dtype=torch.uint8, device=side.dev)

    def bench(fn, reps=10) -> float:
        fn()
        torch.cuda.synchronize(side.dev)
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in evs:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(side.dev)
        return float(np.median([a.elapsed_time(b) for a, b in evs])) * 1e3

    for lay in layouts:
        for ps in page_sizes:
            shaped, views = pools.views(lay, ps)
            fused = FusedGather([views])
            for tokens in token_counts:
                n = max(1, tokens // ps)
                ids = torch.from_numpy(pick_pages(shaped.shape[1], n, 11)).to(side.dev)
                nbytes = n * lay.page_bytes(ps)
                item = ps * lay.token_bytes

                def index_select():
                    for r, v in enumerate(views):
                        torch.index_select(v, 0, ids, out=staging[r * n * item:(r + 1) * n * item].view(n, item))

                cases = {"fused_gather": lambda: fused.copy(0, ids, staging, scatter=False),
                         "fused_scatter": lambda: fused.copy(0, ids, staging, scatter=True),
                         "index_select_gather": index_select}
                for op, fn in cases.items():
                    us = bench(fn)
                    side.results["kernels"].append({"layout": lay.name, "page_size": ps, "tokens": tokens, "op": op,
                                                    "us": us, "gbps": nbytes / (us * 1e-6) / 1e9, "bytes": nbytes})
                side.log(f"kernels {lay.name} ps {ps} {tokens} tok: " + ", ".join(
                    f"{r['op']} {r['gbps']:.0f} GB/s" for r in side.results["kernels"][-3:]))


def _bench_rank(rank: int, conn, cfg: dict) -> dict:
    from .kv import LAYOUTS
    from .loops import StagingSlots

    side = Side(rank, conn, cfg)
    torch = side.torch
    layouts = [LAYOUTS[n] for n in cfg["layouts"]]
    out_path = cfg.get("partial_path")

    def save() -> None:
        if rank == 0 and out_path:
            with open(out_path, "w") as f:
                json.dump(side.results, f, indent=1)

    cfg = dict(cfg, save=save)

    if rank == 0:
        side.results["machine"] = _machine(side.tr.lib.version)
    free_start = side.free_mb()
    pools = Pools(side, layouts, cfg["pool_tokens"])
    max_bytes = max(t for t in cfg["tokens"]) * max(l.page_bytes(1) for l in layouts)
    scratch = torch.empty(max(max_bytes, GiB), dtype=torch.uint8, device=side.dev)
    scratch.fill_(3)
    src_flat = pools.whole[layouts[-1].name].view(-1)
    free0 = side.free_mb()
    side.log(f"pools + scratch {free_start - free0:.0f} MB")
    comm16 = connect_pair(side.tr, conn, rank, 60, max_ctas=16)
    first = free0 - side.free_mb()
    side.conn.send(first)
    side.results["first_comm_mb"] = {"this_rank": first, "peer": side.conn.recv()}
    side.log(f"first communicator: {first:.0f} MB")

    side.results["comm_cost"] = _comm_costs(side, src_flat, scratch, cfg["caps"], cfg["per_cap"])
    save()

    slots16 = StagingSlots(comm16, cfg["chunk_mb"] * MiB, cfg["slots"])
    seed = 100
    for lay in layouts:
        for ps in cfg["page_sizes"]:
            for tokens in cfg["tokens"]:
                seed += 2
                iters = cfg["iters_small"] if tokens <= 4096 else cfg["iters_large"]
                _engine_case(side, pools, lay, ps, tokens, comm16, slots16, iters, seed)
                n = max(1, tokens // ps)
                _contiguous_case(side, comm16, src_flat, scratch, n * lay.page_bytes(ps), iters,
                                 layout=lay.name, page_size=ps, tokens=tokens)
            save()

    # staging size: chunk budget sweep on one case
    lay = layouts[-1]
    slots16 = None  # the sweep's slots replace it
    for chunk_mb in cfg["chunk_sweep_mb"]:
        slots = StagingSlots(comm16, chunk_mb * MiB, cfg["slots"])
        _engine_case(side, pools, lay, 16, cfg["chunk_sweep_tokens"], comm16, slots, cfg["iters_large"], 500,
                     method="engine_chunk_sweep")
        del slots
    save()

    # lean communicators: engine vs contiguous at the same small cap
    for cap in cfg["lean_caps"]:
        lean = connect_pair(side.tr, conn, rank, 60, max_ctas=cap)
        slots = StagingSlots(lean, cfg["chunk_mb"] * MiB, cfg["slots"])
        for lay in layouts:
            for tokens in cfg["lean_tokens"]:
                _engine_case(side, pools, lay, 16, tokens, lean, slots, cfg["iters_large"], 700 + tokens)
                _contiguous_case(side, lean, src_flat, scratch, (tokens // 16) * lay.page_bytes(16),
                                 cfg["iters_large"], layout=lay.name, page_size=16, tokens=tokens)
        del slots
        lean.close()
    save()

    # two peers at once: two communicators, each moving its own request
    other = connect_pair(side.tr, conn, rank, 60, max_ctas=16)
    _two_peers(side, pools, layouts[-1], 16, cfg["two_peer_tokens"], [comm16, other], cfg)
    other.close()
    save()

    if cfg["per_page"]:
        _baselines(side, pools, layouts, src_flat, scratch, cfg)

    side.barrier()
    if rank == 0 and cfg["kernel_tokens"]:
        _kernels(side, pools, layouts, cfg["page_sizes"], cfg["kernel_tokens"])
    side.barrier()
    comm16.close()
    return side.results


def _baselines(side: Side, pools: Pools, layouts, src_flat, scratch, cfg: dict) -> None:
    """Per-page sends on a blocking communicator (the cheapest way to issue many sends), and what a blocking
    communicator gives the engine and one contiguous send."""
    from sglang_p2p_backend.engine.transport.nccl import NcclTransport

    from .loops import StagingSlots

    rank, conn = side.rank, side.conn
    save = cfg["save"]
    blocking = NcclTransport(side.dev, blocking=True)
    pp = connect_pair(blocking, conn, rank, 60, max_ctas=16)
    # what a blocking communicator would save per op (its init cannot time out, so the engine does not use one)
    slots_pp = StagingSlots(pp, cfg["chunk_mb"] * MiB, cfg["slots"])
    for lay in layouts:
        for tokens in (128, 4096):
            _engine_case(side, pools, lay, 16, tokens, pp, slots_pp, cfg["iters_small"], 800 + tokens,
                         method="engine_blocking_comm")
            _contiguous_case(side, pp, src_flat, scratch, (tokens // 16) * lay.page_bytes(16), cfg["iters_small"],
                             method="contiguous_blocking_comm", layout=lay.name, page_size=16, tokens=tokens)
    del slots_pp
    for lay in layouts:
        for ps, tokens in cfg["per_page_cases"]:
            for grouped in (False, True):
                _per_page_case(side, pools, lay, ps, tokens, pp, cfg["iters_per_page"], grouped)
        save()
    pp.close()


def _two_peers(side: Side, pools: Pools, layout, ps: int, tokens: int, comms, cfg) -> None:
    """Both communicators carry a request of `tokens` at the same time (different pages)."""
    from sglang_p2p_backend.engine.copy.gather_cuda import FusedGather

    from .kv import chunk_ranges, pick_pages
    from .loops import PipelinedReceiver, PipelinedSender, StagingSlots

    torch = side.torch
    shaped, views = pools.views(layout, ps)
    n = tokens // ps
    perm = pick_pages(shaped.shape[1], 2 * n, 900 + side.rank)
    ids = [perm[:n], perm[n:]]
    ranges = chunk_ranges(n, layout.page_bytes(ps), cfg["chunk_mb"] * MiB)
    fused = FusedGather([views], max_programs=side.cfg.get("gather_programs"))
    ends = [(PipelinedSender if side.rank == 0 else PipelinedReceiver)(c, fused, StagingSlots(c, cfg["chunk_mb"] * MiB, cfg["slots"]))
            for c in comms]

    def send():
        for e, i in zip(ends, ids):
            e.send(i, ranges)

    def recv():
        evs = [e.recv(i, ranges) for e, i in zip(ends, ids)]
        last = torch.cuda.Event()
        for ev in evs:
            torch.cuda.current_stream(side.dev).wait_event(ev)
        last.record()
        return last

    times = side.timed(send, recv, cfg["iters_large"])
    side.record(times, 2 * n * layout.page_bytes(ps), method="engine_two_peers", layout=layout.name, page_size=ps,
                tokens=tokens, cap=comms[0].max_ctas, peers=2)


def config(quick: bool, core: bool = False) -> dict:
    cfg = {
        "layouts": ["mla", "mha"],
        "page_sizes": [1, 16, 64],
        "tokens": [128, 1024, 4096, 16384, 32768],
        "pool_tokens": 40960,
        "caps": [2, 4, 8, 16, None],
        "per_cap": 3,
        "chunk_mb": 64,
        "slots": 3,
        "chunk_sweep_mb": [8, 16, 32, 64, 128, 256],
        "chunk_sweep_tokens": 16384,
        "lean_caps": [4, 8],
        "lean_tokens": [4096, 32768],
        "two_peer_tokens": 16384,
        "per_page_cases": [(1, 128), (16, 128), (64, 128), (16, 4096), (64, 4096)],
        "kernel_tokens": [4096, 32768],
        "iters_small": 30,
        "iters_large": 10,
        "iters_per_page": 2,
        "per_page": True,
        "split": False,
    }
    if core:
        cfg.update(page_sizes=[16], tokens=[128, 4096, 32768], caps=[4, 16], per_cap=1, chunk_sweep_mb=[64, 256],
                   lean_tokens=[32768], per_page=False, kernel_tokens=[])
    if quick:
        cfg.update(tokens=[128, 4096], page_sizes=[16], caps=[4, 16], per_cap=1, chunk_sweep_mb=[64],
                   lean_caps=[4], lean_tokens=[4096], two_peer_tokens=4096, per_page_cases=[(16, 128)],
                   kernel_tokens=[4096], iters_small=5, iters_large=3, iters_per_page=1, pool_tokens=8192)
    return cfg


def split_config(cfg: dict) -> dict:
    """The engine again, ops on a blocking child communicator split off the non-blocking one (fewer cases)."""
    return dict(cfg, split=True, page_sizes=[16], caps=[4, 16], per_cap=2, chunk_sweep_mb=[16, 32, 128],
                lean_caps=[4], per_page=False, kernel_tokens=[], partial_path=cfg["partial_path"] + ".split")


def evaluate(res: dict) -> dict:
    """Our targets, from the measured rows, per transport mode."""
    modes = sorted({r.get("mode", "nonblocking") for r in res.get("transfers", [])})
    return {m: _evaluate_mode(res, m) for m in modes}


def _evaluate_mode(res: dict, mode: str) -> dict:
    tr = [r for r in res.get("transfers", []) if r.get("mode", "nonblocking") in (mode, "baseline")]
    per_page_rows = [r for r in res.get("transfers", []) if r["method"] == "per_page"]
    eng = {(r["layout"], r["page_size"], r["tokens"], r["cap"]): r for r in tr if r["method"] == "engine"}
    con = {(r["layout"], r["page_size"], r["tokens"], r["cap"]): r for r in tr if r["method"] == "contiguous"}
    ratios = {f"{k[0]}/ps{k[1]}/{k[2]}tok/cap{k[3]}": eng[k]["p50_us"] / con[k]["p50_us"]
              for k in eng if k in con and k[2] >= 4096}
    big = [r["gbps_p50"] for r in eng.values() if r["tokens"] >= 4096 and r["cap"] == 16]
    two = [r["gbps_p50"] for r in tr if r["method"] == "engine_two_peers"]
    speedups = {}
    for r in per_page_rows:
        k = (r["layout"], r["page_size"], r["tokens"], 16)
        if k in eng:
            speedups[f"{k[0]}/ps{k[1]}/{k[2]}tok"] = r["p50_us"] / eng[k]["p50_us"]
    small = {f"{k[0]}/ps{k[1]}": r["p50_us"] for k, r in eng.items() if k[2] == 128 and k[3] == 16}
    costs = res.get("comm_cost_split" if mode.startswith("split") else "comm_cost", [])
    lean = [r for r in costs if r["cap"] == 4]
    return {
        "engine_over_contiguous_p50_ge4k": ratios,
        "max_ratio_ge4k": max(ratios.values()) if ratios else None,
        "engine_min_gbps_ge4k_cap16": min(big) if big else None,
        "two_peers_gbps": two,
        "per_page_over_engine": speedups,
        "p50_us_128_tokens": small,
        "lean_comm_mb_cap4": lean[0]["mb"] if lean else None,
        "lean_comm_mb_cap4_prefill_decode": [lean[0]["mb_prefill"], lean[0]["mb_decode"]] if lean else None,
        "targets": {"ratio_le": 1.2, "gbps_ge": 300, "per_page_speedup_ge": 50, "p50_128_us_le": 300,
                    "lean_mb_le": 40},
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="a few cases only (smoke run)")
    ap.add_argument("--no-cumem-sweep", action="store_true", help="skip the NCCL_CUMEM_ENABLE=0 memory sweep")
    ap.add_argument("--no-split", action="store_true", help="skip the blocking-child (split) transport mode")
    ap.add_argument("--core", action="store_true", help="engine vs contiguous at page 16 only (a short run)")
    ap.add_argument("--high-priority", action="store_true", help="pair streams at the highest CUDA priority")
    ap.add_argument("--gather-programs", type=int, default=None, help="bound the gather/scatter grid (persistent)")
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = config(args.quick, args.core)
    cfg.update(high_priority=args.high_priority, gather_programs=args.gather_programs)
    if args.core:
        args.no_cumem_sweep = True
    cfg["partial_path"] = os.path.join(args.out, "transfer_partial.json")
    t0 = time.monotonic()
    try:
        res = run_pair(_bench_rank, (cfg,), timeout=args.timeout)[0]
    except Exception as e:  # keep what the phases before the failure measured
        print("benchmark failed:", e, file=sys.stderr)
        if not os.path.exists(cfg["partial_path"]):
            raise
        with open(cfg["partial_path"]) as f:
            res = json.load(f)
        res.setdefault("errors", []).append(f"run stopped early: {str(e)[-2000:]}")
    if not args.no_split:
        scfg = split_config(cfg)
        left = args.timeout - (time.monotonic() - t0)
        try:
            if left < 40:
                raise TimeoutError(f"only {left:.0f}s left")
            split = run_pair(_bench_rank, (scfg,), timeout=min(200.0, left - 30))[0]
            res["transfers"] += split["transfers"]
            res["comm_cost_split"] = split["comm_cost"]
            res.setdefault("errors", []).extend(split.get("errors", []))
        except Exception as e:  # the non-blocking results still count
            res.setdefault("errors", []).append(f"split mode: {str(e)[-3000:]}")
            if os.path.exists(scfg["partial_path"]):
                with open(scfg["partial_path"]) as f:
                    part = json.load(f)
                res["transfers"] += part.get("transfers", [])
                res["comm_cost_split"] = part.get("comm_cost", [])
        if os.path.exists(scfg["partial_path"]):
            os.remove(scfg["partial_path"])
    if not args.no_cumem_sweep:
        left = args.timeout - (time.monotonic() - t0)
        try:
            if left < 30:
                raise TimeoutError(f"only {left:.0f}s left")
            mem = run_pair(_bench_memory_only, (cfg,), timeout=min(90.0, left), env={"NCCL_CUMEM_ENABLE": "0"})[0]
            res["comm_cost_cumem0"] = mem["comm_cost"]
        except Exception as e:  # the main results still count
            res.setdefault("errors", []).append(f"cumem=0 sweep: {str(e)[-2000:]}")
    res["config"] = {k: v for k, v in cfg.items() if k not in ("partial_path", "save")}
    if args.core or args.high_priority or args.gather_programs:
        res["machine"]["variant"] = mode_name(cfg)
    res["evaluation"] = evaluate(res)
    gpu = res["machine"]["gpu"].replace(" ", "-").lower()
    name = f"transfer_{gpu}-x{res['machine']['gpus']}"
    if res["machine"].get("variant"):
        name += "_" + res["machine"]["variant"].replace("+", "_")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    os.remove(cfg["partial_path"])
    try:
        from .plot import plot

        plot(res, os.path.join(args.out, name + ".png"))
    except Exception as e:  # matplotlib missing: the JSON is the result
        print("plot skipped:", e, file=sys.stderr)
    print(json.dumps(res["evaluation"], indent=1))
    return 0 if not res.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
