#!/bin/bash
# The whole end-to-end check on a 2-GPU host (torch 2.11.0+cu130, Python 3.12, no internet), one command:
#
#   bash e2e/run_all.sh [--gpus 1|2] [--phase check|sglang-tests|perf|all|mooncake-bench|liveness|faults|unpack]
#                       [--skip-sglang-tests] [--budget-s SECONDS]
#   (phases also: lb, deepep)
#
# It unpacks whichever bundle archives (.bundle/sglang.tar.xz, .bundle/extras.tar.xz, built by
# e2e/build_bundle.sh) this working tree carries into $E2E_ROOT (default /tmp/e2e, which survives between calls
# to a warm device machine), builds the random models, and runs:
#   check: p2pnccl PD + our LB vs a non-PD server, token for token and logprobs (llama-tiny, mla-tiny; or the
#          models E2E_CHECK_ONLY names, e.g. swa-tiny: the hybrid sliding-window GPT-OSS), then
#          SGLang's own PD tests with SGLANG_TEST_PD_DISAGG_BACKEND=p2pnccl       (needs sglang.tar.xz)
#   sglang-tests: only those tests; a file runs only when its expected time is left, and files an earlier call
#          ran keep their result, so check + perf + sglang-tests calls together cover them all
#   perf:  p2pnccl vs Mooncake (nvlink_intra) at concurrency 1/16/64, then genai-bench through each LB
#                                                                                  (needs both archives)
#   mooncake-bench: bench/mooncake/pd_path.py with both roles' pools on GPU 0, Mooncake tcp transport only ->
#          $OUT/mooncake_pd_<kind>.json                                             (needs both archives)
#   liveness: SGLang's test_peer_failures_abort_without_hanging E2E_LIVENESS_RUNS times (default 30) against one
#          P/D launch with E2E_LIVENESS_BACKEND (p2pnccl over NCCL, or mooncake), then its chunked-prefill abort
#          test -> $OUT/liveness_<backend>.json                  (needs sglang.tar.xz; mooncake: extras too)
#   faults: kill -9 / SIGSTOP of decode and prefill under load behind our LB, restart -> $OUT/faults.json
#   lb:    our LB vs SGLang's mini_lb vs smg in front of the same PD servers: llama-tiny all on GPU 0, or with
#          --gpus 4 llama-anchor one server per GPU (rates from the measured prefill capacity);
#          E2E_LB_TOPOLOGY=2p2d (default) or 3p1d; warm-up, 3 repetitions per LB in rotated order of the bursty,
#          shared-prefix and long-prefix workloads (run length planned to fit the budget), then SIGKILL of a
#          prefill and a decode under load through every LB at once and their restart
#          -> $OUT/lb_compare_<topology>_<kind>.json (e2e/lb_compare.py). Carry .bundle/lb.tar.xz for the peers
#          (without it only our LB runs). E2E_LB_ARGS: extra flags (e.g. "--lbs ours:load_aware,mini_lb").
#   lb-overhead: the LBs' own cost on this host's CPUs: simulated workers answering at once, 2,000 requests at
#          concurrency 256 through ours, smg, mini_lb and sent directly -> $OUT/lb_overhead_<kind>.json
#          (e2e/lb_overhead.py; E2E_LB_OVERHEAD_ARGS adds flags). Needs only lb.tar.xz, no SGLang bundle.
#   ipc:   the same-host CUDA IPC path on this machine: tests/gpu/test_cuda_ipc.py (two processes, byte-exact),
#          bench/transfer/ipc_bench.py -> $OUT/ipc_$KIND.json, then the SGLang-class byte-exact cases with
#          SGLANG_P2P_TRANSPORT=cudaipc (tests/gpu/test_pd_sglang_cuda.py; E2E_IPC_SGLANG_K selects, "" skips)
#          -> $OUT/ipc_tests.log. The end-to-end check over it: E2E_P2P_1GPU=cudaipc ... --phase check
#   serve: p2pnccl (auto: the CUDA IPC path) next to SGLang's NIXL backend (and Mooncake with --extra), every
#          server on GPU 0 (--gpus 2: the decodes on GPU 1), decode with and without CUDA graphs, repeated cells, scheduler CPU by thread and
#          py-spy profiles -> $OUT/serve_<kind>.json (e2e/serve.py; flags in E2E_SERVE_ARGS; needs serve.tar.xz)
#   shapes: the DeepSeek deployment in miniature on a 4-GPU host (--gpus 4): every configs/topologies/mini-*.yaml
#          started from its launch config, checked against a non-PD server with negative controls
#          -> $OUT/shapes_<kind>.json (e2e/shapes.py; E2E_SHAPES picks shapes)              (needs sglang.tar.xz)
#   shape-faults: kill -9 of one of mini-a's two prefills, then of its decode, under load behind our LB's
#          default policy, each restarted -> $OUT/shape_faults_<kind>.json (e2e/shape_faults.py)
#   shape-serve: serving figures of a 4-GPU miniature (E2E_SERVE_SHAPE: mini-a-serve or mini-b-serve), p2pnccl
#          next to NIXL and Mooncake on the same rendered commands -> $OUT/shape_serve_<shape>_<kind>.json
#          (e2e/shape_serve.py; E2E_SERVE_ARGS adds flags; needs serve.tar.xz, this call or an earlier one)
#   transfer-bench: bench/transfer/xfer_bench.py on this machine's GPUs: the same-host write path (SM kernel and
#          copy engines) against one cudaMemcpyPeer, the NCCL path against one contiguous NCCL send, a matmul's
#          slowdown during transfers, a 128-token request's fixed cost by phase -> $OUT/xfer_$KIND.json and
#          $OUT/xfer_$KIND.log (E2E_XFER_ARGS adds flags, e.g. "--programs 16,32,66,132": the copy kernel's grid
#          bounded to each count, write time against the matmul's slowdown, SGLANG_P2P_IPC_PROGRAMS's trade-off),
#          after tests/gpu/test_copy_engine.py, tests/gpu/test_cuda_ipc.py (the same-host path's bytes, a
#          restarted peer mapped afresh), tests/gpu/test_engine_pipeline_nccl.py (the NCCL pipeline,
#          overlap on, byte-exact) and the NCCL waits' pacing test (with the split communicator, the default, also the peer-death
#          tests of the split communicator) -> $OUT/xfer_tests.log (E2E_XFER_TESTS=0 skips them). Needs no SGLang: carry .bundle/bench.tar.xz (msgspec) or sglang.tar.xz
#   deepep: DeepEP as the (P3x3)D4 profile uses it: built here with nvcc for sm_90 against the image's NVSHMEM
#          wheel, DeepEP's own intranode test on GPUs 0-1, DeepGEMM's bf16 grouped GEMM (what SGLang runs an
#          unquantized model's experts with under DeepEP) against torch, then with --gpus 4 and sglang.tar.xz
#          unpacked (this call or the next, warm) the shape mini-b-deepep (e2e.shapes), and last a probe of
#          DeepEP's low-latency test -> $OUT/deepep_<kind>.json naming the first step that failed,
#          $OUT/deepep_built.tar.xz (the build, for a later call to carry as .bundle/deepep-built.tar.xz),
#          $OUT/shapes_mini-b-deepep_<kind>.json, then (where DeepEP's low-latency test passed) mini-b-deepep-ll,
#          the decode on the low-latency kernels -> $OUT/shapes_mini-b-deepep-ll_<kind>.json; E2E_DEEPEP_SHAPES
#          picks (default shapes,shapes_ll) (e2e/deepep.py). Needs .bundle/deepep.tar.xz
#          (e2e/build_bundle.sh .bundle deepep) in this call or an earlier one on the same machine
#   unpack: only unpack what this call carries (a first call can bring extras.tar.xz, the next sglang.tar.xz)
# .bundle/triton-cache.tar.xz, where a call carries it, fills TRITON_CACHE_DIR ($E2E_ROOT/triton-cache) before any
#   server starts; E2E_SAVE_TRITON_CACHE=1 packs that folder into $OUT/triton-cache.tar.xz at the end (e2e/triton_cache.py)
# --gpus 1 (or E2E_GPUS=1; default 2): every server on GPU 0. NCCL cannot put two ranks on one GPU, so p2pnccl
#   runs on its Mooncake tcp transport (SGLANG_P2P_TRANSPORT=mooncake MC_FORCE_TCP=1) and SGLang's mooncake
#   backend on tcp too: check and perf then need extras.tar.xz unpacked (this call or an earlier one). perf runs
#   the two pairs one after the other; a backend an earlier perf call finished keeps its result (e2e/config.py
#   has the memory sizing).
# Results: $OUT/e2e_results.json (every step done so far on this machine, merged), $OUT/e2e_report.md,
# $OUT/e2e_logs_<phase>.tgz. $OUT defaults to $E2E_ROOT/out. Exit status 0 when every step it ran passed.
# Each phase is planned to end inside --budget-s (default 560 s: a device call is limited to 600 s).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
E2E_ROOT=${E2E_ROOT:-/tmp/e2e}
OUTDIR=${OUT:-$E2E_ROOT/out}
BUNDLE=${E2E_BUNDLE:-$ROOT/.bundle}
PHASE=check
SGLANG_TESTS=1
BUDGET=560
GPUS=${E2E_GPUS:-2}
while [ $# -gt 0 ]; do
  case "$1" in
    --phase) PHASE=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --skip-sglang-tests) SGLANG_TESTS=0; shift ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$PHASE" in check|sglang-tests|perf|all|mooncake-bench|liveness|faults|lb|lb-overhead|ipc|serve|shapes|shape-faults|shape-serve|transfer-bench|deepep|unpack) ;;
  *) echo "run_all.sh: --phase must be check, sglang-tests, perf, all, mooncake-bench, liveness, faults, lb, lb-overhead, ipc, serve, shapes, shape-faults, shape-serve, transfer-bench, deepep or unpack" >&2; exit 2 ;; esac
