"""DeepSeek-V4 (``deepseek_v4``) -> llama.cpp ``deepseek4``.

Three source layouts are read, all onto the same GGUF names:

* the official release (what users download): ``embed``, ``head``, ``norm``, ``hc_head_{fn,base,scale}``,
  ``layers.N.{attn_norm, ffn_norm, hc_{attn,ffn}_{fn,base,scale}, attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a,
  wo_b, attn_sink, compressor.{wkv,wgate,ape,norm}, indexer.{wq_b, weights_proj, compressor.*}},
  ffn.{gate.{weight,bias,tid2eid}, shared_experts.w{1,2,3}, experts.E.w{1,2,3}}}``, ``mtp.K.*``.  Linear weights
  are FP8 E4M3 with an E8M0 ``.scale`` per 128x128 block and routed experts are FP4 E2M1 packed two per byte with an
  E8M0 ``.scale`` per 32 values; the ``.scale`` tensors resolve as companions of their weights.
* transformers' ``save_pretrained`` default (``save_original_format=True``): the official names under ``model.``,
  except ``model.embed_tokens``, ``model.hc_head.hc_{fn,base,scale}`` and ``attn.norm`` for ``attn.kv_norm``
  (rewritten by ``aliases``).
* transformers' internal names (``save_original_format=False``): ``self_attn.{q_a_proj, kv_proj, o_a_proj, sinks,
  compressor.{kv_proj, position_bias, indexer.*}}``, ``attn_hc.fn``, ``mlp.experts.gate_up_proj`` [E, 2*ff, embd] ...

The MTP block (``mtp.*``) is kept in a converted main file unless the recipe skips class ``mtp``: as llama.cpp's
loader reads it (:data:`MTP_MAIN_RULES`, blocks past the trunk with ``nextn.*``; llama.cpp's own converter leaves
it out of the main file) or under ds4's ``mtp.K.*`` names (:data:`MTP_DS4_RULES`).  The map bound without a dialect
(runtime, imatrix, swapsets) drops it.  ``convert --support mtp`` writes it as llama.cpp's ``--mtp`` export does
(:data:`MTP_SUPPORT_RULES`).  Hash-routed layers
(the first ``num_hash_layers``) route through ``tid2eid`` (written as I32); their unused ``gate.bias`` is dropped.

Metadata: the converter's ``DeepseekV4Model``.  transformers saves neither ``compress_ratios`` nor
``num_hash_layers``; they are derived from ``layer_types`` with ``compress_rates`` and from the leading
``hash_moe`` run of ``mlp_layer_types``.  Intended difference: a transformers-saved config keeps the YaRN
parameters of the compressed layers only in ``rope_parameters["compress"]``, where the converter does not look (it
reads an official config's ``rope_scaling``); quantkit writes the same ``rope.scaling.*`` keys from either (without
the ``attention_factor`` transformers injects there: deepseek4 computes its own).  llama.cpp requires 4
hyper-connection streams, compression ratios in {0, 4, 128} and an indexer head dim that is a multiple of 64.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from gguf.constants import GGUFValueType

from ..errors import SourceError, SupportError, UnsupportedError
from .base import (Arch, Hparams, InputGroups, MetadataBuilder, MetadataInputs, column_part, drop, expert_rules,
                   require, rope_parameters, rule, text_hparams, text_model_metadata)

# transformers' DeepseekV4Config field defaults (those the conversion reads)
DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "rms_norm_eps": 1.0e-6, "tie_word_embeddings": False,
}
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512
RATIO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
# llama.cpp's deepseek4 limits
HC_STREAMS = 4
COMPRESS_RATIOS = frozenset({0, 4, 128})
INDEXER_HEAD_DIM_MULTIPLE = 64   # the indexer's Hadamard rotation works on blocks of 64
# YaRN keys of transformers' rope_parameters["compress"] that an official rope_scaling carries
YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "extrapolation_factor")

L = "layers.{L}"


def _both(official: str, internal: str, gguf: str, cls: str, *steps: str, when: str | None = None) -> tuple:
    return (rule(official, gguf, cls, *steps, when=when), rule(internal, gguf, cls, *steps, when=when))


RULES = (
    drop("mtp.{*}", "mtp", "MTP block: llama.cpp's converter exports it only with --mtp, as a separate file"),
    *(drop(p, "vision", "vision tower and aligner: not part of the text model")
      for p in ("vision.{*}", "aligner.{*}", "image_{*}")),
    rule("embed.weight", "token_embd.weight", "token_embd"),
    rule("norm.weight", "output_norm.weight", "norm"),
    rule("head.weight", "output.weight", "output"),
    rule("lm_head.weight", "output.weight", "output"),
    *(rule(f"hc_head_{leaf}", f"output_hc_{leaf}.weight", "hc") for leaf in ("fn", "base", "scale")),
    *(rule(f"{L}.{name}", f"blk.{{layer}}.hc_{part}_{leaf}.weight", "hc")
      for part in ("attn", "ffn") for leaf in ("fn", "base", "scale")
      for name in (f"hc_{part}_{leaf}", f"{part}_hc.{leaf}")),
    *_both(f"{L}.attn_norm.weight", f"{L}.input_layernorm.weight", "blk.{layer}.attn_norm.weight", "norm"),
    *_both(f"{L}.ffn_norm.weight", f"{L}.post_attention_layernorm.weight", "blk.{layer}.ffn_norm.weight", "norm"),
    # attention
    *_both(f"{L}.attn.attn_sink", f"{L}.self_attn.sinks", "blk.{layer}.attn_sinks.weight", "sinks"),
    *_both(f"{L}.attn.wq_a.weight", f"{L}.self_attn.q_a_proj.weight", "blk.{layer}.attn_q_a.weight", "attn_q"),
    *_both(f"{L}.attn.q_norm.weight", f"{L}.self_attn.q_a_norm.weight", "blk.{layer}.attn_q_a_norm.weight", "norm"),
    *_both(f"{L}.attn.wq_b.weight", f"{L}.self_attn.q_b_proj.weight", "blk.{layer}.attn_q_b.weight", "attn_q"),
    *_both(f"{L}.attn.wkv.weight", f"{L}.self_attn.kv_proj.weight", "blk.{layer}.attn_kv.weight", "attn_kv"),
    *_both(f"{L}.attn.kv_norm.weight", f"{L}.self_attn.kv_norm.weight", "blk.{layer}.attn_kv_a_norm.weight", "norm"),
    *_both(f"{L}.attn.wo_a.weight", f"{L}.self_attn.o_a_proj.weight", "blk.{layer}.attn_output_a.weight",
           "attn_output"),
    *_both(f"{L}.attn.wo_b.weight", f"{L}.self_attn.o_b_proj.weight", "blk.{layer}.attn_output_b.weight",
           "attn_output"),
    # compressor (compressed layers) and the indexer with its own compressor (ratio-4 layers)
    *_both(f"{L}.attn.compressor.ape", f"{L}.self_attn.compressor.position_bias",
           "blk.{layer}.attn_compressor_ape.weight", "ape"),
    *_both(f"{L}.attn.compressor.wkv.weight", f"{L}.self_attn.compressor.kv_proj.weight",
           "blk.{layer}.attn_compressor_kv.weight", "compressor"),
    *_both(f"{L}.attn.compressor.wgate.weight", f"{L}.self_attn.compressor.gate_proj.weight",
           "blk.{layer}.attn_compressor_gate.weight", "compressor"),
    *_both(f"{L}.attn.compressor.norm.weight", f"{L}.self_attn.compressor.kv_norm.weight",
           "blk.{layer}.attn_compressor_norm.weight", "norm"),
    *_both(f"{L}.attn.indexer.wq_b.weight", f"{L}.self_attn.compressor.indexer.q_b_proj.weight",
           "blk.{layer}.indexer.attn_q_b.weight", "indexer"),
    *_both(f"{L}.attn.indexer.weights_proj.weight", f"{L}.self_attn.compressor.indexer.scorer.weights_proj.weight",
           "blk.{layer}.indexer.proj.weight", "indexer"),
    *_both(f"{L}.attn.indexer.compressor.ape", f"{L}.self_attn.compressor.indexer.position_bias",
           "blk.{layer}.indexer_compressor_ape.weight", "ape"),
    *_both(f"{L}.attn.indexer.compressor.wkv.weight", f"{L}.self_attn.compressor.indexer.kv_proj.weight",
           "blk.{layer}.indexer_compressor_kv.weight", "indexer"),
    *_both(f"{L}.attn.indexer.compressor.wgate.weight", f"{L}.self_attn.compressor.indexer.gate_proj.weight",
           "blk.{layer}.indexer_compressor_gate.weight", "indexer"),
    *_both(f"{L}.attn.indexer.compressor.norm.weight", f"{L}.self_attn.compressor.indexer.kv_norm.weight",
           "blk.{layer}.indexer_compressor_norm.weight", "norm"),
    # MoE
    *_both(f"{L}.ffn.gate.weight", f"{L}.mlp.gate.weight", "blk.{layer}.ffn_gate_inp.weight", "router"),
    drop(f"{L}.ffn.gate.bias", "bias", "hash-routed layer: routes by tid2eid, the bias is unused",
         when="hash_layer"),
    *_both(f"{L}.ffn.gate.bias", f"{L}.mlp.gate.e_score_correction_bias", "blk.{layer}.exp_probs_b.bias", "bias"),
    rule(f"{L}.ffn.gate.bias_vl", "blk.{layer}.exp_probs_b_vl.bias", "bias"),
    *_both(f"{L}.ffn.gate.tid2eid", f"{L}.mlp.gate.tid2eid", "blk.{layer}.ffn_gate_tid2eid.weight", "hash_routing",
           "to_int32", when="hash_layer"),
    *(rule(f"{L}.{prefix}.{name}.weight", f"blk.{{layer}}.ffn_{short}_shexp.weight", "shared_expert")
      for short, names in (("gate", ("w1", "gate_proj")), ("up", ("w3", "up_proj")), ("down", ("w2", "down_proj")))
      for prefix, name in zip(("ffn.shared_experts", "mlp.shared_experts"), names)),
    *expert_rules(f"{L}.ffn.experts", gate="w1", up="w3", down="w2"),
    *expert_rules(f"{L}.mlp.experts"),
)

M = "mtp.{M}"
#: The MTP block's decoder layer: the block rules with ``mtp.K`` for ``layers.N`` (block ``num_hidden_layers + K``).
_MTP_BLOCK = tuple(dataclasses.replace(r, pattern=M + r.pattern[len(L):]) for r in RULES
                   if r.pattern.startswith(L + "."))
#: llama.cpp's NextN names (``LLM_TENSOR_NEXTN_*``): ``e_proj`` and ``h_proj`` side by side are ``nextn.eh_proj``
#: (its converter's ``torch.cat((e_proj, h_proj), dim=1)``), ``enorm``/``hnorm``/``norm`` the NextN norms.
_MTP_NEXTN = (
    column_part(f"{M}.e_proj.weight", "blk.{layer}.nextn.eh_proj.weight", "mtp", 0),
    column_part(f"{M}.h_proj.weight", "blk.{layer}.nextn.eh_proj.weight", "mtp", 1),
    rule(f"{M}.enorm.weight", "blk.{layer}.nextn.enorm.weight", "mtp"),
    rule(f"{M}.hnorm.weight", "blk.{layer}.nextn.hnorm.weight", "mtp"),
    rule(f"{M}.norm.weight", "blk.{layer}.nextn.shared_head_norm.weight", "mtp"),
)
#: The ``--support mtp`` file (llama.cpp's ``--mtp`` export): the MTP blocks, whose own ``hc_head_*`` replace the
#: model's as the output hyper-connection.
MTP_SUPPORT_RULES = (
    *(rule(f"{M}.hc_head_{leaf}", f"output_hc_{leaf}.weight", "hc") for leaf in ("fn", "base", "scale")),
    drop("hc_head_{*}", "hc", "the MTP file takes the MTP block's own hc_head as output hyper-connection"),
    *_MTP_NEXTN,
    *_MTP_BLOCK,
)
#: A main file keeping the MTP blocks, as llama.cpp's deepseek4 loader reads one (src/models/deepseek4.cpp: blocks
#: ``n_layer .. n_layer_all`` with the NextN tensors, ``nextn_predict_layers``, per-block arrays of ``block_count``
#: entries).  That loader runs the MTP block with the model's ``output_hc_*`` and has no name for the block's own
#: ``hc_head``, so it is left out here (``convert --support mtp`` and the ds4 dialect carry it).
MTP_MAIN_RULES = (
    drop(f"{M}.hc_head_{{*}}", "mtp", "llama.cpp's deepseek4 loader has no name for the MTP block's own hc_head "
                                      "in a main file (its MTP graph uses output_hc_*); --support mtp carries it"),
    *_MTP_NEXTN,
    *_MTP_BLOCK,
)
#: The same blocks under ds4's names (ds4.c ``mtp_weights_bind``: ``mtp.K.<block tensor>``, ``e_proj`` and
#: ``h_proj`` apart, ``enorm``/``hnorm``/``norm``, the block's own ``hc_head_{base,fn,scale}``); ds4 loads them from
#: the file given to ``--mtp``, so a main file carrying them serves as its own MTP file.  They are not blocks of
#: the file (ds4 requires ``block_count`` = the trunk's).
MTP_DS4_RULES = (
    *(rule(f"{M}.hc_head_{leaf}", f"mtp.{{mtp}}.hc_head_{leaf}.weight", "hc") for leaf in ("fn", "base", "scale")),
    *(rule(f"{M}.{leaf}.weight", f"mtp.{{mtp}}.{leaf}.weight", "mtp")
      for leaf in ("e_proj", "h_proj", "enorm", "hnorm", "norm")),
    *(dataclasses.replace(r, targets=tuple(dataclasses.replace(t, gguf=t.gguf.replace("blk.{layer}.", "mtp.{mtp}."))
                                           for t in r.targets)) for r in _MTP_BLOCK),
)

#: The DSpark drafter of a checkpoint with DSpark settings (``convert --support dspark``), as llama.cpp's
#: ``DeepseekV4DSparkModel`` exports it (conversion/deepseek.py; loader src/models/dflash.cpp): stage K
#: (``mtp.K.*``) is block K of a ``dflash`` GGUF with V4's block names, the stage-0 heads are root tensors
#: (``main_proj`` -> ``fc``, ``main_norm`` -> ``enc.output_norm``, the Markov and confidence heads, ``norm`` and
#: ``hc_head``); the target's own tensors are not part of it.
S = "mtp.{L}"
DSPARK_RULES = (
    rule(f"{S}.main_proj.weight", "fc.weight", "mtp"),
    rule(f"{S}.main_norm.weight", "enc.output_norm.weight", "norm"),
    rule(f"{S}.markov_head.markov_w1.weight", "markov_w1.weight", "mtp"),
    rule(f"{S}.markov_head.markov_w2.weight", "markov_w2.weight", "mtp"),
    rule(f"{S}.confidence_head.proj.weight", "conf_proj.weight", "mtp"),
    rule(f"{S}.norm.weight", "output_norm.weight", "norm"),
    *(rule(f"{S}.hc_head_{leaf}", f"output_hc_{leaf}.weight", "hc") for leaf in ("fn", "base", "scale")),
    drop(f"{S}.ffn.gate.bias_vl", "bias", "image-token routing bias: not part of the dflash drafter"),
    *(dataclasses.replace(r, pattern=S + r.pattern[len(L):]) for r in RULES if r.pattern.startswith(L + ".")),
    *(drop(p, "metadata", "the target model's tensor: the DSpark drafter runs beside the target")
      for p in ("layers.{*}", "embed.weight", "head.weight", "lm_head.weight", "norm.weight", "hc_head_{*}")),
    *(drop(p, "vision", "vision tower and aligner: not part of the drafter")
      for p in ("vision.{*}", "aligner.{*}", "image_{*}")),
)

#: ``wo_a`` multiplies each group of heads' output by its own ``o_lora_rank`` rows (llama.cpp loads it
#: ``[o_group_dim, o_lora_rank, o_groups]``): llama-imatrix stores one sum per group.
INPUT_GROUPS = (
    InputGroups("blk.{L}.attn_output_a.weight", hparam="o_groups", gguf_key="{arch}.attention.output_group_count"),
)

ALIASES = (
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.", ""),
    (r"^(layers\.\d+)\.attn\.norm\.", r"\1.attn.kv_norm."),
)


def hash_layer(hp: Hparams, groups: Mapping[str, int]) -> bool:
    """Condition: the block routes by token id (one of the first ``num_hash_layers``)."""
    return groups["layer"] < hp["num_hash_layers"]


def has_mtp_block(hp: Hparams) -> bool:
    """A checkpoint with DSpark settings holds the DSpark drafter's stages under ``mtp.*`` (llama.cpp's
    ``DeepseekV4DSparkModel`` reads them from there), not an MTP block."""
    return not any(key.startswith("dspark_") for key in hp)


def normalize(config: Mapping[str, Any]) -> Hparams:
    hp = text_hparams(config, DEFAULTS)
    n = hp["num_hidden_layers"]
    rates = dict(DEFAULT_COMPRESS_RATES, **(hp.get("compress_rates") or {}))
    hp["compress_rates"] = rates
    ratios = hp.get("compress_ratios")
    if hp.get("layer_types") is None:
        if ratios is not None:
            if any(r not in RATIO_LAYER_TYPE for r in ratios):
                raise SourceError(f"ratios must be in {sorted(RATIO_LAYER_TYPE)}, found {sorted(set(ratios))}",
                                  field="compress_ratios")
            hp["layer_types"] = [RATIO_LAYER_TYPE[r] for r in ratios][:n]
        else:
            interleave = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                          for i in range(max(n - 2, 0))]
            hp["layer_types"] = ["heavily_compressed_attention"] * min(n, 2) + interleave
    if ratios is None:
        hp["compress_ratios"] = [rates.get(t, 0) for t in hp["layer_types"][:n]]
    if hp.get("mlp_layer_types") is None:
        n_hash = hp.get("num_hash_layers", DEFAULT_NUM_HASH_LAYERS)
        hp["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    if "num_hash_layers" not in hp:
        types = hp["mlp_layer_types"]
        hp["num_hash_layers"] = next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))
    if hp.get("partial_rotary_factor") is None:
        legacy = hp.get("qk_rope_head_dim")
        hp["partial_rotary_factor"] = legacy / hp["head_dim"] if legacy is not None else DEFAULT_PARTIAL_ROTARY_FACTOR
    hp.setdefault("qk_rope_head_dim", int(hp["head_dim"] * hp["partial_rotary_factor"]))
    return hp


def check(hp: Hparams) -> None:
    n = require(hp, "num_hidden_layers")
    if hp["hc_mult"] != HC_STREAMS:
        raise SourceError(f"llama.cpp's deepseek4 needs {HC_STREAMS} hyper-connection streams, found {hp['hc_mult']}",
                          field="hc_mult")
    ratios = hp["compress_ratios"]
    if len(ratios) < n or any(r not in COMPRESS_RATIOS for r in ratios):
        raise SourceError(f"llama.cpp's deepseek4 needs one ratio per layer ({n}) from {sorted(COMPRESS_RATIOS)}, "
                          f"found {ratios}", field="compress_ratios")
    head = require(hp, "index_head_dim")
    if head <= 0 or head % INDEXER_HEAD_DIM_MULTIPLE:
        raise SourceError(f"llama.cpp's deepseek4 indexer needs a head dim that is a positive multiple of "
                          f"{INDEXER_HEAD_DIM_MULTIPLE} (Hadamard rotation), found {head}", field="index_head_dim")
    if not 0 < hp["qk_rope_head_dim"] <= hp["head_dim"]:
        raise SourceError(f"must be in 1..head_dim ({hp['head_dim']}), found {hp['qk_rope_head_dim']}",
                          field="qk_rope_head_dim")
    types = hp["mlp_layer_types"]
    n_hash = hp["num_hash_layers"]
    if len(types) != n or any(t != "hash_moe" for t in types[:n_hash]) or "hash_moe" in types[n_hash:]:
        raise SourceError(f"llama.cpp's deepseek4 needs the {n_hash} hash-routed layers first, found {types}",
                          field="mlp_layer_types")


def _rope(hp: Hparams) -> dict[str, Any]:
    """The converter's rope parameters: official ``rope_scaling`` merged in, or the YaRN keys of
    transformers' ``rope_parameters["compress"]`` when there is no ``rope_scaling``."""
    rp = rope_parameters(hp)
    if rp.get("full_attention", rp).get("rope_type") is None:
        scaling = hp.get("rope_scaling")
        if scaling is None:
            compress = (hp.get("rope_parameters") or {}).get("compress") or {}
            scaling = {k: compress[k] for k in YARN_KEYS if k in compress} if compress.get("rope_type") == "yarn" else None
        if scaling is not None:
            scaling = dict(scaling)
            if "rope_type" not in scaling and scaling.get("type") is not None:
                scaling["rope_type"] = scaling["type"]
            rp.update(scaling)
    return rp


