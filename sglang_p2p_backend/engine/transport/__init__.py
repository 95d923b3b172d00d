"""Transports behind one interface (base.py): the two-sided ones (nccl, tcp) and the one-sided Mooncake one.

Which ones a process starts is `select.process_transports`; which one serves a peer is `select.choose_transport`.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.transport.base import OneSidedTransport, TransportError, TwoSidedTransport


def two_sided_transport(name: str, device: torch.device, host: str, config: EngineConfig) -> TwoSidedTransport:
    """The two-sided transport `name` ("nccl" or "tcp") set up as `config` says; "auto" means NCCL on a CUDA
    device, else tcp."""
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "tcp"
    if name == "tcp":
        from sglang_p2p_backend.engine.transport.tcp import TcpTransport

        return TcpTransport(host=host, io_timeout=config.io_timeout)
    if name == "nccl":
        if device.type != "cuda":
            raise TransportError("SGLANG_P2P_TRANSPORT=nccl needs the KV cache on a CUDA device; use tcp on CPU")
        from sglang_p2p_backend.engine.transport.nccl import NcclTransport

        return NcclTransport.from_config(config, device)
    raise TransportError(f"transport {name!r} is not a two-sided transport (nccl, tcp)")


def one_sided_transport(
    protocol: str, host: str, ib_device: Optional[str], gpu_id: int, transfer_timeout_s: float,
    retry_after_s: float,
) -> OneSidedTransport:
    """A Mooncake engine for this process (imported lazily: hosts without Mooncake never load it); a session
    whose write failed is skipped for `retry_after_s`."""
    from sglang_p2p_backend.engine.transport.mooncake import MooncakeTransport

    return MooncakeTransport(
        protocol=protocol, hostname=host, ib_device=ib_device, gpu_id=gpu_id, transfer_timeout_s=int(transfer_timeout_s),
        retry_after_s=retry_after_s,
    )
