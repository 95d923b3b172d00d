#!/usr/bin/env bash
# The README's main job: builds the CPU environment if needed, then runs the 1P1D transfer demo through
# SGLang's classes (prefill and decode processes on 127.0.0.1). Arguments go to sglang_p2p_backend.demo.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
release=${SGLANG_RELEASE:-0.5.23}
# only what the demo imports: .venv, one SGLang release and the project (no test tools, no benchmark venv)
bash scripts/install_cpu.sh --releases "$release" --core --no-bench >/dev/null
# shellcheck disable=SC1091
. scripts/env.sh "$release"
export SGLANG_HOST_IP=${SGLANG_HOST_IP:-127.0.0.1}
exec python -m sglang_p2p_backend.demo "$@"
