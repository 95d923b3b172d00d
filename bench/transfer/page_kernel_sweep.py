"""The same-host page kernel's launch parameters against the one copy it should match, into the prefill's own GPU
and across NVLink.

    python -m bench.transfer.page_kernel_sweep [--out PATH] [--machine NAME] [--case-s 0.1] [--budget-s 240]
                                               [--per-sm 1,2,4,8,16] [--candidates default,cs,...]

`engine/copy/span_copy.py`'s `_copy_pages` moves every page of a chunk in one launch; how fast depends on the
words a program moves a loop step (`BLOCK`), its warps and how many programs the grid holds. This times the
kernel alone (CUDA events, GPU time, no host planning) for each combination on the KV shapes of
bench/transfer/xfer_cases.py (MHA page 1 and 16, MLA page 64; 4k and 16k tokens; contiguous and scattered pages),
with the destination pool on cuda:0 (`same`: a decode sharing the prefill's GPU) and, on a host with two GPUs, on
cuda:1 (`peer`, through peer access as the CUDA IPC mapping gives it), against one `copy_` of the same bytes
between two contiguous buffers (the `ref` rows). Every combination's destination pages are compared with the
source pages after its timed runs, so a fast wrong variant shows as `bad`. What the default grid and block are
set from; `xfer_bench.py` then measures the whole write with them.

Beside the transport's launch (`default`), in turn twice for every case, a candidate kept here, not in the
transport: `blocks`, programs striding over (page, 8 KiB block) units instead of whole pages, and `blocks_vec16`,
the same told that every address is 16-byte aligned (`tl.multiple_of`: 16-byte loads and stores, where pointers
computed from loaded integers otherwise get one 8-byte access per word). Into the prefill's own GPU on 1 x H200
(2026-11-29, two calls) neither won: `blocks` within 0-3% of `default` from 4k tokens up, and at 128 tokens the
two calls disagreed (a 128-token MLA request 20-37 us either way, against 10-13 us for one copy of its 9 MB: the 61
regions' scattered pages, not the grid, bound it); `blocks_vec16` 2-5% slower than `blocks` from 4k up. Across
NVLink (2 x H200, 2026-11-29) both were within 1% of the default from 4k tokens up. Cache hints on the transport's kernel (`ef`: loads `evict_first`; `cs`:
streaming stores; both; both with 16-byte accesses; both at 4,096 words a step over 8 warps) are candidates too;
into its own GPU (2026-11-29) none was 5% better across the cases (`cs` 0-6% faster for MLA from 4k up, no
faster for MHA, slower at 128 tokens), nor across NVLink (`cs` and `ef_cs` within 1%). Since session 43: `unroll2`, `units` (every
(page, block) unit its own program, no loop, no bound on the grid), `units_b4096w8`, and `flat` (Triton's own copy
of the reference's contiguous buffers, its ceiling). Into the prefill's own GPU on 1 x H200 `units` took 1-7% less
GPU time than the transport's loop from 4k tokens up (0.92-0.94 of one copy where the loop took 0.86-0.90; `flat`
0.91-0.97), but beside a matmul it takes the SMs (docs/bench.md, session 43), so it stays here. `--candidates`
picks the rows (all by default), `--per-sm ""` skips the grid sweep.

`--host-ids` measures instead (a process of its own): the upload of a launch's page ids and region table (one
`cudaMemcpyAsync` from pinned memory) and the kernel, against the kernel reading the same ids and table straight
from the pinned buffer (mapped into the device's address space), for 128-token and 4k-token requests: whether
the upload is worth dropping from the write path (`host_ids` in the JSON; pages compared as above).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

try:
    from bench.transfer.gpu_names import common_args, cuda_torch, picked
    from bench.transfer.xfer_cases import SHAPES, Case, Shape, Table, page_ids
except ImportError:  # run as a script from bench/transfer
    from gpu_names import common_args, cuda_torch, picked  # type: ignore[no-redef]
    from xfer_cases import SHAPES, Case, Shape, Table, page_ids  # type: ignore[no-redef]


@dataclass(frozen=True)
class Variant:
    """One launch configuration of the transport's kernel: `block` words a loop step, `warps` a program, `per_sm`
    programs an SM."""

    block: int
    warps: int
    per_sm: int

    @property
    def name(self) -> str:
        return f"b{self.block}w{self.warps}x{self.per_sm}"


def access_forms(ptx: str) -> list[str]:
    """The global load and store instructions of a compiled kernel (`ld.global.v2.b64`: 16-byte vectors)."""
    return sorted(set(re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx)))


def variants(blocks=(1024, 2048, 4096), warps=(4, 8, 16), per_sm=(1, 2, 4, 8, 16)) -> list[Variant]:
    """Every combination in which each thread moves at least one 16-byte vector a step (block words of 8 bytes
    over warps x 32 threads)."""
    return [Variant(b, w, p) for b in blocks for w in warps for p in per_sm if b * 8 >= w * 32 * 16]


SWEEP_CASES = (("mla_p64", 128), ("mha_p16", 128), ("mha_p16", 4096), ("mha_p16", 16384), ("mha_p1", 4096),
               ("mla_p64", 4096), ("mla_p64", 16384))

try:  # a candidate measured against the transport's kernel, not used by it (see the module docstring)
    import triton
    import triton.language as tl

    from sglang_p2p_backend.engine.copy.span_copy import _page_item

    @triton.jit(do_not_specialize=["n_pages", "n_regions", "n_blocks"])
    def _copy_page_blocks(ids, n_pages, table, n_regions, n_blocks, like, BLOCK: tl.constexpr, VEC: tl.constexpr):
        """`span_copy._copy_pages` with programs striding over (item, block) units instead of whole items, and
        with VEC > 1 the promise that every address and item length is a multiple of 16 bytes (16-byte
        accesses; the sweep passes it only where the pools allow it)."""
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        for unit in range(pid, n_pages * n_regions * n_blocks, step):
            item = unit // n_blocks
            w0 = (unit - item * n_blocks) * BLOCK
            src, dst, words = _page_item(ids, n_pages, table, item, like, VEC)
            offs = w0 + tl.arange(0, BLOCK)
            m = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    @triton.jit(do_not_specialize=["n_pages", "n_regions"])
    def _copy_pages_hinted(ids, n_pages, table, n_regions, like, BLOCK: tl.constexpr, LOAD_EF: tl.constexpr,
                           STORE_CS: tl.constexpr, VEC: tl.constexpr):
        """`span_copy._copy_pages` with cache hints: LOAD_EF reads the source with `evict_first` (every byte is
        read once, so it need not stay in L2), STORE_CS writes with `.cs` (streaming: the destination is not read
        again here); VEC as in `_copy_page_blocks`."""
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        for item in range(pid, n_pages * n_regions, step):
            src, dst, words = _page_item(ids, n_pages, table, item, like, VEC)
            for w0 in range(0, words, BLOCK):
                offs = w0 + tl.arange(0, BLOCK)
                m = offs < words
                if LOAD_EF:
                    v = tl.load(src + offs, mask=m, eviction_policy="evict_first")
                else:
                    v = tl.load(src + offs, mask=m)
                if STORE_CS:
                    tl.store(dst + offs, v, mask=m, cache_modifier=".cs")
                else:
                    tl.store(dst + offs, v, mask=m)

    @triton.jit(do_not_specialize=["n_pages", "n_regions"])
    def _copy_pages_unroll2(ids, n_pages, table, n_regions, like, BLOCK: tl.constexpr):
        """`span_copy._copy_pages` with two blocks loaded before either is stored: twice the bytes in flight a
        program without more programs."""
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        for item in range(pid, n_pages * n_regions, step):
            src, dst, words = _page_item(ids, n_pages, table, item, like, 1)
            for w0 in range(0, words, 2 * BLOCK):
                o1 = w0 + tl.arange(0, BLOCK)
                o2 = o1 + BLOCK
                m1 = o1 < words
                m2 = o2 < words
                a = tl.load(src + o1, mask=m1)
                b = tl.load(src + o2, mask=m2)
                tl.store(dst + o1, a, mask=m1)
                tl.store(dst + o2, b, mask=m2)

    @triton.jit(do_not_specialize=["n_pages", "n_regions", "n_blocks"])
    def _copy_page_units(ids, n_pages, table, n_regions, n_blocks, like, BLOCK: tl.constexpr):
        """One program a (item, block) unit and no loop: program u copies block u % n_blocks of item u // n_blocks
        (blocks past an item's end copy nothing), so the grid is every unit, as an elementwise kernel's is, and
        the hardware deals the programs to SMs as they free up."""
        unit = tl.program_id(0).to(tl.int64)
        item = unit // n_blocks
        w0 = (unit - item * n_blocks) * BLOCK
        src, dst, words = _page_item(ids, n_pages, table, item, like, 1)
        offs = w0 + tl.arange(0, BLOCK)
        m = offs < words
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    @triton.jit
    def _copy_flat(a, b, n, BLOCK: tl.constexpr):
        """One contiguous buffer of n words, a program a block: what Triton reaches on the reference's own copy
        (16-byte accesses: the pointers come in as arguments, aligned)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(b + offs, tl.load(a + offs, mask=m), mask=m)
except ImportError:  # CPU-only installs: nothing is launched
    triton = None


def sweep_cases(shapes=SHAPES) -> list[Case]:
    by_name = {s.name: s for s in shapes}
    return [Case(by_name[n], t, d) for n, t in SWEEP_CASES for d in ("contiguous", "scattered")]


#: rows timed twice in turn for every case: the transport's launch and the candidates (`_copy_page_blocks`' two
#: forms; `_copy_pages_hinted`'s: `ef` loads evict_first, `cs` stores streaming, `ef_cs` both, `ef_cs_vec16` both
#: with 16-byte accesses, `ef_cs_b4096w8` both with 4,096 words a step over 8 warps); `unroll2` two blocks loaded
#: before either is stored; `units` one program a (page, block) unit with no loop and no bound on the grid, as an
#: elementwise kernel's, `units_b4096w8` the same with 4,096-word blocks over 8 warps; `flat` (on the reference's
#: own contiguous buffers, not pages) Triton's ceiling on one plain copy
CANDIDATES = ("default", "blocks", "blocks_vec16", "ef", "cs", "ef_cs", "ef_cs_vec16", "ef_cs_b4096w8", "unroll2",
              "units", "units_b4096w8", "flat")


def best(rows: list[dict]) -> dict[str, dict]:
    """Per (target, case): the fastest variant that copied every byte right, and the reference time."""
    out: dict[str, dict] = {}
    for r in rows:
        key = f"{r['target']}:{r['case']}"
        slot = out.setdefault(key, {"ref_us": None, "best": None, **{c: None for c in CANDIDATES}})
        if r["variant"] == "ref":
            slot["ref_us"] = r["us"]
        elif r["variant"] in CANDIDATES:  # each timed twice: the faster of the two
            if slot.get(r["variant"]) is None or r["us"] < slot[r["variant"]]["us"]:
                slot[r["variant"]] = r
        elif not r["bad"] and (slot["best"] is None or r["us"] < slot["best"]["us"]):
            slot["best"] = r
    return out


def _pools(torch, shape: Shape, src_pages: int, dst_pages: int, src_dev, dst_dev):
    """One tensor a side: region r's pages at base + r * pages * item (regions apart, as SGLang's per-layer
    buffers are; the kernel only sees bases)."""
    src = torch.randint(-128, 127, (shape.regions, src_pages, shape.item), dtype=torch.int8, device=src_dev)
    dst = torch.zeros((shape.regions, dst_pages, shape.item), dtype=torch.int8, device=dst_dev)
    return src, dst


def gpu_timer(torch, stream, case_s: float):
    """fn -> the median GPU time in us of fn() on `stream`, repeated for about case_s (at least 5 times)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn) -> float:
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

    return timed


def run(out: Path, machine: str, case_s: float, budget_s: float, per_sm=(1, 2, 4, 8, 16),
        candidates=CANDIDATES) -> dict:
    import torch

    from sglang_p2p_backend.engine.copy import span_copy
    from sglang_p2p_backend.engine.transport.cuda_ipc import same_gpu_programs_per_sm

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
    t_end = time.monotonic() + budget_s
    rows: list[dict] = []
    skipped: list[str] = []
    #: the global accesses the candidates compiled to, by kernel and VEC (the device's Triton decides)
    forms: dict[str, list[str]] = {}

    timed = gpu_timer(torch, stream, case_s)
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
                if "flat" in candidates:  # Triton's own ceiling on the reference's buffers
                    a.random_(-128, 127)
                    b.zero_()
                    a64, b64, n64 = a.view(torch.int64), b.view(torch.int64), nbytes // 8
                    flat_grid = -(-n64 // 2048)
                    flat = lambda: _copy_flat[(flat_grid,)](a64, b64, n64, BLOCK=2048, num_warps=8)  # noqa: E731
                    for _ in range(2):
                        rows.append({"target": target, "case": case.name, "variant": "flat", "block": 2048,
                                     "warps": 8, "grid": flat_grid, "vec": 2, "us": timed(flat), "bytes": nbytes,
                                     "bad": not bool(torch.equal(a, b.to(dev0)))})
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

                # the candidate's VEC: 16-byte vectors where every base and item size is a multiple of 16
                vec = 16 // word if span_copy.word_size(table[:, 0], table[:, 1], table[:, 2], cap=16) == 16 else 1

                def launch(block: int, warps: int, grid: int):
                    return lambda: span_copy._copy_pages[(grid,)](dev, n, dev[2 * n:], shape.regions, like,
                                                                   BLOCK=block, num_warps=warps)

                def blocks(block: int, grid: int, vec: int):
                    units = -(-words // block)
                    return lambda: _copy_page_blocks[(grid,)](dev, n, dev[2 * n:], shape.regions, units, like,
                                                              BLOCK=block, VEC=vec, num_warps=4)

                default_block = min(1024, max(16, 1 << (words - 1).bit_length()))
                bound = span_copy.default_programs(sms, default_block * word)
                if target == "same":  # the transport's bound into its own GPU
                    bound = same_gpu_programs_per_sm([shape.item]) * sms
                default_grid = min(n * shape.regions, bound)
                unit_grid = min(n * shape.regions * -(-words // default_block), bound)
                def hinted(block: int, warps: int, ef: bool, cs: bool, vec: int):
                    return lambda: _copy_pages_hinted[(default_grid,)](dev, n, dev[2 * n:], shape.regions, like,
                                                                        BLOCK=block, LOAD_EF=ef, STORE_CS=cs,
                                                                        VEC=vec, num_warps=warps)

                big = min(4096, max(default_block, 1 << (words - 1).bit_length()))

                def units(name: str, block: int, warps: int) -> tuple:
                    """The `turns` row of `_copy_page_units` at `block` words over `warps`: every unit a program."""
                    n_blocks = -(-words // block)
                    grid = n * shape.regions * n_blocks
                    return (name, lambda: _copy_page_units[(grid,)](dev, n, dev[2 * n:], shape.regions, n_blocks, like,
                                                                    BLOCK=block, num_warps=warps),
                            grid, 1, block, warps)

                # the transport's launch and the candidates, in turn twice so a drift of the clocks shows
                turns = (("default", launch(default_block, 4, default_grid), default_grid, 1, default_block, 4),
                         ("blocks", blocks(default_block, unit_grid, 1), unit_grid, 1, default_block, 4),
                         ("blocks_vec16", blocks(default_block, unit_grid, vec), unit_grid, vec, default_block, 4),
                         ("ef", hinted(default_block, 4, True, False, 1), default_grid, 1, default_block, 4),
                         ("cs", hinted(default_block, 4, False, True, 1), default_grid, 1, default_block, 4),
                         ("ef_cs", hinted(default_block, 4, True, True, 1), default_grid, 1, default_block, 4),
                         ("ef_cs_vec16", hinted(default_block, 4, True, True, vec), default_grid, vec, default_block,
                          4),
                         ("ef_cs_b4096w8", hinted(big, 8, True, True, 1), default_grid, 1, big, 8),
                         ("unroll2", lambda: _copy_pages_unroll2[(default_grid,)](
                             dev, n, dev[2 * n:], shape.regions, like, BLOCK=default_block, num_warps=4),
                          default_grid, 1, default_block, 4),
                         units("units", default_block, 4),
                         units("units_b4096w8", big, 8))
                for variant, fn, grid, v, blk, warps in turns * 2:
                    if variant not in candidates:
                        continue
                    dst.zero_()
                    us = timed(fn)
                    rows.append({"target": target, "case": case.name, "variant": variant, "block": blk,
                                 "warps": warps, "grid": grid, "vec": v, "us": us, "bytes": nbytes, "bad": not check()})
                if f"blocks_vec{vec}" not in forms:
                    for v in sorted({1, vec}):
                        compiled = _copy_page_blocks[(1,)](dev, 0, dev[2 * n:], shape.regions, 1, like,
                                                           BLOCK=default_block, VEC=v, num_warps=4)
                        forms[f"blocks_vec{v}"] = access_forms(compiled.asm.get("ptx", ""))
                        compiled = _copy_pages_hinted[(1,)](dev, 0, dev[2 * n:], shape.regions, like,
                                                            BLOCK=default_block, LOAD_EF=True, STORE_CS=True, VEC=v,
                                                            num_warps=4)
                        forms[f"ef_cs_vec{v}"] = access_forms(compiled.asm.get("ptx", ""))
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
    result = {"machine": machine, "sms": sms, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "triton": triton.__version__, "access_forms": forms, "rows": rows,
              "best": best(rows), "skipped": skipped}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


class _Pinned:
    """A pinned host buffer handed to a Triton kernel as a pointer (its launcher maps it to the device's view)."""

    def __init__(self, t):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


HOST_IDS_CASES = (("mla_p64", 128), ("mha_p16", 128), ("mla_p64", 4096), ("mha_p1", 4096))


def host_ids(torch, span_copy, timed_pair, sms: int, shapes=SHAPES) -> list[dict]:
    """Upload + kernel against the kernel reading its ids and table from pinned host memory, on cuda:0 into
    cuda:0 (GPU time between events, `timed_pair(fn)` -> median us)."""
    dev0 = torch.device("cuda:0")
    by_name = {s.name: s for s in shapes}
    out = []
    for name, tokens in HOST_IDS_CASES:
        shape = by_name[name]
        case = Case(shape, tokens, "scattered")
        n_max = shape.pages(tokens)
        src, dst = _pools(torch, shape, n_max, 2 * n_max, dev0, dev0)
        s_ids, d_ids = page_ids(case, n_max, 2 * n_max)
        n = len(s_ids)
        rb_s, rb_d = src[0].numel(), dst[0].numel()
        _, table, words, _ = span_copy.RegionTables().get(
            np.array([src.data_ptr() + r * rb_s for r in range(shape.regions)]),
            np.array([dst.data_ptr() + r * rb_d for r in range(shape.regions)]), np.array([shape.item] * shape.regions))
        host = torch.from_numpy(np.concatenate([s_ids, d_ids, table.reshape(-1)]).astype(np.int64)).pin_memory()
        dev = torch.empty_like(host, device=dev0)
        like = torch.empty(1, dtype=torch.int64, device=dev0)
        block = min(1024, max(16, 1 << (words - 1).bit_length()))
        grid = (min(n * shape.regions, 8 * sms),)
        pinned = _Pinned(host)

        def uploaded():
            dev.copy_(host, non_blocking=True)
            span_copy._copy_pages[grid](dev, n, dev[2 * n:], shape.regions, like, BLOCK=block)

        def from_host():
            span_copy._copy_pages[grid](pinned, n, _Pinned(host[2 * n:]), shape.regions, like, BLOCK=block)

        row = {"case": f"{name}_{tokens}", "bytes": n * shape.item * shape.regions, "grid": grid[0]}
        for label, fn in (("upload_kernel_us", uploaded), ("host_ids_us", from_host),
                          ("upload_kernel_us_2", uploaded), ("host_ids_us_2", from_host)):
            dst.zero_()
            try:
                row[label] = timed_pair(fn)
                ok = bool(torch.equal(dst.index_select(1, torch.from_numpy(d_ids).to(dev0)),
                                      src.index_select(1, torch.from_numpy(s_ids).to(dev0))))
                row[label.replace("_us", "_ok")] = ok
            except Exception as e:  # noqa: BLE001 - a device that cannot read pinned memory: recorded, not fatal
                row[label] = None
                row[label.replace("_us", "_error")] = f"{type(e).__name__}: {e}"
                break
        out.append(row)
        del src, dst
        torch.cuda.empty_cache()
    return out


def report(result: dict) -> str:
    shown = [c for c in CANDIDATES if any(b.get(c) for b in result["best"].values())]
    cols = [("target:case", 34), ("ref us", 9)]
    for name in shown:
        cols += [(name, max(9, len(name) + 1)), ("ratio", 7)]
    t = Table(cols + [("best", 14), ("best us", 9), ("ratio", 7)])
    for key, b in result["best"].items():
        ref, top = b["ref_us"], b["best"]
        cells = []
        for name in shown:
            r = b.get(name)
            cells += [r and r["us"], r and ref and ref / r["us"]]
        t.add(key, ref, *cells, top and top["variant"], top and top["us"], top and ref and ref / top["us"])
    bad = [f"{r['target']}:{r['case']}:{r['variant']}" for r in result["rows"] if r["bad"]]
    forms = "; ".join(f"{k}: {' '.join(v)}" for k, v in result.get("access_forms", {}).items())
    text = (t.render() + f"\naccesses: {forms or 'not recorded'}\nwrong bytes: {bad or 'none'}"
            f"\nskipped: {result['skipped'] or 'none'}")
    for r in result.get("host_ids", []):
        text += "\nhost ids " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
    return text


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "bench/results/page_kernel_sweep.json", case_s=0.1, budget_s=240.0)
    ap.add_argument("--per-sm", default="1,2,4,8,16", help="programs an SM to try, comma-separated (empty: none)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES),
                    help="the rows timed in turn for every case, comma-separated (default: all)")
    ap.add_argument("--host-ids", action="store_true",
                    help="instead of the sweep, time the kernel reading its ids from pinned memory (a process of its "
                         "own: a device that cannot read it may fail the context)")
    args = ap.parse_args(argv)
    torch = cuda_torch("page_kernel_sweep")
    if torch is None:
        return 0
    per_sm = tuple(int(x) for x in args.per_sm.split(",") if x.strip())
    if args.host_ids:
        from sglang_p2p_backend.engine.copy import span_copy

        dev0 = torch.device("cuda:0")
        sms = torch.cuda.get_device_properties(dev0).multi_processor_count
        rows = host_ids(torch, span_copy, gpu_timer(torch, torch.cuda.Stream(dev0), args.case_s), sms)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": args.machine, "host_ids": rows}, indent=1))
        print(report({"best": {}, "rows": [], "skipped": [], "host_ids": rows}))
        return 1 if any(v is False for r in rows for k, v in r.items() if k.endswith("_ok")) else 0
    result = run(args.out, args.machine, args.case_s, args.budget_s, per_sm,
                 picked(ap, args.candidates, CANDIDATES, "candidates"))
    print(report(result))
    return 1 if any(r["bad"] for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
