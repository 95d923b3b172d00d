#!/usr/bin/env bash
# The README's test command. Builds the CPU environment from the project's own files (scripts/install_cpu.sh),
# then runs the whole suite against SGLang 0.5.23 and the SGLang-dependent part (marker `sglang`) against 0.5.17.
# GPU tests (marker `gpu`) skip without CUDA. Extra pytest arguments are passed through.
#   bash scripts/test.sh          everything (what CI runs)
#   bash scripts/test.sh --fast   the edit-test loop: tests not marked `slow`, against 0.5.23 only; installs
#                                 nothing when the environment is current
# A PD test's driver processes are forked from one that imported SGLang once per pytest worker
# (sglang_p2p_backend/testing/forkserver.py); most of what is left is waiting on timeouts, so tests run side by
# side (pytest-xdist, TEST_WORKERS per pytest run, default 2); tests marked `serial` assert wall-clock bounds and
# run afterwards with nothing beside them.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
FAST=0
if [ "${1:-}" = --fast ]; then FAST=1; shift; fi
WORKERS=${TEST_WORKERS:-2}
# the smoke sweep needs the benchmark tools' venv: it runs last, once their install (started below) is done
SWEEP=tests/bench/test_sweep_smoke.py

status=0
pytest_on() {  # pytest_on RELEASE PYTEST-ARGS...: one pytest run; its failure (not "no test collected") -> status
  local release=$1; shift
  echo "=== pytest against SGLang $release: $*"
  # shellcheck disable=SC1091
  ( . scripts/env.sh "$release" && python -m pytest -q -p no:cacheprovider "$@" )
  local rc=$?
  # 5 = no test collected for that selection: not a failure of the suite
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=$rc; fi
}

if [ $FAST = 1 ]; then
  bash scripts/install_cpu.sh --releases 0.5.23 --no-bench >/dev/null || exit 1
  # no path given: pytest's testpaths (tests/); a path given narrows the run to it
  pytest_on 0.5.23 -n "$WORKERS" -m "not slow and not gpu and not serial" "$@"
  pytest_on 0.5.23 -m "not slow and not gpu and serial" "$@"
  exit $status
fi

bash scripts/install_cpu.sh --no-bench || exit 1
bench_log=.venv/install_tools.log
bash bench/sweep/install_tools.sh >"$bench_log" 2>&1 &
bench_pid=$!

# one release after the other (each pytest run has its fork servers import its release): no more than
# TEST_WORKERS pairs start at once
pytest_on 0.5.23 -n "$WORKERS" -m "not serial" --ignore "$SWEEP" tests "$@"
pytest_on 0.5.17 -n "$WORKERS" -m "sglang and not serial" tests "$@"
pytest_on 0.5.23 -m serial tests "$@"
pytest_on 0.5.17 -m "sglang and serial" tests "$@"
if ! wait $bench_pid; then
  cat "$bench_log"
  echo "bench/sweep/install_tools.sh failed" >&2
  exit 1
fi
pytest_on 0.5.23 "$SWEEP" "$@"
exit $status
