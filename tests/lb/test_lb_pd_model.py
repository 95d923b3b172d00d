"""bench/lb_sim/pd_model.py, the discrete-event model that replays lb_compare's workloads through the LB's policy
objects: deterministic, and the routing it shows is the policies' own (which prefill holds which prefix)."""

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "lb_sim" / "pd_model.py"


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.spec_from_file_location("pd_model", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pd_model"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_model_replays_shared_prefix_through_the_policies(model):
    reqs = model.workload("shared_prefix", 0, 5.0)
    hw = model.Hw(send_gbps=50)
    runs = {name: model.run(name, reqs, hw, 3, 1) for name in ("ours:prefix_aware", "ours:prefix_aware:c0.25", "random")}
    assert model.run("ours:prefix_aware", reqs, hw, 3, 1) == runs["ours:prefix_aware"]  # deterministic
    for r in runs.values():
        assert r["requests"] == len(reqs) and sum(r["request_share"]) == pytest.approx(1.0, abs=0.01)
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
    # the six 4k prefixes fit every prefill's cache: random still hits on the prefixes, prefix affinity adds the
    # conversations' own turns (the GPU runs: 0.933-0.935 and 0.955-0.961)
    assert 0.90 < runs["random"]["hit_rate"] < runs["ours:prefix_aware"]["hit_rate"]
    # with no cost for a hit, the prefixes stay where their first request went, so one prefill can take the two
    # most requested (0.41 + 0.20 of the requests); a cached-token cost spreads the hot ones over all three
    assert runs["ours:prefix_aware:c0.25"]["prefill_request_share_max"] < runs["ours:prefix_aware"]["prefill_request_share_max"]
