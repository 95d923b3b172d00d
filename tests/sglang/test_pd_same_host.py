"""The same-host path (SGLANG_P2P_TRANSPORT=cudaipc) through SGLang's classes on CPU, with the shared-memory
stand-in for CUDA IPC (tests/support/shm_ipc.py: the decode's pools live in shared segments, handles are their
names). What runs is the product's code: the export in the registration, the prefill's checks of it against
the registered pools, mapping once per decode process in the worker that owns it, bounds on every write, the
aux row and Status on the control channel after the copy, and unmapping when the peer dies. Only the CUDA
calls and the copy kernel are stood in for (tests/gpu/test_cuda_ipc.py runs them on a GPU).

The byte-exact, abort, kill and mismatch cases of the PD suite run over this path too (tests/sglang/
test_pd_transfer.py, `cudaipc-standin`); here: what is particular to it.
"""

import pytest
from support.shm_ipc import IPC_STANDIN

from sglang_p2p_backend.testing.launch import run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

FAST = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "8", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "8",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}
IPC = {"SGLANG_P2P_TRANSPORT": "cudaipc", **IPC_STANDIN}


def _plan(**extra) -> dict:
    return {"pool": {"layout": "mla", "num_layers": 3, "page_size": 4, "num_pages": 200},
            "requests": [{"room": 81, "tokens": 4 * 30 + 1, "chunk_pages": 8}], "deadline_s": 40, **extra}


def _reason(side: dict, room: int) -> str:
    r = side["requests"][str(room)]
    assert r["status"] == "Failed", r
    return r["reason"]


def test_a_decode_that_exports_nothing_is_refused_by_a_forced_prefill_on_both_sides():
    # the decode runs tcp (no export): a prefill forced to cudaipc cannot serve it, and both sides say why
    plan = _plan(env={"decode": {"SGLANG_P2P_TRANSPORT": "tcp"}}, linger_s={"prefill": 2.0})
    result = run_pair(plan, env={**FAST, **IPC})
    d, p = result["decode"], result["prefill"]
    want = "SGLANG_P2P_TRANSPORT=cudaipc cannot serve this pair"
    assert want in _reason(d, 81) and "exports no CUDA IPC memory" in _reason(d, 81), _reason(d, 81)
    assert any(want in why for why in p["leftovers"]["rejected_peers"].values()), p["leftovers"]["rejected_peers"]
    assert p["leftovers"]["ipc_mapped"] == []
    assert d["untouched_violations"] == []


def test_an_export_that_does_not_cover_the_registered_pool_is_refused_before_any_write():
    # a decode (forced to cudaipc: it offers nothing else) whose first exported region is one page shorter than
    # the pool it registers: mapping it would let page ids that pass the pool bounds land outside the exported
    # memory; an auto prefill has no other way to that decode, so it refuses the pair at registration
    plan = _plan(faults={"decode": {"ipc_export_short": True}}, linger_s={"prefill": 2.0},
                 env={"prefill": {"SGLANG_P2P_TRANSPORT": "auto"}})
    result = run_pair(plan, env={**FAST, **IPC})
    d, p = result["decode"], result["prefill"]
    assert "does not cover registered" in _reason(d, 81), _reason(d, 81)
    assert d["untouched_violations"] == [], "a refused pair wrote pages"
    assert p["leftovers"]["ipc_mapped"] == []


def test_a_dead_decode_is_unmapped_once_its_silence_expires():
    # the decode exits mid-transfer; the prefill's room fails, and once SGLANG_P2P_PEER_TIMEOUT has passed its
    # mapping of the dead process's memory is gone (before the prefill's own shutdown)
    plan = _plan(faults={"prefill": {"chunk_delay_s": 0.3}, "decode": {"exit_after_s": 1.0}},
                 linger_s={"prefill": 5.0}, requests=[{"room": 81, "tokens": 4 * 120, "chunk_pages": 8}])
    result = run_pair(plan, env={**FAST, **IPC, "SGLANG_P2P_PEER_TIMEOUT": "2"})
    assert result["decode"] is None
    p = result["prefill"]
    assert "KV transfer to decode rank 127.0.0.1:" in _reason(p, 81)
    assert p["leftovers"]["ipc_mapped"] == [] and p["leftovers"]["decode_peers"] == [], p["leftovers"]
    assert p["shm_mapped_after_close"] == 0


def test_head_slices_of_a_different_attention_tp_land_exactly():
    # two prefill ranks of 2 KV heads each into one decode rank holding all 4: each prefill rank copies its head
    # range of every token row into the decode's mapped pages (one span per row and region)
    p = {"pool": {"layout": "mha", "num_layers": 2, "page_size": 4, "num_pages": 200, "head_dim": 32,
                  "total_kv_heads": 4},
         "tp": {"prefill": 2, "decode": 1},
         "requests": [{"room": 91, "tokens": 4 * 25 + 3, "chunk_pages": 6},
                      {"room": 92, "tokens": 4 * 12, "chunk_pages": 5, "prefix": 4 * 3}],
         "deadline_s": 40}
    result = run_pair(p, env={**FAST, **IPC})
    d = result["ranks"]["decode"][0]
    for room in ("91", "92"):
        r = d["requests"][room]
        assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
    assert d["untouched_violations"] == []
    for pr in result["ranks"]["prefill"]:
        assert pr["leftovers"]["ipc_failed"] == {} and len(pr["leftovers"]["ipc_mapped"]) == 1, pr["leftovers"]


