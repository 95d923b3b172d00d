#!/usr/bin/env bash
# Runs a command inside the SGLang container with what multi-node PD with DeepEP and RDMA needs, from
# this checkout (mounted at the same path, working directory = checkout). Examples:
#   launch/docker_run.sh launch/node.sh --config configs/topologies/p3x3-d4.yaml --rank 0
#   launch/docker_run.sh launch/lb.sh --config configs/topologies/p3x3-d4.yaml
# Environment:
#   IMAGE          container image with SGLang 0.5.23 or 0.5.17 (default lmsysorg/sglang:v0.5.23)
#   SHM_SIZE       /dev/shm size (default 64g)
#   MOUNTS         "SRC:DST[:ro]" mounts, space-separated (default: /models and /workspace if they exist;
#                  empty: none)
#   PIP_INSTALL=0  skip installing this project into the container (when the image already has it)
#   DOCKER_EXTRA_ARGS  more `docker run` options, space-separated (e.g. --privileged for DeepEP IBGDA)
set -euo pipefail
if [ $# -eq 0 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
image=${IMAGE:-lmsysorg/sglang:v0.5.23}

opts=(
  --rm --init
  --name "sglang-pd-$(hostname -s)-$$"
  --gpus all
  # every server, NCCL, DeepEP, the bootstrap server and torch.distributed bind host ports that peers on
  # other nodes dial by the host's own address: no NAT in between
  --network host
  # CUDA IPC between the 8 GPU ranks of a node and torch tensors shared between processes
  --ipc host
  # RDMA verbs devices for NCCL's IB transport, DeepEP (NVSHMEM) and Mooncake
  --device /dev/infiniband
  # RDMA registration pins memory; the default 64 KiB memlock limit makes ibv_reg_mr fail
  --ulimit memlock=-1:-1
  --cap-add IPC_LOCK
  # NCCL's intra-node shared-memory transport and torch shared tensors; docker's 64 MB default is far too small
  --shm-size "${SHM_SIZE:-64g}"
  -v "$root:$root" -w "$root"
)
# the launcher reads the node's rank from these; docker passes each only if it is set here
for var in RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE PYTHON; do
  opts+=(-e "$var")
done
default_mounts=""
for dir in /models /workspace; do
  if [ -d "$dir" ]; then default_mounts+=" $dir:$dir"; fi
done
read -r -a mounts <<< "${MOUNTS-$default_mounts}"
for m in "${mounts[@]}"; do
  opts+=(-v "$m")
done
read -r -a extra <<< "${DOCKER_EXTRA_ARGS:-}"
opts+=("${extra[@]}")

if [ "${PIP_INSTALL:-1}" = 1 ]; then
  # registers the p2pnccl plugin's entry point in the container's SGLang environment, then runs the command
  # shellcheck disable=SC2016  # $@ is expanded by the container's bash, not here
  exec docker run "${opts[@]}" "$image" bash -c \
    'pip install -q --no-deps --no-build-isolation -e . && exec "$@"' bash "$@"
fi
exec docker run "${opts[@]}" "$image" "$@"
