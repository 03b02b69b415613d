"""Seeded tiny checkpoints of the five target architectures, built with transformers, for every later test.

Each architecture (:data:`ARCHS`) is a real transformers 5.23 model shrunk to hidden 256, 8 routed experts
(top-2) of width 256, a 512-row vocabulary with a real byte-level BPE tokenizer (:mod:`.tiny_tokenizer`) and the
fewest layers that still contain every layer type of the architecture (see :func:`describe`).  Weights are the
model's own random initialisation under ``torch.manual_seed(seed)``; afterwards every floating tensor that the
initialisation left constant (norm weights, biases, ``A_log``, ``dt_bias``, ``hc_*`` base/scale, attention sinks,
compressor position biases, router correction biases) gets ``PERTURB_STD`` Gaussian noise from a generator seeded
with ``seed``, so a test can tell whether a converter carried it, and DeepSeek V4's hash-routing table gets
distinct random experts per token.  Nothing here depends on the global RNG state of the caller.

Dtypes: ``"f32"`` keeps the float32 master; ``"bf16"`` is what a release holds: transformers' own
``from_pretrained(dtype=bfloat16)`` of the master, which keeps each model's ``_keep_in_fp32_modules_strict``
(norms, router biases, hyper-connection parameters, ...) in float32.

Checkpoints (:func:`save_tiny_checkpoint`) come in three layouts and several encodings, see
:mod:`.tiny_checkpoints`.  Everything that llama.cpp's converter reads from ``config.json`` but transformers
does not write (INTEROP.md) is added to the saved ``config.json`` (:attr:`TinyArch.converter_keys`).
"""
from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedError
from .tiny_tokenizer import MODEL_VOCAB_SIZE, TokenizerSpec, build_tokenizer, special_ids

PERTURB_STD = 0.1
PERTURB_SEED_OFFSET = 0x5EED  # the perturbation generator must not replay the initialisation's random stream
DTYPES = ("bf16", "f32")

HIDDEN = 256
EXPERTS = 8
TOP_K = 2
EXPERT_WIDTH = 256
DENSE_WIDTH = 512

_DEEPSEEK_TOKENS = TokenizerSpec(leading=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
                                 trailing=("<｜User｜>", "<｜Assistant｜>"),
                                 bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                                 pad="<｜end▁of▁sentence｜>")
_QWEN_TOKENS = TokenizerSpec(trailing=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                             eos="<|im_end|>", pad="<|endoftext|>")
_QWEN_VL_TOKENS = TokenizerSpec(trailing=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                          "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
                                eos="<|im_end|>", pad="<|endoftext|>")
_GLM_TOKENS = TokenizerSpec(trailing=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                                      "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                      "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                                      "<|end_of_video|>", "<|image|>", "<|video|>"),
                            eos="<|endoftext|>", pad="<|endoftext|>")


@dataclass(frozen=True)
class TinyArch:
    """One target architecture: how to configure, build and describe its tiny model."""

    name: str
    model_class: str            # transformers class the checkpoint's "architectures" names
    auto_class: str             # transformers Auto class that loads it back
    tokenizer: TokenizerSpec
    make_config: Callable[[dict[str, int]], Any]       # special-token ids -> transformers config
    converter_keys: Callable[[Any], dict[str, Any]]    # config -> keys llama.cpp needs in config.json
    nested: bool = False        # config.json has text_config/vision_config (a multimodal checkpoint)
    layer_notes: tuple[str, ...] = field(default_factory=tuple)   # which layer covers which type


def _qwen3_moe(ids: dict[str, int]):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=DENSE_WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])


def _deepseek_v3(ids: dict[str, int]):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=DENSE_WIDTH,
        moe_intermediate_size=EXPERT_WIDTH, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=128,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, num_nextn_predict_layers=0,
        max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=ids["<｜begin▁of▁sentence｜>"], eos_token_id=ids["<｜end▁of▁sentence｜>"],
        tie_word_embeddings=False)


# DeepSeek V4: one layer per compression ratio llama.cpp accepts (sliding, CSA, HCA); layer 0 is hash-routed.
V4_COMPRESS_RATIOS = (0, 4, 128)
V4_HASH_LAYERS = 1
V4_ROPE_SCALING = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                   "beta_slow": 1}


def _deepseek_v4(ids: dict[str, int]):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=HIDDEN, moe_intermediate_size=EXPERT_WIDTH,
        num_hidden_layers=len(V4_COMPRESS_RATIOS), num_attention_heads=4, num_key_value_heads=1, head_dim=128,
        q_lora_rank=128, qk_rope_head_dim=64, o_groups=2, o_lora_rank=64, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K, n_shared_experts=1, compress_ratios=list(V4_COMPRESS_RATIOS),
        num_hash_layers=V4_HASH_LAYERS, index_n_heads=16, index_head_dim=128, index_topk=8, sliding_window=32,
        hc_mult=4, hc_sinkhorn_iters=20, num_nextn_predict_layers=0, max_position_embeddings=1048576,
        rope_scaling=dict(V4_ROPE_SCALING), bos_token_id=ids["<｜begin▁of▁sentence｜>"],
        eos_token_id=ids["<｜end▁of▁sentence｜>"], tie_word_embeddings=False)


