"""The same-host path's pure parts, on CPU: `span_copy.plan_tiles`/`word_size` (the tile table the copy kernel
runs) replayed as memmoves on a numpy "memory", and `cuda_ipc.RegionTable.translate`/`check_export` (the bounds
every destination span is checked against). The kernel and the CUDA calls run in tests/gpu/test_cuda_ipc.py."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

pytest.importorskip("torch")

from sglang_p2p_backend.engine.wire.messages import IpcExport, IpcRegion  # noqa: E402
from sglang_p2p_backend.engine.copy.span_copy import default_programs, plan_tiles, word_size  # noqa: E402
from sglang_p2p_backend.engine.transport.base import TransportError  # noqa: E402
from sglang_p2p_backend.engine.transport.cuda_ipc import CudaBackend, RegionTable, check_export  # noqa: E402


def _bytes_of(addr, lens) -> np.ndarray:
    """Every byte address of the spans (addr[i], lens[i]), span after span."""
    return np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in zip(addr, lens)] or [np.zeros(0, np.int64)])


@pytest.mark.parametrize("align", [8, 4, 1])
def test_tiles_replayed_as_memmoves_copy_every_span_byte_once_in_order(align):
    rng = np.random.default_rng(align)
    half = 1 << 16
    lens = rng.integers(0, 700, 40) // align * align
    lens[[3, 17]] = 0  # zero-length spans vanish
    lens[[5, 30]] = [5 * 64 + align, 3 * 64]  # longer than a tile: cut
    src = rng.permutation(half // 1024)[:40] * 1024 + align  # disjoint, `align`-aligned
    dst = half + rng.permutation(half // 1024)[:40] * 1024
    word, tiles = plan_tiles(src, dst, lens, tile_bytes=64)
    assert word == align and tiles.dtype == np.int64 and tiles.shape[1] == 3
    assert (tiles[:, 2] > 0).all() and (tiles[:, 2] * word <= 64).all()
    assert len(tiles) == int(sum(-(-n // 64) for n in lens))
    # every byte exactly once, span after span, on both sides
    np.testing.assert_array_equal(_bytes_of(tiles[:, 0], tiles[:, 2] * word), _bytes_of(src, lens))
    np.testing.assert_array_equal(_bytes_of(tiles[:, 1], tiles[:, 2] * word), _bytes_of(dst, lens))

    memory = np.zeros(2 * half, dtype=np.uint8)
    memory[:half] = rng.integers(1, 256, half, dtype=np.uint8)
    want = memory.copy()
    for s, d, n in zip(src, dst, lens):
        want[d : d + n] = memory[s : s + n]
    for s, d, w in tiles:  # what the kernel does, program by program
        memory[d : d + w * word] = memory[s : s + w * word]
    np.testing.assert_array_equal(memory, want)


def test_long_span_cut_at_tile_bytes_with_exact_tiles():
    word, tiles = plan_tiles([4096], [65536], [10 * 1024 + 512], tile_bytes=4096)
    assert word == 8
    np.testing.assert_array_equal(tiles, [[4096, 65536, 512], [8192, 69632, 512], [12288, 73728, 320]])
    word, tiles = plan_tiles([0], [1000], [20], tile_bytes=8)  # 1000 and 20: 4-byte words
    assert word == 4
    np.testing.assert_array_equal(tiles, [[0, 1000, 2], [8, 1008, 2], [16, 1016, 1]])


def test_zero_length_spans_vanish():
    word, tiles = plan_tiles([0, 64, 128], [1024, 2048, 4096], [0, 16, 0], tile_bytes=64)
    np.testing.assert_array_equal(tiles, [[64, 2048, 2]])
    _, none = plan_tiles([8, 16], [32, 48], [0, 0])
    assert none.shape == (0, 3)


@pytest.mark.parametrize("src, dst, lens, want", [
    ([0, 4096], [8192, 16], [256, 4096], 8),  # all 8-aligned (16-aligned too: still 8)
    ([0, 4096], [8192, 16], [256, 4095], 1),  # one odd length
    ([0, 4100], [8192, 16], [256, 4096], 4),  # 4-aligned
    ([2, 4096], [8192, 16], [256, 4096], 2),
])
def test_word_is_widest_power_of_two_up_to_8_dividing_everything(src, dst, lens, want):
    assert word_size(np.array(src), np.array(dst), np.array(lens)) == want
    assert plan_tiles(src, dst, lens)[0] == want


def test_malformed_batches_raise_value_error():
    with pytest.raises(ValueError, match="pair up"):
        plan_tiles([0, 8], [64], [8, 8])
    with pytest.raises(ValueError, match="negative"):
        plan_tiles([0, 8], [64, 72], [8, -8])
    with pytest.raises(ValueError, match="multiple"):
        plan_tiles([0], [64], [64], tile_bytes=12)  # 8-byte words
    with pytest.raises(ValueError, match="multiple"):
        plan_tiles([0], [64], [64], tile_bytes=20, word=8)


# -- destination bounds --------------------------------------------------------------------------------------

BASES = [0x7000_0000, 0x9000_0000]  # where the two allocations are mapped in this process
# registration order (not address order); r0 and r2 are adjacent in the decode and share allocation 0
REGIONS = [IpcRegion(ptr=0x10000, alloc=0, offset=0, length=0x1000),
           IpcRegion(ptr=0x20000, alloc=1, offset=0x100, length=0x800),
           IpcRegion(ptr=0x11000, alloc=0, offset=0x1000, length=0x400)]


def test_spans_inside_a_region_map_to_its_mapped_base_plus_offset():
    table = RegionTable.build(REGIONS, BASES)
    got = table.translate(np.array([0x10010, 0x20100, 0x11000, 0x207F8]), np.array([0x10, 0x700, 0x400, 8]))
    np.testing.assert_array_equal(got, [0x7000_0010, 0x9000_0200, 0x7000_1000, 0x9000_08F8])
    assert table.translate(np.zeros(0, np.int64), np.zeros(0, np.int64)).size == 0


@pytest.mark.parametrize("bad, length", [
    (0x10FF8, 16),  # crosses r0's end, although r2 follows it in the decode: one region per span
    (0x11300, 0x200),  # crosses the end of r2
    (0xFFF0, 8),  # before the first region
    (0x18000, 8),  # in the gap between r2 and r1
    (0x20800, 1),  # just past the last region
    (0x10100, -8),  # negative length
])
def test_spans_outside_every_region_are_refused_naming_the_address(bad, length):
    table = RegionTable.build(REGIONS, BASES)
    dst = np.array([0x10000, bad, 0x18008])  # the first bad span is named, the good one first changes nothing
    with pytest.raises(TransportError, match=re.escape(f"{bad:#x}")) as e:
        table.translate(dst, np.array([8, length, 8]))
    assert f"{0x18008:#x}" not in str(e.value)


def _export(regions=REGIONS, sizes=(0x1400, 0x1000)) -> IpcExport:
    return IpcExport(device_uuid="GPU-x", boot_id="b", pid=1, handles=[b"\1" * 64, b"\2" * 64],
                     alloc_sizes=list(sizes), regions=list(regions))


def test_check_export_names_what_does_not_match_the_registration():
    want = [(r.ptr, r.length) for r in REGIONS]
    assert check_export(_export(), want) is None
    assert check_export(_export(), [(p, n - 8) for p, n in want]) is None  # the export may be longer
    assert check_export(_export(), want[:2]) == "the export has 3 regions, the registration 2"
    short = check_export(_export(), [want[0], (0x20000, 0x801), want[2]])
    assert short is not None and "0x20000+2048" in short and "0x20000+2049" in short
    moved = check_export(_export(), [want[0], (0x20008, 8), want[2]])
    assert moved is not None and "registered 0x20008+8" in moved
    outside = check_export(_export(sizes=(0x1400, 0x800)), want)  # r1 ends at 0x900 of its 0x800 allocation
    assert outside == "exported region 0x20000 lies outside its allocation"
    no_alloc = [REGIONS[0], IpcRegion(ptr=0x20000, alloc=2, offset=0, length=0x800), REGIONS[2]]
    assert check_export(_export(regions=no_alloc), want) == "exported region 0x20000 lies outside its allocation"


def test_cuda_handles_keep_all_64_bytes_nul_bytes_included():
    """A CUDA IPC handle is 64 opaque bytes with NULs in them; a char-string copy would truncate it."""
    handle = bytes(range(64))[::-1]  # NUL at the end
    handle = handle[:10] + b"\0" + handle[11:]  # and one inside
    seen = {}

    class FakeRuntime:
        def cudaIpcGetMemHandle(self, out, base):
            ctypes.memmove(ctypes.addressof(out._obj), handle, 64)
            return 0

        def cudaIpcOpenMemHandle(self, out, h, flags):
            seen["handle"] = ctypes.string_at(ctypes.addressof(h), 64)
            out._obj.value = 0x1000
            return 0

    lib = CudaBackend()
    lib._rt, lib._drv = FakeRuntime(), object()
    assert lib.get_handle(0x7000_0000) == handle
    assert lib.open_handle(handle, -1) == 0x1000  # device -1: no CUDA call on this CPU host
    assert seen["handle"] == handle


def test_default_grid_keeps_about_8_kib_in_flight_an_sm():
    """One program an SM for 8 KiB loop steps (MHA page 16: 32 KiB pages, MLA page 64: 72 KiB), 4 an SM for MHA
    page 1 (2 KiB pages, a 256-thread block of 8-byte words), never more than 8 nor fewer than 1 an SM."""
    h100 = 132
    assert default_programs(h100, 1024 * 8) == 132
    assert default_programs(h100, 256 * 8) == 528
    assert default_programs(h100, 16 * 8) == 8 * 132  # tiny items: the old bound
    assert default_programs(h100, 64 * 1024) == 132  # steps above 8 KiB: still one an SM
    assert default_programs(h100, 0) == 8 * 132
