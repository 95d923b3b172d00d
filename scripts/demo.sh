#!/usr/bin/env bash
# The README's main job: builds the CPU environment if needed, then runs the 1P1D transfer demo through
# SGLang's classes (prefill and decode processes on 127.0.0.1). Arguments go to sglang_p2p_backend.demo.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/install_cpu.sh >/dev/null
# shellcheck disable=SC1091
. scripts/env.sh "${SGLANG_RELEASE:-0.5.23}"
export SGLANG_HOST_IP=${SGLANG_HOST_IP:-127.0.0.1}
exec python -m sglang_p2p_backend.demo "$@"
