"""Failure modes SGLang's own PD users reported, each run through SGLang's classes in driver processes
(testing/driver.py) with the exact pages, aux rows, statuses and reasons checked. The contract page lists them
("Upstream failure modes" in docs/sglang-contract.md)."""

import json
import os
import time

import pytest
import importlib.util

from test_pd_transfer import (FAST_FAILURE_ENV, IPC_ENV, MOONCAKE_ENV, assert_clean, failed_reason,
                              require_deferred_release)

from sglang_p2p_backend.testing.faults import EXIT_CODE
from sglang_p2p_backend.testing.launch import STARTUP_S, PairRun, log_tails, run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POOL = {"layout": "mha", "num_layers": 2, "page_size": 4, "num_pages": 400}
TRANSPORTS = [pytest.param({}, id="tcp"), pytest.param(IPC_ENV, id="cudaipc-standin")]


def landed(side: dict, key: str) -> dict:
    """The decode's result of request `key`, asserted Success with every page, the aux row and the first token
    its own."""
    r = side["requests"][key]
    assert r["status"] == "Success", r
    assert r["num_bad_pages"] == 0 and r["aux_room_ok"] and r["first_token_ok"], r
    return r


def assert_ranks_clean(result: dict) -> None:
    for role in ("prefill", "decode"):
        for side in result["ranks"][role]:
            assert side is not None, f"a {role} rank died: {result['workdir']}"
            assert_clean(side)


@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_aux_rows_reused_at_once_under_concurrency_each_hold_their_own_room(transport_env):
    # 40 rooms through 4 aux rows on either side: every row is handed to the next room the moment its room
    # concludes, some rooms aborted mid-transfer by the decode or the prefill, so a late row of one room has the
    # chance to land in the next room's slot; each finished room's row must carry its own room and first token
    requests = [{"room": 5000 + i, "tokens": 4 * (3 + i % 5), "chunk_pages": 2} for i in range(40)]
    for i in range(3, 40, 9):
        requests[i]["abort"] = {"side": "decode", "at": "transfer", "after_s": 0}
    for i in range(7, 40, 11):
        requests[i]["abort"] = {"side": "prefill", "at": "chunk", "n": 1}
    aborted = {str(r["room"]) for r in requests if "abort" in r}
    plan = {"pool": POOL, "requests": requests, "aux_rows": {"prefill": 4, "decode": 4}, "reuse": ["aux"],
            "faults": {"prefill": {"chunk_delay_s": 0.01}}, "deadline_s": 90, "linger_s": {"prefill": 1.0}}
    result = run_pair(plan, env={**FAST_FAILURE_ENV, **transport_env}, timeout=150)
    d, p = result["decode"], result["prefill"]
    for key, r in d["requests"].items():
        if key in aborted:
            assert r["status"] == "Failed" and "Aborted" in r["reason"], r
        else:
            landed(d, key)
            assert p["requests"][key]["status"] == "Success", p["requests"][key]
    assert d["untouched_violations"] == []
    assert_clean(d)
    assert_clean(p)


# plain DP: SGLang's --dp-size 2 without DP attention, two prefill replicas (each its own TP group, both behind
# one bootstrap server) whose DP controller hands out rooms by bootstrap room, or by another load balancer
PLAIN_DP = {"dp": {"prefill": 2}}


@pytest.mark.parametrize("routing", [
    pytest.param({}, id="follow-bootstrap-room"),
    # round robin: the replica is the controller's choice, which the decode learns from the bootstrap server
    pytest.param({"load_balance_method": {"prefill": "round_robin"},
                  "prefill_dp_rank": {"6001": 0, "6002": 1, "6003": 1, "6004": 0}}, id="round-robin"),
])
def test_plain_dp_replicas_each_serve_the_rooms_their_controller_gave_them(routing):
    rooms = [6001, 6002, 6003, 6004]
    plan = {"pool": POOL, "requests": [{"room": r, "tokens": 4 * 9 + r % 3, "chunk_pages": 4} for r in rooms],
            "deadline_s": 40, **PLAIN_DP, **routing}
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    chosen = routing.get("prefill_dp_rank", {str(r): r % 2 for r in rooms})
    for replica, p in enumerate(result["ranks"]["prefill"]):
        mine = sorted(k for k, v in chosen.items() if v == replica)
        assert sorted(p["requests"]) == mine
        assert {r["status"] for r in p["requests"].values()} == {"Success"}, p["requests"]
    for room in rooms:
        landed(result["decode"], str(room))
    assert result["decode"]["untouched_violations"] == []
    assert_ranks_clean(result)


