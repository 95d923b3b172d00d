"""Per-worker circuit breaker with half-open probes (smg's `--cb-*` flags), pure state, no I/O.

closed: requests flow; consecutive failed legs are counted (a failure more than `window` after the previous
one starts the count again) and `failure_threshold` of them open the circuit.
open: the worker gets no new requests for `timeout` seconds, then the circuit is half-open.
half-open: at most `max_probes` requests at a time go to the worker as probes; `success_threshold`
successes close the circuit, any failure opens it again for another `timeout`.
A failure is a transport error, a timeout or a 5xx status on the worker's own leg; a 4xx is the request's
fault and a leg cancelled because the other leg failed says nothing about this worker: neither counts.
Health checks re-admitting a worker (it was ejected, then answered again) make an open circuit half-open at
once, so a restarted worker gets probe traffic without waiting out the open timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal

State = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class BreakerConfig:
    # smg 1.13's defaults
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout: float = 60.0
    window: float = 120.0
    max_probes: int = 1  # requests in flight on a half-open worker
    enabled: bool = True


class CircuitBreaker:
    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self._clock = cfg, clock
        self.state: State = "closed"
        self.failures = 0
        self.successes = 0
        self.probes = 0
        self.opened_at = 0.0
        self.last_failure = float("-inf")
        self.generation = 0  # bumped on every transition, so a probe started before one is not counted after
        self.transitions = 0

    def _to(self, state: State) -> None:
        if state != self.state:
            self.state = state
            self.generation += 1
            self.transitions += 1
        self.failures = self.successes = self.probes = 0
        if state == "open":
            self.opened_at = self._clock()

    def current(self) -> State:
        """The state now (an open circuit whose timeout has passed becomes half-open)."""
        if self.state == "open" and self._clock() - self.opened_at >= self.cfg.timeout:
            self._to("half_open")
        return self.state

    def allows(self) -> bool:
        """Whether a new request may go to the worker."""
        if not self.cfg.enabled:
            return True
        state = self.current()
        return state == "closed" or (state == "half_open" and self.probes < self.cfg.max_probes)

    def begin(self) -> int | None:
        """A request was dispatched; returns a probe ticket when it is a half-open probe (give it to end)."""
        if self.cfg.enabled and self.current() == "half_open":
            self.probes += 1
            return self.generation
        return None

    def end(self, ticket: int | None, ok: bool | None) -> None:
        """The leg ended: ok True (success), False (failure) or None (says nothing about the worker)."""
        if ticket is not None and ticket == self.generation and self.probes > 0:
            self.probes -= 1
        if ok is True:
            self.record_success()
        elif ok is False:
            self.record_failure()

    def record_success(self) -> None:
        if not self.cfg.enabled:
            return
        state = self.current()
        self.failures = 0
        if state == "half_open":
            self.successes += 1
            if self.successes >= self.cfg.success_threshold:
                self._to("closed")

    def record_failure(self) -> None:
        if not self.cfg.enabled:
            return
        now = self._clock()
        state = self.current()
        if state == "half_open":
            self._to("open")
        elif state == "closed":
            if now - self.last_failure > self.cfg.window:
                self.failures = 0
            self.failures += 1
            if self.failures >= self.cfg.failure_threshold:
                self._to("open")
        self.last_failure = now

    def readmit(self) -> None:
        """Health checks found the worker answering again: probe it now instead of after the timeout."""
        if self.cfg.enabled and self.current() == "open":
            self._to("half_open")

    def snapshot(self) -> dict:
        return {"state": self.current(), "consecutive_failures": self.failures, "half_open_successes": self.successes, "probes_in_flight": self.probes}
