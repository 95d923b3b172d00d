"""The copy-engine path on real GPUs (SGLANG_P2P_COPY_ENGINE=on): the exact bytes that land.

1. `CopyEngines` over the libcudart torch loaded, in one process: scattered and contiguous spans on one GPU and
   from GPU 0 to GPU 1 (skipped on a one-GPU host), through cudaMemcpyBatchAsync where the runtime has it and
   through the one-cudaMemcpyAsync-per-span fallback; every byte of the destination is compared, written spans
   with their source and the rest with the fill they started with.
2. The same-host transport with `copy_engine="on"`, two processes: tests/gpu/test_cuda_ipc.py's scattered
   requests (MLA and MHA, pages 1/16/64, four chunks each, the first queued behind a slow fill of its sources, so a
   copy that does not wait for the forward pass ships stale bytes), the decode on the same GPU and on GPU 1;
   the decode checks every page.
3. Mapping three allocations of GPU 1 from GPU 0 leaves torch's next kernel working (two GPUs only).
4. `auto` on real GPUs: a contiguous MLA chunk of 2.25 MiB spans goes to the copy engines into GPU 1 and to the
   kernel into the prefill's own GPU (the peer's GPU as the transport detects it), a scattered one to the kernel;
   the decode checks every page. `split`: the same pages as one chunk, cut between the two in one write.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("msgspec")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.transfer.pair import collect, expect, guarded, spawn  # noqa: E402
from sglang_p2p_backend.engine.copy.copy_engine import CopyEngines  # noqa: E402
from sglang_p2p_backend.engine.transport.cuda_ipc import CudaBackend  # noqa: E402

import test_cuda_ipc as ipc  # noqa: E402  (tests/gpu is on sys.path, as for nccl_pair_workers)

NBYTES = 8 << 20


def _spans(rng, scattered: bool, item: int = 4096, n: int = 512):
    """(src offsets, dst offsets, lengths) of `n` items: pages in random order into random free slots, or one
    run moved whole."""
    if not scattered:
        return np.array([0]), np.array([item * 7]), np.array([item * n])
    slots = NBYTES // item
    src = rng.permutation(slots)[:n] * item
    dst = rng.permutation(slots)[:n] * item
    lens = rng.integers(1, item // 16 + 1, size=n) * 16  # lengths of 16 .. item bytes
    return src, dst, lens


@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("batched", [True, False], ids=["batch", "per-span"])
@pytest.mark.parametrize("dst_gpu", [0, 1], ids=["same-gpu", "cross-gpu"])
def test_copy_engines_land_exact_bytes(scattered, batched, dst_gpu):
    if dst_gpu >= torch.cuda.device_count():
        pytest.skip("needs a second GPU")
    ce = CopyEngines(CudaBackend().rt)
    print(f"REPORT copy engines: runtime {ce.runtime_version}, cudaMemcpyBatchAsync ABI {ce.abi}")
    if batched and ce.abi is None:
        pytest.skip(f"runtime {ce.runtime_version} has no cudaMemcpyBatchAsync")
    if not batched:
        ce.abi = None  # the fallback path, as on CUDA < 12.8
    src_dev, dst_dev = torch.device("cuda", 0), torch.device("cuda", dst_gpu)
    g = torch.Generator(device=src_dev).manual_seed(5)
    src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device=src_dev, generator=g)
    dst = torch.full((NBYTES,), 0x3C, dtype=torch.uint8, device=dst_dev)
    s, d, n = _spans(np.random.default_rng(11), scattered)
    torch.cuda.synchronize(src_dev)
    torch.cuda.synchronize(dst_dev)
    stream = torch.cuda.Stream(device=src_dev)
    with torch.cuda.device(src_dev):
        moved = ce.copy(s + src.data_ptr(), d + dst.data_ptr(), n, stream.cuda_stream)
    stream.synchronize()
    assert moved == int(n.sum())
    assert ce.batch_failed is None, ce.batch_failed
    want = np.full(NBYTES, 0x3C, dtype=np.uint8)
    host_src = src.cpu().numpy()
    for a, b, k in zip(s.tolist(), d.tolist(), n.tolist()):
        want[b:b + k] = host_src[a:a + k]
    got = dst.cpu().numpy()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ, first at offset {int(bad[0]) if bad.size else -1}"


def _run_pair(decode_gpu: int, timeout: float = 180.0):
    a, b = mp.get_context("spawn").Pipe()
    results = mp.get_context("spawn").Queue()
    procs = [spawn(ipc.prefill_cases, 0, 0, a, results, (ipc.CASES, "on"), None, dump_after=timeout - 10),
             spawn(ipc.decode_cases, 1, decode_gpu, b, results, (ipc.CASES,), None, dump_after=timeout - 10)]
    out = collect(procs, results, [0, 1], timeout=timeout)
    return out[0], out[1]


@pytest.fixture(scope="module", params=[0, 1], ids=["same-gpu", "cross-gpu"])
def ce_transfers(request):
    if request.param >= torch.cuda.device_count():
        pytest.skip("needs a second GPU")
    return _run_pair(request.param)


@pytest.mark.parametrize("layout, page_size", ipc.CASES)
def test_transport_on_copy_engines_lands_byte_exact(ce_transfers, layout, page_size):
    prefill, decode = ce_transfers[0][(layout, page_size)], ce_transfers[1][(layout, page_size)]
    assert prefill["page_chunks"] >= 2
    assert not decode["bad_written"], f"destination pages differ from their source: {decode['bad_written']}"
    assert not decode["nonzero_other"], f"pages nobody wrote changed: {decode['nonzero_other']}"
    refused = prefill["refused"]
    assert all(v is not None for v in refused.values()), f"writes outside the pools went through: {refused}"



REGION_BYTES = 64 << 20  # each its own cudaMalloc segment, as SGLang's per-layer pool tensors


def _export_regions(rank, conn, n):
    def body(conn, n):
        regions = [torch.full((REGION_BYTES,), i + 1, dtype=torch.uint8, device="cuda") for i in range(n)]
        torch.cuda.synchronize()
        be = CudaBackend()
        conn.send(("handles", [be.get_handle(be.allocation(t.data_ptr())[0]) for t in regions]))
        expect(conn, ("done",), 60)
        return [int(t[0].item()) for t in regions]
    return guarded(body, conn, n)


def _raw_opens(be: CudaBackend, handles: list, dev: torch.device) -> dict:
    """What the runtime itself leaves behind: each handle opened with the bare call, the thread's last error
    peeked after each, then a torch kernel (in a thread of its own: the last error is per thread)."""
    import ctypes

    from sglang_p2p_backend.engine.transport.cuda_ipc import _LAZY_ENABLE_PEER_ACCESS, _Handle

    out: dict = {"codes": [], "peeks": [], "torch": None}
    ptrs = []
    with torch.cuda.device(dev):
        for h in handles:
            p = ctypes.c_void_p()
            out["codes"].append(int(be.rt.cudaIpcOpenMemHandle(ctypes.byref(p), _Handle.of(h),
                                                               ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))))
            out["peeks"].append(int(be.rt.cudaPeekAtLastError()))
            ptrs.append(int(p.value or 0))
        try:
            out["torch"] = float(torch.ones(4, device=dev).sum().item())
        except Exception as e:  # noqa: BLE001 - the observation itself
            out["torch"] = f"{type(e).__name__}: {e}".splitlines()[0]
        be.rt.cudaGetLastError()
        for p in ptrs:
            be.close_handle(p, dev)
    return out


def _open_then_compute(rank, conn):
    def body(conn):
        import threading

        be, dev = CudaBackend(), torch.device("cuda", 0)
        (handles,) = expect(conn, ("handles",), 60)[1:]
        raw: dict = {}
        t = threading.Thread(target=lambda: raw.update(_raw_opens(be, handles, dev)))
        t.start()
        t.join()
        print(f"REPORT bare opens: {raw}", flush=True)
        ptrs = [be.open_handle(h, dev) for h in handles]  # the transport's own call, in this thread
        x = torch.arange(8, device=dev, dtype=torch.float32)  # a torch kernel in the thread that opened them
        total = float((x * 2).sum().item())
        for p in ptrs:
            be.close_handle(p, dev)
        conn.send(("done",))
        return {"opened": len(ptrs), "total": total, "raw": raw}
    return guarded(body, conn)


def test_opening_several_allocations_of_a_peer_gpu_leaves_torch_working():
    """Mapping several allocations of a peer GPU (one lazy peer enable each) leaves no CUDA error behind for
    torch's next kernel in the mapping thread. The transfer benchmark saw "peer access is already enabled"
    raised by a torch kernel after mapping a decode pool on 2 x H100; this is the transport's part of it, and the
    bare runtime calls' last errors are printed (REPORT) for the comparison."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    a, b = mp.get_context("spawn").Pipe()
    results = mp.get_context("spawn").Queue()
    procs = [spawn(_open_then_compute, 0, 0, a, results, (), None, dump_after=80),
             spawn(_export_regions, 1, 1, b, results, (3,), None, dump_after=80)]
    out = collect(procs, results, [0, 1], timeout=90)
    print(f"REPORT cudaIpcOpenMemHandle from GPU 0 of 3 GPU-1 allocations, bare: {out[0]['raw']}")
    assert {k: out[0][k] for k in ("opened", "total")} == {"opened": 3, "total": 56.0}
    assert out[1] == [1, 2, 3]


