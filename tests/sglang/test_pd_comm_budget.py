"""The pair-communicator budget through SGLang's classes: two prefill ranks (DP attention) feed one decode rank
whose budget holds a single pair channel. The decode answers the second prefill's offer with "no room" and asks
the idle one to release its channel; every room still lands byte for byte and the decode never holds more than
its budget. On CPU the pairs are the tcp transport's channels, costed with the measured NCCL table (the same
admission code runs on GPUs, where they are NCCL communicators)."""

import pytest

from sglang_p2p_backend.engine.pair.comm_pool import H200_COST
from sglang_p2p_backend.testing.launch import run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

BUDGET_MB = 45  # decode: one channel at cap 2 (39.8 MB), never two; prefill: one at cap 4 (37.7 MB)
ENV = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
    "SGLANG_P2P_NCCL_BUDGET_MB": str(BUDGET_MB),
    "SGLANG_P2P_TRANSPORT": "tcp",
}
ROOMS = list(range(3201, 3209))


def test_decode_budget_of_one_channel_serves_two_prefill_ranks_without_loss():
    plan = {
        "pool": {"layout": "mla", "num_layers": 3, "page_size": 4, "num_pages": 512},
        "tp": {"prefill": 2, "decode": 1},
        "attn_dp": {"prefill": 2},
        "requests": [{"room": r, "tokens": 120, "chunk_pages": 6} for r in ROOMS],
        "faults": {"prefill": {"chunk_delay_s": 0.02}},
        "deadline_s": 60,
    }
    result = run_pair(plan, env=ENV, timeout=90)
    d = result["decode"]
    assert d is not None and all(p is not None for p in result["ranks"]["prefill"]), result["workdir"]
    for room in ROOMS:
        r = d["requests"][str(room)]
        assert r["status"] == "Success" and r["num_bad_pages"] == 0 and r["aux_room_ok"], (room, r)
    assert d["untouched_violations"] == []

    dl = d["leftovers"]
    assert dl["comm_peak_mb"] <= BUDGET_MB, dl
    assert dl["comm_peak_mb"] == pytest.approx(H200_COST["decode"].mb_of(2)), dl  # one channel, at the lean cap
    assert dl["comm_stats"].get("no_room", 0) >= 1, dl  # the second prefill rank was turned away at least once
    released = sum(p["leftovers"]["comm_stats"].get("released", 0) for p in result["ranks"]["prefill"])
    assert released >= 1, [p["leftovers"] for p in result["ranks"]["prefill"]]
    for p in result["ranks"]["prefill"]:
        pl = p["leftovers"]
        assert pl["comm_peak_mb"] <= BUDGET_MB and pl["request_status"] == [] and pl["staging_in_use"] == 0, pl
        assert set(r["status"] for r in p["requests"].values()) == {"Success"}
        assert p["threads_left"] == []
