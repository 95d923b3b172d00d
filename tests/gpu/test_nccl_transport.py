"""The nccl transport with the fused gather/scatter on two GPUs (one process each): byte-exact transfers of
MLA and MHA pools at page sizes 1, 16 and 64, chunked and not, and a peer killed mid-transfer."""

from __future__ import annotations

import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    # one GPU is enough: both ranks then share it and NCCL moves bytes over loopback (bench/transfer/pair.py)
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from bench.transfer.pair import collect, run_pair, spawn  # noqa: E402

import nccl_pair_workers as workers  # noqa: E402

CASES = [(lay, ps, chunked, 16) for lay in ("mla", "mha") for ps in (1, 16, 64) for chunked in (False, True)]
CASES += [("mla", 16, True, 2), ("mha", 64, True, 4), ("mha", 16, False, None)]  # lean and default communicators


@pytest.fixture(scope="module")
def transfers():
    """All cases in one pair of processes (CUDA and NCCL start once); the decode's verdict per case."""
    return run_pair(workers.transfer_cases, (CASES,), timeout=280)[1]


@pytest.mark.parametrize("layout, page_size, chunked, cap", CASES)
def test_pages_arrive_byte_exact(transfers, layout, page_size, chunked, cap):
    v = transfers[(layout, page_size, chunked, cap)]
    assert v["equal"], f"pages differ at destination page ids {v['bad_pages']}"
    assert v["chunks"] >= 3 if chunked else v["chunks"] == 1


FAIL_TIMEOUT = 3.0


@pytest.mark.parametrize("cumem", ["1", "0"], ids=["cumem", "legacy-ipc"])
@pytest.mark.parametrize("dies", ["decode", "prefill"])
def test_peer_killed_mid_transfer_fails_in_time_then_a_new_communicator_works(dies, cumem):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    v_end, s_end = ctx.Pipe()  # victim <-> survivor
    n_end, r_end = ctx.Pipe()  # survivor <-> replacement of the victim
    survivor_rank = 1 if dies == "prefill" else 0
    victim_rank = 1 - survivor_rank
    env = {"NCCL_CUMEM_ENABLE": cumem}
    procs = [
        spawn(workers.survivor, survivor_rank, survivor_rank, s_end, results, (n_end, FAIL_TIMEOUT), env, 80),
        spawn(workers.victim, victim_rank, victim_rank, v_end, results, (), env),
        spawn(workers.replacement, victim_rank, victim_rank, r_end, results, (), env, 80),
    ]
    # the victim never reports (it is killed); the replacement reports as the victim's rank: collect both
    # through the survivor's report, which carries the replacement's verdict too
    out = collect(procs, results, (survivor_rank, victim_rank), timeout=90)
    s = out[survivor_rank]
    print(f"REPORT peer-death dies={dies} cumem={cumem} split={s['split']}: failed after {s['failed_after_s']:.2f}s "
          f"({s['error']}); next transfer {s['next']}; free memory delta {s['free_delta_mb']:.0f} MB")
    assert s["error"] is not None, "the survivor's wait did not fail"
    assert s["failed_after_s"] < FAIL_TIMEOUT + 5.0
    assert s["aborted"] and s["later_ops_fail"]
    assert s["next"]["equal"], s["next"]


def test_waits_sleep_until_the_pace_the_link_showed():
    """The pair's first operation is connect()'s one-byte probe (it also connects, so it teaches nothing); after
    three transfers that teach the rate, each one carries when it should end, from the fastest rate the pair has
    shown; the waiter sees it done soon after (not up to a 0.5 ms poll late, nor asleep long past it) and the
    bytes are right."""
    for side in run_pair(workers.paced_ops, (), timeout=120):
        # the probe connected (untimed); ops 0-2 teach the rate (3 samples); from op 3 on each carries its end
        assert side["expected"] == [False] * 3 + [True] * (workers.PACE_OPS - 3)
        assert side["rate"] is not None
        assert all(-1.0 < late < 0.05 for late in side["late_s"]), side["late_s"]
        assert side["equal"]


def test_posts_are_ordered_after_the_callers_stream():
    """A send carries the bytes its caller's stream wrote last, a receive lands after its caller's stream has
    cleared the buffer, each behind ~20 ms of GPU sleep on that stream; a post from the channel's own stream
    (nothing to order) lands too."""
    decode = run_pair(workers.ordered_posts, (), timeout=120)[1]
    assert decode["got"] == [[i + 1] for i in range(workers.ORDER_ROUNDS + 1)], decode["got"]
