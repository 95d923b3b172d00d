"""SGLang's own KV pool classes on CPU for the driver processes, described to the manager by SGLang's own code
(`get_contiguous_buf_infos`, `setup_state_kv_args`): the KV regions, state components and KVArgs fields are
exactly what a scheduler of that pool hands the backend.

`sglang_pool="swa"`: `SWAKVPool` over `MHATokenToKVPool`, even layers sliding-window, odd layers full attention.
The full layers' K and V are the KV regions (page ids of the full pool); the sliding-window layers' K and V are
one state component of type SWA, addressed by page ids of the SWA sub-pool, `swa_pages` of them per request.

`sglang_pool="mamba"`: `HybridLinearKVPool` over `MambaPool` with a GDN-shaped state (Qwen3-Next's
`Mamba2StateShape`: conv state cat([q | k | v]) x (K-1) in bf16 with its conv sub-blocks, temporal state heads x
head_dim x state in fp32), sharded over `state_tp` as SGLang shards it on that TP rank; even layers linear
attention, odd layers full attention (the KV regions). One mamba component of one region per layer and tensor,
one slot per request (slot 0 is SGLang's padding slot). Its contents are defined for the model's whole state
tensors, each rank holding its shard of them, so a decode rank of another TP checks exactly its slice.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from sglang_p2p_backend.engine.copy.memory import page_views, regions_from_lists
from sglang_p2p_backend.testing.pools import SENTINEL, HostPools, PoolSpec, StateComponent, expected_pages


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


class MambaPools(SGLangPools):
    """SGLang's hybrid linear pool: a request's state items are its shard of the model's state tensors."""

    def _state_items(self, seed: int, room: int, ids: list[np.ndarray]):
        mamba = self.owner.mamba_pool
        dims, outer, groups = (mamba.get_state_dim_per_tensor(), mamba.get_state_slice_outer_counts(),
                               mamba.get_state_conv_shard_groups())
        tp, rank = self.spec.state_tp, self.spec.state_tp_rank
        for c, (comp, item_ids) in enumerate(zip(self.states, ids)):
            idx = torch.from_numpy(np.asarray(item_ids, dtype=np.int64)).to(self.spec.device)
            for r, t in enumerate(comp.regions):
                full, unit = dims[r] * tp, t.shape[1] // (outer[r] * dims[r])
                # the model's whole item (the same on every rank of either role), then this rank's shard of it
                model = expected_pages(seed, room, -1 - 64 * c - r, len(idx), outer[r] * full * unit)
                model = model.view(len(idx), outer[r], full, unit)
                yield t, idx, model[:, :, _shard(full, groups[r], tp, rank)].reshape(len(idx), -1)


def _shard(full: int, groups: Optional[Sequence[int]], tp: int, rank: int) -> list[int]:
    """The indices of a state tensor's sliced axis TP rank `rank` holds: its contiguous share of the axis, or of
    each conv sub-block (GDN's q, k, v are sharded one by one)."""
    out, base = [], 0
    for g in groups or [full]:
        n = g // tp
        out += range(base + rank * n, base + (rank + 1) * n)
        base += g
    return out


def _mamba(spec: PoolSpec) -> HostPools:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    heads, k_heads, head_dim = spec.mamba_heads, spec.mamba_heads // 2, 8
    key_dim, value_dim = k_heads * head_dim, heads * head_dim
    shape = Mamba2StateShape.create(tp_world_size=spec.state_tp, intermediate_size=value_dim, n_groups=k_heads,
                                    num_heads=heads, head_dim=head_dim, state_size=head_dim, conv_kernel=4,
                                    conv_shard_groups=[key_dim, key_dim, value_dim])  # as Qwen3-Next's config
    linear, full = list(range(0, spec.num_layers, 2)), list(range(1, spec.num_layers, 2))
    params = Mamba2CacheParams(shape=shape, layers=linear,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    slots = spec.state_slots or 16
    mamba = MambaPool(size=slots, spec_state_size=slots, cache_params=params, mamba_layer_ids=linear,
                      device=spec.device)
    tokens = (spec.num_pages - 1) * spec.page_size
    pool = HybridLinearKVPool(size=tokens, dtype=getattr(torch, spec.dtype), page_size=spec.page_size,
                              head_num=spec.kv_heads, head_dim=spec.head_dim, full_attention_layer_ids=full,
                              device=spec.device, mamba_pool=mamba)
    kv = _views(*pool.get_contiguous_buf_infos(), spec.device)
    state = StateComponent(_views(*pool.get_state_buf_infos(), spec.device), 1, first_item=1)
    return MambaPools(spec, kv, [state], owner=pool)


def allocate(spec: PoolSpec) -> HostPools:
    """The pool `spec.sglang_pool` names, with `spec.num_pages` pages in each of its page-addressed pools."""
    if spec.sglang_pool not in ("swa", "mamba") or spec.layout != "mha":
        raise ValueError(f"sglang_pool must be 'swa' or 'mamba' over an mha layout, got {spec.sglang_pool!r} over "
                         f"{spec.layout!r}")
    if spec.sglang_pool == "mamba":
        return _mamba(spec)
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
