"""Same-host CUDA IPC write path on one GPU: `CudaIpcTransport.write` against one device-to-device copy.

    python bench/transfer/ipc_bench.py [--machine NAME] [--out PATH] [--reps 30] [--latency-reps 1000]

Two processes share GPU 0 (CUDA IPC needs two: a process cannot open its own handle). The decode allocates its
pools with torch, one tensor per region as SGLang does, exports them with `export_regions` and sends the
export; the prefill maps it (`open_peer`) and writes requests built by `onesided.chunk_descriptors`:
- `mla_4k_*`: 4,096 tokens of MLA (61 layers x 576 bf16 per token), page 64: 64 pages per layer, to
  contiguous destination pages (one span per layer) and to scattered ones (one span per page and layer);
- `mha_16k_*`: 16,384 tokens of MHA (32 layers x K, V x 8 x 128 bf16), page 16: 1,024 pages per region;
- `mla_128`: 128 tokens (2 pages x 61 layers, scattered): the latency of one small write.
The prefill's pages are contiguous in every case (pages 0..n-1 of its pool).

Columns: `write` is host time from the call of `write_pages()` to its return (the path the prefill takes for whole
pages: bounds checks, one upload of the page ids and region table, one launch of the page-table kernel, and a
synchronise); `spans` the same bytes through `write()` (one descriptor per merged run: the path of head slices); `kernel` the GPU time of the tile-table upload and the copy alone (CUDA events, launched behind
a GPU sleep so host planning is not counted); `plan` the host work before the launch (address translation and
`plan_tiles`). `torch` is ONE `dst.copy_(src)` of a contiguous tensor of the same bytes, CUDA-event timed, in the
same process. ratio = torch / write (target >= 0.8); latency target: mla_128 write p50 <= 100 us. After each
case the decode checks its destination pages byte for byte against the prefill's seeded contents (after the
page path and again after the span path). Last, `interference`: a bf16 matmul loop on a stream of its own in the
prefill process, launched and then as one CUDA graph, timed alone and while the 16k MHA request is written back
to back (target: at most 5% slower).
`--copy-engine off` sends every chunk to the kernel (`on`: to the copy engines), where `split` (the default, as
served) and `auto` send the 16k contiguous request's 32 MiB spans into the same GPU to the copy engines.
`--programs N` bounds the page kernel's grid (SGLANG_P2P_IPC_PROGRAMS), for the write time and the matmul's slowdown
at each bound.
Writes JSON to --out (default bench/results/ipc_<machine>.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time
from pathlib import Path

import numpy as np

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # run as a script: the repository root holds `bench` and `sglang_p2p_backend`
    sys.path.insert(0, _ROOT)

from bench.transfer.gpu_names import gpu_slugs  # noqa: E402
from bench.transfer.interference import beside_writes  # noqa: E402
from bench.transfer.pair import collect, expect, guarded, page_bytes, spawn  # noqa: E402
from sglang_p2p_backend.engine.config import COPY_ENGINE_MODES  # noqa: E402

#: regions and bytes per token in a region (bf16)
LAYOUTS = {"mla": (61, 576 * 2), "mha": (64, 8 * 128 * 2)}
PAGE_SIZE = {"mla": 64, "mha": 16}
PREFILL_PAGES = {"mla": 64, "mha": 1024}  # the largest request of each layout
DECODE_PAGES = {"mla": 256, "mha": 2048}  # room for scattered destinations
# (name, layout, tokens, destination pages)
CASES = [("mla_4k_contiguous", "mla", 4096, "contiguous"), ("mla_4k_scattered", "mla", 4096, "scattered"),
         ("mha_16k_contiguous", "mha", 16384, "contiguous"), ("mha_16k_scattered", "mha", 16384, "scattered")]
LATENCY = ("mla_128", "mla", 128, "scattered")
SESSION = "127.0.0.1:17002"
SEED = {"mla": 11, "mha": 12}
RATIO_TARGET = 0.8
LATENCY_TARGET_US = 100.0
INTERFERENCE_TARGET = 0.05  # a matmul loop of the same process slowed by at most 5% while transfers run


def _device(torch):
    return torch.device("cuda", torch.cuda.current_device())


def _item(layout: str) -> int:
    return PAGE_SIZE[layout] * LAYOUTS[layout][1]


def _alloc(torch, layout: str, pages: int, dev, zero: bool):
    regions, token_bytes = LAYOUTS[layout]
    shape = (pages, PAGE_SIZE[layout], token_bytes // 2)
    make = torch.zeros if zero else torch.empty
    return [make(shape, dtype=torch.bfloat16, device=dev) for _ in range(regions)]


def _truth(torch, layout: str, region: int, dev):
    """The prefill's bytes of one region; the decode regenerates them from the seed to check a case."""
    g = torch.Generator(device=dev).manual_seed(SEED[layout] * 1009 + region)
    return torch.randint(0, 256, (PREFILL_PAGES[layout], _item(layout)), generator=g, device=dev, dtype=torch.uint8)


