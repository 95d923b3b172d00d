"""sglang-p2p-backend: the `p2pnccl` PD-disaggregation KV transfer backend for SGLang."""

__version__ = "0.1.0"
