"""Copy engines on one stream against several, and the other ways to move a chunk's long spans, into the prefill's
own GPU (and into a second GPU where the host has one).

    python -m bench.transfer.ce_lanes [--out PATH] [--machine NAME] [--case-s 0.2] [--lanes 1,2,4,8]
                                      [--targets same,peer]

The same-host path sends a chunk of few long spans (contiguous pages: one span a layer) to the copy engines with
one `cudaMemcpyBatchAsync` on one stream (engine/copy/copy_engine.py). Into the prefill's own GPU that took
0.62-0.75 of one `copy_` of the same bytes on H200, where the page kernel took 0.84-0.90 but slowed a matmul
beside it by ~120%. This asks why, on the regions SGLang allocates (one tensor a layer, the chunk the first
pages of each):
- `copy`: ONE `copy_` of a contiguous tensor of the chunk's bytes (the reference: a device-to-device
  `cudaMemcpyAsync`);
- `ce xK`: the batch call with `cudaMemcpyFlagPreferOverlapWithCompute` (as the transport makes it), the spans
  dealt over K streams in contiguous runs, each lane ordered after the caller's stream and the caller's stream
  after every lane: whether one stream's batch uses one copy engine and several go faster;
- `plain xK`: the batch call without the flag (the driver chooses how to copy);
- `memcpy xK`: one `cudaMemcpyAsync` a span;
- `ce headN`: the batch call on one stream, split: the first N spans in a call of their own, then the rest,
  whether the copy engines start on the first spans while the host hands over the others (the batch call's host
  time grows with the spans);
- `kernel`: the transport's span kernel (engine/copy/span_copy.py `SpanCopier`);
- `2d`: ONE `cudaMemcpy2DAsync` for every region (a region a row: the regions here lie at one stride from each
  other on both sides, a pad apart): whether the copy engines' cost is a setup per copy, paid once here.
- `3d`: ONE `cudaMemcpy3DBatchAsync` op with the copy-engine hint (CUDA 12.8+), every region a row as in `2d`:
  whether the hint keeps a strided copy on the copy engines, at one setup for every region.
The regions of every request are carved out of one allocation with a gap between them: a strided copy cannot
take its rows from several allocations (bench/transfer/strided_allocations.py), which SGLang's layers are.
`layout` then allocates pools as SGLang does (one `torch.zeros` a layer, K then V) and reports the strides
between consecutive regions: whether real pools are evenly strided, as the `2d` method needs.
Each is timed two ways: `gpu` (CUDA events, every call queued behind a GPU sleep, so host work is not counted) and
`wall` (the call to the stream's synchronise, host included, as a write pays it). Then `interference`: a bf16
4096^3 matmul loop on its own stream of the source GPU, launched and as one CUDA graph (no launches for the
writer's thread to delay), alone and while one method copies the largest case back to back into each target:
whether it takes SMs there. Every method's destination is zeroed and compared with the source after its timed calls (`ok`).
Without CUDA it prints that it measured nothing and exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from typing import Callable, Optional

import numpy as np

try:
    from bench.transfer.gpu_names import common_args, cuda_torch, picked
    from bench.transfer.interference import beside_writes
except ImportError:  # run as a script from bench/transfer
    from gpu_names import common_args, cuda_torch, picked  # type: ignore[no-redef]
    from interference import beside_writes  # type: ignore[no-redef]

MIB = 1 << 20
#: (name, regions, bytes a region): the contiguous requests of xfer_cases/ipc_bench, one span a region
CASES = [("mla_1k", 61, 1024 * 1152), ("mha_1k", 64, 1024 * 2048), ("mla_4k", 61, 4096 * 1152),
         ("mha_4k", 64, 4096 * 2048), ("mla_16k", 61, 16384 * 1152), ("mha_16k", 64, 16384 * 2048)]
#: bytes between one region's chunk and the next region's start (both sides): the regions are evenly strided
#: but never back to back, as separately allocated layers
PAD = 2 * MIB
#: the first call's span counts of the `ce headN` methods
HEADS = (1, 4, 16)
#: where the copies go: the prefill's own GPU, a second GPU
TARGETS = ("same", "peer")
#: the case the interference loop runs beside (into every target), and the methods it times there
INTERFERENCE_CASE = "mha_16k"
INTERFERENCE_METHODS = ("copy", "kernel", "ce x1", "3d")
#: the GPU sleep every `gpu` timing is queued behind (~4 ms at 2 GHz): longer than the host's queueing of any method
SLEEP_CYCLES = 8_000_000


def deal(n: int, lanes: int) -> list[tuple[int, int]]:
    """[start, end) runs of n spans over at most `lanes` lanes, as even as they go, none empty."""
    lanes = max(1, min(lanes, n))
    cuts = [(i * n) // lanes for i in range(lanes + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Operand(ctypes.Structure):
    """cudaMemcpy3DOperand with its pointer member (type cudaMemcpyOperandTypePointer = 1); the union's other
    member (an array handle and a 3D offset) is as long, 32 bytes."""
    _fields_ = [("type", ctypes.c_int), ("ptr", ctypes.c_void_p), ("rowLength", ctypes.c_size_t),
                ("layerHeight", ctypes.c_size_t), ("locHint", _Loc)]


class _Op(ctypes.Structure):
    """cudaMemcpy3DBatchOp: src, dst, extent (width, height, depth), srcAccessOrder, flags."""
    _fields_ = [("src", _Operand), ("dst", _Operand), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t),
                ("depth", ctypes.c_size_t), ("srcAccessOrder", ctypes.c_int), ("flags", ctypes.c_uint)]


class Methods:
    """The ways to queue one case's spans (src, dst, lens: uint64 arrays) on the caller's stream `main`."""

    def __init__(self, torch, device, lanes: int, all_methods: bool = True, heads: tuple[int, ...] = HEADS):
        self.all_methods, self.heads = all_methods, heads
        from sglang_p2p_backend.engine.copy.copy_engine import CopyEngines
        from sglang_p2p_backend.engine.copy.span_copy import SpanCopier
        from sglang_p2p_backend.engine.transport.cuda_ipc import backend

        rt = backend().rt
        self.torch = torch
        self.ce = CopyEngines(rt)
        self.plain = CopyEngines(rt)
        self.plain._attrs.flags = 0
        self.spans = SpanCopier(device)
        self.rt = rt
        rt.cudaMemcpy2DAsync.restype = ctypes.c_int
        rt.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.streams = [torch.cuda.Stream(device=device) for _ in range(lanes)]
        self.forks = [torch.cuda.Event() for _ in range(lanes)]
        self.joins = [torch.cuda.Event() for _ in range(lanes)]

    def lanes(self, engines, per_span: bool, k: int, src, dst, lens, main) -> None:
        for i, (a, b) in enumerate(deal(lens.size, k)):
            s = self.streams[i]
            self.forks[i].record(main)
            s.wait_event(self.forks[i])
            if per_span:
                engines._each(src[a:b], dst[a:b], lens[a:b], s.cuda_stream)
            else:
                code = engines._batch(src[a:b], dst[a:b], lens[a:b], s.cuda_stream)
                if code:
                    raise RuntimeError(f"cudaMemcpyBatchAsync failed: {engines._error(code)}")
            self.joins[i].record(s)
            main.wait_event(self.joins[i])

    def head(self, k: int, src, dst, lens, main) -> None:
        for a, b in ((0, k), (k, lens.size)):
            if b > a:
                code = self.ce._batch(src[a:b], dst[a:b], lens[a:b], main.cuda_stream)
                if code:
                    raise RuntimeError(f"cudaMemcpyBatchAsync failed: {self.ce._error(code)}")

    def two_d(self, src, dst, lens, main) -> None:
        """One 2D copy: row r = span r; the spans must share a length and a stride on each side."""
        n = lens.size
        sp = int(src[1]) - int(src[0]) if n > 1 else int(lens[0])
        dp = int(dst[1]) - int(dst[0]) if n > 1 else int(lens[0])
        code = self.rt.cudaMemcpy2DAsync(int(dst[0]), dp, int(src[0]), sp, int(lens[0]), n, 4, main.cuda_stream)
        if code:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {self.ce._error(code)}")

    def three_d(self, src, dst, lens, main) -> None:
        """One cudaMemcpy3DBatchAsync op (CUDA 13 ABI: numOps, ops, flags, stream), rows as in `two_d`."""
        n = lens.size
        op = _Op()
        for side, base, nxt in ((op.src, src[0], src[1] if n > 1 else src[0] + lens[0]),
                                (op.dst, dst[0], dst[1] if n > 1 else dst[0] + lens[0])):
            side.type = 1
            side.ptr = int(base)
            side.rowLength = int(nxt) - int(base)
            side.layerHeight = n
        op.width, op.height, op.depth = int(lens[0]), n, 1
        op.srcAccessOrder = 1  # stream order
        op.flags = 1  # cudaMemcpyFlagPreferOverlapWithCompute
        fn = self.rt.cudaMemcpy3DBatchAsync
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_size_t, ctypes.POINTER(_Op), ctypes.c_ulonglong, ctypes.c_void_p]
        code = fn(1, ctypes.byref(op), 0, main.cuda_stream)
        if code:
            raise RuntimeError(f"cudaMemcpy3DBatchAsync failed: {self.ce._error(code)}")

    def table(self, lanes: tuple[int, ...]) -> dict[str, Callable]:
        out = {"kernel": lambda src, dst, lens, main: self.spans.copy(src, dst, lens, main), "2d": self.two_d, "3d": self.three_d}
        for k in self.heads:
            out[f"ce head{k}"] = lambda *a, k=k: self.head(k, *a)
        for k in lanes:
            out[f"ce x{k}"] = lambda *a, k=k: self.lanes(self.ce, False, k, *a)
            if self.all_methods:
                out[f"plain x{k}"] = lambda *a, k=k: self.lanes(self.plain, False, k, *a)
                out[f"memcpy x{k}"] = lambda *a, k=k: self.lanes(self.ce, True, k, *a)
        return out


def run(machine: str, case_s: float, lanes: tuple[int, ...], budget_s: float, all_methods: bool = True,
        heads: tuple[int, ...] = HEADS, wanted: tuple[str, ...] = TARGETS) -> dict:
    import torch

    t_start = time.monotonic()
    src_dev = torch.device("cuda:0")
    targets = [("same", src_dev)] + ([("peer", torch.device("cuda:1"))] if torch.cuda.device_count() > 1 else [])
    targets = [t for t in targets if t[0] in wanted]
    main = torch.cuda.Stream(device=src_dev)
    methods = Methods(torch, src_dev, max(lanes), all_methods, heads)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows, skipped, interference = [], [], []
    for target, dst_dev in targets:
        for name, regions, per in CASES:
            if time.monotonic() - t_start > budget_s:
                skipped.append(f"{target}:{name}")
                continue
            src_all = torch.randint(-128, 127, (regions, per + PAD), dtype=torch.int8, device=src_dev)
            dst_all = torch.zeros((regions, per + PAD), dtype=torch.int8, device=dst_dev)
            srcs, dsts = [src_all[r, :per] for r in range(regions)], [dst_all[r, :per] for r in range(regions)]
            ref_src = torch.empty(per * regions, dtype=torch.int8, device=src_dev)
            ref_dst = torch.empty(per * regions, dtype=torch.int8, device=dst_dev)
            src = np.array([t.data_ptr() for t in srcs], dtype=np.uint64)
            dst = np.array([t.data_ptr() for t in dsts], dtype=np.uint64)
            lens = np.full(regions, per, dtype=np.uint64)
            queue = {"copy": lambda *a: ref_dst.copy_(ref_src, non_blocking=True), **methods.table(lanes)}
            for method, fn in queue.items():
                dst_all.zero_()
                torch.cuda.synchronize(src_dev)

                def once(behind_sleep: bool) -> float:
                    with torch.cuda.stream(main):
                        if behind_sleep:
                            torch.cuda._sleep(SLEEP_CYCLES)
                        start.record(main)
                        t0 = time.perf_counter()
                        fn(src, dst, lens, main)
                        end.record(main)
                        main.synchronize()
                        wall = (time.perf_counter() - t0) * 1e6
                    return start.elapsed_time(end) * 1e3 if behind_sleep else wall

                once(False)
                once(True)
                gpu, wall, spent = [], [], 0.0
                while len(gpu) < 5 or (spent < case_s and len(gpu) < 100):
                    gpu.append(once(True))
                    wall.append(once(False))
                    spent += (gpu[-1] + wall[-1]) / 1e6
                ok = method == "copy" or (all(torch.equal(a, b.to(src_dev)) for a, b in zip(srcs, dsts))
                                          and not bool(dst_all[:, per:].any()))  # and nothing in the pads
                rows.append({"target": target, "case": name, "regions": regions, "span_bytes": per,
                             "method": method, "gpu_us": float(np.median(gpu)), "wall_us": float(np.median(wall)),
                             "reps": len(gpu), "ok": bool(ok)})
            if name == INTERFERENCE_CASE:  # the matmul on the source GPU, beside writes into this target
                interference += [{"target": target, **i} for i in interfere(torch, src_dev, queue, src, dst, lens, main)]
            src_all = dst_all = srcs = dsts = ref_src = ref_dst = queue = None  # freed before the next case
            torch.cuda.empty_cache()
    return {"machine": machine, "lanes": list(lanes), "rows": rows, "interference": interference,
            "skipped": skipped, "layout": layout(torch, src_dev)}


def layout(torch, device) -> list[dict]:
    """Pools allocated as SGLang's are (a fresh process's caching allocator; one tensor a layer, K then V): the
    distinct strides between consecutive regions of each kind."""
    out = []
    for name, layers, token_bytes, tokens in (("mla_200k", 61, 1152, 200_000), ("mha_200k", 32, 2048, 200_000),
                                              ("mla_1m", 61, 1152, 1_000_000), ("mha_500k", 32, 2048, 500_000)):
        kinds = ("kv",) if name.startswith("mla") else ("k", "v")
        bufs = {k: [torch.zeros(tokens * token_bytes + 64 * token_bytes, dtype=torch.int8, device=device)
                    for _ in range(layers)] for k in kinds}
        for k, ts in bufs.items():
            ptrs = np.array([t.data_ptr() for t in ts], dtype=np.int64)
            strides = sorted(set(np.diff(ptrs).tolist()))
            out.append({"pool": name, "kind": k, "region_bytes": ts[0].numel(), "strides": strides[:8],
                        "distinct": len(strides)})
        bufs = None
        torch.cuda.empty_cache()
    return out


def interfere(torch, device, queue: dict, src, dst, lens, main) -> list[dict]:
    """The matmul loop, launched and as one CUDA graph, alone and beside each of INTERFERENCE_METHODS, back to
    back."""
    out = []
    for method in INTERFERENCE_METHODS:
        fn = queue.get(method)
        if fn is None:
            continue

        def write(fn=fn) -> None:
            with torch.cuda.stream(main):
                fn(src, dst, lens, main)
            main.synchronize()

        r = beside_writes(torch, device, write, reps=8, iters=50, join_timeout=30)
        out.append({"method": method, "alone_ms": r["matmul_ms_alone"], "busy_ms": r["matmul_ms_during"],
                    "slowdown": r["slowdown"], "graph_alone_ms": r["graph_ms_alone"],
                    "graph_busy_ms": r["graph_ms_during"], "slowdown_graph": r["slowdown_graph"],
                    "writes": r["writes_during"], "error": r["error"]})
    return out


def report(result: dict) -> str:
    lines = [f"{'target:case':18} {'method':11} {'gpu us':>9} {'wall us':>9} {'copy/gpu':>9} {'copy/wall':>9} ok"]
    ref = {(r["target"], r["case"]): r for r in result["rows"] if r["method"] == "copy"}
    for r in result["rows"]:
        c = ref.get((r["target"], r["case"]))
        g = c["gpu_us"] / r["gpu_us"] if c else float("nan")
        w = c["gpu_us"] / r["wall_us"] if c else float("nan")
        lines.append(f"{r['target'] + ':' + r['case']:18} {r['method']:11} {r['gpu_us']:9.1f} {r['wall_us']:9.1f} "
                     f"{g:9.2f} {w:9.2f} {'yes' if r['ok'] else 'BAD'}")
    for i in result["interference"]:
        lines.append(f"interference {i.get('target', 'same')}:{INTERFERENCE_CASE} {i['method']:11} alone "
                     f"{i['alone_ms']:.2f} ms, beside "
                     f"{i['busy_ms']:.2f} ms: {100 * i['slowdown']:+.1f}% ({i['writes']} writes)"
                     + (f"; as one CUDA graph {100 * i['slowdown_graph']:+.1f}%" if i.get("slowdown_graph") is not None
                        else "")
                     + (f" ERROR {i['error']}" if i["error"] else ""))
    for p in result.get("layout", []):
        lines.append(f"layout {p['pool']} {p['kind']}: regions of {p['region_bytes']} bytes, {p['distinct']} distinct "
                     f"strides {p['strides']}")
    lines.append(f"skipped: {result['skipped'] or 'none'}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "bench/results/ce_lanes.json", case_s=0.2, budget_s=200.0)
    ap.add_argument("--lanes", default="1,2,4,8", help="stream counts to deal the spans over, comma-separated")
    ap.add_argument("--heads", default=",".join(map(str, HEADS)), help="first-call span counts of `ce headN`")
    ap.add_argument("--few", action="store_true", help="leave out the batch call without its hint and memcpy")
    ap.add_argument("--targets", default=",".join(TARGETS), help="same (into GPU 0), peer (into GPU 1, two GPUs only)")
    args = ap.parse_args(argv)
    torch = cuda_torch("ce_lanes")
    if torch is None:
        return 0
    lanes = tuple(int(x) for x in args.lanes.split(",") if x.strip())
    heads = tuple(int(x) for x in args.heads.split(",") if x.strip())
    result = run(args.machine, args.case_s, lanes, args.budget_s, not args.few, heads,
                 picked(ap, args.targets, TARGETS, "targets"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(report(result))
    bad = [r for r in result["rows"] if not r["ok"]] + [i for i in result["interference"] if i["error"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
