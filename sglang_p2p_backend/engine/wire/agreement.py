"""What a prefill rank and a decode rank must agree on, and the one comparison both sides run.

The decode sends its `Agreement` in PeerRegister; the prefill compares it with its own and answers with its
own agreement in PeerAnswer, which the decode compares in turn. So a mismatch refuses the pair on both sides,
each logging every differing parameter with both values and the setting that fixes it. Pool sizes are not
here: they need not match (each side checks the other's ids against the other's registered sizes).

The KV layout is compared per head, not per page, when the attention TP sizes differ on an MHA/GQA pool: a
decode rank then receives only its heads (heads.py), so what must match is the bytes of one head of one token
in every region; the prefill's KV head count (SGLang's `total_kv_head_num`) says how many heads each side holds.
State components are then compared per tensor instead of per slot: a mamba state sliced over TP must describe
the same tensors on both sides (state_slices.py), a state replicated over TP must have the same items, an SWA
window (sliced by the KV heads' ranges) must hold heads of one KV head's bytes in token-major pages on both sides,
and on an MLA pool (replicated latent KV) every component moves whole from the one prefill rank SGLang's mapping
names.
What cannot be paired (other state types on an MHA/GQA model, hybrid-MLA state, head counts that do not spread
over a TP size) is refused with both values named.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import msgspec

from sglang_p2p_backend.engine.copy.heads import heads_per_rank, layout_problem
from sglang_p2p_backend.engine.copy.state_slices import Shards, StatePlan, Window, pair_spans, problem as state_problem
from sglang_p2p_backend.engine.wire.messages import PROTOCOL_VERSION, Agreement

# field -> (what it is, how to make both sides agree)
_FIXES: dict[str, tuple[str, str]] = {
    "protocol": ("p2pnccl protocol version", "install the same sglang-p2p-backend release on prefill and decode"),
    "page_size": ("page size", "launch both with the same --page-size"),
    "mla": ("KV pool kind (MLA)", "prefill and decode must run the same model"),
    "kv_dtype": ("KV cache dtype", "launch both with the same --kv-cache-dtype"),
    "kv_item_lens": (
        "KV layout (bytes per page of every KV region)",
        "prefill and decode must run the same model, attention TP and page size",
    ),
    "state_item_lens": ("state layout (bytes per slot of every state region)", "run the same model and TP on both"),
    "slot_bytes": (
        "staging slot size in bytes (the largest chunk either side sends or receives)",
        "set the same SGLANG_P2P_STAGING_MB and SGLANG_P2P_STAGING_SLOTS on prefill and decode",
    ),
    "auth": ("control-message authentication", "set the same SGLANG_P2P_AUTH_KEY (or _FILE) on every prefill and decode"),
    "aux_item_lens": (
        "aux (metadata) layout (bytes per row of every aux buffer)",
        "run the same SGLang release with the same speculative-decoding, logprob and --disaggregation-enable-kv-checksum "
        "settings on prefill and decode",
    ),
    "kv_layout": ("KV byte layout (KVArgs.kv_layout)", "launch both with the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT"),
    "swa_kv_cache_layout": (
        "SWA sub-pool layout (KVArgs.swa_kv_cache_layout)",
        "set the same SGLANG_USE_HND_KVCACHE and SGLANG_AITER_KV_CACHE_LAYOUT on prefill and decode",
    ),
    "state_types": ("kind of every state component (KVArgs.state_types)", "prefill and decode must run the same model"),
    "mha_layout": ("MHA KV page layout (head-major: SGLANG_USE_HND_KVCACHE)", "set the same SGLANG_USE_HND_KVCACHE on "
                                                                            "prefill and decode"),
}
#: what else a refusal may reveal when it differs (a decode needs it to name the head or state layout it cannot
#: pair)
_SHAPE = ("attn_tp_size", "kv_total_heads", "state_dims", "state_outer_counts", "state_conv_groups", "state_tp_size",
          "hybrid_mla")


def _describe(name: str, value: Any) -> str:
    if value == "":
        return "none"  # a label one side does not set
    if name in ("kv_item_lens", "state_item_lens") and isinstance(value, list):
        flat = [x for v in value for x in (v if isinstance(v, list) else [v])]
        return f"{len(value)} regions of {sorted(set(flat))} bytes"
    return repr(value)


def differences(mine: Agreement, theirs: Agreement, my_role: str, their_role: str) -> list[str]:
    """One line per differing parameter: what it is, both values, and the fix. Empty when they agree."""
    sliced = not mine.mla and not theirs.mla and mine.attn_tp_size != theirs.attn_tp_size
    # state sliced over TP is compared per tensor (below) instead of per slot
    state_sliced = sliced and bool(mine.state_item_lens or theirs.state_item_lens)
    out = []
    for name, (what, fix) in _FIXES.items():
        if sliced and name == "kv_item_lens":
            out += _head_layout_differences(mine, theirs, my_role, their_role)
            continue
        if state_sliced and name == "state_item_lens":
            continue
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            out.append(f"{what} differs: {my_role} {_describe(name, a)}, {their_role} {_describe(name, b)}; {fix}")
    if mine.attn_tp_size != theirs.attn_tp_size and (mine.state_item_lens or theirs.state_item_lens):
        out += _state_tp_differences(mine, theirs, my_role, their_role, state_sliced)
    return out


def shards(a: Agreement, c: int) -> Shards:
    """One side's description of state component `c` (KVArgs' per-tensor lists; absent lists read empty)."""
    pick = lambda lists: lists[c] if c < len(lists) else []  # noqa: E731
    return Shards(tuple(pick(a.state_item_lens)), tuple(pick(a.state_dims)), tuple(pick(a.state_outer_counts)),
                  tuple(tuple(g) for g in pick(a.state_conv_groups)))


def window(prefill: Agreement, decode: Agreement) -> Optional[Window]:
    """The KV head layout an SWA window is sliced by (None on an MLA pool: no heads to slice by)."""
    if prefill.mla or decode.mla:
        return None
    total = max(prefill.kv_total_heads, decode.kv_total_heads)  # a decode may not know it (0)
    _, per_head = _head_layout(prefill, total) if total > 0 else (0, [])
    return Window(total, prefill.page_size, (prefill.swa_kv_cache_layout, decode.swa_kv_cache_layout), tuple(per_head))


def pair_state_spans(prefill: Agreement, prefill_rank: int, decode: Agreement,
                     decode_rank: int) -> tuple[Optional[StatePlan], ...]:
    """What prefill rank `prefill_rank` sends decode rank `decode_rank` of each state component's items (both
    sides compute it from the two agreements): spans of each item, or an SWA window's head range of each token
    row; () when whole items move (same attention TP, or an MLA pool, whose state SGLang's mapping takes whole
    from one prefill rank). Raises StateSliceError."""
    if prefill.attn_tp_size == decode.attn_tp_size or (prefill.mla and decode.mla):
        return ()
    heads = window(prefill, decode)
    return tuple(pair_spans(kind, shards(prefill, c), prefill.attn_tp_size, prefill_rank, shards(decode, c),
                            decode.attn_tp_size, decode_rank, heads) for c, kind in enumerate(prefill.state_types))


def _state_tp_differences(mine: Agreement, theirs: Agreement, my_role: str, their_role: str,
                          state_sliced: bool) -> list[str]:
    """State components between different attention TP sizes: can each be paired as SGLang pairs it?"""
    tps = f"{my_role} attention TP {mine.attn_tp_size}, {their_role} {theirs.attn_tp_size}"
    fix = "launch both with the same attention TP"
    out = []
    if mine.hybrid_mla or theirs.hybrid_mla:
        side = my_role if mine.hybrid_mla else their_role
        out.append(f"state components of a hybrid-MLA model ({side}: KVArgs.is_hybrid_mla_backend) with different "
                   f"attention TP ({tps}) are not paired by p2pnccl (replicated MLA KV beside TP-sharded state); {fix}")
    for role, a in ((my_role, mine), (their_role, theirs)):
        if a.state_tp_size and a.state_tp_size != a.attn_tp_size:
            out.append(f"the {role} lays state out over TP {a.state_tp_size} but attention over TP {a.attn_tp_size} "
                       f"(CP/TP group sharing): p2pnccl slices state only over attention TP; {fix}")
    if out or not state_sliced or mine.state_types != theirs.state_types:
        return out  # whole items on an MLA pool (compared per slot above); differing types are named above
    prefill, decode = (mine, theirs) if my_role == "prefill" else (theirs, mine)
    for c, kind in enumerate(mine.state_types):
        why = state_problem(kind, shards(prefill, c), prefill.attn_tp_size, shards(decode, c), decode.attn_tp_size,
                            window(prefill, decode))
        if why:
            out.append(f"state component {c} ({kind}) cannot be sliced between {tps}: {why}; {fix}")
    if len(mine.state_types) != max(len(mine.state_item_lens), len(theirs.state_item_lens)):
        out.append(f"state components without a type (KVArgs.state_types) cannot be sliced between {tps}; {fix}")
    return out


def redacted(mine: Agreement, theirs: Agreement) -> Agreement:
    """`theirs` with only the values that differ from `mine` replaced by mine: what a refusal tells a peer (it
    names what to change, and nothing else of this rank's configuration)."""
    changed = {n: getattr(mine, n) for n in (*_FIXES, "mla", *_SHAPE) if getattr(mine, n) != getattr(theirs, n)}
    return msgspec.structs.replace(theirs, **changed)


def _head_layout(a: Agreement, total: int) -> tuple[int, list[int]]:
    """(heads per rank, bytes of one head of one token row per region) of one side; -1 where not whole."""
    n = heads_per_rank(total, a.attn_tp_size)
    row = [x // a.page_size if a.page_size and x % a.page_size == 0 else -1 for x in a.kv_item_lens]
    return n, [r // n if r >= 0 and r % n == 0 else -1 for r in row]


def _describe_heads(role: str, a: Agreement, total: int) -> str:
    n, per_head = _head_layout(a, total)
    return (f"{role} attention TP {a.attn_tp_size}: {len(a.kv_item_lens)} regions of {n} of {total} heads x "
            f"{sorted(set(per_head))} bytes per token, page size {a.page_size}")


def _head_layout_differences(mine: Agreement, theirs: Agreement, my_role: str, their_role: str) -> list[str]:
    """Different attention TP on an MHA/GQA pool: can each decode rank take its heads out of the prefill's?"""
    total = max(mine.kv_total_heads, theirs.kv_total_heads)
    problems = [p for p in (layout_problem(total, mine.attn_tp_size), layout_problem(total, theirs.attn_tp_size)) if p]
    big, small = max(mine.attn_tp_size, theirs.attn_tp_size), min(mine.attn_tp_size, theirs.attn_tp_size)
    if big % small:
        problems.append("neither attention TP size divides the other")
    if "hnd" in (mine.mha_layout, theirs.mha_layout):
        problems.append("head-major pages (SGLANG_USE_HND_KVCACHE) are not sliced by p2pnccl")
    if not problems:
        (_, a), (_, b) = _head_layout(mine, total), _head_layout(theirs, total)
        if len(a) != len(b) or a != b or -1 in a:
            problems.append("the bytes of one KV head differ")
    if not problems:
        return []
    return [f"KV layout cannot be sliced by heads ({'; '.join(problems)}): {_describe_heads(my_role, mine, total)}; "
            f"{_describe_heads(their_role, theirs, total)}; prefill and decode must run the same model and KV dtype"]


def local_agreement(
    *,
    page_size: int,
    kv_dtype: str,
    kv_item_lens: list[int],
    state_item_lens: list[list[int]],
    slot_bytes: int,
    auth: bool,
    mla: bool = False,
    attn_tp_size: int = 1,
    kv_total_heads: int = 0,
    aux_item_lens: Sequence[int] = (),
    kv_layout: Optional[str] = None,
    swa_kv_cache_layout: Optional[str] = None,
    state_types: Sequence[str] = (),
    mha_layout: str = "",
    state_dims: Sequence[Sequence[int]] = (),
    state_outer_counts: Sequence[Sequence[int]] = (),
    state_conv_groups: Sequence[Sequence[Optional[Sequence[int]]]] = (),
    state_tp_size: int = 0,
    hybrid_mla: bool = False,
) -> Agreement:
    return Agreement(
        protocol=PROTOCOL_VERSION,
        page_size=int(page_size),
        kv_dtype=str(kv_dtype),
        kv_item_lens=[int(x) for x in kv_item_lens],
        state_item_lens=[[int(x) for x in comp] for comp in state_item_lens],
        slot_bytes=int(slot_bytes),
        auth=bool(auth),
        mla=bool(mla),
        attn_tp_size=int(attn_tp_size),
        kv_total_heads=int(kv_total_heads),
        aux_item_lens=[int(x) for x in aux_item_lens],
        kv_layout=kv_layout or "",
        swa_kv_cache_layout=swa_kv_cache_layout or "",
        state_types=[str(t) for t in state_types],
        mha_layout=mha_layout,
        state_dims=[[int(x) for x in comp] for comp in state_dims],
        state_outer_counts=[[int(x) for x in comp] for comp in state_outer_counts],
        state_conv_groups=[[[int(x) for x in (g or ())] for g in comp] for comp in state_conv_groups],
        state_tp_size=int(state_tp_size),
        hybrid_mla=bool(hybrid_mla),
    )

