"""The worker registry: each prefill/decode server, its health state and the load the LB knows about.

Load is kept per DP rank. Local counters move at dispatch and at the end of each leg, so they are never
stale; polled server loads (see loads.py) are added on top only for the part this LB did not dispatch.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal
from urllib.parse import urlsplit

from .circuit import BreakerConfig, CircuitBreaker

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")

# Weight of a new latency sample in the exponentially weighted average (about the last 10 requests).
LATENCY_ALPHA = 0.1


def normalize_url(url: str) -> str:
    """`http://host:port` without a trailing slash; raises ValueError for anything else."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL must look like http://host:port, got {url!r}")
    try:
        parts.port
    except ValueError as e:
        raise ValueError(f"bad port in worker URL {url!r}: {e}") from None
    return url


def bootstrap_host_of(url: str) -> str:
    """The host decode servers reach the prefill's bootstrap server at; IPv6 literals in brackets."""
    host = urlsplit(url).hostname or ""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    except ValueError:
        pass
    return host


@dataclass
class PolledLoad:
    """One poll of a worker's load endpoint, and what this LB had in flight on it at that moment."""

    at: float
    tokens: list[float]  # prefill: queued prompt tokens per rank; decode: unused
    reqs: list[float]  # running + waiting requests per rank
    kv_usage: float
    local_tokens: list[float]
    local_reqs: list[float]
    #: decode: KV tokens in use or asked for by queued requests, all ranks (None: the server does not say)
    kv_demand: float | None = None
    kv_capacity: float = 0.0  # the pool's tokens, all ranks


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    bootstrap_port: int | None = None
    node: str = ""
    dp_size: int = 1
    # health: `healthy` False means ejected (not routable); `degraded` means failing its checks but kept in
    # rotation, being the last of its role that could take a request (ejecting it would be a certain outage)
    healthy: bool = True
    degraded: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    consecutive_timeouts: int = 0
    last_error: str = ""
    # its /get_server_info was read (DP size). Kept here, not in a set of id(worker): CPython gives a new
    # Worker the id of a removed one, which then skipped the reading
    info_read: bool = False
    load_error: str = ""  # why its last load answer was unusable ("" when usable), so that it is logged once
    # local load per DP rank
    inflight_reqs: list[int] = field(default_factory=lambda: [0])
    inflight_tokens: list[int] = field(default_factory=lambda: [0])
    polled: PolledLoad | None = None
    latency: float | None = None  # EWMA seconds of one leg (prefill: per 1k prompt tokens)
    selected: int = 0
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(BreakerConfig(enabled=False)), repr=False)
    # callbacks of the attempts in flight on this worker, told when health checks find it stalled
    stall_watchers: set[Callable[["Worker", str], None]] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        if not self.node:
            self.node = urlsplit(self.url).hostname or self.url
        self.set_dp_size(self.dp_size)

    @property
    def state(self) -> str:
        """healthy, degraded (failing but still tried) or ejected."""
        return "ejected" if not self.healthy else "degraded" if self.degraded else "healthy"

    @property
    def bootstrap_host(self) -> str:
        return bootstrap_host_of(self.url)

    def set_dp_size(self, n: int) -> None:
        n = max(1, int(n))
        if n != len(self.inflight_reqs):
            # in-flight work started under the old size stays on rank 0's books until it ends
            self.inflight_reqs = [sum(self.inflight_reqs)] + [0] * (n - 1)
            self.inflight_tokens = [sum(self.inflight_tokens)] + [0] * (n - 1)
            self.polled = None
        self.dp_size = n

    # ------------------------------------------------------------ load
    def _external(self, polled: list[float], local_at_poll: list[float], rank: int, max_age: float, now: float) -> float:
        """Load on `rank` that this LB did not dispatch: polled minus our own in-flight at poll time.

        The since-poll credit is implicit: our current local count (used by the caller) already holds
        what we dispatched and released after the poll, so only foreign load is taken from the poll.
        """
        p = self.polled
        if p is None or now - p.at > max_age or rank >= len(polled):
            return 0.0
        return max(0.0, polled[rank] - local_at_poll[rank])

    def prefill_load(self, rank: int, max_age: float = 10.0, now: float | None = None) -> float:
        """Outstanding prompt tokens on one rank."""
        now = time.monotonic() if now is None else now
        ext = self._external(self.polled.tokens, self.polled.local_tokens, rank, max_age, now) if self.polled else 0.0
        return self.inflight_tokens[rank] + ext

    def decode_load(self, rank: int, max_age: float = 10.0, now: float | None = None) -> float:
        """Running requests on one rank."""
        now = time.monotonic() if now is None else now
        ext = self._external(self.polled.reqs, self.polled.local_reqs, rank, max_age, now) if self.polled else 0.0
        return self.inflight_reqs[rank] + ext

    def kv_usage(self, max_age: float = 10.0) -> float:
        """The decode's KV pool use as a fraction (above 1: more asked for than it holds). Where the poll gave
        the demand in tokens, what this LB dispatched or saw finish since moves it: between two polls (1 s) a
        burst would otherwise all go to the decode that looked emptiest, more than its pool holds (seen on
        4 x H200: 40 requests of 12k tokens onto one decode in 2 s, 20 of them waiting for pages)."""
        p = self.polled
        if p is None or time.monotonic() - p.at > max_age:
            return 0.0
        if p.kv_demand is None or p.kv_capacity <= 0:
            return p.kv_usage
        since = sum(self.inflight_tokens) - sum(p.local_tokens)
        return max(0.0, p.kv_demand + since) / p.kv_capacity

    def record_poll(self, tokens: list[float], reqs: list[float], kv_usage: float,
                    kv: tuple[float, float] | None = None) -> None:
        """One poll's figures (per rank), `kv` the decode's (demand, capacity) in tokens when it reports them."""
        if len(tokens) != self.dp_size or len(reqs) != self.dp_size:
            return  # DP size comes from /get_server_info; a poll that disagrees is not used
        demand, capacity = kv if kv is not None else (None, 0.0)
        self.polled = PolledLoad(time.monotonic(), tokens, reqs, kv_usage, list(self.inflight_tokens),
                                 list(self.inflight_reqs), demand, capacity)

    def notify_stalled(self, reason: str) -> None:
        """Fail the requests in flight here: the worker accepts connections but stopped answering."""
        for cb in list(self.stall_watchers):
            cb(self, reason)

    def note_answer(self) -> None:
        """It answered a request of ours (a load poll): busy perhaps, but not stopped, whatever the last probes say."""
        self.consecutive_timeouts = 0

    def observe_latency(self, seconds: float) -> None:
        self.latency = seconds if self.latency is None else (1 - LATENCY_ALPHA) * self.latency + LATENCY_ALPHA * seconds

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "bootstrap_port": self.bootstrap_port,
            "node": self.node,
            "dp_size": self.dp_size,
            "healthy": self.healthy,
            "state": self.state,
            "consecutive_failures": self.consecutive_failures,
            "consecutive_timeouts": self.consecutive_timeouts,
            "last_error": self.last_error,
            "inflight_requests": sum(self.inflight_reqs),
            "outstanding_tokens": sum(self.inflight_tokens),
            "polled": None if self.polled is None else {"age_s": round(time.monotonic() - self.polled.at, 3), "tokens": self.polled.tokens, "requests": self.polled.reqs, "kv_usage": self.polled.kv_usage},
            "latency_s": self.latency,
            "selected": self.selected,
            "circuit": self.breaker.snapshot() if self.breaker.cfg.enabled else None,
        }


