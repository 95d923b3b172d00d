"""Trust without a shared key, through SGLang's classes (one process per role on 127.0.0.1, tcp transport): a
sender that is not one of a pair's two processes cannot make a room succeed with wrong bytes, cannot lock decodes
out with registrations from addresses it does not own, and every mismatch between a prefill and a decode fails
both sides' requests within seconds naming both values; a refusal lasts only as long as its cause.

The hostile party is this test process (tests/support/hostile.py). No test here sets
SGLANG_P2P_AUTH_KEY unless it says so: the default configuration is what most users run.
"""

import json
import os
import time

import msgspec
import numpy as np
import pytest
from support import hostile
from test_control_plane import HOSTILE_ENV, KEY, LINGER, POOL, slow_rooms
from test_pd_transfer import FAST_FAILURE_ENV, assert_all_landed, failed_reason

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.agreement import local_agreement
from sglang_p2p_backend.engine.wire.pair_secret import PAIR_MAGIC
from sglang_p2p_backend.testing.launch import PairRun, run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

#: SGLang's own timeouts well above what these tests allow, so only our refusals can end a room in time
SLOW_SGLANG_ENV = {**FAST_FAILURE_ENV, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
                   "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120"}


def test_forged_success_without_a_key_leaves_rooms_byte_exact():
    """The attack: claim the prefill's session (the bootstrap server tells anyone), send Status(Success) for the
    live rooms, then an AuxData for every aux row. Before pair secrets the decode reported those rooms Success with
    most pages wrong."""
    rooms = [801, 802, 803]
    plan = {"pool": POOL, "requests": slow_rooms(rooms, tokens=200), "faults": {"prefill": {"chunk_delay_s": 0.4}},
            "deadline_s": 60, "linger_s": LINGER}
    run = PairRun(plan, env=HOSTILE_ENV)
    prefill, decode = run.session("prefill"), run.session("decode")
    time.sleep(2.0)  # rooms published, chunks flowing
    # Success first: once a room has succeeded, a wrong aux row guess no longer fails it
    forged = [wire.encode(wire.Status(prefill, room, 0, 4)) for room in rooms]  # KVPoll.Success
    rows = [b"\x07" * min(8, n) for n in _aux_item_lens()]  # every aux buffer: its room id, first token...
    for room in rooms:
        forged += [wire.encode(wire.AuxData(prefill, room, row, rows)) for row in range(64)]
    hostile.push(decode, forged)
    result = run.wait(90)
    assert_all_landed(result, rooms)  # every room Success with every page and aux row exact
    assert result["decode"]["leftovers"]["dropped"]["secret"] == len(forged)


def _aux_item_lens() -> list:
    """Bytes of one row of each of SGLang's aux buffers, as the driver builds them."""
    from sglang_p2p_backend.testing import runtime

    return runtime.metadata_buffers(64).get_buf_infos()[2]


def _pool_agreement(pool: dict) -> wire.Agreement:
    """The agreement a decode rank of the driver sends (what an attacker would have learnt from an answer)."""
    from sglang_p2p_backend.testing.pools import PoolSpec

    spec = PoolSpec(**pool)
    aux_lens = _aux_item_lens()
    return local_agreement(page_size=spec.page_size, kv_dtype="bfloat16", kv_item_lens=[spec.item_len] * spec.num_regions,
                           state_item_lens=[], slot_bytes=128 << 20, auth=False, mla=spec.layout == "mla",
                           aux_item_lens=aux_lens)


def registration(session: str, agreement: wire.Agreement, secret: bytes = b"s" * 16) -> list:
    return wire.encode(wire.PeerRegister(
        session=session, incarnation=1, hostname="phantom", engine_rank=0, attn_tp_size=1,
        agreement=agreement, kv_ptrs=[1 << 20] * len(agreement.kv_item_lens), aux_ptrs=[], aux_item_lens=[],
        state_ptrs=[], kv_pages=1 << 20, aux_rows=64, state_slots=[], transports=["tcp"], secret=secret))


def phantom_registrations(count: int, agreement: wire.Agreement) -> list:
    return [registration(hostile.phantom(i), agreement) for i in range(count)]


