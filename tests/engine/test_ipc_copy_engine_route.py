"""The same-host transport's copy-engine route (SGLANG_P2P_COPY_ENGINE) with the shared-memory stand-in of CUDA
IPC: `off` keeps the page kernel's call (the default, unchanged), `on` hands the checked, coalesced spans to the
copy engines, `auto` follows ce_plan's rule per chunk; the bytes land either way and nothing else changes. What
the CUDA calls do runs in tests/gpu/test_copy_engine.py. Also the page kernel's grid bound
(SGLANG_P2P_IPC_PROGRAMS): parsed with the other knobs and handed to every page write of the transport."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.config import ConfigError, EngineConfig
from sglang_p2p_backend.engine.copy import ce_plan
from sglang_p2p_backend.engine.transport import cuda_ipc
from sglang_p2p_backend.engine.transport.base import TransportError
from support.shm_ipc import ShmBackend
from support.knobs import config_with

ITEM, REGIONS, PAGES = 64, 3, 20


class RecordingShm(ShmBackend):
    """The stand-in, noting which copy each write took."""

    def __init__(self, batched: bool = True):
        super().__init__()
        self.calls: list[tuple] = []
        self.programs: list = []  # the grid bound each page write was given
        self.batched = batched

    def write_pages(self, device, src_bases, dst_bases, item_bytes, src_ids, dst_ids, max_programs=None):
        self.calls.append(("pages", len(src_ids)))
        self.programs.append(max_programs)
        super().write_pages(device, src_bases, dst_bases, item_bytes, src_ids, dst_ids, max_programs)

    def copy_engines_batched(self):
        return self.batched

    def write_copy_engines(self, device, src, dst, lens):
        self.calls.append(("copy_engines", src.tolist(), dst.tolist(), lens.tolist()))
        super().write_copy_engines(device, src, dst, lens)


@pytest.fixture
def shm():
    backend = RecordingShm()
    cuda_ipc.use_backend(backend)
    yield backend
    cuda_ipc.use_backend(None)
    backend.close()


def _pair(shm, mode, back_to_back=False, programs=None):
    """A decode pool of REGIONS regions in one segment (back to back when asked, else with a gap of one page
    between regions), mapped by a prefill transport in `mode` (its page kernel's grid bound `programs`)."""
    stride = PAGES * ITEM if back_to_back else (PAGES + 1) * ITEM
    dst_pool = shm.allocate(REGIONS * stride)
    dst_pool.zero_()
    src_pool = torch.arange(REGIONS * stride, dtype=torch.int64).remainder(251).to(torch.uint8) + 1
    dst_regions = [(dst_pool.data_ptr() + r * stride, PAGES * ITEM) for r in range(REGIONS)]
    decode = cuda_ipc.CudaIpcTransport(torch.device("cpu"))
    decode.register(dst_regions)
    prefill = cuda_ipc.CudaIpcTransport(torch.device("cpu"), mode, programs)
    prefill.open_peer("d", decode.export)
    src_bases = [src_pool.data_ptr() + r * stride for r in range(REGIONS)]
    return prefill, src_pool, dst_pool, src_bases, [p for p, _ in dst_regions], stride


def _mapped(tr, addr: int) -> int:
    """Where the prefill's mapping of the decode's segment puts decode address `addr` (what a copy writes to)."""
    return int(tr._peers["d"].table.translate(np.array([addr]), np.array([1]))[0])  # noqa: SLF001


def _check(src_pool, dst_pool, stride, src_ids, dst_ids):
    s, d = src_pool.numpy(), dst_pool.numpy()
    written = np.zeros(d.size, dtype=bool)
    for r in range(REGIONS):
        for a, b in zip(src_ids, dst_ids):
            lo_s, lo_d = r * stride + a * ITEM, r * stride + b * ITEM
            assert d[lo_d:lo_d + ITEM].tolist() == s[lo_s:lo_s + ITEM].tolist()
            written[lo_d:lo_d + ITEM] = True
    assert not d[~written].any()


def test_off_keeps_the_page_kernel_call(shm):
    tr, sp, dp, sb, db, stride = _pair(shm, "off")
    src_ids, dst_ids = np.array([0, 1, 2]), np.array([5, 6, 7])
    assert tr.write_pages("d", sb, db, [ITEM] * REGIONS, src_ids, dst_ids, PAGES, PAGES) == 3 * REGIONS * ITEM
    assert shm.calls == [("pages", 3)]
    _check(sp, dp, stride, src_ids, dst_ids)
    tr.close()


def test_on_sends_coalesced_runs_of_every_region_to_the_copy_engines(shm):
    tr, sp, dp, sb, db, stride = _pair(shm, "on")
    src_ids, dst_ids = np.array([0, 1, 2, 9]), np.array([5, 6, 7, 0])
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, src_ids, dst_ids, PAGES, PAGES)
    base_d = _mapped(tr, dp.data_ptr())
    assert shm.calls == [("copy_engines",
                          [sb[0], sb[0] + 9 * ITEM, sb[1], sb[1] + 9 * ITEM, sb[2], sb[2] + 9 * ITEM],
                          [base_d + 5 * ITEM, base_d, base_d + stride + 5 * ITEM, base_d + stride,
                           base_d + 2 * stride + 5 * ITEM, base_d + 2 * stride],
                          [3 * ITEM, ITEM] * REGIONS)]
    _check(sp, dp, stride, src_ids, dst_ids)
    tr.close()


