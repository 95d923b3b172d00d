"""bench.mooncake.pd_path: which cases each pool device runs, with which environment, and what the JSON names."""
import json

import pytest

from bench.mooncake import pd_path
from sglang_p2p_backend.testing.pools import HostPools, PoolSpec


def test_cuda_pools_run_only_the_mooncake_tcp_case():
    cases = pd_path.transports_for("cuda:0")
    assert list(cases) == ["mooncake"]
    assert cases["mooncake"]["SGLANG_P2P_TRANSPORT"] == "mooncake" and cases["mooncake"]["MC_FORCE_TCP"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in cases["mooncake"]


def test_cpu_pools_run_both_cases_with_the_gpus_hidden():
    """On a GPU host the plugin takes the KV for GPU memory unless the transport is tcp: the CPU bench hides them."""
    cases = pd_path.transports_for("cpu")
    assert list(cases) == ["tcp", "mooncake"]
    assert {c["CUDA_VISIBLE_DEVICES"] for c in cases.values()} == {""}


def test_unknown_device_is_refused():
    with pytest.raises(ValueError):
        pd_path.transports_for("tpu")


def test_plan_puts_both_roles_pools_on_the_device_and_the_driver_accepts_it():
    pool = pd_path.plan_for(8, "cuda:0")["pool"]
    assert pool["device"] == "cuda:0" and PoolSpec(**pool).device == "cuda:0"
    small = {**pd_path.plan_for(8)["pool"], "num_layers": 2, "num_pages": 4}
    pools = HostPools.allocate(PoolSpec(**small))
    assert pools.kv[0].device.type == "cpu" and len(pools.kv) == 2


def _fake_result(plan):
    page = {"status": "Success", "transfer_s": 0.5, "first_send_at": 1.0, "success_at": 1.5, "bytes": 1000}
    rooms = {str(r["room"]): page for r in plan["requests"]}
    return {"workdir": "/w", "returncodes": {}, "prefill": {"requests": rooms},
            "decode": {"untouched_violations": [],
                       "requests": {k: {"status": "Success", "num_bad_pages": 0, "aux_room_ok": True} for k in rooms}}}


def test_gpu_run_writes_the_device_into_every_row_and_the_file(tmp_path, monkeypatch):
    seen = []

    def fake_run_pair(plan, timeout, env, workdir=None):
        seen.append((plan["pool"]["device"], env, workdir))
        return _fake_result(plan)

    monkeypatch.setattr(pd_path, "run_pair", fake_run_pair)
    monkeypatch.setattr(pd_path, "device_info", lambda d: {"pools": d, "name": "NVIDIA H200"})
    out = tmp_path / "out" / "mooncake_pd_nvidia-h200.json"
    rc = pd_path.main(["--device", "cuda:0", "--machine", "nvidia-h200", "--out", str(out), "--logs", str(tmp_path / "l")])
    assert rc == 0
    assert [d for d, _, _ in seen] == ["cuda:0", "cuda:0"] and all(e["MC_FORCE_TCP"] == "1" for _, e, _ in seen)
    assert all(w and w.startswith(str(tmp_path / "l")) for _, _, w in seen)
    doc = json.loads(out.read_text())
    assert doc["device"] == {"pools": "cuda:0", "name": "NVIDIA H200"} and doc["machine"]["name"] == "nvidia-h200"
    assert doc["plan"]["transports"] == ["mooncake"] and doc["plan"]["pool"]["device"] == "cuda:0"
    assert [(r["transport"], r["device"], r["ok"]) for r in doc["results"]] == [("mooncake", "cuda:0", True)] * 2
    assert "pools on cuda:0" in doc["bench"]


def test_a_run_killed_after_the_first_pair_keeps_its_row(tmp_path, monkeypatch):
    calls = []

    def fake_run_pair(plan, timeout, env, workdir=None):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # the step's timeout
        return _fake_result(plan)

    monkeypatch.setattr(pd_path, "run_pair", fake_run_pair)
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        pd_path.main(["--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["transport"] for r in doc["results"]] == ["tcp"] and doc["device"] == {"pools": "cpu"}


def test_a_failed_pair_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(pd_path, "run_pair", lambda plan, timeout, env, workdir=None: {
        "workdir": "/w", "returncodes": {"prefill": 1, "decode": 1}, "prefill": None, "decode": None})
    monkeypatch.setattr(pd_path, "device_info", lambda d: {"pools": d})
    out = tmp_path / "r.json"
    assert pd_path.main(["--device", "cuda:0", "--out", str(out)]) == 1
    assert [r["ok"] for r in json.loads(out.read_text())["results"]] == [False, False]
