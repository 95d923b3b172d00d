"""SGLANG_P2P_GIL_SWITCH_MS: parsed once with the other knobs, and applied to the process's GIL switch interval
only downwards (a lower interval set by the host process, or 0 = Python's own, is left alone)."""
import sys

import pytest

from sglang_p2p_backend.engine.config import ConfigError, EngineConfig
from sglang_p2p_backend.engine.threads import shorten_gil_switch
from support.knobs import config_with


@pytest.mark.parametrize("raw, want", [(None, 0.5), ("", 0.5), ("0", 0.0), ("0.2", 0.2), ("2", 2.0)])
def test_switch_interval_knob(monkeypatch, raw, want):
    assert config_with(monkeypatch, "SGLANG_P2P_GIL_SWITCH_MS", raw).gil_switch_ms == want


@pytest.mark.parametrize("raw", ["fast", "-1"])
def test_switch_interval_knob_rejects_nonsense_naming_it(monkeypatch, raw):
    monkeypatch.setenv("SGLANG_P2P_GIL_SWITCH_MS", raw)
    with pytest.raises(ConfigError, match="SGLANG_P2P_GIL_SWITCH_MS"):
        EngineConfig.from_env()


def test_switch_interval_is_only_ever_lowered():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        shorten_gil_switch(0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        shorten_gil_switch(2.0)  # higher than what is set: left alone
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(0.005)
        shorten_gil_switch(0.0)  # off
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