def test_on_joins_regions_that_lie_back_to_back_into_one_span(shm):
    tr, sp, dp, sb, db, stride = _pair(shm, "on", back_to_back=True)
    ids = np.arange(PAGES)
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, ids, ids, PAGES, PAGES)
    assert shm.calls == [("copy_engines", [sb[0]], [_mapped(tr, dp.data_ptr())], [REGIONS * PAGES * ITEM])]
    _check(sp, dp, stride, ids, ids)
    tr.close()


def test_auto_takes_the_kernel_for_short_spans_and_the_copy_engines_for_long_ones(shm, monkeypatch):
    tr, sp, dp, sb, db, stride = _pair(shm, "auto")
    tr._peers["d"].same_gpu = False  # noqa: SLF001 - the stand-in's segments all live on one "device"
    # with the shipped thresholds 64-byte pages are far below the mean span: the kernel
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([0, 1]), np.array([3, 4]), PAGES, PAGES)
    assert shm.calls == [("pages", 2)]
    # a threshold this chunk meets (3 spans of 2 pages): the copy engines
    monkeypatch.setattr(ce_plan, "CE_MIN_MEAN_SPAN_BYTES", 2 * ITEM)
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([10, 11]), np.array([12, 13]), PAGES, PAGES)
    assert [c[0] for c in shm.calls] == ["pages", "copy_engines"]
    # the same chunk into a decode on the prefill's own GPU: that threshold is the same-GPU one, not met
    tr._peers["d"].same_gpu = True  # noqa: SLF001
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([18, 19]), np.array([18, 19]), PAGES, PAGES)
    assert [c[0] for c in shm.calls] == ["pages", "copy_engines", "pages"]
    tr._peers["d"].same_gpu = False  # noqa: SLF001
    # not batched (CUDA < 12.8): the span limit is CE_MAX_SPANS_UNBATCHED
    shm.batched = False
    monkeypatch.setattr(ce_plan, "CE_MAX_SPANS_UNBATCHED", 2)
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([14, 15]), np.array([16, 17]), PAGES, PAGES)
    assert [c[0] for c in shm.calls] == ["pages", "copy_engines", "pages", "pages"]
    _check(sp, dp, stride, [0, 1, 10, 11, 18, 19, 14, 15], [3, 4, 12, 13, 18, 19, 16, 17])
    tr.close()


