"""What the GPU benchmarks here share: the host's GPUs as nvidia-smi names them, for result file names (no CUDA
context needed), the torch a benchmark runs with (`cuda_torch`: None, said once, where there is no CUDA device),
their common options (`common_args`) and a checked list of names an option picks (`picked`)."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path


def gpu_slugs() -> list[str]:
    """One file-name slug per GPU ('nvidia-h100-80gb-hbm3'); empty without nvidia-smi or GPUs."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    return [re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") for name in out if name.strip()]


def cuda_torch(tool: str):
    """torch where it sees a CUDA device, else None after printing that `tool` measured nothing (a GPU benchmark
    then exits 0: CPU-only machines run its command too)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print(f"{tool}: no CUDA device, nothing measured")
        return None
    return torch


def common_args(ap: argparse.ArgumentParser, out: str, case_s: float, budget_s: float) -> None:
    """--out (the JSON), --machine (its name in the results), --case-s (seconds of timed calls a case) and
    --budget-s (no case starts after it), with this benchmark's defaults."""
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--machine", default="unknown")
    ap.add_argument("--case-s", type=float, default=case_s)
    ap.add_argument("--budget-s", type=float, default=budget_s)


def picked(ap: argparse.ArgumentParser, text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """The comma-separated names in `text`, in order; one not in `known` ends the run through `ap.error` (exit 2),
    naming it and the choices."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"unknown {what} {unknown}; choose from {','.join(known)}")
    return names
