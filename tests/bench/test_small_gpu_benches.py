"""The small one-GPU benchmarks without CUDA: each measures nothing, says so, writes no file and exits 0
(bench/transfer/strided_allocations.py, nccl_post.py)."""

from __future__ import annotations

import pytest
import torch

from bench.transfer import nccl_post, strided_allocations


@pytest.mark.parametrize("bench", [strided_allocations, nccl_post], ids=["strided_allocations", "nccl_post"])
def test_without_cuda_it_measures_nothing_and_exits_0(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path / "x.json")]) == 0
    assert "no CUDA device, nothing measured" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()
