"""The random models the GPU check serves: built on CPU here, with the sharpening scales applied exactly."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from e2e import make_tiny_models as mtm  # noqa: E402


def _build(tmp_path_factory, folder: str, only: str):
    out = tmp_path_factory.mktemp(folder)
    assert mtm.main([str(out), "--only", only]) == 0
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory, "models", "llama-tiny,mla-tiny,deepseek-tiny")


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _unsharpened(name, tok_ids):
    spec = mtm.specs(tok_ids)[name]
    cfg, cls = mtm.classes(spec.family)
    torch.manual_seed(1234)
    return {k: v for k, v in cls(cfg(**spec.config)).to(torch.bfloat16).state_dict().items()}


def test_folders_have_weights_config_and_tokenizer(built):
    for name in ("llama-tiny", "mla-tiny"):
        d = built / name
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in d.iterdir()}
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["vocab_size"] == mtm.VOCAB and cfg["tie_word_embeddings"] is False
    mla = json.loads((built / "mla-tiny/config.json").read_text())
    assert mla["model_type"] == "deepseek_v3" and mla["kv_lora_rank"] == 512
    assert mla["first_k_dense_replace"] == mla["num_hidden_layers"]  # no MoE layer


def test_deepseek_tiny_has_moe_layers_with_decisive_routers(built):
    cfg = json.loads((built / "deepseek-tiny/config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["first_k_dense_replace"], cfg["n_routed_experts"], cfg["num_experts_per_tok"],
            cfg["n_shared_experts"], cfg["topk_method"], cfg["scoring_func"]) == (4, 1, 8, 2, 1, "noaux_tc", "sigmoid")
    ids = mtm.build_tokenizer(built / "tokenizer")
    base, got = _unsharpened("deepseek-tiny", ids), _weights(built / "deepseek-tiny")
    assert "model.layers.0.mlp.gate.weight" not in got  # the first layer is dense
    for layer in (1, 3):
        key = f"model.layers.{layer}.mlp.gate.weight"
        torch.testing.assert_close(got[key].float(), (base[key].float() * mtm.ROUTER_SCALE).bfloat16().float(),
                                   rtol=1e-2, atol=1e-3)
        assert f"model.layers.{layer}.mlp.experts.7.down_proj.weight" in got
        assert f"model.layers.{layer}.mlp.shared_experts.up_proj.weight" in got


def test_llama_sharpening_scales(built):
    ids = mtm.build_tokenizer(built / "tokenizer")
    base, got = _unsharpened("llama-tiny", ids), _weights(built / "llama-tiny")
    for key, scale in (("model.layers.0.self_attn.q_proj.weight", 2.5), ("model.layers.3.self_attn.k_proj.weight", 2.5),
                       ("model.layers.1.self_attn.v_proj.weight", 0.7), ("model.layers.2.self_attn.o_proj.weight", 0.7),
                       ("lm_head.weight", 5.0), ("model.layers.0.mlp.up_proj.weight", 1.0)):
        torch.testing.assert_close(got[key].float(), (base[key].float() * scale).bfloat16().float(), rtol=1e-2, atol=1e-3)


def test_mla_sharpening_scales_k_rows_up_and_v_rows_down(built):
    ids = mtm.build_tokenizer(built / "tokenizer")
    base, got = _unsharpened("mla-tiny", ids), _weights(built / "mla-tiny")
    kvb = "model.layers.1.self_attn.kv_b_proj.weight"
    b, g = base[kvb].float().view(4, 256, 512), got[kvb].float().view(4, 256, 512)
    torch.testing.assert_close(g[:, :128], (b[:, :128] * 2.5).bfloat16().float(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(g[:, 128:], (b[:, 128:] * 0.7).bfloat16().float(), rtol=1e-2, atol=1e-3)
    kva = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    torch.testing.assert_close(got[kva][:512], base[kva][:512])  # the normalised latent part is left alone
    torch.testing.assert_close(got[kva][512:].float(), (base[kva][512:].float() * 2.5).bfloat16().float(), rtol=1e-2, atol=1e-3)


def test_sharpened_model_output_depends_on_one_prompt_token(built):
    """What makes the comparison sharp: one changed token moves the next-token logprobs well above bf16 noise."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(built / "llama-tiny", dtype=torch.float32)
    prompt = torch.randint(3, mtm.VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    changed = prompt.clone()
    changed[0, 20] = (changed[0, 20] + 1) % mtm.VOCAB
    with torch.no_grad():
        a = m(prompt).logits[0, -1].log_softmax(-1)
        b = m(changed).logits[0, -1].log_softmax(-1)
    assert (a - b).abs().max().item() > 0.05


# --- swa-tiny: the hybrid sliding-window model (GPT-OSS, bf16) ---------------------------------------------

@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    return _build(tmp_path_factory, "swa", "swa-tiny")


def test_swa_tiny_is_hybrid_swa_for_sglang(swa):
    """The config SGLang reads marks it hybrid SWA (SWAKVPool) with layers 0, 2 sliding and 1, 3 full, and has
    every field 0.5.17's gpt_oss.py reads from it."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(swa / "swa-tiny")
    assert cfg.architectures == ["GptOssForCausalLM"] and cfg.model_type == "gpt_oss"
    assert cfg.sliding_window == mtm.SWA_WINDOW and cfg.sliding_window - 1 > 0  # SGLang's window: sliding_window - 1
    assert cfg.swiglu_limit == 7.0 and cfg.attention_bias is True and cfg.hidden_act == "silu"
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["rope_theta"] == 150000.0
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (4, 2, 128)
    assert cfg.num_local_experts % 16 != 0  # the router stays off FlashInfer's tinygemm path
    assert getattr(cfg, "quantization_config", None) is None  # bf16: no MXFP4 loader, no MXFP4 MoE kernels
    # where the SGLang release on the path imports, ask it; else the fields it reads (0.5.17 model_config.py)
    try:
        from sglang.srt.configs.model_config import get_hybrid_layer_ids, is_hybrid_swa_model
    except ImportError:
        assert "GptOssForCausalLM" in cfg.architectures
        swa_ids = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
        full_ids = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    else:
        from sglang.srt.configs.model_config import ModelConfig

        assert is_hybrid_swa_model(cfg.architectures, cfg)
        swa_ids, full_ids = get_hybrid_layer_ids(cfg.architectures, cfg)
        mc = ModelConfig(str(swa / "swa-tiny"))  # what the server builds from --model-path
        assert mc.is_hybrid_swa and (mc.swa_attention_layer_ids, mc.full_attention_layer_ids) == ([0, 2], [1, 3])
        assert (mc.num_key_value_heads, mc.head_dim, mc.context_len) == (2, 64, 131072)
    assert (list(swa_ids), list(full_ids)) == ([0, 2], [1, 3])


def test_swa_tiny_checkpoint_is_the_hub_layout_sglang_loads(swa):
    """gpt_oss.py's loader takes the experts fused as gpt-oss-20b ships them (gate_up [E, hidden, 2 x inter],
    down [E, inter, hidden], transposed on load), biases and the sinks by name; sharpened like the others."""
    got = _weights(swa / "swa-tiny")
    assert tuple(got["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 256, 256)
    assert tuple(got["model.layers.0.mlp.experts.down_proj"].shape) == (4, 128, 256)
    for key in ("model.layers.1.mlp.experts.gate_up_proj_bias", "model.layers.1.mlp.experts.down_proj_bias",
                "model.layers.3.self_attn.sinks", "model.layers.2.self_attn.q_proj.bias", "model.layers.0.mlp.router.bias"):
        assert key in got
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    ids = mtm.build_tokenizer(swa / "tokenizer")
    base = _unsharpened("swa-tiny", ids)
    for key, scale in (("model.layers.0.self_attn.q_proj.weight", 2.5), ("model.layers.1.self_attn.k_proj.bias", 2.5),
                       ("model.layers.2.self_attn.v_proj.weight", 0.7), ("model.layers.3.self_attn.o_proj.bias", 0.7),
                       ("model.layers.1.mlp.router.weight", 5.0), ("lm_head.weight", 5.0),
                       ("model.layers.0.self_attn.sinks", 1.0), ("model.layers.2.mlp.experts.down_proj", 1.0)):
        torch.testing.assert_close(got[key].float(), (base[key].float() * scale).bfloat16().float(), rtol=1e-2, atol=1e-3)


def test_swa_tiny_forward_slides_and_depends_on_context_beyond_the_window(swa):
    """A forward pass on a prompt past the window: the window is in effect (all-full attention answers
    differently), and a token outside the last window still moves the next-token logprobs (through the full
    layers' KV), as does one inside it: a wrong byte of either KV part would show."""
    import transformers

    path = swa / "swa-tiny"
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = 3 * mtm.SWA_WINDOW
    prompt = torch.randint(3, mtm.VOCAB, (1, n), generator=torch.Generator().manual_seed(0))

    def last(model, ids):
        with torch.no_grad():
            out = model(ids).logits
        assert out.shape == (1, n, mtm.VOCAB) and torch.isfinite(out).all()
        return out[0, -1].log_softmax(-1)

    base = last(m, prompt)
    for pos in (5, n - 10):  # far outside the last window; inside it
        changed = prompt.clone()
        changed[0, pos] = (changed[0, pos] + 1) % mtm.VOCAB
        assert (base - last(m, changed)).abs().max().item() > 0.05, pos
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    full = transformers.AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32)
    assert (base - last(full, prompt)).abs().max().item() > 0.05
