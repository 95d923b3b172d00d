"""CPU checks of the nccl transport's wire format and its ncclConfig_t mirror (no GPU needed)."""

from __future__ import annotations

import ctypes

import pytest

pytest.importorskip("torch")

from sglang_p2p_backend.engine.transport.base import TransportError  # noqa: E402
from sglang_p2p_backend.engine.transport.nccl import NcclConfig, pack_unique_id, unpack_unique_id  # noqa: E402


def test_pair_id_carries_the_channel_cap():
    raw = bytes(range(128))
    assert unpack_unique_id(pack_unique_id(raw, 4)) == (raw, 4)
    assert unpack_unique_id(pack_unique_id(raw, None)) == (raw, None)
    with pytest.raises(TransportError, match="different transports"):
        unpack_unique_id(b"127.0.0.1:5555:abcd")


def test_config_matches_the_nccl_2_17_prefix_of_ncclConfig_t():
    # offsets of ncclConfig_t in nccl.h (2.17 .. 2.30 keep them): size, magic, version, blocking,
    # cgaClusterSize, minCTAs, maxCTAs, netName, splitShare
    offsets = {name: getattr(NcclConfig, name).offset for name, _ in NcclConfig._fields_}
    assert offsets == {"size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20,
                       "minCTAs": 24, "maxCTAs": 28, "netName": 32, "splitShare": 40}
    cfg = NcclConfig.make(blocking=False, max_ctas=8)
    assert cfg.size == ctypes.sizeof(NcclConfig) == 48
    assert (cfg.magic, cfg.version, cfg.blocking, cfg.minCTAs, cfg.maxCTAs) == (0xCAFEBEEF, 21700, 0, 8, 8)
    assert NcclConfig.make(blocking=True, max_ctas=None).maxCTAs == -(2**31)
