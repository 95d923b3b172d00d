"""SGLang's own KV pool classes on CPU for the driver processes, described to the manager by SGLang's own code
(`get_contiguous_buf_infos`, `setup_state_kv_args`): the KV regions, state components and KVArgs fields are
exactly what a scheduler of that pool hands the backend.

`sglang_pool="swa"`: `SWAKVPool` over `MHATokenToKVPool`, even layers sliding-window, odd layers full attention.
The full layers' K and V are the KV regions (page ids of the full pool); the sliding-window layers' K and V are
one state component of type SWA, addressed by page ids of the SWA sub-pool, `swa_pages` of them per request.
With `total_kv_heads` set, the pool holds this rank's `kv_heads` heads (from `heads_lo` on) in both sub-pools, and
the window pages' contents, like the KV's, are defined for the model's every head, so a decode rank of another
attention TP checks exactly its heads of each token row.

`sglang_pool="mamba"`: `HybridLinearKVPool` over `MambaPool` with a GDN-shaped state (Qwen3-Next's
`Mamba2StateShape`: conv state cat([q | k | v]) x (K-1) in bf16 with its conv sub-blocks, temporal state heads x
head_dim x state in fp32), sharded over `state_tp` as SGLang shards it on that TP rank; even layers linear
attention, odd layers full attention (the KV regions). One mamba component of one region per layer and tensor,
one slot per request (slot 0 is SGLang's padding slot). Its contents are defined for the model's whole state
tensors, each rank holding its shard of them, so a decode rank of another TP checks exactly its slice.

The other pools (SGLang 0.5.23), each the class that produces a state type, its components taken in the order
SGLang's `setup_state_kv_args` lists them, a request's items picked as SGLang's schedulers pick them (its KV
pages for what SGLang sends with the KV page indices, its window pages for the SWA sub-pool's scales, a row of
its own otherwise):

- `"mxfp8"`: `MHATokenToKVPoolMXFP8` (FP8 K/V, UE8M0 block scales): `block_scale`, one item per KV page.
- `"swa_mxfp8"`: `SWAKVPool` over two MXFP8 pools: `swa` window pages, `block_scale` (full layers' scales, with
  the KV pages), `block_scale_swa` (the window's scales, with the window pages).
- `"dsa"`: `DSATokenToKVPool` (MLA, DeepSeek V3.2's indexer): `dsa`, the index-K page of each KV page.
- `"qsa"`: `QSATokenToKVPool` over a GDN `MambaPool`: `mamba` (a slot), `qsa_pending` (the request row's
  pending ring), `qsa_compressed` (the compressed index keys of each KV page).
- `"minimax"`: `MiniMaxSparseKVPool` with K-only sparse layers: its sparse layers are the KV regions,
  `minimax_index_k` and `minimax_dense_kv` go with the KV pages.
- `"dsv4"`: `DeepSeekV4TokenToKVPool` (V4 layout, compression ratios 4 and 128, offline C128): `swa` window
  pages and `c128_state`, a request's raw C128 ring.
- `"dsv4_dspark"`: the same with a DSpark draft's pool (SWA-only): also the draft's `swa` window (the target's
  window indices: one allocator) and `request_row`, the draft's SWA valid-from of the request's row.
- `"dsv4_unified"`: the same pool in the unified-KV layout, which SGLang builds only on ROCm with
  `SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton`: built on CPU with that platform gate answering True
  (`_unified_kv_gate`); `swa` (its window), `swa_ring` (ring rows of the window's positions), `c128_state`.
"""

from __future__ import annotations

from contextlib import contextmanager
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

    #: the speculative-decoding draft's pool, where the target's state includes the draft's (DSpark)
    draft: object = None

    def kv_lists(self) -> tuple[list[int], list[int], list[int]]:
        return tuple(list(x) for x in _kv_buf_infos(self.owner))

    def describe(self, args: Any) -> None:
        from sglang.srt.disaggregation.utils import setup_state_kv_args

        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = self.kv_lists()
        setup_state_kv_args(args, self.owner, self.draft, self.spec.num_layers)