def test_spans_go_to_the_copy_engines_after_the_export_check(shm):
    tr, sp, dp, sb, db, stride = _pair(shm, "on")
    a, b = dp.data_ptr(), sp.data_ptr()
    # two spans that continue each other on both sides become one
    assert tr.write("d", [b, b + 32], [a + 64, a + 96], [32, 32]) == 64
    assert shm.calls == [("copy_engines", [b], [_mapped(tr, a) + 64], [64])]
    with pytest.raises(TransportError, match="outside every region the decode exported"):
        tr.write("d", [b], [a + PAGES * ITEM], [8])  # the gap after region 0 was not exported
    assert len(shm.calls) == 1
    tr.close()


def test_the_knob_is_read_once_and_checked(monkeypatch):
    monkeypatch.delenv("SGLANG_P2P_COPY_ENGINE", raising=False)
    assert EngineConfig.from_env().copy_engine == "split"  # the default since session 32's serving runs
    monkeypatch.setenv("SGLANG_P2P_COPY_ENGINE", " Off ")
    assert EngineConfig.from_env().copy_engine == "off"
    monkeypatch.setenv("SGLANG_P2P_COPY_ENGINE", "yes")
    with pytest.raises(ConfigError, match=r"SGLANG_P2P_COPY_ENGINE='yes' is not one of split, auto, off, on"):
        EngineConfig.from_env()


def test_auto_thresholds_from_the_knobs_reach_the_transport(shm):
    """The 2-page chunk of 64-byte pages that the shipped thresholds keep on the kernel goes to the copy engines
    with a 128-byte mean span, and back to the kernel with a cap of 2 spans (it has 3, one a region)."""
    tr, sp, dp, sb, db, stride = _pair(shm, "auto")
    tr.ce_min_span = 2 * ITEM
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([0, 1]), np.array([3, 4]), PAGES, PAGES)
    tr.ce_max_spans = 2
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([10, 11]), np.array([12, 13]), PAGES, PAGES)
    assert [c[0] for c in shm.calls] == ["copy_engines", "pages"]
    _check(sp, dp, stride, [0, 1, 10, 11], [3, 4, 12, 13])
    tr.close()


@pytest.mark.parametrize("name, attr, raw, want", [
    ("SGLANG_P2P_CE_MIN_SPAN_KIB", "ce_min_span_bytes", None, None),
    ("SGLANG_P2P_CE_MIN_SPAN_KIB", "ce_min_span_bytes", "1024", 1 << 20),
    ("SGLANG_P2P_CE_MAX_SPANS", "ce_max_spans", None, None),
    ("SGLANG_P2P_CE_MAX_SPANS", "ce_max_spans", " 256 ", 256),
])
def test_the_threshold_knobs_are_read_once_unset_being_the_shipped_rule(monkeypatch, name, attr, raw, want):
    assert getattr(config_with(monkeypatch, name, raw), attr) == want


@pytest.mark.parametrize("name", ["SGLANG_P2P_CE_MIN_SPAN_KIB", "SGLANG_P2P_CE_MAX_SPANS"])
@pytest.mark.parametrize("raw, why", [("0", "must be positive"), ("1.5", "is not a whole number")])
def test_the_threshold_knobs_refuse_anything_but_a_count_naming_it(monkeypatch, name, raw, why):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError, match=re.escape(f"{name}={raw!r} {why}")):
        EngineConfig.from_env()


@pytest.mark.parametrize("raw, want", [(None, None), ("", None), ("1", 1), ("132", 132), (" 66 ", 66)])
def test_the_programs_knob_is_read_once_unset_being_the_default_grid(monkeypatch, raw, want):
    assert config_with(monkeypatch, "SGLANG_P2P_IPC_PROGRAMS", raw).ipc_programs == want


@pytest.mark.parametrize("raw, why", [("0", "must be positive"), ("-8", "must be positive"),
                                      ("many", "is not a whole number"), ("1.5", "is not a whole number")])
def test_the_programs_knob_refuses_anything_but_a_count_naming_it(monkeypatch, raw, why):
    monkeypatch.setenv("SGLANG_P2P_IPC_PROGRAMS", raw)
    with pytest.raises(ConfigError, match=re.escape(f"SGLANG_P2P_IPC_PROGRAMS={raw!r} {why}")):
        EngineConfig.from_env()


