"""The simulated worker's settings: role, ports and the timing knobs (the command-line flags, cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "sim-model"


@dataclass
class SimConfig:
    role: str = "prefill"
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int | None = None
    dp_size: int = 1
    prefill_base_ms: float = 2.0
    prefill_ms_per_token: float = 0.05
    prefill_concurrency: int = 1
    transfer_ms: float = 0.0
    decode_ms_per_token: float = 10.0
    decode_slowdown: float = 0.01
    kv_capacity_tokens: int = 1_000_000
    max_running_requests: int = 4096
    bootstrap_timeout: float = 30.0
    prefix_cache_tokens: int = 0  # radix cache capacity per prefill DP rank; 0: no cache
    page_tokens: int = 16
    model: str = MODEL
    record_output: bool = False  # keep the exact bytes of each answer (tests compare pass-through)

