"""Running the benchmark tools as subprocesses: a clean offline environment and a filtered log."""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Sequence

from .errors import SweepError

# genai-bench logs one INFO line per request about a metric that text tasks never have
NOISE = ("audio_throughput",)


def tool_env(api_key: str) -> dict[str, str]:
    env = dict(os.environ)
    # the project's .venv puts a pinned SGLang (and its transformers) on PYTHONPATH: the tools live in their
    # own venv and must not import those
    for k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(k, None)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        ENABLE_UI="false",  # genai-bench: plain log instead of the live dashboard
        OPENAI_API_KEY=api_key, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
    )
    return env


def redact(cmd: Sequence[str], secret: str) -> str:
    return " ".join("***" if a == secret else (f"'{a}'" if any(ch in a for ch in " ({\"") else a) for a in cmd)


def run_tool(cmd: Sequence[str], log: Path, api_key: str, timeout_s: float | None = None) -> None:
    """Run cmd, keep its output (less the noise) in log; SweepError with the log's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(f"$ {redact(cmd, api_key)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=tool_env(api_key), stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        # the read loop blocks until the tool closes its output, so a timer enforces the limit
        timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                if not any(n in line for n in NOISE):
                    f.write(line.replace(api_key, "***") if api_key else line)
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        hint = ""
        if "No values found for metric" in tail:
            hint = "every request failed (genai-bench found no TTFT at all): check the target's own log\n"
        raise SweepError(f"{Path(cmd[0]).name} failed (exit {rc}); {hint}log {log}; last lines:\n{tail}")
