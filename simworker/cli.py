"""`python -m simworker`: one simulated prefill or decode server, configured by flags."""

from __future__ import annotations

import argparse
import asyncio

from .config import MODEL, SimConfig
from .worker import SimWorker


def build_parser() -> argparse.ArgumentParser:
    """The flags; each timing knob defaults to SimConfig's value."""
    p = argparse.ArgumentParser(prog="python -m simworker", description="Simulated SGLang PD worker (stands in for a GPU server).")
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-port", type=int, default=None, help="prefill: port of the simulated bootstrap server (default: any free port)")
    p.add_argument("--dp-size", type=int, default=1, help="DP-attention ranks, each with its own queue")
    p.add_argument("--prefill-base-ms", type=float, default=SimConfig.prefill_base_ms)
    p.add_argument("--prefill-ms-per-token", type=float, default=SimConfig.prefill_ms_per_token)
    p.add_argument("--prefill-concurrency", type=int, default=SimConfig.prefill_concurrency, help="prefill slots per DP rank")
    p.add_argument("--transfer-ms", type=float, default=SimConfig.transfer_ms)
    p.add_argument("--decode-ms-per-token", type=float, default=SimConfig.decode_ms_per_token)
    p.add_argument("--decode-slowdown", type=float, default=SimConfig.decode_slowdown, help="relative slowdown per extra running request")
    p.add_argument("--kv-capacity-tokens", type=int, default=SimConfig.kv_capacity_tokens)
    p.add_argument("--bootstrap-timeout", type=float, default=SimConfig.bootstrap_timeout)
    p.add_argument("--prefix-cache-tokens", type=int, default=SimConfig.prefix_cache_tokens, help="prefill: radix cache capacity per DP rank in tokens (0: no cache)")
    p.add_argument("--page-tokens", type=int, default=SimConfig.page_tokens, help="prefill: radix cache page size")
    p.add_argument("--model", default=MODEL)
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """SimConfig from parsed flags."""
    return SimConfig(**{k: v for k, v in vars(args).items() if k in SimConfig.__dataclass_fields__})


async def _run(cfg: SimConfig) -> None:
    worker = SimWorker(cfg)
    await worker.start()
    extra = f" bootstrap {cfg.bootstrap_port}" if cfg.role == "prefill" else ""
    print(f"sim {cfg.role} worker on {worker.url}{extra}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    """Serve until interrupted (SIGINT); returns the exit status."""
    cfg = config_from_args(build_parser().parse_args(argv))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_run(cfg))
    except KeyboardInterrupt:
        pass
    return 0