def _routed_prefill(rank, conn, seed: int, mode: str = "auto"):
    """Map the decode's MLA page-64 pool (72 KiB pages), write pages 0-31 to 100-131 (61 spans of 2.25 MiB) and
    40 scattered pages with SGLANG_P2P_COPY_ENGINE=`mode`: as two writes with `auto`, as one chunk with `split`;
    note the route each write took."""
    def body(conn, seed):
        from sglang_p2p_backend.engine.transport import cuda_ipc

        dev, layout, ps = ipc._device(), "mla", 64
        tr = cuda_ipc.CudaIpcTransport(dev, mode)
        blob, ptrs = ipc._recv(conn, "export")
        export = ipc.msgspec.msgpack.decode(blob, type=ipc.messages.IpcExport)
        tr.open_peer(ipc.SESSION, export)
        item = ipc._item(layout, ps)
        pool = ipc._alloc_pool(layout, ps, dev)
        for r, t in enumerate(pool):
            ipc._pages(t).copy_(ipc._truth(seed, r, item, dev))
        torch.cuda.synchronize(dev)
        routes = []
        real = cuda_ipc.backend()
        for name in ("write_pages", "write_copy_engines", "write_split"):  # note each call, then make it
            def noted(*a, _name=name, _call=getattr(real, name), **k):
                routes.append(_name)
                return _call(*a, **k)
            setattr(real, name, noted)
        bases = [t.data_ptr() for t in pool]
        rng = np.random.default_rng(seed)
        runs = (np.arange(32), np.arange(100, 132))
        scattered = (rng.permutation(np.arange(40, 100))[:40], rng.permutation(np.arange(140, 300))[:40])
        chunks = [runs, scattered] if mode == "auto" else [tuple(np.concatenate(x) for x in zip(runs, scattered))]
        for src, dst in chunks:
            tr.write_pages(ipc.SESSION, bases, ptrs, [item] * len(bases), src, dst, ipc.PAGES, ipc.PAGES)
        torch.cuda.synchronize(dev)
        tr.forget_peer(ipc.SESSION)
        conn.send(("written", np.concatenate([runs[0], scattered[0]]), np.concatenate([runs[1], scattered[1]]), seed))
        return {"routes": routes, "same_gpu": export.device_uuid == real.device_id(dev)}
    return guarded(body, conn, seed)


