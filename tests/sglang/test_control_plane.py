"""The control plane against mismatched, hostile and dead peers, through SGLang's classes (one process per
role on 127.0.0.1, tcp transport): every case asserts what the user sees (failed rooms and their reasons,
bytes that land) and what is left behind (tables, sockets, threads, file descriptors).

The hostile party is this test process: it pushes forged or mutated frames at a rank's control socket
(tests/support/hostile.py) while a real pair transfers.
"""

import random
import time

import msgspec
import pytest
from support import hostile
from test_pd_transfer import FAST_FAILURE_ENV, assert_all_landed, failed_reason

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.agreement import local_agreement
from sglang_p2p_backend.testing.launch import PairRun, run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POOL = {"layout": "mla", "num_layers": 4, "page_size": 1, "num_pages": 1200}
KEY = {"SGLANG_P2P_AUTH_KEY": "0123456789abcdef-test-key"}
# tests that push frames keep both ranks reading for a while after their rooms end, so every pushed frame is
# handled (and counted) even when a loaded machine delays the push past the transfers
LINGER = {"prefill": 3.0, "decode": 3.0}
# their rooms are slowed down on purpose (the frames must reach live rooms): SGLang's waiting timeout above that
HOSTILE_ENV = {**FAST_FAILURE_ENV, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120"}


def slow_rooms(rooms, tokens=120, chunk_pages=10):
    return [{"room": r, "tokens": tokens, "chunk_pages": chunk_pages} for r in rooms]


def test_staging_mismatch_is_refused_on_both_sides_naming_both_values():
    plan = {
        "pool": POOL,
        "requests": slow_rooms([101, 102, 103]),
        # two slots each (not the default three), so the slot sizes are the round halves named below
        "env": {"prefill": {"SGLANG_P2P_STAGING_MB": "2", "SGLANG_P2P_STAGING_SLOTS": "2"},
                "decode": {"SGLANG_P2P_STAGING_MB": "1", "SGLANG_P2P_STAGING_SLOTS": "2"}},
        "deadline_s": 40,
    }
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    for room in (101, 102, 103):
        for side in ("prefill", "decode"):
            reason = failed_reason(result[side], room)
            assert "staging slot size" in reason and "SGLANG_P2P_STAGING_MB" in reason, reason
            assert "prefill 1048576" in reason and "decode 524288" in reason, reason
        assert result["decode"]["requests"][str(room)]["seconds"] < 5, "refusal must not wait for a timeout"


def test_out_of_bounds_aux_row_is_dropped_and_fails_only_its_room():
    # the prefill itself sends room 201's aux row to a row the room did not publish; a stranger adds an
    # undecodable one (a stranger's decodable one would lack the pair secret: test_trust.py)
    plan = {"pool": POOL, "requests": slow_rooms([201, 202], tokens=200), "deadline_s": 60, "linger_s": LINGER,
            "faults": {"prefill": {"chunk_delay_s": 0.4, "aux_row": {"201": 2**30}}}}
    run = PairRun(plan, env=HOSTILE_ENV)
    prefill, decode = run.session("prefill"), run.session("decode")
    time.sleep(2.0)  # both rooms published and transferring
    hostile.push(decode, [wire.encode(wire.AuxData(prefill, 201, 2**40, [b"x" * 64]))])  # beyond any static bound
    result = run.wait(60)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]  # no SIGSEGV
    d = result["decode"]
    assert "aux_index 1073741824 is not the room's row" in failed_reason(d, 201)
    assert d["leftovers"]["dropped"]["malformed"] == 1 and d["leftovers"]["dropped"]["bounds"] == 1
    r = d["requests"]["202"]
    assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
    assert d["untouched_violations"] == []


