"""Different attention TP on the two sides of an MHA/GQA model, through SGLang's real rank mapping (one process per
TP rank): each decode rank receives exactly its heads, from the prefill rank(s) that own them, each head once
(replicated KV heads: a prefill rank holding a replica sends none), in chunked sends; no other page changes.

Every decode rank checks every page of every request against the model's contents of exactly its heads
(testing/pools.py: contents are defined per head of the model, a rank's pool holds its heads of them), and
that the prefill ranks' writes moved each head once. Each run also aborts a request in the middle of its
transfer. Plus a head count that cannot be split (refused at registration on both sides with both layouts
named), and DP attention on either side. Every run costs several processes of SGLang start-up: pairings are
spread over the cases, not multiplied (the full pairing matrix runs in tests/engine/test_heads.py).
"""

import importlib.util

import pytest

from sglang_p2p_backend.testing.launch import run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "8", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "8",
       # small staging slots: several chunks per request, each packing many pages' head slices
       "SGLANG_P2P_STAGING_MB": "1"}
MOONCAKE = {"SGLANG_P2P_TRANSPORT": "mooncake", "MC_FORCE_TCP": "1", "GLOG_minloglevel": "2"}
HAS_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def plan(tp, total_heads, page_size, attn_dp=None, tokens=(83, 40, 41), chunk_pages=4, head_dim=64):
    ps = page_size
    requests = [{"room": 4001, "tokens": tokens[0] * ps, "chunk_pages": chunk_pages},
                {"room": 4002, "tokens": tokens[1] * ps + 3},  # one send, partial last page
                {"room": 4004, "tokens": tokens[2] * ps, "chunk_pages": 7, "prefix": 8 * ps}]
    p = {"pool": {"layout": "mha", "num_layers": 3, "page_size": ps, "num_pages": 400, "head_dim": head_dim,
                  "total_kv_heads": total_heads},
         "tp": tp, "requests": requests, "deadline_s": 40}
    if attn_dp:
        p["attn_dp"] = attn_dp
    return p


def rooms(p):
    return [r["room"] for r in p["requests"]]


def assert_heads_landed(result, rooms_by_decode_rank, failed=()):
    for d, want in zip(result["ranks"]["decode"], rooms_by_decode_rank):
        assert d is not None, f"a decode rank died: {result['workdir']}"
        assert sorted(d["requests"]) == sorted(map(str, want)), (sorted(d["requests"]), want)
        for room in want:
            r = d["requests"][str(room)]
            if room in failed:
                assert r["status"] == "Failed", r
                continue
            assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], (result["workdir"], r)
        assert d["untouched_violations"] == [], d["untouched_violations"]


def assert_clean(result):
    for role in ("prefill", "decode"):
        for side in result["ranks"][role]:
            assert side is not None, f"a {role} rank died: {result['workdir']}"
            left = side["leftovers"]
            assert left["request_status"] == [] and left["staging_in_use"] == 0, left
            assert left.get("transfer_infos", []) == [] and left.get("live_rooms", []) == [], left
            assert left.get("arrivals_pending", 0) == 0, left
            assert side["threads_left"] == []


def kv_bytes_sent(result, rooms):
    """KV bytes every prefill rank's writes moved for `rooms` (the driver counts what each send returned)."""
    return sum(p["requests"][str(room)].get("sent_bytes", 0) for p in result["ranks"]["prefill"] for room in rooms)


# (prefill TP, decode TP, model KV heads, page size, abort): one prefill rank feeding several decode ranks and
# several feeding one, GQA with fewer KV heads than TP ranks on either side (replicated heads); each run also
# aborts one more request in the middle of its transfer, on one side or the other
ABORT_PREFILL = {"side": "prefill", "at": "chunk", "n": 2}
ABORT_DECODE = {"side": "decode", "at": "transfer", "after_s": 0.15}
CASES = [
    pytest.param(1, 2, 4, 16, ABORT_DECODE, id="p1d2-h4-ps16"),
    pytest.param(2, 1, 4, 1, ABORT_PREFILL, id="p2d1-h4-ps1"),
    pytest.param(2, 4, 8, 1, ABORT_DECODE, id="p2d4-h8-ps1"),
    pytest.param(4, 2, 8, 16, ABORT_PREFILL, id="p4d2-h8-ps16"),
    pytest.param(1, 4, 2, 16, ABORT_PREFILL, id="p1d4-h2-ps16"),  # decode ranks 0,1 share head 0, 2,3 head 1
    pytest.param(4, 2, 2, 1, ABORT_DECODE, id="p4d2-h2-ps1"),  # prefill ranks 1 and 3 hold replicas: no KV from them
]  # more pairings (4 -> 1 with one head, 4 -> 8, ...) in tests/engine/test_heads.py, without processes


