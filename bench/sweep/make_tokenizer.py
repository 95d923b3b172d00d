"""Build a local Hugging Face tokenizer folder without any hub download.

genai-bench and evalscope perf need a tokenizer to cut prompts to an exact token count.  On a GPU cluster
pass the served model's own tokenizer folder instead (e.g. the model path); this one is for loopback sweeps
against simulated workers and for CI.  It trains a byte-level BPE with the ``tokenizers`` library on English
text that ships with every CPython (``pydoc_data.topics``), so the result is the same on every machine.

    python -m bench.sweep.make_tokenizer OUT_DIR [--vocab-size 4096]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# a minimal chat template so chat-endpoint clients that render prompts locally get plain text
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def corpus() -> list[str]:
    from pydoc_data.topics import topics  # stdlib: ~0.7 MB of English prose

    return [topics[k] for k in sorted(topics)]


def build(out_dir: Path, vocab_size: int = 4096) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **special,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--vocab-size", type=int, default=4096)
    a = ap.parse_args(argv)
    print(build(a.out_dir, a.vocab_size))


if __name__ == "__main__":
    main()
