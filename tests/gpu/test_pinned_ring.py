"""Page-id uploads through the pinned ring: each upload's own ids arrive; a slot whose copy still waits behind
other work on the stream is not written again (the upload takes torch's allocator instead, without waiting)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from sglang_p2p_backend.engine.copy.pinned_ring import PinnedRing  # noqa: E402


def test_a_slot_is_not_rewritten_before_its_queued_copy_has_read_it():
    """Two slots, seven uploads queued behind ~25 ms of GPU work: the first two take the slots, the other five find
    the next slot's copy still queued and go through torch's allocator; none waits, each gets its own ids."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ring = PinnedRing(dev, slots=2, slot_items=64)
    stream = torch.cuda.Stream(dev)
    arrays = [np.arange(k * 100, k * 100 + 50, dtype=np.int32) for k in range(7)]  # int32 in: int64 out
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time queued ahead of every copy
        got = [ring.upload(a) for a in arrays]  # seven uploads through two slots
    stream.synchronize()
    for a, t in zip(arrays, got):
        assert t.dtype == torch.int64 and t.device == dev
        assert np.array_equal(t.cpu().numpy(), a.astype(np.int64))
    assert ring.fallbacks == 5
    torch.cuda.synchronize()
    again = ring.upload(arrays[0])  # the slots' copies are done: the ring takes the next upload
    assert ring.fallbacks == 5 and np.array_equal(again.cpu().numpy(), arrays[0].astype(np.int64))


def test_ids_larger_than_a_slot_and_empty_ids_still_arrive():
    dev = torch.device("cuda", torch.cuda.current_device())
    ring = PinnedRing(dev, slots=2, slot_items=8)
    big = np.arange(1000, 1100, dtype=np.int64)
    t = ring.upload(big)
    empty = ring.upload(np.zeros(0, dtype=np.int64))
    torch.cuda.synchronize()
    assert np.array_equal(t.cpu().numpy(), big) and ring.fallbacks == 1
    assert empty.numel() == 0 and empty.device == dev


def test_a_ring_without_slots_is_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        PinnedRing(torch.device("cuda", 0), slots=0)
