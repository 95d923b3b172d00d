#!/bin/bash
# Builds what the end-to-end check needs on the GPU host (torch 2.11.0+cu130, Python 3.12, no internet) as two
# archives, each under the 60 MiB that one device call can carry beside the repository:
#
#   bash e2e/build_bundle.sh [OUT_DIR [sglang|extras|serve|lb|bench|tms|deepep]]  (default: .bundle/, sglang and extras; ignored by git;
#                                                         ~8 min on 2 cores, xz is most of it)
#
#   sglang.tar.xz  SGLang 0.5.17 and everything its server imports: the recipe below
#                  (slim sglang-kernel: FlashAttention-3, SM100, FlashMLA libraries left out; xgrammar without its
#                  static library), packed with xz instead of two zips (~55 MiB instead of 60 + 38).
#   extras.tar.xz  mooncake/  Mooncake TE for CUDA 13 (0.3.14), only the transfer engine and the NVLink allocator
#                             (the store, EP, PG and their libraries are not used by PD transfers)
#                  genai/     genai-bench 0.0.5 and what it needs that the host image lacks; the OCI SDK without its
#                             service modules (genai-bench imports oci.config at start; services load lazily)
#   serve.tar.xz   nixl/      NIXL 1.5.1 for CUDA 13 (nixl + nixl-cu13 wheels: Python API, UCX plugin, UCX modules;
#                             e2e/slim_nixl.py), what SGLang's own nixl backend imports; only with `serve` named
#                  mooncake/  Mooncake TE for CUDA 13, slimmed as in extras (the serve phase's third column)
#                  bin/py-spy the sampling profiler the serve phase attaches to the schedulers
#   lb.tar.xz      the peer routers the LB comparison (e2e/lb_compare.py) runs against, each in a folder of its own
#                  so it goes only on that router's PYTHONPATH:
#                  smg/      smg 1.13.0 (sgl-model-gateway) with its closure (grpcio, grpcio-health-checking,
#                            protobuf, PyYAML, setproctitle), whatever versions the host image has
#                  minilb/   sglang-router 0.3.2 (SGLang's mini_lb; its argument parser loads the Rust module too);
#                            fastapi, uvicorn, orjson and aiohttp come from sglang.tar.xz and the host image
#                  common/   orjson, fastapi, uvicorn, pydantic, setproctitle (sglang.tar.xz's versions): what
#                            our LB and mini_lb need beyond the host image, on the path only where no SGLang bundle
#                            is unpacked, so run_all.sh --phase lb-overhead runs in a call that carries lb.tar.xz
#                            alone (50 MiB in all)
#   bench.tar.xz   msgspec alone (0.2 MiB): the one package the transfer engine imports that the host image lacks, so
#                  run_all.sh --phase transfer-bench (bench/transfer/xfer_bench.py) runs without the SGLang bundle
#   tms.tar.xz     torch_memory_saver 0.0.10 (0.4 MiB), which --enable-memory-saver needs and the host image lacks: its
#                  Python package and the two CUDA 13 hook libraries only (E2E_CHECK_MEMORY_SAVER=1 in the check)
#   deepep.tar.xz  src/      DeepEP's source at the commit e2e/deepep.py pins (DEEPEP_COMMIT: the last of the v1
#                            line), only what setup.py builds and DeepEP's tests, taken with `git archive` from a
#                            clone of deepseek-ai/DeepEP named by DEEPEP_GIT (GitHub is no package registry: get
#                            the clone once, by whatever means the session has); src/COMMIT names the commit
#                  deepgemm/ sgl-deep-gemm 0.1.5.post1 and apache-tvm-ffi 0.1.11, the DeepGEMM SGLang 0.5.17 pins
#                            (its experts run on DeepGEMM under DeepEP); DEEPEP_WHEELS=DIR takes the two wheels
#                            from DIR instead of pip (offline)
#                  include/  rdma-core's <infiniband/*.h> (Debian's libibverbs-dev) and <rdma/ib_user_verbs.h>
#                            (linux-libc-dev): NVSHMEM's device headers include <infiniband/mlx5dv.h>, which an
#                            image without libibverbs-dev lacks; apt-get download, or DEEPEP_DEBS=DIR with the two
#                            .deb files. ~4 MiB in all: run_all.sh --phase deepep builds DeepEP on the GPU host in a
#                            call of its own (sglang.tar.xz comes in the next)
# Needs pip (any Python) and network here; PIP_INDEX_URL etc. are honoured. XZ_THREADS (default 2).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(realpath -m "${1:-$ROOT/.bundle}"); mkdir -p "$OUT"
WHICH=${2:-sglang extras}
# a device call carries the repository's tracked files and one archive, 64 MiB together: an archive must leave
# room for the repository as it is now, and a little for the results the next commits add
TRAVEL_BYTES=$((64 << 20)) MARGIN_BYTES=$((512 << 10))
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
PY=${PYTHON:-python3}

