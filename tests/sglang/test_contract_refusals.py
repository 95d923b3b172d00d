"""Settings p2pnccl cannot serve fail the manager SGLang's registry hands out, at construction, before it binds,
registers or starts anything, with a message naming each flag and why (docs/sglang-contract.md)."""

import inspect
import threading

import pytest

pytestmark = [pytest.mark.sglang]

PP = ("--pp-size 2: p2pnccl pairs KV and state regions by position, not by layer id (KVArgs.kv_layer_ids, "
      "prefill_start_layer, prefill_end_layer), so one pipeline stage's layers would land on another's")
DCP = "--dcp-size 2: decode context parallelism interleaves a page's tokens over ranks, and p2pnccl does not re-lay them out"
SHARDING = ("--enable-kv-cache-sharding True: each prefill rank then holds a subset of the logical KV pages, which "
            "p2pnccl does not pair with the decode's")
HOST = ("--disaggregation-decode-host-receive-threshold 0.5: p2pnccl receives into device KV pages only (no "
        "KVTransferDestination.HOST, KVArgs.host_*)")
HISPARSE = ("--enable-hisparse True: HiSparse decode publishes separate device page ids (device_kv_indices) that "
            "p2pnccl does not write")
ROLE_SWITCH = "--enable-pd-role-switch True: p2pnccl has no teardown() (supports_role_switch is False)"
PREFILL_COMPLETE = ("--disaggregation-decode-allocation-policy prefill_complete: p2pnccl does not defer the decode's "
                    "bootstrap until the prefill completes (mark_prefill_complete)")
RUST = ("SGLANG_RUST_SERVER=1: with DP attention SGLang registers prefill ranks with the Rust /route registry "
        "(KVArgs.rust_http_port), and p2pnccl's ranks use SGLang's Python bootstrap server (signed, checked)")
CP = ("--attn-cp-size 2: with attention context parallelism SGLang's own backends send from one elected CP rank, or "
      "filter each rank's pages and send CP-replicated state once (is_dummy_cp_rank, "
      "enable_all_cp_ranks_for_transfer); p2pnccl does neither")
CUSTOM_POOL = ("SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK: a setting of SGLang's mooncake backend: SGLang then "
               "allocates the KV pools through Mooncake's allocator (and, for INTRA_NODE_NVLINK, the aux rows on the "
               "GPU), which p2pnccl does not register or read; unset it (p2pnccl reaches GPUs of its host through "
               "CUDA IPC or NCCL)")
DSA_TAIL = ("state component 1 is dsa_tail (KVArgs.state_types): its indices name the live slots inside one ring "
            "row per request, not whole items, and p2pnccl copies whole items")


def server_args(role: str, **flags):
    from sglang_p2p_backend import plugin

    plugin.load()
    from sglang.srt.server_args import ServerArgs

    missing = set(flags) - set(inspect.signature(ServerArgs).parameters)
    if missing:
        pytest.skip(f"this SGLang release has no {sorted(missing)}")
    return ServerArgs(model_path="dummy", device="cpu", disaggregation_mode=role,
                      disaggregation_transfer_backend="p2pnccl", **flags)


def build_manager(role: str, sargs, state_types=()):
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    args = KVArgs()
    args.state_types = list(state_types)
    manager = get_kv_class(TransferBackend("p2pnccl"), KVClassType.MANAGER)
    return manager(args, DisaggregationMode(role), sargs, False)


@pytest.mark.parametrize("role,flags,why", [
    ("prefill", {"pp_size": 2}, PP),
    ("decode", {"pp_size": 2}, PP),
    ("prefill", {"dcp_size": 2, "tp_size": 2}, DCP),
    ("decode", {"dcp_size": 2, "tp_size": 2}, DCP),
    ("prefill", {"enable_kv_cache_sharding": True}, SHARDING),
    ("decode", {"disaggregation_decode_host_receive_threshold": 0.5}, HOST),
    ("decode", {"enable_hisparse": True}, HISPARSE),
    ("prefill", {"enable_pd_role_switch": True}, ROLE_SWITCH),
    ("decode", {"disaggregation_decode_allocation_policy": "prefill_complete"}, PREFILL_COMPLETE),
    ("decode", {"pp_size": 2, "enable_pd_role_switch": True}, f"{PP}; {ROLE_SWITCH}"),
    ("prefill", {"attn_cp_size": 2, "tp_size": 2}, CP),
])
def test_a_setting_p2pnccl_cannot_serve_fails_the_manager_naming_the_flag(role, flags, why):
    sargs = server_args(role, **flags)
    with pytest.raises(ValueError) as e:
        build_manager(role, sargs)
    assert str(e.value) == f"p2pnccl cannot serve this {role} server: {why}"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("p2p-")], "refused after starting threads"