# -- decode ---------------------------------------------------------------------------------------------------

def _decode(conn, cfg):
    import msgspec
    import torch

    from sglang_p2p_backend.engine.transport.cuda_ipc import export_regions

    dev = _device(torch)
    pools = {lay: _alloc(torch, lay, DECODE_PAGES[lay], dev, zero=True) for lay in LAYOUTS}
    torch.cuda.synchronize(dev)
    regions = [(t.data_ptr(), t.numel() * t.element_size()) for lay in LAYOUTS for t in pools[lay]]
    t0 = time.perf_counter()
    export = export_regions(regions, dev)
    export_ms = (time.perf_counter() - t0) * 1e3
    if {len(h) for h in export.handles} != {64}:
        raise RuntimeError(f"export_regions returned handles of {sorted({len(h) for h in export.handles})} bytes, "
                           "not 64 (the handle bytes were cut)")
    conn.send(("export", msgspec.msgpack.encode(export), {lay: [t.data_ptr() for t in pools[lay]] for lay in LAYOUTS}))
    while True:
        msg = expect(conn, ("verify", "done"), cfg["timeout"])
        if msg[0] == "done":
            return {"export_ms": export_ms, "allocations": len(export.handles), "regions": len(regions)}
        _, lay, src, dst = msg
        src_t, dst_t = torch.from_numpy(src).to(dev), torch.from_numpy(dst).to(dev)
        bad = torch.zeros(DECODE_PAGES[lay], dtype=torch.bool, device=dev)
        for r, t in enumerate(pools[lay]):
            bad[dst_t[(page_bytes(t)[dst_t] != _truth(torch, lay, r, dev)[src_t]).any(dim=1)]] = True
            page_bytes(t)[dst_t] = 0  # the next case of this layout starts from zeros again
        torch.cuda.synchronize(dev)
        conn.send(("verified", bad.nonzero().flatten().tolist()[:10]))


def decode(rank, conn, cfg):
    return guarded(_decode, conn, cfg)


# -- prefill --------------------------------------------------------------------------------------------------

def _peer(messages, layout: str, export, ptrs: list[int]):
    agreement = messages.Agreement(protocol=messages.PROTOCOL_VERSION, page_size=PAGE_SIZE[layout],
                                   kv_dtype="bfloat16", kv_item_lens=[_item(layout)] * len(ptrs), state_item_lens=[],
                                   slot_bytes=0, auth=False, mla=layout == "mla")
    return messages.PeerRegister(session=SESSION, incarnation=export.pid, hostname=socket.gethostname(),
                                 engine_rank=0, attn_tp_size=1, agreement=agreement, kv_ptrs=list(ptrs), aux_ptrs=[],
                                 aux_item_lens=[], state_ptrs=[], kv_pages=DECODE_PAGES[layout], aux_rows=0,
                                 state_slots=[], transports=["cudaipc"], ipc=export)


