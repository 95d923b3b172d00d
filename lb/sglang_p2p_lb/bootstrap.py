"""Bootstrap fields SGLang's PD servers need (docs/sglang-contract.md), added to a copy of the client body.

Prefill and decode get the same body plus `bootstrap_host/port/room` (lists of batch length for a batched
`/generate`, one fresh room per item). With DP attention, the room is drawn so that `room % dp_size` is
the chosen prefill rank (SGLang's default `follow_bootstrap_room` then agrees with `routed_dp_rank`),
the prefill gets `routed_dp_rank` (a policy that names no rank gets `room % dp_size`, so the rank is
known whatever the prefill's `--load-balance-method`), both sides get `disagg_prefill_dp_rank` (the decode
need not ask the prefill which rank holds the KV, and the prefill does not register its rank for that
query), and the decode gets its own `routed_dp_rank`.
"""

from __future__ import annotations

import random
from typing import Any

from .policy import Choice

ROOM_LIMIT = 2**63  # rooms are non-negative int64, as mini_lb and the Rust routers draw them
_rng = random.SystemRandom()


def new_room(dp_size: int = 1, rank: int | None = None) -> int:
    """A random room; when `rank` is given, one with `room % dp_size == rank`."""
    room = _rng.randrange(ROOM_LIMIT)
    if rank is None or dp_size <= 1:
        return room
    room -= room % dp_size
    room += rank
    return room if room < ROOM_LIMIT else room - dp_size


def build_bodies(body: dict[str, Any], choice: Choice, batch: int | None, dp_fields: bool) -> tuple[dict, dict, list[int]]:
    """Prefill body, decode body and the rooms drawn; `body` itself is not modified."""
    p, d = choice.prefill, choice.decode
    p_rank = choice.prefill_rank if dp_fields and p.dp_size > 1 else None
    rooms = [new_room(p.dp_size, p_rank) for _ in range(batch or 1)]
    common = dict(body)
    if batch is None:
        common.update(bootstrap_host=p.bootstrap_host, bootstrap_port=p.bootstrap_port, bootstrap_room=rooms[0])
    else:
        common.update(bootstrap_host=[p.bootstrap_host] * batch, bootstrap_port=[p.bootstrap_port] * batch, bootstrap_room=rooms)
    if not dp_fields or (p.dp_size <= 1 and d.dp_size <= 1):
        return common, common, rooms  # one body for both legs, serialized once
    p_body, d_body = dict(common), dict(common)
    if p.dp_size > 1:
        # with a batch and no chosen rank the items sit on different ranks: both sides follow the room
        if p_rank is not None or batch is None:
            rank = p_rank if p_rank is not None else rooms[0] % p.dp_size
            # the prefill runs the request on that rank whatever its --load-balance-method, and both sides
            # know it: the decode does not query the prefill's bootstrap server for it
            p_body["routed_dp_rank"] = rank
            p_body["disagg_prefill_dp_rank"] = d_body["disagg_prefill_dp_rank"] = rank
    if d.dp_size > 1 and choice.decode_rank is not None:
        d_body["routed_dp_rank"] = choice.decode_rank
    return p_body, d_body, rooms
