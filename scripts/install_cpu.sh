#!/usr/bin/env bash
# Builds the CPU test environment from this project's own files, on a fresh machine:
#   .venv/                 torch 2.13.0 (CPU build), the pinned packages of requirements/cpu-common.txt, this project
#   .deps/sglang-<ver>/    one folder per supported SGLang release: sglang --no-deps plus the versions it pins
# The SGLang release in use is chosen by putting its folder first on PYTHONPATH (scripts/env.sh does that).
# torch must be installed first and everything SGLang-related with --no-deps: a plain `torch` requirement
# would pull the multi-GB CUDA build. Idempotent: a finished step is skipped on the next run.
# Options (what the demo needs is less than what the tests need):
#   --releases "0.5.23 ..."  the SGLang releases to install (default: SGLANG_RELEASES, else every supported one)
#   --no-extras              skip requirements/extra-*.txt (test tools, Kubernetes client, shellcheck, Mooncake)
#   --no-bench               skip the benchmark tools' venv (.venv-bench, bench/sweep/install_tools.sh)
#   --core                   only what the demo imports (requirements/cpu-core.txt) instead of cpu-common.txt; implies
#                            --no-extras. A later run without it completes the environment.
# The SGLang trees install in the background beside the .venv steps: they go into folders of their own, --no-deps.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
RELEASES=${SGLANG_RELEASES:-"0.5.23 0.5.17"}
EXTRAS=1
BENCH=1
CORE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --releases) RELEASES=$2; shift 2 ;;
    --no-extras) EXTRAS=0; shift ;;
    --no-bench) BENCH=0; shift ;;
    --core) CORE=1; EXTRAS=0; shift ;;
    *) echo "install_cpu.sh: unknown option $1 (--releases LIST, --no-extras, --no-bench, --core)" >&2; exit 2 ;;
  esac
done
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Debian's libibverbs1: Mooncake's non-CUDA wheel (an extra) links it even for its tcp protocol
if [ "$EXTRAS" = 1 ] && ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "install Debian's libibverbs1 (Mooncake needs it): apt-get install libibverbs1" >&2; exit 1
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q)
install_releases() {
  for v in $RELEASES; do
    local d=.deps/sglang-$v
    if [ ! -f "$d/.installed" ] || ! cmp -s "requirements/sglang-$v.txt" "$d/.installed"; then
      rm -rf "$d"
      "${PIP[@]}" --no-deps --target "$d" -r "requirements/sglang-$v.txt"
      cp "requirements/sglang-$v.txt" "$d/.installed"
    fi
  done
}
install_releases >.venv/install_releases.log 2>&1 &
releases_pid=$!
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null; then
  "${PIP[@]}" torch==2.13.0
fi
torch_companions() {  # torchvision and triton without their torch requirement, and torchvision's CPU import fix
  "${PIP[@]}" --no-deps torchvision==0.28.0 triton==3.9.0
  SP=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp scripts/cpu_torchvision_fix.py "$SP/_sglang_p2p_cpu_torchvision_fix.py"
  echo "import _sglang_p2p_cpu_torchvision_fix as m; m.install()" > "$SP/_sglang_p2p_cpu_torchvision_fix.pth"
}
if cmp -s requirements/cpu-common.txt .venv/.common-installed 2>/dev/null; then
  :  # the full set is in, the core set with it
elif [ "$CORE" = 1 ]; then
  if ! cat requirements/cpu-core.txt requirements/cpu-common.txt | cmp -s - .venv/.core-installed; then
    "${PIP[@]}" -r requirements/cpu-core.txt -c requirements/cpu-common.txt
    torch_companions
    cat requirements/cpu-core.txt requirements/cpu-common.txt > .venv/.core-installed
  fi
else
  "${PIP[@]}" -r requirements/cpu-common.txt
  torch_companions
  cp requirements/cpu-common.txt .venv/.common-installed
fi
if ! wait $releases_pid; then
  cat .venv/install_releases.log >&2
  echo "install_cpu.sh: installing SGLang ${RELEASES} into .deps/ failed (log above)" >&2
  exit 1
fi
# Extra tool sets (LB bench peers, benchmark drivers, Mooncake): requirements/extra-*.txt, resolved against
# torch 2.13.0 and the common pins so nothing upgrades torch to a CUDA build; *-nodeps.txt go in with --no-deps.
echo "torch==2.13.0" > .venv/constraints.txt
grep -v '^#' requirements/cpu-common.txt >> .venv/constraints.txt
for f in requirements/extra-*.txt; do
  [ "$EXTRAS" = 1 ] && [ -e "$f" ] || continue
  stamp=.venv/.$(basename "$f").installed
  cmp -s "$f" "$stamp" 2>/dev/null && continue
  case "$f" in
    *-nodeps.txt) "${PIP[@]}" --no-deps -r "$f" ;;
    *) "${PIP[@]}" -c .venv/constraints.txt -r "$f" ;;
  esac
  cp "$f" "$stamp"
done
# genai-bench + evalscope for the benchmark sweeps: their own venv (.venv-bench), their pins clash with SGLang's
if [ "$BENCH" = 1 ]; then
  bash bench/sweep/install_tools.sh
fi
# the project itself (editable, so the sglang.srt.plugins entry point is registered); the stamp names this
# checkout, so a venv moved to or shared with another checkout installs it again
stamp=.venv/.project-installed
if ! { cat pyproject.toml; echo "$ROOT"; } | cmp -s - "$stamp"; then
  "${PIP[@]}" --no-deps --no-build-isolation -e .
  { cat pyproject.toml; echo "$ROOT"; } > "$stamp"
fi
echo "CPU environment ready: .venv + .deps/sglang-{${RELEASES// /,}}"