def test_auto_takes_the_same_host_path_and_falls_back_when_the_export_is_unusable():
    # both sides on auto: the prefill maps the same-host decode and copies into it; with an export that does not
    # cover the registered pool it logs why, keeps the decode on the two-sided path, and the KV still lands
    standin = dict(IPC_STANDIN)
    for faults, want_mapped in (({}, True), ({"decode": {"ipc_export_short": True}}, False)):
        result = run_pair(_plan(faults=faults), env={**FAST, **standin})
        d, p = result["decode"], result["prefill"]
        r = d["requests"]["81"]
        assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
        assert d["untouched_violations"] == []
        left = p["leftovers"]
        assert bool(left["ipc_mapped"]) == want_mapped, left
        if not want_mapped:
            # nothing mapped, yet every page arrived: the two-sided path carried it
            assert "does not cover registered" in " ".join(left["ipc_failed"].values()), left["ipc_failed"]


@pytest.mark.parametrize("alone_kernel", ["1", "0"])
def test_a_request_alone_takes_the_kernel_for_its_last_chunk_into_another_gpu(alone_kernel):
    # prefill and decode on two "GPUs" of one host, the copy engines' thresholds low enough for every chunk: one
    # request alone on the prefill sends its earlier chunks by the rule (the copy engines: its next chunk's forward
    # pass runs beside them) and its last to the kernel; SGLANG_P2P_ALONE_KERNEL=0 routes every chunk by the rule.
    # The bytes land either way
    from support.shm_ipc import DEVICE_ENV

    ce = {"SGLANG_P2P_CE_MIN_SPAN_KIB": "1", "SGLANG_P2P_CE_MAX_SPANS": "1024", "SGLANG_P2P_ALONE_KERNEL": alone_kernel}
    plan = _plan(env={"prefill": {DEVICE_ENV: "shm-gpu0", **ce}, "decode": {DEVICE_ENV: "shm-gpu1"}})
    plan["pool"]["head_dim"] = 576  # pages of 4.5 KiB a layer: every span reaches the 1 KiB threshold
    result = run_pair(plan, env={**FAST, **IPC})
    d, p = result["decode"], result["prefill"]
    r = d["requests"]["81"]
    assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
    assert d["untouched_violations"] == []
    routes = p["leftovers"]["ipc_routes"]
    chunks = -(-31 // 8)  # 121 tokens in pages of 4: 31 pages, 8 a chunk
    if alone_kernel == "1":
        assert routes["copy_engine"]["chunks"] == chunks - 1, routes
        assert routes["kernel"]["chunks"] == 1 and routes["kernel"]["why"] == {"alone on the GPU": 1}, routes
    else:
        assert routes == {"copy_engine": {"chunks": chunks, "bytes": routes["copy_engine"]["bytes"], "why": {}}}, routes


@pytest.mark.parametrize("conclude_in_poll", ["1", "0"])
def test_rooms_whose_last_copy_the_scheduler_queued_are_concluded_in_its_poll_and_every_byte_lands(conclude_in_poll):
    # several requests, each of several chunks: after the first chunk mapped the decode, SGLang's thread queues each
    # copy itself, and with SGLANG_P2P_CONCLUDE_IN_POLL=1 its poll concludes those rooms (a worker that gets there
    # first concludes the room instead, once); =0 leaves every room to its worker. Bytes, aux row and Status exact
    # either way, and nothing is left in the poll's tables once the senders were cleared
    # each copy runs 20 ms, and its worker notices its end 200 ms later (a worker woken late, as for the GIL): the
    # poll, every 2 ms, concludes first where it may
    plan = _plan(env={"prefill": {"SGLANG_P2P_CONCLUDE_IN_POLL": conclude_in_poll}},
                 faults={"prefill": {"write_delay_s": 0.02, "worker_wake_s": 0.2}})
    plan["requests"] = [{"room": 81 + i, "tokens": 4 * 20 + 1 + i, "chunk_pages": 8} for i in range(6)]
    result = run_pair(plan, env={**FAST, **IPC})
    d, p = result["decode"], result["prefill"]
    for i in range(6):
        r = d["requests"][str(81 + i)]
        assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], r
        assert p["requests"][str(81 + i)]["status"] == "Success"
    assert d["untouched_violations"] == []
    left = p["leftovers"]
    assert left["poll_tables"] == [] and left["transfer_infos"] == [], left
    if conclude_in_poll == "1":  # each room but those whose only copy went before the decode was mapped
        assert 4 <= left["concluded_in_poll"] <= 6, left
    else:
        assert left["concluded_in_poll"] == 0, left
