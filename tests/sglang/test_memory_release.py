"""SGLang's release_memory_occupation / resume_memory_occupation (--enable-memory-saver) on both sides of a 1P1D
pair, through SGLang's own queue methods (testing/memory_release.py) and real transfers before, during and after.

Released, a rank's KV pages may be unmapped (torch_memory_saver): KV of a request sent meanwhile must never move
(the room fails on both sides naming the release, no byte of the decode's pool touched) and the Mooncake
registration must go (it names the pages); a paused prefill's waiting request, which sent no KV yet, goes on after
the resume; resumed, the next request lands byte-exact over the same transport.
"""

from multiprocessing import shared_memory
from types import SimpleNamespace

import pytest
import torch
from support.shm_ipc import ShmBackend
from test_pd_transfer import TRANSPORTS, assert_clean, failed_reason

from sglang_p2p_backend.adapter.decode import DecodeKVManager
from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.transport import cuda_ipc
from sglang_p2p_backend.testing.launch import run_pair

pytestmark = pytest.mark.sglang

POOL = {"layout": "mla", "num_layers": 3, "page_size": 4, "num_pages": 200, "state_slots": 8}


@pytest.mark.slow
@pytest.mark.parametrize("sides", [("prefill", "decode"), ("decode",)], ids=["both", "decode-only"])
@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_a_released_pair_refuses_requests_and_serves_again_after_resume(transport_env, sides):
    # idle servers released (both, or only the decode, whose prefill would otherwise write into it): a request
    # opened meanwhile fails on both sides naming the release (the decode publishes nothing and tells the
    # prefill), nothing lands; resumed, the next one lands byte-exact
    released = [f"{side}-0-released" for side in sides]
    resumed = [f"{side}-0-resumed" for side in sides]
    requests = [
        {"room": 61, "tokens": 4 * 12 + 3, "chunk_pages": 5},
        {"room": 62, "tokens": 4 * 12, "chunk_pages": 5, "after": released},  # while released
        {"room": 63, "tokens": 4 * 15 + 1, "chunk_pages": 5, "after": resumed},
    ]
    release = {"release_after": ["prefill-61-done", "decode-61-done"],
               "resume_after": ["prefill-62-done", "decode-62-done"]}
    plan = {"pool": POOL, "requests": requests, "deadline_s": 60,
            "memory_release": {side: release for side in sides}}
    result = run_pair(plan, env=transport_env)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    p, d = result["prefill"], result["decode"]
    for side in (p, d):
        if side["role"] in sides:
            assert side["memory_release"]["state"] == "resumed", side["memory_release"]
        for room in ("61", "63"):
            assert side["requests"][room]["status"] == "Success", side["requests"][room]
        assert "release_memory_occupation" in failed_reason(side, 62)
        assert_clean(side)
    assert d["memory_release"]["changed_while_released"] is False  # no byte of the released pools moved
    assert_landed(d, ("61", "63"))
    if transport_env.get("SGLANG_P2P_TRANSPORT") == "mooncake":  # registered again after, nothing kept during
        for side in (p, d):
            if side["role"] in sides:
                assert side["memory_release"]["registered_while_released"] == 0
                # a write failing on the decode's old registration marks its session for the peer timeout only
                assert side["memory_release"]["retry_after_s"] == float(
                    transport_env.get("SGLANG_P2P_PEER_TIMEOUT", EngineConfig.peer_timeout))


@pytest.mark.slow
@pytest.mark.parametrize("transport_env", TRANSPORTS)
def test_a_paused_prefill_keeps_its_waiting_rooms_across_a_release_and_refuses_chunks_meanwhile(transport_env):
    # SGLang releases a paused prefill with requests still waiting (bootstrapped, no KV sent): room 64 is such a
    # request, and goes on after the resume; room 65's chunks come while the prefill is released (its decode is
    # not) and fail the room on both sides naming the release, nothing written into the decode
    requests = [
        {"room": 64, "tokens": 4 * 12 + 1, "chunk_pages": 5},
        {"room": 65, "tokens": 4 * 10, "chunk_pages": 5, "after": {"prefill": "prefill-0-released",
                                                                    "decode": "prefill-0-released"}},
    ]
    plan = {"pool": POOL, "requests": requests, "deadline_s": 60,
            "send_after": {"64": ["prefill-0-resumed"]},
            "memory_release": {"prefill": {"release_after": ["decode-64-published"],
                                           "resume_after": ["prefill-65-done", "decode-65-done"]}}}
    result = run_pair(plan, env=transport_env)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    p, d = result["prefill"], result["decode"]
    assert p["memory_release"]["state"] == "resumed", p["memory_release"]
    for side in (p, d):
        assert side["requests"]["64"]["status"] == "Success", side["requests"]["64"]
        assert "release_memory_occupation" in failed_reason(side, 65)
        assert_clean(side)
    assert_landed(d, ("64",))
    assert d["untouched_violations"] == [], "room 65's pages, or any other, changed"


def assert_landed(d: dict, rooms) -> None:
    for room in rooms:
        r = d["requests"][room]
        assert r["num_bad_pages"] == 0, r["bad_pages"]
        assert r["aux_room_ok"] and r["first_token_ok"] and r["state_ok"], r
    assert d["untouched_violations"] == [], "pages outside the destinations changed"


def test_a_cuda_ipc_export_that_no_longer_names_the_pools_after_resume_stops_the_decode():
    # prefills keep the allocation they opened: had the pause freed the pools and new memory come back at the same
    # addresses, their writes would land in the old memory while SGLang reads the new (Success, wrong KV). The
    # export is compared again at resume; a new allocation at the same address (another segment under the
    # stand-in) stops the rank, the same one does not
    shm = ShmBackend()
    cuda_ipc.use_backend(shm)
    try:
        pool = shm.allocate(4 * 4096)
        regions = [(pool.data_ptr(), 2 * 4096), (pool.data_ptr() + 2 * 4096, 2 * 4096)]
        ipc = cuda_ipc.CudaIpcTransport(torch.device("cpu"))
        ipc.register(regions)
        fatal: list[str] = []
        decode = SimpleNamespace(ipc=ipc, local_memory=SimpleNamespace(pool_regions=lambda: regions),
                                 _fatal=fatal.append)
        DecodeKVManager._memory_resumed(decode)
        assert fatal == [] and ipc.export_changed(regions) is None
        base = pool.data_ptr()
        other = shared_memory.SharedMemory(create=True, size=shm._own[base].size)
        old, shm._own[base] = shm._own[base], other  # the same address, another allocation
        try:
            DecodeKVManager._memory_resumed(decode)
        finally:
            shm._own[base] = old
            other.close()
            other.unlink()
        assert len(fatal) == 1 and "other allocations than the ones exported" in fatal[0], fatal
        assert "SGLANG_P2P_TRANSPORT=nccl" in fatal[0]
    finally:
        cuda_ipc.use_backend(None)
        shm.close()
