"""The transport interface: what moves the bytes of a planned chunk between one prefill and one decode rank.

Two shapes, as in the field:
- `TwoSidedTransport` (NCCL, the CPU `tcp` stand-in): one ordered pair channel (`PairComm`) per (prefill
  rank, decode rank), created on first use from a unique id that the prefill makes and carries on the control
  channel. The prefill gathers pages into staging and `send`s; the decode `recv`s into staging and scatters.
  Both sides issue their operations on a pair in the same order (the control channel is ordered per peer).
- `OneSidedTransport` (Mooncake Transfer Engine): the prefill writes merged page runs straight into registered
  decode memory; the decode learns completion on the control channel.

Rank 0 of a pair is always the prefill (sender), rank 1 the decode (receiver). Nothing here imports SGLang.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch


class TransportError(RuntimeError):
    """A transfer that cannot complete: peer lost, timeout, aborted channel. The message names the cause."""


class Completion(ABC):
    """Handle of one posted operation."""

    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Block until done; raise TransportError on failure or after `timeout` seconds."""

    @abstractmethod
    def done(self) -> bool:
        """Non-blocking: True once finished (successfully or not)."""


class DoneCompletion(Completion):
    """Completion of an operation that finished synchronously."""

    def wait(self, timeout: float) -> None:
        return None

    def done(self) -> bool:
        return True


class PairComm(ABC):
    """An ordered, two-rank channel between one prefill rank and one decode rank."""

    #: device of the buffers this channel moves (cuda:N for NCCL, cpu for tcp)
    device: torch.device
    #: stream the channel's operations run on; gather/scatter kernels for it are issued there too. None on CPU.
    stream: Optional["torch.cuda.Stream"] = None
    #: a second stream of this channel alone, for the gather or scatter of one chunk while `stream` moves the
    #: next (engine/pair/pipeline.py); None where the transport has none (CPU), then nothing overlaps
    side_stream: Optional["torch.cuda.Stream"] = None

    @abstractmethod
    def send(self, buf: torch.Tensor) -> Completion:
        """Post a send of the whole contiguous uint8 `buf` to the other rank."""

    @abstractmethod
    def recv(self, buf: torch.Tensor) -> Completion:
        """Post a receive of exactly `buf.numel()` bytes into the contiguous uint8 `buf`."""

    @abstractmethod
    def abort(self) -> None:
        """Tear the channel down without waiting for the peer (it may be dead); idempotent."""

    def close(self) -> None:
        """Orderly release; defaults to abort."""
        self.abort()


class TwoSidedTransport(ABC):
    name: str = "two-sided"

    @abstractmethod
    def new_unique_id(self, max_ctas: Optional[int] = -1) -> bytes:
        """Prefill side: make the id that lets the decode rank join a new pair channel; `max_ctas` caps its
        channels where the transport has any (-1: the transport's default, None: no cap)."""

    @abstractmethod
    def connect(self, unique_id: bytes, rank: int, timeout: float) -> PairComm:
        """Join the pair channel named by `unique_id` as `rank` (0 prefill, 1 decode). Both ranks call it;
        it returns once both joined, or raises TransportError after `timeout` seconds."""

    @abstractmethod
    def alloc_staging(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 buffer of `nbytes` the channel can send from / receive into."""

    def close(self) -> None:
        """Release transport-wide resources (not the pair channels, which their owners close)."""


class OneSidedTransport(ABC):
    name: str = "one-sided"

    @abstractmethod
    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register local memory regions given as (address, length) so peers can write into them."""

    @abstractmethod
    def session_id(self) -> str:
        """What a peer needs to address this process's registered memory; travels in the registration."""

    @abstractmethod
    def write(self, session: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        """Write `lengths[i]` bytes from local `src[i]` to the peer's `dst[i]` as one batch; blocks until
        done and raises TransportError on failure."""

    def unregister(self) -> None:
        """Deregister every region `register` took (SGLang pauses the KV memory under it: a registration names
        physical pages that are about to go); `register` may be called again afterwards. Nothing by default."""

    def forget_peer(self, session: str) -> None:
        """The peer at `session` is gone: drop what this transport keeps for it (nothing, by default)."""

    def close(self) -> None:
        """Deregister memory and release the engine."""
