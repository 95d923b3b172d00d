"""Host time of the same-host write path up to the copy, on any machine: `CudaIpcTransport.write_pages` with a
backend that copies nothing, so what is timed is the checks, the translation, the route's rule and the
copy-engine spans or the kernel's arguments, as a transfer worker runs them for each chunk. Then the NCCL path's
host steps around a chunk header: the sender's before it and the decode's checks of it (`NCCL_CASES`). Then a
room's conclusion once its last copy ran: its aux row and Status over the control channel (`CONCLUDE_CASES`).

    python bench/transfer/host_plan.py [--out PATH] [--batches 5] [--calls 2000] [--engine-root DIR]
                                       [--cold-mib 64] [--only conclude]

Each case writes to one mapped peer again and again with the same pools, as a peer's chunks do; the figure is
the best of `--batches` batches of `--calls` calls (a shared CPU's noise only ever adds time). `--engine-root`
times another checkout's `sglang_p2p_backend` instead of this one (the before of a change): run both in turn.
No GPU: the peer's export is a region table over made-up addresses, as xfer_bench's `plan` section builds it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types
from typing import Optional


def _engine_path(argv: Optional[list[str]]) -> None:
    """Put --engine-root (else this repository) first on sys.path, before the engine is imported."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = argv if argv is not None else sys.argv[1:]
    if "--engine-root" in args:
        root = os.path.abspath(args[args.index("--engine-root") + 1])
    sys.path.insert(0, root)


#: (name, regions, bytes a token of a region, tokens a page, tokens, where the pages land, the decode on the
#: prefill's GPU): a request's one chunk. `mixed` (xfer_cases: three quarters of the pages in 4 runs, the rest single
#: pages) at 16k page 1 is the chunk `split` cuts between the two routes; at 4k its runs are too short for the engines
CASES = (("mha_p16_4096_contiguous", 64, 2048, 16, 4096, "contiguous", False),
         ("mla_p64_4096_contiguous", 61, 1152, 64, 4096, "contiguous", False),
         ("mha_p16_4096_scattered", 64, 2048, 16, 4096, "scattered", False),
         ("mla_p64_4096_contiguous_same_gpu", 61, 1152, 64, 4096, "contiguous", True),
         ("mla_p64_128_scattered", 61, 1152, 64, 128, "scattered", False),
         ("mha_p1_4096_scattered", 64, 2048, 1, 4096, "scattered", False),
         ("mha_p1_4096_mixed", 64, 2048, 1, 4096, "mixed", False),
         ("mha_p1_16384_mixed", 64, 2048, 1, 16384, "mixed", False))
POOL_TOKENS = 131072
#: (name, regions, bytes a token of a region, tokens a page, tokens): the NCCL path's first chunk of a request
NCCL_CASES = (("nccl_mha_p1_1024", 64, 2048, 1, 1024), ("nccl_mla_p64_4096", 61, 1152, 64, 4096),
              ("nccl_mha_p1_16384", 64, 2048, 1, 16384))


#: (name, the draft model's hidden size in SGLang's aux rows, keyed): a room's conclusion to a registered peer (its
#: pair secret on every message), without and with SGLANG_P2P_AUTH_KEY's envelope
CONCLUDE_CASES = (("conclude_hidden16", 16, False), ("conclude_hidden16_keyed", 16, True),
                  ("conclude_hidden7168_keyed", 7168, True))


class NoCopy:
    """A backend that takes every write and copies nothing (the route is still chosen as with CUDA)."""

    def copy_engines_batched(self) -> bool:
        return True

    def write_pages(self, *_a, **_k) -> None:
        pass

    def write_copy_engines(self, *_a, **_k) -> None:
        pass

    def write_split(self, *_a, **_k) -> None:
        pass

    def note(self, *_a, **_k) -> None:
        pass


