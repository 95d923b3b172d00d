"""Server flags, ports and per-backend environment shared by the check, perf and SGLang-test steps."""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

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

# --- single-GPU mode (run_all.sh --gpus 1, E2E_GPUS=1): every server on GPU 0 -------------------------------------
# How SGLang 0.5.17 sizes its KV pool (mem_cache/kv_cache_configurator.py, _profile_available_bytes):
#   budget = free_now - free_at_start * (1 - mem_fraction_static)
# where free_at_start is what the GPU had free when this server began (before its weights), so memory that other
# servers already hold is simply not in it; then --max-total-tokens caps the pool (config_from_budget). So on a
# shared GPU --mem-fraction-static is only the lower bound "the cap must fit in f x what was free", and the cap
# is what a server really takes. Every flag set below is capped well under the GPU:
# * check: CHECK_FLAGS unchanged (the reference and P/D must keep identical flags): 131072 tokens of 2-2.3 KiB
#   (llama-tiny, mla-tiny) = ~0.3 GiB of KV a server; six servers with CUDA context and weights take ~15 GiB.
#   With f = 0.2 each start needs only 0.3 GiB out of 0.2 x (>= 60 GiB free), so servers may start three at a
#   time (CHECK_LANES_1GPU) instead of one after the other (e2e/servers.py), a ~3 x shorter launch.
# * perf: 280000 tokens x 128 KiB = 34 GiB a server; four at once (two pairs) do not fit one GPU, so the pairs run
#   one after the other (perf.py), each pair started prefill first, decode once the prefill's pool is allocated
#   (one lane). The decode then sees ~100 GiB free on an H200 and needs 34 GiB of 0.6 x 100; on an 80 GB H100 the
#   cap drops to 200000 tokens (24 GiB a server: 0.6 x ~51 GiB free > 25 GiB; 0.45 would not do there), and the
#   rest (0.4 x free) stays free for activations. The cap is in the results ("flags"), so runs on the two kinds
#   are not mixed up.
# * SGLang's own PD tests start prefill and decode at once without a cap: sglang_tests.py adds --base-gpu-id 0
#   and a 131072-token cap for them.
PERF_TOKENS_1GPU = {"large": 280000, "small": 200000}  # >= 120 GiB GPU (H200) / less (H100 80 GB)
PERF_MEM_FRACTION_1GPU = "0.6"
CHECK_LANES_1GPU = 3
# NCCL refuses two ranks of one communicator on one GPU of one host ("duplicate GPU"). On one GPU p2pnccl
# therefore runs either
# * over real NCCL with each server naming a host of its own (NCCL_HOSTID, testing/launch.py one_gpu_env): NCCL
#   then moves the pages through its socket transport on loopback. The check uses this: it proves the NCCL path
#   inside SGLang (not NVLink speed). It needs per-server environments, which SGLang's own tests cannot give
#   (their fixture starts both servers with one environment), so
# * perf and SGLang's tests use p2pnccl's Mooncake transport over tcp (the CUDA build of Mooncake copies GPU
#   memory through host buffers), and SGLang's mooncake backend runs on tcp as well, so both move pages the
#   same way (no intra-node NVLink: there is one GPU). E2E_P2P_1GPU=nccl|mooncake|cudaipc overrides the choice;
#   for SGLang's tests, nccl sets SGLANG_P2P_ONE_GPU_NCCL=1 (each server takes a host id when it loads the
#   plugin); cudaipc is the same-host path (two processes on one GPU open each other's CUDA IPC handles).
# MC_FORCE_TCP=1, not "true": SGLang 0.5.17 compares it with "1" to skip RDMA device selection (its own
# `mooncake_tcp` backend alias sets exactly that).
BACKEND_ENV_1GPU = {
    "p2pnccl": {"SGLANG_P2P_TRANSPORT": "mooncake", "MC_FORCE_TCP": "1"},
    "mooncake": {"MC_FORCE_TCP": "1"},
}
P2P_1GPU_DEFAULT = {"check": "nccl", "perf": "mooncake", "sglang_tests": "mooncake"}
SINGLE_GPU_NOTE = ("both servers on one GPU (no NVLink): p2pnccl moved pages over real NCCL through NCCL's socket "
                   "transport on loopback in the check (each server its own NCCL_HOSTID), and with its Mooncake tcp "
                   "transport in perf and SGLang's tests")

