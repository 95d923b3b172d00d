"""Shared cases for the launcher tests: the shipped topologies, a writer for variants of them, and a reader
of rendered flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted((REPO / "configs" / "topologies").glob("*.yaml"))
# the one-host topologies (1p1d-one-host, the miniatures) put prefill and decode on different ports of one
# host; a RoleBasedGroup's LB discovery dials one port for every pod
RBG_TOPOLOGIES = [p for p in TOPOLOGIES if p.stem != "1p1d-one-host" and not p.stem.startswith("mini-")]
EXPECTED_TOPOLOGIES = {"p3x3-d4", "p3x2-d4", "p4x2-d4", "p4-d6", "p4-d9", "p2-d2", "1p1d-one-host",
                       "mini-a-2p-dpdecode", "mini-b-dp-both", "mini-b-deepep", "mini-b-deepep-ll", "mini-c-tp1-tp2", "mini-c-tp2-tp1",
                       "mini-c-tp1-tp4", "mini-a-serve", "mini-b-serve"}


@pytest.fixture
def variant(tmp_path: Path) -> Callable[..., Path]:
    """variant("p2-d2", edit) writes a copy of a shipped topology changed by edit(dict) and returns its path."""

    def make(base: str, edit: Callable[[dict[str, Any]], None]) -> Path:
        src = REPO / "configs" / "topologies" / f"{base}.yaml"
        data = yaml.safe_load(src.read_text())
        for key in ("model", "cluster"):  # keep the shipped profiles reachable from tmp_path
            data[key] = str((src.parent / data[key]).resolve())
        edit(data)
        out = tmp_path / f"{base}-variant.yaml"
        out.write_text(yaml.safe_dump(data, sort_keys=False))
        return out

    return make


def flags(args: tuple[str, ...]) -> dict[str, list[str]]:
    """--flag -> its values (a flag given twice would be a rendering bug, so it fails here)."""
    out: dict[str, list[str]] = {}
    key = None
    for tok in args:
        if tok.startswith("--"):
            assert tok not in out, f"{tok} rendered twice"
            key, out[tok] = tok, []
        else:
            out[key].append(tok)
    return out
