"""Assemble e2e_results.json from the step files a run (or two device calls) left behind.

    python3 -m e2e.results --state DIR --machine-json FILE --out FILE

Each step writes its own JSON under the state folder (check.json, sglang_tests.json, perf.json), which survives
between device calls while the machine stays warm; this merges whichever are there, so the file that comes
back from the second call holds both phases.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA = 1
STEPS = ("check", "sglang_tests", "perf")


def load(path: Path) -> Any:
    """A result file, `.json` or `.json.gz` (larger results are kept gzipped in the repository: a device call
    carries the tree and the SGLang bundle within 64 MiB)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def merge(machine: dict[str, Any], steps: dict[str, Any], run_gpus: int | None = None) -> dict[str, Any]:
    """The results document: schema, machine, and one key per step present (in STEPS order)."""
    doc: dict[str, Any] = {"schema": SCHEMA, "machine": machine}
    gpus = sorted({s.get("gpus", 2) for s in steps.values() if isinstance(s, dict) and "gpus" in s})
    if gpus:  # steps of run_all.sh --gpus 1 say so; on one GPU p2pnccl used Mooncake tcp, not NCCL
        doc["gpus"] = gpus[0] if len(gpus) == 1 else gpus
    elif run_gpus is not None:  # no step says (none ran): the mode run_all.sh was called in
        doc["gpus"] = run_gpus
    for name in STEPS:
        if name in steps:
            doc[name] = steps[name]
    doc["missing_steps"] = [s for s in STEPS if s not in steps]
    return doc


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write a step's document; steps call this from a finally block, so a step killed at its deadline still
    leaves what it measured (json writes inf as Infinity, which json.loads reads back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def load_steps(state: Path) -> dict[str, Any]:
    out = {}
    for name in STEPS:
        p = state / f"{name}.json"
        if p.exists():
            try:
                out[name] = json.loads(p.read_text())
            except ValueError as e:
                out[name] = {"status": "unreadable", "error": str(e)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--machine-json", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpus", type=int, default=None, help="run_all.sh --gpus, for a file no step wrote into")
    a = ap.parse_args(argv)
    machine = json.loads(a.machine_json.read_text()) if a.machine_json.exists() else {}
    doc = merge(machine, load_steps(a.state), a.gpus)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