#: NVLink multicast off (it can take a shared host's GPUs out of service), also in every child process
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COMMON_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",  # bootstrap and backend addresses stay on loopback
    **MULTICAST_OFF,
}
BACKEND_ENV = {
    "p2pnccl": {"SGLANG_P2P_TRANSPORT": "auto"},  # auto picks the CUDA IPC path between GPUs of one host
    # Mooncake's strongest path on this host: intra-node NVLink (CUDA IPC), not TCP (no RDMA NICs there)
    "mooncake": {"MC_INTRANODE_NVLINK": "true", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"},
}


def step_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    """The arguments every server step takes: --models (folder of built models), --out (results JSON), --logs."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--logs", type=Path, required=True)
    return ap


# Flags one model needs on every server of its check (the reference and P/D alike, so they stay comparable).
# swa-tiny (GPT-OSS, bf16): SGLang 0.5.17 would pick the triton_kernels MoE runner where that package is installed
# and the fused Triton MoE where not; naming the fused one (bias and clamped SwiGLU supported, as for bf16
# GPT-OSS on ROCm) makes the run the same on every host. Its attention needs sinks and a sliding window: the
# triton backend of CHECK_FLAGS has both (0.5.17's GPT-OSS accepts triton, trtllm_mha, fa3, fa4).
MODEL_CHECK_FLAGS: dict[str, list[str]] = {"swa-tiny": ["--moe-runner-backend", "triton"]}


def with_flag(flags: Sequence[str], name: str, value: object) -> list[str]:
    """`flags` with the value after `name` replaced by `value` (the flag must be there)."""
    out = list(flags)
    out[out.index(name) + 1] = str(value)
    return out


def check_flags(model: str) -> list[str]:
    """CHECK_FLAGS for one model, with its own flags (MODEL_CHECK_FLAGS) and its page size from
    E2E_CHECK_PAGE_SIZE ("mla-tiny=64,llama-tiny=1"; the reference and the PD pair of a model get the same, so
    they stay comparable)."""
    sizes = dict(item.split("=", 1) for item in filter(None, os.environ.get("E2E_CHECK_PAGE_SIZE", "").split(",")))
    flags = [*CHECK_FLAGS, *MODEL_CHECK_FLAGS.get(model, [])]
    return [*flags, "--page-size", str(int(sizes[model]))] if model in sizes else flags


def gpus_from_env() -> int:
    """GPUs the run spreads its servers over: run_all.sh --gpus (E2E_GPUS), 2 unless told."""
    n = int(os.environ.get("E2E_GPUS", "2") or 2)
    if n not in (1, 2):
        raise ValueError(f"E2E_GPUS must be 1 or 2, got {n}")
    return n


def p2p_transport_1gpu(step: str) -> str:
    """What p2pnccl moves pages with on one GPU in `step` (check | perf | sglang_tests): nccl, mooncake or cudaipc."""
    value = os.environ.get("E2E_P2P_1GPU", "").strip() or P2P_1GPU_DEFAULT[step]
    if value not in ("nccl", "mooncake", "cudaipc"):
        raise ValueError(f"E2E_P2P_1GPU must be nccl, mooncake or cudaipc, got {value!r}")
    return value


def backend_env(backend: str, gpus: int, step: str = "check", role: str = "") -> dict[str, str]:
    """The environment a backend's `role` server ("prefill" / "decode") gets on top of COMMON_ENV."""
    if gpus == 1 and backend == "p2pnccl" and p2p_transport_1gpu(step) == "cudaipc":
        return {"SGLANG_P2P_TRANSPORT": "cudaipc"}
    if gpus == 1 and backend == "p2pnccl" and p2p_transport_1gpu(step) == "nccl":
        if step == "sglang_tests":  # one environment for both servers: each takes a host id at plugin load
            return {"SGLANG_P2P_TRANSPORT": "nccl", "SGLANG_P2P_ONE_GPU_NCCL": "1", "NCCL_SOCKET_IFNAME": "lo"}
        from sglang_p2p_backend.testing.launch import one_gpu_env

        return {"SGLANG_P2P_TRANSPORT": "nccl", **one_gpu_env(role or "server")}
    return dict((BACKEND_ENV_1GPU if gpus == 1 else BACKEND_ENV)[backend])


def transport_info(backend: str, gpus: int, step: str = "check") -> dict[str, object]:
    """What moved the pages, for the results file: transport, protocol and the environment that chose it."""
    if gpus == 1 and backend == "p2pnccl" and p2p_transport_1gpu(step) == "cudaipc":
        transport, protocol = "cudaipc", "same-host copy kernel into the decode's pools (one GPU, two processes)"
    elif gpus == 1 and backend == "p2pnccl" and p2p_transport_1gpu(step) == "nccl":
        transport, protocol = "nccl", "socket transport on loopback (one GPU, NCCL_HOSTID per server)"
    elif gpus == 1:
        transport, protocol = "mooncake", "tcp"
    elif backend == "p2pnccl":
        transport, protocol = "cudaipc", "auto: same host"  # SGLANG_P2P_TRANSPORT=auto between two GPUs of one host
    else:
        transport, protocol = "mooncake", "nvlink_intra"
    env = backend_env(backend, gpus, step, "prefill")
    env.pop("NCCL_HOSTID", None)  # differs per server and per run
    return {"transport": transport, "protocol": protocol, "env": env}


def pd_gpus(gpus: int) -> tuple[int, int]:
    """(prefill GPU, decode GPU)."""
    return (0, 0) if gpus == 1 else (0, 1)


def perf_flags(gpus: int, gpu_mem_mib: Optional[int] = None) -> list[str]:
    """PERF_FLAGS, or on one GPU the flags that let one pair of llama-anchor servers share it (see above)."""
    if gpus != 1:
        return list(PERF_FLAGS)
    large = gpu_mem_mib is not None and gpu_mem_mib >= 120 * 1024
    tokens = PERF_TOKENS_1GPU["large" if large else "small"]
    return [*BASE_FLAGS, "--mem-fraction-static", PERF_MEM_FRACTION_1GPU, "--max-total-tokens", str(tokens)]


def gpu_mem_mib(index: int = 0) -> Optional[int]:
    """Total memory of one GPU in MiB: E2E_GPU_MEM_MIB (an override), else nvidia-smi, else None."""
    value = os.environ.get("E2E_GPU_MEM_MIB", "").strip()
    if not value:
        try:
            out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
            value = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        except (OSError, subprocess.TimeoutExpired):
            value = ""
    try:
        return int(float(value))
    except ValueError:
        return None


def e2e_root() -> Path:
    return Path(os.environ.get("E2E_ROOT", "/tmp/e2e"))


def deadline_from_env(default_s: float = 540.0) -> float:
    """Monotonic deadline of the current phase: run_all.sh exports E2E_DEADLINE_EPOCH (wall-clock seconds)."""
    epoch = float(os.environ.get("E2E_DEADLINE_EPOCH", time.time() + default_s))
    return time.monotonic() + (epoch - time.time())


def pd_pair(name: str, model: Path, backend: str, base_port: int, flags: Sequence[str],
            gpus: int = 2, step: str = "check") -> tuple[Server, Server, Server]:
    """Prefill on GPU 0, decode on GPU 1 (both on GPU 0 when gpus == 1) and our LB in front: ports base, base+1,
    base+2; bootstrap base+3."""
    gpu_p, gpu_d = pd_gpus(gpus)
    p = Server(f"{name}-{backend}-prefill", base_port, "prefill", model, gpu=gpu_p, backend=backend,
               bootstrap_port=base_port + 3, args=list(flags),
               env={**COMMON_ENV, **backend_env(backend, gpus, step, "prefill")})
    d = Server(f"{name}-{backend}-decode", base_port + 1, "decode", model, gpu=gpu_d, backend=backend,
               args=list(flags), env={**COMMON_ENV, **backend_env(backend, gpus, step, "decode")})
    lb = Server(f"{name}-{backend}-lb", base_port + 2, "lb", lb_prefill=p, lb_decode=d)
    return p, d, lb


def reference(name: str, model: Path, port: int, gpu: int, flags: Sequence[str]) -> Server:
    return Server(f"{name}-reference", port, "null", model, gpu=gpu, args=list(flags), env=dict(COMMON_ENV))
