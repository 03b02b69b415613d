"""Qwen3.8-Flash-Next / Qwen4-Exp (``qwen4_exp``) -> llama.cpp ``qwen4exp``.

Layout (text tower of ``Qwen4ExpForConditionalGeneration``; ``model.language_model.`` is read as ``model.``):
hyper-connections in place of every norm (``{attn,mlp}_hyper_connection.{hc_norm, input_mix_weight_{down,up},
block_inject_weight}``, and ``hyper_connection_mixer`` before the head), gated-delta-net layers
(``linear_attn.{in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias, conv1d, norm, out_proj}``) and
gated attention layers with a QSA indexer (``self_attn.{q,k,v,o}_proj``, ``{q,k}_norm``,
``indexer.{index_qk_proj, q_layernorm, k_layernorm}``), MoE with a gated shared expert, and on the
``ple_layer_ids`` layer a PLE n-gram embedding whose table is stored in ``split_ngram_parts`` row shards
(``ple.ple_embedding.ngram_embedding.shard_S.weight``, concatenated in shard order into ``per_layer_token_embd``)
and whose int64 hash constants become metadata.  The MTP block is not converted: llama.cpp's qwen4exp (gguf-py
``MODEL_TENSORS``, ``src/models/qwen4exp.cpp``) has no NextN tensors and ds4's Qwen3.8 builder
(``gguf-tools/qwen38_quantize.py``) leaves ``mtp.*`` out, so there is no engine layout to write it in.

Transforms (the converter's Qwen3.5 chain): V heads of the gated delta net reordered from grouped-by-K to tiled order
(``gdn_*`` steps), ``A = -exp(A_log)``, convolutions squeezed to [C, K], zero-centred norm weights + 1 (every
``*norm.weight`` except ``linear_attn.norm``, plus the PLE and indexer norms), ``index_qk_proj`` split into q and k.

Metadata: the converter's ``Qwen4ExpTextModel`` chain, with two intended differences.
* ``attention.compress_ratios``: the converter marks ``full_attention`` layers, a name transformers rewrites to
  ``indexed_attention``, so it writes all zeros and QSA never engages; quantkit marks both names.
* ``rope.dimension_count``: without ``partial_rotary_factor`` the converter assumes 0.25 where transformers' Qwen4-Exp
  rotary embedding uses 1.0; quantkit writes what transformers runs.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from gguf.constants import GGUFValueType

from ..errors import SourceError
from .base import (Arch, Hparams, MetadataBuilder, MetadataInputs, Target, drop, expert_rules, require,
                   rope_parameters, rule, split, text_hparams, text_model_metadata)

# transformers' Qwen4ExpTextConfig field defaults (those the conversion reads)
DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512, "hc_count": 4,
    "hc_lowrank": 320, "ple_layer_ids": [], "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
    "split_ngram_parts": 512, "indexer_n_heads": None, "indexer_kv_heads": None, "indexer_head_dim": None,
    "indexer_budget": None, "indexer_compress_ratio": None, "norm_topk_prob": True, "output_gate_type": None,
    "eos_token_id": None, "hidden_act": "silu",
}
# transformers' Qwen4ExpConfig (the vision-language wrapper) defaults the conversion reads
ROOT_DEFAULTS: Mapping[str, Any] = {"image_token_id": 248056}
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_FULL_ATTENTION_PERIOD = 4
# the converter's default full_attention_interval, and transformers' rotary defaults for Qwen4-Exp
FULL_ATTENTION_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY_FACTOR = 1.0
DEFAULT_MROPE_SECTION = (11, 11, 10, 0)
PLE_CONSTANTS = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_offsets",
                 "ple_embedding.ngram_heads_vocab_sizes")

L = "model.layers.{L}"
LA = f"{L}.linear_attn"
SA = f"{L}.self_attn"
PLE = f"{L}.ple"


def _hyper(part: str, source: str) -> tuple:
    return (
        rule(f"{L}.{source}.hc_norm.weight", f"blk.{{layer}}.hc_{part}_norm.weight", "hc", "plus_one"),
        rule(f"{L}.{source}.input_mix_weight_down.weight", f"blk.{{layer}}.hc_{part}_down.weight", "hc"),
        rule(f"{L}.{source}.input_mix_weight_up.weight", f"blk.{{layer}}.hc_{part}_up.weight", "hc"),
        rule(f"{L}.{source}.block_inject_weight.weight", f"blk.{{layer}}.hc_{part}_inject.weight", "hc"),
    )


RULES = (
    drop("model.visual.{*}", "vision", "vision tower: converted into the separate mmproj file"),
    *(drop(p, "mtp", "MTP draft block: no engine publishes a GGUF layout for it (llama.cpp's qwen4exp has no "
                     "NextN tensors; ds4's qwen38_quantize.py leaves mtp.* out)") for p in ("mtp.{*}", "model.mtp.{*}")),
    rule("model.embed_tokens.weight", "token_embd.weight", "token_embd"),
    rule("lm_head.weight", "output.weight", "output"),
    rule("model.hyper_connection_mixer.hc_norm.weight", "output_hc_norm.weight", "hc", "plus_one"),
    rule("model.hyper_connection_mixer.input_mix_weight_down.weight", "output_hc_down.weight", "hc"),
    rule("model.hyper_connection_mixer.input_mix_weight_up.weight", "output_hc_up.weight", "hc"),
    *_hyper("attn", "attn_hyper_connection"),
    *_hyper("ffn", "mlp_hyper_connection"),
    # gated delta net
    rule(f"{LA}.in_proj_qkv.weight", "blk.{layer}.attn_qkv.weight", "gdn_qkv", "gdn_qkv_v_order"),
    rule(f"{LA}.in_proj_z.weight", "blk.{layer}.attn_gate.weight", "gdn_gate", "gdn_rows_v_order"),
    rule(f"{LA}.in_proj_a.weight", "blk.{layer}.ssm_alpha.weight", "gdn_ab", "gdn_heads_order"),
    rule(f"{LA}.in_proj_b.weight", "blk.{layer}.ssm_beta.weight", "gdn_ab", "gdn_heads_order"),
    rule(f"{LA}.A_log", "blk.{layer}.ssm_a", "ssm_param", "gdn_heads_order", "neg_exp"),
    rule(f"{LA}.dt_bias", "blk.{layer}.ssm_dt.bias", "ssm_param", "gdn_heads_order"),
    rule(f"{LA}.conv1d.weight", "blk.{layer}.ssm_conv1d.weight", "conv", "squeeze", "gdn_conv_v_order"),
    rule(f"{LA}.norm.weight", "blk.{layer}.ssm_norm.weight", "norm"),
    rule(f"{LA}.out_proj.weight", "blk.{layer}.ssm_out.weight", "gdn_output", "gdn_cols_v_order"),
    # gated attention with the QSA indexer
    rule(f"{SA}.q_proj.weight", "blk.{layer}.attn_q.weight", "attn_q"),
    rule(f"{SA}.k_proj.weight", "blk.{layer}.attn_k.weight", "attn_kv"),
    rule(f"{SA}.v_proj.weight", "blk.{layer}.attn_v.weight", "attn_kv"),
    rule(f"{SA}.o_proj.weight", "blk.{layer}.attn_output.weight", "attn_output"),
    rule(f"{SA}.q_norm.weight", "blk.{layer}.attn_q_norm.weight", "norm", "plus_one"),
    rule(f"{SA}.k_norm.weight", "blk.{layer}.attn_k_norm.weight", "norm", "plus_one"),
    split(f"{SA}.indexer.index_qk_proj.weight",
          Target("blk.{layer}.indexer.q_proj.weight", "indexer", ("indexer_q",)),
          Target("blk.{layer}.indexer.k_proj.weight", "indexer", ("indexer_k",))),
    rule(f"{SA}.indexer.q_layernorm.weight", "blk.{layer}.indexer.q_norm.weight", "norm", "plus_one"),
    rule(f"{SA}.indexer.k_layernorm.weight", "blk.{layer}.indexer.k_norm.weight", "norm", "plus_one"),
    # MoE
    rule(f"{L}.mlp.gate.weight", "blk.{layer}.ffn_gate_inp.weight", "router"),
    rule(f"{L}.mlp.shared_expert_gate.weight", "blk.{layer}.ffn_gate_inp_shexp.weight", "router"),
    rule(f"{L}.mlp.shared_expert.gate_proj.weight", "blk.{layer}.ffn_gate_shexp.weight", "shared_expert"),
    rule(f"{L}.mlp.shared_expert.up_proj.weight", "blk.{layer}.ffn_up_shexp.weight", "shared_expert"),
    rule(f"{L}.mlp.shared_expert.down_proj.weight", "blk.{layer}.ffn_down_shexp.weight", "shared_expert"),
    *expert_rules(f"{L}.mlp.experts"),
    # PLE n-gram embedding
    rule(f"{PLE}.key_proj.weight", "blk.{layer}.ple_key.weight", "ple"),
    rule(f"{PLE}.value_proj.weight", "blk.{layer}.ple_value.weight", "ple"),
    rule(f"{PLE}.norm_key.weight", "blk.{layer}.ple_norm_key.weight", "norm", "plus_one"),
    rule(f"{PLE}.norm_query.weight", "blk.{layer}.ple_norm_query.weight", "norm", "plus_one"),
    rule(f"{PLE}.norm_conv.weight", "blk.{layer}.ple_norm_conv.weight", "norm", "plus_one"),
    rule(f"{PLE}.conv1d.weight", "blk.{layer}.ple_conv1d.weight", "conv", "squeeze"),
    rule(f"{PLE}.ple_embedding.ngram_embedding.shard_{{S}}.weight", "per_layer_token_embd.weight", "ngram_table"),
    rule(f"{PLE}.ple_embedding.ngram_embedding.weight", "per_layer_token_embd.weight", "ngram_table"),
    *(drop(f"{PLE}.{name}", "metadata", "int64 hash constant, written as GGUF metadata") for name in PLE_CONSTANTS),
)


def normalize(config: Mapping[str, Any]) -> Hparams:
    hp = text_hparams(config, DEFAULTS, ROOT_DEFAULTS)
    n = hp["num_hidden_layers"]
    if hp.get("layer_types") is None:
        period = hp.get("full_attention_interval", DEFAULT_FULL_ATTENTION_PERIOD)
        hp["layer_types"] = ["linear_attention" if (i + 1) % period else "indexed_attention" for i in range(n)]
    hp["ple_layer_ids"] = sorted(set(hp.get("ple_layer_ids") or []))
    if hp.get("ple_embed_dim") is None:
        hp["ple_embed_dim"] = hp["hidden_size"]
    rp = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    rp.setdefault("rope_theta", hp.get("rope_theta", DEFAULT_ROPE_THETA))
    rp.setdefault("rope_type", rp.get("type", "default"))
    hp["rope_parameters"] = rp
    return hp


def _ple_heads(hp: Hparams) -> int:
    return (hp["ngram_size"] - 1) * hp["heads_per_ngram"]


def check(hp: Hparams) -> None:
    n = require(hp, "num_hidden_layers")
    if len(hp["layer_types"]) != n:
        raise SourceError(f"has {len(hp['layer_types'])} entries for {n} layers", field="layer_types")
    bad = sorted(set(hp["layer_types"]) - {"linear_attention", "indexed_attention", "full_attention"})
    if bad:
        raise SourceError(f"unknown layer types {bad}", field="layer_types")
    gate = hp.get("output_gate_type") or hp.get("hidden_act")
    if gate != "sigmoid":
        raise SourceError(f"llama.cpp's qwen4exp hard-codes a sigmoid output gate, the config gives {gate!r}",
                          field="output_gate_type")
    if any(hp.get(k) is None for k in ("indexer_n_heads", "indexer_head_dim", "indexer_budget",
                                       "indexer_compress_ratio")):
        raise SourceError("llama.cpp's qwen4exp needs the QSA indexer (indexer_n_heads, indexer_head_dim, "
                          "indexer_budget, indexer_compress_ratio)", field="indexer_n_heads")
    if hp["linear_num_value_heads"] % hp["linear_num_key_heads"]:
        raise SourceError(f"must be a multiple of linear_num_key_heads ({hp['linear_num_key_heads']})",
                          field="linear_num_value_heads")
    ple = hp["ple_layer_ids"]
    if len(ple) > 1:
        raise SourceError(f"llama.cpp's qwen4exp holds one PLE table, the config has PLE on layers {ple}",
                          field="ple_layer_ids")
    if ple:
        if hp["ple_embed_dim"] != hp["hidden_size"]:
            raise SourceError(f"llama.cpp's qwen4exp needs ple_embed_dim == hidden_size ({hp['hidden_size']}), "
                              f"found {hp['ple_embed_dim']}", field="ple_embed_dim")
        if _ple_heads(hp) <= 0 or hp["ple_embed_dim"] % _ple_heads(hp):
            raise SourceError(f"must be a multiple of (ngram_size-1)*heads_per_ngram = {_ple_heads(hp)}",
                              field="ple_embed_dim")
        if not 1 <= ple[0] <= n or hp["layer_types"][ple[0] - 1] != "linear_attention":
            raise SourceError(f"PLE layer {ple[0]} (one-based) must be a linear-attention layer", field="ple_layer_ids")
        _eos(hp)


def _eos(hp: Hparams) -> int:
    eos = hp.get("eos_token_id")
    if isinstance(eos, list) and eos:
        eos = eos[-1]  # the PLE hash resets its n-grams on the primary EOS, the last listed
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise SourceError("the PLE hash resets its n-grams on EOS; the config must give eos_token_id",
                          field="eos_token_id")
    return eos


def _constant(inputs: MetadataInputs, suffix: str) -> list[int]:
    if inputs.tensor_values is None or inputs.tensor_shapes is None:
        raise SourceError(f"qwen4exp metadata needs the checkpoint's {suffix!r} tensor (pass tensor_values and "
                          f"tensor_shapes)")
    name = next((n for n in inputs.tensor_shapes if n.endswith(suffix)), None)
    if name is None:
        raise SourceError(f"PLE constant {suffix!r} is missing from the checkpoint")
    values = np.asarray(inputs.tensor_values(name))
    if values.dtype.kind not in "iu" or values.ndim != 1:
        raise SourceError(f"expected a 1-D integer tensor, found {values.dtype}{list(values.shape)}", tensor=name)
    if values.size and int(values.min()) < 0:
        raise SourceError("hash constants must be non-negative (stored as UINT64)", tensor=name)
    return [int(v) for v in values]


def metadata(meta: MetadataBuilder, hp: Hparams, inputs: MetadataInputs) -> None:
    n = hp["num_hidden_layers"]
    rp = rope_parameters(hp)
    text_model_metadata(meta, hp, n, rp)
    meta.u32_or_array("{arch}.expert_feed_forward_length", hp["moe_intermediate_size"])
    meta.u32("{arch}.expert_shared_feed_forward_length", hp["shared_expert_intermediate_size"])
    meta.u32("{arch}.ssm.conv_kernel", hp["linear_conv_kernel_dim"])
    meta.u32("{arch}.ssm.state_size", hp["linear_key_head_dim"])
    meta.u32("{arch}.ssm.group_count", hp["linear_num_key_heads"])
    meta.u32("{arch}.ssm.time_step_rank", hp["linear_num_value_heads"])
    meta.u32("{arch}.ssm.inner_size", hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    meta.array("{arch}.attention.recurrent_layers", [t == "linear_attention" for t in hp["layer_types"]],
               GGUFValueType.BOOL)
    meta.u32("{arch}.full_attention_interval", hp.get("full_attention_interval", FULL_ATTENTION_INTERVAL))
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    meta.u32("{arch}.rope.dimension_count", int(head_dim * rp.get("partial_rotary_factor",
                                                                   DEFAULT_PARTIAL_ROTARY_FACTOR)))
    if "mrope_section" not in rp:
        meta.array("{arch}.rope.dimension_sections", list(DEFAULT_MROPE_SECTION), GGUFValueType.INT32)
    meta.u32("{arch}.hyper_connection.count", hp["hc_count"])
    meta.u32("{arch}.hyper_connection.low_rank", hp["hc_lowrank"])
    meta.u32("{arch}.attention.indexer.head_count", hp["indexer_n_heads"])
    meta.u32("{arch}.attention.indexer.key_length", hp["indexer_head_dim"])
    meta.u32("{arch}.attention.indexer.top_k", hp["indexer_budget"])
    ratio = hp["indexer_compress_ratio"]
    meta.array("{arch}.attention.compress_ratios",
               [ratio if t in ("full_attention", "indexed_attention") else 0 for t in hp["layer_types"]],
               GGUFValueType.INT32)
    if not hp["ple_layer_ids"]:
        return
    meta.array("{arch}.ple.layers", [i - 1 for i in hp["ple_layer_ids"]], GGUFValueType.INT32)
    meta.u32("{arch}.ple.ngram_size", hp["ngram_size"])
    meta.u32("{arch}.ple.heads_per_ngram", hp["heads_per_ngram"])
    meta.u32("{arch}.ple.conv_kernel", hp["ple_conv_kernel_size"])
    meta.u32("{arch}.ple.eos_token_id", _eos(hp))
    if hp.get("image_token_id") is not None:
        meta.u32("{arch}.ple.image_token_id", hp["image_token_id"])
    row_dim = hp["ple_embed_dim"] // _ple_heads(hp)
    for name, shape in (inputs.tensor_shapes or {}).items():
        if ".ngram_embedding." in name and shape[-1] != row_dim:
            raise SourceError(f"PLE table rows are {shape[-1]} wide, the config implies ple_embed_dim / "
                              f"((ngram_size-1)*heads_per_ngram) = {row_dim}", tensor=name)
    meta.u32("{arch}.embedding_length_per_layer_input", row_dim)
    for key, suffix in zip(("layer_multipliers", "head_offsets", "head_vocab_sizes"), PLE_CONSTANTS):
        meta.array("{arch}.ple." + key, _constant(inputs, suffix), GGUFValueType.UINT64)


ARCH = Arch(
    model_type="qwen4_exp", gguf_arch="qwen4exp", rules=RULES, normalize=normalize, check=check, metadata=metadata,
    block_count=lambda hp: hp["num_hidden_layers"], expert_count=lambda hp: hp["num_experts"],
    aliases=((r"^model\.language_model\.", "model."),), shard_count_key="split_ngram_parts",
)
