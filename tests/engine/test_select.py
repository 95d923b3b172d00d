"""The `auto` transport policy (`engine/transport/select.py`): the decision table, forcing, logging once per
peer, and a planning check at DeepSeek's 96P x 144D scale that communicator GPU memory stays within budget."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.transport.select import (
    ENV_VAR,
    Choice,
    PeerFacts,
    ProcessTransports,
    TransportSelector,
    choose_transport,
    parse_forced,
    process_transports,
    rdma_devices,
    rdma_present,
)

GPU_FACTS = dict(gpu=True, mooncake_available=True)


def never_asked() -> bool:
    raise AssertionError("the pool was asked although the answer could not matter")


@pytest.mark.parametrize(
    "same_host, rdma, fits, want",
    [
        (False, True, never_asked, ("mooncake", "rdma")),  # across nodes with NICs: no communicator at all
        (True, True, True, ("nccl", None)),  # same host, pool has room: NVLink via NCCL
        (True, True, False, ("mooncake", "rdma")),  # pool at budget: spill to RDMA
        (False, False, True, ("nccl", None)),  # across nodes, no NICs Mooncake could use: NCCL
        (True, False, False, ("nccl", None)),  # nowhere to spill: NCCL once the pool makes room
    ],
)
def test_auto_decision_table(same_host, rdma, fits, want) -> None:
    c = choose_transport(None, PeerFacts(same_host=same_host, rdma_present=rdma, nccl_fits=fits, **GPU_FACTS))
    assert (c.transport, c.protocol) == want
    assert c.reason and "\n" not in c.reason


def test_auto_reasons_name_the_cause() -> None:
    full = PeerFacts(same_host=True, rdma_present=False, nccl_fits=False)
    assert "no RDMA devices" in choose_transport("auto", full).reason
    assert "once the pool makes room" in choose_transport("auto", full).reason
    no_mc = PeerFacts(same_host=False, rdma_present=True, nccl_fits=False, mooncake_available=False)
    c = choose_transport("", no_mc)
    assert c.transport == "nccl" and "Mooncake not installed" in c.reason


def test_without_gpu_auto_is_cpu_tcp() -> None:
    c = choose_transport(None, PeerFacts(same_host=True, rdma_present=True, nccl_fits=never_asked, gpu=False))
    assert c == Choice("tcp", None, c.reason) and "no CUDA" in c.reason


@pytest.mark.parametrize("forced", ["nccl", "mooncake", "cudaipc", "tcp", " Mooncake "])
def test_forced_value_wins(forced: str) -> None:
    facts = PeerFacts(same_host=False, rdma_present=True, nccl_fits=never_asked)
    c = choose_transport(forced, facts)
    assert c.transport == forced.strip().lower()
    assert f"{ENV_VAR}={c.transport}" in c.reason


def test_forced_mooncake_uses_rdma_only_where_there_are_devices() -> None:
    assert choose_transport("mooncake", PeerFacts(False, True, False)).protocol == "rdma"
    assert choose_transport("mooncake", PeerFacts(False, False, False)).protocol == "tcp"


def test_typo_in_forced_value_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_forced("AUTO") is None and parse_forced(None) is None
    monkeypatch.setenv(ENV_VAR, "mooncak")
    with pytest.raises(ValueError, match=f"{ENV_VAR}='mooncak' is not one of"):
        EngineConfig.from_env()
    with pytest.raises(ValueError, match=f"{ENV_VAR}='mooncak' is not one of"):
        TransportSelector("mooncak")


def test_choice_logged_once_per_peer_and_again_when_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    sel = TransportSelector(forced="auto")
    room = PeerFacts(same_host=True, rdma_present=True, nccl_fits=True)
    full = PeerFacts(same_host=True, rdma_present=True, nccl_fits=False)
    with caplog.at_level(logging.INFO, logger="sglang_p2p_backend.engine.transport.select"):
        for _ in range(3):
            sel.choose("d0", room)
        sel.choose("d1", room)
        sel.choose("d0", full)  # changed: logged again
        sel.choose("d0", full)
        sel.forget("d1")
        sel.choose("d1", room)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert lines[0].startswith("transport for peer d0: nccl:")
    assert lines[2].startswith("transport for peer d0: mooncake (rdma):")


def test_rdma_devices_reads_sysfs(tmp_path: Path) -> None:
    assert rdma_devices(str(tmp_path / "absent")) == []
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    assert rdma_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1"]


@pytest.mark.parametrize(
    "forced, gpu, rdma, mooncake, want",
    [
        (None, False, False, True, ProcessTransports("tcp", None)),  # CPU CI: auto stays on tcp
        (None, False, True, True, ProcessTransports("tcp", None)),  # no GPU: no Mooncake engine in auto
        (None, True, False, True, ProcessTransports("nccl", None, ipc=True)),  # no NICs: nothing to spill to
        (None, True, True, False, ProcessTransports("nccl", None, ipc=True)),  # NICs but Mooncake not installed
        (None, True, True, True, ProcessTransports("nccl", "rdma", ipc=True)),  # all three, chosen per peer
        ("mooncake", False, False, True, ProcessTransports(None, "tcp")),  # forced: no staging, no NCCL
        ("mooncake", True, True, True, ProcessTransports(None, "rdma")),
        ("tcp", True, True, True, ProcessTransports("tcp", None)),
        ("nccl", True, True, True, ProcessTransports("nccl", None)),  # forced nccl: no IPC export either
        ("cudaipc", True, True, True, ProcessTransports(None, None, ipc=True)),  # forced: no staging, no NCCL
    ],
)
def test_process_starts_only_the_transports_it_can_use(forced, gpu, rdma, mooncake, want) -> None:
    got = process_transports(forced, gpu=gpu, rdma_present=rdma, mooncake_available=mooncake)
    assert got == want
    assert got.names() == [n for n in ("cudaipc" if want.ipc else None, want.two_sided,
                                       "mooncake" if want.mooncake else None) if n]


def test_forced_cudaipc_without_a_gpu_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="cudaipc needs the KV cache on a CUDA device"):
        process_transports("cudaipc", gpu=False, rdma_present=False, mooncake_available=False)



@pytest.mark.parametrize(
    "same_host, offers, mappable, want",
    [
        (True, ("cudaipc", "nccl"), True, "cudaipc"),  # same host, exported, mappable: the copy kernel
        (True, ("cudaipc", "nccl"), False, "nccl"),  # exported but not mappable here (GPU not visible, VMM pool)
        (True, ("nccl",), True, "nccl"),  # the decode exported nothing: it did not offer cudaipc
        (False, ("cudaipc", "nccl", "mooncake"), True, "mooncake"),  # another host: never IPC, RDMA first
    ],
)
def test_auto_prefers_cuda_ipc_for_same_host_mappable_peers(same_host, offers, mappable, want) -> None:
    asked = []

    def ipc() -> bool:
        asked.append(True)
        return mappable

    facts = PeerFacts(same_host=same_host, rdma_present=True, nccl_fits=True, peer_offers=offers, ipc=ipc)
    assert choose_transport(None, facts).transport == want
    assert bool(asked) == (same_host and "cudaipc" in offers)  # mapping is only probed where it can matter


def test_forced_cudaipc_is_chosen_whatever_the_facts() -> None:
    facts = PeerFacts(same_host=False, rdma_present=True, nccl_fits=True, peer_offers=("cudaipc",), ipc=False)
    c = choose_transport("cudaipc", facts)
    assert (c.transport, c.reason) == ("cudaipc", "forced by SGLANG_P2P_TRANSPORT=cudaipc")


def test_peer_that_receives_only_with_mooncake_gets_mooncake() -> None:
    """A decode forced to mooncake offers only that; an auto prefill with a Mooncake engine follows it."""
    facts = PeerFacts(same_host=True, rdma_present=True, nccl_fits=never_asked, peer_offers=("mooncake",))
    c = choose_transport(None, facts)
    assert (c.transport, c.protocol) == ("mooncake", "rdma") and "only with Mooncake" in c.reason
    cpu = PeerFacts(same_host=True, rdma_present=False, nccl_fits=never_asked, gpu=False, peer_offers=("mooncake",))
    assert (choose_transport("auto", cpu).transport, choose_transport("auto", cpu).protocol) == ("mooncake", "tcp")


def test_peer_without_mooncake_is_never_sent_there() -> None:
    """Across hosts with NICs, but the decode runs no Mooncake engine: NCCL, not a write it cannot take."""
    facts = PeerFacts(same_host=False, rdma_present=True, nccl_fits=False, peer_offers=("nccl",))
    assert choose_transport(None, facts).transport == "nccl"


def test_mc_force_tcp_hides_rdma_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    force_tcp = EngineConfig.from_env().mooncake_force_tcp
    assert rdma_present(str(tmp_path), force_tcp=force_tcp) and not rdma_present(str(tmp_path / "absent"))
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert not rdma_present(str(tmp_path), force_tcp=EngineConfig.from_env().mooncake_force_tcp)


# ----------------------------------------------------------------------- planning at 96P x 144D scale

MB = 1 << 20


@dataclass
class CommPool:
    """Stand-in for one GPU's NCCL communicator pool: a GPU-memory budget and a fixed cost per communicator
    (38 MB: a 4-channel 2-rank communicator on H200, docs/nccl.md). Only the admission rule matters here."""

    budget: int
    per_comm: int = 38 * MB
    live: list = field(default_factory=list)

    def admits(self) -> bool:
        return (len(self.live) + 1) * self.per_comm <= self.budget

    def add(self, peer) -> None:
        if not self.admits():  # the pool's LRU eviction keeps it within budget whatever the policy says
            self.live.pop(0)
        self.live.append(peer)

    @property
    def used(self) -> int:
        return len(self.live) * self.per_comm


def plan(n_p: int, n_d: int, node_of, rdma: bool, budget: int) -> tuple[Counter, dict, dict]:
    """Choose a transport for every (P rank, D rank) pair, P-major as prefill ranks meet decode ranks.

    A communicator lives on both GPUs of the pair, so NCCL needs room in both pools."""
    p_pools = {p: CommPool(budget) for p in range(n_p)}
    d_pools = {d: CommPool(budget) for d in range(n_d)}
    sel = TransportSelector(forced="auto", log=logging.getLogger("plan"))
    counts: Counter = Counter()
    for p in range(n_p):
        for d in range(n_d):
            pp, dp = p_pools[p], d_pools[d]
            facts = PeerFacts(
                same_host=node_of("P", p) == node_of("D", d),
                rdma_present=rdma,
                nccl_fits=lambda: pp.admits() and dp.admits(),
            )
            c = sel.choose((p, d), facts)
            counts[c.transport] += 1
            if c.transport == "nccl":
                pp.add(d)
                dp.add(p)
    return counts, p_pools, d_pools


def separate_nodes(role: str, rank: int) -> str:
    """96P144D as deployed: prefill and decode groups on their own 8-GPU nodes."""
    return f"{role}{rank // 8}"


def test_96p144d_with_rdma_uses_no_communicator_memory() -> None:
    counts, p_pools, d_pools = plan(96, 144, separate_nodes, rdma=True, budget=4096 * MB)
    assert counts == Counter(mooncake=96 * 144)
    assert all(pool.used == 0 for pool in [*p_pools.values(), *d_pools.values()])


def test_96p144d_without_rdma_stays_within_budget() -> None:
    """No NICs Mooncake could use: NCCL everywhere, the pool bounding what lives at once."""
    budget = 2048 * MB
    counts, p_pools, d_pools = plan(96, 144, separate_nodes, rdma=False, budget=budget)
    assert counts == Counter(nccl=96 * 144)
    assert max(pool.used for pool in [*p_pools.values(), *d_pools.values()]) <= budget
    # what it would cost unbounded: every P GPU 144 communicators, every D GPU 96
    assert 144 * 38 * MB > budget


def test_same_host_pairs_spill_to_rdma_once_the_pool_is_full() -> None:
    """One 8-GPU host, 4P4D, room for 2 communicators per GPU: 8 pairs on NCCL, the other 8 on Mooncake."""
    counts, p_pools, d_pools = plan(4, 4, lambda role, rank: "host0", rdma=True, budget=2 * 38 * MB)
    assert counts == Counter(nccl=8, mooncake=8)
    assert all(len(pool.live) == 2 for pool in [*p_pools.values(), *d_pools.values()])
