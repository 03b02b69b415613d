"""DeepSeek-V3 (``deepseek_v3``) -> llama.cpp ``deepseek2``.

Layout: ``model.layers.N.{input_layernorm, self_attn.{q_a_proj, q_a_layernorm, q_b_proj (or q_proj),
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, post_attention_layernorm, mlp...}``; the first
``first_k_dense_replace`` layers have a dense ``mlp.{gate,up,down}_proj``, the others ``mlp.gate`` (+
``e_score_correction_bias``), ``mlp.shared_experts`` and routed ``mlp.experts``.  The official release stores FP8
weights with ``weight_scale_inv`` block scales (companions) and appends its MTP block as layer
``num_hidden_layers``, which the converter (and this map) leaves out: llama.cpp's ``deepseek2`` does not load it.

``kv_b_proj`` [heads*(nope+v), kv_lora_rank] is split for the absorbed MLA kernels into ``attn_k_b``
[heads, kv_lora_rank, nope] (transposed) and ``attn_v_b`` [heads, v, kv_lora_rank].

Metadata: the converter's ``DeepseekV2Model``, which writes MLA as MQA (``head_count_kv`` 1, key length
kv_lora_rank + rope dim).  One intended difference: transformers' DeepSeek-V3 always routes with sigmoid scores and
does not save ``scoring_func``; without it the converter writes no gating function and llama.cpp falls back to
softmax, so quantkit writes ``expert_gating_func`` = sigmoid when the config does not say otherwise.
"""
from __future__ import annotations

from typing import Any, Mapping

from .base import (Arch, Hparams, MetadataBuilder, MetadataInputs, drop, expert_rules, mla_rules, mtp_layer,
                   rope_parameters, rule, text_hparams, text_model_metadata, tied)

# transformers' DeepseekV3Config field defaults (those the conversion reads)
DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
DEFAULT_ROPE_THETA = 10000.0

L = "model.layers.{L}"
RULES = (
    drop(f"{L}.{{*}}", "mtp", "MTP block: llama.cpp's deepseek2 does not load it (the converter skips it)",
         when="mtp_layer"),
    rule("model.embed_tokens.weight", "token_embd.weight", "token_embd"),
    rule("model.norm.weight", "output_norm.weight", "norm"),
    drop("lm_head.weight", "output", "tied to token_embd (tie_word_embeddings)", when="tied"),
    rule("lm_head.weight", "output.weight", "output"),
    rule(f"{L}.input_layernorm.weight", "blk.{layer}.attn_norm.weight", "norm"),
    rule(f"{L}.post_attention_layernorm.weight", "blk.{layer}.ffn_norm.weight", "norm"),
    rule(f"{L}.self_attn.q_proj.weight", "blk.{layer}.attn_q.weight", "attn_q"),
    *mla_rules(f"{L}.self_attn"),
    rule(f"{L}.mlp.gate_proj.weight", "blk.{layer}.ffn_gate.weight", "dense_ffn"),
    rule(f"{L}.mlp.up_proj.weight", "blk.{layer}.ffn_up.weight", "dense_ffn"),
    rule(f"{L}.mlp.down_proj.weight", "blk.{layer}.ffn_down.weight", "dense_ffn"),
    rule(f"{L}.mlp.gate.weight", "blk.{layer}.ffn_gate_inp.weight", "router"),
    rule(f"{L}.mlp.gate.e_score_correction_bias", "blk.{layer}.exp_probs_b.bias", "bias"),
    rule(f"{L}.mlp.shared_experts.gate_proj.weight", "blk.{layer}.ffn_gate_shexp.weight", "shared_expert"),
    rule(f"{L}.mlp.shared_experts.up_proj.weight", "blk.{layer}.ffn_up_shexp.weight", "shared_expert"),
    rule(f"{L}.mlp.shared_experts.down_proj.weight", "blk.{layer}.ffn_down_shexp.weight", "shared_expert"),
    *expert_rules(f"{L}.mlp.experts"),
)


def normalize(config: Mapping[str, Any]) -> Hparams:
    hp = text_hparams(config, DEFAULTS)
    rp = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    rp.setdefault("rope_theta", hp.get("rope_theta", DEFAULT_ROPE_THETA))
    rp.setdefault("rope_type", rp.get("type", "default"))
    hp["rope_parameters"] = rp
    hp.setdefault("head_dim", hp["qk_rope_head_dim"])  # transformers sets head_dim = qk_rope_head_dim
    hp.setdefault("scoring_func", "sigmoid")          # what transformers' DeepSeek-V3 router always does
    return hp


def check(hp: Hparams) -> None:
    return None


def metadata(meta: MetadataBuilder, hp: Hparams, inputs: MetadataInputs) -> None:
    view = {**hp, "num_key_value_heads": 1, "rms_norm_eps": hp.get("rms_norm_eps", 1e-6)}  # MLA written as MQA
    rp = rope_parameters(view)
    text_model_metadata(meta, view, hp["num_hidden_layers"], rp)
    dense = hp.get("first_k_dense_replace")
    if dense is None:
        dense = hp["num_hidden_layers"] if hp.get("n_routed_experts") is None else 0
    meta.u32("{arch}.leading_dense_block_count", dense)
    kv_lora = hp.get("kv_lora_rank", 512)
    rope, nope = hp["qk_rope_head_dim"], hp["qk_nope_head_dim"]
    meta.u32("{arch}.vocab_size", hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        meta.u32("{arch}.attention.q_lora_rank", hp["q_lora_rank"])
    meta.u32("{arch}.attention.kv_lora_rank", kv_lora)
    meta.u32("{arch}.attention.key_length", kv_lora + rope)
    meta.u32("{arch}.attention.value_length", kv_lora)
    meta.u32("{arch}.attention.key_length_mla", nope + rope)
    meta.u32("{arch}.attention.value_length_mla", hp["v_head_dim"])
    meta.u32_or_array("{arch}.expert_feed_forward_length",
                      hp["moe_intermediate_size"] if "moe_intermediate_size" in hp else hp["intermediate_size"])
    if hp.get("n_routed_experts") is not None:
        meta.u32("{arch}.expert_count", hp["n_routed_experts"])
    meta.u32("{arch}.expert_shared_count", hp.get("n_shared_experts", 0))
    if hp.get("routed_scaling_factor") is not None:
        meta.f32("{arch}.expert_weights_scale", hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        meta.boolean("{arch}.expert_weights_norm", hp["norm_topk_prob"])
    meta.u32("{arch}.rope.dimension_count", rope)
    if (mscale_all_dim := rp.get("mscale_all_dim")) is not None:
        # the converter's legacy definition for deepseek2 (0.1 * mscale_all_dim)
        meta.f32("{arch}.rope.scaling.yarn_log_multiplier", 0.1 * mscale_all_dim)


ARCH = Arch(
    model_type="deepseek_v3", gguf_arch="deepseek2", rules=RULES, normalize=normalize, check=check,
    metadata=metadata, block_count=lambda hp: hp["num_hidden_layers"], expert_count=lambda hp: hp["n_routed_experts"],
    conditions={"mtp_layer": mtp_layer, "tied": tied},
)