case "$GPUS" in 1|2|4) ;;
  *) echo "run_all.sh: --gpus must be 1, 2 or 4" >&2; exit 2 ;; esac
case "$PHASE:$GPUS" in shapes:4|shape-faults:4|shape-serve:4) ;; shapes:*|shape-faults:*|shape-serve:*)
  echo "run_all.sh: --phase $PHASE needs a 4-GPU host (--gpus 4)" >&2; exit 2 ;; esac
export E2E_GPUS=$GPUS  # read by e2e.check, e2e.perf, e2e.sglang_tests (e2e/config.py)
START=$(date +%s)
export E2E_ROOT E2E_DEADLINE_EPOCH=$((START + BUDGET - 25))  # 25 s kept for results and the log archive
STATE=$E2E_ROOT/state
mkdir -p "$E2E_ROOT" "$STATE" "$OUTDIR"
export E2E_PIDFILE=$STATE/pids  # process-group leaders the Python steps started (e2e/servers.py)
say() { echo "[e2e +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( E2E_DEADLINE_EPOCH - $(date +%s) )); }

# --- 1. unpack what this call carries (a marker holds the archive's checksum, so a rerun skips it) ---------
unpack() {  # unpack NAME: $BUNDLE/NAME.tar.xz -> $E2E_ROOT/NAME
  local archive=$BUNDLE/$1.tar.xz dest=$E2E_ROOT/$1 sum
  [ -f "$archive" ] || return 0
  sum=$(cksum < "$archive")
  if [ "$(cat "$dest/.unpacked" 2>/dev/null)" = "$sum" ]; then say "$1: already unpacked"; return 0; fi
  # Python's tarfile rather than tar -J: the host image need not have the xz program
  rm -rf "$dest" && mkdir -p "$dest" && python3 -m tarfile -e "$archive" "$dest" && echo "$sum" > "$dest/.unpacked"
  say "$1: unpacked ($(du -sh "$dest" | cut -f1))"
}
unpack sglang
unpack extras
unpack serve
unpack lb
unpack bench
unpack tms
unpack deepep
unpack deepep-built
unpack triton-cache
python3 -m e2e.distinfo "$E2E_ROOT/plugin" >/dev/null   # entry point discovery for SGLang's plugin loader
if [ "$PHASE" = unpack ]; then  # the GPU tests that start SGLang's roles need the entry point too (docs/e2e.md)
  say "unpack: the p2pnccl entry point is in $E2E_ROOT/plugin"
  for part in sglang extras serve lb bench tms deepep deepep-built triton-cache; do [ -f "$E2E_ROOT/$part/.unpacked" ] && say "unpack: $part is in $E2E_ROOT/$part"; done
  exit 0
fi
if [ "$PHASE" = deepep ] && [ ! -f "$E2E_ROOT/deepep/.unpacked" ]; then
  echo "run_all.sh: no DeepEP bundle: carry .bundle/deepep.tar.xz in this call (e2e/build_bundle.sh .bundle deepep)" >&2
  exit 3
fi
HAVE_SGLANG=0; [ -f "$E2E_ROOT/sglang/.unpacked" ] && HAVE_SGLANG=1
if [ "$HAVE_SGLANG" = 0 ] && [ "$PHASE" != lb-overhead ] && [ "$PHASE" != transfer-bench ] && [ "$PHASE" != deepep ]; then
  echo "run_all.sh: no SGLang bundle: carry .bundle/sglang.tar.xz in this call (e2e/build_bundle.sh builds it)" >&2
  exit 3
fi

# --- 2. environment --------------------------------------------------------------------------------------
export PYTHONPATH=$ROOT:$ROOT/lb:$ROOT/e2e/stubs:$E2E_ROOT/plugin:$E2E_ROOT/sglang${PYTHONPATH:+:$PYTHONPATH}
HAVE_MOONCAKE=0
if [ -d "$E2E_ROOT/extras/mooncake" ]; then PYTHONPATH=$PYTHONPATH:$E2E_ROOT/extras/mooncake; HAVE_MOONCAKE=1; fi
if [ -d "$E2E_ROOT/serve/nixl" ]; then PYTHONPATH=$PYTHONPATH:$E2E_ROOT/serve/nixl; fi
# torch_memory_saver (.bundle/tms.tar.xz): --enable-memory-saver, E2E_CHECK_MEMORY_SAVER=1
if [ -d "$E2E_ROOT/tms/torch_memory_saver" ]; then PYTHONPATH=$PYTHONPATH:$E2E_ROOT/tms/torch_memory_saver; fi
# lb-overhead without SGLang: what our LB and mini_lb need beyond the host image (orjson, fastapi, uvicorn)
if [ "$HAVE_SGLANG" = 0 ] && [ -d "$E2E_ROOT/lb/common" ]; then PYTHONPATH=$PYTHONPATH:$E2E_ROOT/lb/common; fi
# transfer-bench without SGLang: msgspec, the transfer engine's one import beyond the host image
if [ "$HAVE_SGLANG" = 0 ] && [ -d "$E2E_ROOT/bench" ]; then PYTHONPATH=$PYTHONPATH:$E2E_ROOT/bench; fi
if [ "$HAVE_MOONCAKE" = 0 ] && [ -d "$E2E_ROOT/serve/mooncake" ]; then
  PYTHONPATH=$PYTHONPATH:$E2E_ROOT/serve/mooncake; HAVE_MOONCAKE=1
fi
GB_BIN=$E2E_ROOT/bin
if [ -d "$E2E_ROOT/extras/genai" ]; then  # genai-bench gets its own path: bench.sweep clears PYTHONPATH for tools
  mkdir -p "$GB_BIN"
  printf '#!/bin/sh\nPYTHONPATH=%s:%s exec python3 -c "import sys; from genai_bench.cli.cli import cli; sys.exit(cli())" "$@"\n' \
    "$E2E_ROOT/extras/genai" "$E2E_ROOT/sglang" > "$GB_BIN/genai-bench"
  chmod +x "$GB_BIN/genai-bench"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Triton's compiled kernels in one place every server and test of every call on this machine shares; carried in
# as .bundle/triton-cache.tar.xz, a fresh machine skips the compiles (a decode's CUDA graph capture took 69 s on
# 2 x H200, most of it the first batch size, where the kernels compile); E2E_SAVE_TRITON_CACHE=1 brings it back as
# $OUT/triton-cache.tar.xz
export TRITON_CACHE_DIR=$E2E_ROOT/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
export SGLANG_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
cd "$ROOT" || exit 1

KIND=${E2E_KIND:-}
if [ -z "$KIND" ]; then  # the machine's name in the results, from its GPUs: 2 x NVIDIA H200 -> nvidia-h200-x2
  KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
    | awk 'NR == 1 {k = tolower($1 "-" $2)} END {if (NR > 1) k = k "-x" NR; print k}')
