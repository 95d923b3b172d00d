"""The same-host page kernel's launch parameters against the one copy it should match, into the prefill's own GPU
and across NVLink.

    python -m bench.transfer.page_kernel_sweep [--out PATH] [--machine NAME] [--case-s 0.1] [--budget-s 240]
                                               [--per-sm 1,2,4,8,16]

`engine/copy/span_copy.py`'s `_copy_pages` moves every page of a chunk in one launch; how fast depends on the
words a program moves a loop step (`BLOCK`), its warps and how many programs the grid holds. This times the
kernel alone (CUDA events, GPU time, no host planning) for each combination on the KV shapes of
bench/transfer/xfer_cases.py (MHA page 1 and 16, MLA page 64; 4k and 16k tokens; contiguous and scattered pages),
with the destination pool on cuda:0 (`same`: a decode sharing the prefill's GPU) and, on a host with two GPUs, on
cuda:1 (`peer`, through peer access as the CUDA IPC mapping gives it), against one `copy_` of the same bytes
between two contiguous buffers (the `ref` rows). Every combination's destination pages are compared with the
source pages after its timed runs, so a fast wrong variant shows as `bad`. What the default grid and block are
set from; `xfer_bench.py` then measures the whole write with them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

try:
    from bench.transfer.xfer_cases import SHAPES, Case, Shape, Table, page_ids
except ImportError:  # run as a script from bench/transfer
    from xfer_cases import SHAPES, Case, Shape, Table, page_ids  # type: ignore[no-redef]


@dataclass(frozen=True)
class Variant:
    """One launch configuration: `block` words a loop step, `warps` a program, `per_sm` programs an SM."""

    block: int
    warps: int
    per_sm: int

    @property
    def name(self) -> str:
        return f"b{self.block}w{self.warps}x{self.per_sm}"


def variants(blocks=(1024, 2048, 4096), warps=(4, 8, 16), per_sm=(1, 2, 4, 8, 16)) -> list[Variant]:
    """Every combination in which each thread moves at least one 16-byte vector a step (block words of 8 bytes
    over warps x 32 threads)."""
    return [Variant(b, w, p) for b in blocks for w in warps for p in per_sm if b * 8 >= w * 32 * 16]


SWEEP_CASES = (("mha_p16", 4096), ("mha_p16", 16384), ("mha_p1", 4096), ("mla_p64", 4096), ("mla_p64", 16384))


def sweep_cases(shapes=SHAPES) -> list[Case]:
    by_name = {s.name: s for s in shapes}
    return [Case(by_name[n], t, d) for n, t in SWEEP_CASES for d in ("contiguous", "scattered")]


def best(rows: list[dict]) -> dict[str, dict]:
    """Per (target, case): the fastest variant that copied every byte right, and the reference time."""
    out: dict[str, dict] = {}
    for r in rows:
        key = f"{r['target']}:{r['case']}"
        slot = out.setdefault(key, {"ref_us": None, "best": None, "default": None})
        if r["variant"] == "ref":
            slot["ref_us"] = r["us"]
        elif r["variant"] == "default":
            slot["default"] = r
        elif not r["bad"] and (slot["best"] is None or r["us"] < slot["best"]["us"]):
            slot["best"] = r
    return out


def _pools(torch, shape: Shape, src_pages: int, dst_pages: int, src_dev, dst_dev):
    """One tensor a side: region r's pages at base + r * pages * item (regions apart, as SGLang's per-layer
    buffers are; the kernel only sees bases)."""
    src = torch.randint(-128, 127, (shape.regions, src_pages, shape.item), dtype=torch.int8, device=src_dev)
    dst = torch.zeros((shape.regions, dst_pages, shape.item), dtype=torch.int8, device=dst_dev)
    return src, dst


def run(out: Path, machine: str, case_s: float, budget_s: float, per_sm=(1, 2, 4, 8, 16)) -> dict:
    import torch

    from sglang_p2p_backend.engine.copy import span_copy

    dev0 = torch.device("cuda:0")
    targets = [("same", dev0)]
    if torch.cuda.device_count() > 1:
        targets.append(("peer", torch.device("cuda:1")))
        # torch enables peer access on its first copy between the devices; both ways, so the kernel on cuda:0
        # can write cuda:1's memory as through the CUDA IPC mapping
        one0, one1 = torch.ones(1, device=dev0), torch.ones(1, device="cuda:1")
        with torch.cuda.device(dev0):
            one1.copy_(one0)
        with torch.cuda.device(1):
            one0.copy_(one1)
        torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(dev0).multi_processor_count
    stream = torch.cuda.Stream(dev0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t_end = time.monotonic() + budget_s
    rows: list[dict] = []
    skipped: list[str] = []

    def timed(fn) -> float:
        """Median GPU time in us of fn() on `stream`, repeated for about case_s (at least 5 times)."""
        with torch.cuda.stream(stream):
            fn()
            fn()
            times: list[float] = []
            spent = 0.0
            while len(times) < 5 or (spent < case_s and len(times) < 200):
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                ms = start.elapsed_time(end)
                times.append(ms * 1e3)
                spent += ms / 1e3
        return float(np.median(times))

    for target, dst_dev in targets:
        by_shape: dict[str, list[Case]] = {}
        for c in sweep_cases():
            by_shape.setdefault(c.shape.name, []).append(c)
        for cases in by_shape.values():
            shape = cases[0].shape
            n_max = max(c.shape.pages(c.tokens) for c in cases)
            src, dst = _pools(torch, shape, n_max, 2 * n_max, dev0, dst_dev)
            region_bytes_src, region_bytes_dst = src[0].numel(), dst[0].numel()
            for case in cases:
                if time.monotonic() > t_end:
                    skipped.append(f"{target}:{case.name}")
                    continue
                s_ids, d_ids = page_ids(case, n_max, 2 * n_max)
                n = len(s_ids)
                nbytes = n * shape.item * shape.regions
                a = torch.empty(nbytes, dtype=torch.int8, device=dev0)
                b = torch.empty(nbytes, dtype=torch.int8, device=dst_dev)
                ref_us = timed(lambda: b.copy_(a, non_blocking=True))
                rows.append({"target": target, "case": case.name, "variant": "ref", "us": ref_us, "bytes": nbytes,
                             "bad": False})
                del a, b
                word = 8
                table = span_copy.page_table([src.data_ptr() + r * region_bytes_src for r in range(shape.regions)],
                                             [dst.data_ptr() + r * region_bytes_dst for r in range(shape.regions)],
                                             [shape.item] * shape.regions, word)
                host = np.concatenate([s_ids, d_ids, table.reshape(-1)]).astype(np.int64)
                dev = torch.from_numpy(host).to(dev0)
                like = torch.empty(1, dtype=torch.int64, device=dev0)
                words = shape.item // word
                s_t = torch.from_numpy(s_ids).to(dev0)
                d_t = torch.from_numpy(d_ids).to(dst_dev)

                def check() -> bool:
                    ok = bool(torch.equal(dst.index_select(1, d_t).to(dev0), src.index_select(1, s_t)))
                    dst.zero_()
                    return ok

                def launch(block: int, warps: int, grid: int):
                    return lambda: span_copy._copy_pages[(grid,)](dev, n, dev[2 * n:], shape.regions, like,
                                                                   BLOCK=block, num_warps=warps)

                default_block = min(1024, max(16, 1 << (words - 1).bit_length()))
                default_grid = min(n * shape.regions, span_copy.default_programs(sms, default_block * word))
                if target == "same":
                    default_grid = min(n * shape.regions, 8 * sms)  # the transport's bound into its own GPU
                dst.zero_()
                us = timed(launch(default_block, 4, default_grid))
                rows.append({"target": target, "case": case.name, "variant": "default", "block": default_block,
                             "warps": 4, "grid": default_grid, "us": us, "bytes": nbytes, "bad": not check()})
                done: set[tuple[int, int, int]] = set()
                for v in variants(per_sm=per_sm):
                    # a page smaller than the block runs with the page's block (the kernel's own rule)
                    block = min(v.block, max(16, 1 << (words - 1).bit_length()))
                    grid = min(n * shape.regions, v.per_sm * sms)
                    if (block, v.warps, grid) in done or block * 8 < v.warps * 32 * 16:
                        continue
                    done.add((block, v.warps, grid))
                    if time.monotonic() > t_end:
                        skipped.append(f"{target}:{case.name}:{v.name}")
                        continue
                    us = timed(launch(block, v.warps, grid))
                    rows.append({"target": target, "case": case.name, "variant": v.name, "block": block,
                                 "warps": v.warps, "grid": grid, "us": us, "bytes": nbytes, "bad": not check()})
            del src, dst
            torch.cuda.empty_cache()
    result = {"machine": machine, "sms": sms, "gpus": torch.cuda.device_count(),
              "torch": torch.__version__, "rows": rows, "best": best(rows), "skipped": skipped}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def report(result: dict) -> str:
    t = Table([("target:case", 34), ("ref us", 9), ("default us", 11), ("ratio", 7), ("best", 14), ("best us", 9),
               ("ratio", 7)])
    for key, b in result["best"].items():
        ref, d, top = b["ref_us"], b["default"], b["best"]
        t.add(key, ref, d and d["us"], d and ref and ref / d["us"], top and top["variant"], top and top["us"],
              top and ref and ref / top["us"])
    bad = [f"{r['target']}:{r['case']}:{r['variant']}" for r in result["rows"] if r["bad"]]
    return t.render() + f"\nwrong bytes: {bad or 'none'}\nskipped: {result['skipped'] or 'none'}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/page_kernel_sweep.json"))
    ap.add_argument("--machine", default="unknown")
    ap.add_argument("--case-s", type=float, default=0.1)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--per-sm", default="1,2,4,8,16", help="programs an SM to try, comma-separated")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("page_kernel_sweep: no CUDA device, nothing measured")
        return 0
    per_sm = tuple(int(x) for x in args.per_sm.split(",") if x.strip())
    result = run(args.out, args.machine, args.case_s, args.budget_s, per_sm)
    print(report(result))
    return 1 if any(r["bad"] for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