def test_600_phantom_registrations_leave_the_real_decode_served():
    """Matching registrations from 600 addresses nobody answers at (and 200 that do not match), before and while
    the real decode registers: none becomes a peer (no slot, no live socket), the real decode is served, sockets
    and fds end flat, refusals are logged rate-limited."""
    rooms = [901, 902, 903]
    requests = [{**r, "start_after_s": 4.0} for r in slow_rooms(rooms)]
    # the prefill lingers until every unconfirmed registration expired (SGLANG_P2P_PEER_TIMEOUT)
    plan = {"pool": POOL, "requests": requests, "deadline_s": 60, "linger_s": {"prefill": 10.0, "decode": 3.0}}
    run = PairRun(plan, env={**HOSTILE_ENV, "SGLANG_P2P_MAX_PEERS": "512", "SGLANG_P2P_PEER_TIMEOUT": "4"})
    prefill = run.session("prefill")
    agreement = _pool_agreement(POOL)
    flood = phantom_registrations(600, agreement)
    mismatched = phantom_registrations(200, msgspec.structs.replace(agreement, page_size=99))
    assert hostile.push(prefill, flood[:550] + mismatched[:100]) == 650
    time.sleep(4.5)  # the decode registers now
    assert hostile.push(prefill, flood[550:] + mismatched[100:]) == 150
    result = run.wait(90)
    assert_all_landed(result, rooms)
    p = result["prefill"]
    left = p["leftovers"]
    # no phantom became a peer (the real decode, gone by now, was the only one)
    decode = run.session("decode")
    assert left["decode_peers"] in ([], [decode]) and left["watched_peers"] in ([], [decode]), left
    assert result["decode"]["leftovers"]["prefills"] == {prefill: "accepted"}
    assert left["control_sockets"] <= 1 and left["answer_sockets"] == 0, left
    assert left["pending_registrations"] == 0, left  # never confirmed, so forgotten
    res = p["resources"]
    assert res["fds_end"] - res["fds_start"] <= 16, res
    log = open(os.path.join(result["workdir"], "prefill-0.log")).read()
    assert 0 < log.count("p2pnccl: decode rank") <= 20, "refusal logs are rate-limited"


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_a_refused_stranger_cannot_fail_another_decodes_room(keyed):
    """A stranger listening at the address it claims registers and is refused (another page size; with the key,
    no envelope). The refusal carries no pair secret and, with the key, nothing of the prefill; the stranger's
    RoomMetadata naming the real decode's live rooms, sealed with whatever the refusal carried, fails nothing.
    Before, the refusal's secret failed such a room on the prefill within 0.05 s, and the decode that owned it
    waited for SGLang's waiting timeout."""
    rooms = [1201, 1202]
    plan = {"pool": POOL, "requests": slow_rooms(rooms, tokens=200), "faults": {"prefill": {"chunk_delay_s": 0.4}},
            "deadline_s": 60, "linger_s": LINGER}
    run = PairRun(plan, env={**HOSTILE_ENV, **(KEY if keyed else {})})
    prefill = run.session("prefill")
    run.session("decode")
    stranger = hostile.Stranger(prefill)
    mine = msgspec.structs.replace(_pool_agreement(POOL), page_size=99)
    try:
        stranger.send(registration(stranger.session, mine))
        ours, answer = stranger.answer()
        time.sleep(2.0)  # the real decode's rooms are published and transferring
        for room in rooms:  # as a refused decode tells the prefill of its rooms
            stranger.send(wire.encode(wire.RoomMetadata(stranger.session, 1, room, b"", -1, [], 1, 0, True)))
    finally:
        stranger.close()
    result = run.wait(90)
    assert_all_landed(result, rooms)
    assert ours == b"s" * 16 and answer.problem and answer.secret == b"", answer
    if keyed:  # 'authentication required' and nothing of this rank
        assert "SGLANG_P2P_AUTH_KEY set and the peer sends none" in answer.problem and "page" not in answer.problem
        assert answer.agreement == mine and (answer.incarnation, answer.prefill_rank, answer.attn_tp_rank) == (0, 0, 0)
    else:
        assert "page size differs: prefill 1, decode 99" in answer.problem, answer.problem
    dropped = result["prefill"]["leftovers"]["dropped"]
    assert dropped.get("auth" if keyed else "not-owner") == (3 if keyed else 2), dropped


