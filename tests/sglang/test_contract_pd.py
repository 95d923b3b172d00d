"""SGLang 0.5.23's wider contract between a prefill and a decode process (driver processes on 127.0.0.1, CPU
transports): layout labels both roles must share, and what travels in the aux buffers."""

import importlib.util
import inspect

import numpy as np
import pytest
from test_pd_hetero_tp import ENV as HETERO_ENV
from test_pd_hetero_tp import assert_heads_landed, kv_bytes_sent, rooms
from test_pd_hetero_tp import plan as hetero_plan
from test_pd_transfer import FAST_FAILURE_ENV, MOONCAKE_ENV, REFUSAL_ENV, TRANSPORTS, assert_all_landed, failed_reason

from sglang_p2p_backend.testing.launch import run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

NEEDS_MOONCAKE = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake not installed")
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
    result = run_pair(plan, env=REFUSAL_ENV)
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
        # SGLang's kv_transfer_latency_ms: the sender's first chunk queued -> its Success (as NIXL reports it),
        # the whole of the driver's first send() -> Success of these chunked requests, not their last chunk's
        assert sent["sends"] > 1 and sent["latency_s"] is not None, sent
        assert 0 < sent["latency_s"] and abs(sent["latency_s"] - sent["transfer_s"]) < 0.1, sent


def test_pages_altered_after_arrival_fail_the_room_by_checksum():
    needs_kv_checksum()
    plan = {"pool": POOL, "requests": [{"room": 511, "tokens": 30, "chunk_pages": 8}, {"room": 512, "tokens": 30}],
            "kv_checksum": BOTH, "faults": {"decode": {"corrupt_after_arrival": [511]}}, "deadline_s": 40,
            "linger_s": {"prefill": 3.0}}  # the last Status leaves before the prefill's sockets close (see below)
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    bad, good = result["decode"]["requests"]["511"], result["decode"]["requests"]["512"]
    assert bad["num_bad_pages"] == 0, bad  # it landed intact; the page changed afterwards
    digest = bad["checksum_row"][0]
    assert bad["status"] == "Failed" and bad["reason"].startswith(
        f"KV checksum mismatch bootstrap_room=511 expected={digest:#x} got=0x"), bad
    assert good["status"] == "Success" and good["num_bad_pages"] == 0, good


def test_kv_checksum_flags_every_corrupted_room_and_no_clean_one_in_500():
    """The checksum target: 500 rooms with the checksum on, 50 of them altered after they landed (the first byte of
    their first page): exactly those 50 fail, each naming the mismatch; the 450 clean ones verify and succeed."""
    needs_kv_checksum()
    rng = np.random.default_rng(36)
    rooms = list(range(600, 1100))
    bad = set(rooms[::10])
    plan = {"pool": {"layout": "mla", "num_layers": 2, "page_size": 4, "num_pages": 2600},
            "requests": [{"room": r, "tokens": int(t)} for r, t in zip(rooms, rng.integers(1, 25, size=len(rooms)))],
            "kv_checksum": BOTH, "faults": {"decode": {"corrupt_after_arrival": sorted(bad)}}, "deadline_s": 240}
    # The prefill's driver ends once its last room is Success, which it marks just before it sends that room's
    # Status: it lingers so the last Statuses leave before its sockets close (on CI's loaded 2-core machine the
    # last four corrupted rooms never learned their Success and failed otherwise, their checksum never compared).
    # SGLang's own timeouts and heartbeat, not FAST_FAILURE_ENV's one missed 2 s heartbeat: a mismatch fails its
    # room at once whatever they are. The message below names what a room not flagged ended with.
    plan["linger_s"] = {"prefill": 5.0}
    result = run_pair(plan, timeout=300.0)
    got = result["decode"]["requests"]
    flagged = {r for r in rooms if got[str(r)]["status"] == "Failed"
               and got[str(r)]["reason"].startswith(f"KV checksum mismatch bootstrap_room={r} ")}
    assert flagged == bad, [(r, got[str(r)]["status"], got[str(r)].get("reason")) for r in sorted(bad ^ flagged)[:5]]
    clean = [got[str(r)] for r in rooms if r not in bad]
    assert all(g["status"] == "Success" and g["num_bad_pages"] == 0 and g["checksum_comparable"] is True
               for g in clean), [g for g in clean if g["status"] != "Success"][:3]


