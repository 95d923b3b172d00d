#!/usr/bin/env bash
# Starts this node's SGLang server of a PD topology (transfer backend p2pnccl). The whole topology is
# validated, and every command checked with SGLang's own parser, before anything starts.
#   launch/node.sh --config configs/topologies/p3x3-d4.yaml --rank 4        # or RANK/SLURM_PROCID from the env
#   launch/node.sh --config ... --role decode --group 0 --node-rank 2
#   launch/node.sh --config ... --dry-run                                   # every node's command, starts nothing
# Other options: --hostfile FILE, --model-path PATH, --sglang-version V, --print-only, --no-check (see --help).
# PYTHON picks the interpreter that has SGLang and this project installed (default python3).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the launcher is part of this checkout; no install needed to render (the plugin itself must be installed)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m sglang_p2p_backend.launch node "$@"
