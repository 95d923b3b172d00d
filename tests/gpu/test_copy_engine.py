"""The copy-engine path on real GPUs (SGLANG_P2P_COPY_ENGINE=on): the exact bytes that land.

1. `CopyEngines` over the libcudart torch loaded, in one process: scattered and contiguous spans on one GPU and
   from GPU 0 to GPU 1 (skipped on a one-GPU host), through cudaMemcpyBatchAsync where the runtime has it and
   through the one-cudaMemcpyAsync-per-span fallback; every byte of the destination is compared, written spans
   with their source and the rest with the fill they started with.
2. The same-host transport with `copy_engine="on"`, two processes: tests/gpu/test_cuda_ipc.py's scattered
   requests (MLA and MHA, pages 1/16/64, four chunks each, the first queued behind a slow fill of its sources, so a
   copy that does not wait for the forward pass ships stale bytes), the decode on the same GPU and on GPU 1;
   the decode checks every page.
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

from bench.transfer.pair import collect, spawn  # noqa: E402
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
