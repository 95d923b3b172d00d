"""The host's GPUs as nvidia-smi names them, for result file names (no CUDA context needed), and the torch a GPU
benchmark runs with (`cuda_torch`: None, said once, where there is no CUDA device)."""

from __future__ import annotations

import re
import subprocess


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
