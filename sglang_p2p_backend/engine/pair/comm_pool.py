"""Policy of the NCCL pair-communicator pool of one GPU: which channel cap a new pair communicator gets, which
idle communicators to close, and when a peer does not fit at all. Pure: no NCCL, no torch, no clock.

Each extra 2-rank communicator costs GPU memory that grows with its channel cap and buys bandwidth
(`CommCost`; docs/nccl.md: 22/38/70/134/262 MB at 2/4/8/16/default channels for 68/133/266/366/368 GB/s;
`H200_COST` / `H200_COST_NO_CUMEM`: this project's measurement per side, where the decode GPU pays about twice
the prefill's, and twice again without cuMem, SGLang's default). Pick the table of the GPU's role and env. The pool keeps the sum of live communicators within `budget_mb`:
- the cap follows the number of live peers: the largest cap of the ladder such that that many peers fit the
  budget at that cap (few peers: full-speed communicators; many peers: lean ones);
- `admit(peer)` answers, in this order: reuse the peer's live communicator; open one at the fair cap if it
  fits; else close idle communicators fatter than the fair cap (least recently used first; they come back
  leaner on their next use); else open at a leaner cap that fits; else close least recently used idle
  communicators; else `Admission.NO_FIT`: the caller hands the peer to the RDMA transport or waits for a
  busy communicator to be released. Lack of memory never fails a transfer.
- the decision is committed when returned (victims leave the accounting, the new peer's memory is reserved);
  the caller closes the victims before creating the communicator and reports `opened` or `failed`.

Both ranks of a pair must use one cap (`transport.nccl` carries it in the pair id), so the decode side calls
`admit(peer, max_cap=<prefill's proposal>)` and the prefill uses the smaller of the two answers.
The pool is not thread-safe: one thread (the comm manager of the GPU) owns it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Mapping, Optional, Sequence

#: channel cap of a communicator; None = NCCL's own choice (no maxCTAs in the config)
Cap = Optional[int]


@dataclass(frozen=True)
class CommCost:
    """GPU memory (MB) and send/recv bandwidth (GB/s) of one extra communicator, by channel cap."""

    mb: Mapping[Cap, float]
    gbps: Mapping[Cap, float] = field(default_factory=dict)

    def mb_of(self, cap: Cap) -> float:
        if cap in self.mb:
            return self.mb[cap]
        # an unmeasured cap: interpolate per channel between the measured ones (memory is ~ fixed + k * channels)
        known = sorted((c, m) for c, m in self.mb.items() if c is not None)
        if cap is None or not known:
            raise KeyError(f"no memory figure for channel cap {cap}")
        below = [(c, m) for c, m in known if c <= cap] or known[:1]
        above = [(c, m) for c, m in known if c >= cap] or known[-1:]
        (c0, m0), (c1, m1) = below[-1], above[0]
        return m0 if c1 == c0 else m0 + (m1 - m0) * (cap - c0) / (c1 - c0)

    @classmethod
    def from_bench(cls, path: str, side: str = "", table: str = "comm_cost") -> "CommCost":
        """Figures measured by bench/transfer: its JSON's `table` ([{cap, mb, mb_prefill, mb_decode, gbps}, ...];
        `comm_cost_cumem0` for NCCL_CUMEM_ENABLE=0). `side` "prefill"/"decode" picks that GPU's cost, else
        the larger of the two."""
        with open(path) as f:
            rows = json.load(f)[table]
        key = f"mb_{side}" if side else "mb"
        return cls({r["cap"]: float(r[key]) for r in rows}, {r["cap"]: float(r["gbps"]) for r in rows})


#: measured on nvidia-h200-x2 (docs/nccl.md, "What a communicator costs"), NCCL 2.28.9 (caps set through NCCL_MIN/MAX_NCHANNELS)
ANCHOR_COST = CommCost(
    mb={2: 22.0, 4: 38.0, 8: 70.0, 16: 134.0, None: 262.0},
    gbps={2: 68.0, 4: 133.0, 8: 266.0, 16: 366.0, None: 368.0},
)

# Measured by bench/transfer on nvidia-h200-x2 (bench/results/transfer_nvidia-h200-x2.json, NCCL 2.28.9, caps
# through ncclConfig_t, after the first send). The decode (receiving) GPU pays about twice the prefill's.
_H200_GBPS = {2: 66.6, 4: 127.8, 8: 242.4, 16: 326.6, None: 324.5}
H200_COST = {
    "prefill": CommCost({2: 23.1, 4: 37.7, 8: 71.3, 16: 138.4, None: 272.6}, _H200_GBPS),
    "decode": CommCost({2: 39.8, 4: 71.3, 8: 138.4, 16: 272.6, None: 541.1}, _H200_GBPS),
}
#: the same with NCCL_CUMEM_ENABLE=0, which SGLang sets unless symmetric memory is on: legacy IPC buffers
H200_COST_NO_CUMEM = {
    "prefill": CommCost({2: 47.5, 4: 93.0, 8: 184.5, 16: 369.1, None: 637.5}, _H200_GBPS),
    "decode": CommCost({2: 64.3, 4: 126.5, 8: 251.7, 16: 503.3, None: 906.0}, _H200_GBPS),
}


class Admission(Enum):
    REUSE = "reuse"  # the peer has a live communicator: use it
    OPEN = "open"  # close `victims` (if any), then open a communicator at `cap`
    NO_FIT = "no_fit"  # nothing fits now: hand the peer to RDMA, or wait for a release and ask again


@dataclass(frozen=True)
class Decision:
    action: Admission
    cap: Cap = None
    victims: tuple[Hashable, ...] = ()
    reason: str = ""


@dataclass
class _Entry:
    cap: Cap
    mb: float
    busy: int = 0
    opening: bool = True


class CommPool:
    def __init__(
        self,
        budget_mb: float,
        *,
        ladder: Sequence[Cap] = (16, 8, 4),
        cost: CommCost = ANCHOR_COST,
        max_comms: Optional[int] = None,
    ):
        if budget_mb <= 0:
            raise ValueError(f"communicator budget must be positive, got {budget_mb} MB")
        if not ladder:
            raise ValueError("the cap ladder needs at least one cap")
        self.budget_mb = float(budget_mb)
        self.cost = cost
        # fattest first; None (NCCL default) counts as the fattest
        self.ladder: tuple[Cap, ...] = tuple(sorted(ladder, key=lambda c: -(c if c is not None else 1 << 30)))
        self.max_comms = max_comms
        self._live: "OrderedDict[Hashable, _Entry]" = OrderedDict()  # least recently used first

    # -- queries -----------------------------------------------------------------------------------------
    @property
    def used_mb(self) -> float:
        return sum(e.mb for e in self._live.values())

    def live(self) -> dict[Hashable, Cap]:
        return {p: e.cap for p, e in self._live.items()}

    def cap_of(self, peer: Hashable) -> Cap:
        return self._live[peer].cap

    def fair_cap(self, n_peers: int) -> Cap:
        """The fattest cap at which `n_peers` communicators fit the budget (the leanest if none does)."""
        for cap in self.ladder:
            if n_peers * self.cost.mb_of(cap) <= self.budget_mb:
                return cap
        return self.ladder[-1]

    def _idle_lru(self) -> list[Hashable]:
        return [p for p, e in self._live.items() if e.busy == 0 and not e.opening]

    def _fatter(self, a: Cap, b: Cap) -> bool:
        return self.ladder.index(a) < self.ladder.index(b) if a in self.ladder and b in self.ladder else False

    # -- the decision ----------------------------------------------------------------------------------
    def admit(self, peer: Hashable, max_cap: Cap = None, *, evict: bool = True) -> Decision:
        """Decide how `peer` gets a communicator; commits the decision (see module docstring). `evict=False`:
        never close another peer's communicator (the decode side, which does not own its pairs' traffic)."""
        entry = self._live.get(peer)
        if entry is not None:
            self._live.move_to_end(peer)
            return Decision(Admission.REUSE, entry.cap, reason="live communicator")
        caps = [c for c in self.ladder if max_cap is None or (c is not None and c <= max_cap)]
        if not caps:
            raise ValueError(f"no cap of the ladder {self.ladder} is <= the peer's cap {max_cap}")
        fair = self.fair_cap(len(self._live) + 1)
        want = fair if fair in caps else caps[0]  # caps is a suffix of the ladder: fair is fatter than all
        free = self.budget_mb - self.used_mb
        slots_full = self.max_comms is not None and len(self._live) >= self.max_comms

        if not slots_full and self.cost.mb_of(want) <= free:
            return self._open(peer, want, (), f"{len(self._live) + 1} peers: fair cap {want}")

        # 1. close idle communicators fatter than the fair cap: rebalance toward the new peer count
        fat = [p for p in self._idle_lru() if self._fatter(self._live[p].cap, want)] if evict else []
        victims = self._pick(fat, want, free, slots_full) if evict else None
        if victims is not None:
            return self._open(peer, want, victims, f"closing {len(victims)} idle communicator(s) above cap {want}")

        # 2. a leaner cap that fits without closing anything
        if not slots_full:
            for cap in caps[caps.index(want) + 1 :]:
                if self.cost.mb_of(cap) <= free:
                    return self._open(peer, cap, (), f"budget nearly full: lean cap {cap}")

        # 3. close least recently used idle communicators for the fair cap, else for the leanest
        for cap in (want, caps[-1]) if evict else ():
            victims = self._pick(self._idle_lru(), cap, free, slots_full)
            if victims is not None:
                return self._open(peer, cap, victims, f"closing {len(victims)} least recently used idle communicator(s)")

        busy = sum(1 for e in self._live.values() if e.busy or e.opening)
        return Decision(
            Admission.NO_FIT,
            reason=(
                f"{len(self._live)} communicators ({busy} busy) hold {self.used_mb:.0f} of {self.budget_mb:.0f} MB; "
                f"even cap {caps[-1]} ({self.cost.mb_of(caps[-1]):.0f} MB) does not fit: use RDMA or wait"
            ),
        )

    def __contains__(self, peer: Hashable) -> bool:
        return peer in self._live

    def would_admit(self, peer: Hashable, max_cap: Cap = None, *, evict: bool = True) -> Decision:
        """What `admit` would answer now, without committing anything."""
        entry = self._live.get(peer)
        if entry is not None:  # the common case (asked per chunk): no copy, and no LRU touch
            return Decision(Admission.REUSE, entry.cap, reason="live communicator")
        saved = OrderedDict((p, _Entry(e.cap, e.mb, e.busy, e.opening)) for p, e in self._live.items())
        try:
            return self.admit(peer, max_cap, evict=evict)
        finally:
            self._live = saved

    def idle(self, peer: Hashable) -> bool:
        """The peer has a communicator that is up and carries no transfer (it may be closed now)."""
        e = self._live.get(peer)
        return e is not None and e.busy == 0 and not e.opening

    def _pick(self, candidates: list[Hashable], cap: Cap, free: float, slots_full: bool) -> Optional[tuple]:
        """Fewest least-recently-used candidates whose closing makes room for one communicator at `cap`."""
        need = self.cost.mb_of(cap)
        victims: list[Hashable] = []
        for p in candidates:
            if free >= need and not slots_full:
                break
            victims.append(p)
            free += self._live[p].mb
            slots_full = False
        if free >= need and not slots_full:
            return tuple(victims)
        return None

    def _open(self, peer: Hashable, cap: Cap, victims: tuple, reason: str) -> Decision:
        for v in victims:
            del self._live[v]
        self._live[peer] = _Entry(cap, self.cost.mb_of(cap))
        return Decision(Admission.OPEN, cap, victims, reason)

    # -- what the owner reports ----------------------------------------------------------------------
    def opened(self, peer: Hashable, cap: Cap = -1) -> None:
        """The communicator admitted for `peer` is up (idle). `cap`: the cap it really got, when the two ranks
        settled on a leaner one than admitted."""
        e = self._live.get(peer)
        if e is None:  # a communicator the pool did not admit (a peer that skipped the offer): count it anyway
            cap = None if cap == -1 else cap
            e = self._live[peer] = _Entry(cap, self.cost.mb_of(cap) if cap is not None or None in self.cost.mb else 0.0)
        e.opening = False
        if cap != -1 and cap != e.cap:
            e.cap, e.mb = cap, self.cost.mb_of(cap)

    def failed(self, peer: Hashable) -> None:
        """Opening failed, or the communicator was aborted/closed: its memory is free again."""
        self._live.pop(peer, None)

    closed = failed

    def acquire(self, peer: Hashable) -> None:
        """A transfer starts on the peer's communicator: it cannot be evicted until `release`."""
        e = self._live[peer]
        e.busy += 1
        self._live.move_to_end(peer)

    def release(self, peer: Hashable) -> None:
        e = self._live.get(peer)
        if e is not None and e.busy > 0:
            e.busy -= 1
            self._live.move_to_end(peer)
