"""Build the random-weight models the end-to-end check serves, with no download.

    python3 -m e2e.make_tiny_models OUT_DIR [--only llama-tiny,mla-tiny,llama-anchor]

Every model shares one byte-level BPE tokenizer (4096 tokens) trained locally on text that ships with CPython
(``bench.sweep.make_tokenizer``), so the models are identical on every machine for a given seed.

* ``llama-tiny``: 4-layer Llama (hidden 256, 4 heads, 2 KV heads), "sharpened" (below).
* ``mla-tiny``: 2-layer DeepSeek-V3 (MLA: kv_lora_rank 512, rope 64, nope 128, v 128; all layers dense, so
  no MoE kernels are needed), sharpened the same way.
* ``deepseek-tiny``: the DeepSeek-V3 shape in miniature for the 4-GPU topologies: MLA as in ``mla-tiny``,
  4 layers of which the first is dense and three MoE (8 routed experts, top 2, one shared expert, sigmoid
  routing as V3), so expert parallelism over 2 GPUs has experts on each; sharpened like the others.
* ``deepseek-wide``: ``deepseek-tiny`` at hidden size 2048 (dense MLP 1024), the smallest DeepEP's low-latency
  kernels are compiled for, so a decode can run them (``mini-b-deepep-ll``); sharpened the same way.
* ``deepseek-anchor``: for serving figures of the 4-GPU topologies: DeepSeek-V3's KV shape (61 MLA layers of
  kv_lora_rank 512 + rope 64, 70 KiB of KV a token like V3), its first 3 layers dense and the others MoE (16
  routed experts, top 4, one shared), hidden 1024; default init, for timing.
* ``swa-tiny``: a hybrid sliding-window model: GPT-OSS in bf16 (no MXFP4), 4 layers alternating
  sliding (window 48) and full attention, hidden 256, 4 heads x 64 with 2 KV heads, attention sinks and biases,
  a small MoE (4 experts of 128, top 2, as GPT-OSS has no dense MLP), YaRN RoPE as gpt-oss-20b. SGLang 0.5.17
  lists ``GptOssForCausalLM`` as hybrid SWA (``is_hybrid_swa_model``), so it serves it from an ``SWAKVPool`` and
  p2pnccl moves the window's pages as an ``swa`` state component next to the full layers' KV. The check's
  prompts of up to 2,500 tokens cross the window many times. Sharpened like the others (q/k, v/o with their
  biases, routers, lm_head).
* ``llama-anchor``: 32 layers, hidden 1024, 8 KV heads x head_dim 128, i.e. 128 KiB of KV per token like
  Llama-3-8B: the shape of the usual Mooncake PD baseline, default init, for timing.

Why sharpen: at the default init a random model's greedy output repeats one token and a changed context moves
its logprobs by about bf16 rounding, so matching outputs would say little about whether the KV arrived
intact. Scaling q/k up (x2.5), v/o down (x0.7) and lm_head up (x5) makes the output depend on the context;
on the 2-GPU host one changed prompt token, or one token's or one layer's KV zeroed on decode, then moved
the logprobs by at least 0.35 nats.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

QK_SCALE, VO_SCALE, LM_HEAD_SCALE = 2.5, 0.7, 5.0
# MoE routers at the default init score every expert ~0.5 (sigmoid of ~0), so which two experts a token takes
# hangs on rounding; scaled up, the choice is decisive and a different TP/EP layout picks the same experts
ROUTER_SCALE = 5.0
VOCAB = 4096
MAX_POSITIONS = 65536  # SGLang's own PD tests send prompts of ~28k tokens
# swa-tiny's window: under the check's 64-token prefill chunk and not a multiple of it or of a page, so chunks and
# pages straddle its edge; every check prompt of 65 tokens or more reaches past it
SWA_WINDOW = 48


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "llama", "deepseek_v3" or "gpt_oss"
    config: dict[str, Any]
    sharpen: bool


def _common(tok_ids: dict[str, int]) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                bos_token_id=tok_ids["bos"], eos_token_id=tok_ids["eos"], pad_token_id=tok_ids["pad"],
                torch_dtype="bfloat16")


def specs(tok_ids: dict[str, int]) -> dict[str, ModelSpec]:
    c = _common(tok_ids)
    llama_tiny = dict(c, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64)
    mla_tiny = dict(c, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                    qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
                    # MoE fields must be valid, but first_k_dense_replace = num_hidden_layers keeps every layer dense
                    first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                    # SGLang 0.5.17's DeepseekV2 model reads this V2-era field, which DeepseekV3Config lacks
                    moe_layer_freq=1,
                    moe_intermediate_size=128, n_group=1, topk_group=1)
    deepseek_tiny = dict(mla_tiny, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8,
                         n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128,
                         # V3's routing, which SGLang's model reads from the config (transformers' class lacks them)
                         topk_method="noaux_tc", scoring_func="sigmoid")
    # the smallest hidden size DeepEP's low-latency kernels are compiled for (mini-b-deepep-ll)
    deepseek_wide = dict(deepseek_tiny, hidden_size=2048, intermediate_size=1024)
    deepseek_anchor = dict(deepseek_tiny, hidden_size=1024, intermediate_size=2048, num_hidden_layers=61,
                           num_attention_heads=16, num_key_value_heads=16, first_k_dense_replace=3,
                           n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)
    # GPT-OSS as SGLang 0.5.17's gpt_oss.py reads it: layer_types (which layers slide: get_hybrid_layer_ids),
    # sliding_window (SGLang attends to sliding_window - 1 earlier tokens, as HF), swiglu_limit (read from the
    # config; transformers hard-codes 7.0 and does not save it), rope_parameters (gpt-oss-20b's YaRN; 131072
    # positions = 32 x 4096, as that model). 4 experts keep the router off FlashInfer's tinygemm (rows % 16).
    swa_tiny = dict(c, max_position_embeddings=131072, hidden_size=256, intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=SWA_WINDOW,
                    num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0, attention_bias=True,
                    hidden_act="silu",
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=4096))
    anchor = dict(c, hidden_size=1024, intermediate_size=1024, num_hidden_layers=32, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=128)
    return {
        "llama-tiny": ModelSpec("llama-tiny", "llama", llama_tiny, sharpen=True),
        "mla-tiny": ModelSpec("mla-tiny", "deepseek_v3", mla_tiny, sharpen=True),
        "deepseek-tiny": ModelSpec("deepseek-tiny", "deepseek_v3", deepseek_tiny, sharpen=True),
        "deepseek-wide": ModelSpec("deepseek-wide", "deepseek_v3", deepseek_wide, sharpen=True),
        "deepseek-anchor": ModelSpec("deepseek-anchor", "deepseek_v3", deepseek_anchor, sharpen=False),
        "swa-tiny": ModelSpec("swa-tiny", "gpt_oss", swa_tiny, sharpen=True),
        "llama-anchor": ModelSpec("llama-anchor", "llama", anchor, sharpen=False),
    }


def _scale_rows(weight: Any, start: int, stop: int, factor: float) -> None:
    weight.data[start:stop] *= factor


def sharpen_llama(model: Any) -> None:
    """q/k x2.5, v/o x0.7, lm_head x5 (module-wise, so it holds for any layer count)."""
    for layer in model.model.layers:
        a = layer.self_attn
        a.q_proj.weight.data *= QK_SCALE
        a.k_proj.weight.data *= QK_SCALE
        a.v_proj.weight.data *= VO_SCALE
        a.o_proj.weight.data *= VO_SCALE
    model.lm_head.weight.data *= LM_HEAD_SCALE


def sharpen_mla(model: Any) -> None:
    """The same scales on MLA's factorised projections.

    k has two parts: k_pe comes straight from kv_a_proj_with_mqa's last qk_rope_head_dim rows (not normalised,
    so scaling those rows scales it), k_nope from kv_b_proj after the kv_a RMSNorm (scale its k rows there).
    kv_b_proj's rows are laid out per head as [k_nope (qk_nope_head_dim), v (v_head_dim)].
    """
    cfg = model.config
    nope, v, rope, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    for layer in model.model.layers:
        a = layer.self_attn
        q = a.q_proj if cfg.q_lora_rank is None else a.q_b_proj
        q.weight.data *= QK_SCALE
        _scale_rows(a.kv_a_proj_with_mqa.weight, r, r + rope, QK_SCALE)
        kvb = a.kv_b_proj.weight.data.view(cfg.num_attention_heads, nope + v, r)
        kvb[:, :nope] *= QK_SCALE
        kvb[:, nope:] *= VO_SCALE
        a.o_proj.weight.data *= VO_SCALE
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):  # an MoE layer's router
            gate.weight.data *= ROUTER_SCALE
    model.lm_head.weight.data *= LM_HEAD_SCALE


def sharpen_gpt_oss(model: Any) -> None:
    """Llama's scales on GPT-OSS, biases included (q = Wx + b: scaling both scales q); routers x5 like
    deepseek-tiny's, so the two experts a token takes are a clear choice. The sinks stay as initialised."""
    for layer in model.model.layers:
        a = layer.self_attn
        for proj, factor in ((a.q_proj, QK_SCALE), (a.k_proj, QK_SCALE), (a.v_proj, VO_SCALE), (a.o_proj, VO_SCALE),
                             (layer.mlp.router, ROUTER_SCALE)):
            proj.weight.data *= factor
            proj.bias.data *= factor
    model.lm_head.weight.data *= LM_HEAD_SCALE


