"""Fused copy of many (src, dst, length) spans on one GPU stream: one Triton launch per chunk, no staging.

The same-host one-sided path (transport/cuda_ipc.py) turns a chunk into descriptors with `onesided.chunk_descriptors`
(merged page runs of every region, or head slices of every token row with different attention TP) whose
destinations are the decode's pool mapped into this process. Copying them with one `cudaMemcpyAsync` each is
what Mooncake's NVLink path does (one call per run of pages); here `plan_tiles` (pure, tested on CPU) cuts
every span into tiles of at most `tile_bytes` so that one launch keeps every SM busy whether the chunk is a
few long runs (contiguous pages: one span per layer) or thousands of single pages, and `SpanCopier.copy`
uploads the tile table and launches once.

Words: the kernel moves the widest power-of-two word (up to 8 bytes) dividing every address and length of the
chunk; KV pools always allow 8 (page rows are multiples of 16 bytes, and allocations are 256-byte aligned).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

try:  # Triton comes with CUDA builds of torch; CPU-only installs lack it and never launch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

#: largest piece one program copies: long runs are cut so a chunk spreads over all SMs
TILE_BYTES = 256 << 10
#: words one program moves per loop iteration
_BLOCK = 1024


def word_size(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, cap: int = 8) -> int:
    """Widest power-of-two word (<= cap) dividing every address and length."""
    if not len(lens):
        return cap
    bits = cap
    for a in (src, dst, lens):
        bits |= int(np.bitwise_or.reduce(a))
    return bits & -bits


def plan_tiles(src: Sequence[int], dst: Sequence[int], lens: Sequence[int], tile_bytes: int = TILE_BYTES,
               word: Optional[int] = None) -> tuple[int, np.ndarray]:
    """(word bytes, int64 [n, 3] tiles of (src address, dst address, words)) covering every span exactly once,
    in order; zero-length spans vanish."""
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    if not (src.shape == dst.shape == lens.shape):
        raise ValueError(f"{src.size} sources, {dst.size} destinations and {lens.size} lengths do not pair up")
    shortest = int(lens.min()) if lens.size else 1
    if shortest < 0:
        raise ValueError("negative span length")
    if shortest == 0:
        keep = lens > 0
        src, dst, lens = src[keep], dst[keep], lens[keep]
    word = word or word_size(src, dst, lens)
    if tile_bytes % word:
        raise ValueError(f"tile of {tile_bytes} bytes is not a multiple of the {word}-byte word")
    if not lens.size or int(lens.max()) <= tile_bytes:  # every span one tile (pages, head slices): no expansion
        return word, np.stack([src, dst, lens // word], axis=1)
    per = -(-lens // tile_bytes)  # tiles per span
    first = np.repeat(np.cumsum(per) - per, per)
    k = np.arange(int(per.sum()), dtype=np.int64) - first  # tile index inside its span
    owner = np.repeat(np.arange(lens.size), per)
    off = k * tile_bytes
    n = np.minimum(lens[owner] - off, tile_bytes)
    return word, np.stack([src[owner] + off, dst[owner] + off, n // word], axis=1)


if triton is not None:

    @triton.jit(do_not_specialize=["n_tiles"])
    def _copy_tiles(tiles, n_tiles, like, BLOCK: tl.constexpr):
        """Program t copies tile t: tiles[t] = (src address, dst address, words); `like` only gives the word
        type (a pointer to it), as in gather_cuda."""
        t = tl.program_id(0)
        base = tiles + t.to(tl.int64) * 3
        src = tl.load(base).to(like.dtype)
        dst = tl.load(base + 1).to(like.dtype)
        n = tl.load(base + 2)
        for w0 in range(0, n, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class SpanCopier:
    """Copies descriptor batches on `device` with one launch each, on the caller's or its own stream."""

    def __init__(self, device: torch.device, tile_bytes: int = TILE_BYTES):
        if triton is None:
            raise RuntimeError("the same-host copy path needs Triton (it comes with CUDA builds of torch)")
        self.device = device
        self.tile_bytes = tile_bytes
        self._host = torch.empty(0, dtype=torch.int64).pin_memory()
        self._dev = torch.empty(0, dtype=torch.int64, device=device)
        self._like = {w: torch.empty(1, dtype=d, device=device) for w, d in _WORD_DTYPES.items()}

    def _upload(self, tiles: np.ndarray, stream: torch.cuda.Stream) -> torch.Tensor:
        n = tiles.size
        if self._host.numel() < n:  # grows to the largest chunk seen, then stays
            self._host = torch.empty(max(n, 2 * self._host.numel()), dtype=torch.int64).pin_memory()
            self._dev = torch.empty(self._host.numel(), dtype=torch.int64, device=self.device)
        self._host[:n].numpy()[:] = tiles.reshape(-1)
        dev = self._dev[:n]
        with torch.cuda.stream(stream):
            dev.copy_(self._host[:n], non_blocking=True)
        return dev

    def copy(self, src: Sequence[int], dst: Sequence[int], lens: Sequence[int],
             stream: Optional[torch.cuda.Stream] = None) -> int:
        """Launch the copy of every span on `stream` (the current one by default) and return the bytes
        queued; the caller synchronises. The pinned tile table is reused: a caller must not call again before
        the previous copy's stream finished (the IPC transport syncs every chunk)."""
        word, tiles = plan_tiles(src, dst, lens, self.tile_bytes)
        if not len(tiles):
            return 0
        stream = stream or torch.cuda.current_stream(self.device)
        table = self._upload(tiles, stream)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            _copy_tiles[(len(tiles),)](table, len(tiles), self._like[word], BLOCK=_BLOCK)
        return int(tiles[:, 2].sum()) * word
