"""The engine's own pipeline (PairSender -> PairReceiver, fused copier, staging pool) over NCCL between two
GPUs, one process per GPU: every destination page byte-exact and no other page touched, for the MLA and MHA
layouts, page sizes 1/16/64, with chunks that fit one small staging slot, with one chunk per request and with
chunks that ramp up from a short first one to whole slots, each chunk's destinations taken from one upload of its
room's published ids; the same with each chunk's scatter queued on the GPU behind its receive
(SGLANG_P2P_DEVICE_SCATTER), and a receive that never completes under such a scatter."""

import pytest
import torch

from bench.transfer.engine_pair import Case, run_cases

pytestmark = [
    pytest.mark.gpu,
    # one GPU is enough: both ranks then share it and NCCL moves bytes over loopback (bench/transfer/pair.py)
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


CASES = [
    Case(layout, page_size, tokens, reps=1, slot_mb=slot_mb, first_mb=first_mb)
    for layout in ("mla", "mha")
    for page_size in (1, 16, 64)
    # 1 MiB slots: many chunks; 256 MiB: one chunk; 64 MiB: the ramp (SGLANG_P2P_FIRST_CHUNK_MB=32) to whole slots
    for tokens, slot_mb, first_mb in ((700, 1, 0), (2048, 256, 0), (2048, 64, 32))
]


def _landed(v: dict) -> dict:
    return {k: v[k] for k in ("bad_pages", "errors", "rooms", "room_uploads", "slots_in_use")}


@pytest.mark.parametrize("device_scatter", ["0", "1"])
def test_pages_land_byte_exact_through_the_engine_pipeline(monkeypatch, device_scatter):
    monkeypatch.setenv("SGLANG_P2P_DEVICE_SCATTER", device_scatter)  # both ranks are spawned with it
    _, verdicts = run_cases(CASES)
    for case, v in zip(CASES, verdicts):
        # the decode checks every chunk against its room's published pages and scatters it from a slice of the
        # room's ids uploaded once (its KV ids are a run of the published list): one upload a room
        assert _landed(v) == {"bad_pages": 0, "errors": [], "rooms": 2, "room_uploads": 2, "slots_in_use": 0}, (case, v)
        assert v["queued"] == v["ended"], (case, v)  # every scatter queued on the GPU was seen to end
        if device_scatter == "0":
            assert v["queued"] == 0, (case, v)
        elif case.slot_mb == 1:  # many chunks, overlapped: their scatters went on the GPU behind the receives
            assert v["queued"] > 0, (case, v)


def test_a_receive_that_never_completes_under_a_queued_scatter_fails_only_its_room(monkeypatch):
    """The prefill stops sending after a chunk's header: the decode posted its receive and queued its scatter
    behind it. The receive fails at its deadline, the channel is aborted, the scatter runs on whatever reached the
    slot (its room's pages only), and it is told ended once the channel's work settled; every slot comes back."""
    monkeypatch.setenv("SGLANG_P2P_DEVICE_SCATTER", "1")
    case = Case("mla", 16, 700, reps=1, slot_mb=1, fail_send_at=3)
    _, (v,) = run_cases([case], io_timeout=5.0)
    assert v["errors"] and all("broke" in e for e in v["errors"]), v
    assert v["bad_others"] == 0, v  # no page outside the room's destinations changed
    assert v["queued"] > 0 and v["queued"] == v["ended"] and v["slots_in_use"] == 0, v
