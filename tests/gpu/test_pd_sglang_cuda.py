"""The PD suite's byte-exact cases with CUDA pools, through SGLang's classes (plugin loader, `get_kv_class`, the
bootstrap server, the scheduler's polling), over real NCCL, the same-host CUDA IPC path and, where it is
installed, Mooncake.

Layouts: DeepSeek MLA (61 layers, 576 bf16 values a token) and an MHA model (32 layers,
8 KV heads x 128, bf16), page sizes 1, 16 and 64, chunked and in one send(). With two GPUs the prefill's pools
are on cuda:0 and the decode's on cuda:1; with one GPU both share it and NCCL runs over loopback sockets
(testing/launch.py `one_gpu_env`): the same code paths, not NVLink speed. Also: the communicator budget with
two prefill ranks feeding one decode rank whose budget holds one communicator, over NCCL.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")


def _sglang_installed() -> bool:
    """SGLang itself, not tests/sglang: with tests/ on sys.path that directory is a namespace package `sglang`,
    which `find_spec("sglang")` finds where SGLang is missing (the role processes then fail to import it)."""
    try:
        return importlib.util.find_spec("sglang.srt") is not None
    except ModuleNotFoundError:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _sglang_installed(), reason="needs SGLang (e2e bundle on GPU hosts)"),
]

from sglang_p2p_backend.testing.launch import run_pair  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _plugin_registered():
    """The role processes find p2pnccl through SGLang's plugin entry point: without it every case would fail at
    start with "'p2pnccl' is not a valid TransferBackend" in its logs only. Said once, with the fix."""
    from importlib.metadata import entry_points

    if not any(e.name == "p2pnccl" for e in entry_points(group="sglang.srt.plugins")):
        pytest.fail("the p2pnccl plugin's entry point is not installed: pip install -e . here, or on a GPU host put "
                    "e2e/run_all.sh's $E2E_ROOT/plugin on PYTHONPATH (docs/e2e.md)", pytrace=False)

LAYOUTS = {
    "mla": {"layout": "mla", "num_layers": 61, "head_dim": 576},
    "mha": {"layout": "mha", "num_layers": 32, "kv_heads": 8, "head_dim": 128},
}
TRANSPORTS = [
    pytest.param({"SGLANG_P2P_TRANSPORT": "nccl"}, id="nccl"),
    # each chunk's scatter queued on the GPU behind its receive, counted for its room by the decode's gate
    pytest.param({"SGLANG_P2P_TRANSPORT": "nccl", "SGLANG_P2P_DEVICE_SCATTER": "1"}, id="nccl-device-scatter"),
    # the same-host path: the decode's pools mapped into the prefill (CUDA IPC; two processes on one GPU work too)
    pytest.param({"SGLANG_P2P_TRANSPORT": "cudaipc"}, id="cudaipc"),
    pytest.param(
        {"SGLANG_P2P_TRANSPORT": "mooncake", "MC_FORCE_TCP": "1", "GLOG_minloglevel": "2"},
        id="mooncake-tcp",
        marks=pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake not installed"),
    ),
]


def gpu_plan(pool: dict, requests: list, deadline_s: float = 120) -> dict:
    two = torch.cuda.device_count() >= 2
    plan = {
        "pool": {**pool, "device": "cuda:0"},
        "requests": requests,
        "deadline_s": deadline_s,
    }
    if two:
        plan["pool_overrides"] = {"decode": {"device": "cuda:1"}}
    else:
        plan["share_gpu"] = True
    return plan


def assert_landed(result: dict, rooms: list[int]) -> None:
    p, d = result["prefill"], result["decode"]
    assert p is not None and d is not None, f"a role died: {result['returncodes']} (logs in {result['workdir']})"
    for room in map(str, rooms):
        assert p["requests"][room]["status"] == "Success", p["requests"][room]
        r = d["requests"][room]
        assert r["status"] == "Success" and r["num_bad_pages"] == 0, r
        assert r["aux_room_ok"] and r["first_token_ok"], r
    assert d["untouched_violations"] == [], d["untouched_violations"]
    gate = d["leftovers"]["scatter_gate"]  # no scatter queued on the GPU left uncounted, no failure left waiting
    assert gate["pending"] == [] and gate["waiting"] == [], gate
    for side in (p, d):
        left = side["leftovers"]
        assert left["request_status"] == [] and left["staging_in_use"] == 0, left
        assert side["threads_left"] == [], side["threads_left"]


@pytest.mark.parametrize("transport_env", TRANSPORTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["mla", "mha"])
def test_cuda_pools_land_byte_exact(layout, page_size, transport_env):
    ps = page_size
    tokens = 2048 if ps > 1 else 700
    pages = -(-tokens // ps)
    requests = [
        {"room": 51, "tokens": tokens, "chunk_pages": max(1, pages // 5)},  # chunked prefill: 5+ send() calls
        {"room": 52, "tokens": tokens - 3},  # one send(), partial last page
        {"room": 53, "tokens": tokens, "chunk_pages": max(1, pages // 3), "prefix": 2 * ps},  # decode prefix
    ]
    plan = gpu_plan({**LAYOUTS[layout], "page_size": ps, "num_pages": 3 * pages + 8}, requests)
    # 8 MiB staging in 2 slots: the larger requests take several chunks of the engine's pipeline too
    env = {**transport_env, "SGLANG_P2P_STAGING_MB": "8"}
    result = run_pair(plan, env=env, timeout=240)
    assert_landed(result, [51, 52, 53])
    queued = result["decode"]["leftovers"]["scatter_gate"]["total"]
    assert (queued > 0) == (transport_env.get("SGLANG_P2P_DEVICE_SCATTER") == "1"), queued


@pytest.mark.parametrize("layout", ["mla", "mha"])
def test_rooms_concluded_in_the_schedulers_poll_over_cuda_ipc_land_byte_exact(layout):
    # each chunk's copy queued by SGLang's thread on its CUDA stream, and its worker made to notice the copy's end
    # 200 ms late (as a worker woken late, waiting for the GIL): SGLang's poll, every 2 ms, concludes the rooms
    # whose last copy its own event says has run. Every byte must have landed by the Success the decode sees
    pool = {**LAYOUTS[layout], "page_size": 16, "num_pages": 3 * 128 + 8}
    requests = [{"room": 61 + i, "tokens": 2048 - 5 * i, "chunk_pages": 32} for i in range(3)]
    plan = gpu_plan(pool, requests)
    plan["faults"] = {"prefill": {"worker_wake_s": 0.2}}
    plan["serial"] = True  # one request at a time: the decode is mapped after the first chunk, the rest queued here
    result = run_pair(plan, env={"SGLANG_P2P_TRANSPORT": "cudaipc"}, timeout=240)
    assert_landed(result, [61, 62, 63])
    left = result["prefill"]["leftovers"]
    assert left["concluded_in_poll"] >= 2 and left["poll_tables"] == [], left


def test_decode_budget_of_one_communicator_serves_two_prefill_ranks_over_nccl():
    plan = gpu_plan({"layout": "mla", "num_layers": 8, "head_dim": 576, "page_size": 16, "num_pages": 512},
                    [{"room": 3201 + i, "tokens": 600, "chunk_pages": 8} for i in range(6)], deadline_s=60)
    plan.update(tp={"prefill": 2, "decode": 1}, attn_dp={"prefill": 2})
    if "pool_overrides" not in plan:
        plan["share_gpu"] = True
    env = {"SGLANG_P2P_TRANSPORT": "nccl", "SGLANG_P2P_NCCL_BUDGET_MB": "45"}
    result = run_pair(plan, env=env, timeout=100)
    d = result["decode"]
    assert d is not None and all(p is not None for p in result["ranks"]["prefill"]), result["workdir"]
    for room in range(3201, 3207):
        r = d["requests"][str(room)]
        assert r["status"] == "Success" and r["num_bad_pages"] == 0, (room, r)
    assert d["leftovers"]["comm_peak_mb"] <= 45 and d["leftovers"]["comm_stats"].get("no_room", 0) >= 1, d["leftovers"]
