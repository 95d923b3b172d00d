"""What machine a run was on: GPUs, how they are linked, driver, torch, NCCL, SGLang. Printed as JSON.

    python3 -m e2e.machine [KIND]
"""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from importlib import metadata
from typing import Any


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def describe(kind: str = "") -> dict[str, Any]:
    info: dict[str, Any] = {"kind": kind, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")}
    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    lines = [g for g in gpus.splitlines() if g]
    info["gpus"] = f"{len(lines)} x {lines[0]}" if lines else "none"
    info["topology"] = _run(["nvidia-smi", "topo", "-m"])
    try:
        import torch

        info["torch"] = torch.__version__
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as e:  # the file is still worth having without torch
        info["torch"] = f"unavailable: {e}"
    for dist in ("sglang", "sglang-kernel", "mooncake-transfer-engine-cuda13", "genai-bench"):
        try:
            info[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist.replace("-", "_")] = None
    info["python"] = sys.version.split()[0]
    return info


if __name__ == "__main__":
    print(json.dumps(describe(sys.argv[1] if len(sys.argv) > 1 else ""), indent=1))