fi
KIND=${KIND:-nvidia-h200-x2}
python3 -m e2e.machine "$KIND" > "$STATE/machine.json" 2>/dev/null || true
if [ "$PHASE" = transfer-bench ]; then  # the transfer engine alone: torch, Triton, msgspec
  python3 -c "import torch, triton, msgspec, sglang_p2p_backend.engine.transport.cuda_ipc; print('preflight: transfer engine importable, torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    || { echo "run_all.sh: preflight failed: carry .bundle/bench.tar.xz (msgspec; e2e/build_bundle.sh .bundle bench)" >&2; exit 4; }
elif [ "$HAVE_SGLANG" = 0 ] && [ "$PHASE" = deepep ]; then  # the build needs torch and setuptools, no SGLang yet
  python3 -c "import torch, setuptools; print('preflight: torch', torch.__version__, 'CUDA', torch.version.cuda, '(no SGLang bundle yet: mini-b-deepep waits for it)')" \
    || { echo "run_all.sh: preflight failed: torch and setuptools are needed to build DeepEP" >&2; exit 4; }
elif [ "$HAVE_SGLANG" = 0 ]; then  # lb-overhead only: our LB and its client, no SGLang
  python3 -c "import sglang_p2p_lb, aiohttp, orjson; print('preflight: LB importable (no SGLang bundle)')" \
    || { echo "run_all.sh: preflight failed: carry .bundle/lb.tar.xz (its common/ has orjson)" >&2; exit 4; }
