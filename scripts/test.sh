#!/usr/bin/env bash
# The README's test command. Builds the CPU environment from the project's own files (scripts/install_cpu.sh),
# then runs the whole suite against SGLang 0.5.23 and the SGLang-dependent part (marker `sglang`) against 0.5.17.
# GPU tests (marker `gpu`) skip without CUDA. Extra pytest arguments are passed through.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/install_cpu.sh || exit 1
status=0
run() {  # run RELEASE PYTEST-ARGS...
  local release=$1; shift
  echo "=== pytest against SGLang $release: $*"
  # shellcheck disable=SC1091
  ( . scripts/env.sh "$release" && python -m pytest -q -p no:cacheprovider "$@" )
  local rc=$?
  # 5 = no test collected for that selection: not a failure of the suite
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=$rc; fi
}
run 0.5.23 tests "$@"
run 0.5.17 -m sglang tests "$@"
exit $status
