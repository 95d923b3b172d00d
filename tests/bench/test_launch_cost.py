"""bench/transfer/launch_cost.py without CUDA (measures nothing, says so, exits 0) and its report."""

from __future__ import annotations

import torch

from bench.transfer import launch_cost


def test_without_cuda_it_measures_nothing_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch_cost.main(["--out", str(tmp_path / "x.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not (tmp_path / "x.json").exists()


def test_the_report_gives_each_levels_median_and_says_wrong_bytes():
    result = {"triton": "3.6.0", "direct_path": True, "launches": 10, "bytes_ok": False,
              "us": {"compiled": [10.0, 10.2, 10.5, 10.6, 11.0], "direct": [5.0, 5.1, 5.3, 5.4, 6.0]}}
    text = launch_cost.report(result)
    assert "compiled" in text and "10.50 us" in text and "5.30 us" in text and "WRONG" in text
