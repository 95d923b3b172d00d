"""Host-memory KV pools laid out as SGLang lays them out, with reproducible page contents.

MHA: K of every layer, then V of every layer, each (tokens, kv_heads, head_dim), page = page_size tokens
(`MHATokenToKVPool.get_contiguous_buf_infos`). MLA: one region per layer, (tokens, 1, kv_lora_rank + rope)
(`MLATokenToKVPool`). Page 0 is never handed out (SGLang keeps it as padding). An optional state component
(one slot-addressed region, like a mamba state) exercises the state path. With `sglang_pool` set the pools are
SGLang's own classes instead, described to the manager by SGLang's own code (testing/sglang_pools.py).

Contents are a pure function of (seed, room, region, page position in the request), so the decode process
can check what landed without talking to the prefill. With `total_kv_heads` set (MHA), they are defined for the
model's every head, and a rank's pool holds its `kv_heads` heads from `heads_lo` on, as a TP rank holds them:
a decode rank with another attention TP than the prefill then checks exactly its heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

SENTINEL = 0xA5


@dataclass(frozen=True)
class PoolSpec:
    layout: str = "mla"  # "mla" or "mha"
    num_layers: int = 4
    kv_heads: int = 2  # MHA only: heads of this rank
    total_kv_heads: int = 0  # MHA: the model's heads (0: contents are per rank, not per head)
    heads_lo: int = 0  # MHA: the first of the model's heads this rank holds
    head_dim: int = 16  # MHA: per head; MLA: kv_lora_rank + rope
    dtype: str = "bfloat16"
    page_size: int = 1
    num_pages: int = 256
    state_slots: int = 0  # 0: no state component
    state_item_len: int = 64
    state_type: str = "mamba"  # the component's KVArgs.state_types value
    state_per_request: int = 1  # items one request holds (a slot or request row: 1; pages of a window: more)
    #: "" (the pools above), or SGLang's own pool class: "swa" (SWAKVPool; even layers sliding-window), "mamba"
    #: (HybridLinearKVPool over a GDN-style MambaPool; even layers linear attention)
    sglang_pool: str = ""
    swa_pages: int = 3  # "swa": the window pages of one request
    #: "mamba": the model's linear-attention heads (value heads; key heads are half), and the TP this rank's state
    #: is sharded over and its rank there (set per rank by the driver)
    mamba_heads: int = 4
    state_tp: int = 1
    state_tp_rank: int = 0
    device: str = "cpu"  # "cuda:N" puts the pools on a GPU (the NCCL transport then moves them)

    @property
    def elt_size(self) -> int:
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def token_bytes(self) -> int:
        width = self.kv_heads * self.head_dim if self.layout == "mha" else self.head_dim
        return width * self.elt_size

    @property
    def num_regions(self) -> int:
        return 2 * self.num_layers if self.layout == "mha" else self.num_layers

    @property
    def item_len(self) -> int:
        return self.page_size * self.token_bytes

    def expected(self, seed: int, room: int, region: int, total: int) -> torch.Tensor:
        """(total, item_len) uint8: this rank's bytes of every page of a request's region."""
        if self.layout != "mha" or not self.total_kv_heads:
            return expected_pages(seed, room, region, total, self.item_len)
        head_bytes = self.head_dim * self.elt_size
        every = expected_pages(seed, room, region, total, self.page_size * self.total_kv_heads * head_bytes)
        mine = every.view(total, self.page_size, self.total_kv_heads, head_bytes)[:, :, self.heads_lo : self.heads_lo + self.kv_heads]
        return mine.reshape(total, self.item_len)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across every region (what a page costs on the wire)."""
        return self.num_regions * self.item_len


@dataclass
class StateComponent:
    """One state component as KVArgs describes it: its regions as uint8 (items, item_len) views, and how many
    of its items one request holds (a mamba slot: 1; an SWA window: its pages). Item 0 of SGLang's paged
    components is padding, never handed out."""

    regions: list
    per_request: int = 1
    first_item: int = 0
    #: where a request's items come from instead of a pick of their own: "kv" (its KV pages: SGLang sends the
    #: component with the KV page indices, as block scales or DSA index pages), or the index of an earlier component
    #: whose items it shares (an SWA sub-pool's block scales go with its window pages)
    follows: object = None

    @property
    def num_items(self) -> int:
        return min(r.shape[0] for r in self.regions)


