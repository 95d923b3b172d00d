#!/usr/bin/env bash
# Builds .venv-bench/: genai-bench + evalscope[perf] at the versions locked in bench/sweep/requirements-bench.txt.
# A venv of their own because evalscope needs datasets<=4.8.4 -> fsspec<=2026.2.0, which conflicts with the
# project's pins (requirements/cpu-common.txt), and because neither tool may see the SGLang folder that
# scripts/env.sh puts on PYTHONPATH. The locked set has no torch and no nvidia-* wheels (about 1.8 GB, ~80 s).
# Idempotent: skipped when the venv already matches the lock file.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
LOCK=bench/sweep/requirements-bench.txt
VENV=${BENCH_VENV:-.venv-bench}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH VIRTUAL_ENV
if [ -x "$VENV/bin/genai-bench" ] && [ -x "$VENV/bin/evalscope" ] && cmp -s "$LOCK" "$VENV/.lock-installed"; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -r "$LOCK"
# refuse a CUDA stack sneaking in through a future lock edit
if "$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -qiE '^(torch|nvidia-|triton)'; then
  echo "install_tools.sh: torch/nvidia packages found in $VENV; fix $LOCK" >&2
  exit 1
fi
cp "$LOCK" "$VENV/.lock-installed"
echo "benchmark tools ready: $VENV/bin/genai-bench, $VENV/bin/evalscope"