@pytest.mark.parametrize("programs", [None, 32])
def test_the_programs_bound_reaches_every_page_write_and_the_bytes_land(shm, programs):
    tr, sp, dp, sb, db, stride = _pair(shm, "off", programs=programs)
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([0, 1]), np.array([3, 4]), PAGES, PAGES)
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([7]), np.array([9]), PAGES, PAGES)
    assert shm.calls == [("pages", 2), ("pages", 1)] and shm.programs == [programs, programs]
    _check(sp, dp, stride, [0, 1, 7], [3, 4, 9])
    tr.close()


@pytest.mark.parametrize("programs, same_gpu, item, want", [
    (None, True, 2048, 16 * 132),  # MHA at page 1: 2 KiB steps, 32 KiB in flight an SM at the upper bound
    (None, True, 4096, 8 * 132),
    (None, True, 32768, 4 * 132),  # MHA at page 16: 8 KiB steps, 32 KiB in flight at 4 an SM
    (None, True, 73728, 4 * 132),  # MLA at page 64
    (None, False, 2048, None), (32, True, 2048, 32), (32, False, 2048, 32)])
def test_a_decode_on_the_same_gpu_keeps_the_wider_grid(shm, monkeypatch, programs, same_gpu, item, want):
    """Across GPUs the kernel's own default (about 8 KiB in flight an SM) bounds the grid; into the prefill's own
    GPU, about 32 KiB in flight an SM within 4-16 programs an SM (as fast there as more, for small and large pages,
    with fewer SMs held from a forward pass beside it); SGLANG_P2P_IPC_PROGRAMS wins either way."""
    tr, *_ = _pair(shm, "off", programs=programs)
    tr._peers["d"].same_gpu = same_gpu  # noqa: SLF001 - the stand-in's segments all live on one "device"
    tr.device = torch.device("cuda", 0)  # where the prefill's pool would be
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 132}))
    assert tr._grid(tr._same_gpu("d"), [item, item // 2]) == want  # noqa: SLF001 - the largest page sets the step
    # an unmapped peer: its write fails before any grid matters
    assert tr._grid(tr._same_gpu("nobody"), [item]) == programs  # noqa: SLF001
    tr.device = torch.device("cpu")
    tr.close()


def test_the_same_gpu_grid_follows_the_kernel_step():
    """The step is the largest page rounded up to a power of two, at most 8 KiB; the programs an SM keep about
    32 KiB in flight, never fewer than 4 or more than 16."""
    assert [cuda_ipc.same_gpu_programs_per_sm([b]) for b in (1, 64, 2048, 3000, 4096, 5000, 8192, 1 << 20)] == \
        [16, 16, 16, 8, 8, 4, 4, 4]
    assert cuda_ipc.same_gpu_programs_per_sm([]) == 16


def test_each_route_is_logged_at_its_first_use_only(shm, caplog):
    """What e2e/shape_serve.py collects: one line when auto first takes the kernel, one when it first takes the
    copy engines, none after."""
    tr, sp, dp, sb, db, stride = _pair(shm, "auto")
    with caplog.at_level("INFO", logger=cuda_ipc.__name__):
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([0, 1]), np.array([3, 4]), PAGES, PAGES)
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([5]), np.array([6]), PAGES, PAGES)
        tr.ce_min_span = ITEM
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([7, 8]), np.array([9, 10]), PAGES, PAGES)
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([11]), np.array([12]), PAGES, PAGES)
    lines = [r.getMessage() for r in caplog.records if cuda_ipc.ROUTE_LOG in r.getMessage()]
    assert [line.split(" from now on")[0] for line in lines] == [
        f"{cuda_ipc.ROUTE_LOG} SM copy kernel", f"{cuda_ipc.ROUTE_LOG} copy engines"]
    assert "(first: 3 spans, 384 bytes)" in lines[1]
    tr.close()