elif ! python3 -c "
from importlib.metadata import entry_points
import sglang_p2p_backend, sglang_p2p_lb, sglang
assert any(e.name == 'p2pnccl' for e in entry_points(group='sglang.srt.plugins')), 'p2pnccl entry point not found'
print('preflight: sglang', sglang.__version__, '+ p2pnccl plugin + LB importable')"; then
  echo "run_all.sh: preflight failed (see above)" >&2; exit 4
fi

MODELS=$E2E_ROOT/models
STATUS=0
reap() {  # end the process groups a step left running (servers run in sessions of their own)
  local pid
  [ -f "$E2E_PIDFILE" ] || return 0
  while read -r pid; do
    kill -KILL -- "-$pid" 2>/dev/null || true  # the whole group, also where its leader has already gone
  done < "$E2E_PIDFILE"
  rm -f "$E2E_PIDFILE"
}

step() {  # step NAME CMD...: run with the time that is left, note a failure, never stop the phase
  local name=$1; shift
  local t=$(( $(left) ))
  if [ "$t" -lt 30 ]; then say "$name: skipped, $t s left"; return; fi
  say "$name: start ($t s left)"
  timeout --kill-after=10 "$t" "$@"; local rc=$?
  reap
  say "$name: exit $rc"
  [ "$rc" -eq 0 ] || STATUS=1
}