def metadata(meta: MetadataBuilder, hp: Hparams, inputs: MetadataInputs) -> None:
    n = hp["num_hidden_layers"]
    text_model_metadata(meta, hp, n, _rope(hp))
    meta.u32("{arch}.rope.dimension_count", hp["qk_rope_head_dim"])
    meta.u32("{arch}.attention.q_lora_rank", hp["q_lora_rank"])
    meta.u32("{arch}.attention.sliding_window", hp["sliding_window"])
    meta.u32_or_array("{arch}.expert_feed_forward_length", hp["moe_intermediate_size"])
    meta.u32("{arch}.expert_shared_count", hp["n_shared_experts"])
    meta.f32("{arch}.expert_weights_scale", hp["routed_scaling_factor"])
    meta.boolean("{arch}.expert_weights_norm", hp["norm_topk_prob"])
    meta.array("{arch}.swiglu_clamp_exp", [float(hp["swiglu_limit"])] * n, GGUFValueType.FLOAT32)
    meta.array("{arch}.swiglu_clamp_shexp", [float(hp["swiglu_limit"])] * n, GGUFValueType.FLOAT32)
    meta.u32("{arch}.attention.indexer.head_count", hp["index_n_heads"])
    meta.u32("{arch}.attention.indexer.key_length", hp["index_head_dim"])
    meta.u32("{arch}.attention.indexer.top_k", hp["index_topk"])
    meta.u32("{arch}.attention.output_group_count", hp["o_groups"])
    meta.u32("{arch}.attention.output_lora_rank", hp["o_lora_rank"])
    meta.array("{arch}.attention.compress_ratios", [int(r) for r in hp["compress_ratios"]], GGUFValueType.INT32)
    meta.f32("{arch}.attention.compress_rope_freq_base", hp["compress_rope_theta"])
    meta.u32("{arch}.hyper_connection.count", hp["hc_mult"])
    meta.u32("{arch}.hyper_connection.sinkhorn_iterations", hp["hc_sinkhorn_iters"])
    meta.f32("{arch}.hyper_connection.epsilon", hp["hc_eps"])
    meta.u32("{arch}.hash_layer_count", hp["num_hash_layers"])
    meta.u32("{arch}.embedding_length_out", hp["hidden_size"] * hp["hc_mult"])