class Lease:
    """The load one dispatched request puts on its pair; each side is released exactly once."""

    __slots__ = ("p", "d", "p_rank", "d_rank", "tokens", "p_tokens", "items", "_p_open", "_d_open")

    def __init__(self, p: Worker, d: Worker, p_rank: int, d_rank: int, tokens: int, items: int, p_tokens: int | None = None) -> None:
        # p_tokens: the prefill work when part of the prompt is expected in the prefill's cache
        self.p, self.d, self.p_rank, self.d_rank, self.tokens, self.items = p, d, p_rank, d_rank, tokens, items
        self.p_tokens = tokens if p_tokens is None else p_tokens
        p.inflight_tokens[p_rank] += self.p_tokens
        p.inflight_reqs[p_rank] += items
        d.inflight_reqs[d_rank] += items
        d.inflight_tokens[d_rank] += tokens
        p.selected += 1
        d.selected += 1
        self._p_open = self._d_open = True

    def release_prefill(self) -> None:
        if self._p_open:
            self._p_open = False
            self.p.inflight_tokens[self.p_rank] -= self.p_tokens
            self.p.inflight_reqs[self.p_rank] -= self.items

    def release_decode(self) -> None:
        if self._d_open:
            self._d_open = False
            self.d.inflight_reqs[self.d_rank] -= self.items
            self.d.inflight_tokens[self.d_rank] -= self.tokens

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()


class WorkerPool:
    """Prefill and decode workers by URL; add/remove at run time."""

    def __init__(self, breaker: BreakerConfig | None = None) -> None:
        self._workers: dict[tuple[Role, str], Worker] = {}
        self.breaker_cfg = breaker or BreakerConfig(enabled=False)
        # (prefill url, decode url) -> last dispatch time, the LB's view of live transfer channels
        self.channels: dict[tuple[str, str], float] = {}

    def add(self, w: Worker) -> Worker:
        key = (w.role, w.url)
        if key in self._workers:
            raise KeyError(f"{w.role} worker {w.url} is already registered")
        w.breaker = CircuitBreaker(self.breaker_cfg)
        self._workers[key] = w
        return w

    def remove(self, url: str, role: Role | None = None) -> list[Worker]:
        url = normalize_url(url)
        gone = [w for (r, u), w in self._workers.items() if u == url and (role is None or r == role)]
        for w in gone:
            del self._workers[(w.role, w.url)]
        for key in [k for k in self.channels if url in k]:
            del self.channels[key]
        return gone

    def get(self, role: Role, url: str) -> Worker | None:
        return self._workers.get((role, normalize_url(url)))

    def all(self, role: Role | None = None) -> list[Worker]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def routable(self, role: Role, exclude: set[str] = frozenset()) -> list[Worker]:
        """Workers in rotation whose circuit lets a request through; degraded ones only when no other is left."""
        ws = [w for w in self._workers.values() if w.role == role and w.healthy and w.url not in exclude and w.breaker.allows()]
        return [w for w in ws if not w.degraded] or ws

    def has_spare(self, w: Worker) -> bool:
        """Whether another worker of w's role could take its requests now (so ejecting w leaves the role served)."""
        return any(o is not w and o.role == w.role and o.healthy and not o.degraded and o.breaker.current() != "open" for o in self._workers.values())

    def note_channel(self, p: Worker, d: Worker) -> None:
        self.channels[(p.url, d.url)] = time.monotonic()

    def live_channels(self, ttl: float) -> set[tuple[str, str]]:
        cutoff = time.monotonic() - ttl
        stale = [k for k, t in self.channels.items() if t < cutoff]
        for k in stale:
            del self.channels[k]
        return set(self.channels)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)