_V4_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _v4_converter_keys(config) -> dict[str, Any]:
    # transformers folds these legacy keys into layer_types / mlp_layer_types / rope_parameters and drops them
    return {"compress_ratios": [_V4_LAYER_TYPE_RATIO[t] for t in config.layer_types],
            "num_hash_layers": config.mlp_layer_types.count("hash_moe"),
            "qk_rope_head_dim": config.qk_rope_head_dim, "rope_scaling": dict(V4_ROPE_SCALING),
            "topk_method": "noaux_tc"}

GLM_LINEAR_HEAD_DIM = 64


def _glm5_next(ids: dict[str, int]):
    from transformers import Glm5NextConfig

    text = dict(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=DENSE_WIDTH,
        moe_intermediate_size=EXPERT_WIDTH, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, routed_scaling_factor=2.5,
        kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=0, qk_nope_head_dim=64, v_head_dim=64,
        index_topk=32, index_head_dim=64, index_n_heads=16, index_kpool=16,
        mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        indexer_types=["full", "full", "shared"],
        linear_head_dim=GLM_LINEAR_HEAD_DIM, linear_num_heads=4, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_sinkhorn_iters=20, rms_norm_eps=1e-5, max_position_embeddings=1048576,
        pad_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|endoftext|>"], ids["<|user|>"],
                                                          ids["<|observation|>"]],
        bos_token_id=None, tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=HIDDEN,
                  projection_intermediate_size=64, patch_size=14, image_size=28)
    return Glm5NextConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False)


def _glm5_converter_keys(config) -> dict[str, Any]:
    text = config.text_config
    return {"linear_attn_config": {"head_dim": text.linear_head_dim, "num_heads": text.linear_num_heads,
                                   "short_conv_kernel_size": text.linear_conv_kernel_dim,
                                   "gate_lower_bound": text.linear_lower_bound, "safe_gate": True},
            "mla_use_nope": True, "first_k_dense_replace": text.mlp_layer_types.count("dense"),
            "num_nextn_predict_layers": 0}


