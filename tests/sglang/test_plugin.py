"""Registration through SGLang's own plugin loader and argument parser."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.sglang


OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, env=OFFLINE)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A local model folder (config only): SGLang 0.5.17 reads the model config while parsing, offline here."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


def test_fresh_process_loader_then_parser_accepts_p2pnccl(tiny_model):
    out = run_fresh(
        f"""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        for mode in ("prefill", "decode"):
            a = prepare_server_args(["--model-path", {tiny_model!r}, "--device", "cpu", "--disaggregation-mode", mode,
                                     "--disaggregation-transfer-backend", "p2pnccl"])
            print(mode, a.disaggregation_transfer_backend)
        """
    )
    assert "prefill p2pnccl" in out and "decode p2pnccl" in out


def test_parser_rejects_p2pnccl_without_the_plugin(tiny_model):
    code = f"""
        import os
        os.environ["SGLANG_PLUGINS"] = "none-of-ours"
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        prepare_server_args(["--model-path", {tiny_model!r}, "--device", "cpu", "--disaggregation-transfer-backend", "p2pnccl"])
        """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, env=OFFLINE)
    assert out.returncode != 0 and "invalid choice: 'p2pnccl'" in out.stderr


def test_registration_is_in_place_and_idempotent():
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

    from sglang_p2p_backend import plugin
    from sglang_p2p_backend.adapter import conn

    enum_before = utils.TransferBackend
    mooncake = utils.TransferBackend.MOONCAKE
    load_plugins()
    plugin.load()
    plugin.load()
    assert utils.TransferBackend is enum_before, "the enum class must never be replaced"
    member = utils.TransferBackend("p2pnccl")
    assert member is utils.TransferBackend.P2PNCCL is utils.TransferBackend["P2PNCCL"]
    assert member in list(utils.TransferBackend) and utils.TransferBackend.MOONCAKE is mooncake
    assert pickle.loads(pickle.dumps(member)) is member
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("p2pnccl") == 1
    get = utils.get_kv_class
    K = utils.KVClassType
    assert get(member, K.MANAGER) is conn.P2pNcclKVManager
    assert get(member, K.SENDER) is conn.P2pNcclKVSender
    assert get(member, K.RECEIVER) is conn.P2pNcclKVReceiver
    assert get(member, K.BOOTSTRAP_SERVER) is conn.P2pNcclKVBootstrapServer
    # other backends still go to SGLang's original, through the scheduler modules' aliases too
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill

    assert prefill.get_kv_class(member, K.MANAGER) is conn.P2pNcclKVManager
    assert decode.get_kv_class(member, K.RECEIVER) is conn.P2pNcclKVReceiver
    assert get(utils.TransferBackend.FAKE, K.SENDER).__name__ == "FakeKVSender"


def test_unsupported_release_fails_with_the_supported_range():
    from sglang_p2p_backend import plugin

    with pytest.raises(plugin.UnsupportedSGLangError) as e:
        plugin.check_sglang_version("0.5.9")
    msg = str(e.value)
    assert "0.5.17 and 0.5.23" in msg and "found 0.5.9" in msg
    assert plugin.check_sglang_version() in plugin.SUPPORTED_SGLANG