def _kv_buf_infos(pool):
    """The KV regions SGLang's scheduler registers for `pool` (MiniMax: its sparse layers; 0.5.17 has no
    `get_kv_transfer_buf_infos`)."""
    try:
        from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos
    except ImportError:
        return pool.get_contiguous_buf_infos()
    return get_kv_transfer_buf_infos(pool)


#: state types whose indices SGLang's schedulers take from the request's KV pages (prefill.py/decode.py payloads:
#: `_full_kv_pages_payload`, `_dsa_pages_payload`, `_minimax_payload`); the driver sends the pages past the
#: decode's prefix on both sides, as SGLang does for the DSA and MiniMax index pages
FOLLOWS_KV = {"block_scale", "dsa", "minimax_index_k", "minimax_dense_kv", "qsa_compressed"}


def _own(spec: PoolSpec, pool: Any, draft: Any = None) -> "SGLangPools":
    """Host pools over `pool`'s memory, its state components as SGLang's `setup_state_kv_args` lists them."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import setup_state_kv_args

    listed = SimpleNamespace()
    setup_state_kv_args(listed, pool, draft, spec.num_layers)
    # a draft's KV regions follow the target's, as the scheduler registers them (same page ids)
    kv = _views(*[a + b for a, b in zip(_kv_buf_infos(pool), _kv_buf_infos(draft) if draft else ([], [], []))],
                spec.device)
    states: list[StateComponent] = []
    types = [getattr(t, "value", t) for t in listed.state_types]
    for c, kind in enumerate(types):
        regions = _views(listed.state_data_ptrs[c], listed.state_data_lens[c], listed.state_item_lens[c], spec.device)
        if kind in FOLLOWS_KV:
            states.append(StateComponent(regions, follows="kv"))
        elif kind == "block_scale_swa":  # the window pages of the SWA sub-pool it describes
            states.append(StateComponent(regions, follows=types.index("swa")))
        elif kind == "swa" and "swa" in types[:c]:  # a DSV4 draft's window: the target's SWA indices (one allocator)
            states.append(StateComponent(regions, follows=types.index("swa")))
        elif kind in ("swa", "swa_ring"):  # window pages; ring rows of the window's positions
            states.append(StateComponent(regions, spec.swa_pages, first_item=1))
        else:  # mamba slot, QSA request row, C128 ring, request row: one item of the request's own
            states.append(StateComponent(regions, 1, first_item=1))
    out = SGLangPools(spec, kv, states, owner=pool)
    out.draft = draft
    return out


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


class SWAPools(SGLangPools):
    """SGLang's SWAKVPool: a request's window pages hold this rank's heads of the model's window pages."""

    def _state_items(self, seed: int, room: int, ids: list[np.ndarray]):
        spec = self.spec
        if not spec.total_kv_heads:
            yield from super()._state_items(seed, room, ids)
            return
        for c, (comp, item_ids) in enumerate(zip(self.states, ids)):
            idx = torch.from_numpy(np.asarray(item_ids, dtype=np.int64)).to(spec.device)
            for r, t in enumerate(comp.regions):
                head = t.shape[1] // (spec.page_size * spec.kv_heads)
                # the model's whole page (the same on every rank of either role), then this rank's heads of each row
                model = expected_pages(seed, room, -1 - 64 * c - r, len(idx), spec.page_size * spec.total_kv_heads * head)
                model = model.view(len(idx), spec.page_size, spec.total_kv_heads, head)
                yield t, idx, model[:, :, spec.heads_lo : spec.heads_lo + spec.kv_heads].reshape(len(idx), -1)


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


def _gdn(spec: PoolSpec, linear: list[int]):
    """A GDN-shaped MambaPool at TP 1 (the QSA pool's linear-attention state)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool

    heads, head_dim = spec.mamba_heads, 8
    key_dim = heads // 2 * head_dim
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=heads * head_dim, n_groups=heads // 2,
                                    num_heads=heads, head_dim=head_dim, state_size=head_dim, conv_kernel=4,
                                    conv_shard_groups=[key_dim, key_dim, heads * head_dim])
    params = Mamba2CacheParams(shape=shape, layers=linear,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    slots = spec.state_slots or 16
    return MambaPool(size=slots, spec_state_size=slots, cache_params=params, mamba_layer_ids=linear, device=spec.device)


def _other(spec: PoolSpec) -> HostPools:
    """The 0.5.23 pools of the module docstring, with `spec.num_pages` pages of `spec.page_size` tokens."""
    from sglang.srt.mem_cache import memory_pool as mp

    tokens = (spec.num_pages - 1) * spec.page_size  # SGLang adds one padding page
    dtype, layers = getattr(torch, spec.dtype), spec.num_layers
    even, odd = list(range(0, layers, 2)), list(range(1, layers, 2))
    kind = spec.sglang_pool
    if kind == "mxfp8":
        return _own(spec, mp.MHATokenToKVPoolMXFP8(size=tokens, page_size=spec.page_size, dtype=dtype,
                                                   head_num=spec.kv_heads, head_dim=spec.head_dim, layer_num=layers,
                                                   device=spec.device, enable_memory_saver=False))
    if kind == "swa_mxfp8":
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        return _own(spec, SWAKVPool(size=tokens, size_swa=tokens, page_size=spec.page_size, dtype=dtype,
                                    head_num=spec.kv_heads, head_dim=spec.head_dim, swa_attention_layer_ids=even,
                                    full_attention_layer_ids=odd, device=spec.device, enable_memory_saver=False,
                                    token_to_kv_pool_class=mp.MHATokenToKVPoolMXFP8))
    if kind == "dsa":  # kv_lora_rank + rope = head_dim; SGLang's indexer keys of 128 dims (fp8 with a scale)
        rope = 16
        return _own(spec, mp.DSATokenToKVPool(size=tokens, page_size=spec.page_size, kv_lora_rank=spec.head_dim - rope,
                                              dtype=dtype, qk_rope_head_dim=rope, layer_num=layers, device=spec.device,
                                              index_head_dim=128, enable_memory_saver=False,
                                              kv_cache_dim=spec.head_dim))
    if kind == "qsa":
        from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

        return _own(spec, QSATokenToKVPool(size=tokens, dtype=dtype, page_size=spec.page_size, head_num=spec.kv_heads,
                                           head_dim=spec.head_dim, full_attention_layer_ids=odd, device=spec.device,
                                           mamba_pool=_gdn(spec, even), qsa_index_kv_heads=1, qsa_index_head_dim=16,
                                           qsa_compress_ratio=spec.page_size, qsa_token_topk=8,
                                           num_request_slots=spec.state_slots or 16))
    if kind == "minimax":  # layer 0 dense, the others K-only sparse (SGLang refuses index-value layers for PD)
        return _own(spec, mp.MiniMaxSparseKVPool(size=tokens, page_size=spec.page_size, dtype=dtype,
                                                 head_num=spec.kv_heads, head_dim=spec.head_dim,
                                                 idx_head_dim=spec.head_dim, dense_layer_ids=[0],
                                                 sparse_layer_ids=list(range(1, layers)),
                                                 disable_value_sparse_layer_ids=list(range(1, layers)),
                                                 device=spec.device, start_layer=0, end_layer=layers))
    if kind in ("dsv4", "dsv4_dspark", "dsv4_unified"):
        return _dsv4(spec, tokens, dspark=kind == "dsv4_dspark", unified=kind == "dsv4_unified")
    raise ValueError(f"unknown sglang_pool {kind!r}")


def _dsv4(spec: PoolSpec, tokens: int, dspark: bool = False, unified: bool = False) -> HostPools:
    """DeepSeek V4's pool (FP8 pages of V4's layout; page size a multiple of 128, as SGLang requires). `dspark`:
    with a DSpark draft's pool (one SWA-only layer), built under SGLang's own speculative setting
    (`--speculative-algorithm DSPARK`), whose SWA valid-from is the `request_row` component. `unified`: the
    unified-KV layout of ROCm's unified_kv_triton backend (`_unified_kv_gate`), whose SWA ring is `swa_ring`."""
    from contextlib import nullcontext

    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import get_spec

    slots = spec.state_slots or 8

    def pool(ratios: list[int], draft: bool) -> Any:
        return DeepSeekV4TokenToKVPool(max_num_reqs=slots - 1, swa_size=tokens, c4_size=tokens,
                                       c128_size=tokens // 128, c4_state_pool_size=64, c128_state_pool_size=64,
                                       page_size=spec.page_size, swa_page_size=spec.page_size,
                                       dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
                                       c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
                                       indexer_head_dim=128, layer_num=len(ratios), device=spec.device,
                                       enable_memory_saver=False, compression_ratios=ratios, sliding_window=128,
                                       **({"is_draft_worker": True} if draft else {}))

    with get_spec().override(speculative_algorithm="DSPARK") if dspark else nullcontext(), \
            _unified_kv_gate(unified):
        target = pool([4, 128] * (spec.num_layers // 2), False)
        draft = pool([0], True) if dspark else None
    return _own(spec, target, draft)


@contextmanager
def _unified_kv_gate(on: bool):
    """SGLang's unified-KV gate (`layers/attention/dsv4/unified_kv_gate.py` `is_unified_kv_triton`: ROCm and
    `SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton`) answering True while the pool is built: what a ROCm server
    with that backend builds, on CPU. Only the gate is replaced; the pool, its buffers and `setup_state_kv_args`
    are SGLang's."""
    if not on:
        yield
        return
    import importlib

    for name in ("sglang.srt.layers.attention.dsv4.unified_kv_gate",  # 0.5.23
                 "sglang.kernels.ops.attention.dsv4.unified_kv_kernels.env_gate"):  # 0.5.17
        try:
            gate = importlib.import_module(name)
            break
        except ImportError:
            continue
    else:
        raise ImportError("this SGLang release has no unified-KV gate (is_unified_kv_triton)")
    saved = gate.is_unified_kv_triton
    gate.is_unified_kv_triton = lambda: True
    try:
        yield
    finally:
        gate.is_unified_kv_triton = saved


#: SGLang's own pool kinds over an MLA page layout (the manager is built with is_mla_backend)
MLA_POOLS = {"dsa", "dsv4", "dsv4_dspark", "dsv4_unified"}


def allocate(spec: PoolSpec) -> HostPools:
    """The pool `spec.sglang_pool` names, with `spec.num_pages` pages in each of its page-addressed pools."""
    want = "mla" if spec.sglang_pool in MLA_POOLS else "mha"
    if spec.layout != want:
        raise ValueError(f"sglang_pool {spec.sglang_pool!r} is laid out {want}, got {spec.layout!r}")
    if spec.sglang_pool == "mamba":
        return _mamba(spec)
    if spec.sglang_pool != "swa":
        return _other(spec)
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    tokens = (spec.num_pages - 1) * spec.page_size  # SGLang adds one padding page
    pool = SWAKVPool(size=tokens, size_swa=tokens, page_size=spec.page_size, dtype=getattr(torch, spec.dtype),
                     head_num=spec.kv_heads, head_dim=spec.head_dim,
                     swa_attention_layer_ids=list(range(0, spec.num_layers, 2)),
                     full_attention_layer_ids=list(range(1, spec.num_layers, 2)),
                     device=spec.device, enable_memory_saver=False)
    kv = _views(*pool.get_contiguous_buf_infos(), spec.device)
    window = StateComponent(_views(*pool.get_state_buf_infos(), spec.device), spec.swa_pages, first_item=1)
    return SWAPools(spec, kv, [window], owner=pool)
