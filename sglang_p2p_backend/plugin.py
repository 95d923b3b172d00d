"""Registers the `p2pnccl` transfer backend with SGLang; run by SGLang's plugin loader.

SGLang calls `load()` through the `sglang.srt.plugins` entry point in every process that calls
`load_plugins()` (launch_server, Engine, schedulers, DP controller, detokenizer). `load()` is idempotent,
cheap (no NCCL, no engine import) and does three things, as the SGLang contract asks:

1. extends the CLI choice list in place (argparse holds the same list object);
2. injects a `P2PNCCL` member into SGLang's existing `TransferBackend` enum: replacing the class would make
   members created before and after the patch compare unequal;
3. wraps `disaggregation.utils.get_kv_class` with an AROUND hook, so the original stays in the hook chain
   (a module-level alias of it would be rebound to the wrapper by `_propagate_patch` and recurse).
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "p2pnccl"
ENUM_MEMBER = "P2PNCCL"
SUPPORTED_SGLANG = ("0.5.17", "0.5.23")
_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"

_hook_registered = False


class UnsupportedSGLangError(RuntimeError):
    pass


def sglang_version() -> str:
    return metadata.version("sglang")


def check_sglang_version(version: str | None = None) -> str:
    version = version or sglang_version()
    if version not in SUPPORTED_SGLANG:
        raise UnsupportedSGLangError(
            f"sglang-p2p-backend supports SGLang {' and '.join(SUPPORTED_SGLANG)} only, found {version}: "
            f"install one of them (pip install sglang=={SUPPORTED_SGLANG[-1]}) or a matching plugin release"
        )
    return version


def _extend_cli_choices() -> None:
    from sglang.srt import server_args

    if BACKEND_NAME not in server_args.DISAGG_TRANSFER_BACKEND_CHOICES:
        server_args.add_disagg_transfer_backend_choices([BACKEND_NAME])


def _inject_enum_member() -> None:
    from sglang.srt.disaggregation.utils import TransferBackend

    if BACKEND_NAME in TransferBackend._value2member_map_:
        return
    member = object.__new__(TransferBackend)
    member._name_ = ENUM_MEMBER
    member._value_ = BACKEND_NAME
    member.__objclass__ = TransferBackend
    TransferBackend._value2member_map_[BACKEND_NAME] = member
    TransferBackend._member_map_[ENUM_MEMBER] = member
    TransferBackend._member_names_.append(ENUM_MEMBER)
    type.__setattr__(TransferBackend, ENUM_MEMBER, member)


def _get_kv_class_around(original, transfer_backend: Any, class_type: Any):
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return KVArgs
    from sglang_p2p_backend.adapter import conn

    return {
        KVClassType.MANAGER: conn.P2pNcclKVManager,
        KVClassType.SENDER: conn.P2pNcclKVSender,
        KVClassType.RECEIVER: conn.P2pNcclKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.P2pNcclKVBootstrapServer,
    }[class_type]


def _register_kv_class_hook() -> None:
    global _hook_registered
    if _hook_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_GET_KV_CLASS, _get_kv_class_around, HookType.AROUND)
    _hook_registered = True
    # load_plugins() applies hooks after every plugin ran; applying here too (idempotent) makes a direct
    # load() call, e.g. from a process that never runs load_plugins(), complete on its own.
    HookRegistry.apply_hooks()


def _one_gpu_nccl() -> None:
    """`SGLANG_P2P_ONE_GPU_NCCL=1` (tests on one GPU only): NCCL refuses two ranks of one communicator on one
    GPU of one host, so each server names a host of its own (NCCL_HOSTID from the first process of the server
    that loads the plugin, inherited by its schedulers) and NCCL moves pages through its socket transport on
    loopback. Lets a fixture that starts prefill and decode with one environment run p2pnccl over real NCCL."""
    if os.environ.get("SGLANG_P2P_ONE_GPU_NCCL") == "1" and "NCCL_HOSTID" not in os.environ:
        os.environ["NCCL_HOSTID"] = f"p2p-one-gpu-{os.getpid()}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def load() -> None:
    """Entry point of the `sglang.srt.plugins` group."""
    check_sglang_version()
    _one_gpu_nccl()
    _extend_cli_choices()
    _inject_enum_member()
    _register_kv_class_hook()
    logger.debug("sglang-p2p-backend: registered transfer backend %r", BACKEND_NAME)
