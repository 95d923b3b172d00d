"""The control protocol's pure parts: the HMAC envelope, the agreement comparison, the wire bounds, and a
property-based fuzz of every message decoder and check (random and mutated frames raise nothing but
WireError, and never yield ids outside the receiver's bounds)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_p2p_backend.engine.wire import checks
from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.agreement import differences, local_agreement
from sglang_p2p_backend.engine.wire.auth import AuthError, Authenticator, key_from_env
from sglang_p2p_backend.engine.pair.liveness import PeerWatch

KEY = b"k" * 32


def agreement(**kw):
    base = dict(page_size=16, kv_dtype="bfloat16", kv_item_lens=[4096] * 4, state_item_lens=[], slot_bytes=1 << 20, auth=False)
    return local_agreement(**{**base, **kw})


def register(session="127.0.0.1:7000", kv_pages=100, aux_rows=8, state_slots=(4,)):
    return wire.PeerRegister(session=session, incarnation=1, hostname="h", engine_rank=0, attn_tp_size=1,
                             agreement=agreement(), kv_ptrs=[0] * 4, aux_ptrs=[0], aux_item_lens=[64], state_ptrs=[[0]],
                             kv_pages=kv_pages, aux_rows=aux_rows, state_slots=list(state_slots), transports=["tcp"])


# ------------------------------------------------------------------ auth
def test_envelope_round_trip_and_every_forgery_is_refused():
    alice, bob = Authenticator(KEY, "a:1", 100), Authenticator(KEY, "b:2", 5)
    frames = wire.encode(wire.Heartbeat("a:1", 100))
    sealed = alice.seal(frames, 1)
    assert bob.open(sealed) == ("a:1", frames)
    with pytest.raises(AuthError, match="replayed"):
        bob.open(sealed)
    with pytest.raises(AuthError, match="wrong authentication tag"):
        bob.open(sealed[:3] + [frames[0], frames[1] + b"x"])  # tampered payload
    with pytest.raises(AuthError, match="wrong authentication tag"):
        bob.open(Authenticator(b"z" * 32, "a:1", 100).seal(frames, 2))  # another key
    with pytest.raises(AuthError, match="unauthenticated"):
        bob.open(frames)
    assert bob.open(alice.seal(frames, 2))[0] == "a:1"  # the next counter passes
    with pytest.raises(AuthError, match="replayed"):  # an older process of the same session
        bob.open(Authenticator(KEY, "a:1", 99).seal(frames, 50))
    assert bob.open(Authenticator(KEY, "a:1", 101).seal(frames, 1))[0] == "a:1"  # a restarted one
    assert bob.dropped == 5


def test_key_settings(tmp_path):
    assert key_from_env({}) is None
    f = tmp_path / "key"
    f.write_text("0123456789abcdef0123\n")
    assert key_from_env({"SGLANG_P2P_AUTH_KEY_FILE": str(f)}) == b"0123456789abcdef0123"
    with pytest.raises(ValueError, match="at least 16"):
        key_from_env({"SGLANG_P2P_AUTH_KEY": "short"})
    with pytest.raises(ValueError, match="not both"):
        key_from_env({"SGLANG_P2P_AUTH_KEY": "x" * 16, "SGLANG_P2P_AUTH_KEY_FILE": str(f)})
    with pytest.raises(ValueError, match="cannot be read"):
        key_from_env({"SGLANG_P2P_AUTH_KEY_FILE": str(tmp_path / "missing")})


# ------------------------------------------------------------------ agreement
def test_differences_name_each_parameter_with_both_values_and_the_fix():
    lines = differences(agreement(), agreement(page_size=32, slot_bytes=1 << 19), "prefill", "decode")
    assert len(lines) == 2
    assert lines[0].startswith("page size differs: prefill 16, decode 32") and "--page-size" in lines[0]
    assert "prefill 1048576, decode 524288" in lines[1] and "SGLANG_P2P_STAGING_MB" in lines[1]
    assert differences(agreement(), agreement(), "prefill", "decode") == []


def test_sglang_layout_labels_and_state_types_are_compared_with_both_values():
    mine = agreement(kv_layout="flashmla", swa_kv_cache_layout="nhd", state_types=["swa"])
    theirs = agreement(kv_layout="fp8_ds_mla", swa_kv_cache_layout="hnd", state_types=["swa", "block_scale_swa"])
    assert differences(mine, theirs, "decode", "prefill") == [
        "KV byte layout (KVArgs.kv_layout) differs: decode 'flashmla', prefill 'fp8_ds_mla'; launch both with the same "
        "--dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT",
        "SWA sub-pool layout (KVArgs.swa_kv_cache_layout) differs: decode 'nhd', prefill 'hnd'; set the same "
        "SGLANG_USE_HND_KVCACHE and SGLANG_AITER_KV_CACHE_LAYOUT on prefill and decode",
        "kind of every state component (KVArgs.state_types) differs: decode ['swa'], prefill ['swa', 'block_scale_swa']; prefill and "
        "decode must run the same model",
    ]
    assert differences(agreement(kv_layout=None), agreement(kv_layout=""), "decode", "prefill") == []  # 0.5.17: none


def test_head_major_mha_pages_must_match_and_are_never_sliced_by_heads():
    assert differences(agreement(mha_layout="hnd"), agreement(), "prefill", "decode") == [
        "MHA KV page layout (head-major: SGLANG_USE_HND_KVCACHE) differs: prefill 'hnd', decode none; set the same "
        "SGLANG_USE_HND_KVCACHE on prefill and decode"]
    # attention TP 1 -> 2 over 4 heads would slice pages by heads: refused with both sides head-major too
    one, two = (agreement(mha_layout="hnd", attn_tp_size=tp, kv_total_heads=4, kv_item_lens=[16 * 4 // tp * 256] * 4)
                for tp in (1, 2))
    (line,) = differences(one, two, "prefill", "decode")
    assert line.startswith("KV layout cannot be sliced by heads (head-major pages (SGLANG_USE_HND_KVCACHE) are not "
                           "sliced by p2pnccl): prefill attention TP 1"), line


# ------------------------------------------------------------------ liveness
def test_peer_watch_reports_silence_once_and_ignores_strangers():
    now = [0.0]
    watch = PeerWatch(8.0, clock=lambda: now[0])
    watch.watch("p")
    watch.seen("stranger")
    now[0] = 7.0
    watch.seen("p")
    now[0] = 14.0
    assert watch.expired() == [] and watch.alive("p")
    now[0] = 15.5
    assert watch.expired() == [("p", 8.5)] and watch.expired() == [] and not watch.alive("p")
    assert watch.peers() == []


# ------------------------------------------------------------------ checks
def test_room_metadata_ids_must_fit_the_registered_pools():
    peer = register()
    ok = wire.RoomMetadata(peer.session, 1, 5, np.arange(10, dtype=np.int32).tobytes(), 7, [b"\x03\x00\x00\x00"], 1, 0, False)
    assert checks.room_metadata(ok, peer).kv_ids.tolist() == list(range(10))
    for bad, field in [
        (dict(kv_ids=np.array([100], dtype=np.int32).tobytes()), "kv_ids: id 100 outside"),
        (dict(kv_ids=np.array([-1], dtype=np.int32).tobytes()), "kv_ids: id -1 outside"),
        (dict(kv_ids=b"\x00\x00\x00"), "not a whole number"),
        (dict(aux_index=8), "aux_index 8 outside"),
        (dict(state_ids=[np.array([4], dtype=np.int32).tobytes()]), "state_ids[0]: id 4"),
        (dict(state_ids=[b"", b""]), "2 state components"),
        (dict(session="127.0.0.1:1"), "is not the registered"),
    ]:
        msg = wire.RoomMetadata(**{**{f: getattr(ok, f) for f in ok.__struct_fields__}, **bad})
        with pytest.raises(wire.WireError, match=field.replace("[", r"\[").replace("]", r"\]")):
            checks.room_metadata(msg, peer)


def published(kv=range(10, 20)):
    return checks.Published(np.array(list(kv), dtype=np.int32), 3, [], frozenset({"p:1"}))


def header(ids, seq=0, nbytes=None, group=0, session="p:1"):
    seg = wire.ChunkSegment(group, 0, 2, np.array(ids, dtype=np.int32).tobytes())
    return wire.ChunkHeader(session, 1, 9, 0, seq, len(ids) * 8 if nbytes is None else nbytes, [seg])


def test_a_chunk_lands_only_in_its_rooms_pages_in_sequence_and_exact_size():
    pub, lens = published(), [[4, 4]]
    v = checks.chunk_header(header([10, 11]), lens, 64, pub)
    assert v.problem is None and v.ids[0].tolist() == [10, 11] and v.chunk.nbytes == 16
    assert "chunk 0 arrived where chunk 1" in checks.chunk_header(header([12]), lens, 64, pub).problem
    assert "not pages this room published" in checks.chunk_header(header([5], seq=1), lens, 64, pub).problem
    assert "does not match" in checks.chunk_header(header([12], seq=2, nbytes=9), lens, 64, pub).problem
    assert "does not serve" in checks.chunk_header(header([12], session="x:2"), lens, 64, pub).problem
    assert "not waiting" in checks.chunk_header(header([12]), lens, 64, None).problem
    big = checks.chunk_header(header([12], seq=3, nbytes=65), lens, 64, pub)
    assert not big.in_step and "exceeds this decode rank's staging slot of 64" in big.problem


def test_published_pages_are_checked_run_by_run_in_order_and_looked_up_otherwise():
    # a prefill rank sends the published pages in order: each chunk is compared with the run after the last one,
    # without sorting the room's pages; anything else is looked up among all of them, as strictly
    pub, lens = published(range(10, 20)), [[4, 4]]
    pub.prefills = frozenset({"p:1", "p:2"})
    assert checks.chunk_header(header([10, 11, 12]), lens, 64, pub).problem is None
    assert checks.chunk_header(header([13, 14], seq=1), lens, 64, pub).problem is None
    assert pub._sorted == [] and pub.next_kv == {0: 5}
    two = wire.ChunkHeader("p:2", 1, 9, 1, 0, 16, [wire.ChunkSegment(0, 0, 2, np.array([10, 11], np.int32).tobytes())])
    assert checks.chunk_header(two, lens, 64, pub).problem is None  # prefill rank 1's own run starts at 0
    assert pub.next_kv == {0: 5, 1: 2}
    assert checks.chunk_header(header([19, 15], seq=2), lens, 64, pub).problem is None  # published, not the run
    assert pub._sorted and pub.next_kv[0] == 7
    refused = checks.chunk_header(header([17, 99], seq=3), lens, 64, pub)  # 17 is the run's next; 99 is not ours
    assert "not pages this room published" in refused.problem and pub.next_kv[0] == 7
    assert "not pages this room published" in checks.chunk_header(header([18, 20], seq=4), lens, 64, pub).problem
    assert checks.chunk_header(header([17, 18], seq=5), lens, 64, pub).problem is None and pub.next_kv[0] == 9


def test_a_chunk_whose_kv_ids_are_the_next_run_says_where_in_the_rooms_list_they_start():
    # the receiver then slices the room's one upload of its list (room_ids.py); a chunk looked up out of order, or
    # refused, names no run
    pub, lens = published(range(10, 20)), [[4, 4]]
    first = checks.chunk_header(header([10, 11, 12]), lens, 64, pub)
    assert first.kv_run[0] is pub.kv_ids and first.kv_run[1] == 0
    second = checks.chunk_header(header([13, 14], seq=1), lens, 64, pub)
    assert second.kv_run[0] is pub.kv_ids and second.kv_run[1] == 3
    assert pub.kv_ids[3:5].tolist() == second.ids[0].tolist()
    assert checks.chunk_header(header([19, 15], seq=2), lens, 64, pub).kv_run is None  # published, not the run
    refused = checks.chunk_header(header([17, 99], seq=3), lens, 64, pub)
    assert refused.chunk is None and refused.kv_run is None
    assert checks.chunk_layout(header([17, 18]), lens, 64).kv_run is None  # no room to compare with


def test_aux_rows_go_only_to_the_rooms_row():
    pub = published()
    checks.aux_data(wire.AuxData("p:1", 9, 3, [b"x" * 8]), [8], pub)
    for msg, field in [
        (wire.AuxData("p:1", 9, 4, [b"x"]), "is not the room's row 3"),
        (wire.AuxData("p:1", 9, 3, [b"x" * 9]), "exceeds the buffer's 8-byte rows"),
        (wire.AuxData("p:1", 9, 3, [b"", b""]), "2 aux rows for 1"),
        (wire.AuxData("q:2", 9, 3, [b""]), "does not serve"),
    ]:
        with pytest.raises(wire.WireError, match=field):
            checks.aux_data(msg, [8], pub)


# ------------------------------------------------------------------ fuzz
SEEDS = [
    wire.encode(register()),
    wire.encode(wire.RoomMetadata("d:1", 1, 9, np.arange(4, dtype=np.int32).tobytes(), 1, [b""], 1, 0, False)),
    wire.encode(header([10, 11])),
    wire.encode(wire.AuxData("p:1", 9, 3, [b"x" * 8])),
    wire.encode(wire.Status("p:1", 9, 0, 4, "")),
    wire.encode(wire.CommOffer("p:1", 1, 16)),
    wire.encode(wire.PeerAnswer("p:1", 1, 0, agreement(), "")),
]


def _use(msg) -> None:
    """Run the receiver-side check of a decoded message, as the roles do before using it."""
    if isinstance(msg, wire.RoomMetadata):
        d = checks.room_metadata(msg, register(session=msg.session))
        assert d.kv_ids.size == 0 or (d.kv_ids.min() >= 0 and d.kv_ids.max() < 100)
    elif isinstance(msg, wire.ChunkHeader):
        v = checks.chunk_header(msg, [[4, 4]], 64, published())
        if v.problem is None:
            assert all(set(i.tolist()) <= set(range(10, 20)) for i in v.ids[:1]) and v.chunk.nbytes <= 64
    elif isinstance(msg, wire.AuxData):
        checks.aux_data(msg, [8], published())
    elif isinstance(msg, wire.Status):
        checks.status(msg.status)


@settings(max_examples=600, deadline=None)
@given(seed=st.sampled_from(SEEDS), cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6),
       tail=st.binary(max_size=32))
def test_mutated_frames_raise_nothing_but_wire_errors(seed, cut, flips, tail):
    body = bytearray(seed[1][: max(1, len(seed[1]) - cut % len(seed[1]))])
    for pos, value in flips:
        body[pos % len(body)] = value
    try:
        msg = wire.decode([wire.MAGIC, bytes(body) + tail])
        _use(msg)
    except wire.WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames_raise_nothing_but_wire_errors(frames):
    try:
        wire.decode([wire.MAGIC, *frames])
    except wire.WireError:
        pass
    if frames[:1] != [wire.MAGIC]:  # not ours: SGLang's frames, handed on undecoded
        assert wire.decode(frames) is None
