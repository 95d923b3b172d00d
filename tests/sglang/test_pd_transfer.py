"""1P1D transfers through SGLang's real classes, a prefill and a decode process on 127.0.0.1 (CPU transports).

Each case runs `sglang_p2p_backend.testing.driver` in two processes: the prefill process runs SGLang's
bootstrap server, both build the p2pnccl manager through SGLang's plugin loader and `get_kv_class`, and poll
requests the way the schedulers do. The decode side checks every destination page byte for byte, that no
other page of its pool changed, the aux row, and state slots. Both sides report what is left behind.

The byte-exact, decode-loss, abort and incompatibility cases run over both CPU transports: `tcp` (what
`auto` picks without a GPU: the two-sided path NCCL uses) and `mooncake` over Mooncake's tcp protocol (the
one-sided path: batch writes into the decode's registered pages, Status on the control channel). The other
cases exercise the control plane and staging, which do not depend on the transport, over `tcp` only.
"""

import importlib.util
import threading
import time
from pathlib import Path

import pytest
from e2e import room_times
from support import kv_digests
from support.shm_ipc import IPC_STANDIN

from sglang_p2p_backend.testing.launch import PairRun, run_pair
from sglang_p2p_backend.testing.plan import touch

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

FAST_FAILURE_ENV = {
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "8",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "8",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
    "SGLANG_P2P_CONNECT_TIMEOUT": "5",
    "SGLANG_P2P_IO_TIMEOUT": "5",
    # SGLang 0.5.23+: an aborted room whose prefill is gone holds its decode pages this long (default 30 s)
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5",
}

#: for tests that expect a refusal's reason: it reaches both sides when the decode registers, which on the loaded
#: 2-core CI machine came after the fast 8 s (the room then timed out in Bootstrapping instead, naming no reason)
REFUSAL_ENV = {**FAST_FAILURE_ENV, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
               "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30"}


MOONCAKE_ENV = {"SGLANG_P2P_TRANSPORT": "mooncake", "MC_FORCE_TCP": "1", "GLOG_minloglevel": "2"}
# the same-host path with its CPU stand-in for CUDA IPC (tests/support/shm_ipc.py): pools in shared memory
# (a dead decode's memory stays writable while the prefill maps it: its death is noticed by liveness, so quickly)
IPC_ENV = {"SGLANG_P2P_TRANSPORT": "cudaipc", **IPC_STANDIN, "SGLANG_P2P_PEER_TIMEOUT": "2"}
TRANSPORTS = [
    pytest.param({}, id="tcp"),
    pytest.param(IPC_ENV, id="cudaipc-standin"),
    pytest.param(
        MOONCAKE_ENV,
        id="mooncake",
        marks=pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake not installed"),
    ),
]


def assert_clean(side: dict) -> None:
    left = side["leftovers"]
    assert left["request_status"] == [] and left["staging_in_use"] == 0, left
    assert left.get("transfer_infos", []) == [] and left.get("live_rooms", []) == [], left
    assert left.get("poll_tables", []) == [], left  # nothing kept for SGLang's poll after its senders were cleared
    assert left.get("arrivals_pending", 0) == 0, left
    assert side["threads_left"] == [], side["threads_left"]


def assert_all_landed(result: dict, rooms: list[int]) -> None:
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    p, d = result["prefill"], result["decode"]
    for room in map(str, rooms):
        assert p["requests"][room]["status"] == "Success", p["requests"][room]
        r = d["requests"][room]
        assert r["status"] == "Success", r
        assert r["num_bad_pages"] == 0, r["bad_pages"]
        assert r["aux_room_ok"] and r["first_token_ok"] and r["state_ok"], r
    assert d["untouched_violations"] == [], "pages outside the destinations changed"
    assert_clean(p)
    assert_clean(d)


