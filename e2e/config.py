"""Server flags, ports and per-backend environment shared by the check, perf and SGLang-test steps."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from .servers import Server

# Flags seen working on the lent H200 hosts with the slim sglang-kernel (no FlashAttention-3 / FlashMLA
# libraries in the bundle): triton attention, pytorch sampling, no CUDA graphs (saves ~70 s of capture). The
# host runs used --disable-cuda-graph, which 0.5.17 deprecates; its replacement is the two per-phase backends.
BASE_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch",
              "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
              "--skip-server-warmup", "--enable-metrics", "--log-level", "info"]
# Correctness: identical flags on the reference and on P/D; radix cache off so every request prefills in full;
# fp32 lm_head so the logprobs are not rounded to bf16; a small chunk so every prompt above 64 tokens is
# prefilled (and, on P, sent) in several chunks.
CHECK_FLAGS = [*BASE_FLAGS, "--disable-radix-cache", "--enable-fp32-lm-head", "--chunked-prefill-size", "64",
               "--mem-fraction-static", "0.2", "--max-total-tokens", "131072", "--random-seed", "0"]
# Timing: 64 requests x (4k prompt + 32) in flight need ~264k tokens of KV (128 KiB each on the anchor model).
# Two prefills share GPU 0 (and two decodes GPU 1): the second one's budget is 0.45 of what the first left.
PERF_FLAGS = [*BASE_FLAGS, "--mem-fraction-static", "0.45", "--max-total-tokens", "280000"]

COMMON_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",  # bootstrap and backend addresses stay on loopback
    # NVLink multicast off (it can take a shared host's GPUs out of service), also in every child process
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
}
BACKEND_ENV = {
    "p2pnccl": {"SGLANG_P2P_TRANSPORT": "auto"},  # auto picks NCCL between GPUs
    # Mooncake's strongest path on this host: intra-node NVLink (CUDA IPC), not TCP (no RDMA NICs there)
    "mooncake": {"MC_INTRANODE_NVLINK": "true", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"},
}


def e2e_root() -> Path:
    return Path(os.environ.get("E2E_ROOT", "/tmp/e2e"))


def deadline_from_env(default_s: float = 540.0) -> float:
    """Monotonic deadline of the current phase: run_all.sh exports E2E_DEADLINE_EPOCH (wall-clock seconds)."""
    epoch = float(os.environ.get("E2E_DEADLINE_EPOCH", time.time() + default_s))
    return time.monotonic() + (epoch - time.time())


def pd_pair(name: str, model: Path, backend: str, base_port: int, flags: Sequence[str]) -> tuple[Server, Server, Server]:
    """Prefill on GPU 0, decode on GPU 1 and our LB in front: ports base, base+1, base+2; bootstrap base+3."""
    env = {**COMMON_ENV, **BACKEND_ENV[backend]}
    p = Server(f"{name}-{backend}-prefill", base_port, "prefill", model, gpu=0, backend=backend,
               bootstrap_port=base_port + 3, args=list(flags), env=env)
    d = Server(f"{name}-{backend}-decode", base_port + 1, "decode", model, gpu=1, backend=backend,
               args=list(flags), env=env)
    lb = Server(f"{name}-{backend}-lb", base_port + 2, "lb", lb_prefill=p, lb_decode=d)
    return p, d, lb


def reference(name: str, model: Path, port: int, gpu: int, flags: Sequence[str]) -> Server:
    return Server(f"{name}-reference", port, "null", model, gpu=gpu, args=list(flags), env=dict(COMMON_ENV))
