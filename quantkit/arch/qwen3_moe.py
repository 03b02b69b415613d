"""Qwen3-MoE (``qwen3_moe``) -> llama.cpp ``qwen3moe``.

Layout: ``model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
mlp.gate, mlp.experts.E.{gate,up,down}_proj}``, or transformers' fused ``mlp.experts.{gate_up_proj,down_proj}``.
Every layer is MoE: llama.cpp's ``qwen3moe`` has no dense feed-forward tensors, so ``mlp_only_layers`` must be
empty and ``decoder_sparse_step`` 1.

Metadata: the converter's ``Qwen2MoeModel`` (base text keys, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length`` when the config has a shared expert).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import SourceError
from .base import (Arch, Hparams, MetadataBuilder, MetadataInputs, expert_rules, rope_parameters, rule,
                   text_hparams, text_model_metadata)

# transformers' Qwen3MoeConfig field defaults (those the conversion reads)
DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "attention_bias": False,
}
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_EXPERTS = 128

L = "model.layers.{L}"
RULES = (
    rule("model.embed_tokens.weight", "token_embd.weight", "token_embd"),
    rule("model.norm.weight", "output_norm.weight", "norm"),
    rule("lm_head.weight", "output.weight", "output"),
    rule(f"{L}.input_layernorm.weight", "blk.{layer}.attn_norm.weight", "norm"),
    rule(f"{L}.post_attention_layernorm.weight", "blk.{layer}.ffn_norm.weight", "norm"),
    rule(f"{L}.self_attn.q_proj.weight", "blk.{layer}.attn_q.weight", "attn_q"),
    rule(f"{L}.self_attn.k_proj.weight", "blk.{layer}.attn_k.weight", "attn_kv"),
    rule(f"{L}.self_attn.v_proj.weight", "blk.{layer}.attn_v.weight", "attn_kv"),
    rule(f"{L}.self_attn.o_proj.weight", "blk.{layer}.attn_output.weight", "attn_output"),
    rule(f"{L}.self_attn.q_proj.bias", "blk.{layer}.attn_q.bias", "bias"),
    rule(f"{L}.self_attn.k_proj.bias", "blk.{layer}.attn_k.bias", "bias"),
    rule(f"{L}.self_attn.v_proj.bias", "blk.{layer}.attn_v.bias", "bias"),
    rule(f"{L}.self_attn.q_norm.weight", "blk.{layer}.attn_q_norm.weight", "norm"),
    rule(f"{L}.self_attn.k_norm.weight", "blk.{layer}.attn_k_norm.weight", "norm"),
    rule(f"{L}.mlp.gate.weight", "blk.{layer}.ffn_gate_inp.weight", "router"),
    *expert_rules(f"{L}.mlp.experts"),
)


def normalize(config: Mapping[str, Any]) -> Hparams:
    hp = text_hparams(config, DEFAULTS)
    if "num_local_experts" not in hp and "num_experts" not in hp:
        hp["num_local_experts"] = DEFAULT_EXPERTS
    rp = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    rp.setdefault("rope_theta", hp.get("rope_theta", DEFAULT_ROPE_THETA))
    rp.setdefault("rope_type", rp.get("type", "default"))
    hp["rope_parameters"] = rp
    return hp


def expert_count(hp: Hparams) -> int:
    return hp["num_local_experts"] if "num_local_experts" in hp else hp["num_experts"]


def check(hp: Hparams) -> None:
    if hp.get("mlp_only_layers"):
        raise SourceError(f"llama.cpp's qwen3moe has no dense layers, found dense layers {hp['mlp_only_layers']}",
                          field="mlp_only_layers")
    if hp.get("decoder_sparse_step", 1) != 1:
        raise SourceError(f"llama.cpp's qwen3moe needs every layer to be MoE, found {hp['decoder_sparse_step']}",
                          field="decoder_sparse_step")


def metadata(meta: MetadataBuilder, hp: Hparams, inputs: MetadataInputs) -> None:
    text_model_metadata(meta, hp, hp["num_hidden_layers"], rope_parameters(hp))
    if (n_ff := hp.get("moe_intermediate_size")) is not None:
        meta.u32_or_array("{arch}.expert_feed_forward_length", n_ff)
    if (shared := hp.get("shared_expert_intermediate_size")) is not None:
        meta.u32("{arch}.expert_shared_feed_forward_length", shared)


ARCH = Arch(
    model_type="qwen3_moe", gguf_arch="qwen3moe", rules=RULES, normalize=normalize, check=check, metadata=metadata,
    block_count=lambda hp: hp["num_hidden_layers"], expert_count=expert_count,
)
