#!/usr/bin/env bash
# One command for a concurrency sweep: installs the tools' venv when missing, then runs `python -m bench.sweep`
# with that venv's python (it has matplotlib and tokenizers, and no SGLang on its path). Arguments pass through:
#   bash bench/sweep/run.sh --launch-sim                      # loopback demo: simulated P/D + LB, local tokenizer
#   bash bench/sweep/run.sh --target http://LB:8000 --tokenizer /models/DeepSeek-V3-0324 --scenarios short,long
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
bash "$ROOT/bench/sweep/install_tools.sh"
# stay in the caller's folder (relative --out / --tokenizer keep their meaning); only this repo on the path
unset VIRTUAL_ENV
VENV=${BENCH_VENV:-.venv-bench}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PYTHONPATH="$ROOT" exec "$VENV/bin/python" -m bench.sweep "$@"
