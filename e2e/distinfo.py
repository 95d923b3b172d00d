"""Write a minimal ``sglang_p2p_backend-<version>.dist-info`` so importlib.metadata finds our entry points.

SGLang loads plugins through ``importlib.metadata.entry_points(group="sglang.srt.plugins")``. The GPU host has no
network, so the project cannot be pip-installed there; a dist-info folder (METADATA + entry_points.txt) in a
directory on PYTHONPATH is all the discovery needs. Both files are generated from pyproject.toml, so they
cannot drift from what ``pip install`` would register.

    python3 -m e2e.distinfo DEST_DIR
"""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def render(pyproject: dict) -> tuple[str, str, str]:
    """(folder name, METADATA text, entry_points.txt text) for the project table of a pyproject."""
    proj = pyproject["project"]
    dist = proj["name"].replace("-", "_")
    meta = f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n"
    sections = dict(proj.get("entry-points", {}))
    if proj.get("scripts"):
        sections["console_scripts"] = proj["scripts"]
    eps = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
                  for group, items in sections.items())
    return f"{dist}-{proj['version']}.dist-info", meta, eps


def write(dest: Path, pyproject_path: Path = ROOT / "pyproject.toml") -> Path:
    name, meta, eps = render(tomllib.loads(pyproject_path.read_text()))
    folder = dest / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(meta)
    (folder / "entry_points.txt").write_text(eps)
    return folder


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
