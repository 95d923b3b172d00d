"""The CUDA IPC transport for real, on ONE GPU with two processes (a process cannot open its own handle).

A "decode" process allocates its KV pool with torch (one tensor per layer region, zeroed), exports it with
`export_regions` and sends the msgspec-encoded export over a pipe. A "prefill" process fills its own pool with
seeded random bytes, maps the export (`CudaIpcTransport.open_peer`) and writes scattered page ids in several
chunks with descriptors from `onesided.chunk_descriptors`; the decode rebuilds the prefill's bytes from the
seed and checks every page: written destinations hold their source page, all others are still zero.

Also: writes outside the exported regions are refused (TransportError naming the address) and change nothing;
a restarted decode process is mapped afresh and gets its bytes; memory from expandable segments is refused
with a message that names them (or the observed outcome is recorded as a skip).

Process bodies live in this module (spawned children import it by name, tests/gpu being on sys.path as for
nccl_pair_workers). Every wait has a timeout; a failing process prints its traceback, tells its peer and
reports it to the test (bench/transfer/pair.py), so nothing hangs past the deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
msgspec = pytest.importorskip("msgspec")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # `bench` is importable from the repository root only
    sys.path.insert(0, _ROOT)

from bench.transfer.pair import collect, expect, spawn  # noqa: E402
from bench.transfer.pair import guarded as _guarded  # noqa: E402
from bench.transfer.pair import page_bytes as _pages  # noqa: E402
from sglang_p2p_backend.engine.wire import messages  # noqa: E402
from sglang_p2p_backend.engine.copy.memory import Region  # noqa: E402
from sglang_p2p_backend.engine.transport.local_memory import LocalMemory  # noqa: E402
from sglang_p2p_backend.engine.transport.onesided import chunk_descriptors  # noqa: E402
from sglang_p2p_backend.engine.transport.base import TransportError  # noqa: E402
from sglang_p2p_backend.engine.transport.cuda_ipc import (  # noqa: E402
    CudaIpcTransport,
    IpcUnavailable,
    backend,
    check_export,
    export_regions,
    reachable,
)

#: regions (MLA: one per layer; MHA: K then V of each layer) and one token's shape in a region (bf16)
LAYOUTS = {"mla": (61, (576,)), "mha": (64, (8, 128))}
PAGES = 300  # per region, on both sides
IO_TIMEOUT = 60.0  # any single wait for the other process
SESSION = "127.0.0.1:17001"
CASES = [(layout, ps) for layout in ("mla", "mha") for ps in (1, 16, 64)]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _item(layout: str, page_size: int) -> int:
    return page_size * int(np.prod(LAYOUTS[layout][1])) * 2


def _alloc_pool(layout: str, page_size: int, dev: torch.device) -> list[torch.Tensor]:
    """Zeroed bf16 tensors, one per region, each its own torch allocation (as SGLang's pools)."""
    regions, token = LAYOUTS[layout]
    return [torch.zeros((PAGES, page_size, *token), dtype=torch.bfloat16, device=dev) for _ in range(regions)]


def _truth(seed: int, region: int, item: int, dev: torch.device) -> torch.Tensor:
    """The prefill's bytes of one region: the same in both processes (same seed, same device generator)."""
    g = torch.Generator(device=dev).manual_seed(seed * 1009 + region)
    return torch.randint(0, 256, (PAGES, item), generator=g, device=dev, dtype=torch.uint8)


def _regions(pool: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in pool]


def _recv(conn, what: str, timeout: float = IO_TIMEOUT):
    """The next message, which must be `what` (its payload); the peer's failure or silence raises here."""
    return expect(conn, (what,), timeout)[1:]


# -- process bodies ------------------------------------------------------------------------------------------

def _plan(seed: int, n: int):
    """Paired page ids: source ids in random-order runs of 1-8 consecutive pages; the first half of the
    destinations shifted copies of them (so runs merge on both sides), the rest random single pages; cut
    into four chunks at random points."""
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, 9, size=PAGES))
    blocks = np.split(np.arange(PAGES), cuts[cuts < PAGES])
    src = np.concatenate([blocks[i] for i in rng.permutation(len(blocks))])[:n]
    half = n // 2
    dst_a = (src[:half] + int(rng.integers(1, PAGES))) % PAGES
    dst_b = rng.permutation(np.setdiff1d(np.arange(PAGES), dst_a))[: n - half]
    dst = np.concatenate([dst_a, dst_b])
    bounds = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))
    return src, dst, [(int(a), int(b)) for a, b in zip([0, *bounds], [*bounds, n])]


