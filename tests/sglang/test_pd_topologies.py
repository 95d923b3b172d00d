"""Parallel layouts through SGLang's real rank mapping: one process per TP rank (gloo worlds), the prefill's
bootstrap server, and p2pnccl's handling of replicated MLA KV, dummy ranks and DP attention. Plus an abort on the
prefill side. MHA with different attention TP (head slices) is in test_pd_hetero_tp.py."""

import pytest
from support import kv_digests

from sglang_p2p_backend.testing.launch import run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "8", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "8"}
REQUESTS = [{"room": 3001, "tokens": 83, "chunk_pages": 4}, {"room": 3002, "tokens": 40}, {"room": 3004, "tokens": 41}]


def plan(layout, tp, attn_dp=None, requests=REQUESTS):
    p = {"pool": {"layout": layout, "num_layers": 3, "page_size": 4, "num_pages": 256}, "tp": tp,
         "requests": requests, "deadline_s": 40}
    if attn_dp:
        p["attn_dp"] = attn_dp
    return p


def statuses(side):
    return {room: r["status"] for room, r in side["requests"].items()}


def assert_every_rank_clean(result):
    for role in ("prefill", "decode"):
        for side in result["ranks"][role]:
            assert side is not None, f"a {role} rank died: {result['workdir']}"
            assert side["leftovers"]["request_status"] == [] and side["leftovers"]["staging_in_use"] == 0
            assert side["threads_left"] == []


def assert_decode_ranks_got_everything(result, rooms):
    for d in result["ranks"]["decode"]:
        for room in rooms:
            r = d["requests"][str(room)]
            assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
        assert d["untouched_violations"] == []


@pytest.mark.parametrize("tp", [{"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 2}], ids=["p2d1", "p1d2"])
def test_mla_with_different_tp_replicates_the_latent_kv(tp):
    result = run_pair(plan("mla", tp), env={**ENV, **kv_digests.ENV})
    assert_decode_ranks_got_everything(result, [3001, 3002, 3004])
    for p in result["ranks"]["prefill"]:  # the dummy prefill rank concludes too, or the TP group would hang
        assert set(statuses(p).values()) == {"Success"}
    assert_every_rank_clean(result)
    # the test-only KV digest: one line per room from the prefill rank that sent it (not the dummy) and from each
    # decode rank, all equal (MLA pages are whole on every rank)
    assert_digests_equal(result, prefill_lines=3, decode_lines=3 * tp["decode"])


def test_mha_with_equal_tp_two():
    result = run_pair(plan("mha", {"prefill": 2, "decode": 2}), env={**ENV, **kv_digests.ENV})
    assert_decode_ranks_got_everything(result, [3001, 3002, 3004])
    assert_every_rank_clean(result)
    # each decode rank holds the heads its own attention TP rank of the prefill sent: pairs by that rank
    assert_digests_equal(result, prefill_lines=6, decode_lines=6)


def assert_digests_equal(result, prefill_lines, decode_lines):
    got = kv_digests.compare_run(result)
    assert got["rooms_compared"] == got["rooms_equal"] == 3 and got["rooms_missing_a_side"] == 0, got
    assert len(kv_digests.lines(result, "prefill")) == prefill_lines
    assert len(kv_digests.lines(result, "decode")) == decode_lines


def test_dp_attention_prefill_rank_is_resolved_per_room():
    result = run_pair(plan("mla", {"prefill": 2, "decode": 1}, attn_dp={"prefill": 2}), env=ENV)
    p0, p1 = result["ranks"]["prefill"]
    assert statuses(p0) == {"3002": "Success", "3004": "Success"}  # room % 2 == 0
    assert statuses(p1) == {"3001": "Success"}
    assert_decode_ranks_got_everything(result, [3001, 3002, 3004])
    assert_every_rank_clean(result)


def test_prefill_abort_mid_transfer_fails_the_decode_with_the_cause():
    p = plan("mla", {"prefill": 1, "decode": 1}, requests=[{"room": 3101, "tokens": 400, "chunk_pages": 5}])
    p["faults"] = {"prefill": {"abort_after_chunks": 2, "chunk_delay_s": 0.1}}
    result = run_pair(p, env=ENV)
    pr, dr = result["prefill"]["requests"]["3101"], result["decode"]["requests"]["3101"]
    assert pr["status"] == "Failed" and "Aborted by AbortReq" in pr["reason"], pr
    assert dr["status"] == "Failed" and "Aborted on prefill" in dr["reason"], dr
    assert dr["seconds"] < 8
    assert result["decode"]["untouched_violations"] == []
    assert_every_rank_clean(result)
