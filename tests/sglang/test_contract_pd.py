"""SGLang 0.5.23's wider contract between a prefill and a decode process (driver processes on 127.0.0.1, CPU
transports): layout labels both roles must share, and what travels in the aux buffers."""

import inspect

import pytest
from test_pd_hetero_tp import ENV as HETERO_ENV
from test_pd_hetero_tp import assert_heads_landed, rooms
from test_pd_hetero_tp import plan as hetero_plan
from test_pd_transfer import FAST_FAILURE_ENV, TRANSPORTS, assert_all_landed, failed_reason

from sglang_p2p_backend.testing.launch import run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POOL = {"layout": "mla", "num_layers": 4, "page_size": 1, "num_pages": 300}
BOTH = {"prefill": True, "decode": True}


def has_kv_checksum() -> bool:
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return "kv_checksum_enabled" in inspect.signature(MetadataBuffers).parameters


def needs_kv_checksum():
    if not has_kv_checksum():
        pytest.skip("this SGLang release has no --disaggregation-enable-kv-checksum")


# prefill layout, decode layout, both as p2pnccl names them, and what SGLang's own check of the prefill server
# (0.5.23, on the decode) names when both are set; with one unset it checks nothing and p2pnccl's agreement does
LAYOUTS = [
    pytest.param("flashmla", "fp8_ds_mla", "prefill 'flashmla', decode 'fp8_ds_mla'",
                 "prefill server has kv_layout=flashmla, but decode server has kv_layout=fp8_ds_mla", id="both-set"),
    pytest.param(None, "fp8_ds_mla", "prefill none, decode 'fp8_ds_mla'", None, id="prefill-unset"),
]


def sglang_checks_kv_layout() -> bool:
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    return hasattr(CommonKVManager, "kv_layout")


@pytest.mark.parametrize("prefill_layout,decode_layout,both,sglang_names", LAYOUTS)
def test_kv_layout_mismatch_is_refused_on_both_sides_naming_both_layouts(prefill_layout, decode_layout, both,
                                                                        sglang_names):
    plan = {
        "pool": POOL,
        "requests": [{"room": 401, "tokens": 40, "chunk_pages": 8}, {"room": 402, "tokens": 9}],
        "kv_layout": {"prefill": prefill_layout, "decode": decode_layout},
        "deadline_s": 40,
    }
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    ours = (f"KV byte layout (KVArgs.kv_layout) differs: {both}; launch both with the same --dsv4-attn-backend and "
            f"SGLANG_DSV4_KV_LAYOUT")
    for room in (401, 402):
        prefill, decode = failed_reason(result["prefill"], room), failed_reason(result["decode"], room)
        assert ours in prefill, prefill
        assert (sglang_names if sglang_names and sglang_checks_kv_layout() else ours) in decode, decode
        assert result["decode"]["requests"][str(room)]["seconds"] < 5, "refusal must not wait for a timeout"


# ------------------------------------------------------------------ KV checksum (--disaggregation-enable-kv-checksum)
@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_kv_checksum_row_travels_with_the_aux_rows_and_verifies(transport_env):
    needs_kv_checksum()
    plan = {
        "pool": {"layout": "mha", "num_layers": 3, "page_size": 16, "num_pages": 200, "state_slots": 4},
        "requests": [{"room": 501, "tokens": 21 * 16 + 5, "chunk_pages": 6},
                     {"room": 502, "tokens": 12 * 16, "chunk_pages": 5, "prefix": 4 * 16}],
        "kv_checksum": BOTH,
        "deadline_s": 40,
    }
    result = run_pair(plan, env=transport_env)
    assert_all_landed(result, [501, 502])
    # SGLang's transfer metric (Common's get_transfer_metric over what send() recorded): pages past the decode's
    # prefix x 6 regions of 1,024-byte pages, plus the 64-byte state slot
    for room, pages in (("501", 22), ("502", 8)):
        sent, got = result["prefill"]["requests"][room], result["decode"]["requests"][room]
        assert got["checksum_row"] == sent["checksum_row"] and sent["checksum_row"][0] > 1, (sent, got)
        assert got["checksum_comparable"] is True
        assert sent["bytes"] == pages * 6 * 1024 + 64, sent


