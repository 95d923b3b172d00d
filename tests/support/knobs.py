"""The engine's configuration read with one environment variable set (or unset: None), for the knob tests."""

from typing import Optional

from sglang_p2p_backend.engine.config import EngineConfig


def config_with(monkeypatch, name: str, raw: Optional[str]) -> EngineConfig:
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    return EngineConfig.from_env()


def assert_on_off_switch(monkeypatch, name: str, field: str) -> None:
    """A 1/0 knob: on when unset, off at 0, and any other value refused naming the knob and its choices."""
    import pytest

    from sglang_p2p_backend.engine.config import ConfigError

    assert getattr(config_with(monkeypatch, name, None), field) is True
    assert getattr(config_with(monkeypatch, name, "0"), field) is False
    with pytest.raises(ConfigError, match=rf"{name}='yes' is not one of 1, 0"):
        config_with(monkeypatch, name, "yes")
