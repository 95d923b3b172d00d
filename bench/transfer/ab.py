"""Two code trees' transfer benchmarks in turn, and what their difference is against the runs' own spread.

On a shared GPU host the p50 of one `xfer_bench.py` case moves by ~10% between two runs of the same code (2 x H200,
2026-11-29: docs/nccl.md, session 28), so one run of each tree says nothing about a change of a few %. This runs
`xfer_bench.py` from the new tree and the old one in turn (new, old, new, old, ...), with the same arguments, and
compares the rows the two have in common: each case's new/old ratio round by round, their geometric mean over the
cases, and the same ratio between rounds of one tree (old/old, new/new) as the floor a difference must clear.

    python3 bench/transfer/ab.py --old /tmp/old [--new .] [--rounds 2] [--out PATH] -- --sections nccl --shapes mha_p1

`--old` / `--new` are checkouts holding `bench/transfer/xfer_bench.py` (e.g. `git archive HEAD | tar x -C /tmp/old`);
each run gets its tree first on PYTHONPATH, before what PYTHONPATH already holds (a bundle's dependencies).
`--new-env` / `--old-env KEY=VALUE` (repeatable) set a variable for that side's runs only, so one tree is compared
with itself under two settings (`--old . --new-env SGLANG_P2P_DEVICE_SCATTER=1`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

#: the sections compared: their rows' key fields and the timing each row carries (us, with p50 and min)
SECTIONS = {"nccl": (("case", "overlap", "slot_mib", "first_chunk_mib"), "send_us"),
            "ipc": (("case", "mode"), "write_us"), "same_gpu": (("case", "mode"), "write_us")}
STATS = ("p50", "min")


def _rows(result: dict, section: str) -> dict[tuple, dict]:
    keys, metric = SECTIONS[section]
    return {tuple(r.get(k) for k in keys): r[metric] for r in result.get(section, []) if r.get(metric)}


def _geo(ratios: Iterable[float]) -> Optional[float]:
    logs = [math.log(r) for r in ratios if r and r > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def ratios(a: dict, b: dict, section: str, stat: str) -> dict[tuple, float]:
    """Each case both results have: a's `stat` over b's."""
    ra, rb = _rows(a, section), _rows(b, section)
    return {k: ra[k][stat] / rb[k][stat] for k in ra.keys() & rb.keys() if rb[k].get(stat)}


def compare(new: list[dict], old: list[dict]) -> dict[str, Any]:
    """`new[i]` against `old[i]` (round i), and each tree's later rounds against its first: per section and
    statistic, the geometric mean over the common cases of every round, and each case's ratios."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        if not any(r.get(section) for r in new + old):
            continue
        sec: dict[str, Any] = {}
        for stat in STATS:
            per_round = [ratios(n, o, section, stat) for n, o in zip(new, old)]
            cases = sorted(set.intersection(*(set(r) for r in per_round)), key=str) if per_round else []
            sec[stat] = {
                "new_over_old": [_geo(r.values()) for r in per_round],
                "old_over_old": [_geo(ratios(o, old[0], section, stat).values()) for o in old[1:]],
                "new_over_new": [_geo(ratios(n, new[0], section, stat).values()) for n in new[1:]],
                "cases": {"/".join(str(x) for x in k if x is not None): [r[k] for r in per_round] for k in cases},
            }
        out[section] = sec
    return out


def render(cmp: dict[str, Any]) -> str:
    def fmt(xs: list) -> str:
        return " ".join("-" if x is None else f"{x:.3f}" for x in xs) or "-"

    lines = []
    for section, sec in cmp.items():
        for stat, s in sec.items():
            lines.append(f"== {section} {stat}: new/old by round {fmt(s['new_over_old'])}; the spread of one tree: "
                         f"old/old {fmt(s['old_over_old'])}, new/new {fmt(s['new_over_new'])} (geometric means over "
                         f"{len(s['cases'])} cases)")
            for case, rs in s["cases"].items():
                lines.append(f"  {case:<44} {fmt(rs)}")
    return "\n".join(lines)


def run_tree(tree: Path, args: list[str], out: Path, timeout: float, extra_env: Optional[dict] = None) -> dict:
    """One `xfer_bench.py` run from `tree` (its own code first on the path, `extra_env` over the environment); its
    result."""
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(tree / "bench" / "transfer" / "xfer_bench.py"), *args, "--out", str(out)]
    done = subprocess.run(cmd, cwd=tree, env=env, timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(out.read_text())


def _env_pairs(ap: argparse.ArgumentParser, pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            ap.error(f"{pair!r} is not KEY=VALUE")
        out[key] = value
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="the tree to compare against")
    ap.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[2], help="default: this tree")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree, in turn (>= 2 gives the spread)")
    ap.add_argument("--run-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", type=Path, help="JSON: the comparison and every run's result")
    for side in ("new", "old"):
        ap.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a variable set for the {side} side's runs only (repeatable)")
    a = ap.parse_args(own)
    envs = {side: _env_pairs(ap, getattr(a, f"{side}_env")) for side in ("new", "old")}
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    for tree in (a.new, a.old):
        if not (tree / "bench" / "transfer" / "xfer_bench.py").exists():
            ap.error(f"{tree} holds no bench/transfer/xfer_bench.py")
    runs: dict[str, list[dict]] = {"new": [], "old": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for label, tree in (("new", a.new), ("old", a.old)):
                runs[label].append(run_tree(tree.resolve(), bench_args, Path(tmp) / f"{label}{i}.json", a.run_timeout_s,
                                            envs[label]))
                print(f"[ab] {label} round {i + 1} done", flush=True)
    cmp = compare(runs["new"], runs["old"])
    print(render(cmp))
    if a.out:
        a.out.write_text(json.dumps({"args": bench_args, "rounds": a.rounds, "env": envs, "compare": cmp, "runs": runs},
                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