def test_flood_of_2000_messages_from_strangers_allocates_nothing():
    plan = {"pool": POOL, "requests": slow_rooms(range(301, 306)), "faults": {"prefill": {"chunk_delay_s": 0.2}},
            "deadline_s": 60, "linger_s": LINGER}
    run = PairRun(plan, env=HOSTILE_ENV)
    prefill, decode = run.session("prefill"), run.session("decode")
    time.sleep(1.5)
    sent = hostile.push(prefill, hostile.forged_metadata(1000))
    sent += hostile.push(decode, hostile.forged_offers(500)) + hostile.push(decode, hostile.forged_chunks(500))
    assert sent == 2000
    result = run.wait(90)
    assert_all_landed(result, list(range(301, 306)))
    p, d = result["prefill"], result["decode"]
    # none carries the pair secret the receiver issued to the session it claims
    assert p["leftovers"]["dropped"] == {"secret": 1000} and d["leftovers"]["dropped"] == {"secret": 1000}
    # one control socket per real peer, one receiver thread for the real prefill, no table entry for strangers
    assert p["leftovers"]["control_sockets"] == 1 and d["leftovers"]["control_sockets"] == 1
    assert d["leftovers"]["receivers"] == [prefill]
    assert p["leftovers"]["decode_peers"] == [decode] and p["leftovers"]["rejected_peers"] == {}
    assert d["leftovers"]["comm_stats"].get("no_room", 0) == 0
    for side in (p, d):
        res = side["resources"]
        # the pair's own channel and sockets only (before bounds, 1,000 strangers cost 1,000 sockets)
        assert res["fds_end"] - res["fds_start"] <= 16, res
        assert res["threads_end"] - res["threads_start"] <= 1, res


def forged_register(session: str, page_size: int) -> list:
    agreement = local_agreement(page_size=page_size, kv_dtype="bfloat16", kv_item_lens=[1152] * 4,
                                state_item_lens=[], slot_bytes=128 << 20, auth=False)
    reg = wire.PeerRegister(session=session, incarnation=12345, hostname="evil", engine_rank=0, attn_tp_size=1,
                            agreement=agreement, kv_ptrs=[1 << 20] * 4, aux_ptrs=[], aux_item_lens=[], state_ptrs=[],
                            kv_pages=1 << 20, aux_rows=64, state_slots=[], transports=["tcp"])
    return wire.encode(reg)


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_forged_register_and_offers_cannot_reshape_a_live_pair(keyed):
    plan = {"pool": POOL, "requests": slow_rooms(range(401, 405)), "faults": {"prefill": {"chunk_delay_s": 0.2}},
            "deadline_s": 60, "linger_s": LINGER}
    run = PairRun(plan, env={**HOSTILE_ENV, **(KEY if keyed else {})})
    prefill, decode = run.session("prefill"), run.session("decode")
    time.sleep(1.5)
    hostile.push(prefill, [forged_register(decode, 99)])  # the live decode's session, another page size
    hostile.push(decode, hostile.forged_offers(120))
    result = run.wait(90)
    assert_all_landed(result, list(range(401, 405)))
    p, d = result["prefill"]["leftovers"], result["decode"]["leftovers"]
    if keyed:  # nothing unauthenticated gets past the envelope
        assert p["dropped"] == {"auth": 1} and d["dropped"] == {"auth": 120}, (p["dropped"], d["dropped"])
    else:  # the live registration stands; offers without a pair secret of this decode reserve nothing
        assert p["dropped"]["duplicate-session"] == 1 and d["dropped"]["secret"] == 120
    assert d["comm_stats"].get("opened", 0) == 1 and d["comm_live"] in ([], [prefill])


def test_different_keys_fail_the_rooms_naming_the_key():
    plan = {"pool": POOL, "requests": slow_rooms([501]), "deadline_s": 40,
            "env": {"prefill": KEY, "decode": {"SGLANG_P2P_AUTH_KEY": "another-key-0123456789"}}}
    result = run_pair(plan, env={**FAST_FAILURE_ENV, "SGLANG_P2P_PEER_TIMEOUT": "3"})
    for side in ("prefill", "decode"):  # both refuse at once (keys are never compared, their tags are)
        reason = failed_reason(result[side], 501)
        assert "SGLANG_P2P_AUTH_KEY set and the peer a different one" in reason, reason
    assert result["prefill"]["leftovers"]["dropped"]["auth"] >= 1