@pytest.mark.parametrize("p_tp,d_tp,heads,page_size,abort", CASES)
def test_each_decode_rank_gets_exactly_its_heads_once(p_tp, d_tp, heads, page_size, abort):
    p = plan({"prefill": p_tp, "decode": d_tp}, heads, page_size)
    p["requests"].append({"room": 4009, "tokens": 60 * page_size, "chunk_pages": 4, "abort": abort})
    p["faults"] = {"prefill": {"chunk_delay_s": 0.03}}  # the aborted request is still moving when it is aborted
    # a decode rank's destinations of the aborted room may reach a prefill rank after it failed and cleared the
    # room (its other decode rank aborted first): kept as a room never started, and reclaimed after
    # SGLANG_P2P_TOMBSTONE_S, here 2 s, before the prefill reports what is left
    p["linger_s"] = {"prefill": 3.0}
    result = run_pair(p, env={**ENV, "SGLANG_P2P_TOMBSTONE_S": "2"})
    done = rooms(p)[:-1]
    assert_heads_landed(result, [rooms(p)] * d_tp, failed=[4009])
    for pr in result["ranks"]["prefill"]:
        assert {pr["requests"][str(r)]["status"] for r in done} == {"Success"}, pr["requests"]
        assert pr["requests"]["4009"]["status"] == "Failed"
    # every decode head's bytes crossed once: replicas sent nothing, no rank sent whole pages
    spec = p["pool"]
    pages = sum(-(-r["tokens"] // page_size) - r.get("prefix", 0) // page_size for r in p["requests"][:-1])
    head_page_bytes = spec["head_dim"] * 2 * 2 * spec["num_layers"] * page_size  # bf16, K and V
    assert kv_bytes_sent(result, done) == pages * head_page_bytes * max(heads, d_tp)
    assert_clean(result)


@pytest.mark.skipif(not HAS_MOONCAKE, reason="Mooncake not installed")
def test_one_sided_writes_land_exactly_the_heads():
    p = plan({"prefill": 2, "decode": 1}, 4, 16, tokens=(20, 9, 12))
    result = run_pair(p, env={**ENV, **MOONCAKE})
    assert_heads_landed(result, [rooms(p)])
    assert_clean(result)


def test_heads_that_do_not_split_are_refused_naming_both_layouts():
    # 3 KV heads: TP 2 cannot split them (SGLang itself would not start so; the pair is refused on both sides)
    p = plan({"prefill": 1, "decode": 2}, 3, 1, tokens=(5, 3, 12))
    p["requests"] = p["requests"][:1]
    p["pool_overrides"] = {"decode": {"total_kv_heads": 0, "kv_heads": 1}}
    # the prefill's room fails at once; it stays up until both answers reached the decode ranks (closing its
    # sockets drops what they still queue: a loaded machine lost the second refusal so)
    p["linger_s"] = {"prefill": 3.0}
    result = run_pair(p, env=ENV)
    for d in result["ranks"]["decode"]:
        r = d["requests"]["4001"]
        assert r["status"] == "Failed" and "cannot be sliced by heads" in r["reason"], r
        assert "prefill attention TP 1" in r["reason"] and "decode attention TP 2" in r["reason"], r["reason"]
    for pr in result["ranks"]["prefill"]:
        assert pr["requests"]["4001"]["status"] == "Failed"
        assert pr["leftovers"]["rejected_peers"], pr["leftovers"]  # refused on the prefill side too
    assert_clean(result)


def test_dp_attention_on_the_decode_rooms_land_on_the_chosen_rank():
    # decode: 2 DP ranks of attention TP 1; SGLang's decode load balancer picks the rank per request
    p = plan({"prefill": 1, "decode": 2}, 2, 16, attn_dp={"decode": 2})
    p["decode_dp_rank"] = {"4001": 1, "4002": 1, "4004": 0}
    result = run_pair(p, env=ENV)
    assert_heads_landed(result, [[4004], [4001, 4002]])  # and the other rank's pages stayed untouched
    assert_clean(result)


def test_dp_attention_on_the_prefill_with_different_attention_tp():
    # prefill: 2 DP ranks of attention TP 1 (room % 2, the bootstrap server's routing); decode: attention TP 2,
    # each decode rank takes its heads from the DP rank that holds the room
    p = plan({"prefill": 2, "decode": 2}, 4, 1, attn_dp={"prefill": 2})
    result = run_pair(p, env=ENV)
    assert_heads_landed(result, [rooms(p)] * 2)
    p0, p1 = result["ranks"]["prefill"]
    assert sorted(p0["requests"]) == ["4002", "4004"] and sorted(p1["requests"]) == ["4001"]  # room % 2
    assert_clean(result)
