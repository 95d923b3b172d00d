"""What a prefill rank and a decode rank must agree on, and the one comparison both sides run.

The decode sends its `Agreement` in PeerRegister; the prefill compares it with its own and answers with its
own agreement in PeerAnswer, which the decode compares in turn. So a mismatch refuses the pair on both sides,
each logging every differing parameter with both values and the setting that fixes it. Pool sizes are not
here: they need not match (each side checks the other's ids against the other's registered sizes).
"""

from __future__ import annotations

from typing import Any

from .messages import PROTOCOL_VERSION, Agreement

# field -> (what it is, how to make both sides agree)
_FIXES: dict[str, tuple[str, str]] = {
    "protocol": ("p2pnccl protocol version", "install the same sglang-p2p-backend release on prefill and decode"),
    "page_size": ("page size", "launch both with the same --page-size"),
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
}


def _describe(name: str, value: Any) -> str:
    if name.endswith("item_lens") and isinstance(value, list):
        flat = [x for v in value for x in (v if isinstance(v, list) else [v])]
        return f"{len(value)} regions of {sorted(set(flat))} bytes"
    return repr(value)


def differences(mine: Agreement, theirs: Agreement, my_role: str, their_role: str) -> list[str]:
    """One line per differing parameter: what it is, both values, and the fix. Empty when they agree."""
    out = []
    for name, (what, fix) in _FIXES.items():
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            out.append(f"{what} differs: {my_role} {_describe(name, a)}, {their_role} {_describe(name, b)}; {fix}")
    return out


def local_agreement(
    *,
    page_size: int,
    kv_dtype: str,
    kv_item_lens: list[int],
    state_item_lens: list[list[int]],
    slot_bytes: int,
    auth: bool,
) -> Agreement:
    return Agreement(
        protocol=PROTOCOL_VERSION,
        page_size=int(page_size),
        kv_dtype=str(kv_dtype),
        kv_item_lens=[int(x) for x in kv_item_lens],
        state_item_lens=[[int(x) for x in comp] for comp in state_item_lens],
        slot_bytes=int(slot_bytes),
        auth=bool(auth),
    )