def dspark_normalize(config: Mapping[str, Any]) -> Hparams:
    hp = normalize(config)
    hp["num_hash_layers"] = 0      # the converter's: stages route by score
    hp["mlp_layer_types"] = ["moe"] * len(hp["mlp_layer_types"])
    return hp


def dspark_check(hp: Hparams) -> None:
    if has_mtp_block(hp):
        raise SupportError("this checkpoint holds no DSpark drafter (config.json has no dspark_* settings; its "
                           "mtp.* are an MTP block: --support mtp)", field="support")
    check(hp)
    for key in ("dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id"):
        require(hp, key, list if key == "dspark_target_layer_ids" else int)


def dspark_metadata(meta: MetadataBuilder, hp: Hparams, inputs: MetadataInputs) -> None:
    """The converter's ``DeepseekV4DSparkModel.set_gguf_parameters``: V4's keys for the stages (uncompressed,
    ``num_hidden_layers`` = stages), without ``embedding_length_out`` (written for deepseek4 only), plus the
    draft block size, the target layers it reads (one-based) and the noise token as mask token."""
    stages = hp["num_hidden_layers"]
    metadata(meta, dict(hp, compress_ratios=[0] * stages), inputs)
    meta.entries.pop(f"{meta.arch}.embedding_length_out")
    meta.u32("{arch}.block_size", hp["dspark_block_size"])
    meta.array("{arch}.target_layers", [int(i) + 1 for i in hp["dspark_target_layer_ids"]], GGUFValueType.INT32)
    meta.u32("tokenizer.ggml.mask_token_id", hp["dspark_noise_token_id"])