def test_a_route_summary_counts_the_chunks_each_route_took(shm, caplog):
    """Beside the first-use lines, the tally's summary (here due at every chunk) says how many chunks and bytes
    went each way, so a serving run's log shows the share, not only that a route was taken."""
    from sglang_p2p_backend.engine.transport.route_tally import RouteTally

    tr, sp, dp, sb, db, stride = _pair(shm, "auto")
    tr._route_tally = RouteTally(cuda_ipc.ROUTE_LOG, every_s=0.0)  # noqa: SLF001
    with caplog.at_level("INFO", logger=cuda_ipc.__name__):
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([0, 1]), np.array([3, 4]), PAGES, PAGES)
        tr.ce_min_span = ITEM
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([7, 8]), np.array([9, 10]), PAGES, PAGES)
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([11]), np.array([12]), PAGES, PAGES)
        tr.ce_max_spans = REGIONS - 1  # a chunk has a span a region at least: over the cap before its runs are looked for
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([13]), np.array([14]), PAGES, PAGES)
    lines = [r.getMessage() for r in caplog.records if "routes so far" in r.getMessage()]
    assert lines[-1] == (f"{cuda_ipc.ROUTE_LOG} routes so far: copy engines 2 chunks (0.00 GiB), "
                         "SM copy kernel 2 chunks (0.00 GiB; 1 for short spans; 1 over the span cap)")
    assert all(line.startswith(cuda_ipc.ROUTE_LOG) for line in lines)  # e2e/shape_serve.py keeps them
    tr.close()


def test_runs_are_looked_for_only_where_the_copy_engines_could_take_the_chunk(shm, monkeypatch):
    """A chunk has at least one span a region: where that many already leave it on the kernel, `auto` does not
    look for its page runs (after the kernel's first use, which is logged with the exact spans), and every chunk
    takes the route the full rule gives it (`choose` of `page_chunk_shape`), counted in the tally."""
    from sglang_p2p_backend.engine.copy import plan

    tr, sp, dp, sb, db, stride = _pair(shm, "auto")
    tr._peers["d"].same_gpu = False  # noqa: SLF001
    looked = []
    real = cuda_ipc.run_breaks
    monkeypatch.setattr(cuda_ipc, "run_breaks", lambda s, d: (looked.append(len(s)), real(s, d))[1])
    tr.ce_min_span = 3 * ITEM  # a region's share must be 3 pages: 2-page chunks can never reach it
    free = list(np.random.default_rng(5).permutation(np.setdiff1d(np.arange(PAGES), np.arange(10, 16))))
    chunks = [(np.array([4, 9]), 2), (np.array([1, 2]), 2), (np.arange(6), np.arange(10, 16)), (np.array([7]), 1),
              (np.array([3, 0, 5, 8, 1, 6]), 6), (np.array([2, 3]), 2)]
    want, written = [], ([], [])
    for src, dst in chunks:
        if isinstance(dst, int):  # that many destination pages nobody else writes, in random order
            dst, free = np.array(free[:dst]), free[dst:]
        spans, nbytes = ce_plan.page_chunk_shape(src, dst, [ITEM] * REGIONS, plan.run_breaks(src, dst))
        want.append("copy_engines" if ce_plan.choose("auto", spans, nbytes, True, 3 * ITEM) == ce_plan.COPY_ENGINE
                    else "pages")
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, src, dst, PAGES, PAGES)
        written[0].extend(src.tolist())
        written[1].extend(dst.tolist())
    assert [c[0] for c in shm.calls] == want
    assert want == ["pages", "pages", "copy_engines", "pages", "pages", "pages"]
    # runs looked for: the first chunk (the kernel's first use) and the two chunks of 3 pages or more
    assert looked == [2, 6, 6]
    counts = tr._route_tally._counts  # noqa: SLF001
    assert {r: c[0] for r, c in counts.items()} == {ce_plan.KERNEL: 5, ce_plan.COPY_ENGINE: 1}
    _check(sp, dp, stride, written[0], written[1])
    tr.close()