@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_pages_of_a_room_the_prefill_aborted_mid_write_are_reused_only_after_the_write(transport_env):
    # room 7001 (replica 1) is aborted on the prefill while its first write is in flight (3 s long); the decode
    # hands its pages at once to room 7002, which replica 0 fills. Were the decode told before the write ended,
    # 7001's bytes would land in 7002's pages after 7002 was checked: they are checked again at the end
    rooms = [{"room": 7001, "tokens": 4 * 30, "chunk_pages": 10, "abort": {"side": "prefill", "at": "chunk", "n": 2}},
             {"room": 7002, "tokens": 4 * 30, "after": "decode-7001-done"}]
    plan = {"pool": POOL, "requests": rooms, "reuse": ["pages"], "deadline_s": 40, **PLAIN_DP,
            "faults": {"prefill": {"write_delay_s": {"7001": 3.0}, "chunk_delay_s": 0.3}}, "linger_s": {"prefill": 5.0, "decode": 4.0}}
    result = run_pair(plan, env=transport_env)
    d, (p0, p1) = result["decode"], result["ranks"]["prefill"]
    assert "Aborted by AbortReq" in failed_reason(p1, 7001)
    assert "Aborted on prefill by AbortReq" in failed_reason(d, 7001)
    assert d["requests"]["7001"]["ended_at"] >= p1["requests"]["7001"]["write_done_at"], (d["requests"], p1["requests"])
    assert p0["requests"]["7002"]["status"] == "Success"
    assert landed(d, "7002")["bad_pages_at_end"] == []
    assert d["untouched_violations"] == []
    assert_ranks_clean(result)