TEMPLATES = Path(__file__).parent / "templates"


def default_chat_template(checkpoint_name: str) -> str:
    """The template llama.cpp's converter embeds when the tokenizer has none: the 0731 checkpoint's when the
    directory name says 0731 (the converter's test), else the DeepSeek V4 one (templates/README.md)."""
    name = "deepseek-ai-DeepSeek-V4-Flash-0731.jinja" if "0731" in checkpoint_name else "deepseek-ai-DeepSeek-V4.jinja"
    return (TEMPLATES / name).read_text(encoding="utf-8")


DSPARK = Arch(
    model_type="deepseek_v4", gguf_arch="dflash", rules=DSPARK_RULES, normalize=dspark_normalize, check=dspark_check,
    metadata=dspark_metadata, block_count=lambda hp: 0, expert_count=lambda hp: hp["n_routed_experts"],
    aliases=ALIASES, conditions={"hash_layer": hash_layer}, default_chat_template=default_chat_template,
    input_groups=INPUT_GROUPS,
)
"""The DSpark drafter's map: its stages are the blocks past a trunk of none (``block_count`` 0; they are counted
from the checkpoint as MTP blocks are, and set ``num_hidden_layers`` of the metadata)."""

ARCH = Arch(
    model_type="deepseek_v4", gguf_arch="deepseek4", rules=RULES, normalize=normalize, check=check,
    metadata=metadata, block_count=lambda hp: hp["num_hidden_layers"],
    expert_count=lambda hp: hp["n_routed_experts"], aliases=ALIASES, conditions={"hash_layer": hash_layer},
    default_chat_template=default_chat_template, input_groups=INPUT_GROUPS,
    support_rules={"mtp": MTP_SUPPORT_RULES}, mtp_rules={"llama.cpp": MTP_MAIN_RULES, "ds4": MTP_DS4_RULES},
    mtp_applies=has_mtp_block, support_archs={"dspark": DSPARK},
)