def test_split_sends_a_chunks_long_runs_to_the_copy_engines_and_its_short_ones_to_the_kernel(shm, caplog):
    """SGLANG_P2P_COPY_ENGINE=split: one write, the kernel taking the single pages and the copy engines the run of
    six (at a 4-page span threshold), each counted on its route; every byte lands and nothing else changes."""
    from sglang_p2p_backend.engine.transport.route_tally import RouteTally

    tr, sp, dp, sb, db, stride = _pair(shm, "split")
    tr._route_tally = RouteTally(cuda_ipc.ROUTE_LOG, every_s=0.0)  # noqa: SLF001
    tr.ce_min_span = 4 * ITEM
    src_ids = np.array([0, 3, 4, 5, 6, 7, 8, 12])  # runs of 1, 6 and 1 pages
    dst_ids = np.array([19, 2, 3, 4, 5, 6, 7, 15])
    with caplog.at_level("INFO", logger=cuda_ipc.__name__):
        assert tr.write_pages("d", sb, db, [ITEM] * REGIONS, src_ids, dst_ids, PAGES, PAGES) == 8 * REGIONS * ITEM
        # a chunk of short runs only: the kernel alone; one long run only: the copy engines alone
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.array([16]), np.array([0]), PAGES, PAGES)
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, np.arange(13, 17) - 4, np.arange(8, 12), PAGES, PAGES)
    base_d = _mapped(tr, dp.data_ptr())
    assert shm.calls[0] == ("pages", 2)
    assert shm.calls[1] == ("copy_engines", [sb[r] + 3 * ITEM for r in range(REGIONS)],
                            [base_d + r * stride + 2 * ITEM for r in range(REGIONS)], [6 * ITEM] * REGIONS)
    assert [c[0] for c in shm.calls[2:]] == ["pages", "copy_engines"]
    _check(sp, dp, stride, [*src_ids, 16, 9, 10, 11, 12], [*dst_ids, 0, 8, 9, 10, 11])
    lines = [r.getMessage() for r in caplog.records if "routes so far" in r.getMessage()]
    assert lines[-1] == (f"{cuda_ipc.ROUTE_LOG} routes so far: copy engines 2 chunks (0.00 GiB), "
                         "SM copy kernel 2 chunks (0.00 GiB; 2 for short spans)")
    tr.close()


def test_split_looks_for_runs_only_where_one_could_reach_the_threshold(shm, monkeypatch, caplog):
    """`split` (the default) builds a chunk's runs only where one could reach the span threshold: not for a chunk
    too short to hold one (a 128-token request pays no search after the kernel's first use, as under `auto`), nor
    for one whose longest run is short (its breaks only). Every chunk still takes the route split_runs gives it,
    its bytes land, and the kernel's first use is logged with the chunk's exact spans."""
    looked = []
    real = ce_plan.page_runs
    monkeypatch.setattr(ce_plan, "page_runs", lambda s, d, *a: (looked.append(len(s)), real(s, d, *a))[1])
    tr, sp, dp, sb, db, stride = _pair(shm, cuda_ipc.COPY_ENGINE_MODES[0])
    assert tr.copy_engine == "split"
    tr.ce_min_span = 3 * ITEM  # a run must hold 3 pages: 2-page chunks can never have one
    chunks = [(np.array([4, 9]), np.array([0, 1])), (np.array([1, 2]), np.array([3, 4])),
              (np.array([5, 6, 7, 12]), np.array([10, 11, 12, 19])), (np.array([0, 3]), np.array([6, 8])),
              (np.array([13, 14, 15, 16]), np.array([13, 15, 17, 18]))]  # 4 pages, no run of 3
    with caplog.at_level("INFO", logger=cuda_ipc.__name__):
        for src, dst in chunks:
            tr.write_pages("d", sb, db, [ITEM] * REGIONS, src, dst, PAGES, PAGES)
    first = [r.getMessage() for r in caplog.records if "SM copy kernel from now on" in r.getMessage()]
    assert first == [f"{cuda_ipc.ROUTE_LOG} SM copy kernel from now on where SGLANG_P2P_COPY_ENGINE=split picks it "
                     f"(first: {2 * REGIONS} spans, {2 * REGIONS * ITEM} bytes)"]  # two runs of one page
    # runs built only for the 4-page chunk with a run of 3, which went to the copy engines beside the kernel's
    # single page; the first chunk (the kernel's first use, logged with exact spans) and the last 4-page chunk,
    # whose longest run is 2, need their breaks only
    assert looked == [4]
    assert [c[0] for c in shm.calls] == ["pages", "pages", "pages", "copy_engines", "pages", "pages"]
    assert shm.calls[2] == ("pages", 1) and shm.calls[-1] == ("pages", 4)
    _check(sp, dp, stride, [4, 9, 1, 2, 5, 6, 7, 12, 0, 3, 13, 14, 15, 16],
           [0, 1, 3, 4, 10, 11, 12, 19, 6, 8, 13, 15, 17, 18])
    counts = tr._route_tally._counts  # noqa: SLF001
    assert {r: c[0] for r, c in counts.items()} == {ce_plan.KERNEL: 5, ce_plan.COPY_ENGINE: 1}
    tr.close()