need_mooncake() {  # need_mooncake WHAT: one GPU moves pages with Mooncake only; without it say why, fail
  if [ "$GPUS" = 2 ] || [ "$HAVE_MOONCAKE" = 1 ]; then return 0; fi
  say "$1: skipped: one GPU needs Mooncake (NCCL rejects two ranks on one GPU); carry .bundle/extras.tar.xz"
  STATUS=1; return 1
}

run_sglang_tests() {
  step models python3 -m e2e.make_tiny_models "$MODELS" --only llama-tiny
  step sglang_tests python3 -m e2e.sglang_tests --sglang-root "$E2E_ROOT/sglang" --model "$MODELS/llama-tiny" \
    --out "$STATE/sglang_tests.json" --logs "$E2E_ROOT/logs/sglang_tests"
}

run_check() {  # one GPU: p2pnccl runs over NCCL (loopback sockets) unless E2E_P2P_1GPU=mooncake|cudaipc
  if [ "${E2E_P2P_1GPU:-nccl}" = mooncake ]; then need_mooncake check || return 0; fi
  step models python3 -m e2e.make_tiny_models "$MODELS" --only "${E2E_CHECK_ONLY:-llama-tiny,mla-tiny}"
  step check python3 -m e2e.check --models "$MODELS" --out "$STATE/check.json" --logs "$E2E_ROOT/logs/check" \
    --only "${E2E_CHECK_ONLY:-llama-tiny,mla-tiny}"
  if [ "$SGLANG_TESTS" = 1 ]; then run_sglang_tests; fi
}