def _us(xs) -> dict:
    a = np.asarray(xs, dtype=np.float64) * 1e6
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "min": float(a.min()),
            "max": float(a.max())}


class Prefill:
    def __init__(self, conn, cfg):
        import msgspec
        import torch

        from sglang_p2p_backend.engine.wire import messages
        from sglang_p2p_backend.engine.copy.memory import Region
        from sglang_p2p_backend.engine.transport.local_memory import LocalMemory
        from sglang_p2p_backend.engine.transport.cuda_ipc import CudaIpcTransport, check_export, reachable

        self.torch, self.conn, self.cfg = torch, conn, cfg
        self.dev = dev = _device(torch)
        self.pools = {lay: _alloc(torch, lay, PREFILL_PAGES[lay], dev, zero=False) for lay in LAYOUTS}
        for lay, pool in self.pools.items():
            for r, t in enumerate(pool):
                page_bytes(t).copy_(_truth(torch, lay, r, dev))
        torch.cuda.synchronize(dev)
        self.local = {lay: LocalMemory(kv=[Region(t.data_ptr(), t.numel() * 2, _item(lay)) for t in pool], state=[],
                                       aux=[]) for lay, pool in self.pools.items()}
        _, blob, ptrs = expect(conn, ("export",), cfg["timeout"])
        export = msgspec.msgpack.decode(blob, type=messages.IpcExport)
        expected = [(p, DECODE_PAGES[lay] * _item(lay)) for lay in LAYOUTS for p in ptrs[lay]]
        problem = reachable(export, dev) or check_export(export, expected)
        if problem:
            raise RuntimeError(f"the decode's export cannot be used: {problem}")
        self.peers = {lay: _peer(messages, lay, export, ptrs[lay]) for lay in LAYOUTS}
        self.tr = CudaIpcTransport(dev, copy_engine=cfg.get("copy_engine", COPY_ENGINE_MODES[0]),
                                   programs=cfg.get("programs"))
        t0 = time.perf_counter()
        self.tr.open_peer(SESSION, export)
        self.open_ms = (time.perf_counter() - t0) * 1e3
        self.allocations = len(export.handles)
        self.rng = np.random.default_rng(2024)

    def _ids(self, layout: str, tokens: int, dest: str):
        n = tokens // PAGE_SIZE[layout]
        src = np.arange(n, dtype=np.int64)
        if dest == "contiguous":
            return src, np.arange(n, dtype=np.int64) + DECODE_PAGES[layout] // 4
        return src, self.rng.choice(DECODE_PAGES[layout], size=n, replace=False).astype(np.int64)

    def _write_times(self, s, d, n, warmup: int, reps: int) -> list[float]:
        return self._timed(lambda: self.tr.write(SESSION, s, d, n), warmup, reps)

    def _page_write(self, lay: str, src_ids, dst_ids):
        kv = self.local[lay].kv
        return lambda: self.tr.write_pages(SESSION, [r.ptr for r in kv], self.peers[lay].kv_ptrs,
                                           [r.item_len for r in kv], src_ids, dst_ids, PREFILL_PAGES[lay],
                                           DECODE_PAGES[lay])

    @staticmethod
    def _timed(fn, warmup: int, reps: int) -> list[float]:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    def interference(self, case: tuple, iters: int = 200) -> dict:
        """A bf16 matmul loop on a stream of its own in the prefill process (a stand-in for the forward passes a
        prefill runs while it ships KV), launched and as a CUDA graph (interference.py), alone and while a
        thread writes `case` back to back as served (`--copy-engine`)."""
        _, lay, tokens, dest = case
        write = self._page_write(lay, *self._ids(lay, tokens, dest))
        r = beside_writes(self.torch, self.dev, write, reps=3, iters=iters)
        return {"case": case[0], "matmul_iters": iters, "matmul_ms_alone": r["matmul_ms_alone"],
                "matmul_ms_with_writes": r["matmul_ms_during"], "slowdown": r["slowdown"],
                "graph_ms_alone": r["graph_ms_alone"], "graph_ms_with_writes": r["graph_ms_during"],
                "slowdown_graph": r["slowdown_graph"], "writes_during": r["writes_during"],
                "write_gbps_during": r["writes_during"] * tokens * LAYOUTS[lay][0] * LAYOUTS[lay][1] / r["wall_s"] / 1e9,
                "error": r["error"]}

    def _plan_and_kernel(self, s, d, n, reps: int) -> dict:
        """Host planning alone, and the upload + copy kernel alone on the GPU, over the same mapping."""
        from sglang_p2p_backend.engine.copy.span_copy import SpanCopier, plan_tiles

        torch = self.torch
        mapping = getattr(self.tr, "_peers", {}).get(SESSION)  # the transport's own mapping (opened once)
        if mapping is None:
            return {"note": "the transport's mapping is not reachable (CudaIpcTransport._peers): no breakdown"}
        plan, translate = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            mapped = mapping.table.translate(d, n)
            t1 = time.perf_counter()
            word, tiles = plan_tiles(s, mapped, n)
            t2 = time.perf_counter()
            translate.append(t1 - t0)
            plan.append(t2 - t0)
        copier = SpanCopier(self.dev)
        stream = torch.cuda.Stream(device=self.dev)
        # keep the GPU busy while the host plans, so the first event fires only once the copy is queued
        cycles = int(max(2e6, 4 * float(np.median(plan)) * 2e9))
        kernel = []
        for i in range(reps + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
            start.record(stream)
            copier.copy(s, mapped, n, stream)
            end.record(stream)
            end.synchronize()
            if i >= 3:
                kernel.append(start.elapsed_time(end) * 1e-3)
        return {"plan_us": _us(plan)["p50"], "translate_us": _us(translate)["p50"], "kernel": kernel,
                "tiles": int(len(tiles)), "word": int(word)}

    def _torch_copy(self, nbytes: int, reps: int) -> tuple[list[float], list[float]]:
        torch = self.torch
        a = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        b = torch.empty_like(a)
        a.fill_(7)
        ev, host = [], []
        for i in range(reps + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            t0 = time.perf_counter()  # host view of the same copy: call to completion, like write()
            b.copy_(a)
            torch.cuda.synchronize(self.dev)
            t1 = time.perf_counter()
            if i >= 3:
                ev.append(start.elapsed_time(end) * 1e-3)
                host.append(t1 - t0)
        del a, b
        torch.cuda.empty_cache()
        return ev, host

    def warm(self, cases: list, seconds: float = 1.0) -> None:
        """Every case's page write in turn for about `seconds` before anything is timed, so the first case timed
        is not the first to run: on 1 x H200 (2026-12-02) 4k MLA contiguous, timed first after 5 writes, took 256
        us a write against 207 us for the scattered case timed next, whose copy takes as long on the GPU."""
        writes = [self._page_write(lay, *self._ids(lay, tokens, dest)) for _, lay, tokens, dest in cases]
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for w in writes:
                w()

    def measure(self, case: tuple, reps: int, warmup: int) -> dict:
        from sglang_p2p_backend.engine.transport.onesided import chunk_descriptors

        name, lay, tokens, dest = case
        src_ids, dst_ids = self._ids(lay, tokens, dest)
        s, d, n = chunk_descriptors(self.local[lay], self.peers[lay], [src_ids], [dst_ids])
        nbytes = int(n.sum())
        # the path the prefill takes for whole pages (page table, one launch); then the span path, verified too
        write = self._timed(self._page_write(lay, src_ids, dst_ids), warmup, reps)
        self.conn.send(("verify", lay, src_ids, dst_ids))
        _, bad = expect(self.conn, ("verified",), self.cfg["timeout"])
        span_write = self._write_times(s, d, n, warmup, reps)
        self.conn.send(("verify", lay, src_ids, dst_ids))
        _, bad_spans = expect(self.conn, ("verified",), self.cfg["timeout"])
        bad = bad + bad_spans
        parts = self._plan_and_kernel(s, d, n, min(reps, 50))
        ref_ev, ref_host = self._torch_copy(nbytes, min(reps, 50))
        w, t = _us(write), _us(ref_ev)
        row = {"case": name, "layout": lay, "tokens": tokens, "page_size": PAGE_SIZE[lay], "destination": dest,
               "pages": int(src_ids.size), "bytes": nbytes, "spans": int(n.size), "reps": reps,
               "write_us": w, "write_gbps": nbytes / w["p50"] / 1e3,
               "torch_copy_us": t, "torch_copy_gbps": nbytes / t["p50"] / 1e3,
               "torch_copy_host_us": _us(ref_host), "ratio": t["p50"] / w["p50"],
               "span_write_us": _us(span_write), "span_ratio": t["p50"] / _us(span_write)["p50"],
               "verified": not bad, "bad_pages": bad}
        kernel = parts.pop("kernel", None)
        row.update(parts)
        if kernel:
            k = _us(kernel)
            row.update(kernel_us=k, kernel_gbps=nbytes / k["p50"] / 1e3, kernel_ratio=t["p50"] / k["p50"])
        return row


def _prefill(conn, cfg):
    import torch

    p = Prefill(conn, cfg)
    p.warm(CASES + [LATENCY])
    rows = [p.measure(c, cfg["reps"], cfg["warmup"]) for c in CASES]
    latency = p.measure(LATENCY, cfg["latency_reps"], max(cfg["warmup"], 50))
    interference = p.interference(CASES[2])
    conn.send(("done",))
    p.tr.close()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = {"gpu": torch.cuda.get_device_name(p.dev), "torch": torch.__version__, "cuda": torch.version.cuda,
            "copy_engine": cfg.get("copy_engine", COPY_ENGINE_MODES[0]), "programs": cfg.get("programs"),
            "triton": triton_version, "python": platform.python_version(), "open_peer_ms": p.open_ms,
            "allocations": p.allocations}
    return {"cases": rows, "latency": latency, "interference": interference, "meta": meta}


def prefill(rank, conn, cfg):
    return guarded(_prefill, conn, cfg)


# -- driver ---------------------------------------------------------------------------------------------------

def gpu_name() -> str:
    """The first GPU's name from nvidia-smi, as a file-name slug ('nvidia-h100-80gb-hbm3')."""
    return (gpu_slugs() or ["unknown-gpu"])[0]


def _table(result: dict) -> str:
    head = (f"{'case':<20}{'MB':>8}{'spans':>7}{'tiles':>7}{'write us':>10}{'GB/s':>7}{'spans us':>10}{'kernel us':>11}"
            f"{'plan us':>9}{'torch us':>10}{'GB/s':>7}{'ratio':>7}  ok")
    lines = [head, "-" * len(head)]
    for r in result["cases"] + [result["latency"]]:
        k = r.get("kernel_us", {}).get("p50")
        lines.append(
            f"{r['case']:<20}{r['bytes'] / 1e6:>8.1f}{r['spans']:>7}{r.get('tiles', 0):>7}{r['write_us']['p50']:>10.1f}"
            f"{r['write_gbps']:>7.0f}{r['span_write_us']['p50']:>10.1f}{k if k is not None else float('nan'):>11.1f}{r.get('plan_us', float('nan')):>9.1f}"
            f"{r['torch_copy_us']['p50']:>10.1f}{r['torch_copy_gbps']:>7.0f}{r['ratio']:>7.2f}  "
            f"{'yes' if r['verified'] else 'NO ' + str(r['bad_pages'])}")
    lat = result["latency"]
    lines.append(f"latency {lat['case']} ({lat['bytes'] / 1e6:.1f} MB, {lat['spans']} spans): write p50 "
                 f"{lat['write_us']['p50']:.1f} us, p99 {lat['write_us']['p99']:.1f} us (target <= {LATENCY_TARGET_US:.0f}"
                 f" us); torch copy + sync on the host p50 {lat['torch_copy_host_us']['p50']:.1f} us")
    inf = result["interference"]
    lines.append(f"interference: {inf['matmul_iters']} bf16 4096^2 matmuls {inf['matmul_ms_alone']:.1f} ms alone, "
                 f"{inf['matmul_ms_with_writes']:.1f} ms while {inf['case']} is written back to back "
                 f"({inf['write_gbps_during']:.0f} GB/s): slowdown {100 * inf['slowdown']:.1f}% (target <= "
                 f"{100 * INTERFERENCE_TARGET:.0f}%); as one CUDA graph {inf['graph_ms_alone']:.1f} -> "
                 f"{inf['graph_ms_with_writes']:.1f} ms, {100 * inf['slowdown_graph']:.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--machine", help="name in the output file (default: the GPU's name from nvidia-smi)")
    ap.add_argument("--out", help="JSON path (default bench/results/ipc_<machine>.json)")
    ap.add_argument("--reps", type=int, default=30, help="timed writes per bandwidth case (after warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--latency-reps", type=int, default=1000, help="timed writes of the 128-token request")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds before both processes are killed")
    ap.add_argument("--copy-engine", choices=COPY_ENGINE_MODES, default=COPY_ENGINE_MODES[0],
                    help="the transport's route rule (SGLANG_P2P_COPY_ENGINE): split (the default, as served), auto "
                         "(each chunk whole by ce_plan.choose), off for the kernel on every chunk, on for the copy "
                         "engines")
    ap.add_argument("--programs", type=int, default=None,
                    help="the page kernel's grid bound (SGLANG_P2P_IPC_PROGRAMS; default: the transport's, 4-16 "
                         "programs an SM into the prefill's own GPU)")
    ns = ap.parse_args(argv)
    if ns.programs is not None and ns.programs < 1:
        ap.error("--programs must be at least 1")
    if ns.reps < 20:
        ap.error("--reps must be at least 20")
    machine = ns.machine or gpu_name()
    out = Path(ns.out or Path(_ROOT) / "bench" / "results" / f"ipc_{machine}.json")

    import multiprocessing as mp

    cfg = {"reps": ns.reps, "warmup": ns.warmup, "latency_reps": ns.latency_reps, "timeout": ns.timeout,
           "copy_engine": ns.copy_engine, "programs": ns.programs}
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    t0 = time.time()
    procs = [spawn(prefill, 0, 0, a, results, (cfg,), None, dump_after=ns.timeout - 20),
             spawn(decode, 1, 0, b, results, (cfg,), None, dump_after=ns.timeout - 20)]
    got = collect(procs, results, (0, 1), timeout=ns.timeout)
    result = got[0]
    result["decode"] = got[1]
    result["meta"].update(machine=machine, host=socket.gethostname(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          wall_s=time.time() - t0, argv=sys.argv[1:])
    lat = result["latency"]
    result["targets"] = {"ratio_min": RATIO_TARGET, "latency_p50_max_us": LATENCY_TARGET_US}
    result["pass"] = {"ratio": {r["case"]: r["ratio"] >= RATIO_TARGET for r in result["cases"]},
                      "latency_p50": lat["write_us"]["p50"] <= LATENCY_TARGET_US,
                      "latency_p99": lat["write_us"]["p99"] <= LATENCY_TARGET_US,
                      "interference": result["interference"]["slowdown"] <= INTERFERENCE_TARGET,
                      "verified": all(r["verified"] for r in result["cases"] + [lat])}
    print(_table(result))
    print(f"pass: {json.dumps(result['pass'])}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if result["pass"]["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