def _qwen4_exp(ids: dict[str, int]):
    from transformers import Qwen4ExpConfig

    text = dict(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=EXPERT_WIDTH, shared_expert_intermediate_size=EXPERT_WIDTH,
        num_experts_per_tok=TOP_K, num_experts=EXPERTS, norm_topk_prob=True,
        layer_types=["linear_attention", "full_attention"], hc_count=4, hc_lowrank=64,
        ple_layer_ids=[1], ple_embed_dim=HIDDEN, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=1,
        ngram_vocab_size_base=1000, split_ngram_parts=2, indexer_n_heads=16, indexer_kv_heads=1,
        indexer_head_dim=64, indexer_budget=16, indexer_compress_ratio=4, output_gate_type="sigmoid",
        rms_norm_eps=1e-6, max_position_embeddings=32768, eos_token_id=ids["<|im_end|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                  out_hidden_size=HIDDEN, num_position_embeddings=64)
    return Qwen4ExpConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _qwen4_converter_keys(config) -> dict[str, Any]:
    # Real releases name the QSA layers "full_attention"; transformers renames them "indexed_attention" on load.
    return {"layer_types": ["full_attention" if t == "indexed_attention" else t
                            for t in config.text_config.layer_types]}


ARCHS: dict[str, TinyArch] = {arch.name: arch for arch in (
    TinyArch("qwen3_moe", "Qwen3MoeForCausalLM", "AutoModelForCausalLM", _QWEN_TOKENS, _qwen3_moe,
             lambda config: {},
             layer_notes=("0: attention + MoE", "1: attention + MoE")),
    TinyArch("deepseek_v3", "DeepseekV3ForCausalLM", "AutoModelForCausalLM", _DEEPSEEK_TOKENS, _deepseek_v3,
             lambda config: {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
             layer_notes=("0: MLA + dense MLP", "1: MLA + MoE (shared expert, group routing)")),
    TinyArch("deepseek_v4", "DeepseekV4ForCausalLM", "AutoModelForCausalLM", _DEEPSEEK_TOKENS, _deepseek_v4,
             _v4_converter_keys,
             layer_notes=("0: sliding attention (ratio 0) + hash-routed MoE",
                          "1: compressed sparse attention (ratio 4, indexer) + MoE",
                          "2: heavily compressed attention (ratio 128) + MoE")),
    TinyArch("glm5_next", "Glm5NextForConditionalGeneration", "AutoModelForImageTextToText", _GLM_TOKENS,
             _glm5_next, _glm5_converter_keys, nested=True,
             layer_notes=("0: KDA linear attention + dense MLP", "1: MLA with its own indexer + MoE",
                          "2: MLA reusing layer 1's indexer selection + MoE")),
    TinyArch("qwen4_exp", "Qwen4ExpForConditionalGeneration", "AutoModelForImageTextToText", _QWEN_VL_TOKENS,
             _qwen4_exp, _qwen4_converter_keys, nested=True,
             layer_notes=("0: gated delta net + PLE n-gram embedding + MoE",
                          "1: QSA sparse (indexed) attention + MoE")),
)}


def get_arch(arch: str) -> TinyArch:
    if arch not in ARCHS:
        raise UnsupportedError(f"no tiny model for architecture {arch!r}; known: {sorted(ARCHS)}")
    return ARCHS[arch]


def tiny_config(arch: str):
    """The transformers config of ``arch``'s tiny model."""
    spec = get_arch(arch)
    return spec.make_config(special_ids(spec.tokenizer))


def build_tiny_tokenizer(arch: str):
    return build_tokenizer(get_arch(arch).tokenizer)


def _perturb_constants(model, generator) -> None:
    """Add noise to every floating tensor the initialisation left constant."""
    import torch

    with torch.no_grad():
        for _, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            flat = tensor.reshape(-1)
            if bool((flat == flat[0]).all()):
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensor.add_((PERTURB_STD * noise).to(tensor.dtype))


def _fill_hash_routes(model, generator) -> None:
    """Give every hash-routing table (DeepSeek V4 ``tid2eid``) distinct random experts per token."""
    import torch

    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith(".tid2eid"):
                vocab, top_k = buffer.shape
                n_experts = model.config.n_routed_experts
                order = torch.argsort(torch.rand(vocab, n_experts, generator=generator), dim=1)
                buffer.copy_(order[:, :top_k].to(buffer.dtype))


def seeded_model(model_class: str, config, seed: int):
    """A ``transformers.<model_class>`` of ``config``: initialised under ``manual_seed(seed)``, constants perturbed
    and hash routes filled (see the module doc), in eval mode; the caller's RNG state is left untouched."""
    import torch
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config)
    generator = torch.Generator().manual_seed(seed + PERTURB_SEED_OFFSET)
    _perturb_constants(model, generator)
    _fill_hash_routes(model, generator)
    return model.eval()


def release_copy(model, auto_class: str):
    """The BF16 release of a float32 ``model``: transformers' ``from_pretrained(dtype=bfloat16)`` of it, which
    keeps the model's ``_keep_in_fp32_modules_strict`` in float32."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="quantkit-tiny-") as tmp:
        model.save_pretrained(tmp)
        return getattr(transformers, auto_class).from_pretrained(tmp, dtype=torch.bfloat16).eval()


@functools.lru_cache(maxsize=16)
def _cached_model(arch: str, seed: int, dtype: str):
    spec = get_arch(arch)
    master = seeded_model(spec.model_class, tiny_config(arch), seed)
    return master if dtype == "f32" else release_copy(master, spec.auto_class)


def build_tiny_model(arch: str, seed: int = 0, dtype: str = "bf16"):
    """``(model, tokenizer)`` of ``arch``: seeded, constants perturbed, in eval mode (see the module doc).

    The model is shared between calls with the same arguments: treat it as read-only.
    """
    get_arch(arch)
    if dtype not in DTYPES:
        raise UnsupportedError(f"tiny model dtype {dtype!r} is not one of {DTYPES}")
    return _cached_model(arch, seed, dtype), build_tiny_tokenizer(arch)


def describe(arch: str) -> dict[str, Any]:
    """The config values chosen for ``arch`` and which layer covers which layer type (for docs and reports)."""
    spec = get_arch(arch)
    config = tiny_config(arch)
    text = config.text_config if spec.nested else config
    return {"model_class": spec.model_class, "layers": list(spec.layer_notes),
            "config": {k: v for k, v in sorted(text.to_diff_dict().items()) if k != "transformers_version"},
            "converter_keys": spec.converter_keys(config)}


def save_tiny_checkpoint(arch: str, out_dir: str | Path, layout: str = "per-expert", encoding: str = "bf16",
                         shards: int = 1, seed: int = 0) -> Path:
    """Write ``arch``'s tiny checkpoint to ``out_dir`` (see :func:`.tiny_checkpoints.write_checkpoint`)."""
    from .tiny_checkpoints import write_checkpoint

    return write_checkpoint(arch, Path(out_dir), layout=layout, encoding=encoding, shards=shards, seed=seed)


class TinyCheckpointCache:
    """Builds each requested tiny checkpoint once under ``root`` (a pytest session's tmp dir) and reuses it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def get(self, arch: str, layout: str = "per-expert", encoding: str = "bf16", shards: int = 1,
            seed: int = 0) -> Path:
        out = self.root / f"{arch}-{layout}-{encoding}-s{shards}-seed{seed}"
        if not (out / "config.json").is_file():
            save_tiny_checkpoint(arch, out, layout=layout, encoding=encoding, shards=shards, seed=seed)
        return out