run_perf() {
  need_mooncake perf || return 0
  local backends=p2pnccl
  if [ "$HAVE_MOONCAKE" = 1 ]; then backends=p2pnccl,mooncake
  else say "perf: no extras archive (Mooncake, genai-bench): p2pnccl only"; fi
  step models python3 -m e2e.make_tiny_models "$MODELS" --only llama-anchor
  step perf python3 -m e2e.perf --models "$MODELS" --out "$STATE/perf.json" --logs "$E2E_ROOT/logs/perf" \
    --backends "$backends" --genai-bench-bin "$GB_BIN"
  # SGLang test files an earlier call had no time for run here if they still fit (each knows its length)
  if [ "$SGLANG_TESTS" = 1 ]; then run_sglang_tests; fi
}

run_mooncake_bench() {  # our full PD path (SGLang's KV classes) with both pools on GPU 0, Mooncake tcp only
  if [ "$HAVE_MOONCAKE" = 0 ]; then say "mooncake-bench: no extras archive (Mooncake): carry .bundle/extras.tar.xz"; STATUS=1; return 0; fi
  step mooncake_bench python3 -m bench.mooncake.pd_path --device cuda:0 --machine "$KIND" --timeout 240 \
    --out "$OUTDIR/mooncake_pd_$KIND.json" --logs "$E2E_ROOT/logs/mooncake_bench"
}

run_liveness() {  # SGLang's liveness test N times: p2pnccl over NCCL (E2E_P2P_1GPU=nccl on one GPU) or mooncake
  local backend=${E2E_LIVENESS_BACKEND:-p2pnccl}
  if [ "$backend" = mooncake ]; then need_mooncake liveness || return 0; fi
  step models python3 -m e2e.make_tiny_models "$MODELS" --only llama-tiny
  E2E_P2P_1GPU=${E2E_P2P_1GPU:-nccl} step liveness python3 -m e2e.sglang_tests --sglang-root "$E2E_ROOT/sglang" \
    --model "$MODELS/llama-tiny" --out "$OUTDIR/liveness_$backend.json" --logs "$E2E_ROOT/logs/liveness_$backend" \
    --repeat "${E2E_LIVENESS_RUNS:-30}" --backend "$backend"
}

run_faults() {
  step models python3 -m e2e.make_tiny_models "$MODELS" --only llama-tiny
  step faults python3 -m e2e.faults --models "$MODELS" --out "$OUTDIR/faults.json" --logs "$E2E_ROOT/logs/faults" \
    --only "${E2E_FAULTS:-}"
}

run_lb() {  # --gpus 4: one llama-anchor server per GPU (e2e/lb_layout.py); else all llama-tiny on GPU 0
  local topo=${E2E_LB_TOPOLOGY:-2p2d} gpus=1 model=llama-tiny
  if [ "$GPUS" = 4 ]; then gpus=4; model=llama-anchor; fi
  if [ "$GPUS" = 4 ] && [ ! -d "$E2E_ROOT/lb" ] && [ -z "${E2E_LB_ARGS:-}" ]; then  # a 10-minute call for our LB alone: no
    say "lb: no lb.tar.xz unpacked on this machine: carry .bundle/lb.tar.xz (an earlier call, e.g. --phase lb-overhead)"
    STATUS=1; return 0
  fi
  step models python3 -m e2e.make_tiny_models "$MODELS" --only "$model"
  [ -d "$E2E_ROOT/lb" ] || say "lb: no lb.tar.xz carried: mini_lb and smg are skipped"
  # shellcheck disable=SC2086 # E2E_LB_ARGS: extra flags, word-split on purpose
  step lb_compare python3 -m e2e.lb_compare --models "$MODELS" --gpus "$gpus" --topology "$topo" --bundle-lb "$E2E_ROOT/lb" \
    --machine "$KIND" --out "$OUTDIR/lb_compare_${topo}_$KIND.json" --logs "$E2E_ROOT/logs/lb_compare_$topo" ${E2E_LB_ARGS:-}
}

