"""bench/transfer/ab.py: two trees' transfer benchmarks in turn, compared against their own spread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.transfer import ab


def _result(times: dict, extra: tuple = ()) -> dict:
    rows = [{"case": c, "overlap": True, "slot_mib": 128, "send_us": {"p50": p50, "min": mn}}
            for c, (p50, mn) in times.items()]
    return {"nccl": rows + list(extra)}


def test_the_comparison_is_round_by_round_over_the_common_cases_with_each_trees_own_spread():
    new = [_result({"a": (50, 40), "b": (200, 100), "only_new": (1, 1)}), _result({"a": (55, 40), "b": (220, 100)})]
    old = [_result({"a": (100, 80), "b": (400, 200)}), _result({"a": (100, 88), "b": (200, 200)})]
    cmp = ab.compare(new, old)
    assert set(cmp) == {"nccl"}  # no ipc rows in either: no ipc section
    p50 = cmp["nccl"]["p50"]
    assert p50["new_over_old"][0] == pytest.approx(0.5)  # both cases halved in round 1
    assert p50["new_over_old"][1] == pytest.approx((0.55 * 1.1) ** 0.5)
    assert p50["old_over_old"] == [pytest.approx(0.5 ** 0.5)]  # old's second run: a the same, b half
    assert p50["new_over_new"] == [pytest.approx(1.1)]
    assert set(p50["cases"]) == {"a/True/128", "b/True/128"}  # the case only one tree has is left out
    assert cmp["nccl"]["min"]["new_over_old"][0] == pytest.approx(0.5)
    text = ab.render(cmp)
    assert "== nccl p50: new/old by round 0.500 0.778" in text and "old/old 0.707" in text


def test_a_tree_without_the_benchmark_is_refused(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        ab.main(["--old", str(tmp_path), "--rounds", "1"])
    assert "holds no bench/transfer/xfer_bench.py" in capsys.readouterr().err


@pytest.mark.slow
def test_the_same_tree_twice_in_turn_compares_every_nccl_case(tmp_path: Path):
    """A/A on CPU (--quick: NCCL's place taken by the tcp channel): every case of both trees compared, two rounds."""
    repo = Path(ab.__file__).resolve().parents[2]
    out = tmp_path / "ab.json"
    assert ab.main(["--old", str(repo), "--rounds", "2", "--out", str(out), "--",
                    "--quick", "--sections", "nccl", "--case-s", "0.02", "--max-reps", "6"]) == 0
    saved = json.loads(out.read_text())
    assert len(saved["runs"]["new"]) == len(saved["runs"]["old"]) == 2
    p50 = saved["compare"]["nccl"]["p50"]
    assert len(p50["cases"]) == len(saved["runs"]["new"][0]["nccl"]) > 0
    assert all(x > 0 for x in p50["new_over_old"] + p50["old_over_old"] + p50["new_over_new"])


def test_a_variable_set_for_one_side_reaches_only_that_sides_runs(tmp_path: Path, monkeypatch, capsys):
    """One tree against itself under two settings: --new-env goes to the new side's runs, nowhere else."""
    repo = Path(ab.__file__).resolve().parents[2]
    seen = []

    def run_tree(tree, args, out, timeout, extra_env=None):
        seen.append(dict(extra_env or {}))
        return {"nccl": [{"case": "c", "overlap": True, "send_us": {"p50": 2.0 if extra_env else 4.0, "min": 1.0}}]}

    monkeypatch.setattr(ab, "run_tree", run_tree)
    out = tmp_path / "ab.json"
    assert ab.main(["--old", str(repo), "--new-env", "SGLANG_P2P_DEVICE_SCATTER=1", "--rounds", "2",
                    "--out", str(out)]) == 0
    assert seen == [{"SGLANG_P2P_DEVICE_SCATTER": "1"}, {}] * 2
    saved = json.loads(out.read_text())
    assert saved["env"] == {"new": {"SGLANG_P2P_DEVICE_SCATTER": "1"}, "old": {}}
    assert saved["compare"]["nccl"]["p50"]["new_over_old"] == [0.5, 0.5]
    with pytest.raises(SystemExit):
        ab.main(["--old", str(repo), "--old-env", "NOEQUALS"])
    assert "'NOEQUALS' is not KEY=VALUE" in capsys.readouterr().err
