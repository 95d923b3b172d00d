"""The host's GPUs as nvidia-smi names them, for result file names (no CUDA context needed)."""

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