def test_pages_altered_after_arrival_fail_the_room_by_checksum():
    needs_kv_checksum()
    plan = {"pool": POOL, "requests": [{"room": 511, "tokens": 30, "chunk_pages": 8}, {"room": 512, "tokens": 30}],
            "kv_checksum": BOTH, "faults": {"decode": {"corrupt_after_arrival": [511]}}, "deadline_s": 40}
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    bad, good = result["decode"]["requests"]["511"], result["decode"]["requests"]["512"]
    assert bad["num_bad_pages"] == 0, bad  # it landed intact; the page changed afterwards
    digest = bad["checksum_row"][0]
    assert bad["status"] == "Failed" and bad["reason"].startswith(
        f"KV checksum mismatch bootstrap_room=511 expected={digest:#x} got=0x"), bad
    assert good["status"] == "Success" and good["num_bad_pages"] == 0, good


def test_kv_checksum_on_one_side_only_is_refused_naming_the_flag():
    needs_kv_checksum()
    plan = {"pool": POOL, "requests": [{"room": 521, "tokens": 20}], "kv_checksum": {"prefill": True},
            "deadline_s": 40}
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    for side in ("prefill", "decode"):
        reason = failed_reason(result[side], 521)
        # the prefill's last aux buffer is the digest row (64 bytes)
        assert ("aux (metadata) layout (bytes per row of every aux buffer) differs: prefill [64, 64, 64, 64, 16, 16, "
                "64, 128, 64, 64, 64], decode [64, 64, 64, 64, 16, 16, 64, 128, 64, 64]; run the same SGLang release "
                "with the same speculative-decoding, logprob and --disaggregation-enable-kv-checksum settings on "
                "prefill and decode") in reason, reason


def test_kv_checksum_is_not_verified_across_attention_tp():
    # a decode rank of another attention TP holds other heads than its prefill rank digested: SGLang must skip
    # the comparison (should_verify_kv_checksum False), or every request fails
    needs_kv_checksum()
    p = hetero_plan({"prefill": 1, "decode": 2}, 4, 16, tokens=(10, 6, 12))
    p["kv_checksum"] = BOTH
    result = run_pair(p, env=HETERO_ENV)
    assert_heads_landed(result, [rooms(p)] * 2)
    for d in result["ranks"]["decode"]:
        assert {r["checksum_comparable"] for r in d["requests"].values()} == {False}, d["requests"]


def test_state_components_across_attention_tp_are_refused_on_both_sides():
    # SGLang slices state per tensor over TP (KVArgs.state_dim_per_tensor, state_slice_outer_counts,
    # state_conv_shard_groups); p2pnccl does not, so the pair is refused before a byte moves
    p = hetero_plan({"prefill": 1, "decode": 2}, 4, 16, tokens=(10, 6, 12))
    p["pool"]["state_slots"] = 8
    p["requests"] = p["requests"][:1]
    p["linger_s"] = {"prefill": 3.0}  # both refusals reach the decode ranks before the prefill closes its sockets
    result = run_pair(p, env=HETERO_ENV)
    why = ("state components with different attention TP (prefill 1, decode 2) are not sliced by p2pnccl; launch both "
           "with the same attention TP")
    for side in (*result["ranks"]["prefill"], *result["ranks"]["decode"]):
        r = side["requests"]["4001"]
        assert r["status"] == "Failed" and why in r["reason"], r


