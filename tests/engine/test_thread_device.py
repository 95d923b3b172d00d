"""Every transfer thread makes its rank's GPU its current device once, at its start: CUDA's current device is per
thread and a new thread's is device 0, so on a rank of GPU 1 the stream helpers took torch's slow path each chunk.
On CPU the device call is recorded instead of made."""

import threading

import pytest
import torch

from sglang_p2p_backend.engine import threads
from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.pair.pipeline import PairReceiver
from sglang_p2p_backend.engine.pair.staging import StagingPool
from sglang_p2p_backend.engine.transport.tcp import TcpTransport

from support.cpu_pools import pools


@pytest.mark.parametrize("device, calls", [(None, []), (torch.device("cpu"), []),
                                           (torch.device("cuda", 1), [torch.device("cuda", 1)])])
def test_only_a_cuda_device_is_made_current(monkeypatch, device, calls):
    made = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    threads.use_device(device)
    assert made == calls


def test_the_receivers_thread_makes_its_copiers_device_current_before_any_chunk(monkeypatch):
    seen = []
    monkeypatch.setattr(threads, "use_device", lambda d: seen.append((d, threading.current_thread().name)))
    _, views = pools()
    copier = PageCopier([views])
    assert copier.device == torch.device("cpu")  # the pools' device
    copier.device = torch.device("cuda", 1)  # as a decode rank of GPU 1 would have it
    transport = TcpTransport("127.0.0.1", io_timeout=5.0)
    receiver = PairReceiver(transport=transport, staging=StagingPool(transport.alloc_staging, 1024, 2),
                            copier=copier, peer_session="prefill:1", wanted=lambda room: False,
                            on_chunk=lambda room, rank, err: None, connect_timeout=5, io_timeout=5.0)
    try:
        done = threading.Event()
        receiver.submit(done.set)
        assert done.wait(5)
        assert seen == [(torch.device("cuda", 1), "p2p-recv-prefill:1")]
    finally:
        receiver.close()
        transport.close()


def test_a_device_that_cannot_be_used_is_logged_and_the_receiver_goes_on(monkeypatch, caplog):
    def refuse(device):
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(threads, "use_device", refuse)
    _, views = pools()
    transport = TcpTransport("127.0.0.1", io_timeout=5.0)
    receiver = PairReceiver(transport=transport, staging=StagingPool(transport.alloc_staging, 1024, 2),
                            copier=PageCopier([views]), peer_session="prefill:2", wanted=lambda room: False,
                            on_chunk=lambda room, rank, err: None, connect_timeout=5, io_timeout=5.0)
    try:
        done = threading.Event()
        receiver.submit(done.set)
        assert done.wait(5)
        assert any("thread p2p-recv-prefill:2 cannot use cpu (it goes on)" in r.getMessage() for r in caplog.records)
    finally:
        receiver.close()
        transport.close()


@pytest.mark.sglang
def test_every_thread_a_kv_manager_spawns_makes_the_ranks_device_current(monkeypatch):
    from sglang_p2p_backend.adapter.prefill import PrefillKVManager

    seen = []
    monkeypatch.setattr(threads, "use_device", lambda d: seen.append((d, threading.current_thread().name)))
    mgr = PrefillKVManager.__new__(PrefillKVManager)  # only what _spawn reads: no SGLang server behind it
    mgr._stop, mgr._threads, mgr.device = threading.Event(), [], torch.device("cuda", 3)
    steps = []

    def step():
        steps.append(threading.current_thread().name)
        mgr._stop.set()

    mgr._spawn(step, "p2p-transfer-0").join(5)
    assert seen == [(torch.device("cuda", 3), "p2p-transfer-0")] and steps == ["p2p-transfer-0"]