@pytest.mark.parametrize("transport_env", TRANSPORTS)
@pytest.mark.parametrize(
    "layout,page_size",
    [("mla", 1), ("mha", 16)],
)
def test_chunked_transfers_land_byte_exact(layout, page_size, transport_env):
    ps = page_size
    plan = {
        "pool": {"layout": layout, "num_layers": 5, "page_size": ps, "num_pages": 400, "state_slots": 8},
        "requests": [
            {"room": 11, "tokens": 37 * ps + 5, "chunk_pages": 8},  # chunked, partial last page
            {"room": 12, "tokens": 24 * ps, "chunk_pages": 1 << 30},  # one send
            {"room": 13, "tokens": 30 * ps, "chunk_pages": 7, "prefix": 8 * ps},  # decode already has 8 pages
            {"room": 14, "tokens": 1, "chunk_pages": 1},  # one token
            # the decode already holds every page: the prefill's only send() carries 0 pages, aux and state
            {"room": 15, "tokens": 6 * ps, "prefix": 6 * ps},
        ],
        "deadline_s": 60,
    }
    assert_all_landed(run_pair(plan, env=transport_env), [11, 12, 13, 14, 15])


def test_staging_shorter_than_a_request_back_pressures_without_loss():
    # 64-token pages over 8 layers of 576 bf16 values: 590 KB a page; 1 MiB of staging in 2 slots holds
    # 0 whole pages, so every page goes region by region, and all requests share the two slots
    plan = {
        "pool": {"layout": "mla", "num_layers": 8, "head_dim": 576, "page_size": 64, "num_pages": 80},
        "requests": [{"room": 20 + i, "tokens": 64 * 9 + i, "chunk_pages": 4} for i in range(4)],
        "deadline_s": 90,
    }
    result = run_pair(plan, env={"SGLANG_P2P_STAGING_MB": "1", "SGLANG_P2P_STAGING_SLOTS": "2",
                                 "SGLANG_P2P_ROOM_TIMES": "1"}, timeout=150)
    assert_all_landed(result, [20, 21, 22, 23])
    for room in ("20", "21", "22", "23"):  # SGLang's kv_transfer_latency_ms: the first chunk queued -> Success
        sent = result["prefill"]["requests"][room]
        assert sent["latency_s"] is not None and abs(sent["latency_s"] - sent["transfer_s"]) < 0.1, sent
    # SGLANG_P2P_ROOM_TIMES: one line a room, its three chunks (9 pages, 4 a chunk), the last chunk's steps in
    # order (no copy queued on a GPU over tcp; `concluded` missing where the poll saw the Success first), and its
    # Success seen where SGLang's latency ends
    log = Path(result["workdir"], "prefill-0.log").read_text()
    timed = {r.pop("room"): r for r in room_times.parse(log)}
    assert sorted(timed) == [20, 21, 22, 23], log[-2000:]
    for room, r in timed.items():
        # the worker's run-queue wait from ready to written, where the kernel keeps it: within that span
        runq = r.pop("runq_written", 0.0)
        assert 0 <= runq <= r["written"] - r["ready"] + 0.5, r
        assert r.pop("chunks") == 3 and [k for k in r if k != "concluded"] == [
            "last_queued", "picked", "ready", "written", "seen"], r
        assert list(r.values()) == sorted(r.values()), r
        assert abs(r["seen"] - 1e3 * result["prefill"]["requests"][str(room)]["latency_s"]) < 50, r


def test_room_times_split_a_same_host_write_at_its_copy_queued():
    """SGLANG_P2P_ROOM_TIMES on the same-host path (its CPU stand-in): each room's line has the steps `planned`
    and `launched`, the copy planned and queued by the backend of the worker's own thread, between the chunk ready
    and written, and the CPU that thread spent from ready to launched."""
    plan = {"pool": {"layout": "mha", "num_layers": 3, "page_size": 4, "num_pages": 64},
            "requests": [{"room": 40 + i, "tokens": 40, "chunk_pages": 4} for i in range(3)], "deadline_s": 60}
    result = run_pair(plan, env={**IPC_ENV, "SGLANG_P2P_ROOM_TIMES": "1"})
    assert_all_landed(result, [40, 41, 42])
    log = Path(result["workdir"], "prefill-0.log").read_text()
    timed = room_times.parse(log)
    assert sorted(r["room"] for r in timed) == [40, 41, 42], log[-2000:]
    for r in timed:
        assert r["chunks"] == 3 and r["ready"] <= r["planned"] <= r["launched"] <= r["written"] <= r["seen"], r
        assert 0 <= r["cpu_launched"] <= r["launched"] - r["ready"] + 0.5, r  # CPU time within the span