def time_case(name: str, regions: int, token_bytes: int, page: int, tokens: int, dest: str, same_gpu: bool,
              batches: int, calls: int) -> dict:
    import numpy as np

    from sglang_p2p_backend.engine.transport import cuda_ipc
    from sglang_p2p_backend.engine.wire.messages import IpcRegion

    item, pages, pool_pages = page * token_bytes, tokens // page, POOL_TOKENS // page
    stride = 1 << 34  # addresses only: regions far apart, nothing is read or written
    src_bases = [(1 << 44) + r * stride for r in range(regions)]
    dst_bases = [(1 << 45) + r * stride for r in range(regions)]
    if dest == "scattered":
        rng = np.random.default_rng(0)
        src_ids, dst_ids = rng.permutation(pool_pages)[:pages], rng.permutation(pool_pages)[:pages]
    elif dest == "mixed":
        try:
            from bench.transfer import xfer_cases as xc
        except ImportError:  # run as a script with --engine-root: the module beside this file
            import xfer_cases as xc  # type: ignore[no-redef]

        src_ids, dst_ids = xc.page_ids(xc.Case(xc.Shape(name, regions, token_bytes, page), tokens, dest),
                                       pool_pages, pool_pages)
    else:
        src_ids, dst_ids = np.arange(100, 100 + pages), np.arange(7, 7 + pages)
    import torch

    tr = cuda_ipc.CudaIpcTransport(torch.device("cpu"))
    if same_gpu:  # the same-GPU grid is worked out for a CUDA device: name one, with an H100's SM count
        tr.device, tr._sms = torch.device("cuda", 0), 132  # noqa: SLF001 - nothing is launched here
    exported = [IpcRegion(ptr=b, alloc=i, offset=0, length=pool_pages * item) for i, b in enumerate(dst_bases)]
    table = cuda_ipc.RegionTable.build(exported, [(1 << 46) + i * stride for i in range(regions)])
    tr._peers["d"] = types.SimpleNamespace(table=table, close=lambda: None, same_gpu=same_gpu)  # noqa: SLF001

    def write() -> None:  # the lists a transfer worker builds for every chunk (onesided._write_kv_pages)
        tr.write_pages("d", list(src_bases), list(dst_bases), [item] * regions, src_ids, dst_ids, pool_pages, pool_pages)

    cuda_ipc.use_backend(NoCopy())
    try:
        best = _best_us(write, batches, calls)
    finally:
        cuda_ipc.use_backend(None)
    return {"case": name, "pages": pages, "regions": regions, "us_best": round(min(best), 2),
            "us_batches": [round(b, 2) for b in best]}


def _best_us(fn, batches: int, calls: int) -> list[float]:
    """Per batch of `calls` calls after a warm-up, the microseconds a call."""
    for _ in range(200):
        fn()
    best = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - t) / calls * 1e6)
    return best


