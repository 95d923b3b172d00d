"""This rank's memory as SGLang describes it: KV regions, state components' regions and aux buffers.

Every transport works from it: the one-sided ones register it and address its regions in their descriptors,
the two-sided path sends aux rows out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sglang_p2p_backend.engine.copy.memory import Region


@dataclass(frozen=True)
class LocalMemory:
    """KV regions, state components' regions, aux buffers (`item_len` of an aux region = bytes of one row)."""

    kv: Sequence[Region]
    state: Sequence[Sequence[Region]]
    aux: Sequence[Region]

    def pool_regions(self) -> list[tuple[int, int]]:
        """(address, length) of the KV regions, then the state components' regions: the pools page ids index."""
        return [(r.ptr, r.length) for r in [*self.kv, *(r for comp in self.state for r in comp)]]

    def regions(self) -> list[tuple[int, int]]:
        """(address, length) of every region, aux buffers included, for registration with the one-sided engine."""
        return self.pool_regions() + [(r.ptr, r.length) for r in self.aux]