SHARPEN: dict[str, Callable[[Any], None]] = {"llama": sharpen_llama, "deepseek_v3": sharpen_mla,
                                             "gpt_oss": sharpen_gpt_oss}


def classes(family: str) -> tuple[Any, Any]:
    """(config class, model class) of a family."""
    import transformers

    return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
            "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}[family]


def build_tokenizer(out: Path) -> dict[str, int]:
    """Train (once) the shared tokenizer; returns the special token ids."""
    from bench.sweep.make_tokenizer import SPECIALS, build

    if not (out / "tokenizer.json").exists():
        build(out, VOCAB)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos, pad = (vocab[s] for s in SPECIALS)
    return {"bos": bos, "eos": eos, "pad": pad}


def build_model(spec: ModelSpec, tok_dir: Path, out: Path, seed: int) -> Path:
    import torch

    config_cls, model_cls = classes(spec.family)
    torch.manual_seed(seed)
    config = config_cls(**spec.config)
    model = model_cls(config).to(torch.bfloat16)
    if spec.sharpen:
        with torch.no_grad():
            SHARPEN[spec.family](model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--only", default="llama-tiny,mla-tiny,llama-anchor", help="comma list of model names")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--force", action="store_true", help="rebuild models that already exist")
    a = ap.parse_args(argv)
    tok_dir = a.out_dir / "tokenizer"
    ids = build_tokenizer(tok_dir)
    table = specs(ids)
    for name in a.only.split(","):
        if name not in table:
            print(f"error: unknown model {name!r}; known: {', '.join(table)}", file=sys.stderr)
            return 2
        dest = a.out_dir / name
        if (dest / "config.json").exists() and not a.force:
            print(f"{dest} (exists)")
            continue
        print(build_model(table[name], tok_dir, dest, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