def test_kv_checksum_on_one_side_only_is_refused_naming_the_flag():
    needs_kv_checksum()
    plan = {"pool": POOL, "requests": [{"room": 521, "tokens": 20}], "kv_checksum": {"prefill": True},
            "deadline_s": 40}
    result = run_pair(plan, env=REFUSAL_ENV)
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


#: what SGLang's own bootstrap check of the prefill says on the decode before p2pnccl's agreement is compared
SGLANG_REFUSES = {"block_scale_swa": "PD Disaggregation does NOT support different attention TP sizes with MXFP8 KV cache"}
# what SGLang's own backends do not pair across attention TP either: refused at registration on both sides, naming
# the component, both TP sizes and why, before a byte moves
STATE_TP_REFUSALS = [
    pytest.param({"state_slots": 8, "state_type": "swa_ring", "state_per_request": 3},
                 "state component 0 (swa_ring) cannot be sliced between prefill attention TP 1, decode 2: a swa_ring "
                 "component is not sliced over attention TP", id="swa_ring"),
    pytest.param({"state_slots": 8, "state_type": "block_scale_swa", "state_per_request": 3},
                 "state component 0 (block_scale_swa) cannot be sliced between prefill attention TP 1, decode 2: the "
                 "SWA window's MXFP8 scales are not sliced by KV heads", id="block_scale_swa"),
    pytest.param({"state_slots": 8, "state_type": "mamba"},
                 "state component 0 (mamba) cannot be sliced between prefill attention TP 1, decode 2: the prefill "
                 "describes 1 regions with 0 state_dim_per_tensor", id="mamba-without-per-tensor-dims"),
]


@pytest.mark.parametrize("state,why", STATE_TP_REFUSALS)
def test_state_that_cannot_be_sliced_across_attention_tp_is_refused_on_both_sides(state, why):
    from sglang.srt.disaggregation.base.conn import StateType

    if state["state_type"] not in {t.value for t in StateType}:
        pytest.skip(f"this SGLang release has no {state['state_type']} state")
    p = hetero_plan({"prefill": 1, "decode": 2}, 4, 16, tokens=(10, 6, 12))
    p["pool"].update(state)
    p["requests"] = p["requests"][:1]
    p["linger_s"] = {"prefill": 3.0}  # both refusals reach the decode ranks before the prefill closes its sockets
    result = run_pair(p, env=HETERO_ENV)
    for side in (*result["ranks"]["prefill"], *result["ranks"]["decode"]):  # the decode ranks hear the prefill's words
        r = side["requests"]["4001"]
        # SGLang 0.5.23's own bootstrap check refuses MXFP8 block scales across attention TP on the decode first
        sglangs = side in result["ranks"]["decode"] and SGLANG_REFUSES.get(state["state_type"], "\0") in r["reason"]
        assert r["status"] == "Failed" and (why in r["reason"] or sglangs), r


# state replicated over attention TP: QSA's items (the same on every rank) move whole from one elected prefill rank
# (every source when scattering, the first of each decode rank's sources when aggregating); on an MLA pool every
# component moves whole from the one prefill rank SGLang's mapping names (the others are dummies)
REPLICATED_STATE = [
    pytest.param("qsa_pending", "mha", 2, 1, id="qsa_pending-mha-p2d1"),
    pytest.param("qsa_compressed", "mha", 1, 2, id="qsa_compressed-mha-p1d2"),
    pytest.param("dsa", "mla", 1, 2, id="dsa-mla-p1d2"),
]


