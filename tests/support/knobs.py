"""The engine's configuration read with one environment variable set (or unset: None), for the knob tests."""

from typing import Optional

from sglang_p2p_backend.engine.config import EngineConfig


def config_with(monkeypatch, name: str, raw: Optional[str]) -> EngineConfig:
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    return EngineConfig.from_env()