@pytest.mark.parametrize("transport_env,deferred", [
    pytest.param(IPC_ENV, "0", id="cudaipc-standin"),
    pytest.param(IPC_ENV, "1", id="cudaipc-standin-sglang-deferred-release"),
    pytest.param(MOONCAKE_ENV, "0", id="mooncake",
                 marks=pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake not installed")),
])
def test_pages_of_a_room_the_decode_failed_mid_write_are_reused_only_after_the_write(transport_env, deferred):
    # room 7101 (replica 1) fails on the decode's own check while the prefill's one-sided write into its pages is
    # in flight (3 s long); its pages go to room 7102 (replica 0) once the decode gives them back. Given back
    # before the write ended, 7101's bytes would land in 7102's pages after 7102 was checked: checked again at
    # the end. Without SGLang's deferred release (0.5.17 has none, or it is off) the backend holds the failure
    # until the prefill's word that the write ended; with it, SGLang holds the pages until the prefill's ACK.
    if deferred == "1":
        require_deferred_release()
    rooms = [{"room": 7101, "tokens": 4 * 30, "chunk_pages": 30},
             {"room": 7102, "tokens": 4 * 30, "after": "decode-7101-done"}]
    plan = {"pool": POOL, "requests": rooms, "reuse": ["pages"], "deadline_s": 40, **PLAIN_DP,
            "faults": {"prefill": {"write_delay_s": {"7101": 3.0}}, "decode": {"fail_after_s": {"7101": 0.5}}},
            "linger_s": {"prefill": 5.0, "decode": 4.0}}
    result = run_pair(plan, env={**transport_env, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": deferred})
    d, (p0, p1) = result["decode"], result["ranks"]["prefill"]
    failed, written = d["requests"]["7101"], p1["requests"]["7101"]
    assert written["write_done_at"] - failed["failed_at"] > 2.0, (failed, written)  # failed mid-write
    # (once on a loaded CI machine, Mooncake over TCP: 7102 still open at the deadline; the logs say why)
    assert p0["requests"]["7102"]["status"] == "Success", (p0["requests"]["7102"], failed, written, log_tails(result))
    assert landed(d, "7102")["bad_pages_at_end"] == []
    assert failed["pages_freed_at"] >= written["write_done_at"], (failed, written)
    assert "injected: the decode's own check failed room 7101" in failed_reason(d, 7101)
    if deferred == "1":  # SGLang aborted the failed room to arm the hold; released on the prefill's ACK
        assert "Aborted by decode rank" in failed_reason(p1, 7101) and failed["release_safe"], (failed, written)
    else:  # told by the decode's hold (RoomFailed), answered once the write ended
        assert "failed the room: injected" in failed_reason(p1, 7101)
    assert d["untouched_violations"] == []
    assert_ranks_clean(result)


@pytest.mark.parametrize("transport_env,deferred", [
    pytest.param(IPC_ENV, "0", id="cudaipc-standin"),
    pytest.param(IPC_ENV, "1", id="cudaipc-standin-sglang-deferred-release"),
])
def test_pages_of_a_room_the_decode_aborted_mid_write_are_reused_only_after_the_write(transport_env, deferred):
    # as above, but the decode's scheduler aborts room 7201 (an AbortReq: the client went away) while the
    # prefill's one-sided write into its pages runs. SGLang 0.5.17 (and 0.5.23 with deferred release off) frees
    # an aborted room's pages as soon as its receiver polls Failed: the backend keeps it from polling Failed
    # until the prefill's word that the write ended
    if deferred == "1":
        require_deferred_release()
    rooms = [{"room": 7201, "tokens": 4 * 30, "chunk_pages": 30, "abort": {"side": "decode", "at": "transfer", "after_s": 0.5}},
             {"room": 7202, "tokens": 4 * 30, "after": "decode-7201-done"}]
    plan = {"pool": POOL, "requests": rooms, "reuse": ["pages"], "deadline_s": 40, **PLAIN_DP,
            "faults": {"prefill": {"write_delay_s": {"7201": 3.0}}}, "linger_s": {"prefill": 5.0, "decode": 4.0}}
    result = run_pair(plan, env={**transport_env, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": deferred})
    d, (p0, p1) = result["decode"], result["ranks"]["prefill"]
    aborted, written = d["requests"]["7201"], p1["requests"]["7201"]
    assert aborted["aborted_at"] == "transfer" and "Aborted by AbortReq" in failed_reason(d, 7201), aborted
    assert written["write_done_at"] - aborted["metadata_at_wall"] > 2.0, (aborted, written)  # aborted mid-write
    assert aborted["pages_freed_at"] >= written["write_done_at"], (aborted, written)
    assert p0["requests"]["7202"]["status"] == "Success"
    assert landed(d, "7202")["bad_pages_at_end"] == []
    assert d["untouched_violations"] == []
    assert_ranks_clean(result)


def test_pages_of_a_room_whose_metadata_failed_part_way_are_reused_only_after_the_write():
    # room 7301's destinations reach prefill TP rank 0, then the send to rank 1 fails (a rank that just died):
    # the room fails on the decode, but rank 0 already writes its heads one-sided into its pages (3 s long).
    # Without SGLang's deferred release the pages go back only once rank 0 answered after that write
    rooms = [{"room": 7301, "tokens": 4 * 30, "chunk_pages": 30},
             {"room": 7302, "tokens": 4 * 30, "after": "decode-7301-done"}]
    plan = {"pool": {**POOL, "head_dim": 64, "total_kv_heads": 4}, "tp": {"prefill": 2}, "requests": rooms, "reuse": ["pages"],
            "deadline_s": 40, "linger_s": {"prefill": 5.0, "decode": 4.0},
            "faults": {"prefill": {"write_delay_s": {"7301": 3.0}}, "decode": {"metadata_fails_after": {"7301": 1}}}}
    result = run_pair(plan, env={**IPC_ENV, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "0"})
    d, (p0, _) = result["decode"], result["ranks"]["prefill"]
    failed, written = d["requests"]["7301"], p0["requests"]["7301"]
    assert "send_metadata to prefill rank" in failed_reason(d, 7301) and "injected" in failed_reason(d, 7301)
    assert written["write_done_at"] - failed["metadata_at_wall"] > 2.0, (failed, written)  # failed mid-write
    assert failed["pages_freed_at"] >= written["write_done_at"], (failed, written)
    assert landed(d, "7302")["bad_pages_at_end"] == []
    assert d["untouched_violations"] == []
    assert_ranks_clean(result)


def test_a_prefill_replaced_at_its_address_fails_the_old_rooms_and_serves_the_new_one():
    # the prefill process dies mid-transfer and a new one comes up at once behind the same bootstrap address (a
    # restarted pod behind a Service: SGLang's heartbeat of that address never fails, so it cannot help). The
    # old room fails within seconds; a room that starts once the old process was declared dead reaches the new one
    env = {**FAST_FAILURE_ENV, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
           "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "60", "SGLANG_P2P_PEER_TIMEOUT": "2"}
    plan = {"pool": POOL, "requests": [{"room": 8001, "tokens": 4 * 60, "chunk_pages": 5},
                                       {"room": 8002, "tokens": 4 * 9, "roles": ["decode"], "after": "restarted"}],
            "faults": {"prefill": {"chunk_delay_s": 0.2, "exit_after_chunks": 3}}, "deadline_s": 60}
    run = PairRun(plan, env=env)
    run.session("decode")
    old = run.session("prefill")
    first = run.procs[("prefill", 0)]
    assert first.wait(STARTUP_S) == EXIT_CODE, run.workdir
    killed_at = time.time()
    replaced = {**run.plan, "faults": {}, "requests": [{"room": 8002, "tokens": 4 * 9}]}
    path = os.path.join(run.workdir, "plan-new.json")
    with open(path, "w") as f:
        json.dump(replaced, f)
    os.remove(os.path.join(run.workdir, "prefill-0.session"))
    run.procs[("prefill", 0)] = run.start("prefill", 0, path, os.path.join(run.workdir, "prefill-new.json"))
    run.session("prefill")
    time.sleep(float(env["SGLANG_P2P_PEER_TIMEOUT"]) + 1.5)  # the old process is declared dead by now
    open(os.path.join(run.workdir, "restarted.ready"), "w").close()
    result = run.wait(60)
    d = result["decode"]
    reason = failed_reason(d, 8001)
    assert f"{old} stopped answering" in reason or "pair channel" in reason, reason
    assert d["requests"]["8001"]["ended_at"] - killed_at < 4, d["requests"]["8001"]
    landed(d, "8002")
    assert json.load(open(os.path.join(run.workdir, "prefill-new.json")))["requests"]["8002"]["status"] == "Success"
    assert_clean(d)


def test_a_room_bootstrapped_again_is_looked_up_on_the_same_prefill_replica():
    # round robin put room 6102 on replica 1 (not 6102 % 2); the request is bootstrapped again afterwards (a
    # retracted request: same room, a new sender and receiver, new pages): the decode's second lookup must
    # name replica 1 again, and the second transfer land as exactly as the first
    again = {"room": 6102, "tokens": 4 * 11, "chunk_pages": 4}
    # each side starts the second attempt once it concluded the first: the decode may publish it before the
    # prefill cleared the first (test_a_room_bootstrapped_again_before_the_prefill_ended_its_first_attempt_lands)
    attempts = [{**again, "attempt": 2, "after": {"decode": "decode-6102-done", "prefill": "prefill-6102-done"}}]
    # replica 0 serves no room but hosts the bootstrap server the decode's second lookup asks: it stays up
    # (SGLang's bootstrap server lives as long as its server; on a loaded machine replica 0 had exited before)
    plan = {"pool": POOL, "requests": [again, *attempts], "deadline_s": 40, "linger_s": {"prefill": 10.0},
            **PLAIN_DP, "load_balance_method": {"prefill": "round_robin"}, "prefill_dp_rank": {"6102": 1}}
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    p0, p1 = result["ranks"]["prefill"]
    assert p0["requests"] == {} and {r["status"] for r in p1["requests"].values()} == {"Success"}, p1["requests"]
    assert [landed(result["decode"], key)["prefill_dp_rank"] for key in ("6102", "6102#2")] == [1, 1]
    assert result["decode"]["untouched_violations"] == []
    assert_ranks_clean(result)


@pytest.mark.parametrize("room,fault", [
    # the prefill's scheduler has the first attempt's Success but clears that sender only 3 s later
    pytest.param(6201, {"clear_delay_s": {"6201": 3.0}}, id="before-the-clear"),
    # the prefill's thread that concludes the first attempt is held 2 s around marking it Success here
    pytest.param(6202, {"mark_delay_s": {"6202": 2.0}}, id="while-marking-success"),
])
def test_a_room_bootstrapped_again_before_the_prefill_ended_its_first_attempt_lands(room, fault):
    # the decode publishes the second attempt of the room as soon as it read the first attempt's Success: the
    # new destinations are kept for the next sender, not merged into the concluded attempt's and wiped with them
    # (which left the prefill in Bootstrapping until SGLang's timeout)
    first = {"room": room, "tokens": 4 * 11, "chunk_pages": 4}
    again = {**first, "attempt": 2, "after": {"decode": f"decode-{room}-done", "prefill": f"prefill-{room}-done"}}
    plan = {"pool": POOL, "requests": [first, again], "deadline_s": 40, "faults": {"prefill": fault}}
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    p, d = result["prefill"], result["decode"]
    if "clear_delay_s" in fault:
        assert d["requests"][f"{room}#2"]["metadata_at_wall"] < p["requests"][str(room)]["cleared_at"], (d, p)
    assert {r["status"] for r in p["requests"].values()} == {"Success"}, p["requests"]
    for key in (str(room), f"{room}#2"):
        landed(d, key)
    assert d["untouched_violations"] == []
    assert_ranks_clean(result)