def test_a_decode_of_the_previous_protocol_version_reads_its_refusal_naming_both_versions():
    """Frame lists between registered ranks go packed into one frame since protocol 9, several in one since 10
    (packing.py); a registration's answer does not, so a decode of the previous version reads why it was refused,
    and the pair in service is untouched."""
    rooms = [1301, 1302]
    plan = {"pool": POOL, "requests": slow_rooms(rooms, tokens=200), "faults": {"prefill": {"chunk_delay_s": 0.4}},
            "deadline_s": 60, "linger_s": LINGER}
    run = PairRun(plan, env=HOSTILE_ENV)
    prefill = run.session("prefill")
    run.session("decode")
    stranger = hostile.Stranger(prefill)
    try:
        old = wire.PROTOCOL_VERSION - 1
        stranger.send(registration(stranger.session, msgspec.structs.replace(_pool_agreement(POOL), protocol=old)))
        _, answer = stranger.answer()
    finally:
        stranger.close()
    result = run.wait(90)
    assert_all_landed(result, rooms)
    assert f"p2pnccl protocol version differs: prefill {wire.PROTOCOL_VERSION}, decode {old}" in answer.problem, answer
    frames = stranger.answer_frames  # as the previous version reads them: the pair secret's frames, then ours
    assert len(frames) == 4 and frames[0] == PAIR_MAGIC and frames[2] == wire.MAGIC, frames


def test_live_strangers_cannot_take_a_real_decodes_slot_or_its_rooms():
    """Without a key, strangers that answer at the addresses they claim, confirm with the secret they were handed
    and keep heartbeating fill the prefill's peer table (SGLANG_P2P_MAX_PEERS=8, 12 of them) before the real decode
    registers: idle ones go (told so), the decode is served, and a live stranger sends every room operation for
    the decode's live rooms with its own secret (ChunkRefused, RoomFailed, a second RoomMetadata, SGLang's ABORT):
    every room lands byte-exact. Before, the decode was refused ('this prefill rank has 8 decode ranks
    registered')."""
    rooms = [1301, 1302, 1303]
    requests = [{**r, "start_after_s": 3.0} for r in slow_rooms(rooms, tokens=200)]
    plan = {"pool": POOL, "requests": requests, "faults": {"prefill": {"chunk_delay_s": 0.4}}, "deadline_s": 60,
            "linger_s": LINGER}
    run = PairRun(plan, env={**HOSTILE_ENV, "SGLANG_P2P_MAX_PEERS": "8"})
    prefill = run.session("prefill")
    strangers = [hostile.Stranger(prefill) for _ in range(12)]
    try:
        for s in strangers:
            s.send(registration(s.session, _pool_agreement(POOL)))
            assert not s.answer()[1].problem
            s.beat()
        run.session("decode")
        time.sleep(5.5)  # the decode registered and its rooms are published and transferring
        last = strangers[-1]  # the newest stranger is still live
        ids = np.arange(4, dtype=np.int32).tobytes()
        for room in rooms:
            forged = [wire.encode(msg) for msg in (wire.ChunkRefused(last.session, 0, room, "forged"),
                                                   wire.RoomFailed(last.session, room, "forged"),
                                                   wire.RoomMetadata(last.session, 1, room, ids, 1, [], 1, 0, False))]
            for frames in forged:
                last.send(frames)
            last.send_together(forged)  # one packed frame: each list checked on its own, as if it came alone
            last.send([b"ABORT", str(room).encode(), *map(str.encode, last.session.split(":"))])
        result = run.wait(90)
        inboxes = [s.received() for s in strangers]
    finally:
        for s in strangers:
            s.close()
    assert_all_landed(result, rooms)
    released = [any(isinstance(m, wire.PeerReleased) for m in inbox) for inbox in inboxes]
    assert sum(released) == 5 and not released[-1], released  # 5 idle ones made room, oldest first
    left = result["prefill"]["leftovers"]
    assert len(left["decode_peers"]) <= 8 and left["control_sockets"] <= 8, left
    assert left["dropped"]["not-owner"] == 7 * len(rooms), left["dropped"]


