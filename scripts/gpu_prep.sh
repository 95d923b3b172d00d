#!/bin/bash
# Source on a GPU host (device machine) before tests/gpu: unpacks the SGLang bundle the way e2e/run_all.sh does
# (same marker, so either may go first), makes the p2pnccl entry point discoverable and sets the NVLink safety
# variables. Usage:  . scripts/gpu_prep.sh   (carry .bundle/sglang.tar.xz, built by e2e/build_bundle.sh)
A=.bundle/sglang.tar.xz; D=/tmp/e2e/sglang; mkdir -p /tmp/e2e
if [ -f "$A" ]; then
  sum=$(cksum < "$A")
  if [ "$(cat $D/.unpacked 2>/dev/null)" != "$sum" ]; then
    rm -rf $D && mkdir -p $D && python3 -m tarfile -e "$A" "$D" && echo "$sum" > $D/.unpacked
  fi
fi
python3 -m e2e.distinfo /tmp/e2e/plugin >/dev/null
export PYTHONPATH=$PWD:$PWD/lb:$PWD/e2e/stubs:/tmp/e2e/plugin:/tmp/e2e/sglang:/tmp/e2e/extras/mooncake
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -c "import msgspec" 2>/dev/null || pip install -q --no-deps .whl/*.whl
