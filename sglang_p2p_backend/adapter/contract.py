"""What of SGLang's KV-transfer contract p2pnccl refuses, checked before a manager binds or registers anything.

SGLang 0.5.23 hands a backend more than both supported releases share (docs/sglang-contract.md lists every
KVArgs field and base-class method). What p2pnccl cannot serve must fail the server at start with the flag that
turned it on and why, never move bytes to the wrong place: `refusals` names each such setting, and the manager
raises `ValueError` with all of them. A setting 0.5.17 lacks reads as its default there.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping, Optional

#: state components whose indices are not whole items of their regions (p2pnccl copies whole items by position)
UNSUPPORTED_STATE_TYPES = {
    "dsa_tail": "its indices name the live slots inside one ring row per request, not whole items, and "
                "p2pnccl copies whole items",
}

_BOTH, _PREFILL, _DECODE = ("prefill", "decode"), ("prefill",), ("decode",)
# (server_args field, the roles that read it, refused when, why): the flag is the field's name as SGLang's
# argument parser spells it
_SETTINGS: tuple[tuple[str, tuple[str, ...], Callable[[Any], bool], str], ...] = (
    ("pp_size", _BOTH, lambda v: int(v) > 1,
     "p2pnccl pairs KV and state regions by position, not by layer id (KVArgs.kv_layer_ids, "
     "prefill_start_layer, prefill_end_layer), so one pipeline stage's layers would land on another's"),
    ("dcp_size", _BOTH, lambda v: int(v) > 1,
     "decode context parallelism interleaves a page's tokens over ranks, and p2pnccl does not re-lay them out"),
    ("enable_kv_cache_sharding", _PREFILL, bool,
     "each prefill rank then holds a subset of the logical KV pages, which p2pnccl does not pair with the "
     "decode's"),
    ("disaggregation_decode_host_receive_threshold", _DECODE, lambda v: float(v) < 1,
     "p2pnccl receives into device KV pages only (no KVTransferDestination.HOST, KVArgs.host_*)"),
    ("enable_hisparse", _DECODE, bool,
     "HiSparse decode publishes separate device page ids (device_kv_indices) that p2pnccl does not write"),
    ("enable_pd_role_switch", _BOTH, bool, "p2pnccl has no teardown() (supports_role_switch is False)"),
    ("disaggregation_decode_allocation_policy", _BOTH, lambda v: v == "prefill_complete",
     "p2pnccl does not defer the decode's bootstrap until the prefill completes (mark_prefill_complete)"),
    ("attn_cp_size", _BOTH, lambda v: int(v) > 1,
     "with attention context parallelism SGLang's own backends send from one elected CP rank, or filter each "
     "rank's pages and send CP-replicated state once (is_dummy_cp_rank, enable_all_cp_ranks_for_transfer); "
     "p2pnccl does neither"),
)
def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


#: environment settings (variable, refused when its value and the server's settings make SGLang act on it, why)
_ENV: tuple[tuple[str, Callable[[str, Any], bool], str], ...] = (
    # Common registers prefill ranks with the Rust registry only under DP attention (0.5.23 attn_dp_size)
    ("SGLANG_RUST_SERVER", lambda v, sargs: _truthy(v) and int(getattr(sargs, "attn_dp_size", 1) or 1) > 1,
     "with DP attention SGLang registers prefill ranks with the Rust /route registry (KVArgs.rust_http_port), "
     "and p2pnccl's ranks use SGLang's Python bootstrap server (signed, checked)"),
    # any value: SGLang then allocates the KV pools through Mooncake's allocator (mem_cache/utils.py) and, with
    # INTRA_NODE_NVLINK, the metadata buffers on the GPU (disaggregation/utils.py MetadataBuffers), whose rows
    # p2pnccl reads and writes as host memory: the first transfer would crash instead of starting refused
    ("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", lambda v, sargs: bool(v.strip()),
     "a setting of SGLang's mooncake backend: SGLang then allocates the KV pools through Mooncake's allocator "
     "(and, for INTRA_NODE_NVLINK, the aux rows on the GPU), which p2pnccl does not register or read; unset it "
     "(p2pnccl reaches GPUs of its host through CUDA IPC or NCCL)"),
)


def flag(field: str) -> str:
    """The command-line flag of a ServerArgs field (SGLang derives one from the other)."""
    return "--" + field.replace("_", "-")


def _setting_refusals(server_args: Any, role: str) -> Iterable[str]:
    for field, roles, refused, why in _SETTINGS:
        value = getattr(server_args, field, None)
        if role in roles and value is not None and refused(value):
            yield f"{flag(field)} {value}: {why}"


def _env_refusals(env: Mapping[str, str], server_args: Any) -> Iterable[str]:
    for name, refused, why in _ENV:
        value = env.get(name)
        if value is not None and refused(value, server_args):
            yield f"{name}={value}: {why}"


def _state_type_name(state_type: Any) -> str:
    return str(getattr(state_type, "value", state_type)).lower()


def _state_refusals(args: Any) -> Iterable[str]:
    for i, state_type in enumerate(getattr(args, "state_types", None) or []):
        why = UNSUPPORTED_STATE_TYPES.get(_state_type_name(state_type))
        if why:
            yield f"state component {i} is {_state_type_name(state_type)} (KVArgs.state_types): {why}"


def refusals(args: Any, server_args: Any, role: str, env: Optional[Mapping[str, str]] = None) -> list[str]:
    """Every setting of this `role` ("prefill" or "decode") server p2pnccl cannot serve, each naming the flag,
    environment variable or KVArgs field, and why (`env`: os.environ unless given)."""
    env = os.environ if env is None else env
    return [*_setting_refusals(server_args, role), *_env_refusals(env, server_args), *_state_refusals(args)]


def check(args: Any, server_args: Any, role: str) -> None:
    """Raise ValueError naming every refused setting; nothing happens when there is none."""
    problems = refusals(args, server_args, role)
    if problems:
        raise ValueError(f"p2pnccl cannot serve this {role} server: " + "; ".join(problems))


def mha_page_layout() -> str:
    """"hnd" when SGLang's MHA pools keep head-major pages (SGLANG_USE_HND_KVCACHE), else "" (token-major rows).
    KVArgs does not carry it, and a whole page copied between the two layouts would be read as other heads."""
    from sglang.srt.environ import envs

    return "hnd" if envs.SGLANG_USE_HND_KVCACHE.get() else ""


def state_type_names(args: Any) -> Optional[list[str]]:
    """KVArgs.state_types as lower-case names (what the peers compare), or None where the release has none."""
    types = getattr(args, "state_types", None)
    return None if types is None else [_state_type_name(t) for t in types]