def failed_reason(side: dict, room: int) -> str:
    r = side["requests"][str(room)]
    assert r["status"] == "Failed", r
    return r["reason"]


@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_decode_killed_mid_transfer_fails_the_prefill_room(transport_env):
    plan = {
        "pool": {"layout": "mla", "num_layers": 4, "page_size": 1, "num_pages": 300},
        "requests": [{"room": 31, "tokens": 200, "chunk_pages": 10}],
        "faults": {"prefill": {"chunk_delay_s": 0.3}, "decode": {"exit_after_s": 1.0}},
        "deadline_s": 40,
    }
    result = run_pair(plan, env={**FAST_FAILURE_ENV, **transport_env})
    assert result["returncodes"]["decode"] == 17 and result["decode"] is None
    p = result["prefill"]
    reason = failed_reason(p, 31)
    assert "KV transfer to decode rank 127.0.0.1:" in reason, reason
    if transport_env is MOONCAKE_ENV:  # the transport's own cause reaches the room
        assert "Mooncake write to 127.0.0.1:" in reason and "batch write returned" in reason, reason
    assert p["requests"]["31"]["seconds"] < 20
    assert_clean(p)


def test_prefill_killed_mid_transfer_fails_the_decode_room():
    plan = {
        "pool": {"layout": "mla", "num_layers": 4, "page_size": 1, "num_pages": 300},
        "requests": [{"room": 41, "tokens": 200, "chunk_pages": 10}],
        "faults": {"prefill": {"chunk_delay_s": 0.2, "exit_after_chunks": 3}},
        "deadline_s": 40,
    }
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    assert result["returncodes"]["prefill"] == 17
    d = result["decode"]
    reason = failed_reason(d, 41)
    assert "prefill" in reason.lower() and ("Lost connection" in reason or "pair channel" in reason), reason
    assert d["requests"]["41"]["seconds"] < 20
    assert d["untouched_violations"] == []
    assert_clean(d)


@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_decode_abort_fails_both_sides_and_keeps_the_channel_in_step(transport_env):
    plan = {
        "pool": {"layout": "mha", "num_layers": 2, "page_size": 4, "num_pages": 300},
        "requests": [
            {"room": 51, "tokens": 4 * 60, "chunk_pages": 4},
            {"room": 52, "tokens": 4 * 30, "chunk_pages": 30},
        ],
        "faults": {"prefill": {"chunk_delay_s": 0.1}, "decode": {"abort_after_s": 0.5}},
        "deadline_s": 40,
    }
    result = run_pair(plan, env={**FAST_FAILURE_ENV, **transport_env})
    d, p = result["decode"], result["prefill"]
    assert "Aborted by AbortReq" in failed_reason(d, 51)
    # SGLang's ABORT, or (a one-sided write without SGLang's deferred release) the decode's hold telling it
    reason = failed_reason(p, 51)
    assert "Aborted by decode rank 127.0.0.1:" in reason or (
        "decode rank 127.0.0.1:" in reason and "failed the room: Aborted by AbortReq" in reason), reason
    assert d["untouched_violations"] == []
    assert_clean(d)
    assert_clean(p)


def test_unknown_bootstrap_rooms_time_out_with_the_room_named():
    plan = {
        "pool": {"layout": "mla", "num_layers": 2, "page_size": 1, "num_pages": 100},
        "requests": [
            {"room": 61, "tokens": 10, "roles": ["decode"]},  # no prefill ever gets it
            {"room": 62, "tokens": 10, "roles": ["prefill"]},  # no decode ever asks for it
            {"room": 63, "tokens": 10},
        ],
        "deadline_s": 40,
        # the prefill's room 62 times out as early as the decode's room 61: the prefill stays up past that, or the
        # decode may see its prefill gone (heartbeat loss) before its own timeout
        "linger_s": {"prefill": 4.0},
    }
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    d, p = result["decode"], result["prefill"]
    assert "61" in failed_reason(d, 61) and "WaitingForInput" in failed_reason(d, 61)
    assert "62" in failed_reason(p, 62) and "Bootstrapping" in failed_reason(p, 62)
    assert d["requests"]["63"]["status"] == "Success" and d["requests"]["63"]["num_bad_pages"] == 0
    assert_clean(d)