def test_the_rust_bootstrap_registry_under_dp_attention_fails_the_manager(monkeypatch):
    monkeypatch.setenv("SGLANG_RUST_SERVER", "1")
    with pytest.raises(ValueError) as e:
        build_manager("prefill", server_args("prefill", attn_dp_size=2, tp_size=2))
    assert str(e.value) == f"p2pnccl cannot serve this prefill server: {RUST}"
    from sglang.srt.disaggregation.base.conn import KVArgs

    from sglang_p2p_backend.adapter.contract import refusals

    assert refusals(KVArgs(), server_args("prefill"), "prefill") == []  # without DP attention it is not read


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_mooncakes_custom_memory_pool_fails_the_manager_whatever_its_value(monkeypatch, role):
    from sglang.srt.disaggregation.base.conn import KVArgs

    from sglang_p2p_backend.adapter.contract import refusals

    monkeypatch.setenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "INTRA_NODE_NVLINK")
    with pytest.raises(ValueError) as e:
        build_manager(role, server_args(role))
    assert str(e.value) == f"p2pnccl cannot serve this {role} server: {CUSTOM_POOL}"
    got = refusals(KVArgs(), server_args(role), role, env={"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "NVLINK"})
    assert got == [CUSTOM_POOL.replace("=INTRA_NODE_NVLINK:", "=NVLINK:")]
    assert refusals(KVArgs(), server_args(role), role, env={"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": ""}) == []


def test_a_state_component_of_an_unsupported_type_fails_the_manager():
    from sglang.srt.disaggregation.base import conn

    if not hasattr(conn.StateType, "DSA_TAIL"):
        pytest.skip("this SGLang release has no dsa_tail state")
    with pytest.raises(ValueError) as e:
        build_manager("prefill", server_args("prefill"), [conn.StateType.MAMBA, conn.StateType.DSA_TAIL])
    assert str(e.value) == f"p2pnccl cannot serve this prefill server: {DSA_TAIL}"


@pytest.mark.parametrize("role,flags", [
    ("prefill", {"disaggregation_decode_host_receive_threshold": 0.5}),  # a decode setting
    ("prefill", {"enable_hisparse": True}),
    ("decode", {"enable_kv_cache_sharding": True}),  # a prefill setting
    ("decode", {}),
])
def test_a_setting_the_role_does_not_read_is_not_refused(role, flags):
    from sglang.srt.disaggregation.base.conn import KVArgs

    from sglang_p2p_backend.adapter.contract import refusals

    assert refusals(KVArgs(), server_args(role, **flags), role, env={"SGLANG_RUST_SERVER": "0"}) == []


@pytest.mark.parametrize("kwargs,text", [
    ({"destination": "host"}, "p2pnccl receives into device KV pages only (no decode host receive: "
                              "--disaggregation-decode-host-receive-threshold must stay 1)"),
    ({"device_kv_indices": [1, 2]}, "p2pnccl writes one page list per room; separate device page ids "
                                    "(device_kv_indices, --enable-hisparse) are not supported"),
])
def test_send_metadata_refuses_host_destinations_and_separate_device_pages(kwargs, text):
    from sglang.srt.disaggregation.base import conn

    if not hasattr(conn, "KVTransferDestination"):
        pytest.skip("this SGLang release has no KV transfer destinations")
    from sglang_p2p_backend.adapter.conn import P2pNcclKVReceiver

    if "destination" in kwargs:
        kwargs = {"destination": conn.KVTransferDestination(kwargs["destination"])}
    receiver = object.__new__(P2pNcclKVReceiver)  # refused before anything of the receiver is read
    with pytest.raises(NotImplementedError) as e:
        receiver.send_metadata([3, 4], 0, None, decode_prefix_len=0, **kwargs)
    assert str(e.value) == text