# ------------------------------------------------------------------ state components of SGLang's own pools
@pytest.mark.parametrize("transport_env", [p for p in TRANSPORTS if p.id != "cudaipc-standin"])  # SGLang allocates
def test_swa_window_of_sglangs_swa_pool_lands_byte_exact(transport_env):
    # SWAKVPool on CPU, described by SGLang's own setup_state_kv_args: the full layers are the KV regions, the
    # sliding-window layers one SWA state component of 4 regions, 3 window pages per request at its own page ids
    pool = {"layout": "mha", "sglang_pool": "swa", "num_layers": 4, "kv_heads": 2, "head_dim": 8, "page_size": 4,
            "num_pages": 64, "swa_pages": 3}
    plan = {"pool": pool,
            "requests": [{"room": 531, "tokens": 4 * 9 + 2, "chunk_pages": 4},
                         {"room": 532, "tokens": 4 * 6, "prefix": 8}],
            "kv_checksum": BOTH if has_kv_checksum() else {},
            "deadline_s": 40}
    result = run_pair(plan, env=transport_env)
    assert_all_landed(result, [531, 532])  # KV pages, window pages (state_ok), aux rows; nothing else changed
    for room, pages in (("531", 10), ("532", 4)):
        sent = result["prefill"]["requests"][room]
        assert sent["bytes"] == pages * 4 * 128 + 3 * 4 * 128, sent  # 4 KV regions, 4 SWA regions of 128 B pages


# HybridLinearKVPool over a GDN-shaped MambaPool (Qwen3-Next's state shape): 2 linear-attention layers (conv and
# temporal state: 4 state regions), 2 full-attention layers (4 KV regions of 2 heads x 8 x bf16 per token)
MAMBA_POOL = {"layout": "mha", "sglang_pool": "mamba", "num_layers": 4, "kv_heads": 2, "head_dim": 8, "page_size": 4,
              "num_pages": 64, "state_slots": 8}
# bytes of one request's state at attention TP 1: 2 conv items of 64 channels x 3 x bf16, 2 temporal items of
# 4 heads x 8 x 8 x fp32
MAMBA_STATE_BYTES = 2 * 64 * 3 * 2 + 2 * 4 * 8 * 8 * 4


def needs_mamba_pool():
    from sglang.srt.mem_cache import memory_pool

    if not hasattr(memory_pool, "HybridLinearKVPool") or not hasattr(memory_pool.MambaPool, "get_state_dim_per_tensor"):
        pytest.skip("this SGLang release has no HybridLinearKVPool with per-tensor state dims")


@pytest.mark.parametrize("transport_env", [p for p in TRANSPORTS if p.id != "cudaipc-standin"])  # SGLang allocates
def test_mamba_state_of_sglangs_hybrid_linear_pool_lands_byte_exact(transport_env):
    # SGLang's HybridLinearKVPool and MambaPool on CPU, described by SGLang's own setup_state_kv_args: every conv
    # and temporal state byte of the request's slot lands at the decode's slot, nothing else changes
    needs_mamba_pool()
    plan = {"pool": MAMBA_POOL,
            "requests": [{"room": 551, "tokens": 4 * 9 + 2, "chunk_pages": 4},
                         {"room": 552, "tokens": 4 * 6, "prefix": 8}, {"room": 553, "tokens": 3}],
            "kv_checksum": BOTH if has_kv_checksum() else {},
            "deadline_s": 40}
    result = run_pair(plan, env=transport_env)
    assert_all_landed(result, [551, 552, 553])  # KV pages, the mamba slot (state_ok), aux rows; nothing else changed
    for room, pages in (("551", 10), ("552", 4), ("553", 1)):
        sent = result["prefill"]["requests"][room]
        assert sent["bytes"] == pages * 4 * 128 + MAMBA_STATE_BYTES, sent  # 4 KV regions of 128-byte pages


@pytest.mark.parametrize("state_type,items", [("request_row", 1), ("block_scale", 5), ("swa_ring", 7)])
def test_state_components_of_each_type_land_at_their_own_indices(state_type, items):
    # one item per request row, or a list of pages or ring rows: p2pnccl copies each item to the decode's item at
    # the same position of its list, whatever the type
    from sglang.srt.disaggregation.base.conn import StateType

    if state_type not in {t.value for t in StateType}:
        pytest.skip(f"this SGLang release has no {state_type} state")
    pool = {**POOL, "state_slots": 40, "state_item_len": 96, "state_type": state_type, "state_per_request": items}
    plan = {"pool": pool, "requests": [{"room": 541, "tokens": 30, "chunk_pages": 8}, {"room": 542, "tokens": 5}],
            "deadline_s": 40}
    assert_all_landed(run_pair(plan), [541, 542])  # state_ok: every item byte-exact; untouched: no other item