def test_a_released_decode_registers_again_for_its_next_room():
    """SGLANG_P2P_MAX_PEERS=1: the real decode finished its first room and is idle when a live stranger registers,
    so it gives its slot up (PeerReleased). Its next room must not be lost: the decode registers again (now the
    idle stranger, which never carried a room, makes room) and the room lands byte-exact."""
    plan = {"pool": POOL, "deadline_s": 60, "linger_s": LINGER,
            "requests": [{"room": 1601, "tokens": 40}, {"room": 1602, "tokens": 40, "after": "stranger-in"}]}
    run = PairRun(plan, env={**HOSTILE_ENV, "SGLANG_P2P_MAX_PEERS": "1"})
    prefill = run.session("prefill")
    stranger = hostile.Stranger(prefill)
    try:
        done = os.path.join(run.workdir, "decode-1601-done.ready")
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:  # the decode is live and idle
            time.sleep(0.05)
        stranger.send(registration(stranger.session, _pool_agreement(POOL)))
        assert not stranger.answer()[1].problem  # it takes the idle decode's slot
        stranger.beat()
        time.sleep(1.0)
        open(os.path.join(run.workdir, "stranger-in.ready"), "w").close()  # the decode's next room starts
        result = run.wait(60)
        inbox = stranger.received()
    finally:
        stranger.close()
    assert_all_landed(result, [1601, 1602])
    assert any(isinstance(m, wire.PeerReleased) for m in inbox), inbox  # it gave the slot back to the decode
    assert result["decode"]["leftovers"]["prefills"] == {prefill: "accepted"}, result["decode"]["leftovers"]
    assert result["prefill"]["leftovers"]["decode_peers"] == [run.session("decode")]


def test_a_room_the_prefill_fails_fails_on_its_decode_within_seconds():
    """The prefill fails a room mid-transfer on its own (its manager is broken: a thread could not go on): the
    decode that owns it fails it within seconds with the prefill's reason, not at SGLang's waiting timeout (120 s
    here). Before, the decode was not told."""
    plan = {"pool": POOL, "requests": slow_rooms([1401], tokens=200), "deadline_s": 40,
            "faults": {"prefill": {"chunk_delay_s": 0.2, "broken_after_chunks": 2}},
            "linger_s": {"prefill": 12.0}}  # up past the 5 s: its exit would end the room on the decode too
    result = run_pair(plan, env=SLOW_SGLANG_ENV)
    p, d = result["prefill"]["requests"]["1401"], result["decode"]["requests"]["1401"]
    assert "p2p-prefill-control stopped: injected" in failed_reason(result["decode"], 1401), d
    assert d["ended_at"] - p["ended_at"] < 5, (p, d)


def _mismatch_plan(room: int, **overrides) -> dict:
    # the decode stays up a while after its room failed, as a server does: it tells the prefill only once the
    # prefill answered its registration (a decode process gone 20 ms after the failure left the prefill's room
    # waiting for its deadline on a loaded CI machine)
    return {"pool": {"layout": "mla", "num_layers": 2, "page_size": 1, "num_pages": 100},
            "requests": [{"room": room, "tokens": 32}], "deadline_s": 40, "linger_s": {"decode": 5.0}, **overrides}


KEY_A = {"SGLANG_P2P_AUTH_KEY": "0123456789abcdef-key-a"}
KEY_B = {"SGLANG_P2P_AUTH_KEY": "0123456789abcdef-key-b"}