@dataclass
class HostPools:
    spec: PoolSpec
    kv: list = field(default_factory=list)  # uint8 (num_pages, item_len) per region
    states: list = field(default_factory=list)  # StateComponent, in KVArgs order
    #: SGLang's pool object when `spec.sglang_pool` is set (it owns the memory the views alias)
    owner: object = None

    @classmethod
    def allocate(cls, spec: PoolSpec, raw: Optional[Callable[[int], torch.Tensor]] = None) -> "HostPools":
        """`raw(nbytes)`: where each region's bytes come from (shared memory for the IPC stand-in); else torch."""
        if spec.layout not in ("mla", "mha"):
            raise ValueError(f"layout must be mla or mha, got {spec.layout!r}")
        dev = torch.device(spec.device)

        def region(rows: int, width: int) -> torch.Tensor:
            if raw is None:
                return torch.full((rows, width), SENTINEL, dtype=torch.uint8, device=dev)
            return raw(rows * width).view(rows, width).fill_(SENTINEL)

        kv = [region(spec.num_pages, spec.item_len) for _ in range(spec.num_regions)]
        states = ([StateComponent([region(spec.state_slots, spec.state_item_len)], spec.state_per_request)]
                  if spec.state_slots else [])
        return cls(spec, kv, states)

    def kv_lists(self) -> tuple[list[int], list[int], list[int]]:
        return (
            [t.data_ptr() for t in self.kv],
            [t.numel() for t in self.kv],
            [self.spec.item_len] * len(self.kv),
        )

    def describe(self, args) -> None:
        """Set KVArgs' KV and state fields as the scheduler does for these pools."""
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = self.kv_lists()
        args.state_data_ptrs = [[t.data_ptr() for t in c.regions] for c in self.states]
        args.state_data_lens = [[t.numel() for t in c.regions] for c in self.states]
        args.state_item_lens = [[t.shape[1] for t in c.regions] for c in self.states]
        from sglang.srt.disaggregation.base.conn import StateType

        args.state_types = [StateType(self.spec.state_type)] * len(self.states)
        args.swa_kv_cache_layout = None  # SGLang 0.5.23: no SWA sub-pool

    def fill(self, seed: int, room: int, pages: np.ndarray, first_pos: int, total: int) -> None:
        """Write the request's reproducible contents into `pages` (positions first_pos.. of `total`)."""
        idx = torch.from_numpy(pages.astype(np.int64)).to(self.spec.device)
        for r, t in enumerate(self.kv):
            t[idx] = self._kv_expected(seed, room, r, t, total)[first_pos : first_pos + len(pages)].to(t.device)
        self._written()

    def _kv_expected(self, seed: int, room: int, region: int, t: torch.Tensor, total: int) -> torch.Tensor:
        """Every page of a request's KV region `region` (view `t`): the spec's layout, or, for a region of another
        page width (an SGLang pool's own regions: MLA/DSA, FP8 pages, MiniMax sparse layers), its own width."""
        if t.shape[1] == self.spec.item_len:
            return self.spec.expected(seed, room, region, total)
        return expected_pages(seed, room, region, total, t.shape[1])

    def fill_state(self, seed: int, room: int, ids: list[np.ndarray]) -> None:
        """Write the request's reproducible contents into its items `ids[c]` of every state component c."""
        for region, item_ids, want in self._state_items(seed, room, ids):
            region[item_ids] = want.to(region.device)
        self._written()

    def _state_items(self, seed: int, room: int, ids: list[np.ndarray]):
        """(region view, the request's item ids there, their expected contents) of every state region."""
        for c, (comp, item_ids) in enumerate(zip(self.states, ids)):
            idx = torch.from_numpy(np.asarray(item_ids, dtype=np.int64)).to(self.spec.device)
            for r, t in enumerate(comp.regions):
                yield t, idx, expected_pages(seed, room, -1 - 64 * c - r, len(idx), t.shape[1])

    def _written(self) -> None:
        """On CUDA, wait for the fill kernels: the pages must be complete before a transport reads them from
        another thread or process (Mooncake copies them out with its own cudaMemcpy), as SGLang's scheduler
        hands the backend a wait_event for the forward that wrote them."""
        if torch.device(self.spec.device).type == "cuda":
            torch.cuda.synchronize(self.spec.device)

    def check(self, seed: int, room: int, pages: np.ndarray, first_pos: int, total: int) -> list[str]:
        """Mismatches (region, page) between `pages` and the request's expected contents."""
        bad = []
        idx = torch.from_numpy(pages.astype(np.int64)).to(self.spec.device)
        for r, t in enumerate(self.kv):
            want = self._kv_expected(seed, room, r, t, total)[first_pos : first_pos + len(pages)]
            got = t[idx].cpu()
            rows = (got != want).any(dim=1).nonzero().flatten().tolist()
            bad += [f"region {r} page {int(pages[i])} (position {first_pos + i})" for i in rows]
        return bad

    def check_state(self, seed: int, room: int, ids: list[np.ndarray]) -> bool:
        return all(torch.equal(t[idx].cpu(), want) for t, idx, want in self._state_items(seed, room, ids))

    def state_bytes(self, ids: list[np.ndarray]) -> list[torch.Tensor]:
        """Copies of the request's state items, region by region (what a snapshot or a digest covers)."""
        return [t[torch.from_numpy(np.asarray(i, dtype=np.int64)).to(t.device)].cpu().clone()
                for comp, i in zip(self.states, ids) for t in comp.regions]

    def untouched(self, used_pages: set[int], used_state: Sequence[set[int]] = ()) -> list[str]:
        """Pages (and state slots) no request owned that no longer hold the sentinel."""
        free = torch.tensor(sorted(set(range(self.spec.num_pages)) - set(used_pages)), dtype=torch.int64, device=self.spec.device)
        bad = []
        for r, t in enumerate(self.kv):
            rows = (t[free] != SENTINEL).any(dim=1).nonzero().flatten().tolist()
            bad += [f"region {r} page {int(free[i])}" for i in rows]
        for c, comp in enumerate(self.states):
            used = used_state[c] if c < len(used_state) else set()
            for r, t in enumerate(comp.regions):
                free = sorted(set(range(comp.first_item, t.shape[0])) - set(used))
                rows = (t[free] != SENTINEL).any(dim=1).nonzero().flatten().tolist() if free else []
                bad += [f"state component {c} region {r} item {free[i]}" for i in rows]
        return bad


def expected_pages(seed: int, room: int, region: int, total: int, item_len: int) -> torch.Tensor:
    """(total, item_len) uint8: every page of a request's region, a function of (seed, room, region, total)."""
    g = torch.Generator().manual_seed(hash((seed, room % (1 << 61), region, total)) & ((1 << 63) - 1))
    return torch.randint(0, 256, (total, item_len), dtype=torch.uint8, generator=g)
