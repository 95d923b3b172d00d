"""Pure parts of trust without a key: pair secrets (issued per registration, carried by every later frame list,
matched in constant time, bounded), what a refusal reveals of this rank's agreement, the aux layout in the
agreement, and the bootstrap server's field checks and write signatures."""

import pytest

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.agreement import differences, local_agreement, redacted
from sglang_p2p_backend.engine.wire.pair_secret import PAIR_MAGIC, IssuedSecrets, open_frames, seal


def agreement(**kw):
    base = dict(page_size=16, kv_dtype="bfloat16", kv_item_lens=[4096] * 4, state_item_lens=[], slot_bytes=1 << 20,
                auth=False, aux_item_lens=[8, 64])
    return local_agreement(**{**base, **kw})


def test_secrets_travel_with_frames_and_name_their_owner():
    issued = IssuedSecrets(limit=3)
    a, b = issued.issue("10.0.0.1:1"), issued.issue("10.0.0.2:2")
    assert a != b and len(a) == 16
    frames = wire.encode(wire.Heartbeat("10.0.0.1:1", 1))
    sealed = seal(frames, a)
    assert sealed[:2] == [PAIR_MAGIC, a] and open_frames(sealed) == (a, frames)
    assert seal(frames, None) == frames and open_frames(frames) == (None, frames)
    assert issued.matches("10.0.0.1:1", a) and not issued.matches("10.0.0.1:1", b)
    assert not issued.matches("10.0.0.1:1", None) and not issued.matches("10.0.0.9:9", a)
    assert issued.owner(b) == "10.0.0.2:2" and issued.owner(b"x" * 16) is None and issued.owner(None) is None
    again = issued.issue("10.0.0.1:1")  # a new registration voids the old secret
    assert not issued.matches("10.0.0.1:1", a) and issued.matches("10.0.0.1:1", again)
    for i in range(3, 6):  # bounded: the oldest is forgotten
        issued.issue(f"10.0.0.{i}:1")
    assert len(issued) == 3 and issued.owner(b) is None


def test_a_refusal_reveals_only_what_differs():
    mine = agreement(kv_item_lens=[2048] * 4, attn_tp_size=2, kv_total_heads=8)
    theirs = agreement(page_size=32, kv_dtype="fp8_e4m3")
    told = redacted(mine, theirs)
    # the values that differ are ours; everything else is what the peer sent
    assert (told.page_size, told.kv_dtype, told.kv_item_lens) == (16, "bfloat16", [2048] * 4)
    assert (told.attn_tp_size, told.kv_total_heads) == (2, 8)
    same = agreement(page_size=32, kv_dtype="fp8_e4m3", slot_bytes=1 << 20)
    assert redacted(mine, same).slot_bytes == same.slot_bytes
    # and the peer names exactly those differences, both values
    lines = differences(theirs, told, "decode", "prefill")
    assert any(line.startswith("page size differs: decode 32, prefill 16") for line in lines), lines
    assert redacted(theirs, theirs) == theirs


def test_aux_layout_is_compared_with_both_values():
    lines = differences(agreement(), agreement(aux_item_lens=[8, 128]), "prefill", "decode")
    assert lines == [f"aux (metadata) layout (bytes per row of every aux buffer) differs: prefill [8, 64], decode "
                     f"[8, 128]; run the same SGLang release with the same speculative-decoding, logprob and "
                     f"--disaggregation-enable-kv-checksum settings on prefill and decode"]


def test_protocol_mismatch_names_both_versions():
    old = wire.Agreement(**{**{f: getattr(agreement(), f) for f in wire.Agreement.__struct_fields__}, "protocol": 4})
    line = differences(agreement(), old, "prefill", "decode")[0]
    assert line.startswith(f"p2pnccl protocol version differs: prefill {wire.PROTOCOL_VERSION}, decode 4")


# ------------------------------------------------------------------ bootstrap server checks (pure)
def test_route_fields_are_checked_by_name():
    bootstrap = pytest.importorskip("sglang_p2p_backend.adapter.bootstrap")  # imports SGLang's bootstrap server
    ok = {"attn_tp_size": 2, "attn_tp_rank": 1, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
          "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
          "rank_ip": "10.1.2.3", "rank_port": 4000, "page_size": 16, "kv_cache_dtype": "bfloat16"}
    assert bootstrap.route_put(dict(ok)) == ok
    assert bootstrap.route_put({**ok, "rank_ip": "prefill-0.prefill.svc"})
    for bad, needle in (({"rank_port": 70000}, "'rank_port' = 70000"), ({"attn_tp_rank": 2}, "'attn_tp_rank' = 2"),
                        ({"page_size": True}, "'page_size' must be an integer"), ({"rank_ip": ""}, "'rank_ip'"),
                        ({"kv_cache_dtype": 3}, "'kv_cache_dtype'"), ({"enable_kv_cache_sharding": "yes"}, "true or false")):
        with pytest.raises(bootstrap.BadRequest, match=needle):
            bootstrap.route_put({**ok, **bad})


def test_write_signatures_bind_key_method_path_body_and_time():
    bootstrap = pytest.importorskip("sglang_p2p_backend.adapter.bootstrap")
    key, body, now = b"k" * 20, b'{"a": 1}', 1_000_000
    sig = bootstrap.signature(key, "PUT", "/route", body, now)
    assert bootstrap.signature_ok(key, "PUT", "/route", body, sig, now + 10)
    assert not bootstrap.signature_ok(key, "PUT", "/route", body + b" ", sig, now)
    assert not bootstrap.signature_ok(key, "POST", "/route", body, sig, now)
    assert not bootstrap.signature_ok(b"j" * 20, "PUT", "/route", body, sig, now)
    assert not bootstrap.signature_ok(key, "PUT", "/route", body, sig, now + 301)  # too old: not replayable later
    assert not bootstrap.signature_ok(key, "PUT", "/route", body, "garbage", now)
