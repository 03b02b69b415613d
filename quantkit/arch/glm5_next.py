"""GLM-5-Next / GLM-5.3-Flash (``glm5_next``) -> llama.cpp ``glm5-next``.

Layout (text tower of ``Glm5NextForConditionalGeneration``; ``model.language_model.`` is read as ``model.``):
``model.layers.N`` with mHC streams (``hc_{attn,ffn}_{fn,base,scale}``), and per ``layer_types`` either a KDA
linear-attention block (``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d``, ``f_a/f_b/g_a/g_b/b_proj``, ``A_log``,
``dt_bias``, ``o_norm``, ``o_proj``) or a NoPE MLA block with a DSA indexer (``q_a/q_b``, ``kv_a_proj_with_mqa``,
``kv_b_proj``, ``indexer.{wq_b, wk, k_norm, weights_proj, index_kpool_compress_{ape,gate}}``); feed-forward is dense
for the leading ``mlp_layer_types == "dense"`` layers and MoE after.  Blocks past ``num_hidden_layers`` are
NextN/MTP blocks (``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.{norm,head}``) which the converter keeps.
transformers' internal layout (``attn_hc.fn``, ``forget_gate.*``, one fused ``conv1d``, fused experts) is read too.

Transforms: ``A_log`` -> ``-exp`` of the first ``num_attention_heads`` values; short convolutions -> [1, C, 1, K];
``kv_b_proj`` split as for DeepSeek.

Metadata: the converter's ``Glm5NextModel``.  transformers does not save ``linear_attn_config``, ``mla_use_nope``
or ``first_k_dense_replace``; they are derived from ``linear_*``, ``qk_rope_head_dim == 0`` and the leading dense
run of ``mlp_layer_types``.  llama.cpp needs ``linear_attn_config.num_heads == num_attention_heads``, NoPE MLA and the
dense layers first.
"""
from __future__ import annotations

from typing import Any, Mapping

from gguf.constants import GGUFValueType

from ..errors import SourceError
from .base import (Arch, Hparams, MetadataBuilder, MetadataInputs, Target, drop, expert_rules, mla_rules, mtp_layer, require,
                   rope_parameters, rule, split, text_hparams, text_model_metadata, tied)

# transformers' Glm5NextTextConfig field defaults (those the conversion reads)
DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "swiglu_limit": 10.0, "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "index_kpool": 16,
    "index_kpool_always_select_tail": True,
}
# the converter writes this layer-norm epsilon for glm5-next regardless of the config
LAYER_NORM_EPS = 1e-6
# transformers' defaults for the layer schedules
DEFAULT_DENSE_LAYERS = 3
DEFAULT_FULL_ATTENTION_PERIOD = 4

L = "model.layers.{L}"
A = f"{L}.self_attn"


def _hc(part: str, prefix: str) -> tuple:
    return tuple(rule(f"{L}.{name}", f"blk.{{layer}}.hc_{part}_{leaf}.weight", "hc")
                 for leaf in ("fn", "base", "scale")
                 for name in (f"hc_{part}_{leaf}", f"{prefix}_hc.{leaf}"))