def test_abort_storm_on_both_sides_leaves_every_table_empty():
    rng = random.Random(7)
    points = [("prefill", "bootstrap"), ("prefill", "chunk"), ("prefill", "last"), ("decode", "init"),
              ("decode", "transfer")]
    requests = []
    for i in range(200):
        req = {"room": 1000 + i, "tokens": rng.randint(5, 12), "chunk_pages": 2}
        if i % 2:
            side, at = rng.choice(points)
            req["abort"] = {"side": side, "at": at, "n": 1, "after_s": rng.uniform(0, 0.05)}
        requests.append(req)
    plan = {"pool": {**POOL, "num_pages": 3000}, "requests": requests, "deadline_s": 90,
            "linger_s": {"prefill": 4.0, "decode": 1.0}}
    result = run_pair(plan, env={**FAST_FAILURE_ENV, "SGLANG_P2P_TOMBSTONE_S": "2"}, timeout=150)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    p, d = result["prefill"], result["decode"]
    for req in requests:
        room = str(req["room"])
        if "abort" not in req:
            r = d["requests"][room]
            assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
            continue
        side = req["abort"]["side"]
        mine = result[side]["requests"][room]
        if "aborted_at" not in mine:  # the transfer ended before its abort point (a decode already done)
            assert mine["status"] == "Success" and side == "decode", (req, mine)
            continue
        assert mine["status"] == "Failed", (req, mine)
        other = d if side == "prefill" else p
        r = other["requests"][room]
        assert r["status"] in ("Failed", "Success"), r  # told, never left waiting for a timeout
        if r["status"] == "Failed":
            assert r["seconds"] < 5, (req, r)
    assert d["untouched_violations"] == []
    for key in ("request_status", "failure_records", "transfer_infos", "req_to_decode_prefix_len", "concluded",
                "owned_rooms", "staging_outstanding", "deferred_ack_targets", "poll_tables"):
        assert p["leftovers"].get(key, []) == [], (key, p["leftovers"][key])
    for key in ("request_status", "failure_records", "live_rooms"):
        assert d["leftovers"][key] == [], (key, d["leftovers"][key])
    assert d["leftovers"]["arrivals_pending"] == 0 and p["threads_left"] == [] and d["threads_left"] == []


def _stop_and_time(plan: dict, stopped: str) -> tuple[dict, float, str]:
    run = PairRun(plan)  # SGLang's own timeouts at their defaults (300 s): only our liveness can be quick
    survivor = "prefill" if stopped == "decode" else "decode"
    result = run.wait(60, roles=(survivor,))
    stopped_at = float(open(f"{run.workdir}/{stopped}.stopped_at").read())
    side = result[survivor]
    reason = failed_reason(side, 601)
    return side, side["requests"]["601"]["ended_at"] - stopped_at, reason


@pytest.mark.parametrize("stopped", ["decode", "prefill"])
def test_a_stopped_peer_fails_its_rooms_within_seconds(stopped):
    # long enough that the prefill is still sending when the peer timeout (8 s) expires
    faults = {"prefill": {"chunk_delay_s": 0.3}}
    faults[stopped] = {**faults.get(stopped, {}), **({"stop_after_s": 0.5} if stopped == "decode" else {"stop_after_chunks": 2})}
    plan = {"pool": {**POOL, "num_pages": 1000}, "requests": slow_rooms([601], tokens=700), "faults": faults,
            "deadline_s": 40}
    side, seconds, reason = _stop_and_time(plan, stopped)
    print(f"\n{stopped} SIGSTOP -> room failed on the {'prefill' if stopped == 'decode' else 'decode'}: {seconds:.1f}s")
    assert "stopped answering" in reason, reason
    assert seconds <= 15, seconds
    assert side["threads_left"] == []


def test_mutated_frames_never_break_a_transfer():
    plan = {"pool": {**POOL, "layout": "mha", "page_size": 16, "state_slots": 8}, "deadline_s": 60,
            "requests": [{"room": 701 + i, "tokens": 16 * 20 + i, "chunk_pages": 4} for i in range(4)],
            "faults": {"prefill": {"chunk_delay_s": 0.2}}, "linger_s": LINGER}
    run = PairRun(plan, env=HOSTILE_ENV)
    prefill, decode = run.session("prefill"), run.session("decode")
    time.sleep(1.0)
    seeds = hostile.forged_metadata(4) + hostile.forged_chunks(4) + hostile.forged_offers(4) + [
        hostile.encode_raw({"type": "Nope", "x": 1}), forged_register("127.0.0.9:9", 16)]
    hostile.push(prefill, hostile.mutated(seeds, 300, seed=1))
    hostile.push(decode, hostile.mutated(seeds, 300, seed=2) + [[b"ABORT_ACK", b"x"], [b"\x00" * 5]])
    result = run.wait(90)
    assert_all_landed(result, [701, 702, 703, 704])
    assert result["decode"]["leftovers"]["receivers"] == [prefill]
    assert sum(result["decode"]["leftovers"]["dropped"].values()) >= 290


def test_forged_register_is_msgpack_of_the_real_type():
    # guards the hostile helpers: what they send must decode as the message they claim to be
    frames = forged_register("127.0.0.1:5", 16)
    assert isinstance(wire.decode(frames), wire.PeerRegister)
    assert isinstance(msgspec.msgpack.decode(frames[1]), dict)
