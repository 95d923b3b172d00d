"""Fused page gather/scatter on CUDA: one Triton launch moves a chunk's pages of every region of a group.

`copier.copy_chunk` issues one `index_select` per region, so an MLA chunk of 61 layers is 61 launches and an
MHA chunk (K and V of 32 layers) 64. Here a group's regions are a device table of base addresses and item lengths,
and one kernel over (page block, region) copies every page of every region between the pool and staging in
`plan.staging_blocks`' layout: region by region, inside a region the segment's pages in order.

Use: `FusedGather(views)` once per registration (views as in `copier.py`: `[group][region]` ->
(num_items, item_len) uint8 tensors on one CUDA device), then `gather_chunk(chunk, ids, staging)` /
`scatter_chunk(chunk, ids, staging)`: one launch per segment of the chunk (one segment for a plain KV chunk),
on the caller's current stream (`prepare_chunk` splits it: checks and ids to the device now, the launch later).
Ids are the transfer's per-group id arrays; they are checked against the region sizes on the host (out-of-range
ids would corrupt memory in a raw-address kernel).

The kernel moves 8-byte words when every base address, item length and the staging buffer allow it (KV
pools always do), else the widest word that divides them all. After a variant's first launch through Triton's JIT
(the warmup's, for whole-group chunks), later launches call its compiled kernel directly (`_launch_direct`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sglang_p2p_backend.engine.copy.pinned_ring import PinnedRing
from sglang_p2p_backend.engine.copy.plan import ids_out_of_range
from sglang_p2p_backend.engine.copy.triton_launch import DirectLaunch

try:  # Triton comes with CUDA builds of torch; CPU-only installs lack it and never call this module
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on CPU-only installs
    triton = None

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: words per (page-block x column-block) tile of one program: 4096 x 8 B = 32 KiB in flight per iteration
_TILE_WORDS = 4096
_MAX_BLOCK_W = 512


def _nothing() -> None:
    """The launch of a copy that moves nothing."""


def _jit_options() -> dict:
    """Compile one variant per tile shape and direction, whatever the ids count and pointer alignments: a new
    variant would be compiled and loaded in the middle of a transfer, and loading a CUDA module can wait for the
    NCCL kernels in flight, i.e. for the peer (see `FusedGather.warmup`)."""
    import inspect

    opts = {"do_not_specialize": ["n_pages", "n_regions"]}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        opts["do_not_specialize_on_alignment"] = ["bases", "item_words", "prefix_words", "ids", "stage"]
    return opts


if triton is not None:

    @triton.jit
    def _copy_block(bases, item_words, prefix_words, ids, stage, n_pages, r, pb,
                    SCATTER: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
        """Pages [pb * BLOCK_P, +BLOCK_P) of region r between the pool and staging."""
        region = tl.load(bases + r).to(stage.dtype)
        iw = tl.load(item_words + r)
        rows = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        row_ok = rows < n_pages
        page = tl.load(ids + rows, mask=row_ok, other=0)
        pool_off = page * iw
        stage_off = n_pages * tl.load(prefix_words + r) + rows.to(tl.int64) * iw
        for w0 in range(0, iw, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            m = row_ok[:, None] & (cols < iw)[None, :]
            if SCATTER:
                v = tl.load(stage + stage_off[:, None] + cols[None, :], mask=m)
                tl.store(region + pool_off[:, None] + cols[None, :], v, mask=m)
            else:
                v = tl.load(region + pool_off[:, None] + cols[None, :], mask=m)
                tl.store(stage + stage_off[:, None] + cols[None, :], v, mask=m)

    @triton.jit(**_jit_options())
    def _copy_pages(
        bases,  # int64 [R]: base address of each region
        item_words,  # int64 [R]: words per page in each region
        prefix_words,  # int64 [R]: words per page of the regions before it in this launch
        ids,  # int64 [n]: page ids of the segment
        stage,  # word pointer: staging at this segment's offset
        n_pages,
        n_regions,
        SCATTER: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_W: tl.constexpr,
        PERSISTENT: tl.constexpr,
    ):
        if PERSISTENT:  # a bounded grid walks (region, page block) items, leaving SMs free for NCCL
            n_blocks = tl.cdiv(n_pages, BLOCK_P)
            for item in range(tl.program_id(0), n_blocks * n_regions, tl.num_programs(0)):
                _copy_block(bases, item_words, prefix_words, ids, stage, n_pages, item // n_blocks,
                            item % n_blocks, SCATTER, BLOCK_P, BLOCK_W)
        else:  # grid (page blocks, regions)
            _copy_block(bases, item_words, prefix_words, ids, stage, n_pages, tl.program_id(1),
                        tl.program_id(0), SCATTER, BLOCK_P, BLOCK_W)


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two dividing n, at most cap."""
    return min(n & -n, cap) if n else cap


