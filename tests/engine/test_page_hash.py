"""The exact page hash (engine/copy/page_hash.py) the transfer benchmark and the test-only KV digest share:
the reference is exact and wraps, the torch version equals it, does not depend on how pages are batched, widens
narrow items, and a room's digest changes with any byte or the pages' order; a digest that cannot be computed
leaves the room alone (adapter/kv_digest.py)."""

import numpy as np
import torch

from sglang_p2p_backend.engine.copy import page_hash as ph


def regions(item=32, pages=9, count=3, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, 256, size=(pages, item), dtype=np.uint8)) for _ in range(count)]


def test_the_reference_hash_is_exact_and_wraps():
    assert ph.hash_weights(3, 0).tolist() == [1, 3, 5] and ph.hash_weights(3, 1).tolist() == [7, 9, 11]
    a = np.array([[1, 2, 3], [0, 0, 1]], dtype=np.int64)
    b = np.array([[1, 0, 0], [2, 0, 0]], dtype=np.int64)
    assert ph.page_hash([a, b]).tolist() == [1 + 6 + 15 + 7, 5 + 14]
    # wraps modulo 2**64 instead of failing: (2**63 - 1) * (1 + 3) = 2**65 - 4, which is -4 modulo 2**64
    big = np.full((1, 2), np.iinfo(np.int64).max, dtype=np.int64)
    assert ph.page_hash([big]).tolist() == [-4]


def test_pool_hash_matches_the_reference_in_any_batch_size():
    regs, ids = regions(), np.array([8, 0, 3, 3, 5])
    want = ph.page_hash([r.numpy()[ids].view(np.int64) for r in regs])
    assert ph.pool_hash(regs, ids).tolist() == want.tolist()
    assert ph.pool_hash(regs, ids, batch_bytes=1).tolist() == want.tolist()  # one page at a time
    assert ph.pool_hash(regs, np.zeros(0, dtype=np.int64)).tolist() == []


def test_items_that_are_not_whole_int64_words_are_widened():
    for item in (12, 6, 5):  # int32, int16 and byte words
        regs = regions(item=item)
        before = ph.room_digest(regs, np.arange(9))
        regs[2][4, item - 1] ^= 0x80
        assert ph.room_digest(regs, np.arange(9)) != before


def test_a_room_digest_sees_every_byte_and_the_page_order():
    regs = regions()
    ids = np.array([1, 4, 7])
    base = ph.room_digest(regs, ids)
    assert 0 <= base < 1 << 64 and base == ph.room_digest(regs, ids)
    assert ph.room_digest(regs, ids[::-1]) != base
    assert ph.room_digest(regs, ids[:2]) != base
    regs[0][7, 0] ^= 1
    assert ph.room_digest(regs, ids) != base


def test_a_digest_that_cannot_be_computed_is_logged_and_leaves_the_room_alone(monkeypatch, caplog):
    """The test-only room digest must never change a room's outcome: a failing hash (a CUDA error on the device,
    say) is logged as not computed, and the call returns None instead of raising into the Success path."""
    import torch

    from sglang_p2p_backend.adapter import kv_digest

    views = [torch.arange(64, dtype=torch.uint8).reshape(4, 16)]
    digest = kv_digest.KVDigest(kv_digest.DigestLabel("decode", 0, 0, 1, True, 1), views)
    assert digest.log_held(7, np.array([2, 0])) is not None  # the working path logs a value

    def broken(regions, ids):
        raise RuntimeError("CUDA error: peer access is already enabled\nmore lines")

    monkeypatch.setattr(kv_digest, "room_digest", broken)
    with caplog.at_level("ERROR", logger=kv_digest.__name__):
        assert digest.log_held(8, np.array([1])) is None
    assert "p2p kv digest decode room=8 not computed: RuntimeError: CUDA error: peer access is already enabled" in caplog.text
