"""Engine settings, read once from the environment (the knobs the README lists)."""

from __future__ import annotations

import os
from dataclasses import dataclass

TRANSPORTS = ("auto", "cudaipc", "nccl", "mooncake", "tcp")


class ConfigError(ValueError):
    pass


def _number(name: str, default: float, cast=float):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be positive")
    return value


def _non_negative(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if raw in ("", "0"):
        return default if raw == "" else 0.0
    return _number(name, default)


@dataclass(frozen=True)
class EngineConfig:
    transport: str = "auto"  # SGLANG_P2P_TRANSPORT
    staging_mb: int = 256  # SGLANG_P2P_STAGING_MB: staging per rank and direction, split into slots
    staging_slots: int = 2  # SGLANG_P2P_STAGING_SLOTS: chunks in flight per rank
    connect_timeout: float = 30.0  # SGLANG_P2P_CONNECT_TIMEOUT: joining a pair channel
    io_timeout: float = 30.0  # SGLANG_P2P_IO_TIMEOUT: one chunk's send/receive, a staging wait
    workers: int = 4  # SGLANG_P2P_WORKERS: prefill transfer queues (peers are sharded over them)
    peer_timeout: float = 8.0  # SGLANG_P2P_PEER_TIMEOUT: a peer silent this long is dead, its rooms fail
    max_peers: int = 512  # SGLANG_P2P_MAX_PEERS: registered peers and control sockets a rank keeps at most
    tombstone_s: float = 60.0  # SGLANG_P2P_TOMBSTONE_S: how long a concluded room's late messages are answered
    #: SGLANG_P2P_GIL_SWITCH_MS: the scheduler process's GIL switch interval at most (0: Python's own, 5 ms).
    #: The backend's threads release the GIL on every CUDA sync and socket wait and need it back within
    #: the interval while the scheduler's main thread runs Python (docs/serving.md measures it)
    gil_switch_ms: float = 0.5

    @property
    def slot_bytes(self) -> int:
        return max(1, (self.staging_mb << 20) // self.staging_slots)

    @classmethod
    def from_env(cls) -> "EngineConfig":
        transport = os.environ.get("SGLANG_P2P_TRANSPORT", "auto").strip().lower() or "auto"
        if transport not in TRANSPORTS:
            raise ConfigError(f"SGLANG_P2P_TRANSPORT={transport!r}: choose one of {', '.join(TRANSPORTS)}")
        return cls(
            transport=transport,
            staging_mb=_number("SGLANG_P2P_STAGING_MB", cls.staging_mb, int),
            staging_slots=_number("SGLANG_P2P_STAGING_SLOTS", cls.staging_slots, int),
            connect_timeout=_number("SGLANG_P2P_CONNECT_TIMEOUT", cls.connect_timeout),
            io_timeout=_number("SGLANG_P2P_IO_TIMEOUT", cls.io_timeout),
            workers=_number("SGLANG_P2P_WORKERS", cls.workers, int),
            peer_timeout=_number("SGLANG_P2P_PEER_TIMEOUT", cls.peer_timeout),
            max_peers=_number("SGLANG_P2P_MAX_PEERS", cls.max_peers, int),
            tombstone_s=_number("SGLANG_P2P_TOMBSTONE_S", cls.tombstone_s),
            gil_switch_ms=_non_negative("SGLANG_P2P_GIL_SWITCH_MS", cls.gil_switch_ms),
        )
