"""Run a function in one process per GPU (spawned), with a pipe between them as the control channel.

Used by the transfer benchmark and the GPU tests: rank 0 is the prefill on cuda:0, rank 1 the decode on
cuda:1. Each child sets the host's NVLink-multicast safety variables before CUDA starts, and the parent
kills children that outlive the deadline, so a hung NCCL call ends the run instead of the session.

On a host with one GPU both ranks share it (`pair_device`): NCCL refuses two ranks of one communicator on one
GPU of one host ("Duplicate GPU detected"), so each rank names a host of its own (NCCL_HOSTID) and NCCL moves
the bytes through its socket transport on loopback. That proves the engine's NCCL code paths (init, caps,
abort, ordering, byte-exactness) on real NCCL; its speed says nothing about NVLink.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from sglang_p2p_backend.testing.launch import one_gpu_env

#: NVLink multicast stays off on the shared test hosts (see the device docs); NCCL reads these once per process
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def pair_device(rank: int) -> int:
    """The CUDA device of `rank` (call before NCCL starts): its own GPU, or GPU 0 shared on a one-GPU host,
    with `one_gpu_env` applied to this process."""
    import torch

    if one_gpu_host():
        os.environ.update(one_gpu_env(f"rank{rank}"))
        return 0
    return rank


def one_gpu_host() -> bool:
    """The pair runs on one shared GPU (NCCL over loopback sockets): figures are not NVLink figures."""
    import torch

    return torch.cuda.device_count() == 1 or os.environ.get("P2P_PAIR_ONE_GPU") == "1"


def service_gil_switch() -> None:
    """This process's GIL switch interval as a server's KV manager sets it (SGLANG_P2P_GIL_SWITCH_MS): a benchmark
    or test process whose transfer threads share the GIL with a pipe reader hands it over as a scheduler does."""
    from sglang_p2p_backend.engine.config import EngineConfig
    from sglang_p2p_backend.engine.threads import shorten_gil_switch

    shorten_gil_switch(EngineConfig.from_env().gil_switch_ms)


def _child(fn: Callable, rank: int, device: int, conn, results, args: tuple, env: dict, dump_after: float) -> None:
    os.environ.update(SAFE_ENV)
    os.environ.update(env)
    service_gil_switch()
    if dump_after > 0:  # a hang shows where every thread of this rank waits, before the parent kills it
        faulthandler.dump_traceback_later(dump_after, exit=False)
    try:
        import torch

        device = pair_device(device)
        torch.cuda.set_device(device)
        results.put((rank, True, fn(rank, conn, *args)))
    except BaseException:  # report everything, the parent decides
        results.put((rank, False, traceback.format_exc()))


class PairError(RuntimeError):
    pass


def spawn(fn: Callable, rank: int, device: int, conn, results, args: tuple = (), env: Optional[dict] = None,
          dump_after: float = 0.0):
    """Start `fn(rank, conn, *args)` in a new process on `device`; its return value goes to `results`.
    `dump_after` > 0: print every thread's stack after that many seconds (hang diagnosis)."""
    p = mp.get_context("spawn").Process(
        target=_child, args=(fn, rank, device, conn, results, args, dict(env or {}), dump_after), daemon=True
    )
    p.start()
    return p


def collect(procs: Sequence, results, expect: Sequence[int], timeout: float) -> dict[int, Any]:
    """Wait for the ranks in `expect` to report (others may die on purpose); kill all children at the end."""
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    errors = []
    try:
        while len(out) + len(errors) < len(expect):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PairError(
                    f"ranks {sorted(set(expect) - set(out))} did not finish within {timeout:.0f}s" + "".join(
                        "\n" + e for e in errors))
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise PairError("\n".join(errors))
        return out
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)


def run_pair(fn: Callable, args: tuple = (), timeout: float = 300.0, env: Optional[dict] = None) -> list[Any]:
    """`fn(rank, conn, *args)` on ranks 0 and 1 (cuda:0 and cuda:1); returns both results."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    procs = [spawn(fn, r, r, c, results, args, env, dump_after=max(timeout - 15, 1)) for r, c in ((0, a), (1, b))]
    out = collect(procs, results, (0, 1), timeout)
    return [out[0], out[1]]


def connect_pair(transport, conn, rank: int, timeout: float = 60.0, max_ctas: Optional[int] = -1):
    """Make a pair communicator over the pipe: rank 0 creates the id (with its cap), rank 1 joins."""
    if rank == 0:
        uid = transport.new_unique_id(max_ctas) if max_ctas != -1 else transport.new_unique_id()
        conn.send(uid)
    else:
        uid = conn.recv()
    return transport.connect(uid, rank, timeout)


def expect(conn, kinds: tuple, timeout: float) -> tuple:
    """The peer's next message (a tuple whose first item is its kind), which must be one of `kinds`; the peer's
    failure ("error", traceback), its silence past `timeout` or a closed pipe raise here instead of hanging."""
    if not conn.poll(timeout):
        raise TimeoutError(f"nothing from the other process within {timeout:.0f}s (waiting for {kinds})")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError(f"the other process closed the pipe (waiting for {kinds})") from None
    if msg[0] == "error":
        raise RuntimeError(f"the other process failed:\n{msg[1]}")
    if msg[0] not in kinds:
        raise RuntimeError(f"expected one of {kinds} from the other process, got {msg[0]!r}")
    return msg


def guarded(body: Callable, conn, *args: Any) -> Any:
    """Run `body(conn, *args)`; on failure print the traceback, tell the peer ("error", traceback: it stops
    waiting) and re-raise."""
    try:
        return body(conn, *args)
    except BaseException:
        tb = traceback.format_exc()
        print(f"[pid {os.getpid()}] {body.__name__} failed:\n{tb}", flush=True)
        try:
            conn.send(("error", tb))
        except (OSError, ValueError):
            pass
        raise


def page_bytes(t):
    """(pages, item bytes) uint8 view of a pool tensor whose first dimension is pages."""
    import torch

    return t.view(-1).view(torch.uint8).view(t.shape[0], -1)