def _peer(layout: str, page_size: int, export: messages.IpcExport, ptrs: list[int]) -> messages.PeerRegister:
    item = _item(layout, page_size)
    agreement = messages.Agreement(protocol=messages.PROTOCOL_VERSION, page_size=page_size, kv_dtype="bfloat16",
                                   kv_item_lens=[item] * len(ptrs), state_item_lens=[], slot_bytes=0, auth=False,
                                   mla=layout == "mla")
    return messages.PeerRegister(session=SESSION, incarnation=export.pid, hostname="localhost", engine_rank=0,
                                 attn_tp_size=1, agreement=agreement, kv_ptrs=list(ptrs), aux_ptrs=[],
                                 aux_item_lens=[], state_ptrs=[], kv_pages=PAGES, aux_rows=0, state_slots=[],
                                 transports=["cudaipc"], ipc=export)


def _decode_export(conn, layout: str, page_size: int):
    dev = _device()
    pool = _alloc_pool(layout, page_size, dev)
    torch.cuda.synchronize(dev)
    export = export_regions(_regions(pool), dev)
    lengths = sorted({len(h) for h in export.handles})
    if lengths != [64]:  # msgspec would refuse it on the prefill side with a less telling message
        raise AssertionError(f"export_regions returned handles of {lengths} bytes, not 64: the handle bytes were "
                             f"cut (a ctypes c_char array stops at the first NUL byte)")
    conn.send(("export", msgspec.msgpack.encode(export), [p for p, _ in _regions(pool)]))
    return pool, export


def _decode_verify(pool: list[torch.Tensor], layout: str, page_size: int, seed: int, src, dst) -> dict:
    dev = pool[0].device
    item = _item(layout, page_size)
    src_t, dst_t = torch.from_numpy(src).to(dev), torch.from_numpy(dst).to(dev)
    written = torch.zeros(PAGES, dtype=torch.bool, device=dev)
    written[dst_t] = True
    others = (~written).nonzero().flatten()
    bad_written, bad_other = torch.zeros_like(written), torch.zeros_like(written)
    for r, t in enumerate(pool):
        got = _pages(t)
        bad_written[dst_t[(got[dst_t] != _truth(seed, r, item, dev)[src_t]).any(dim=1)]] = True
        bad_other[others[got[others].ne(0).any(dim=1)]] = True
    return {"pages": int(dst.size), "untouched": int(others.numel()),
            "bad_written": bad_written.nonzero().flatten().tolist()[:10],
            "nonzero_other": bad_other.nonzero().flatten().tolist()[:10]}


def _decode_cases(conn, cases):
    out = {}
    for layout, ps in cases:
        pool, _ = _decode_export(conn, layout, ps)
        src, dst, seed = _recv(conn, "written")
        out[(layout, ps)] = _decode_verify(pool, layout, ps, seed, src, dst)
        del pool
        torch.cuda.empty_cache()  # the prefill unmapped it before saying "written": new allocations next case
    return out


def decode_cases(rank, conn, cases):
    return _guarded(_decode_cases, conn, cases)


def decode_once(rank, conn, case):
    def body(conn, case):
        pool, export = _decode_export(conn, *case)
        src, dst, seed = _recv(conn, "written")
        v = _decode_verify(pool, *case, seed, src, dst)
        v["ptrs"] = [r.ptr for r in export.regions]
        return v
    body.__name__ = "decode_once"
    return _guarded(body, conn, case)


