"""bench/transfer/ce_lanes.py's pure parts: how spans are dealt over streams, the table with a wrong copy named,
and the clean skip without CUDA (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from bench.transfer import ce_lanes


def test_deal_covers_every_span_once_in_order_over_at_most_k_lanes():
    assert ce_lanes.deal(64, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert ce_lanes.deal(61, 4) == [(0, 15), (15, 30), (30, 45), (45, 61)]
    assert ce_lanes.deal(3, 8) == [(0, 1), (1, 2), (2, 3)]  # never an empty lane
    assert ce_lanes.deal(5, 0) == [(0, 5)]
    for n in range(1, 70):
        for k in (1, 2, 3, 4, 8):
            runs = ce_lanes.deal(n, k)
            assert runs[0][0] == 0 and runs[-1][1] == n and all(a < b for a, b in runs)
            assert all(x[1] == y[0] for x, y in zip(runs, runs[1:]))


def test_report_gives_each_method_its_ratio_to_the_copy_and_names_wrong_bytes():
    rows = [{"target": "same", "case": "c", "method": "copy", "gpu_us": 100.0, "wall_us": 110.0, "ok": True},
            {"target": "same", "case": "c", "method": "ce x4", "gpu_us": 125.0, "wall_us": 200.0, "ok": False}]
    text = ce_lanes.report({"rows": rows, "interference": [], "skipped": []})
    line = next(t for t in text.splitlines() if "ce x4" in t)
    assert line.split()[-3:] == ["0.80", "0.50", "BAD"]


def test_without_cuda_it_measures_nothing_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ce_lanes.main(["--out", str(tmp_path / "x.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not (tmp_path / "x.json").exists()


def test_interference_rows_name_their_target_and_an_unknown_target_is_refused(monkeypatch):
    rows = [{"target": "peer", "case": "c", "method": "copy", "gpu_us": 100.0, "wall_us": 110.0, "ok": True}]
    inter = [{"target": "peer", "method": "2d", "alone_ms": 10.0, "busy_ms": 11.0, "slowdown": 0.1, "writes": 9,
              "error": None}]
    text = ce_lanes.report({"rows": rows, "interference": inter, "skipped": []})
    assert "interference peer:" in text and "+10.0%" in text
    monkeypatch.setattr(ce_lanes, "cuda_torch", lambda tool: torch)
    with pytest.raises(SystemExit, match="2"):
        ce_lanes.main(["--targets", "peer,moon"])