@pytest.mark.parametrize("decode_gpu", [0, 1], ids=["same-gpu", "cross-gpu"])
def test_auto_sends_long_runs_across_gpus_to_the_copy_engines_and_the_bytes_land(decode_gpu):
    if decode_gpu >= torch.cuda.device_count():
        pytest.skip("needs a second GPU")
    a, b = mp.get_context("spawn").Pipe()
    results = mp.get_context("spawn").Queue()
    procs = [spawn(_routed_prefill, 0, 0, a, results, (31,), None, dump_after=110),
             spawn(ipc.decode_cases, 1, decode_gpu, b, results, ([("mla", 64)],), None, dump_after=110)]
    out = collect(procs, results, [0, 1], timeout=120)
    prefill, decode = out[0], out[1][("mla", 64)]
    print(f"REPORT auto, decode on GPU {decode_gpu}: routes {prefill['routes']}")
    assert prefill["same_gpu"] == (decode_gpu == 0)
    want = ["write_pages", "write_pages"] if decode_gpu == 0 else ["write_copy_engines", "write_pages"]
    assert prefill["routes"] == want
    assert decode["pages"] == 72
    assert not decode["bad_written"], f"destination pages differ from their source: {decode['bad_written']}"
    assert not decode["nonzero_other"], f"pages nobody wrote changed: {decode['nonzero_other']}"


@pytest.mark.parametrize("decode_gpu", [0, 1], ids=["same-gpu", "cross-gpu"])
def test_split_cuts_one_chunk_between_the_copy_engines_and_the_kernel_and_the_bytes_land(decode_gpu):
    """SGLANG_P2P_COPY_ENGINE=split, the same pages as one chunk: into GPU 1 the 32-page run goes to the copy
    engines and the 40 single pages to the kernel in one write (`write_split`); into the prefill's own GPU the
    run's 2.25 MiB spans are under that destination's threshold, so the whole chunk takes the kernel."""
    if decode_gpu >= torch.cuda.device_count():
        pytest.skip("needs a second GPU")
    a, b = mp.get_context("spawn").Pipe()
    results = mp.get_context("spawn").Queue()
    procs = [spawn(_routed_prefill, 0, 0, a, results, (32, "split"), None, dump_after=110),
             spawn(ipc.decode_cases, 1, decode_gpu, b, results, ([("mla", 64)],), None, dump_after=110)]
    out = collect(procs, results, [0, 1], timeout=120)
    prefill, decode = out[0], out[1][("mla", 64)]
    print(f"REPORT split, decode on GPU {decode_gpu}: routes {prefill['routes']}")
    assert prefill["routes"] == (["write_pages"] if decode_gpu == 0 else ["write_split"])
    assert decode["pages"] == 72
    assert not decode["bad_written"], f"destination pages differ from their source: {decode['bad_written']}"
    assert not decode["nonzero_other"], f"pages nobody wrote changed: {decode['nonzero_other']}"