@pytest.mark.parametrize("state_type,layout,p_tp,d_tp", REPLICATED_STATE)
def test_replicated_state_moves_whole_once_across_attention_tp(state_type, layout, p_tp, d_tp):
    from sglang.srt.disaggregation.base.conn import StateType

    if state_type not in {t.value for t in StateType}:
        pytest.skip(f"this SGLang release has no {state_type} state")
    p = hetero_plan({"prefill": p_tp, "decode": d_tp}, 4, 16, tokens=(10, 6, 12))
    p["pool"].update(layout=layout, state_slots=12, state_item_len=96, state_type=state_type)
    if layout == "mla":
        p["pool"].update(head_dim=64, total_kv_heads=0)
    result = run_pair(p, env=HETERO_ENV)
    assert_heads_landed(result, [rooms(p)] * d_tp)
    for d in result["ranks"]["decode"]:
        assert {d["requests"][str(r)]["state_ok"] for r in rooms(p)} == {True}, d["requests"]
    pages = sum(-(-r["tokens"] // 16) - r.get("prefix", 0) // 16 for r in p["requests"])
    # MHA: every decode head once (4 heads x 16 tokens x 64 x bf16 per region); MLA: whole pages to every decode rank
    kv = pages * 6 * 16 * 64 * 2 * 4 if layout == "mha" else pages * 3 * 16 * 64 * 2 * d_tp
    assert kv_bytes_sent(result, rooms(p)) == kv + 96 * len(rooms(p)) * d_tp  # each decode rank's item once


def mamba_tp_plan(p_tp: int, d_tp: int, **pool) -> dict:
    """SGLang's hybrid linear pool on every rank, the KV's 4 heads and the state sharded over each side's TP."""
    return {"pool": {**MAMBA_POOL, "total_kv_heads": 4, **pool}, "tp": {"prefill": p_tp, "decode": d_tp},
            "requests": [{"room": 561, "tokens": 4 * 9 + 2, "chunk_pages": 4}, {"room": 562, "tokens": 4 * 6, "prefix": 8},
                         {"room": 563, "tokens": 3}],
            "deadline_s": 60}


# (prefill TP, decode TP, linear-attention heads, transport): 4 decode ranks need 4 key heads (SGLang pads key
# groups that do not divide over TP, which are then no shards of one tensor: refused, the next test's kind)
MAMBA_TP = [
    pytest.param(1, 2, 4, {}, id="p1d2-tcp"),
    pytest.param(2, 1, 4, {}, id="p2d1-tcp"),
    pytest.param(2, 4, 8, {}, id="p2d4-tcp"),
    pytest.param(1, 2, 4, MOONCAKE_ENV, id="p1d2-mooncake", marks=NEEDS_MOONCAKE),
    pytest.param(2, 1, 4, MOONCAKE_ENV, id="p2d1-mooncake", marks=NEEDS_MOONCAKE),
]


@pytest.mark.parametrize("p_tp,d_tp,heads,transport_env", MAMBA_TP)
def test_mamba_state_is_sliced_per_tensor_across_attention_tp(p_tp, d_tp, heads, transport_env):
    # every decode rank's conv (q | k | v sub-blocks sharded one by one) and temporal state is exactly its shard of
    # the model's state, whichever prefill rank(s) held it; every byte crossed once (each decode head and each
    # state byte from one prefill rank); no other slot or page changed
    needs_mamba_pool()
    p = mamba_tp_plan(p_tp, d_tp, mamba_heads=heads)
    result = run_pair(p, env={**HETERO_ENV, **transport_env})
    done = [r["room"] for r in p["requests"]]
    assert_heads_landed(result, [done] * d_tp)
    for d in result["ranks"]["decode"]:
        assert {d["requests"][str(r)]["state_ok"] for r in done} == {True}, d["requests"]
    pages = {561: 10, 562: 4, 563: 1}
    for room in done if not transport_env else ():  # one-sided writes count the aux rows too
        sent = sum(pr["requests"][str(room)].get("sent_bytes", 0) for pr in result["ranks"]["prefill"])
        assert sent == pages[room] * 4 * 4 * 64 + mamba_state_bytes(heads), (room, sent)  # 4 regions x 4 heads x 64 B


def test_mamba_state_of_another_model_is_refused_across_attention_tp_naming_both_layouts():
    # the decode runs a model with twice the linear-attention heads: its shards are not slices of the prefill's
    # tensors, refused on both sides with both sizes named
    needs_mamba_pool()
    p = mamba_tp_plan(2, 1)
    p["requests"] = p["requests"][:1]
    p["pool_overrides"] = {"decode": {"mamba_heads": 8}}
    p["linger_s"] = {"prefill": 3.0}
    result = run_pair(p, env=HETERO_ENV)
    why = ("state component 0 (mamba) cannot be sliced between prefill attention TP 2, decode 1: region 0: sliced axis "
           "of 32 x TP 2 on the prefill, 128 x TP 1 on the decode (state_dim_per_tensor): not the same tensor")
    for side in (*result["ranks"]["prefill"], *result["ranks"]["decode"]):
        r = side["requests"]["561"]
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


# (prefill TP, decode TP, model KV heads, transport): the window pages of SGLang's SWAKVPool sliced by the KV
# heads' ranges, as the KV pages: scatter, aggregation, replicated heads on the decode (2 heads over 4 ranks)
SWA_TP = [
    pytest.param(1, 2, 4, {}, id="p1d2-tcp"),
    pytest.param(2, 1, 4, {}, id="p2d1-tcp"),
    pytest.param(1, 4, 2, {}, id="p1d4-h2-tcp"),
    pytest.param(1, 2, 4, MOONCAKE_ENV, id="p1d2-mooncake", marks=NEEDS_MOONCAKE),
    pytest.param(2, 1, 4, MOONCAKE_ENV, id="p2d1-mooncake", marks=NEEDS_MOONCAKE),
]


@pytest.mark.parametrize("p_tp,d_tp,heads,transport_env", SWA_TP)
def test_swa_window_is_sliced_by_kv_heads_across_attention_tp(p_tp, d_tp, heads, transport_env):
    # SWAKVPool on every rank holding its heads of the model's KV and window (testing/sglang_pools.py SWAPools):
    # every decode rank's window pages hold exactly its heads of each token row (state_ok), its KV pages its heads;
    # each decode head crossed once (two-sided: the bytes the prefill ranks sent); nothing else changed
    pool = {"layout": "mha", "sglang_pool": "swa", "num_layers": 4, "kv_heads": 2, "head_dim": 8, "page_size": 4,
            "num_pages": 64, "swa_pages": 3, "total_kv_heads": heads}
    p = {"pool": pool, "tp": {"prefill": p_tp, "decode": d_tp},
         "requests": [{"room": 571, "tokens": 4 * 9 + 2, "chunk_pages": 4}, {"room": 572, "tokens": 4 * 6, "prefix": 8}],
         "deadline_s": 60}
    result = run_pair(p, env={**HETERO_ENV, **transport_env})
    done = rooms(p)
    assert_heads_landed(result, [done] * d_tp)
    for d in result["ranks"]["decode"]:
        assert {d["requests"][str(r)]["state_ok"] for r in done} == {True}, d["requests"]
    per_page = d_tp * max(1, heads // d_tp) * 4 * 16  # every decode rank's heads of 4 token rows of 16 B heads
    for room, pages in ((571, 10), (572, 4)) if not transport_env else ():  # one-sided writes count the aux rows too
        assert kv_bytes_sent(result, [room]) == (pages + 3) * 4 * per_page, room  # 4 KV + 4 window regions


# HybridLinearKVPool over a GDN-shaped MambaPool (Qwen3-Next's state shape): 2 linear-attention layers (conv and
# temporal state: 4 state regions), 2 full-attention layers (4 KV regions of 2 heads x 8 x bf16 per token)
MAMBA_POOL = {"layout": "mha", "sglang_pool": "mamba", "num_layers": 4, "kv_heads": 2, "head_dim": 8, "page_size": 4,
              "num_pages": 64, "state_slots": 8}


def mamba_state_bytes(heads: int = 4) -> int:
    """Bytes of one request's state at attention TP 1: 2 conv items of (heads + 2 x heads / 2 key heads) x 8
    channels x 3 x bf16, 2 temporal items of heads x 8 x 8 x fp32."""
    return 2 * (heads * 8 + 2 * (heads // 2) * 8) * 3 * 2 + 2 * heads * 8 * 8 * 4


MAMBA_STATE_BYTES = mamba_state_bytes()


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


@pytest.mark.parametrize("state_type,items", [("request_row", 1), ("block_scale", 5), ("swa_ring", 7), ("c128_state", 1),
                                              ("block_scale_swa", 5), ("minimax_index_k", 4), ("minimax_dense_kv", 4),
                                              ("dsa", 4)])
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


# ------------------------------------------------------------------ every other state type through its own SGLang pool
# (pool kind, the class that produces the type in SGLang 0.5.23, its pool settings, the state types SGLang's
# setup_state_kv_args lists for it, in order); testing/sglang_pools.py builds each on CPU
OWN_POOLS = [
    ("mxfp8", "memory_pool:MHATokenToKVPoolMXFP8", {"layout": "mha", "kv_heads": 2, "head_dim": 32, "page_size": 4,
                                                   "num_pages": 64}, ["block_scale"]),
    ("swa_mxfp8", "swa_memory_pool:SWAKVPool", {"layout": "mha", "kv_heads": 2, "head_dim": 32, "page_size": 4,
                                               "num_pages": 64}, ["swa", "block_scale", "block_scale_swa"]),
    ("dsa", "memory_pool:DSATokenToKVPool", {"layout": "mla", "head_dim": 48, "page_size": 64, "num_pages": 24},
     ["dsa"]),
    ("qsa", "qsa_kv_pool:QSATokenToKVPool", {"layout": "mha", "kv_heads": 2, "head_dim": 8, "page_size": 4,
                                            "num_pages": 64, "state_slots": 8},
     ["mamba", "qsa_pending", "qsa_compressed"]),
    ("minimax", "memory_pool:MiniMaxSparseKVPool", {"layout": "mha", "kv_heads": 2, "head_dim": 8, "page_size": 4,
                                                   "num_pages": 64}, ["minimax_index_k", "minimax_dense_kv"]),
    ("dsv4", "deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool", {"layout": "mla", "page_size": 128, "num_pages": 12,
                                                                "state_slots": 8}, ["swa", "c128_state"]),
    ("dsv4_dspark", "deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool", {"layout": "mla", "page_size": 128,
                                                                       "num_pages": 12, "state_slots": 8},
     ["swa", "c128_state", "swa", "request_row"]),
    # SGLang builds the unified-KV layout only on ROCm (unified_kv_triton): its platform gate is forced while the
    # pool is built (testing/sglang_pools.py `_unified_kv_gate`)
    ("dsv4_unified", "deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool", {"layout": "mla", "page_size": 128,
                                                                        "num_pages": 12, "state_slots": 8},
     ["swa", "swa_ring", "c128_state"]),
]


def needs_own_pool(cls: str, types: list):
    """Skip where this SGLang release lacks the pool class or one of the state types it produces."""
    from sglang.srt.disaggregation.base.conn import StateType

    module, _, name = cls.partition(":")
    try:
        found = hasattr(importlib.import_module(f"sglang.srt.mem_cache.{module}"), name)
    except ImportError:
        found = False
    absent = [t for t in types if t not in {s.value for s in StateType}]
    missing = ([] if found else [name]) + ([f"{', '.join(absent)} state"] if absent else [])
    if missing:
        pytest.skip(f"this SGLang release has no {' and no '.join(missing)}")


@pytest.mark.parametrize("transport_env", [p for p in TRANSPORTS if p.id != "cudaipc-standin"])  # SGLang allocates
@pytest.mark.parametrize("kind,cls,pool,types", [pytest.param(*p, id=p[0]) for p in OWN_POOLS])
def test_state_of_each_type_from_its_own_sglang_pool_lands_byte_exact(kind, cls, pool, types, transport_env):
    # the pool class SGLang builds for the type, on CPU, described by SGLang's own setup_state_kv_args: every byte of
    # every component lands at the decode's own items (its KV pages for index pages and block scales, its window
    # pages for the SWA sub-pool and its scales, a row of its own for request state), nothing else changes
    needs_own_pool(cls, types)
    page = pool["page_size"]
    plan = {"pool": {**pool, "sglang_pool": kind, "num_layers": 4, "swa_pages": 3},
            "requests": [{"room": 571, "tokens": page * 3 + 2, "chunk_pages": 2},
                         {"room": 572, "tokens": page * 3, "prefix": page}],
            "kv_checksum": BOTH if has_kv_checksum() else {},
            "deadline_s": 60}
    result = run_pair(plan, env=transport_env)
    assert_all_landed(result, [571, 572])  # KV pages, every state item (state_ok), aux rows; nothing else changed
    assert result["decode"]["state_types"] == types, result["decode"]["state_types"]