dl() {  # dl DIR SPEC...: wheels for the GPU host, no dependency resolution (each set is listed in full)
  local dir=$1; shift
  mkdir -p "$dir"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps "${PLAT[@]}" -d "$dir" "$@" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
}

unpack_wheels() {  # unpack_wheels WHEEL_DIR DEST: unzip every wheel, leaving out the parts named in slim_args
  local w
  for w in "$1"/*.whl; do
    # the patterns must reach unzip unexpanded: word splitting on, globbing off
    # shellcheck disable=SC2046  # slim_args prints the exclusion patterns one per word on purpose
    (set -f; unzip -q -o "$w" -d "$2" $(slim_args "$(basename "$w")"))
  done
}

slim_args() {  # the unzip -x patterns for one wheel (files never used by a text model's PD serving)
  case "$1" in
    sglang_kernel-*) echo "-x sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100/* sgl_kernel/infllm_ops* sgl_kernel/flashmla_ops*" ;;
    xgrammar-*) echo "-x xgrammar/lib/*" ;;  # a 65 MB static archive, unused at run time
    mooncake_transfer_engine*) echo "-x mooncake/_store* mooncake/_ep* mooncake/libmooncake_* mooncake/mooncake_client
      mooncake/mooncake_master mooncake/transfer_engine_bench mooncake/mooncake_ep_jit/* mooncake/_pg_jit/*
      mooncake/reshard/* mooncake_transfer_engine_cuda13.libs/libetcd_wrapper-* mooncake_transfer_engine_cuda13.libs/libzmq-*
      mooncake_transfer_engine_cuda13.libs/libsodium-* mooncake_transfer_engine_cuda13.libs/libpgm-*
      mooncake_transfer_engine_cuda13.libs/libunwind-* mooncake_transfer_engine_cuda13.libs/liburing-*
      mooncake_transfer_engine_cuda13.libs/libcrypto-* mooncake_transfer_engine_cuda13.libs/libxxhash-*
      mooncake_transfer_engine_cuda13.libs/libzstd-*" ;;
    *) ;;
  esac
}

pack() {  # pack NAME DIR: DIR's contents -> OUT/NAME.tar.xz, refused when over the limit
  find "$2" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$2" -cf - . | xz -9 -T"${XZ_THREADS:-2}" > "$OUT/$1.tar.xz.tmp"
  mv "$OUT/$1.tar.xz.tmp" "$OUT/$1.tar.xz"
  local size repo
  size=$(stat -c %s "$OUT/$1.tar.xz")
  repo=$(repo_bytes)
  echo "$OUT/$1.tar.xz: $((size >> 20)) MiB; with the repository's $((repo >> 10)) KiB: $(((size + repo) >> 10)) KiB of the $((TRAVEL_BYTES >> 10)) KiB a call carries"
  if [ $((size + repo + MARGIN_BYTES)) -gt "$TRAVEL_BYTES" ]; then
    echo "build_bundle.sh: $1.tar.xz and the repository exceed what one device call carries (64 MiB, $((MARGIN_BYTES >> 10)) KiB kept free): leave more out of the archive" >&2
    exit 1
  fi
}

repo_bytes() {  # the bytes of the repository's tracked files: what travels with every device call
  git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 stat -c %s 2>/dev/null) | awk '{s += $1} END {print s + 0}'
}

check_needed_libs() {  # every shared library a kept .so needs is either kept beside it or a system library
  local dir=$1 so lib missing=0
  while IFS= read -r so; do
    for lib in $(readelf -d "$so" 2>/dev/null | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'); do
      case "$lib" in
        libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|libresolv.so*) ;;
        libcuda.so*|libcudart.so*|libibverbs.so*|libmlx5.so*|libnuma.so*|libcurl.so*|libz.so*) ;;  # on the host
        libnvidia-ml.so*|libssl.so.3|libcrypto.so.3) ;;  # the driver's NVML, OpenSSL 3: on the host (NIXL's grpc)
        *) [ -n "$(find "$dir" -name "$lib" -print -quit)" ] || { echo "missing $lib (needed by $so)" >&2; missing=1; } ;;
      esac
    done
  done < <(find "$dir" -name "*.so*" -type f)
  return $missing
}

build_sglang() {
  dl "$W/w1" sglang==0.5.17 sglang-kernel==0.4.5 transformers==5.12.1 openai==2.6.1 pyzmq fastapi starlette uvicorn \
     pydantic pydantic-core annotated-types typing-inspection orjson msgspec setproctitle interegular \
     partial-json-parser distro jiter pybase64 python-multipart dill gguf ipython traitlets jedi parso decorator \
     pexpect ptyprocess prompt_toolkit wcwidth stack_data asttokens executing pure_eval matplotlib-inline \
     ipython-pygments-lexers zstandard apache-tvm-ffi==0.1.11 opentelemetry-api \
     xgrammar==0.2.1 sniffio compressed-tensors==0.18.0 loguru flashinfer-python==0.6.15.post1 jsonschema \
     jsonschema-specifications referencing rpds-py watchfiles blobfile pycryptodomex openai-harmony==0.0.4 llguidance \
     datasets==4.8.4 multiprocess==0.70.19
  # datasets: sglang.test.test_utils imports sglang.benchmark, which imports it (SGLang's PD tests need test_utils)
  mkdir -p "$W/sglang"
  unpack_wheels "$W/w1" "$W/sglang"
  rm -rf "$W/sglang"/sglang/multimodal_gen "$W/sglang"/sglang/test/srt "$W/sglang"/jedi/third_party/typeshed \
         "$W/sglang"/zstandard/_cffi*.so "$W/sglang"/Cryptodome
  # Cryptodome (1.4 MiB packed): blobfile imports it only to sign Google Cloud Storage requests; without it the
  # archive and the repository together fit the 64 MiB a device call carries
  find "$W/sglang" -name "*.pyi" -delete
  # tvm_ffi's libbacktrace sources (its library is built in) and jedi's RECORD (0.7 MiB unpacked): room the repository
  # outgrew. Other RECORD files must stay: tvm_ffi finds xgrammar's bindings library through its package's RECORD
  rm -rf "$W/sglang"/tvm_ffi/3rdparty/libbacktrace "$W/sglang"/jedi-*.dist-info/RECORD
  # transformers 5.12.1 pins tokenizers <=0.23.0; the host ships 0.23.2, which works for our use
  sed -i 's/"tokenizers": "tokenizers>=0.22.0,<=0.23.0"/"tokenizers": "tokenizers>=0.22.0,<=0.24.0"/' \
    "$W/sglang/transformers/dependency_versions_table.py"
  # the PD test files the check runs must be in the wheel (sglang/test/manual/disaggregation)
  test -f "$W/sglang/sglang/test/manual/disaggregation/test_disaggregation_chunked_prefill_abort.py"
  pack sglang "$W/sglang"
  rm -rf "$W/w1" "$W/sglang"
}

build_extras() {
  dl "$W/w2" mooncake-transfer-engine-cuda13==0.3.14
  mkdir -p "$W/extras/mooncake"
  unpack_wheels "$W/w2" "$W/extras/mooncake"
  check_needed_libs "$W/extras/mooncake" || { echo "build_bundle.sh: Mooncake slimmed too far" >&2; exit 1; }
  # genai-bench's closure less what the host image has (KINDS.md package list) and what sglang.tar.xz has
  # (datasets and multiprocess among them: the genai-bench wrapper puts the SGLang tree on its path too)
  dl "$W/w3" genai-bench==0.0.5 locust==2.47.0 gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.5.6 \
     zope-event==6.2 zope-interface==8.7 flask==3.1.3 flask-cors==6.0.5 flask-login==0.6.3 itsdangerous==2.2.0 \
     blinker==1.9.0 configargparse==1.9.0 brotli==1.2.1 python-socketio==5.18.1 python-engineio==4.15.1 \
     bidict==0.24.1 simple-websocket==1.1.0 wsproto==1.3.2 \
     openpyxl==3.1.5 et-xmlfile==2.0.0 tenacity==9.2.1 oci==2.189.0 oci-openai==1.1.0 circuitbreaker==2.1.3 \
     cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pyopenssl==26.4.0 pyjwt==2.15.1 pytz==2026.6 \
     asn1crypto==1.5.1 python-pkcs11==0.9.4 crc32c==2.8 truststore==0.10.5 httpx2==2.16.2 httpcore2==2.16.2
  mkdir -p "$W/extras/genai"
  unpack_wheels "$W/w3" "$W/extras/genai"
  # the OCI SDK is 500 MB unpacked, almost all of it service clients that load on first use (oci.__getattr__)
  "$PY" "$ROOT/e2e/slim_oci.py" "$W/extras/genai/oci"
  pack extras "$W/extras"
}

build_serve() {  # serve.tar.xz: the serve phase's peers (NIXL with its UCX plugin, Mooncake) and py-spy
  dl "$W/w4" nixl==1.5.1 nixl-cu13==1.5.1 py-spy==0.4.3
  mkdir -p "$W/serve/nixl" "$W/serve/bin" "$W/serve/mooncake"
  unzip -q -o "$W/w4"/py_spy-*.whl -d "$W/w4/pyspy"
  find "$W/w4/pyspy" -name py-spy -type f -exec cp {} "$W/serve/bin/py-spy" \;
  chmod +x "$W/serve/bin/py-spy"
  rm -rf "$W/w4"/py_spy-*.whl "$W/w4/pyspy"
  unpack_wheels "$W/w4" "$W/serve/nixl"
  (cd "$ROOT" && "$PY" -m e2e.slim_nixl "$W/serve/nixl")
  dl "$W/w5" mooncake-transfer-engine-cuda13==0.3.14
  unpack_wheels "$W/w5" "$W/serve/mooncake"
  check_needed_libs "$W/serve" || { echo "build_bundle.sh: NIXL or Mooncake slimmed too far" >&2; exit 1; }
  pack serve "$W/serve"
}

build_lb() {
  dl "$W/w6" smg==1.13.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2 pyyaml==6.0.4 setproctitle==1.3.8
  mkdir -p "$W/lb/smg"
  unpack_wheels "$W/w6" "$W/lb/smg"
  dl "$W/w7" sglang-router==0.3.2
  mkdir -p "$W/lb/minilb"
  unpack_wheels "$W/w7" "$W/lb/minilb"
  # the versions sglang.tar.xz carries
  dl "$W/w8" orjson==3.13.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
     annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 setproctitle==1.3.8
  mkdir -p "$W/lb/common"
  unpack_wheels "$W/w8" "$W/lb/common"
  check_needed_libs "$W/lb" || { echo "build_bundle.sh: a peer router misses a library" >&2; exit 1; }
  pack lb "$W/lb"
}

build_bench() {  # msgspec at the version the project pins (requirements/cpu-common.txt)
  local pin
  pin=$(grep -E '^msgspec==' "$ROOT/requirements/cpu-common.txt")
  dl "$W/w9" "$pin"
  mkdir -p "$W/bench"
  unpack_wheels "$W/w9" "$W/bench"
  pack bench "$W/bench"
}

build_tms() {  # torch_memory_saver for torch's CUDA 13: the package and its *_cu13 hook libraries
  dl "$W/w13" torch_memory_saver==0.0.10
  mkdir -p "$W/tms/torch_memory_saver"
  unzip -q -o "$W"/w13/torch_memory_saver-*.whl -d "$W/tms/torch_memory_saver" \
    -x 'torch_memory_saver_hook_mode_preload.abi3.so' 'torch_memory_saver_hook_mode_torch.abi3.so' '*_cu12.abi3.so'
  pack tms "$W/tms"
}

build_deepep() {  # deepep.tar.xz: DeepEP's source at the pinned commit, DeepGEMM with its tvm-ffi
  local git_dir=${DEEPEP_GIT:-} commit
  if [ -z "$git_dir" ]; then
    for git_dir in "$ROOT/.deepep/DeepEP.git" "$ROOT/.deepep/DeepEP" ""; do
      [ -n "$git_dir" ] && git -C "$git_dir" rev-parse --git-dir >/dev/null 2>&1 && break
    done
  fi
  if [ -z "$git_dir" ]; then
    echo "build_bundle.sh: deepep needs a clone of deepseek-ai/DeepEP: set DEEPEP_GIT to its git directory" >&2; exit 1
  fi
  commit=${DEEPEP_COMMIT:-$(sed -n 's/^DEEPEP_COMMIT = "\([0-9a-f]*\)".*/\1/p' "$ROOT/e2e/deepep.py")}
  mkdir -p "$W/deepep/src"
  git -C "$git_dir" archive --format=tar "$commit" -- setup.py csrc deep_ep tests LICENSE README.md \
    | tar -x -C "$W/deepep/src"
  echo "$commit" > "$W/deepep/src/COMMIT"
  if [ -n "${DEEPEP_WHEELS:-}" ]; then
    mkdir -p "$W/w11" && cp "$DEEPEP_WHEELS"/sgl_deep_gemm-*.whl "$DEEPEP_WHEELS"/apache_tvm_ffi-*.whl "$W/w11/"
  else
    dl "$W/w11" sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11
  fi
  mkdir -p "$W/deepep/deepgemm"
  unpack_wheels "$W/w11" "$W/deepep/deepgemm"
  mkdir -p "$W/w12/x" "$W/deepep/include/rdma"
  if [ -n "${DEEPEP_DEBS:-}" ]; then
    cp "$DEEPEP_DEBS"/libibverbs-dev_*.deb "$DEEPEP_DEBS"/linux-libc-dev_*.deb "$W/w12/"
  else
    (cd "$W/w12" && apt-get download libibverbs-dev linux-libc-dev 2>&1 | grep -v "unsandboxed" || true)
  fi
  for deb in "$W"/w12/*.deb; do dpkg-deb -x "$deb" "$W/w12/x"; done
  cp -r "$W/w12/x/usr/include/infiniband" "$W/deepep/include/"
  cp "$W/w12/x/usr/include/rdma/ib_user_verbs.h" "$W/deepep/include/rdma/"
  (cd "$ROOT" && "$PY" -m e2e.deepep check-bundle "$W/deepep") || { echo "build_bundle.sh: deepep bundle incomplete" >&2; exit 1; }
  pack deepep "$W/deepep"
}

# sglang.tar.xz: SGLang and its import chain; extras.tar.xz: Mooncake and genai-bench; serve.tar.xz: NIXL,
# Mooncake, py-spy; lb.tar.xz: smg and mini_lb
for part in $WHICH; do
  case "$part" in
    sglang) build_sglang ;;
    extras) build_extras ;;
    serve) build_serve ;;
    lb) build_lb ;;
    bench) build_bench ;;
    tms) build_tms ;;
    deepep) build_deepep ;;
    *) echo "build_bundle.sh: unknown part $part (sglang, extras, serve, lb, bench, tms or deepep)" >&2; exit 2 ;;
  esac
done
ls -la "$OUT"
