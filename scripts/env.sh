# Source with the SGLang release to use:  . scripts/env.sh 0.5.23
# Puts that release's folder (built by scripts/install_cpu.sh) first on PYTHONPATH and activates .venv.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SGLANG_RELEASE=${1:-${SGLANG_RELEASE:-0.5.23}}
export SGLANG_RELEASE
export PYTHONPATH="$_root/.deps/sglang-$SGLANG_RELEASE${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC1091
. "$_root/.venv/bin/activate"
unset _root