def _prefill_one(tr: CudaIpcTransport, conn, layout: str, page_size: int, seed: int, forget: bool = True,
                 received=None) -> dict:
    """Map the decode's export, write a scattered request in four chunks (the first one queued right behind a
    slow fill of the sources: the copy must wait for it), try writes outside the export, tell the decode."""
    dev = tr.device
    blob, ptrs = received or _recv(conn, "export")
    export = msgspec.msgpack.decode(blob, type=messages.IpcExport)
    peer = _peer(layout, page_size, export, ptrs)
    item = _item(layout, page_size)
    problem = reachable(export, dev) or check_export(export, [(p, PAGES * item) for p in ptrs])
    assert problem is None, problem
    tr.open_peer(SESSION, export)
    assert tr.mapped(SESSION, export)

    pool = _alloc_pool(layout, page_size, dev)
    # one whole-page copy within this process first: the page kernel is compiled for this pool's pages, so every
    # chunk below takes the direct launch (span_copy.PageCopier._launch_direct), the first one right behind the
    # slow fill; each direct launch is counted
    copier = backend()._copiers(dev).pages  # noqa: SLF001 - the copier write_pages takes
    scratch = _alloc_pool(layout, page_size, dev)
    backend().write_pages(dev, np.array([t.data_ptr() for t in pool]), np.array([t.data_ptr() for t in scratch]),
                          np.array([item] * len(pool)), np.array([0]), np.array([1]))
    del scratch
    direct, launch = [], copier._launch_direct  # noqa: SLF001
    copier._launch_direct = lambda *a: (direct.append(a[1][0]), launch(*a))  # noqa: SLF001 - a[1]: the grid
    for t in pool:
        _pages(t).fill_(0xA5)  # stale bytes: a copy that does not wait for the fill below ships these
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(50_000_000)  # tens of ms of GPU time on the current stream before the sources are final
    for r, t in enumerate(pool):
        _pages(t).copy_(_truth(seed, r, item, dev))
    local = LocalMemory(kv=[Region(p, n, item) for p, n in _regions(pool)], state=[], aux=[])

    src, dst, chunks = _plan(seed, PAGES * 3 // 5)
    spans, merged, page_chunks = 0, 0, 0
    bases = [r.ptr for r in local.kv]
    for i, (lo, hi) in enumerate(chunks):
        if i % 2 == 0:  # the page-table kernel (the first chunk too: it must wait for the slow fill)
            tr.write_pages(SESSION, bases, peer.kv_ptrs, [item] * len(bases), src[lo:hi], dst[lo:hi], PAGES, PAGES)
            page_chunks += 1
            continue
        s, d, n = chunk_descriptors(local, peer, [src[lo:hi]], [dst[lo:hi]])
        tr.write(SESSION, s, d, n)
        spans, merged = spans + len(n), merged + int((n > item).sum())

    chunk_launches = len(direct)  # the chunks' own (the launches below are counted too)
    # launched (SGLANG_P2P_IPC_LAUNCH=scheduler: one thread queues, another waits): the first chunk again (the
    # same bytes), behind tens of ms of GPU time on the current stream, so it is still running when asked
    lo, hi = chunks[0]

    def rewrite():
        return tr.write_pages(SESSION, bases, peer.kv_ptrs, [item] * len(bases), src[lo:hi], dst[lo:hi], PAGES, PAGES)

    torch.cuda._sleep(50_000_000)
    began = time.perf_counter()
    first = backend().launch(dev, rewrite)
    # its host steps as this thread's backend recorded them (SGLANG_P2P_ROOM_TIMES reads them)
    marks = {"began": began, "cpu_now": time.thread_time(), **backend().last_write()._asdict()}
    launches = {"bytes": first[0], "done_at_once": first[1].done(),
                "refused_while_running": backend().launch(dev, rewrite) is None}
    waiter = threading.Thread(target=first[1].wait)  # the worker's part, on another thread
    waiter.start()
    waiter.join(IO_TIMEOUT)
    marks["waited"] = time.perf_counter()
    launches["done_after_wait"] = first[1].done()
    launches["untimed_ms"] = first[1].gpu_ms()
    # timed (SGLANG_P2P_ROOM_TIMES), again behind GPU time on the current stream (~10 ms), which its copy waits for
    # and its device time leaves out
    torch.cuda._sleep(20_000_000)
    began = time.perf_counter()
    again = backend().launch(dev, rewrite, timed=True)
    launches["launched_again"] = again is not None
    if again is not None:
        again[1].wait()
        launches["timed"] = {"gpu_ms": again[1].gpu_ms(), "wall_ms": 1e3 * (time.perf_counter() - began)}

    # (a) writes outside the export, each batch with a valid span first (into a page nobody writes)
    spare = int(np.setdiff1d(np.arange(PAGES), dst)[0])
    ok_s, ok_d, ok_n = chunk_descriptors(local, peer, [np.array([0])], [np.array([spare])])
    by_addr = sorted(zip(ptrs, [PAGES * item] * len(ptrs)))
    lo_ptr, (hi_ptr, hi_len) = by_addr[0][0], by_addr[-1]
    bad = {"crosses_last_region_end": (hi_ptr + hi_len - item // 2, item),
           "before_first_region": (lo_ptr - item, item),
           "past_every_region": (hi_ptr + hi_len + (1 << 20), 8)}
    refused = {}
    for name, (addr, length) in bad.items():
        try:
            tr.write(SESSION, np.append(ok_s, ok_s[0]), np.append(ok_d, addr), np.append(ok_n, length))
            refused[name] = None
        except TransportError as e:
            refused[name] = (type(e).__name__, str(e), f"{addr:#x}")
    # (b) whole-page writes with a page id past either pool
    for name, (s_ids, d_ids) in {"page_id_past_decode_pool": ([0], [PAGES]),
                                 "page_id_past_prefill_pool": ([PAGES + 1], [spare])}.items():
        try:
            tr.write_pages(SESSION, bases, peer.kv_ptrs, [item] * len(bases), np.array(s_ids), np.array(d_ids),
                           PAGES, PAGES)
            refused[name] = None
        except TransportError as e:
            refused[name] = (type(e).__name__, str(e), str(max(s_ids[0], d_ids[0])))
    torch.cuda.synchronize(dev)
    del copier._launch_direct  # noqa: SLF001 - the class's again
    if forget:
        tr.forget_peer(SESSION)
    conn.send(("written", src, dst, seed))
    return {"spans": spans, "merged_spans": merged, "page_chunks": page_chunks, "direct_launches": chunk_launches,
            "refused": refused, "export": export, "marks": marks, "launches": launches, "chunk0": hi - lo}


def _prefill_cases(conn, cases, copy_engine: str = "off"):
    tr = CudaIpcTransport(_device(), copy_engine)
    out = {}
    for i, (layout, ps) in enumerate(cases):
        r = _prefill_one(tr, conn, layout, ps, seed=100 + i)
        r.pop("export")
        out[(layout, ps)] = r
        torch.cuda.empty_cache()
    tr.close()
    return out


def prefill_cases(rank, conn, cases, copy_engine: str = "off"):
    """`copy_engine`: SGLANG_P2P_COPY_ENGINE's value for the transport (tests/gpu/test_copy_engine.py runs "on")."""
    return _guarded(_prefill_cases, conn, cases, copy_engine)


def _prefill_restart(conn, conn_next, case):
    tr = CudaIpcTransport(_device())
    first = _prefill_one(tr, conn, *case, seed=7, forget=False)  # still mapped when that decode exits
    # the replacement decode process starts only after the first one ended (the test waits for it)
    received = _recv(conn_next, "export")
    new = msgspec.msgpack.decode(received[0], type=messages.IpcExport)
    assert tr.mapped(SESSION, first["export"]) and not tr.mapped(SESSION, new)
    tr.forget_peer(SESSION)
    assert not tr.mapped(SESSION, first["export"])
    second = _prefill_one(tr, conn_next, *case, seed=8, received=received)
    tr.close()
    return {"first_pid": first["export"].pid, "second_pid": second["export"].pid,
            "first": {k: v for k, v in first.items() if k != "export"},
            "second": {k: v for k, v in second.items() if k != "export"}}


def prefill_restart(rank, conn, conn_next, case):
    return _guarded(_prefill_restart, conn, conn_next, case)


def expandable_export(rank, conn):
    """In a process started with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: what exporting gives."""
    try:  # the environment normally suffices; this makes sure before the first allocation
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except Exception:  # noqa: BLE001 - recorded through the snapshot below
        pass
    dev = _device()
    t = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    segments = torch.cuda.memory_snapshot()
    expandable = [s.get("is_expandable") for s in segments if "is_expandable" in s]
    out = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "segments_expandable": expandable}
    try:
        e = export_regions([(t.data_ptr(), t.numel())], dev)
        out["outcome"] = f"exported: {len(e.handles)} handle(s) of {[len(h) for h in e.handles]} bytes"
    except IpcUnavailable as e:
        out["outcome"], out["message"] = "IpcUnavailable", str(e)
    except Exception as e:  # noqa: BLE001 - anything else is a defect the test names
        out["outcome"], out["message"] = "other", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return out


# -- tests ---------------------------------------------------------------------------------------------------

def _run(bodies, timeout: float, env=None):
    """Start `(fn, rank, conn, args)` bodies on GPU 0 and collect every rank's result."""
    results = mp.get_context("spawn").Queue()
    procs = [spawn(fn, rank, 0, conn, results, args, env, dump_after=timeout - 10) for fn, rank, conn, args in bodies]
    return collect(procs, results, [b[1] for b in bodies], timeout=timeout)


@pytest.fixture(scope="module")
def transfers():
    """All layout x page size cases in one pair of processes (CUDA, Triton and the mapping start once)."""
    a, b = mp.get_context("spawn").Pipe()
    out = _run([(prefill_cases, 0, a, (CASES,)), (decode_cases, 1, b, (CASES,))], timeout=150)
    return out[0], out[1]


@pytest.mark.parametrize("layout, page_size", CASES)
def test_scattered_chunks_land_byte_exact_and_nothing_else_changes(transfers, layout, page_size):
    prefill, decode = transfers[0][(layout, page_size)], transfers[1][(layout, page_size)]
    print(f"REPORT cudaipc {layout} page {page_size}: {decode['pages']} pages in {prefill['spans']} spans "
          f"({prefill['merged_spans']} merged runs); {decode['untouched']} pages untouched")
    assert prefill["spans"] >= LAYOUTS[layout][0]  # the span kernel's chunks (their merging is a CPU test)
    assert prefill["page_chunks"] >= 2  # half the chunks went through the page-table kernel
    # ... each by the direct launch (the kernel compiled before the slow fill the first one waits for)
    assert prefill["direct_launches"] == prefill["page_chunks"]
    # the launch's copy was planned and queued within the call, behind tens of ms of GPU time: its wait comes
    # after `launched`, so a room's host and device time split there
    m = prefill["marks"]
    assert m["began"] <= m["planned"] <= m["launched"] < m["waited"], m
    assert m["waited"] - m["launched"] > 0.01 > m["launched"] - m["planned"], m
    assert 0 < m["launched_cpu"] <= m["cpu_now"], m
    # ... after the write's own host steps, in order (room times show each, with the thread's CPU time at it)
    assert [s[0] for s in m["steps"]] == ["entered", "checked", "routed", "planned"], m
    walls, cpus = [s[1] for s in m["steps"]], [s[2] for s in m["steps"]]
    assert m["began"] <= walls[0] and walls == sorted(walls) and walls[-1] == m["planned"], m
    assert cpus == sorted(cpus) and cpus[-1] <= m["launched_cpu"], m
    # a launch returns with its copy still queued behind the GPU's work, refuses the thread's next launch until it
    # ran (its page ids wait in pinned memory), and is done once another thread waited for it
    ln = dict(prefill["launches"])
    # a timed launch gives its copy's device time, without the ~10 ms its stream waited for the current one first;
    # an untimed one none
    timed = ln.pop("timed")
    assert ln.pop("untimed_ms") is None and timed["wall_ms"] > 5 and 0 < timed["gpu_ms"] < timed["wall_ms"] / 2, timed
    assert ln == {"bytes": prefill["chunk0"] * _item(layout, page_size) * LAYOUTS[layout][0], "done_at_once": False,
                  "refused_while_running": True, "done_after_wait": True, "launched_again": True}, ln
    assert not decode["bad_written"], f"destination pages differ from their source: {decode['bad_written']}"
    assert not decode["nonzero_other"], f"pages nobody wrote changed: {decode['nonzero_other']}"


@pytest.mark.parametrize("layout, page_size", CASES)
def test_writes_outside_the_export_are_refused_naming_the_address(transfers, layout, page_size):
    refused = transfers[0][(layout, page_size)]["refused"]
    for name, got in refused.items():
        assert got is not None, f"{name}: the write was accepted"
        kind, message, addr = got
        assert kind == "TransportError" and addr in message, (name, got)
    # their valid first spans went to a page the checks above saw still zero (nonzero_other)
    assert not transfers[1][(layout, page_size)]["nonzero_other"]


def test_restarted_decode_is_mapped_afresh_and_gets_its_bytes():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p1, d1 = ctx.Pipe()
    p2, d2 = ctx.Pipe()
    case = ("mla", 16)
    prefill = spawn(prefill_restart, 0, 0, p1, results, (p2, case), None, dump_after=80)
    first = spawn(decode_once, 1, 0, d1, results, (case,), None, dump_after=50)
    procs = [prefill, first]
    try:
        old = collect([first], results, (1,), timeout=60)[1]  # returns once that process has exited
        procs.append(spawn(decode_once, 2, 0, d2, results, (case,), None, dump_after=50))
        out = collect(procs[::2], results, (0, 2), timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    new, pre = out[2], out[0]
    print(f"REPORT cudaipc restart: decode pid {pre['first_pid']} -> {pre['second_pid']}, same addresses "
          f"{old['ptrs'] == new['ptrs']}")
    assert pre["first_pid"] != pre["second_pid"]
    for v in (old, new):
        assert not v["bad_written"] and not v["nonzero_other"], v


def test_expandable_segments_memory_is_refused_naming_them():
    out = _run([(expandable_export, 0, None, ())], timeout=60,
               env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})[0]
    print(f"REPORT cudaipc expandable segments: {out}")
    assert out["outcome"] != "other", out["message"]
    if out["segments_expandable"] and not any(out["segments_expandable"]):
        pytest.skip(f"the allocator did not use expandable segments here: {out}")
    if out["outcome"] != "IpcUnavailable" or "expandable_segments" not in out["message"]:
        pytest.skip(f"observed on this driver: {out['outcome']}: {out.get('message', '')}")
