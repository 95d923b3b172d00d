"""The same-host copy kernels on a GPU (one process, pools on one device), where alignment and item sizes vary: the
word size follows the pools (items or bases only 8-byte aligned), regions of short items beside long ones, a grid
far smaller than the items, and spans cut into tiles; every page lands where it should and nothing else changes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from sglang_p2p_backend.engine.copy.span_copy import SpanCopier  # noqa: E402
from sglang_p2p_backend.engine.transport.cuda_ipc import backend  # noqa: E402

REGIONS, PAGES = 6, 40


def _regions(item: int, shift: int, dev) -> tuple[torch.Tensor, list[int]]:
    """One uint8 buffer holding REGIONS regions of PAGES items, region r starting `shift` bytes past a 512-byte
    boundary (shift 8: 8-aligned bases, not 16)."""
    stride = -(-(PAGES * item + shift) // 512) * 512
    buf = torch.zeros(REGIONS * stride + 512, dtype=torch.uint8, device=dev)
    start = -buf.data_ptr() % 512
    return buf, [buf.data_ptr() + start + r * stride + shift for r in range(REGIONS)]


def _page(buf: torch.Tensor, base: int, item: int, page: int) -> torch.Tensor:
    off = base - buf.data_ptr() + page * item
    return buf[off:off + item]


@pytest.mark.parametrize("item, shift", [(1152, 0), (1160, 0), (1152, 8), (1155, 3)],
                         ids=["16-aligned", "item-8-aligned", "bases-8-aligned", "odd"])
def test_page_kernel_copies_every_page_whatever_the_alignment(item, shift):
    dev = torch.device("cuda", torch.cuda.current_device())
    src, sb = _regions(item, shift, dev)
    dst, db = _regions(item, shift, dev)
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, device=dev))
    items = np.array([item] * REGIONS, dtype=np.int64)
    rng = np.random.default_rng(item + shift)
    written: dict[int, int] = {}
    for _ in range(2):  # the first launch of a word size goes through Triton's JIT, a later one is the direct launch
        s_ids = rng.choice(PAGES, size=7, replace=False).astype(np.int64)
        free = np.setdiff1d(np.arange(PAGES), list(written))
        d_ids = rng.choice(free, size=7, replace=False).astype(np.int64)
        backend().write_pages(dev, np.array(sb), np.array(db), items, s_ids, d_ids)
        written.update(zip(d_ids.tolist(), s_ids.tolist()))
    torch.cuda.synchronize(dev)
    # the second launch went through the kept kernel, straight to its launcher (triton_launch.DirectLaunch)
    kept = list(backend()._copiers(dev).pages._compiled.values())  # noqa: SLF001
    assert kept and all(k.direct for k in kept)
    want = torch.zeros_like(dst)  # every written page, and zero everywhere else (between regions too)
    for r in range(REGIONS):
        for d, s in written.items():
            _page(want, db[r] - dst.data_ptr() + want.data_ptr(), item, d).copy_(_page(src, sb[r], item, s))
    assert torch.equal(dst, want)


def test_regions_of_short_items_beside_long_ones_with_a_small_grid():
    """Regions of 72 KiB items (9 loop steps of 8 KiB) beside regions of 1,152-byte ones, with the default grid
    and with two programs striding over all 18 items; bytes beside each page stay zero."""
    dev = torch.device("cuda", torch.cuda.current_device())
    sizes = [73728, 1152] * 3
    src = [torch.randint(0, 256, (PAGES * n,), dtype=torch.uint8, device=dev) for n in sizes]
    dst = [torch.zeros(PAGES * n, dtype=torch.uint8, device=dev) for n in sizes]
    s_ids = np.array([3, 17, 5], dtype=np.int64)
    d_ids = np.array([0, 39, 6], dtype=np.int64)
    for grid in (None, 2):
        for t in dst:
            t.zero_()
        backend().write_pages(dev, np.array([t.data_ptr() for t in src]), np.array([t.data_ptr() for t in dst]),
                              np.array(sizes, dtype=np.int64), s_ids, d_ids, max_programs=grid)
        torch.cuda.synchronize(dev)
        for n, a, b in zip(sizes, src, dst):
            want = torch.zeros_like(b)
            for si, di in zip(s_ids.tolist(), d_ids.tolist()):
                want[di * n:(di + 1) * n] = a[si * n:(si + 1) * n]
            assert torch.equal(b, want), (n, grid)


@pytest.mark.parametrize("shift", [0, 8, 3], ids=["16-aligned", "8-aligned", "odd"])
def test_span_kernel_copies_every_span_whatever_the_alignment(shift):
    dev = torch.device("cuda", torch.cuda.current_device())
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(8 << 20, dtype=torch.uint8, device=dev)
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    # a long span (cut into tiles), short ones, one ending past a 16-byte boundary when shifted
    spans = [(0, 1 << 20, 3 << 20), (2 << 20, 64, 4096 + shift), (3 << 20, 8192, 1152 + shift)]
    s = np.array([base_s + a + shift for a, _, _ in spans], dtype=np.int64)
    d = np.array([base_d + b + shift for _, b, _ in spans], dtype=np.int64)
    n = np.array([length for _, _, length in spans], dtype=np.int64)
    assert SpanCopier(dev).copy(s, d, n) == int(n.sum())
    torch.cuda.synchronize(dev)
    want = torch.zeros_like(dst)
    for a, b, length in spans:
        want[b + shift:b + shift + length] = src[a + shift:a + shift + length]
    assert torch.equal(dst, want)
