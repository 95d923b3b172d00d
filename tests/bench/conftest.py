"""Fixtures of the sweep tests.

``data/`` holds real output of genai-bench 0.0.5 and evalscope perf 1.14.1 (one concurrency-2 run of the
``smoke`` scenario, D(32,8), against a loopback OpenAI mock; evalscope's stored request/response texts
blanked).  Tests that run the tools use the tools' own venv (bench/sweep/install_tools.sh); without it they
skip on a developer machine and fail in CI (CI=true), so a missing install step cannot pass unnoticed.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
BENCH_VENV = REPO / os.environ.get("BENCH_VENV", ".venv-bench")


@pytest.fixture
def raw_copy(tmp_path: Path) -> Path:
    """A writable copy of the fixtures laid out as a sweep's OUT/raw/<tool>/ folders."""
    raw = tmp_path / "out" / "raw"
    shutil.copytree(DATA, raw)
    return raw


@pytest.fixture(scope="session")
def bench_python() -> Path:
    py = BENCH_VENV / "bin" / "python"
    if not (py.exists() and (BENCH_VENV / "bin" / "genai-bench").exists() and (BENCH_VENV / "bin" / "evalscope").exists()):
        msg = f"benchmark tools missing ({BENCH_VENV}); run: bash bench/sweep/install_tools.sh"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return py


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def bench_env() -> dict[str, str]:
    """Environment for the real entry point: none of the project venv's SGLang path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.fixture
def dead_url() -> str:
    """A loopback URL on which nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
