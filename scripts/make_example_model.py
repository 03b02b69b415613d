"""Build quantkit's bundled example checkpoint ``quantkit/examples/tiny-moe/``, deterministically.

The example is a one-layer Qwen3-MoE (hidden 256, 4 heads / 2 KV heads, 4 routed experts of width 256, top-2,
vocabulary 512 with the tiny byte-level BPE of :mod:`quantkit.testing.tiny_tokenizer`): every weight row is a
multiple of 256, so every GGUF block type, K-quants and IQ types included, applies to every matrix, and the BF16
checkpoint stays near 2.5 MB.

Steps (each a function, so a later issue can put training between the initial weights and the release):

1. :func:`example_tokenizer`: the trained tiny BPE with Qwen's special tokens.
2. :func:`example_config`: the model configuration.
3. :func:`initial_weights`: seeded random initialisation with constant tensors perturbed (as the test models).
4. :func:`write_release`: the BF16 release (transformers' own ``save_pretrained``), the tokenizer and
   ``quantkit_example.json`` (how it was built, with the versions that determine its bytes).

Usage: ``python scripts/make_example_model.py [--out DIR] [--seed N]``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantkit.examples import example_model_dir  # noqa: E402
from quantkit.testing import tiny_tokenizer  # noqa: E402
from quantkit.testing.tiny_models import build_tiny_tokenizer, release_copy, seeded_model  # noqa: E402

ARCH = "qwen3_moe"
MODEL_CLASS = "Qwen3MoeForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
PROVENANCE_FILE = "quantkit_example.json"
DEFAULT_SEED = 0


def example_tokenizer():
    return build_tiny_tokenizer(ARCH)


def example_config(tokenizer):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=tiny_tokenizer.MODEL_VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=256, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))


def initial_weights(config, seed: int):
    return seeded_model(MODEL_CLASS, config, seed)


def write_release(model, tokenizer, out: Path, seed: int) -> None:
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    release_copy(model, AUTO_CLASS).save_pretrained(out)
    tokenizer.save_pretrained(out)
    provenance = {
        "builder": "scripts/make_example_model.py", "seed": seed, "weights": "random initialisation (untrained)",
        "tokenizer_corpus": [f"python{sys.version_info.major}.{sys.version_info.minor}/{name}"
                             for name in tiny_tokenizer.CORPUS_FILES],
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")


def build(out: Path, seed: int = DEFAULT_SEED) -> Path:
    tokenizer = example_tokenizer()
    model = initial_weights(example_config(tokenizer), seed)
    write_release(model, tokenizer, out, seed)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=example_model_dir(), help="output directory")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    build(args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
