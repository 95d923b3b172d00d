#!/usr/bin/env bash
# Starts the PD load balancer of a topology: every prefill group's master URL with its bootstrap port,
# every decode group's master URL (mini_lb / sgl-router compatible flags, `python -m sglang_p2p_lb`).
#   launch/lb.sh --config configs/topologies/p3x3-d4.yaml [--hostfile FILE] [--print-only | --dry-run]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m sglang_p2p_backend.launch lb "$@"
