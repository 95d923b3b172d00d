"""Pure parts of the `mooncake` transport: batch cuts, IB device strings, session
names, and the refusals that need no peer. Runs without Mooncake installed except where marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_p2p_backend.engine.transport import mooncake as mc
from sglang_p2p_backend.engine.transport.base import TransportError
from sglang_p2p_backend.engine.transport.mooncake import batch_bounds, ib_devices_for_gpu, session_name


@pytest.mark.parametrize(
    "n, cap, want",
    [(0, 1024, []), (1024, 1024, [(0, 1024)]), (1025, 1024, [(0, 1024), (1024, 1025)]), (5, 2, [(0, 2), (2, 4), (4, 5)])],
)
def test_batch_bounds(n: int, cap: int, want: list) -> None:
    assert batch_bounds(n, cap) == want


def test_batch_bounds_rejects_zero_cap() -> None:
    with pytest.raises(ValueError):
        batch_bounds(3, 0)


def test_ib_device_strings_as_sglang_accepts_them(tmp_path: Path) -> None:
    assert ib_devices_for_gpu(None, 0) == ""
    assert ib_devices_for_gpu(" mlx5_0, mlx5_1 ", 3) == "mlx5_0,mlx5_1"
    mapping = {"0": "mlx5_0", "1": "mlx5_1,mlx5_2"}
    assert ib_devices_for_gpu(json.dumps(mapping), 1) == "mlx5_1,mlx5_2"
    f = tmp_path / "ib.json"
    f.write_text(json.dumps(mapping))
    assert ib_devices_for_gpu(str(f), 0) == "mlx5_0"
    with pytest.raises(ValueError, match="no entry for GPU 7"):
        ib_devices_for_gpu(json.dumps(mapping), 7)
    with pytest.raises(ValueError, match="not valid JSON"):
        ib_devices_for_gpu("{0: mlx5_0}", 0)
    with pytest.raises(ValueError, match="cannot read"):
        ib_devices_for_gpu(str(tmp_path / "missing.json"), 0)


def test_session_name_brackets_ipv6() -> None:
    assert session_name("10.0.0.2", 15123) == "10.0.0.2:15123"
    assert session_name("fe80::1", 15123) == "[fe80::1]:15123"


def test_protocol_is_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="protocol must be one of"):
        mc.MooncakeTransport("nvlink")


def test_rdma_without_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mc, "rdma_devices", lambda: [])
    with pytest.raises(TransportError, match="needs RDMA devices.*use protocol 'tcp'"):
        mc.MooncakeTransport("rdma")


def test_rdma_with_unknown_device_names_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mc, "rdma_devices", lambda: ["mlx5_0"])
    with pytest.raises(TransportError, match=r"\['mlx5_9'\].*not on this machine"):
        mc.MooncakeTransport("rdma", ib_device="mlx5_0,mlx5_9")


def test_missing_mooncake_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("mooncake"):
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(TransportError, match="apt-get install -y libibverbs1"):
        mc.MooncakeTransport("tcp")


def test_tcp_engine_env_is_scoped(monkeypatch: pytest.MonkeyPatch) -> None:
    """MC_FORCE_TCP / MC_TRANSFER_TIMEOUT are set only while the engine is built, then restored."""
    pytest.importorskip("mooncake.engine")
    import os

    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "77")
    with mc.MooncakeTransport("tcp", transfer_timeout_s=1) as t:
        assert t.transfer_timeout_s == mc.MIN_TRANSFER_TIMEOUT_S
        assert t.session_id().startswith("127.0.0.1:")
    assert "MC_FORCE_TCP" not in os.environ
    assert os.environ["MC_TRANSFER_TIMEOUT"] == "77"