@pytest.mark.parametrize(
    "override,needle",
    [
        ({"pool_overrides": {"decode": {"page_size": 16}}}, "page_size"),
        ({"kv_dtype": {"prefill": "bfloat16", "decode": "fp8_e4m3"}}, "kv_cache_dtype"),
    ],
)
@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_incompatible_decode_fails_with_the_setting_named(override, needle, transport_env):
    plan = {
        "pool": {"layout": "mla", "num_layers": 2, "page_size": 1, "num_pages": 100},
        "requests": [{"room": 71, "tokens": 32}],
        "deadline_s": 40,
        **override,
    }
    result = run_pair(plan, env={**FAST_FAILURE_ENV, **transport_env})
    d, p = result["decode"], result["prefill"]
    reason = failed_reason(d, 71)
    assert needle in reason and "must use the same" in reason, reason
    assert d["requests"]["71"]["seconds"] < 5
    failed_reason(p, 71)
    assert_clean(d)
    assert_clean(p)


def test_prefill_that_never_answers_fails_the_decode_within_its_timeouts():
    plan = {
        "pool": {"layout": "mla", "num_layers": 2, "page_size": 1, "num_pages": 100},
        "requests": [{"room": 81, "tokens": 16}],
        "faults": {"prefill": {"stop_self": True}},
        "deadline_s": 30,
    }
    result = run_pair(plan, env=FAST_FAILURE_ENV, timeout=45)
    d = result["decode"]
    reason = failed_reason(d, 81)
    # Which watch notices first is a race: SGLang's heartbeat ("Lost connection"), the room's own timeout, or our
    # peer timeout (the prefill may freeze before or after answering the registration). Each names the prefill.
    noticed = ("Lost connection with prefill", "timed out", "stopped answering: no message for")
    assert any(n in reason for n in noticed), reason
    assert d["requests"]["81"]["seconds"] < 15
    assert_clean(d)


def deferred_release_available() -> bool:
    """SGLang 0.5.23+ has deferred decode KV release (ABORT with a generation, ABORT_ACK, the decode's hold)."""
    from sglang.srt.disaggregation.common import conn as common

    return hasattr(common.CommonKVManager, "register_deferred_ack_target")


def require_deferred_release() -> None:
    if not deferred_release_available():
        pytest.skip("this SGLang release has no deferred decode KV release (added in 0.5.23)")


DEFERRED_ENV = {
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",
    # well above the write delay: a release before it would be a timeout, not an ACK
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "20",
}


def assert_no_deferred_leftovers(p: dict, d: dict) -> None:
    assert p["leftovers"]["staging_outstanding"] == [] and p["leftovers"]["deferred_ack_targets"] == [], p["leftovers"]
    assert d["leftovers"]["deferred_abort_rooms"] == [], d["leftovers"]


