"""The thread-safe front of the communicator pool: victims closed under the lock, busy channels kept, the
settings read from the environment (by EngineConfig) with clear errors."""

import threading

import pytest

from sglang_p2p_backend.engine.config import EngineConfig, parse_caps
from sglang_p2p_backend.engine.pair.comm_budget import CommBudget, NoRoom, cap_from_wire, cap_to_wire
from sglang_p2p_backend.engine.pair.comm_pool import H200_COST, H200_COST_NO_CUMEM, CommPool


def budget(mb, closed):
    return CommBudget(CommPool(mb, ladder=(16, 8, 4, 2), cost=H200_COST["prefill"]), closed.append)


def test_victims_are_closed_before_admit_returns_and_busy_channels_are_kept():
    closed = []
    b = budget(300, closed)  # two at cap 16 (138 MB each)
    for peer in "ab":
        b.admit(peer)
        b.opened(peer, 16)
    with b.using("a") as live:
        assert live
        d = b.admit("c")  # three peers: cap 8 is fair; only idle "b" may go
        assert d.cap == 8 and closed == ["b"]
    assert b.stats["evicted"] == 1 and b.peak_mb <= 300


def test_release_request_closes_only_idle_channels():
    closed = []
    b = budget(1000, closed)
    b.admit("a")
    assert not b.close_if_idle("a")  # still opening
    b.opened("a", 16)
    with b.using("a"):
        assert not b.close_if_idle("a")  # carrying a transfer
    assert b.close_if_idle("a") and closed == ["a"]
    with b.using("a") as live:
        assert not live  # the owner sees it is gone and opens a new one


def test_no_room_names_the_budget():
    b = budget(30, [])  # not even cap 2 (23 MB) twice
    b.admit("a")
    b.opened("a", 2)
    with b.using("a"):
        with pytest.raises(NoRoom, match="does not fit"):
            b.admit("b")
    assert b.stats["no_room"] == 1


def test_cap_below_the_ladder_is_no_room_not_a_crash():
    b = CommBudget(CommPool(1000, ladder=(16, 8), cost=H200_COST["decode"]))
    with pytest.raises(NoRoom, match="<= the peer's cap 4"):
        b.admit("p", max_cap=4, evict=False)


def test_concurrent_admissions_stay_within_budget():
    b = budget(500, [])
    errors = []

    def worker(i):
        for j in range(50):
            peer = f"{i}-{j % 5}"
            try:
                b.admit(peer)
                b.opened(peer, -1)
            except NoRoom:
                pass
            except Exception as e:  # noqa: BLE001 - any other error fails the test
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and b.used_mb() <= 500 and b.peak_mb <= 500


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_P2P_NCCL_BUDGET_MB", "512")
    monkeypatch.setenv("SGLANG_P2P_NCCL_CAPS", "default, 8")
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    b = CommBudget.from_config(EngineConfig.from_env(), "decode")
    assert b.pool.budget_mb == 512 and b.pool.ladder == (None, 8) and b.pool.cost is H200_COST_NO_CUMEM["decode"]
    monkeypatch.setenv("SGLANG_P2P_NCCL_CAPS", "16,fast")
    with pytest.raises(ValueError, match="SGLANG_P2P_NCCL_CAPS='16,fast'"):
        CommBudget.from_config(EngineConfig.from_env(), "decode")
    monkeypatch.setenv("SGLANG_P2P_NCCL_CAPS", "")
    monkeypatch.setenv("SGLANG_P2P_NCCL_BUDGET_MB", "lots")
    with pytest.raises(ValueError, match="SGLANG_P2P_NCCL_BUDGET_MB='lots'"):
        CommBudget.from_config(EngineConfig.from_env(), "prefill")
    assert parse_caps(None) == (16, 8, 4, 2)
    assert [cap_from_wire(cap_to_wire(c)) for c in (None, 2, 16)] == [None, 2, 16]
