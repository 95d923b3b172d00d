"""The engine's own pipeline (PairSender -> PairReceiver, fused copier, staging pool) over NCCL between two
GPUs, one process per GPU: every destination page byte-exact and no other page touched, for the MLA and MHA
layouts, page sizes 1/16/64, with chunks that fit one small staging slot, with one chunk per request and with
chunks that ramp up from a short first one to whole slots, each chunk's destinations taken from one upload of its
room's published ids."""

import pytest
import torch

from bench.transfer.engine_pair import Case, run_cases

pytestmark = [
    pytest.mark.gpu,
    # one GPU is enough: both ranks then share it and NCCL moves bytes over loopback (bench/transfer/pair.py)
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_pages_land_byte_exact_through_the_engine_pipeline():
    cases = [
        Case(layout, page_size, tokens, reps=1, slot_mb=slot_mb, first_mb=first_mb)
        for layout in ("mla", "mha")
        for page_size in (1, 16, 64)
        # 1 MiB slots: many chunks; 256 MiB: one chunk; 64 MiB: the ramp (SGLANG_P2P_FIRST_CHUNK_MB=32) to whole slots
        for tokens, slot_mb, first_mb in ((700, 1, 0), (2048, 256, 0), (2048, 64, 32))
    ]
    _, verdicts = run_cases(cases)
    for case, v in zip(cases, verdicts):
        # the decode checks every chunk against its room's published pages and scatters it from a slice of the
        # room's ids uploaded once (its KV ids are a run of the published list): one upload a room
        assert v == {"bad_pages": 0, "errors": [], "rooms": 2, "room_uploads": 2}, (case, v)