@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_decode_abort_holds_pages_until_the_in_flight_write_ended(transport_env):
    # the prefill's only write of room 91 starts 3 s late; the decode aborts 0.5 s after its metadata, while
    # that write is in flight. Mooncake then writes into the aborted room's pages; tcp's send stops before its
    # first chunk. Either way the decode may give the pages back only after the write ended.
    require_deferred_release()
    plan = {
        "pool": {"layout": "mha", "num_layers": 2, "page_size": 4, "num_pages": 300},
        "requests": [{"room": 91, "tokens": 4 * 40, "chunk_pages": 40}],
        "faults": {"prefill": {"write_delay_s": 3.0}, "decode": {"abort_after_s": 0.5}},
        "linger_s": {"prefill": 5.0, "decode": 1.5},
        "deadline_s": 40,
    }
    result = run_pair(plan, env={**FAST_FAILURE_ENV, **DEFERRED_ENV, **transport_env})
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    d, p = result["decode"], result["prefill"]
    assert "Aborted by AbortReq" in failed_reason(d, 91)
    assert "Aborted by decode rank 127.0.0.1:" in failed_reason(p, 91)
    dr, pr = d["requests"]["91"], p["requests"]["91"]
    assert dr["release_safe"], dr  # released on the prefill's ACK, not on the timeout
    assert pr["write_done_at"] - dr["abort_at"] > 2.0, (pr, dr)  # the abort came while the write was in flight
    assert pr["ack_sent_at"] >= pr["write_done_at"], pr
    assert dr["released_at"] >= pr["write_done_at"], (dr, pr)
    assert dr["changed_after_release"] is False, dr
    assert d["untouched_violations"] == []
    assert_clean(d)
    assert_clean(p)
    assert_no_deferred_leftovers(p, d)


@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_abort_ack_waits_for_the_room_in_flight_only(transport_env):
    # one decode rank: both rooms go to the same transfer worker. Room 92's write is in flight for 3 s when
    # the decode aborts both; room 93's chunk is still queued behind it (nothing of it in flight), so its ACK
    # goes out at once and its pages come back at once, while room 92's wait for the end of its write.
    # Same host: both copies queued by that worker (SGLANG_P2P_IPC_LAUNCH=worker). With SGLang's thread queueing
    # them, room 93's copy would not wait behind room 92's once the decode is mapped (the next test).
    require_deferred_release()
    plan = {
        "pool": {"layout": "mha", "num_layers": 2, "page_size": 4, "num_pages": 300},
        "requests": [
            {"room": 92, "tokens": 4 * 20, "chunk_pages": 20},
            {"room": 93, "tokens": 4 * 20, "chunk_pages": 20},
        ],
        "faults": {"prefill": {"write_delay_s": {"92": 3.0}}, "decode": {"abort_after_s": 0.5}},
        "linger_s": {"prefill": 5.0, "decode": 1.5},
        "deadline_s": 40,
    }
    env = {**FAST_FAILURE_ENV, **DEFERRED_ENV, **transport_env, "SGLANG_P2P_IPC_LAUNCH": "worker"}
    result = run_pair(plan, env=env)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    d, p = result["decode"], result["prefill"]
    held, idle = d["requests"]["92"], d["requests"]["93"]
    sent_held, sent_idle = p["requests"]["92"], p["requests"]["93"]
    for r in (held, idle):
        assert r["status"] == "Failed" and "Aborted by AbortReq" in r["reason"], r
        assert r["release_safe"] and r["changed_after_release"] is False, r
    # room 92: no ACK while its write ran
    assert sent_held["ack_sent_at"] >= sent_held["write_done_at"], sent_held
    assert held["released_at"] >= sent_held["write_done_at"], (held, sent_held)
    assert held["released_at"] - held["abort_at"] > 2.0, held
    # room 93: nothing in flight, ACK at once (its queued chunk is dropped unwritten later)
    assert "write_done_at" not in sent_idle, sent_idle
    assert sent_idle["ack_sent_at"] < sent_held["write_done_at"], (sent_idle, sent_held)
    assert idle["released_at"] - idle["abort_at"] < 1.5, idle
    assert d["untouched_violations"] == []
    assert_clean(d)
    assert_clean(p)
    assert_no_deferred_leftovers(p, d)