class _GroupTable:
    """Device table of one group's regions."""

    def __init__(self, views: Sequence[torch.Tensor], device: torch.device):
        self.ptrs = [int(v.data_ptr()) for v in views]
        self.item_lens = [int(v.shape[1]) for v in views]
        self.num_items = [int(v.shape[0]) for v in views]
        word = 8
        for x in self.ptrs + self.item_lens:
            while word > 1 and x % word:
                word //= 2
        self.word = word
        self.bases = torch.tensor(self.ptrs, dtype=torch.int64, device=device)
        self.item_words_host = [n // word for n in self.item_lens]
        self.item_words = torch.tensor(self.item_words_host, dtype=torch.int64, device=device)
        # per region range [lo, hi): prefix sums restarted at lo, built lazily (a chunk may take a region slice)
        self._prefix: dict[tuple[int, int], torch.Tensor] = {}
        self._block: dict[tuple[int, int], tuple[int, int]] = {}
        self.device = device

    def prefix(self, lo: int, hi: int) -> torch.Tensor:
        key = (lo, hi)
        if key not in self._prefix:
            words = self.item_words_host[lo:hi]
            pre = np.concatenate(([0], np.cumsum(words)[:-1])).astype(np.int64)
            self._prefix[key] = torch.from_numpy(pre).to(self.device)
        return self._prefix[key]

    def blocks(self, lo: int, hi: int) -> tuple[int, int]:
        key = (lo, hi)
        if key not in self._block:
            g = math.gcd(*self.item_words_host[lo:hi]) if hi > lo else 1
            block_w = _pow2_divisor(g, _MAX_BLOCK_W)
            self._block[key] = (max(1, _TILE_WORDS // block_w), block_w)
        return self._block[key]


class FusedGather:
    """Fused gather/scatter over the regions of each group (see the module docstring)."""

    def __init__(self, views: Sequence[Sequence[torch.Tensor]], *, num_warps: int = 8, warmup: bool = True,
                 max_programs: Optional[int] = None):
        """`max_programs`: bound the grid (a persistent kernel) so a gather or scatter that overlaps an NCCL
        kernel leaves SMs to it; None launches one program per (page block, region)."""
        if triton is None:
            raise RuntimeError("gather_cuda needs Triton (it comes with CUDA builds of torch)")
        devices = {v.device for regions in views for v in regions}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"fused gather needs every region on one CUDA device, got {sorted(map(str, devices))}")
        self.device = next(iter(devices))
        self.groups = [_GroupTable(regions, self.device) for regions in views]
        self.num_warps = num_warps
        self.max_programs = max_programs
        #: each variant's compiled kernel, kept from its launch through Triton's JIT (the warmup's, mostly), which
        #: later launches call directly (`_launch`)
        self._compiled: dict[tuple, DirectLaunch] = {}
        #: the page-id uploads' pinned slots, made once (no pinned block taken from torch's allocator a room)
        self.uploads = PinnedRing(self.device)
        if warmup:
            self.warmup()

    def warmup(self) -> None:
        """Compile and load the kernel variants whole-group chunks use, touching no memory (zero pages).

        Call before the first transfer. Triton loads a kernel's CUDA module at its first launch, and with
        CUDA's lazy loading (torch's default) a module load can wait until the kernels running on the device
        finish: a decode that launches its first scatter while its receive waits for the prefill would stall
        until the data arrives (and deadlock if the prefill waits for the decode meanwhile)."""
        with torch.cuda.device(self.device):
            for g, table in enumerate(self.groups):
                if not table.ptrs:
                    continue
                probe = torch.zeros(16, dtype=torch.uint8, device=self.device)
                for scatter in (False, True):
                    self._launch(table, 0, len(table.ptrs), table.word, probe[:0].view(_WORD_DTYPES[table.word]),
                                 torch.zeros(1, dtype=torch.int64, device=self.device), 0, scatter)
            torch.cuda.current_stream(self.device).synchronize()

    def _ids(self, table: _GroupTable, ids: np.ndarray | torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if isinstance(ids, torch.Tensor) and ids.device.type == "cuda":
            return ids.to(torch.int64)  # already on the GPU: the caller vouches for the range
        part = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
        problem = ids_out_of_range(part, min(table.num_items[lo:hi]))
        if problem:
            raise IndexError(problem)
        return self.upload_ids(part)

    def upload_ids(self, ids: np.ndarray) -> torch.Tensor:
        """Page ids to the device as int64, on the current stream, through the pinned ring (unchecked: the caller
        checks the range)."""
        return self.uploads.upload(ids)

    def copy(self, group: int, ids: np.ndarray | torch.Tensor, staging: torch.Tensor, **kw: Any) -> int:
        """Gather (scatter=False) pages `ids` of regions [region_lo, region_hi) of `group` into `staging`, or
        scatter them back; staging holds region by region, pages in order. Returns the bytes moved. Keywords:
        `scatter` (required), `region_lo`, `region_hi`, as `prepare` takes them."""
        nbytes, launch = self.prepare(group, ids, staging, **kw)
        launch()
        return nbytes

    def prepare(
        self,
        group: int,
        ids: np.ndarray | torch.Tensor,
        staging: torch.Tensor,
        *,
        scatter: bool,
        region_lo: int = 0,
        region_hi: Optional[int] = None,
    ) -> tuple[int, Callable[[], None]]:
        """`copy` in two steps: its checks, and the ids to the device on the current stream, now; the launch
        (returned with the bytes it moves) later, on this stream or one ordered after it. A receiver readies a
        chunk's scatter this way while the chunk's bytes are still on their way."""
        table = self.groups[group]
        hi = len(table.ptrs) if region_hi is None else region_hi
        if not 0 <= region_lo <= hi <= len(table.ptrs):
            raise IndexError(f"regions [{region_lo}, {hi}) outside group {group}'s {len(table.ptrs)} regions")
        n = int(ids.numel() if isinstance(ids, torch.Tensor) else len(ids))
        nbytes = n * sum(table.item_lens[region_lo:hi])
        if n == 0 or hi <= region_lo:
            return 0, _nothing
        if staging.device != self.device or staging.dtype != torch.uint8 or staging.numel() < nbytes:
            raise ValueError(f"staging must be uint8 on {self.device} with >= {nbytes} bytes")
        word = table.word
        while word > 1 and staging.data_ptr() % word:
            word //= 2
        dev_ids = self._ids(table, ids, region_lo, hi)
        return nbytes, self._launcher(table, region_lo, hi, word, staging[:nbytes].view(_WORD_DTYPES[word]), dev_ids,
                                      n, scatter)

    def _launch(self, table: _GroupTable, lo: int, hi: int, word: int, stage_words: torch.Tensor,
                dev_ids: torch.Tensor, n: int, scatter: bool) -> None:
        self._launcher(table, lo, hi, word, stage_words, dev_ids, n, scatter)()

    def _launcher(self, table: _GroupTable, lo: int, hi: int, word: int, stage_words: torch.Tensor,
                  dev_ids: torch.Tensor, n: int, scatter: bool) -> Callable[[], None]:
        """The launch of one copy, its arguments worked out now (it keeps `dev_ids` and `stage_words` alive)."""
        words_t, prefix = table.item_words, table.prefix(lo, hi)
        block_p, block_w = table.blocks(lo, hi)
        if word != table.word:  # staging less aligned than the pool: the same copy in smaller words
            scale = table.word // word
            words_t, prefix = words_t * scale, prefix * scale
            block_w = min(block_w * scale, _MAX_BLOCK_W)
            block_p = max(1, _TILE_WORDS // block_w)
        grid = (max(1, triton.cdiv(n, block_p)), hi - lo)
        persistent = self.max_programs is not None
        if persistent:
            grid = (max(1, min(self.max_programs, grid[0] * grid[1])),)
        # the pointers as the kernel gets them (bases and item words from region lo on: 8-byte entries), without
        # making the tensor views the JIT takes (a few us each), which only its path below needs
        ptrs = (table.bases.data_ptr() + 8 * lo, words_t.data_ptr() + 8 * lo, prefix.data_ptr(), dev_ids.data_ptr(),
                stage_words.data_ptr())
        # what Triton compiles a variant for: the constants, the word type, and (where it specialises on them)
        # whether each pointer is 16-byte aligned; the sizes are not specialised on (`_jit_options`)
        key = (stage_words.dtype, bool(scatter), block_p, block_w, persistent, self.num_warps,
               tuple(p % 16 == 0 for p in ptrs))

        def launch() -> None:
            kernel = self._compiled.get(key)
            if kernel is not None and torch.cuda.current_device() == self.device.index:
                self._launch_direct(kernel, grid, ptrs, n, hi - lo, scatter, block_p, block_w, persistent)
                return
            kernel = _copy_pages[grid](
                table.bases[lo:hi],
                words_t[lo:hi],
                prefix,
                dev_ids,
                stage_words,
                n,
                hi - lo,
                SCATTER=scatter,
                BLOCK_P=block_p,
                BLOCK_W=block_w,
                PERSISTENT=persistent,
                num_warps=self.num_warps,
            )
            if callable(getattr(kernel, "__getitem__", None)):  # a CompiledKernel (Triton 3): callable directly
                self._compiled[key] = DirectLaunch(kernel)

        return launch

    def _launch_direct(self, kernel: DirectLaunch, grid: tuple, ptrs: tuple, n: int, n_regions: int,
                       scatter: bool, block_p: int, block_w: int, persistent: bool) -> None:
        """The compiled variant launched on the current stream's handle (triton_launch.DirectLaunch), without
        Triton's JIT, which binds and specialises the arguments anew at every launch (33 of a gather's 131 us of
        host time on an H100 host, bench/results/gather_host_nvidia-h100_2026-11-28.log); what the JIT itself
        ends with. The device is this gather's (checked by the caller: the kernel was loaded there)."""
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, 1)
        kernel.launch(grid3, torch._C._cuda_getCurrentRawStream(self.device.index), *ptrs, n, n_regions, scatter,
                      block_p, block_w, persistent)

    def prepare_chunk(self, chunk, ids: Sequence, staging: torch.Tensor, scatter: bool) -> Callable[[], int]:
        """`gather_chunk` / `scatter_chunk` in two steps (`prepare`): the returned call launches every segment's
        copy and returns the chunk's bytes."""
        launches, off = [], 0
        for seg in chunk.segments:
            nbytes, launch = self.prepare(seg.group, ids[seg.group][seg.lo : seg.hi], staging[off:], scatter=scatter,
                                          region_lo=seg.region_lo, region_hi=seg.region_hi)
            launches.append(launch)
            off += nbytes

        def run() -> int:
            for launch in launches:
                launch()
            return off

        return run

    def gather_chunk(self, chunk, ids: Sequence, staging: torch.Tensor) -> int:
        """`copier.copy_chunk(chunk, views, ids, staging, scatter=False)` with the views bound at init."""
        return self.prepare_chunk(chunk, ids, staging, scatter=False)()

    def scatter_chunk(self, chunk, ids: Sequence, staging: torch.Tensor) -> int:
        """`copier.copy_chunk(chunk, views, ids, staging, scatter=True)` with the views bound at init."""
        return self.prepare_chunk(chunk, ids, staging, scatter=True)()
