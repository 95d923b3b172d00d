"""bench/transfer/page_kernel_sweep.py's pure parts: the launch combinations, the cases, the pick of the fastest
right variant and the table (the timing itself needs CUDA: without it the script measures nothing and says so)."""

from __future__ import annotations

import pytest
import torch

from bench.transfer import page_kernel_sweep as sweep


def test_every_variant_gives_each_thread_at_least_one_16_byte_vector_a_step():
    vs = sweep.variants()
    assert vs and all(v.block * 8 >= v.warps * 32 * 16 for v in vs)
    assert len({v.name for v in vs}) == len(vs)
    # 1024 words over 16 warps is exactly one vector a thread; 512 words over 16 warps would be half of one
    assert sweep.Variant(1024, 16, 1) in vs
    assert sweep.variants(blocks=(512,), warps=(16,), per_sm=(1,)) == []


def _row(variant: str, us: float, bad: bool = False) -> dict:
    """One timed row of case `c` into the prefill's own GPU, as `run` records it."""
    return {"target": "same", "case": "c", "variant": variant, "us": us, "bad": bad}


def test_the_cases_cover_both_destinations_of_each_shape_and_size():
    names = [c.name for c in sweep.sweep_cases()]
    assert "mha_p16_16384_scattered" in names and "mla_p64_4096_contiguous" in names
    assert len(names) == 2 * len(sweep.SWEEP_CASES) == len(set(names))


def test_best_skips_a_faster_variant_that_copied_wrong_bytes():
    rows = [_row("ref", 100.0),
            _row("default", 130.0),
            _row("b1024w4x1", 90.0, bad=True),
            _row("b2048w8x2", 120.0),
            _row("b4096w8x2", 125.0)]
    b = sweep.best(rows)["same:c"]
    assert (b["ref_us"], b["default"]["us"], b["best"]["variant"]) == (100.0, 130.0, "b2048w8x2")
    text = sweep.report({"best": sweep.best(rows), "rows": rows, "skipped": []})
    assert "b2048w8x2" in text and "wrong bytes: ['same:c:b1024w4x1']" in text


def test_without_cuda_it_measures_nothing_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sweep.main(["--out", str(tmp_path / "x.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not (tmp_path / "x.json").exists()


def test_the_report_shows_the_candidates_timed_and_an_unknown_one_is_refused(monkeypatch):
    rows = [_row("ref", 100.0),
            _row("default", 130.0),
            _row("ef_cs", 110.0)]
    header = sweep.report({"best": sweep.best(rows), "rows": rows, "skipped": []}).splitlines()[0]
    assert "ef_cs" in header and "blocks" not in header
    monkeypatch.setattr(sweep, "cuda_torch", lambda tool: torch)
    with pytest.raises(SystemExit, match="2"):
        sweep.main(["--candidates", "default,fastest"])


def test_a_candidate_timed_twice_keeps_its_faster_turn_and_a_wrong_one_is_still_named():
    """The rows added in session 43 (`units`, `flat`) go through the same pick: the faster of the two turns is
    shown, and a turn that copied wrong bytes is listed whatever its time."""
    rows = [_row("ref", 100.0),
            _row("units", 120.0),
            _row("units", 110.0),
            _row("flat", 104.0),
            _row("flat", 98.0, bad=True)]
    b = sweep.best(rows)["same:c"]
    assert b["units"]["us"] == 110.0 and b["flat"]["us"] == 98.0
    text = sweep.report({"best": sweep.best(rows), "rows": rows, "skipped": []})
    assert "units" in text.splitlines()[0] and "wrong bytes: ['same:c:flat']" in text
    assert {"unroll2", "units", "units_b4096w8", "flat"} <= set(sweep.CANDIDATES)