run_lb_overhead() {  # CPU only: simulated workers, every LB of lb.tar.xz and direct dispatch
  [ -d "$E2E_ROOT/lb" ] || say "lb-overhead: no lb.tar.xz carried: mini_lb and smg are skipped"
  # shellcheck disable=SC2086 # E2E_LB_OVERHEAD_ARGS: extra flags, word-split on purpose
  step lb_overhead python3 -m e2e.lb_overhead --bundle-lb "$E2E_ROOT/lb" --machine "$KIND" \
    --out "$OUTDIR/lb_overhead_$KIND.json" --logs "$E2E_ROOT/logs/lb_overhead" ${E2E_LB_OVERHEAD_ARGS:-}
}

run_ipc() {  # pytest output goes to $OUT/ipc_tests.log; figures to $OUT/ipc_$KIND.json
  step ipc_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_page_kernel.py tests/gpu/test_cuda_ipc.py -rs \
    > "$OUTDIR/ipc_tests.log" 2>&1
  # shellcheck disable=SC2086 # E2E_IPC_BENCH_ARGS: extra flags, e.g. "--reps 10 --timeout 90"
  step ipc_bench python3 bench/transfer/ipc_bench.py --machine "$KIND" --out "$OUTDIR/ipc_$KIND.json" ${E2E_IPC_BENCH_ARGS:-}
  local k=${E2E_IPC_SGLANG_K-"cudaipc"}
  if [ -n "$k" ]; then
    step ipc_sglang python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pd_sglang_cuda.py -k "$k" -rs \
      >> "$OUTDIR/ipc_tests.log" 2>&1
  fi
  cat "$OUTDIR/ipc_tests.log"
}

run_transfer_bench() {  # figures to $OUT/xfer_$KIND.json, the printed tables to $OUT/xfer_$KIND.log
  if [ "${E2E_XFER_TESTS:-1}" = 1 ]; then  # the bytes first: the copy-engine path, the NCCL pipeline (overlap on)
    # with the split communicator (the default; SGLANG_P2P_NCCL_SPLIT=0 turns it off), also its abort path: a
    # peer killed mid-transfer (~1 min more)
    local split_tests=()
    [ "${SGLANG_P2P_NCCL_SPLIT:-1}" = 1 ] && \
      split_tests=("tests/gpu/test_nccl_transport.py::test_peer_killed_mid_transfer_fails_in_time_then_a_new_communicator_works")
    step copy_engine_tests python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_copy_engine.py \
      tests/gpu/test_page_kernel.py tests/gpu/test_cuda_ipc.py tests/gpu/test_engine_pipeline_nccl.py "tests/gpu/test_nccl_transport.py::test_waits_sleep_until_the_pace_the_link_showed" \
      "${split_tests[@]}" -rs > "$OUTDIR/xfer_tests.log" 2>&1
    tail -n 30 "$OUTDIR/xfer_tests.log"
  fi
  # the bench stops starting cases 60 s before the phase's deadline (its processes need ~20 s to start)
  local budget=$(( $(left) - 60 ))
  # shellcheck disable=SC2086 # E2E_XFER_ARGS: extra flags, word-split on purpose
  step transfer_bench python3 bench/transfer/xfer_bench.py --machine "$KIND" --out "$OUTDIR/xfer_$KIND.json" \
    --budget-s "$budget" ${E2E_XFER_ARGS:-} > "$OUTDIR/xfer_$KIND.log" 2>&1
  cat "$OUTDIR/xfer_$KIND.log"
}

run_serve() {  # E2E_SERVE_ARGS: e2e.serve's flags (--modes, --cells, --reps, --extra, --profile)
  if [ ! -d "$E2E_ROOT/serve/nixl" ]; then
    say "serve: no NIXL: carry .bundle/serve.tar.xz (e2e/build_bundle.sh .bundle serve) in this or an earlier call"
    STATUS=1; return 0
  fi
  step models python3 -m e2e.make_tiny_models "$MODELS" --only llama-anchor
  local where=()
  [ "$GPUS" != 1 ] && where=(--decode-gpu 1)  # two GPUs: prefills on GPU 0, decodes on GPU 1 (the KV crosses NVLink)
  # shellcheck disable=SC2086
  step serve python3 -m e2e.serve --models "$MODELS" --out "$OUTDIR/serve_$KIND.json" --logs "$E2E_ROOT/logs/serve" \
    --machine "$KIND" --pyspy "$E2E_ROOT/serve/bin/py-spy" "${where[@]}" ${E2E_SERVE_ARGS:-}
}

