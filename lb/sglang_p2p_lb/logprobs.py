"""Merge the prefill's input logprobs into the decode's answer, as mini_lb does for `return_logprob`."""

from __future__ import annotations

from typing import Any

MERGED_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def merge_item(prefill: Any, decode: Any) -> Any:
    """Prepend each input-logprob list of the prefill item to the decode item's (in place, returned)."""
    if not isinstance(prefill, dict) or not isinstance(decode, dict):
        return decode
    pm, dm = prefill.get("meta_info"), decode.get("meta_info")
    if not isinstance(pm, dict) or not isinstance(dm, dict):
        return decode
    for key in MERGED_KEYS:
        if isinstance(pm.get(key), list) and isinstance(dm.get(key), list):
            dm[key] = pm[key] + dm[key]
    return decode


def merge(prefill: Any, decode: Any) -> Any:
    """Merge a single answer or a batch (lists are matched item by item)."""
    if isinstance(prefill, list) and isinstance(decode, list):
        return [merge_item(p, d) for p, d in zip(prefill, decode)] + decode[len(prefill):]
    return merge_item(prefill, decode)


def prefill_items_by_index(prefill: Any) -> dict[int, Any]:
    """Prefill answer(s) keyed by batch index, for merging into streamed decode chunks (`index` field)."""
    if isinstance(prefill, list):
        return {i: item for i, item in enumerate(prefill)}
    return {0: prefill}
