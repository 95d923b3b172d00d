"""The KV digest comparer of the end-to-end shapes (e2e/kv_digest.py): the line the backend logs parses, rooms
pair across servers and ranks (MLA: all equal; MHA/GQA: by attention TP rank, only at equal attention TP and
page size), one-sided rooms and mismatches are reported, and corrupted rooms count as controls."""

from e2e import kv_digest
from sglang_p2p_backend.adapter.kv_digest import DigestLabel, format_line


def line(role, room, digest, rank=0, tp=(0, 1), mla=True, page=1, pages=4):
    return format_line(DigestLabel(role, rank, tp[0], tp[1], mla, page), room, pages, digest)


def logs(*lines):
    return "\n".join(f"[2026-01-01 00:00:00 TP0] {l}" for l in lines)  # as SGLang's log format prefixes them


def test_the_logged_line_parses_back():
    text = logs(line("decode", 7, 0xABC, rank=3, tp=(1, 2), mla=False, page=16, pages=5), "other noise")
    (d,) = kv_digest.parse(text, "decode-0")
    assert d == kv_digest.Digest("decode", 7, 3, 1, 2, False, 16, 5, "0000000000000abc", "decode-0")


def test_mla_rooms_pair_across_servers_and_dp_ranks():
    """Two TP-1 prefill servers, one decode with attention DP 2: each room on one prefill and one decode rank."""
    prefill = {"prefill-0": logs(line("prefill", 1, 11), line("prefill", 3, 33)), "prefill-1": logs(line("prefill", 2, 22))}
    decode = {"decode": logs(line("decode", 1, 11, rank=0), line("decode", 2, 22, rank=1), line("decode", 3, 33, rank=1))}
    got = kv_digest.compare(prefill, decode)
    assert (got["rooms_compared"], got["rooms_equal"], got["mismatched"], got["rooms_missing_a_side"]) == (3, 3, 0, 0)


def test_mla_every_digest_of_a_room_must_be_equal():
    """One prefill rank feeding two decode ranks (decode TP 2): both decode ranks must hold the same bytes."""
    prefill = {"p": logs(line("prefill", 5, 1))}
    ok = kv_digest.compare(prefill, {"d": logs(line("decode", 5, 1, rank=0, tp=(0, 2)), line("decode", 5, 1, rank=1, tp=(1, 2)))})
    bad = kv_digest.compare(prefill, {"d": logs(line("decode", 5, 1, rank=0, tp=(0, 2)), line("decode", 5, 2, rank=1, tp=(1, 2)))})
    assert ok["rooms_equal"] == 1 and bad["rooms_equal"] == 0 and bad["mismatched"] == 1
    (m,) = bad["mismatches"]
    assert m["room"] == 5 and [d["digest"] for d in m["decode"]] == ["0" * 15 + "1", "0" * 15 + "2"]
    assert m["decode"][1]["server"] == "d" and m["decode"][1]["rank"] == 1


def test_mha_pairs_by_attention_tp_rank_and_other_layouts_are_not_compared():
    mha = dict(mla=False, page=16)
    prefill = {"p": logs(line("prefill", 9, 1, rank=0, tp=(0, 2), **mha), line("prefill", 9, 2, rank=1, tp=(1, 2), **mha))}
    same = {"d": logs(line("decode", 9, 1, rank=0, tp=(0, 2), **mha), line("decode", 9, 2, rank=1, tp=(1, 2), **mha))}
    swapped = {"d": logs(line("decode", 9, 2, rank=0, tp=(0, 2), **mha), line("decode", 9, 1, rank=1, tp=(1, 2), **mha))}
    assert kv_digest.compare(prefill, same)["rooms_equal"] == 1
    assert kv_digest.compare(prefill, swapped)["mismatched"] == 1  # rank 0's heads are not rank 1's
    # the decode at another attention TP holds other heads of each page: no verdict, counted apart
    other_tp = {"d": logs(line("decode", 9, 7, rank=0, tp=(0, 1), **mha))}
    other_page = {"d": logs(line("decode", 9, 1, rank=0, tp=(0, 2), mla=False, page=1))}
    for decode in (other_tp, other_page):
        got = kv_digest.compare(prefill, decode)
        assert (got["rooms_not_comparable"], got["rooms_compared"], got["mismatched"]) == (1, 0, 0)


def test_rooms_with_one_side_only_are_reported_not_compared():
    got = kv_digest.compare({"p": logs(line("prefill", 1, 1), line("prefill", 2, 2))}, {"d": logs(line("decode", 2, 2), line("decode", 4, 4))})
    assert (got["rooms_compared"], got["rooms_equal"], got["rooms_missing_a_side"]) == (1, 1, 2)
    assert [(m["room"], len(m["prefill"]), len(m["decode"])) for m in got["missing"]] == [(1, 1, 0), (4, 0, 1)]


def test_rooms_the_decode_corrupted_are_controls_that_must_mismatch():
    fault = "test fault (/s/corrupt exists): zeroed 3 pages of room {} from page 9 in 4 KV regions"
    prefill = {"p": logs(line("prefill", 1, 1), line("prefill", 2, 2), line("prefill", 3, 3))}
    decode = {"d": logs(line("decode", 1, 1), fault.format(2), line("decode", 2, 99), fault.format(3), line("decode", 3, 3))}
    got = kv_digest.compare(prefill, decode)
    assert (got["rooms_compared"], got["rooms_equal"], got["control_rooms"], got["controls_flagged_by_digest"]) == (1, 1, 2, 1)
    assert [c["room"] for c in got["controls_not_flagged"]] == [3]  # zeroed, yet equal: the digest missed it
    assert not kv_digest.passed(got, min_rooms=1, kv_controls=2)
    decode["d"] = decode["d"].replace("decode room=3 rank=0 attn_tp=0/1 mla=1 page=1 pages=4 digest=" + "0" * 15 + "3",
                                      "decode room=3 rank=0 attn_tp=0/1 mla=1 page=1 pages=4 digest=" + "0" * 15 + "4")
    got = kv_digest.compare(prefill, decode)
    assert kv_digest.passed(got, min_rooms=1, kv_controls=2)
    assert not kv_digest.passed(got, min_rooms=2, kv_controls=2)  # too few rooms compared
    assert not kv_digest.passed(got, min_rooms=1, kv_controls=3)  # a control request left no corrupted room


def test_a_mismatch_fails_and_the_listing_is_bounded():
    prefill = {"p": logs(*(line("prefill", r, r) for r in range(50)))}
    decode = {"d": logs(*(line("decode", r, r + 1) for r in range(50)))}
    got = kv_digest.compare(prefill, decode)
    assert got["mismatched"] == 50 and len(got["mismatches"]) == kv_digest.LISTED
    assert not kv_digest.passed(got, min_rooms=1, kv_controls=0)
