"""Where e2e/lb_compare.py's servers run, what they serve, and how hard the workloads drive them.

Two layouts:
* ``--gpus 1``: every server on GPU 0, ``llama-tiny`` (2 KiB of KV a token), p2pnccl over NCCL's loopback
  sockets (or CUDA IPC within the GPU). A cache hit saves almost no GPU time there (docs/lb.md says why).
* ``--gpus 4``: one server per GPU (2P2D: prefills on GPUs 0-1, decodes on 2-3; 3P1D: prefills on 0-2, the
  decode on 3), p2pnccl with ``SGLANG_P2P_TRANSPORT=auto`` (CUDA IPC between the GPUs of one host), model
  ``llama-anchor`` (32 layers, 8 KV heads x 128, 128 KiB of KV a token, like Llama-3-8B). A 12k-token prompt
  is then ~15 TFLOP of prefill (about 0.1 s on an H100 with Triton attention) while its KV (1.5 GiB) crosses
  NVLink in a few ms, so a prefix hit saves real GPU time and routing for hits can show in TTFT.

Pools (80 GB H100): each prefill holds 98,304 tokens (12 GiB), which is also its radix cache; the
``long_prefix`` workload's 10 prefixes of 12k tokens (120k) are more than one prefill's cache and less than
two, so a router that keeps each prefix on one prefill hits where one that spreads them thrashes. Each decode
holds 458,752 tokens (56 GiB: 3P1D's one decode takes every running request, up to ~37 of 12k tokens) at
``--mem-fraction-static 0.88`` (0.88 x ~78.5 GiB free, less 0.45 GiB of weights, is 68.6 GiB, so 12 GiB stay
for activations and the CUDA context). The bursty workload's prompts grow with the model (median 600, 15% of
6k-14k tokens) so that long prompts block a prefill for ~0.1-0.2 s, the head-of-line blocking a load-aware
router avoids; the few-shot prefixes grow to 4k tokens. Where the time left is short, shared_prefix (whose
prefixes fit every prefill's cache) is dropped before long_prefix.

Rates: on the 4-GPU layout the request rates come from the prefill capacity measured after the warm-up
(tokens per second of a burst of fresh prompts of each workload's mean length), times a load factor per
workload (``LOADS``, relative to the capacity without any cache hit), capped at ``max_rps`` so that the one
client process and the Python LBs are not what queues. The bursty load (0.8) queues in its 3x bursts.
The chat workloads hit the cache on most turns whatever the router does (a turn resends its conversation),
so their load is set from the misses: long_prefix at 5.0 of the capacity without hits is ~0.2 of the prefills'
time where every prefix stays on one prefill (hit rate ~0.97) and 0.7-1.0 where they are spread (0.80-0.86,
2026-11-27), so it queues unless the router finds the cached prefixes; shared_prefix (2.0) fits every cache,
so it runs at the cap and queues only where hits are lost. The burst that measures the capacity is short
(0.2-1 s), so its fixed latencies make it an underestimate by up to ~20%.

Decodes: each chat turn asks for 8 tokens on 4 GPUs (``chat_output``; 32 elsewhere). A decode's pool holds ~36
requests of 12.5k tokens; at 32 tokens a turn (~1 s on the decode) the decodes were full at 4.0 x capacity on
2026-11-27 (x4, 2P2D: running 34 of 36, ~40 requests waiting in the decodes' PD queues, TTFT p50 1-2 s for
every LB), so TTFT measured the decodes' memory, not the routing. At 8 tokens the same pool turns over 4x
faster and the prefills are what queues.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

TOPOLOGIES = {"2p2d": (2, 2), "3p1d": (3, 1)}
KV_BYTES_PER_TOKEN = {"llama-tiny": 4 * 2 * 2 * 64 * 2, "llama-anchor": 32 * 2 * 8 * 128 * 2}
WEIGHTS_GIB = {"llama-tiny": 0.01, "llama-anchor": 0.45}
LOADS = {"bursty_mixed": 0.8, "shared_prefix": 2.0, "long_prefix": 5.0}
TURNS = {"shared_prefix": 4, "long_prefix": 3}
RATE_FIELD = {"bursty_mixed": "bursty_rate", "shared_prefix": "chat_rate", "long_prefix": "long_rate"}


@dataclass(frozen=True)
class Layout:
    gpus: int
    model: str
    mem_fraction: str
    prefill_tokens: int
    decode_tokens: int
    transport: str  # nccl | cudaipc (one GPU) | auto (one server per GPU)
    lanes: int  # servers of one GPU that start side by side (e2e.servers.Stack.launch)
    workload: tuple[tuple[str, Any], ...] = ()  # WorkloadParams fields this layout sets
    calibrate: bool = False
    # in the order the plan keeps them: the last is dropped first when the time left is short
    workloads: tuple[str, ...] = ("bursty_mixed", "shared_prefix", "long_prefix")


LAYOUTS = {
    1: Layout(1, "llama-tiny", "0.2", 98304, 262144, "nccl", 3),
    4: Layout(4, "llama-anchor", "0.88", 98304, 458752, "auto", 1, calibrate=True,
              workload=(("short_median", 600), ("long_min", 6000), ("long_max", 14000), ("chat_prefix", 4000), ("chat_output", 8)),
              workloads=("bursty_mixed", "long_prefix", "shared_prefix")),
}


def placement(topology: str, gpus: int) -> list[tuple[str, int, int]]:
    """(role, index, GPU) of every server: all on GPU 0, or one per GPU, prefills first."""
    n_p, n_d = TOPOLOGIES[topology]
    if gpus == 1:
        return [("prefill", i, 0) for i in range(n_p)] + [("decode", i, 0) for i in range(n_d)]
    if gpus != n_p + n_d:
        raise ValueError(f"{topology} needs 1 or {n_p + n_d} GPUs, not {gpus}")
    return [("prefill", i, i) for i in range(n_p)] + [("decode", i, n_p + i) for i in range(n_d)]


def pool_gib(layout: Layout, role: str) -> float:
    tokens = layout.prefill_tokens if role == "prefill" else layout.decode_tokens
    return tokens * KV_BYTES_PER_TOKEN[layout.model] / 2**30


def fits(layout: Layout, topology: str, gpu_free_gib: float) -> bool:
    """Whether every GPU's pools and weights fit `mem_fraction` of what it has free (SGLang's own rule)."""
    per_gpu: dict[int, float] = {}
    for role, _, gpu in placement(topology, layout.gpus):
        per_gpu[gpu] = per_gpu.get(gpu, 0.0) + pool_gib(layout, role) + WEIGHTS_GIB[layout.model]
    return max(per_gpu.values()) <= float(layout.mem_fraction) * gpu_free_gib


def burst_size(n_prefills: int, prompt_tokens: int, prefill_tokens: int) -> int:
    """Requests in one calibration burst: 2-8 per prefill, at most half of the prefills' pools in flight."""
    return max(2 * n_prefills, min(8 * n_prefills, prefill_tokens * n_prefills // (2 * max(1, prompt_tokens))))


def rates(capacity_tok_s: Mapping[str, float], mean_prompt: Mapping[str, float], loads: Mapping[str, float],
          max_rps: float) -> dict[str, dict[str, float]]:
    """Per workload: the measured capacity in requests/s without cache hits, the offered rate (load x capacity,
    capped at max_rps) and the WorkloadParams field it sets (conversations/s for the chat workloads)."""
    out = {}
    for wl, tok_s in capacity_tok_s.items():
        cap = tok_s / mean_prompt[wl]
        rps = min(loads[wl] * cap, max_rps)
        out[wl] = {"capacity_rps": round(cap, 2), "offered_rps": round(rps, 2), "capped": loads[wl] * cap > max_rps,
                   RATE_FIELD[wl]: round(rps / TURNS.get(wl, 1), 3)}
    return out
