"""Views of registered memory: a raw (address, length) region as a uint8 torch tensor, without copying.

SGLang describes its KV, aux and state pools by base address and length only (KVArgs), so the engine
wraps addresses: host memory through ctypes/numpy, CUDA memory through `__cuda_array_interface__`, which
torch consumes zero-copy.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Region:
    """One registered memory region: base address, byte length, and bytes of one page (item) in it."""

    ptr: int
    length: int
    item_len: int

    @property
    def num_items(self) -> int:
        return self.length // self.item_len if self.item_len else 0


class _CudaBuffer:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def region_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor aliasing `nbytes` at `ptr` on `device` (the caller keeps the memory alive)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        return torch.as_tensor(_CudaBuffer(ptr, nbytes), device=device)
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    return torch.from_numpy(arr)


def page_views(regions: Sequence[Region], device: torch.device) -> list[torch.Tensor]:
    """(num_items, item_len) uint8 views of regions, for indexed gather/scatter of whole pages."""
    views = []
    for r in regions:
        t = region_tensor(r.ptr, r.num_items * r.item_len, device)
        views.append(t.view(r.num_items, r.item_len) if r.item_len else t.view(0, 0))
    return views


def regions_from_lists(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int]) -> list[Region]:
    if not (len(ptrs) == len(lens) == len(item_lens)):
        raise ValueError(f"region lists differ in length: {len(ptrs)} ptrs, {len(lens)} lens, {len(item_lens)} items")
    return [Region(int(p), int(n), int(i)) for p, n, i in zip(ptrs, lens, item_lens)]