@pytest.mark.parametrize("mode, alone_route", [("split", "pages"), ("auto", "pages"), ("on", "copy_engines"),
                                               ("off", "pages")])
def test_a_chunk_alone_on_the_gpu_goes_whole_to_the_kernel_under_split_and_auto(shm, caplog, monkeypatch, mode,
                                                                               alone_route):
    """`alone` (the last chunk of the only request on the prefill rank), into another GPU: `split` and `auto` give
    it whole to the kernel, counted so, where their rule gives the same chunk to the copy engines; `on` and `off`
    are the user's word and stay as they are. The bytes land either way."""
    from sglang_p2p_backend.engine.transport.route_tally import RouteTally

    tr, sp, dp, sb, db, stride = _pair(shm, mode)
    monkeypatch.setattr(tr, "_same_gpu", lambda session: False)  # the stand-in's pools count as one GPU
    tr._route_tally = RouteTally(cuda_ipc.ROUTE_LOG, every_s=0.0)  # noqa: SLF001
    tr.ce_min_span, tr.ce_max_spans = ITEM, 64  # any run would take the copy engines by the rule
    ids = np.arange(6)
    with caplog.at_level("INFO", logger=cuda_ipc.__name__):
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, ids, ids + 10, PAGES, PAGES, alone=True)
        tr.write_pages("d", sb, db, [ITEM] * REGIONS, ids + 6, ids + 4, PAGES, PAGES)
    rule_route = "pages" if mode == "off" else "copy_engines"
    assert [c[0] for c in shm.calls] == [alone_route, rule_route]
    _check(sp, dp, stride, [*range(12)], [*range(10, 16), *range(4, 10)])
    lines = [r.getMessage() for r in caplog.records if "routes so far" in r.getMessage()]
    if mode in ("split", "auto"):
        assert lines[-1] == (f"{cuda_ipc.ROUTE_LOG} routes so far: copy engines 1 chunks (0.00 GiB), "
                             "SM copy kernel 1 chunks (0.00 GiB; 1 alone on the GPU)")
        # the kernel's first line gives the chunk's exact spans: one run a region
        first = [r.getMessage() for r in caplog.records if "SM copy kernel from now on" in r.getMessage()]
        assert first and first[0].endswith(f"(first: {REGIONS} spans, {6 * REGIONS * ITEM} bytes)")
    tr.close()


def test_a_chunk_alone_into_its_own_gpu_is_routed_by_the_rule(shm):
    """A decode on the prefill's own GPU may run its steps on the SMs a kernel would take: `alone` changes nothing
    there."""
    tr, sp, dp, sb, db, stride = _pair(shm, "split")
    assert tr._same_gpu("d")  # noqa: SLF001 - the stand-in's segments are one "GPU"
    tr.ce_min_span, tr.ce_max_spans = ITEM, 64
    ids = np.arange(6)
    tr.write_pages("d", sb, db, [ITEM] * REGIONS, ids, ids + 10, PAGES, PAGES, alone=True)
    assert [c[0] for c in shm.calls] == ["copy_engines"]
    _check(sp, dp, stride, ids, ids + 10)
    tr.close()
