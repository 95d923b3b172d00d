"""Transports behind one interface (base.py), chosen per process by SGLANG_P2P_TRANSPORT."""

from __future__ import annotations

import torch

from .base import TransportError, TwoSidedTransport


def two_sided_transport(name: str, device: torch.device, host: str, io_timeout: float) -> TwoSidedTransport:
    """The two-sided transport `name` ("nccl" or "tcp"); "auto" means NCCL on a CUDA device, else tcp."""
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "tcp"
    if name == "tcp":
        from .tcp import TcpTransport

        return TcpTransport(host=host, io_timeout=io_timeout)
    if name == "nccl":
        if device.type != "cuda":
            raise TransportError("SGLANG_P2P_TRANSPORT=nccl needs the KV cache on a CUDA device; use tcp on CPU")
        from .nccl import NcclTransport

        return NcclTransport(device=device)
    raise TransportError(f"transport {name!r} is not a two-sided transport (nccl, tcp)")