RULES = (
    drop("model.visual.{*}", "vision", "vision tower: converted into the separate mmproj file"),
    rule("model.embed_tokens.weight", "token_embd.weight", "token_embd"),
    rule("model.norm.weight", "output_norm.weight", "norm"),
    drop("lm_head.weight", "output", "tied to token_embd (tie_word_embeddings)", when="tied"),
    rule("lm_head.weight", "output.weight", "output"),
    # NextN / MTP blocks
    rule(f"{L}.eh_proj.weight", "blk.{layer}.nextn.eh_proj.weight", "mtp", when="mtp_layer"),
    rule(f"{L}.enorm.weight", "blk.{layer}.nextn.enorm.weight", "mtp", when="mtp_layer"),
    rule(f"{L}.hnorm.weight", "blk.{layer}.nextn.hnorm.weight", "mtp", when="mtp_layer"),
    rule(f"{L}.embed_tokens.weight", "blk.{layer}.nextn.embed_tokens.weight", "mtp", when="mtp_layer"),
    rule(f"{L}.shared_head.norm.weight", "blk.{layer}.nextn.shared_head_norm.weight", "mtp", when="mtp_layer"),
    rule(f"{L}.shared_head.head.weight", "blk.{layer}.nextn.shared_head_head.weight", "mtp", when="mtp_layer"),
    rule(f"{L}.input_layernorm.weight", "blk.{layer}.attn_norm.weight", "norm"),
    rule(f"{L}.post_attention_layernorm.weight", "blk.{layer}.ffn_norm.weight", "norm"),
    *_hc("attn", "attn"),
    *_hc("ffn", "ffn"),
    # KDA linear attention
    rule(f"{A}.q_proj.weight", "blk.{layer}.attn_q.weight", "kda_qk"),
    rule(f"{A}.k_proj.weight", "blk.{layer}.attn_k.weight", "kda_qk"),
    rule(f"{A}.v_proj.weight", "blk.{layer}.attn_v.weight", "kda_v"),
    rule(f"{A}.o_proj.weight", "blk.{layer}.attn_output.weight", "kda_output", when="linear_layer"),
    rule(f"{A}.q_conv1d.weight", "blk.{layer}.ssm_conv1d_q.weight", "conv", "conv_4d"),
    rule(f"{A}.k_conv1d.weight", "blk.{layer}.ssm_conv1d_k.weight", "conv", "conv_4d"),
    rule(f"{A}.v_conv1d.weight", "blk.{layer}.ssm_conv1d_v.weight", "conv", "conv_4d"),
    split(f"{A}.conv1d.weight",
          Target("blk.{layer}.ssm_conv1d_q.weight", "conv", ("kda_conv_q", "conv_4d")),
          Target("blk.{layer}.ssm_conv1d_k.weight", "conv", ("kda_conv_k", "conv_4d")),
          Target("blk.{layer}.ssm_conv1d_v.weight", "conv", ("kda_conv_v", "conv_4d"))),
    *(rule(f"{A}.{pre}{name}.weight", f"blk.{{layer}}.ssm_{short}.weight", "kda_gate")
      for pre in ("", "forget_gate.") for name, short in (("f_a_proj", "f_a"), ("f_b_proj", "f_b"))),
    rule(f"{A}.g_a_proj.weight", "blk.{layer}.ssm_g_a.weight", "kda_gate"),
    rule(f"{A}.g_b_proj.weight", "blk.{layer}.ssm_g_b.weight", "kda_gate"),
    rule(f"{A}.b_proj.weight", "blk.{layer}.ssm_beta.weight", "kda_gate"),
    *(rule(f"{A}.{pre}A_log", "blk.{layer}.ssm_a", "ssm_param", "first_heads", "neg_exp")
      for pre in ("", "forget_gate.")),
    *(rule(f"{A}.{pre}dt_bias", "blk.{layer}.ssm_dt.bias", "ssm_param") for pre in ("", "forget_gate.")),
    rule(f"{A}.o_norm.weight", "blk.{layer}.ssm_norm.weight", "norm"),
    # NoPE MLA with the DSA indexer
    *mla_rules(f"{A}"),
    rule(f"{A}.indexer.wq_b.weight", "blk.{layer}.indexer.attn_q_b.weight", "indexer"),
    rule(f"{A}.indexer.wk.weight", "blk.{layer}.indexer.attn_k.weight", "indexer"),
    rule(f"{A}.indexer.k_norm.weight", "blk.{layer}.indexer.k_norm.weight", "norm"),
    rule(f"{A}.indexer.k_norm.bias", "blk.{layer}.indexer.k_norm.bias", "norm"),
    rule(f"{A}.indexer.weights_proj.weight", "blk.{layer}.indexer.proj.weight", "indexer"),
    rule(f"{A}.indexer.index_kpool_compress_ape", "blk.{layer}.indexer_compressor_ape.weight", "ape"),
    rule(f"{A}.indexer.index_kpool_compress_gate", "blk.{layer}.indexer_compressor_gate.weight", "indexer"),
    # feed-forward
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


def linear_layer(hp: Hparams, groups: Mapping[str, int]) -> bool:
    """Condition: the block is a KDA (linear attention) layer."""
    layer, types = groups["layer"], hp["layer_types"]
    return layer < len(types) and types[layer] == "linear_attention"


def normalize(config: Mapping[str, Any]) -> Hparams:
    hp = text_hparams(config, DEFAULTS)
    n = hp["num_hidden_layers"]
    if hp.get("mlp_layer_types") is None:
        hp["mlp_layer_types"] = ["dense"] * min(DEFAULT_DENSE_LAYERS, n) + ["sparse"] * (n - DEFAULT_DENSE_LAYERS)
    if hp.get("layer_types") is None:
        hp["layer_types"] = ["linear_attention" if i % DEFAULT_FULL_ATTENTION_PERIOD != DEFAULT_FULL_ATTENTION_PERIOD - 1
                             else "indexed_attention" for i in range(n)]
    hp["layer_types"] = ["indexed_attention" if t == "full_attention" else t for t in hp["layer_types"]]
    if "linear_attn_config" not in hp:
        hp["linear_attn_config"] = {"head_dim": hp["linear_head_dim"], "num_heads": hp["linear_num_heads"],
                                    "short_conv_kernel_size": hp["linear_conv_kernel_dim"],
                                    "gate_lower_bound": hp["linear_lower_bound"]}
    hp.setdefault("mla_use_nope", hp["qk_rope_head_dim"] == 0)
    if "first_k_dense_replace" not in hp:
        types = hp["mlp_layer_types"]
        hp["first_k_dense_replace"] = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    hp.setdefault("num_nextn_predict_layers", 0)
    return hp


def check(hp: Hparams) -> None:
    n = require(hp, "num_hidden_layers")
    for key in ("layer_types", "mlp_layer_types"):
        if len(hp[key]) != n:
            raise SourceError(f"has {len(hp[key])} entries for {n} layers", field=key)
    lin = hp["linear_attn_config"]
    if lin.get("num_heads") != hp["num_attention_heads"]:
        raise SourceError(f"llama.cpp's glm5-next needs as many linear-attention heads as attention heads "
                          f"({hp['num_attention_heads']}), found {lin.get('num_heads')}", field="linear_num_heads")
    if not hp["mla_use_nope"] or hp["qk_rope_head_dim"] != 0:
        raise SourceError(f"llama.cpp's glm5-next needs NoPE MLA, found qk_rope_head_dim "
                          f"{hp['qk_rope_head_dim']}", field="qk_rope_head_dim")
    dense = hp["first_k_dense_replace"]
    if any(t != "dense" for t in hp["mlp_layer_types"][:dense]) or "dense" in hp["mlp_layer_types"][dense:]:
        raise SourceError("llama.cpp's glm5-next needs the dense layers first (leading_dense_block_count)",
                          field="mlp_layer_types")
    bad = sorted(set(hp["layer_types"]) - {"linear_attention", "indexed_attention"})
    if bad:
        raise SourceError(f"unknown layer types {bad}", field="layer_types")


def block_count(hp: Hparams) -> int:
    return hp["num_hidden_layers"] + hp["num_nextn_predict_layers"]


def metadata(meta: MetadataBuilder, hp: Hparams, inputs: MetadataInputs) -> None:
    blocks = block_count(hp)
    view = {k: v for k, v in hp.items() if k != "head_dim"}  # the converter drops head_dim
    text_model_metadata(meta, view, blocks, rope_parameters(view))
    kv_heads = [0 if t == "linear_attention" else 1 for t in hp["layer_types"]]
    meta.u32_or_array("{arch}.attention.head_count_kv", kv_heads + [1] * (blocks - len(kv_heads)))
    meta.u32("{arch}.vocab_size", hp["vocab_size"])
    meta.f32("{arch}.attention.layer_norm_epsilon", LAYER_NORM_EPS)
    if hp["num_nextn_predict_layers"]:
        meta.u32("{arch}.nextn_predict_layers", hp["num_nextn_predict_layers"])
    lin = hp["linear_attn_config"]
    meta.u32("{arch}.ssm.conv_kernel", lin["short_conv_kernel_size"])
    meta.u32("{arch}.kda.head_dim", lin["head_dim"])
    if lin.get("gate_lower_bound") is not None:
        meta.f32("{arch}.kda.gate_lower_bound", lin["gate_lower_bound"])
    kv_lora, rope = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    meta.u32("{arch}.attention.q_lora_rank", hp["q_lora_rank"])
    meta.u32("{arch}.attention.kv_lora_rank", kv_lora)
    meta.u32("{arch}.rope.dimension_count", rope)
    meta.u32("{arch}.attention.key_length", kv_lora + rope)
    meta.u32("{arch}.attention.value_length", kv_lora)
    meta.u32("{arch}.attention.key_length_mla", hp["qk_nope_head_dim"] + rope)
    meta.u32("{arch}.attention.value_length_mla", hp["v_head_dim"])
    meta.u32("{arch}.attention.indexer.head_count", hp["index_n_heads"])
    meta.u32("{arch}.attention.indexer.key_length", hp["index_head_dim"])
    meta.u32("{arch}.attention.indexer.top_k", hp["index_topk"])
    meta.u32("{arch}.attention.indexer.kpool", hp["index_kpool"])
    meta.boolean("{arch}.attention.indexer.kpool_select_tail", hp.get("index_kpool_always_select_tail", True))
    if hp.get("indexer_types") is not None:
        meta.array("{arch}.attention.indexer.types", [t == "full" for t in hp["indexer_types"]], GGUFValueType.BOOL)
    meta.u32("{arch}.hyper_connection.count", hp["hc_mult"])
    meta.u32("{arch}.hyper_connection.sinkhorn_iterations", hp["hc_sinkhorn_iters"])
    meta.f32("{arch}.hyper_connection.epsilon", hp["hc_eps"])
    meta.u32("{arch}.leading_dense_block_count", hp["first_k_dense_replace"])
    meta.u32_or_array("{arch}.expert_feed_forward_length", hp["moe_intermediate_size"])
    meta.u32("{arch}.expert_shared_count", hp["n_shared_experts"])
    meta.f32("{arch}.expert_weights_scale", hp["routed_scaling_factor"])
    meta.boolean("{arch}.expert_weights_norm", hp["norm_topk_prob"])
    if (limit := hp.get("swiglu_limit")) is not None:
        meta.array("{arch}.swiglu_clamp_exp", [float(limit)] * blocks, GGUFValueType.FLOAT32)
        meta.array("{arch}.swiglu_clamp_shexp", [float(limit)] * blocks, GGUFValueType.FLOAT32)


ARCH = Arch(
    model_type="glm5_next", gguf_arch="glm5-next", rules=RULES, normalize=normalize, check=check, metadata=metadata,
    block_count=block_count, expert_count=lambda hp: hp["n_routed_experts"],
    aliases=((r"^model\.language_model\.", "model."),),
    conditions={"mtp_layer": mtp_layer, "tied": tied, "linear_layer": linear_layer},
    special_token_fallbacks=(("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"),
                             ("eom", "<|observation|>")),
)
