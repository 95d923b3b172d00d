"""Which transport moves a peer's pages: the `auto` policy of `SGLANG_P2P_TRANSPORT`, as a pure function.

`choose_transport` decides from facts the caller gathers (forced value, same host or not, whether the decode's
pools can be mapped through CUDA IPC, RDMA devices, GPU, Mooncake installed, whether the NCCL communicator pool
admits one more communicator); `TransportSelector`
adds the "log once per peer" part; `rdma_devices` is the one probe of the machine (sysfs), kept apart so the
policy stays testable without I/O. Nothing here imports SGLang, torch or Mooncake.

Policy for `auto` (GPU hosts):
0. peer on the same host, its pools exported and mappable here (same GPU or peer access) -> `cudaipc`: one
   copy kernel a chunk straight into the decode's pages, no staging, no communicator memory;
1. peer on another host and Mooncake can use RDMA -> `mooncake` (rdma): one-sided writes cost no GPU memory
   per peer, which is what makes 96P x 144D fan-out fit;
2. otherwise NCCL while the communicator pool admits another communicator;
3. pool at its budget and RDMA usable -> `mooncake` (rdma);
4. pool at its budget, no RDMA -> `nccl` anyway: the pool makes room (closes an idle communicator or the
   sender waits for one to be released), so GPU memory stays within budget at the price of waiting.
Without a GPU `auto` means the CPU two-sided `tcp` transport.

A peer can only be served by a transport it offers (its registration lists them): a decode that runs forced
`mooncake` offers only that, and an `auto` prefill then writes to it with Mooncake. `process_transports`
says which transports a process sets up at all (so `auto` on a host without RDMA never starts a Mooncake
engine, and forced `mooncake` never allocates NCCL staging).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Union

from sglang_p2p_backend.engine.config import AUTO, TRANSPORT_VAR as ENV_VAR, parse_transport

logger = logging.getLogger(__name__)

#: where the kernel lists RDMA devices (IB and RoCE HCAs alike)
SYSFS_INFINIBAND = "/sys/class/infiniband"

#: a bool, or a callable asked only when the answer matters (the pool's "does one more fit?")
BoolOrQuery = Union[bool, Callable[[], bool]]


@dataclass(frozen=True)
class PeerFacts:
    """What the choice for one peer depends on."""

    same_host: bool
    rdma_present: bool
    nccl_fits: BoolOrQuery
    gpu: bool = True
    #: this process runs a Mooncake engine
    mooncake_available: bool = True
    #: transports the peer can receive with (its registration); empty = not known, anything goes
    peer_offers: tuple[str, ...] = ()
    #: the peer's pools are exported and this process can map them (asked only for a same-host peer)
    ipc: BoolOrQuery = False

    def offered(self, transport: str) -> bool:
        return not self.peer_offers or transport in self.peer_offers


@dataclass(frozen=True)
class Choice:
    transport: str
    #: Mooncake protocol ("rdma" | "tcp") when transport is "mooncake", else None
    protocol: Optional[str]
    #: one line a person reads in the log to know why
    reason: str


def _ask(value: BoolOrQuery) -> bool:
    return bool(value() if callable(value) else value)


def parse_forced(value: Optional[str]) -> Optional[str]:
    """The transport forced by `SGLANG_P2P_TRANSPORT`, or None for `auto`/unset; ConfigError (a ValueError)
    for a typo."""
    name = parse_transport(value)
    return None if name == AUTO else name


def choose_transport(forced: Optional[str], facts: PeerFacts) -> Choice:
    """Pure `auto` policy (see module docstring). `forced` is the raw `SGLANG_P2P_TRANSPORT` value."""
    name = parse_forced(forced)
    mooncake_usable = facts.mooncake_available and facts.offered("mooncake")
    rdma_usable = facts.rdma_present and mooncake_usable
    if name is not None:
        protocol = None
        if name == "mooncake":
            # forced Mooncake still uses the NICs when there are any; tcp works anywhere
            protocol = "rdma" if facts.rdma_present else "tcp"
        return Choice(name, protocol, f"forced by {ENV_VAR}={name}")
    if facts.same_host and "cudaipc" in facts.peer_offers and _ask(facts.ipc):
        return Choice("cudaipc", None, "peer on the same host, its pools mapped through CUDA IPC: one copy kernel a chunk")
    two_sided = "nccl" if facts.gpu else "tcp"
    if mooncake_usable and not facts.offered(two_sided):
        protocol = "rdma" if facts.rdma_present else "tcp"
        return Choice("mooncake", protocol, f"peer receives only with Mooncake (not {two_sided}): Mooncake {protocol}")
    if not facts.gpu:
        return Choice("tcp", None, "no CUDA device: CPU two-sided tcp transport")
    if not facts.same_host and rdma_usable:
        return Choice("mooncake", "rdma", "peer on another host and RDMA devices present: Mooncake rdma")
    if _ask(facts.nccl_fits):
        where = "same host" if facts.same_host else "another host, no usable RDMA"
        return Choice("nccl", None, f"NCCL communicator pool has room ({where})")
    if rdma_usable:
        return Choice("mooncake", "rdma", "NCCL communicator pool at its GPU-memory budget: Mooncake rdma")
    missing = "Mooncake not installed" if facts.rdma_present else "no RDMA devices"
    return Choice("nccl", None, f"NCCL communicator pool at its budget and {missing}: NCCL once the pool makes room")


@dataclass(frozen=True)
class ProcessTransports:
    """The transports one process sets up: the same-host CUDA IPC path, a two-sided one, a Mooncake engine."""

    #: "nccl" | "tcp" | None (forced mooncake or cudaipc: no pair channels, no staging)
    two_sided: Optional[str]
    #: Mooncake protocol ("rdma" | "tcp"), or None when this process runs no Mooncake engine
    mooncake: Optional[str]
    #: CUDA IPC: the decode exports its pools, the prefill maps same-host peers' pools
    ipc: bool = False

    def names(self) -> list[str]:
        """What this process can move pages with, preferred first (goes in the decode's registration)."""
        return [n for n in ("cudaipc" if self.ipc else None, self.two_sided, "mooncake" if self.mooncake else None) if n]


def process_transports(forced: Optional[str], *, gpu: bool, rdma_present: bool, mooncake_available: bool,
                       ipc_capable: Optional[bool] = None) -> ProcessTransports:
    """Which transports a process starts for `SGLANG_P2P_TRANSPORT=forced`.

    Forced values start exactly that transport (forced `mooncake`: rdma with RDMA devices, tcp otherwise).
    `auto` starts NCCL on a GPU (tcp without one) with the CUDA IPC path beside it and, only on a GPU host with
    RDMA devices and Mooncake installed, a Mooncake rdma engine as well, for the peers `choose_transport` sends
    there. `ipc_capable` (default: `gpu`) says whether this process's pools can be shared with a same-host peer."""
    name = parse_forced(forced)
    ipc = gpu if ipc_capable is None else ipc_capable
    if name == "mooncake":
        return ProcessTransports(None, "rdma" if rdma_present else "tcp")
    if name == "cudaipc":
        if not ipc:
            raise ValueError(f"{ENV_VAR}=cudaipc needs the KV cache on a CUDA device; use auto or tcp on CPU")
        return ProcessTransports(None, None, ipc=True)
    if name is not None:
        return ProcessTransports(name, None)
    if gpu and rdma_present and mooncake_available:
        return ProcessTransports("nccl", "rdma", ipc=ipc)
    return ProcessTransports("nccl" if gpu else "tcp", None, ipc=ipc)


def rdma_present(sysfs: str = SYSFS_INFINIBAND, *, force_tcp: bool = False) -> bool:
    """RDMA devices exist and Mooncake may use them (`force_tcp`: `MC_FORCE_TCP` keeps it off them)."""
    return bool(rdma_devices(sysfs)) and not force_tcp


def rdma_devices(sysfs: str = SYSFS_INFINIBAND) -> list[str]:
    """Names of the RDMA devices this machine has (e.g. mlx5_0), empty when none or no sysfs."""
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


class TransportSelector:
    """Chooses per peer and logs the choice once per peer (again only if it changes)."""

    def __init__(self, forced: Optional[str] = AUTO, log: logging.Logger = logger) -> None:
        parse_forced(forced)  # fail at start-up on a typo, not at the first transfer
        self._forced = forced
        self._log = log
        self._last: dict[Hashable, Choice] = {}

    def choose(self, peer: Hashable, facts: PeerFacts) -> Choice:
        choice = choose_transport(self._forced, facts)
        previous = self._last.get(peer)
        if previous is None or (previous.transport, previous.protocol) != (choice.transport, choice.protocol):
            self._last[peer] = choice
            proto = f" ({choice.protocol})" if choice.protocol else ""
            self._log.info("transport for peer %s: %s%s: %s", peer, choice.transport, proto, choice.reason)
        return choice

    def forget(self, peer: Hashable) -> None:
        """The peer left: its next appearance is logged again."""
        self._last.pop(peer, None)