def time_nccl_case(name: str, regions: int, token_bytes: int, page: int, tokens: int, batches: int,
                   calls: int) -> list[dict]:
    """The NCCL path's host steps around a request's first chunk header (one 256 MiB staging slot), scattered
    pages: the sender's before the header (`bad_ids`, `plan_chunks`, the segments' wire form, as
    `PairSender.send` runs them), the decode's checks of the header (`checks.chunk_header`) for a room's first
    chunk (its published pages not yet looked at) and for the same chunk again (a room's later chunk), and the
    decode's count of arrived pages when the prefill's Success comes (`_pages_missing`)."""
    import numpy as np
    import torch

    from sglang_p2p_backend.engine.copy.copier import PageCopier
    from sglang_p2p_backend.engine.copy.plan import plan_chunks
    from sglang_p2p_backend.engine.pair.pipeline import _segment_msg
    from sglang_p2p_backend.engine.wire import checks
    from sglang_p2p_backend.engine.wire.messages import ChunkHeader

    item, pages, pool_pages = page * token_bytes, tokens // page, POOL_TOKENS // page
    pool = torch.empty(pool_pages, 1, dtype=torch.uint8).expand(pool_pages, item)  # shapes only, a byte a page
    copier = PageCopier([[pool] * regions])
    rng = np.random.default_rng(0)
    src_ids, dst_ids = rng.permutation(pool_pages)[:pages], rng.permutation(pool_pages)[:pages].astype(np.int32)
    slot = 256 << 20

    def prepare() -> list:
        assert copier.bad_ids([src_ids]) is None
        chunks = plan_chunks(copier.item_lens, [pages], slot, [None])
        return [_segment_msg(seg, [dst_ids]) for seg in chunks[0].segments]

    segments = prepare()
    header = ChunkHeader("p:1", 1, 9, 0, 0, sum(len(s.dst_ids) // 4 for s in segments) * item * regions, segments)
    # a room for every call, made before the timing (each first chunk meets a room's pages unlooked at)
    rooms = iter([checks.Published(dst_ids, 0, [], frozenset({"p:1"})) for _ in range(200 + batches * calls)])

    def first_check() -> None:
        assert checks.chunk_header(header, copier.item_lens, slot, next(rooms)).problem is None

    later = checks.Published(dst_ids, 0, [], frozenset({"p:1"}))

    def later_check() -> None:
        later.next_seq.clear()
        getattr(later, "next_kv", {}).clear()
        assert checks.chunk_header(header, copier.item_lens, slot, later).problem is None

    from sglang_p2p_backend.adapter.decode import DecodeKVManager

    done = checks.Published(dst_ids, 0, [], frozenset({"p:1"}))
    done.received.extend(np.array_split(dst_ids, max(1, header.nbytes // slot)))  # the request's chunks, in order
    decode = types.SimpleNamespace(live_rooms={9: done}, two_sided_only=True)

    def all_arrived() -> None:  # at the prefill's Success: every published page landed
        assert DecodeKVManager._pages_missing(decode, 9) is None

    out = []
    for step, fn in (("sender_before_header", prepare), ("decode_check_first", first_check),
                     ("decode_check_later", later_check), ("decode_all_arrived", all_arrived)):
        best = _best_us(fn, batches, calls)
        out.append({"case": f"{name}_{step}", "pages": pages, "regions": regions, "us_best": round(min(best), 2),
                    "us_batches": [round(b, 2) for b in best]})
    return out


class Evictor:
    """Stands for what runs between two conclusions in service: SGLang's scheduler loop and a forward pass, a whole
    request apart, which leave the caches holding other code and data. Each call writes a byte of every cache line
    of `mib` MiB and runs unrelated Python and C code (json), as a request's worth of other work would."""

    def __init__(self, mib: int):
        import numpy as np

        self._big = np.zeros(mib << 20, dtype=np.uint8)
        self._junk = [{f"k{i}": list(range(20))} for i in range(2000)]

    def __call__(self) -> None:
        self._big[::64] += 1
        json.dumps(self._junk)


def time_conclude_case(name: str, hidden_size: int, keyed: bool, batches: int, calls: int,
                       cold_mib: int = 0) -> dict:
    """A room's conclusion on the host, as SGLang's poll (or a worker) runs it once the last copy ran: the aux row
    read from SGLang's own aux buffers (`TransferWorkers._aux_message`), then it and the Status encoded, sealed
    and handed to ZMQ without waiting (`ControlChannel.send_now`, both in one call where the engine takes several
    messages: protocol 10) for a PULL socket on 127.0.0.1. One conclusion at a time, as SGLang's poll makes them:
    each timed alone and both its messages received before the next (outside the timing), so ZMQ's I/O thread is
    idle when it starts; the figure is a batch's median conclusion, `zmq_frames` the frames a message took and
    `zmq_sends` the sends a conclusion took. `cold_mib` > 0: the caches are cleared of it before each (`Evictor`),
    as in service, where it runs once a request (docs/bench.md)."""
    import inspect

    import zmq

    from sglang_p2p_backend.adapter.transfer_workers import TransferWorkers
    from sglang_p2p_backend.engine.copy.memory import Region
    from sglang_p2p_backend.engine.transport.local_memory import LocalMemory
    from sglang_p2p_backend.engine.wire import messages
    from sglang_p2p_backend.engine.wire.auth import Authenticator
    from sglang_p2p_backend.engine.wire.control import ControlChannel
    from sglang_p2p_backend.testing.runtime import metadata_buffers

    bufs = metadata_buffers(64, hidden_size)
    ptrs, lens, items = bufs.get_buf_infos()
    pull = zmq.Context.instance().socket(zmq.PULL)
    endpoint = f"127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    channel = ControlChannel(auth=Authenticator(b"k" * 32, "127.0.0.1:1", 1) if keyed else None)
    channel.set_secret(endpoint, b"s" * 16)  # a registered peer's, as every message after registration carries
    # the decode's aux rows laid out as this rank's (registration compares them)
    me = types.SimpleNamespace(local=LocalMemory([], [], [Region(p, n, i) for p, n, i in zip(ptrs, lens, items)]),
                               peers={endpoint: types.SimpleNamespace(aux_ptrs=ptrs, aux_item_lens=items)},
                               session="127.0.0.1:1")

    together = len(inspect.signature(ControlChannel.send_now).parameters) > 3  # (self, endpoint, msg, *more)
    sends = 1 if together else 2

    def conclude() -> None:
        aux = TransferWorkers._aux_message(me, endpoint, 9, 5, 7)  # noqa: SLF001 - the worker's own step
        msgs = (aux, messages.Status("127.0.0.1:1", 9, 0, 2, "", 0))
        for part in ((msgs,) if together else ((m,) for m in msgs)):
            if not channel.send_now(endpoint, *part):
                raise RuntimeError("a send found the socket busy with nothing else sending on it")

    frames = []

    def received() -> None:
        for _ in range(sends):
            if not pull.poll(5000):
                raise RuntimeError("a message never arrived")
            frames.append(len(pull.recv_multipart()))

    evict = Evictor(cold_mib) if cold_mib > 0 else (lambda: None)
    best = []
    try:
        for batch in range(batches + 1):  # the first: warm-up
            took = []
            for _ in range(calls if batch else 200):
                evict()
                t = time.perf_counter()
                conclude()
                took.append(time.perf_counter() - t)
                received()
            if batch:
                best.append(statistics.median(took) * 1e6)
    finally:
        channel.forget(endpoint)
        pull.close(linger=0)
    return {"case": name + ("_cold" if cold_mib > 0 else ""), "aux_row_bytes": sum(items), "keyed": keyed,
            "zmq_frames": sorted(set(frames)), "zmq_sends": sends, "cold_mib": cold_mib,
            "us_best": round(min(best), 2), "us_batches": [round(b, 2) for b in best]}


def main(argv: Optional[list[str]] = None) -> int:
    _engine_path(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON (default: print only)")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--engine-root", default=None, help="another checkout whose sglang_p2p_backend is timed")
    ap.add_argument("--cold-mib", type=int, default=0,
                    help="also time each conclusion with the caches cleared before it by writing this many MiB")
    ap.add_argument("--only", choices=("all", "conclude"), default="all", help="conclude: the conclusion rows alone")
    ns = ap.parse_args(argv)
    rows = []
    if ns.only == "all":
        rows += [time_case(*c, ns.batches, ns.calls) for c in CASES]
        rows += [r for c in NCCL_CASES for r in time_nccl_case(*c, ns.batches, ns.calls)]
    rows += [time_conclude_case(*c, ns.batches, ns.calls) for c in CONCLUDE_CASES]
    if ns.cold_mib > 0:
        rows += [time_conclude_case(*c, ns.batches, ns.calls, ns.cold_mib) for c in CONCLUDE_CASES]
    for r in rows:
        what = "a room" if r["case"].startswith("conclude") else "a chunk"
        print(f"{r['case']:28s} {r['us_best']:8.2f} us {what} (best of {ns.batches} batches)")
    doc = {"machine": f"cpu-{os.cpu_count()}core", "python": platform.python_version(),
           "engine_root": ns.engine_root or "this repository", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