run_shapes() {
  step models python3 -m e2e.make_tiny_models "$MODELS" --only deepseek-tiny,llama-tiny
  step shapes python3 -m e2e.shapes --models "$MODELS" --out "$OUTDIR/shapes_$KIND.json" \
    --logs "$E2E_ROOT/logs/shapes" --only "${E2E_SHAPES:-mini-a-2p-dpdecode,mini-b-dp-both,mini-c-tp1-tp2,mini-c-tp2-tp1,mini-c-tp1-tp4}"
}

run_shape_faults() {
  step models python3 -m e2e.make_tiny_models "$MODELS" --only deepseek-tiny
  step shape_faults python3 -m e2e.shape_faults --models "$MODELS" --out "$OUTDIR/shape_faults_$KIND.json" \
    --logs "$E2E_ROOT/logs/shape_faults"
}

run_shape_serve() {
  if [ ! -d "$E2E_ROOT/serve/nixl" ]; then
    say "shape-serve: no NIXL: carry .bundle/serve.tar.xz (e2e/build_bundle.sh .bundle serve) in this or an earlier call"
    STATUS=1; return 0
  fi
  local shape=${E2E_SERVE_SHAPE:-mini-a-serve}
  step models python3 -m e2e.make_tiny_models "$MODELS" --only deepseek-anchor
  # shellcheck disable=SC2086 # E2E_SERVE_ARGS: extra flags, word-split on purpose
  step shape_serve python3 -m e2e.shape_serve --models "$MODELS" --shape "$shape" --machine "$KIND" \
    --out "$OUTDIR/shape_serve_${shape}_$KIND.json" --logs "$E2E_ROOT/logs/shape_serve" \
    --pyspy "$E2E_ROOT/serve/bin/py-spy" ${E2E_SERVE_ARGS:-}
}

run_deepep() {  # e2e/deepep.py: each step once per machine; the shape when SGLang and 4 GPUs are there
  step deepep python3 -m e2e.deepep run --root "$E2E_ROOT" --models "$MODELS" --gpus "$GPUS" \
    --out "$OUTDIR/deepep_$KIND.json" --logs "$E2E_ROOT/logs/deepep" --built-out "$OUTDIR/deepep_built.tar.xz" \
    --shapes-out "$OUTDIR/shapes_mini-b-deepep_$KIND.json" --shape-steps "${E2E_DEEPEP_SHAPES:-shapes,shapes_ll}"
}

case "$PHASE" in
  deepep) run_deepep ;;
  shapes) run_shapes ;;
  shape-serve) run_shape_serve ;;
  shape-faults) run_shape_faults ;;
  serve) run_serve ;;
  ipc) run_ipc ;;
  transfer-bench) run_transfer_bench ;;
  liveness) run_liveness ;;
  faults) run_faults ;;
  check) run_check ;;
  lb) run_lb ;;
  lb-overhead) run_lb_overhead ;;
  sglang-tests) run_sglang_tests ;;
  perf) run_perf ;;
  all) run_check; run_perf ;;
  mooncake-bench) run_mooncake_bench ;;
esac

# --- 3. results: every step this machine has done so far, merged --------------------------------------------
python3 -m e2e.results --state "$STATE" --machine-json "$STATE/machine.json" --out "$OUTDIR/e2e_results.json" \
  --gpus "$GPUS" >/dev/null
python3 -m e2e.report "$OUTDIR/e2e_results.json" > "$OUTDIR/e2e_report.md" || STATUS=1
[ -d "$E2E_ROOT/logs" ] && { (cd "$E2E_ROOT" && python3 -m tarfile -c "$OUTDIR/e2e_logs_$PHASE.tgz" logs) || true; }
cat "$OUTDIR/e2e_report.md"
if [ "${E2E_SAVE_TRITON_CACHE:-0}" = 1 ]; then
  python3 -m e2e.triton_cache pack "$TRITON_CACHE_DIR" "$OUTDIR/triton-cache.tar.xz" || true
fi
say "done (status $STATUS); results in $OUTDIR"
exit $STATUS
