"""SGLang's own KV pool classes on CPU for the driver processes, described to the manager by SGLang's own code
(`get_contiguous_buf_infos`, `setup_state_kv_args`): the KV regions, state components and KVArgs fields are
exactly what a scheduler of that pool hands the backend.

`sglang_pool="swa"`: `SWAKVPool` over `MHATokenToKVPool`, even layers sliding-window, odd layers full attention.
The full layers' K and V are the KV regions (page ids of the full pool); the sliding-window layers' K and V are
one state component of type SWA, addressed by page ids of the SWA sub-pool, `swa_pages` of them per request.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sglang_p2p_backend.engine.copy.memory import page_views, regions_from_lists
from sglang_p2p_backend.testing.pools import SENTINEL, HostPools, PoolSpec, StateComponent


def _views(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], device: str) -> list[torch.Tensor]:
    views = page_views(regions_from_lists(ptrs, lens, item_lens), torch.device(device))
    for t in views:
        t.fill_(SENTINEL)
    return views


class SGLangPools(HostPools):
    """Views of an SGLang pool's memory; KVArgs filled by SGLang's own functions."""

    def kv_lists(self) -> tuple[list[int], list[int], list[int]]:
        return tuple(list(x) for x in self.owner.get_contiguous_buf_infos())

    def describe(self, args: Any) -> None:
        from sglang.srt.disaggregation.utils import setup_state_kv_args

        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = self.kv_lists()
        setup_state_kv_args(args, self.owner, None, self.spec.num_layers)


def allocate(spec: PoolSpec) -> HostPools:
    """The pool `spec.sglang_pool` names, with `spec.num_pages` pages in each of its page-addressed pools."""
    if spec.sglang_pool != "swa" or spec.layout != "mha":
        raise ValueError(f"sglang_pool must be 'swa' over an mha layout, got {spec.sglang_pool!r} over {spec.layout!r}")
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    tokens = (spec.num_pages - 1) * spec.page_size  # SGLang adds one padding page
    pool = SWAKVPool(size=tokens, size_swa=tokens, page_size=spec.page_size, dtype=getattr(torch, spec.dtype),
                     head_num=spec.kv_heads, head_dim=spec.head_dim,
                     swa_attention_layer_ids=list(range(0, spec.num_layers, 2)),
                     full_attention_layer_ids=list(range(1, spec.num_layers, 2)),
                     device=spec.device, enable_memory_saver=False)
    kv = _views(*pool.get_contiguous_buf_infos(), spec.device)
    window = StateComponent(_views(*pool.get_state_buf_infos(), spec.device), spec.swa_pages, first_item=1)
    return SGLangPools(spec, kv, [window], owner=pool)
