"""The same-host route tally: chunks and bytes per route, one summary line per interval."""

from sglang_p2p_backend.engine.copy.ce_plan import COPY_ENGINE, KERNEL
from sglang_p2p_backend.engine.transport.route_tally import RouteTally


def test_a_summary_comes_once_an_interval_and_counts_every_chunk_before_it():
    now = [100.0]
    t = RouteTally("p2pnccl: same-host chunks on the", every_s=30.0, clock=lambda: now[0])
    assert t.add(KERNEL, 1 << 30) is None
    now[0] = 110.0
    assert t.add(COPY_ENGINE, 3 << 29) is None
    now[0] = 130.0  # 30 s after the tally began: due
    assert t.add(KERNEL, 1 << 29) == ("p2pnccl: same-host chunks on the routes so far: copy engines 1 chunks "
                                      "(1.50 GiB), SM copy kernel 2 chunks (1.50 GiB)")
    now[0] = 159.0  # the next one 30 s after that line, not after the start
    assert t.add(KERNEL, 0) is None
    now[0] = 160.0
    assert t.add("other", 0).endswith("SM copy kernel 3 chunks (1.50 GiB), other 1 chunks (0.00 GiB)")


def test_the_kernel_summary_says_which_threshold_kept_its_chunks():
    now = [0.0]
    t = RouteTally("p", every_s=10.0, clock=lambda: now[0])
    t.add(KERNEL, 1 << 30, "for short spans")
    t.add(KERNEL, 1 << 30, "over the span cap")
    t.add(KERNEL, 1 << 30, "for short spans")
    t.add(KERNEL, 1 << 30)  # the kernel by the operator's choice: no reason
    now[0] = 10.0
    assert t.add(COPY_ENGINE, 1 << 30) == ("p routes so far: copy engines 1 chunks (1.00 GiB), SM copy kernel 4 chunks "
                                           "(4.00 GiB; 2 for short spans; 1 over the span cap)")


def test_the_counts_so_far_are_there_between_summaries():
    t = RouteTally("p", every_s=1e9, clock=lambda: 0.0)
    assert t.counts() == {}
    t.add(COPY_ENGINE, 100)
    t.add(KERNEL, 7, "alone on the GPU")
    t.add(KERNEL, 5)
    assert t.counts() == {COPY_ENGINE: {"chunks": 1, "bytes": 100, "why": {}},
                          KERNEL: {"chunks": 2, "bytes": 12, "why": {"alone on the GPU": 1}}}