def test_abort_ack_waits_for_a_copy_the_scheduler_queued_while_its_poll_concludes_the_room_whose_copy_ran():
    # same host, SGLang's thread queueing each copy (the default) and its poll concluding rooms. Room 91 maps the
    # decode; then rooms 92 and 93 are queued in `add` at once. Room 92's copy runs 3 s; room 93's ran, so the
    # poll concludes it (Success, every byte) before the decode aborts at 0.5 s. Room 92's ACK and its pages wait
    # for its copy, counted in flight from its launch on SGLang's thread, not from its worker.
    require_deferred_release()
    plan = {
        "pool": {"layout": "mha", "num_layers": 2, "page_size": 4, "num_pages": 300},
        "requests": [
            {"room": 91, "tokens": 4 * 5, "chunk_pages": 5},
            {"room": 92, "tokens": 4 * 20, "chunk_pages": 20, "after": "decode-91-done"},
            {"room": 93, "tokens": 4 * 20, "chunk_pages": 20, "after": "decode-91-done"},
        ],
        "faults": {"prefill": {"write_delay_s": {"92": 3.0}}, "decode": {"abort_after_s": 0.5}},
        "linger_s": {"prefill": 5.0, "decode": 1.5},
        "deadline_s": 40,
    }
    result = run_pair(plan, env={**FAST_FAILURE_ENV, **DEFERRED_ENV, **IPC_ENV})
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    d, p = result["decode"], result["prefill"]
    for room in (91, 93):
        r = d["requests"][str(room)]
        assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
        assert p["requests"][str(room)]["status"] == "Success"
    assert p["leftovers"]["concluded_in_poll"] >= 1, p["leftovers"]  # room 93 (room 91's copy was its worker's)
    held, sent_held = d["requests"]["92"], p["requests"]["92"]
    assert held["status"] == "Failed" and "Aborted by AbortReq" in held["reason"], held
    assert held["release_safe"] and held["changed_after_release"] is False, held
    assert sent_held["ack_sent_at"] >= sent_held["write_done_at"], sent_held
    assert held["released_at"] >= sent_held["write_done_at"], (held, sent_held)
    assert held["released_at"] - held["abort_at"] > 2.0, held
    assert d["untouched_violations"] == []
    assert_clean(d)
    assert_clean(p)
    assert_no_deferred_leftovers(p, d)


def test_the_test_only_kv_fault_zeroes_one_page_of_every_room_while_its_file_exists(tmp_path):
    """The end-to-end checks' negative control (adapter/kv_fault.py): with the flag file present, each room that
    completes has exactly an eighth of its pages (at least one, from the middle) zeroed in every KV region, and
    nothing else changes."""
    flag = tmp_path / "corrupt"
    flag.touch()
    plan = {
        "pool": {"layout": "mla", "num_layers": 3, "page_size": 1, "num_pages": 200},
        "requests": [{"room": 61, "tokens": 40, "chunk_pages": 16}, {"room": 62, "tokens": 9, "chunk_pages": 4}],
        "deadline_s": 60,
    }
    result = run_pair(plan, env={"SGLANG_P2P_TEST_CORRUPT_KV_FILE": str(flag)})
    d = result["decode"]
    for room, tokens, zeroed in ((61, 40, range(20, 25)), (62, 9, range(4, 5))):
        r = d["requests"][str(room)]
        assert r["status"] == "Success" and r["num_bad_pages"] == 3 * len(zeroed), r  # in each of the 3 regions
        assert {b.split(" page ")[0] for b in r["bad_pages"]} == {"region 0", "region 1", "region 2"}
        assert {b.rsplit("(position ", 1)[1] for b in r["bad_pages"]} == {f"{p})" for p in zeroed}
    assert d["untouched_violations"] == []


