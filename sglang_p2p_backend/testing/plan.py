"""What a run's plan asks of one role's process: its requests, its rank's share of the pools, the DP rank that
takes a room, and the ready markers the processes of both roles meet at (files in the plan's workdir).

The plan is one JSON file both roles read (testing/launch.py writes it): the pool layout, the requests (room,
prompt tokens, chunking, decode prefix, aborts), per-role settings and optional faults (testing/faults.py).
`dp` ({role: n}) runs n independent replicas of a server (SGLang's --dp-size without DP attention), each its
own process group of `tp` ranks; `reuse` (["aux", "pages"]) gives a concluded request's aux row (and a failed
one's pages) to the next request at once, as SGLang's allocators do. `send_after` ({room: names}) holds a
prefill request after its bootstrap until the names are ready (a scheduler that has not run its prefill yet);
`memory_release` ({role: {release_after, resume_after}}) releases and resumes a role's KV memory
(testing/memory_release.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

from sglang_p2p_backend.testing.pools import PoolSpec


def first_token(room: int) -> int:
    """The first output token the prefill writes into a request's aux row: one of its own per room, so a row
    that landed in another request's slot shows."""
    return 4242 + room % 100_000


@dataclass
class Req:
    room: int
    tokens: int
    chunk_pages: int
    prefix: int = 0  # decode prefix tokens (page aligned)
    #: {"side": "prefill"|"decode", "at": ...}: abort this request on that side at that point (prefill: "bootstrap",
    #: "chunk" after `n` chunks, "last" after the last chunk; decode: "init" before its metadata, "transfer" after it)
    abort: Optional[dict] = None
    #: start no sooner than this many seconds into the run, and only once `<after>.ready` exists (a name or a list;
    #: in the plan also {role: names}, each role waiting for its own)
    start_after_s: float = 0.0
    after: Any = ""
    #: the same room again (a retracted request bootstrapped anew): results go to "<room>#<attempt>"
    attempt: int = 1
    handle: Any = None
    phase: str = "new"
    pages: Optional[np.ndarray] = None
    aux: int = -1
    state_ids: Optional[list] = None  # per state component, the request's items (slot, window pages)
    sent: int = 0
    started: float = 0.0
    hold: Optional[tuple] = None  # decode, deferred release: (required_acks, monotonic deadline)
    snapshot: Optional[list] = None  # decode: the held pages' bytes when they were released
    result: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.room) if self.attempt == 1 else f"{self.room}#{self.attempt}"


def requests(plan: dict, role: str) -> list[Req]:
    """The plan's requests this role sees (a request may name `roles` to reach only one side)."""
    return [
        Req(r["room"], r["tokens"], r.get("chunk_pages", 1 << 30), r.get("prefix", 0),
            r["abort"] if r.get("abort", {}).get("side") == role else None, r.get("start_after_s", 0.0),
            _role_part(r.get("after", ""), role), r.get("attempt", 1))
        for r in plan["requests"]
        if role in r.get("roles", ("prefill", "decode"))
    ]


def _role_part(value: Any, role: str) -> Any:
    """A plan value given per role ({role: value}) as this role reads it; any other value as it is."""
    return value.get(role, "") if isinstance(value, dict) else value


def rank_heads(spec: PoolSpec, attn_tp: int, attn_tp_rank: int) -> PoolSpec:
    """An MHA pool of `total_kv_heads` heads as attention TP rank `attn_tp_rank` of `attn_tp` holds it: its
    `max(1, total // tp)` heads, contiguous blocks, or head `rank // (tp // total)` when heads are replicated
    (SGLang's MHA pool on a TP rank)."""
    if spec.layout != "mha" or not spec.total_kv_heads:
        return spec
    total = spec.total_kv_heads
    n = max(1, total // attn_tp)
    first = attn_tp_rank * n if total >= attn_tp else attn_tp_rank // (attn_tp // total)
    return replace(spec, kv_heads=n, heads_lo=first)


def dp_rank_of(plan: dict, role: str, room: int, dp: int) -> int:
    """The DP rank a role's DP controller picks for `room`: the prefill's default follows the bootstrap room
    (`room % dp`, what the decode's bootstrap lookup assumes); another load balancer may pick anything, so the
    plan may name it per room (`decode_dp_rank`, `prefill_dp_rank`), else `room % dp` too."""
    chosen = plan.get(f"{role}_dp_rank", {}).get(str(room))
    return int(chosen) if chosen is not None else room % dp


def touch(plan: dict, name: str) -> None:
    """Mark `name` ready for the other processes of the run."""
    open(os.path.join(plan["workdir"], f"{name}.ready"), "w").close()


def ready(plan: dict, names: Any) -> bool:
    """Whether every one of `names` (a name or a list; empty ones skipped) was marked ready."""
    names = [names] if isinstance(names, str) else names
    return all(os.path.exists(os.path.join(plan["workdir"], f"{n}.ready")) for n in names if n)


def wait_for(plan: dict, names: list[str], timeout: float = 120) -> None:
    """Wait until every one of `names` was marked ready. Raises RuntimeError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(plan["workdir"], f"{n}.ready")) for n in names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"peers {names} not ready after {timeout:.0f}s")
        time.sleep(0.05)
