"""This rank's memory as SGLang describes it: KV regions, state components' regions and aux buffers.

Every transport works from it: the one-sided ones register it and address its regions in their descriptors,
the two-sided path sends aux rows out of it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property
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

    @cached_property
    def _aux_views(self) -> list[memoryview]:
        """Each aux buffer's bytes, viewed once: SGLang keeps them in host memory for the process's life."""
        return [memoryview((ctypes.c_char * r.length).from_address(r.ptr)).cast("B") for r in self.aux]

    def aux_row(self, index: int, lens: Sequence[int]) -> list[bytes]:
        """Row `index` of the first len(lens) aux buffers, `lens[i]` bytes of buffer i's (a copy, taken now). A slice
        of a view made once, where one `ctypes.string_at` a buffer at addresses numpy worked out took half a room's
        conclusion on the host (docs/bench.md, "A room's conclusion on the host")."""
        rows = []
        for view, r, n in zip(self._aux_views, self.aux, lens):
            start = r.item_len * index
            if index < 0 or n > r.item_len or start + n > r.length:
                raise IndexError(f"aux row {index} ({n} bytes) is outside an aux buffer of {r.length} bytes "
                                 f"({r.item_len} a row)")
            rows.append(view[start:start + n].tobytes())
        return rows
