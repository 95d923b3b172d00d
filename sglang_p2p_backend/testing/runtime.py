"""Set up SGLang's process state the way a scheduler process has it, on CPU, for one PD role.

A KV manager reads SGLang's runtime context (parallel sizes and ranks, process groups). A scheduler gets
them from `publish(server_args)` and `initialize_model_parallel`; here the same calls run with gloo and a
world of one. Also the one place where the driver meets differences between SGLang 0.5.17 and 0.5.23
(publish signature, sender constructor, MetadataBuffers constructor).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional

import torch


def setup(
    mode: str,
    *,
    host: str,
    bootstrap_port: int,
    dist_port: int,
    page_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    attn_dp: int = 1,
    replicas: int = 1,
    replica: int = 0,
    load_balance_method: Optional[str] = None,
    local_rank: Optional[int] = None,
) -> Any:
    """Load plugins, build ServerArgs for `mode` ("prefill"/"decode") with p2pnccl, publish them and build
    gloo process groups for this rank of a `tp_size`-rank server (one process per rank, as SGLang runs its
    TP schedulers). `replicas` > 1: --dp-size without DP attention, this rank in replica `replica` (each replica
    its own process groups, as SGLang's DP controller launches them). Returns the ServerArgs."""
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ["MASTER_PORT"] = str(dist_port)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.server_args import ServerArgs

    dp_fields: dict = {}
    if attn_dp > 1:  # DP attention: 0.5.23 spells it attn_dp_size, 0.5.17 dp_size + enable_dp_attention
        if "attn_dp_size" in inspect.signature(ServerArgs).parameters:
            dp_fields = {"attn_dp_size": attn_dp}
        else:
            dp_fields = {"dp_size": attn_dp, "enable_dp_attention": True}
    elif replicas > 1:
        dp_fields = {"dp_size": replicas}
    # what SGLang resolves "auto" to when a server starts (a PD prefill follows the bootstrap room), which these
    # ServerArgs would otherwise keep as "auto"
    dp_fields["load_balance_method"] = load_balance_method or ("follow_bootstrap_room" if mode == "prefill" else "round_robin")
    server_args = ServerArgs(
        **dp_fields,
        model_path="dummy",
        device="cpu",
        host=host,
        page_size=page_size,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="p2pnccl",
        disaggregation_bootstrap_port=bootstrap_port,
        tp_size=tp_size,
    )
    rc.reset_context()
    if hasattr(rc, "SpawnRanks"):  # 0.5.23
        rc.publish(server_args, role="scheduler",
                   ranks=rc.SpawnRanks(world_rank=tp_rank, dp_rank=replica if replicas > 1 else None))
    else:  # 0.5.17
        rc.publish(server_args, role="scheduler")
    # SGLang makes cuda:local_rank this process's device when CUDA exists: it must be the GPU the rank's KV pools
    # are on (the copier's kernels launch on the current device), and one this host has
    if local_rank is None:
        local_rank = tp_rank % torch.cuda.device_count() if torch.cuda.is_available() else tp_rank
    init_distributed_environment(world_size=tp_size, rank=tp_rank, local_rank=local_rank, backend="gloo")
    if "tensor_model_parallel_size" in inspect.signature(initialize_model_parallel).parameters:  # 0.5.17
        initialize_model_parallel(tensor_model_parallel_size=tp_size, attention_data_parallel_size=attn_dp, backend="gloo")
    else:  # 0.5.23 reads the widths from the published context
        initialize_model_parallel(backend="gloo")
    from sglang.srt.layers import dp_attention

    if getattr(dp_attention, "_ATTN_DP_SIZE", 0) is None:  # 0.5.17 keeps these in module globals
        dp_attention._ATTN_DP_SIZE = attn_dp
        dp_attention._ATTN_DP_RANK = tp_rank // (tp_size // attn_dp)
    return server_args


def sender_kwargs(sender_cls: type) -> dict:
    """Extra constructor arguments the release's prefill scheduler passes (0.5.17: dest_tp_ranks, pp_rank)."""
    params = inspect.signature(sender_cls.__mro__[1].__init__).parameters
    extra = {}
    if "dest_tp_ranks" in params:
        extra["dest_tp_ranks"] = [0]
    if "pp_rank" in params:
        extra["pp_rank"] = 0
    return extra


def metadata_buffers(size: int, hidden_size: int = 16, kv_checksum: bool = False) -> Any:
    """SGLang's own aux buffers (host memory), as the scheduler builds them (`hidden_size`: of the draft model's
    hidden states, which speculative decoding passes along; it sets the bytes of one aux row; `kv_checksum`:
    SGLang 0.5.23's --disaggregation-enable-kv-checksum adds the digest buffer)."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    extra = {"kv_checksum_enabled": True} if kv_checksum else {}
    return MetadataBuffers(
        size=size, hidden_size=hidden_size, hidden_states_dtype=torch.float32, max_top_logprobs_num=4, max_sampling_mask_tokens=1,
        **extra,
    )
