"""Faults a plan injects into a role's process (`plan["faults"][role]`), as a hung, dying, buggy or forged
server would show them to its peer.

Prefill: `chunk_delay_s` (a pause between a request's sends), `abort_after_chunks`, `exit_after_chunks`,
`stop_after_chunks` (abort the request, exit, or SIGSTOP after that many chunks), `broken_after_chunks` (the
manager marked broken, as when one of its threads cannot go on), `aux_row` (aux rows sent to
another row than the published one), `write_delay_s` (every write starts later: prefill_role.py's write watch),
`clear_delay_s` ({room: seconds}: the scheduler clears the room's sender that long after its Success, as a busy
one does), `mark_delay_s` ({room: seconds}: the manager's thread that concludes the room's first attempt is
descheduled that long just before it marks the room Success here), `stop_self` (SIGSTOP once registered). Decode: `abort_after_s`, `exit_after_s`, `stop_after_s` (counted
from a request's metadata), `fail_after_s` ({room: seconds}: the decode fails the room on its own check, as a
refused chunk, missing pages or a lost heartbeat do), `ipc_export_short` (a CUDA IPC export that does not cover the pool it registers),
`corrupt_after_arrival` (rooms whose first page is altered after it landed, before the KV checksum is verified),
`metadata_fails_after` ({room: n}: send_metadata of the room reaches its first n prefill ranks, then the next
send fails a second later, as one to a rank that just died does).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from sglang_p2p_backend.testing.plan import Req

#: the exit code of a process a fault killed
EXIT_CODE = 17


def stop_self(plan: dict, role: str) -> None:
    """This process stops (SIGSTOP) as a hung or frozen server would; the time goes to `<role>.stopped_at`."""
    with open(os.path.join(plan["workdir"], f"{role}.stopped_at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def prefill_after_send(faults: dict, plan: dict, req: Req, last: bool) -> bool:
    """The prefill's faults after a send() of `req`; True when one aborted the request (an AbortReq reaching
    the prefill scheduler mid-transfer)."""
    delay = float(faults.get("chunk_delay_s", 0))
    if delay and not last:
        time.sleep(delay)
    if "abort_after_chunks" in faults and req.sent >= faults["abort_after_chunks"] * req.chunk_pages:
        req.handle.abort()
        return True
    if "exit_after_chunks" in faults and req.sent >= faults["exit_after_chunks"] * req.chunk_pages:
        time.sleep(0.3)
        os._exit(EXIT_CODE)
    if "stop_after_chunks" in faults and req.sent >= faults["stop_after_chunks"] * req.chunk_pages:
        stop_self(plan, "prefill")
    if "broken_after_chunks" in faults and req.sent >= faults["broken_after_chunks"] * req.chunk_pages:
        req.handle.kv_mgr._fatal("p2pnccl thread p2p-prefill-control stopped: injected")
    return False


def clear_later(faults: dict, req: Req, now: float) -> bool:
    """Prefill fault `clear_delay_s`: True while the sender of `req`, concluded, is not to be cleared yet."""
    delay = float(faults.get("clear_delay_s", {}).get(str(req.room), 0)) if req.attempt == 1 else 0.0
    return now - req.result.setdefault("concluded_seen", now) < delay


def decode_after_metadata(faults: dict, plan: dict, req: Req, now: float) -> bool:
    """The decode's faults while `req` waits for its KV; True when one aborted the request."""
    waited = now - req.result["metadata_at"]
    fail_after = faults.get("fail_after_s", {}).get(str(req.room))
    if fail_after is not None and waited >= fail_after and "failed_at" not in req.result:
        req.result["failed_at"] = time.time()
        req.handle.kv_mgr.room_failed(req.room, f"injected: the decode's own check failed room {req.room}")
    if "abort_after_s" in faults and waited >= faults["abort_after_s"]:
        req.result["abort_at"] = time.time()
        req.handle.abort()
        return True
    if "exit_after_s" in faults and waited >= faults["exit_after_s"]:
        os._exit(EXIT_CODE)
    if "stop_after_s" in faults and waited >= faults["stop_after_s"]:
        stop_self(plan, "decode")
    return False


def delay_success_mark(mgr: Any, delays: dict) -> None:
    """Prefill fault `mark_delay_s` ({room: seconds}): the first Success of those rooms is marked on this rank
    that much later, wherever the manager's own steps put the Status to the decode around the mark."""
    if not delays:
        return
    from sglang.srt.disaggregation.base.conn import KVPoll

    update, pending = mgr.update_status, {int(room): float(s) for room, s in delays.items()}

    def delayed(room: int, status: int) -> None:
        if status == KVPoll.Success and room in pending:
            time.sleep(pending.pop(room))
        update(room, status)

    mgr.update_status = delayed


def fail_metadata_part_way(mgr: Any, rooms: dict) -> None:
    """Decode fault `metadata_fails_after`: the room's RoomMetadata reaches its first n prefill ranks only."""
    if not rooms:
        return
    from sglang_p2p_backend.engine.wire.control import ControlError

    send, sent = mgr.send_room, {int(room): int(n) for room, n in rooms.items()}

    def failing(endpoint: str, room: int, frames: list) -> None:
        if room in sent:
            if sent[room] <= 0:
                time.sleep(1.0)  # the registration with it timing out, while the first ranks already write
                raise ControlError(f"injected: prefill rank {endpoint} is gone")
            sent[room] -= 1
        send(endpoint, room, frames)

    mgr.send_room = failing


def misdirect_aux(mgr: Any, rows: dict) -> None:
    """Prefill fault `aux_row` ({room: row}): the aux row of those rooms is sent to that row of the decode
    instead of the one it published (a buggy or compromised prefill; two-sided transports)."""
    if not rows:
        return
    aux_message = mgr.workers._aux_message
    mgr.workers._aux_message = lambda session, room, src, dst: aux_message(session, room, src,
                                                                           int(rows.get(str(room), dst)))


def corrupt_after_arrival(faults: dict, pools: Any, req: Req) -> None:
    """Decode fault `corrupt_after_arrival` ([room, ...]): the first byte of the room's first page, KV region 0,
    is inverted after the transfer landed (memory going bad between the transfer and the forward)."""
    if req.room in faults.get("corrupt_after_arrival", ()) and len(req.pages):
        pools.kv[0][int(req.pages[0]), 0] ^= 0xFF


def shorten_ipc_export(mgr: Any, nbytes: int) -> None:
    """Decode fault `ipc_export_short`: the export no longer covers the pool it registers (a forged or buggy
    peer); its first region loses `nbytes`."""
    if mgr.ipc is not None and mgr.ipc.export is not None:
        mgr.ipc.export.regions[0].length -= nbytes