@pytest.mark.parametrize("overrides,prefill_needles,decode_needles", [
    pytest.param({"pool_overrides": {"decode": {"page_size": 16}}},
                 ["page size differs: prefill 1, decode 16", "--page-size"], ["page_size=1", "page_size=16"],
                 id="page-size"),
    pytest.param({"kv_dtype": {"prefill": "bfloat16", "decode": "fp8_e4m3"}},
                 ["KV cache dtype differs: prefill 'bfloat16', decode 'fp8_e4m3'"], ["bfloat16", "fp8_e4m3"],
                 id="kv-dtype"),
    pytest.param({"env": {"prefill": KEY_A}},
                 ["prefill rank has SGLANG_P2P_AUTH_KEY set and the peer sends none"],
                 ["prefill rank has SGLANG_P2P_AUTH_KEY set and the peer sends none"], id="key-on-prefill-only"),
    pytest.param({"env": {"decode": KEY_A}},
                 ["the peer has SGLANG_P2P_AUTH_KEY set, this prefill rank has none"],
                 ["the peer has SGLANG_P2P_AUTH_KEY set, this prefill rank has none"], id="key-on-decode-only"),
    pytest.param({"env": {"prefill": KEY_A, "decode": KEY_B}},
                 ["SGLANG_P2P_AUTH_KEY set and the peer a different one"],
                 ["SGLANG_P2P_AUTH_KEY set and the peer a different one"], id="different-keys"),
])
def test_mismatches_fail_both_sides_within_10s_naming_both_values(overrides, prefill_needles, decode_needles):
    result = run_pair(_mismatch_plan(71, **overrides), env=SLOW_SGLANG_ENV)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    for side, needles in (("prefill", prefill_needles), ("decode", decode_needles)):
        reason = failed_reason(result[side], 71)
        for needle in needles:
            assert needle in reason, (side, reason)
        assert result[side]["requests"]["71"]["seconds"] < 10, (side, result[side]["requests"]["71"])


def test_aux_row_mismatch_is_refused_on_both_sides():
    # a decode whose metadata rows are laid out otherwise (another SGLang release or speculative settings)
    plan = _mismatch_plan(72, aux_hidden_size={"decode": 32})
    result = run_pair(plan, env=SLOW_SGLANG_ENV)
    for side in ("prefill", "decode"):
        reason = failed_reason(result[side], 72)
        assert "aux (metadata) layout" in reason and "differs" in reason, (side, reason)
        assert result[side]["requests"]["72"]["seconds"] < 10


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_refused_prefill_restarted_with_a_fixed_configuration_is_served():
    """A prefill started with the wrong page size fails its requests on both sides; restarted at the same bootstrap
    address with the right one, it serves the same decode process (no decode restart)."""
    plan = _mismatch_plan(0, pool_overrides={"prefill": {"page_size": 16}})
    plan["requests"] = [{"room": 1101, "tokens": 32},
                        {"room": 1102, "tokens": 32, "roles": ["decode"], "after": "restarted"}]
    plan["deadline_s"] = 90
    run = PairRun(plan, env=SLOW_SGLANG_ENV)
    run.session("decode")
    first = run.procs[("prefill", 0)]
    first.wait(180)  # its room 1101 failed (told by the decode), so it exited
    assert first.returncode == 0, run.workdir
    deadline = time.monotonic() + 20
    while not _port_free(run.plan["bootstrap_port"]) and time.monotonic() < deadline:
        time.sleep(0.2)  # its bootstrap server goes with it
    # a real restart (a model load) outlasts the decode's liveness check of the bootstrap server, which then drops
    # what it cached of the old prefill (its page size included); drivers restart in well under a second
    time.sleep(float(SLOW_SGLANG_ENV["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"])
               * (int(SLOW_SGLANG_ENV["SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"]) + 1) + 1)
    fixed = {**run.plan, "pool_overrides": {}, "requests": [{"room": 1102, "tokens": 32}]}
    fixed_path = os.path.join(run.workdir, "plan-fixed.json")
    with open(fixed_path, "w") as f:
        json.dump(fixed, f)
    os.remove(os.path.join(run.workdir, "prefill-0.session"))
    second = run.start("prefill", 0, fixed_path, os.path.join(run.workdir, "prefill-fixed.json"))
    run.procs[("prefill", 0)] = second
    run.session("prefill")  # its bootstrap server and manager are up
    open(os.path.join(run.workdir, "restarted.ready"), "w").close()
    result = run.wait(90)
    d = result["decode"]
    assert "page_size=16" in failed_reason(d, 1101)
    assert "page size differs: prefill 16, decode 1" in failed_reason(result["prefill"], 1101)  # the first one
    r = d["requests"]["1102"]
    assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
    fixed_result = json.load(open(os.path.join(run.workdir, "prefill-fixed.json")))
    assert fixed_result["requests"]["1102"]["status"] == "Success"