@pytest.mark.parametrize("layout,page_size", [("mla", 1), ("mha", 16)])
def test_the_test_only_kv_digest_is_logged_equal_on_both_sides_of_every_room(layout, page_size):
    """SGLANG_P2P_TEST_KV_DIGEST=1 (adapter/kv_digest.py): the prefill logs a digest of the pages it sent for
    each room, chunk after chunk, the decode one of the pages it holds at the room's Success; the end-to-end
    comparer (e2e/kv_digest.py) finds them equal, room by room."""
    plan = {
        "pool": {"layout": layout, "num_layers": 3, "page_size": page_size, "num_pages": 200},
        "requests": [{"room": 71, "tokens": 83, "chunk_pages": 2}, {"room": 72, "tokens": 9, "chunk_pages": 4}],
        "deadline_s": 60,
    }
    result = run_pair(plan, env=kv_digests.ENV)
    assert_all_landed(result, [71, 72])
    got = kv_digests.compare_run(result)
    assert got["rooms_compared"] == got["rooms_equal"] == 2 and got["mismatches"] == [], got
    assert got["rooms_missing_a_side"] == 0 and got["control_rooms"] == 0, got
    sent = {d.room: d.pages for d in kv_digests.lines(result, "prefill")}
    assert sent == {71: -(-83 // page_size), 72: -(-9 // page_size)}  # every page once, over every chunk


def test_the_kv_digest_flags_the_rooms_the_test_only_fault_corrupted(tmp_path):
    """The decode digests after the corruption fault: the rooms it zeroed pages of (its log names them) are
    mismatches, and only they: the room that completed before the flag file existed is equal on both sides."""
    flag = tmp_path / "corrupt"
    later = {"chunk_pages": 8, "after": "flag-on"}  # these start once the flag file exists
    plan = {
        "pool": {"layout": "mla", "num_layers": 3, "page_size": 1, "num_pages": 200},
        "requests": [{"room": 81, "tokens": 40, "chunk_pages": 16},
                     {"room": 82, "tokens": 30, **later}, {"room": 83, "tokens": 9, **later}],
        "deadline_s": 60,
    }
    run = PairRun(plan, env={**kv_digests.ENV, "SGLANG_P2P_TEST_CORRUPT_KV_FILE": str(flag)})

    def flag_on() -> None:  # once the decode digested room 81 (after the fault's moment, before its Success)
        log = Path(run.workdir) / "decode-0.log"
        deadline = time.monotonic() + 300
        while "p2p kv digest decode room=81 " not in log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.05)
        flag.touch()
        touch(run.plan, "flag-on")

    arm = threading.Thread(target=flag_on, daemon=True)
    arm.start()
    result = run.wait(120)
    arm.join(5)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    assert {r: result["decode"]["requests"][r]["status"] for r in ("81", "82", "83")} == dict.fromkeys(("81", "82", "83"), "Success")
    got = kv_digests.compare_run(result)
    assert got["control_rooms"] == got["controls_flagged_by_digest"] == 2 and got["controls_not_flagged"] == [], got
    assert got["rooms_compared"] == got["rooms_equal"] == 1, got  # room 81



@pytest.mark.parametrize("digest", [False, True], ids=["plain", "kv-digest"])
def test_page_ids_handed_over_as_a_host_tensor_still_being_copied_are_read_after_its_event(digest):
    """SGLang 0.5.23 hands a sender with `supports_host_tensor_indices` each chunk's page ids as a host tensor
    whose copy from the device may still run, with the event that ends it, so its scheduler never waits for the
    forward pass in flight. The driver's stand-in holds -1 in the tensor until the event is waited on: every page
    must land exactly, and the wait must be a transfer worker's, not the scheduler's; with the test-only KV digest,
    which records the ids as they are queued, the scheduler waits (and the digests still match)."""
    plan = {
        "pool": {"layout": "mha", "num_layers": 3, "page_size": 4, "num_pages": 200, "state_slots": 4},
        "requests": [
            {"room": 21, "tokens": 33 * 4 + 3, "chunk_pages": 8},
            {"room": 22, "tokens": 12 * 4, "chunk_pages": 1 << 30},
            {"room": 23, "tokens": 20 * 4, "chunk_pages": 6, "prefix": 6 * 4},
        ],
        "host_tensor_indices": True,
        "deadline_s": 60,
    }
    result = run_pair(plan, env=kv_digests.ENV if digest else None)
    assert_all_landed(result, [21, 22, 23])
    for room in ("21", "22", "23"):
        r = result["prefill"]["requests"][room]
        assert r["host_tensor_indices"] is True, r
        waited = r["indices_waited_by"]
        assert waited and all(name is not None for name in waited), waited
        assert all((name == "MainThread") == digest for name in waited), waited
    if digest:
        got = kv_digests.compare_run(result)
        assert got["rooms_compared"] == got["rooms_equal"] == 3 and got["mismatches"] == [], got
