"""ds4's GGUF dialect: the names, keys and order of antirez's ds4 engine and its GLM-5.3 ("DwarfStar") forks.

Tables only (see :mod:`quantkit.arch.dialects` for how they are applied).  Each architecture is one
:class:`~quantkit.arch.dialects.ArchDialect`; where every name comes from is recorded, row by row, in
``tests/data/dialects/ds4_<arch>.tsv``.

* ``glm5-next`` (GLM-5.3-Flash): KDA tensors are ``kda_*`` (llama.cpp: ``attn_q``/``ssm_*``), the k-pool tensors
  ``indexer.pool_{ape,gate}`` (llama.cpp: ``indexer_compressor_{ape,gate}``); short convolutions are
  ``[C, 1, K]`` (llama.cpp: ``[1, C, 1, K]``, the same bytes); ``kda_a_log`` holds ``A_log`` itself where
  llama.cpp's ``ssm_a`` holds ``-exp(A_log)`` (a different payload: see ``LAYOUT_A_LOG``).  Keys: the
  DwarfStar converter's set (``layer_types``, ``trunk_block_count``, ``swiglu_limit``, ``linear_attention.*``,
  ``attention.indexer.pool_size``, ``context_length`` as UINT64, ...).  Tensor order: per block hc, attn_norm,
  attention, ffn_norm, feed-forward, nextn; ``output_norm`` and ``output`` last.
* ``deepseek4`` (DeepSeek V4 Flash): ds4.c binds llama.cpp's own names (``weights_bind``), in the order of the
  template GGUF its quantizer copies (the llama.cpp converter's); the dialect adds the keys ds4.c requires that
  llama.cpp's converter does not write (``deepseek4.vocab_size``).  The MTP block is ``mtp.K.*``
  (``mtp_weights_bind``; :data:`_V4_MTP`), built from the checkpoint only (``native``).
* ``qwen4exp`` (Qwen3.8 Flash Next): ds4's engine for it (``general.architecture = qwen38-next``, antirez/ds4's
  ``gguf-tools/qwen38_quantize.py``) is not a renaming of llama.cpp's ``qwen4exp``: it splits the fused gated-delta-net
  ``in_proj_qkv`` and its convolution into ``kda_{q,k,v}`` / ``kda_{q,k,v}_conv`` in the checkpoint's head order
  (llama.cpp tiles the V heads), keeps every other GDN tensor in that order too (``kda_gate``, ``kda_alpha``,
  ``kda_beta``, ``kda_dt_bias``, ``kda_output``'s columns) and ``A_log`` itself, splits the gated query into
  ``attn_q`` / ``attn_gate``, and keys the model as ``qwen38-next.*``.  Those tensors are built from the
  checkpoint's rows (:data:`QWEN38_NEXT`'s ``relaid`` rows, steps of :mod:`quantkit.arch.transforms`), so
  ``convert --dialect ds4`` writes it and ``redialect`` refuses it (:data:`UNSUPPORTED`).  ds4 writes the PLE n-gram
  table to a sidecar GGUF (``--ple-out``) under the same name and shape; quantkit keeps the table self-contained,
  last in the main file.
"""
from __future__ import annotations

from gguf.constants import GGUFValueType as T

from ...io.gguf import ArrayOf
from . import (LAYOUT_A_LOG, LAYOUT_CONV, ArchDialect, KeyRow, RelaidRow, TensorRow)

NAME = "ds4"

U32, U64, F32, BOOL = T.UINT32, T.UINT64, T.FLOAT32, T.BOOL
U32_ARRAY, I32_ARRAY, F32_ARRAY = ArrayOf(T.UINT32), ArrayOf(T.INT32), ArrayOf(T.FLOAT32)
U64_ARRAY = ArrayOf(T.UINT64)


def _same(*names: str) -> tuple[TensorRow, ...]:
    return tuple(TensorRow(n, n) for n in names)


# -- GLM-5.3-Flash --------------------------------------------------------------------------------------------------

_GLM_KDA = (
    TensorRow("blk.{L}.attn_q.weight", "blk.{L}.kda_q.weight"),
    TensorRow("blk.{L}.attn_k.weight", "blk.{L}.kda_k.weight"),
    TensorRow("blk.{L}.attn_v.weight", "blk.{L}.kda_v.weight"),
    TensorRow("blk.{L}.ssm_conv1d_q.weight", "blk.{L}.kda_q_conv.weight", LAYOUT_CONV),
    TensorRow("blk.{L}.ssm_conv1d_k.weight", "blk.{L}.kda_k_conv.weight", LAYOUT_CONV),
    TensorRow("blk.{L}.ssm_conv1d_v.weight", "blk.{L}.kda_v_conv.weight", LAYOUT_CONV),
    TensorRow("blk.{L}.ssm_f_a.weight", "blk.{L}.kda_f_a.weight"),
    TensorRow("blk.{L}.ssm_f_b.weight", "blk.{L}.kda_f_b.weight"),
    TensorRow("blk.{L}.ssm_dt.bias", "blk.{L}.kda_dt_bias.weight"),
    TensorRow("blk.{L}.ssm_a", "blk.{L}.kda_a_log.weight", LAYOUT_A_LOG),
    TensorRow("blk.{L}.ssm_beta.weight", "blk.{L}.kda_beta.weight"),
    TensorRow("blk.{L}.ssm_g_a.weight", "blk.{L}.kda_g_a.weight"),
    TensorRow("blk.{L}.ssm_g_b.weight", "blk.{L}.kda_g_b.weight"),
    TensorRow("blk.{L}.ssm_norm.weight", "blk.{L}.kda_o_norm.weight"),
    # llama.cpp names both attention outputs attn_output; ds4 names the KDA one kda_output (layer_types decides)
    TensorRow("blk.{L}.attn_output.weight", "blk.{L}.kda_output.weight", linear_only=True),
)
_GLM_DSA = (
    *_same("blk.{L}.attn_q_a.weight", "blk.{L}.attn_q_a_norm.weight", "blk.{L}.attn_q_b.weight",
           "blk.{L}.attn_kv_a_mqa.weight", "blk.{L}.attn_kv_a_norm.weight"),
    TensorRow("blk.{L}.attn_output.weight", "blk.{L}.attn_output.weight", attention_only=True),
    *_same("blk.{L}.indexer.attn_q_b.weight", "blk.{L}.indexer.attn_k.weight", "blk.{L}.indexer.k_norm.weight",
           "blk.{L}.indexer.k_norm.bias", "blk.{L}.indexer.proj.weight"),
    TensorRow("blk.{L}.indexer_compressor_ape.weight", "blk.{L}.indexer.pool_ape.weight"),
    TensorRow("blk.{L}.indexer_compressor_gate.weight", "blk.{L}.indexer.pool_gate.weight"),
    *_same("blk.{L}.attn_k_b.weight", "blk.{L}.attn_v_b.weight"),
)
_GLM_BLOCK = (
    *_same("blk.{L}.hc_attn_fn.weight", "blk.{L}.hc_attn_base.weight", "blk.{L}.hc_attn_scale.weight",
           "blk.{L}.hc_ffn_fn.weight", "blk.{L}.hc_ffn_base.weight", "blk.{L}.hc_ffn_scale.weight",
           "blk.{L}.attn_norm.weight"),
    *_GLM_KDA,
    *_GLM_DSA,
    *_same("blk.{L}.ffn_norm.weight",
           "blk.{L}.ffn_gate.weight", "blk.{L}.ffn_up.weight", "blk.{L}.ffn_down.weight",
           "blk.{L}.ffn_gate_inp.weight", "blk.{L}.exp_probs_b.bias",
           "blk.{L}.ffn_gate_exps.weight", "blk.{L}.ffn_up_exps.weight", "blk.{L}.ffn_down_exps.weight",
           "blk.{L}.ffn_gate_shexp.weight", "blk.{L}.ffn_up_shexp.weight", "blk.{L}.ffn_down_shexp.weight",
           "blk.{L}.nextn.eh_proj.weight", "blk.{L}.nextn.enorm.weight", "blk.{L}.nextn.hnorm.weight",
           "blk.{L}.nextn.shared_head_norm.weight"),
)

_GLM_KEYS = (
    KeyRow("{arch}.block_count", U32, "{arch}.block_count", U32),
    KeyRow("{arch}.trunk_block_count", U32, None, None, "trunk_blocks"),
    KeyRow("{arch}.nextn_predict_layers", U32, "{arch}.nextn_predict_layers", U32, "zero_if_absent"),
    KeyRow("{arch}.context_length", U64, "{arch}.context_length", U32),
    KeyRow("{arch}.embedding_length", U32, "{arch}.embedding_length", U32),
    KeyRow("{arch}.vocab_size", U32, "{arch}.vocab_size", U32),
    KeyRow("{arch}.feed_forward_length", U32, "{arch}.feed_forward_length", U32),
    KeyRow("{arch}.expert_feed_forward_length", U32, "{arch}.expert_feed_forward_length", U32),
    KeyRow("{arch}.expert_count", U32, "{arch}.expert_count", U32),
    KeyRow("{arch}.expert_used_count", U32, "{arch}.expert_used_count", U32),
    KeyRow("{arch}.expert_shared_count", U32, "{arch}.expert_shared_count", U32),
    KeyRow("{arch}.leading_dense_block_count", U32, "{arch}.leading_dense_block_count", U32),
    KeyRow("{arch}.expert_weights_scale", F32, "{arch}.expert_weights_scale", F32),
    KeyRow("{arch}.expert_weights_norm", BOOL, "{arch}.expert_weights_norm", BOOL),
    KeyRow("{arch}.swiglu_limit", F32, "{arch}.swiglu_clamp_exp", F32_ARRAY, "per_block_constant"),
    KeyRow("{arch}.attention.layer_norm_rms_epsilon", F32, "{arch}.attention.layer_norm_rms_epsilon", F32),
    KeyRow("{arch}.attention.head_count", U32, "{arch}.attention.head_count", U32),
    KeyRow("{arch}.attention.key_length", U32, "{arch}.attention.key_length_mla", U32),
    KeyRow("{arch}.attention.value_length", U32, "{arch}.attention.value_length_mla", U32),
    KeyRow("{arch}.attention.q_lora_rank", U32, "{arch}.attention.q_lora_rank", U32),
    KeyRow("{arch}.attention.kv_lora_rank", U32, "{arch}.attention.kv_lora_rank", U32),
    KeyRow("{arch}.attention.rope_dimension_count", U32, "{arch}.rope.dimension_count", U32),
    KeyRow("{arch}.attention.indexer.head_count", U32, "{arch}.attention.indexer.head_count", U32),
    KeyRow("{arch}.attention.indexer.key_length", U32, "{arch}.attention.indexer.key_length", U32),
    KeyRow("{arch}.attention.indexer.top_k", U32, "{arch}.attention.indexer.top_k", U32),
    KeyRow("{arch}.attention.indexer.pool_size", U32, "{arch}.attention.indexer.kpool", U32),
    KeyRow("{arch}.linear_attention.head_count", U32, None, None, "linear_heads"),
    KeyRow("{arch}.linear_attention.head_dimension", U32, "{arch}.kda.head_dim", U32),
    KeyRow("{arch}.linear_attention.conv_kernel", U32, "{arch}.ssm.conv_kernel", U32),
    KeyRow("{arch}.linear_attention.gate_lower_bound", F32, "{arch}.kda.gate_lower_bound", F32),
    KeyRow("{arch}.layer_types", U32_ARRAY, "{arch}.attention.head_count_kv", I32_ARRAY),
    KeyRow("{arch}.hyper_connection.count", U32, "{arch}.hyper_connection.count", U32),
    KeyRow("{arch}.hyper_connection.sinkhorn_iterations", U32, "{arch}.hyper_connection.sinkhorn_iterations", U32),
    KeyRow("{arch}.hyper_connection.epsilon", F32, "{arch}.hyper_connection.epsilon", F32),
)

GLM5_NEXT = ArchDialect(
    gguf_arch="glm5-next",
    tensors=(*_same("token_embd.weight"), *_GLM_BLOCK, *_same("output_norm.weight", "output.weight")),
    keys=_GLM_KEYS,
    # keys the llama.cpp dialect derives from others: re-created from them on the way back
    llamacpp_derived=("{arch}.swiglu_clamp_shexp",),
    # the llama.cpp keys ds4 engines hard-code for GLM-5.3-Flash (written when going back without a stash)
    llamacpp_constants=(("{arch}.attention.indexer.kpool_select_tail", BOOL, True),
                        ("{arch}.expert_gating_func", U32, 2)),   # sigmoid
    # a ds4 file has no indexer.types key: every sparse-MLA layer owns its indexer
    llamacpp_refused=("{arch}.attention.indexer.types",),
    markers=("{arch}.layer_types", "{arch}.trunk_block_count", "{arch}.linear_attention.head_dimension"),
)

# -- DeepSeek V4 Flash ----------------------------------------------------------------------------------------------

_V4_BLOCK = _same(
    "blk.{L}.hc_attn_fn.weight", "blk.{L}.hc_attn_scale.weight", "blk.{L}.hc_attn_base.weight",
    "blk.{L}.attn_norm.weight", "blk.{L}.attn_q_a.weight", "blk.{L}.attn_q_a_norm.weight", "blk.{L}.attn_q_b.weight",
    "blk.{L}.attn_kv.weight", "blk.{L}.attn_kv_a_norm.weight", "blk.{L}.attn_sinks.weight",
    "blk.{L}.attn_output_a.weight", "blk.{L}.attn_output_b.weight",
    "blk.{L}.attn_compressor_ape.weight", "blk.{L}.attn_compressor_kv.weight", "blk.{L}.attn_compressor_gate.weight",
    "blk.{L}.attn_compressor_norm.weight",
    "blk.{L}.indexer.attn_q_b.weight", "blk.{L}.indexer.proj.weight", "blk.{L}.indexer_compressor_ape.weight",
    "blk.{L}.indexer_compressor_kv.weight", "blk.{L}.indexer_compressor_gate.weight",
    "blk.{L}.indexer_compressor_norm.weight",
    "blk.{L}.hc_ffn_fn.weight", "blk.{L}.hc_ffn_scale.weight", "blk.{L}.hc_ffn_base.weight",
    "blk.{L}.ffn_norm.weight", "blk.{L}.ffn_gate_inp.weight", "blk.{L}.exp_probs_b.bias",
    "blk.{L}.ffn_gate_exps.weight", "blk.{L}.ffn_up_exps.weight", "blk.{L}.ffn_down_exps.weight",
    "blk.{L}.ffn_gate_shexp.weight", "blk.{L}.ffn_up_shexp.weight", "blk.{L}.ffn_down_shexp.weight",
    "blk.{L}.ffn_gate_tid2eid.weight",
)

#: ds4.c ``mtp_weights_bind``: the MTP block K as ``mtp.K.*`` (the tensors it binds; ``e_proj``/``h_proj`` apart
#: where llama.cpp concatenates them into ``nextn.eh_proj``, and the block's own ``hc_head``, which llama.cpp's main
#: file has no name for).  The block binds no compressor, indexer or ``tid2eid``: the MTP block is uncompressed and
#: routed by score.
_V4_MTP = tuple(f"mtp.{{L}}.{leaf}" for leaf in (
    "hc_head_base.weight", "hc_head_fn.weight", "hc_head_scale.weight", "e_proj.weight", "h_proj.weight",
    "enorm.weight", "hnorm.weight", "norm.weight",
    "hc_attn_fn.weight", "hc_attn_scale.weight", "hc_attn_base.weight", "attn_norm.weight", "attn_q_a.weight",
    "attn_q_a_norm.weight", "attn_q_b.weight", "attn_kv.weight", "attn_kv_a_norm.weight", "attn_sinks.weight",
    "attn_output_a.weight", "attn_output_b.weight", "hc_ffn_fn.weight", "hc_ffn_scale.weight", "hc_ffn_base.weight",
    "ffn_norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_exps.weight",
    "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"))

DEEPSEEK4 = ArchDialect(
    gguf_arch="deepseek4",
    tensors=(*_same("token_embd.weight", "output_hc_base.weight", "output_hc_fn.weight", "output_hc_scale.weight",
                    "output_norm.weight", "output.weight"), *_V4_BLOCK),
    native=_V4_MTP,
    native_note=("DeepSeek V4's MTP block is named mtp.K.* by ds4 (e_proj and h_proj apart, with its own hc_head) "
                 "and blk.N.* with nextn.eh_proj by llama.cpp (without that hc_head): convert it from the source "
                 "checkpoint with `quantkit convert --dialect`, or skip class mtp"),
    keys=(KeyRow("{arch}.vocab_size", U32, None, None, "vocab_from_tokens"),),
    keep_order=True,   # ds4's quantizer keeps its template's (the llama.cpp converter's) tensor order
    passthrough_arch_keys=True,   # every other deepseek4.* key is llama.cpp's, read by ds4.c as it is
    markers=("{arch}.vocab_size",),   # required by ds4.c, never written by llama.cpp's converter
)

# -- Qwen3.8 Flash Next ---------------------------------------------------------------------------------------------

def _kept(*names: str) -> tuple[RelaidRow, ...]:
    return tuple(RelaidRow(n, n) for n in names)


def _hc(site: str) -> tuple[RelaidRow, ...]:
    return _kept(*(f"blk.{{L}}.hc_{site}_{part}.weight" for part in ("down", "up", "inject", "norm")))


_QWEN38_GDN = (
    # llama.cpp's attn_qkv with its V rows tiled; ds4 slices the checkpoint's rows in their own order
    RelaidRow("blk.{L}.kda_q.weight", "blk.{L}.attn_qkv.weight", ("gdn_q_part",)),
    RelaidRow("blk.{L}.kda_k.weight", "blk.{L}.attn_qkv.weight", ("gdn_k_part",)),
    RelaidRow("blk.{L}.kda_v.weight", "blk.{L}.attn_qkv.weight", ("gdn_v_part",)),
    # [C, 1, K] channels of conv1d (llama.cpp: squeezed to [C, K], V channels tiled)
    RelaidRow("blk.{L}.kda_q_conv.weight", "blk.{L}.ssm_conv1d.weight", ("gdn_q_part",)),
    RelaidRow("blk.{L}.kda_k_conv.weight", "blk.{L}.ssm_conv1d.weight", ("gdn_k_part",)),
    RelaidRow("blk.{L}.kda_v_conv.weight", "blk.{L}.ssm_conv1d.weight", ("gdn_v_part",)),
    RelaidRow("blk.{L}.kda_gate.weight", "blk.{L}.attn_gate.weight", ()),
    RelaidRow("blk.{L}.kda_alpha.weight", "blk.{L}.ssm_alpha.weight", ()),
    RelaidRow("blk.{L}.kda_beta.weight", "blk.{L}.ssm_beta.weight", ()),
    RelaidRow("blk.{L}.kda_a_log.weight", "blk.{L}.ssm_a", ()),   # A_log itself (llama.cpp: -exp(A_log), tiled)
    RelaidRow("blk.{L}.kda_dt_bias.weight", "blk.{L}.ssm_dt.bias", ()),
    RelaidRow("blk.{L}.kda_o_norm.weight", "blk.{L}.ssm_norm.weight"),
    RelaidRow("blk.{L}.kda_output.weight", "blk.{L}.ssm_out.weight", (), columns_permuted=True),
)
_QWEN38_QSA = (
    # llama.cpp's attn_q is q_proj as it is: per head [query | output gate]
    RelaidRow("blk.{L}.attn_q.weight", "blk.{L}.attn_q.weight", ("query_half",)),
    RelaidRow("blk.{L}.attn_gate.weight", "blk.{L}.attn_q.weight", ("gate_half_rows",)),
    *_kept("blk.{L}.attn_k.weight", "blk.{L}.attn_v.weight", "blk.{L}.attn_q_norm.weight",
           "blk.{L}.attn_k_norm.weight", "blk.{L}.attn_output.weight", "blk.{L}.indexer.q_proj.weight",
           "blk.{L}.indexer.k_proj.weight", "blk.{L}.indexer.q_norm.weight", "blk.{L}.indexer.k_norm.weight"),
)
_QWEN38_FFN = (
    *_kept("blk.{L}.ffn_gate_inp.weight"),
    RelaidRow("blk.{L}.ffn_gate_inp_shexp.weight", "blk.{L}.ffn_gate_inp_shexp.weight", ("squeeze",)),   # [E]
    *_kept("blk.{L}.ffn_gate_exps.weight", "blk.{L}.ffn_up_exps.weight", "blk.{L}.ffn_down_exps.weight",
           "blk.{L}.ffn_gate_shexp.weight", "blk.{L}.ffn_up_shexp.weight", "blk.{L}.ffn_down_shexp.weight"),
)
_QWEN38_PLE = (
    RelaidRow("blk.{L}.ple_conv1d.weight", "blk.{L}.ple_conv1d.weight", ()),   # [C, 1, K] (llama.cpp: [C, K])
    *_kept("blk.{L}.ple_key.weight", "blk.{L}.ple_value.weight", "blk.{L}.ple_norm_conv.weight",
           "blk.{L}.ple_norm_key.weight", "blk.{L}.ple_norm_query.weight"),
)

_QWEN38_KEYS = (
    KeyRow("{arch}.block_count", U32, "{arch}.block_count", U32),
    KeyRow("{arch}.trunk_block_count", U32, None, None, "trunk_blocks"),
    KeyRow("{arch}.nextn_predict_layers", U32, "{arch}.nextn_predict_layers", U32, "zero_if_absent"),
    KeyRow("{arch}.context_length", U64, "{arch}.context_length", U32),
    KeyRow("{arch}.embedding_length", U32, "{arch}.embedding_length", U32),
    KeyRow("{arch}.vocab_size", U32, None, None, "vocab_from_tokens"),
    KeyRow("{arch}.expert_feed_forward_length", U32, "{arch}.expert_feed_forward_length", U32),
    KeyRow("{arch}.expert_count", U32, "{arch}.expert_count", U32),
    KeyRow("{arch}.expert_used_count", U32, "{arch}.expert_used_count", U32),
    KeyRow("{arch}.expert_shared_count", U32, "{arch}.expert_shared_feed_forward_length", U32, "present"),
    # llama.cpp's qwen4exp writes neither: its graph passes normalized top-k weights and no scale
    KeyRow("{arch}.expert_weights_scale", F32, None, None, "constant", 1.0),
    KeyRow("{arch}.expert_weights_norm", BOOL, None, None, "constant", True),
    KeyRow("{arch}.swiglu_limit", F32, None, None, "constant", 0.0),
    KeyRow("{arch}.attention.layer_norm_rms_epsilon", F32, "{arch}.attention.layer_norm_rms_epsilon", F32),
    KeyRow("{arch}.attention.head_count", U32, "{arch}.attention.head_count", U32),
    KeyRow("{arch}.attention.head_count_kv", U32, "{arch}.attention.head_count_kv", U32),
    KeyRow("{arch}.attention.key_length", U32, "{arch}.attention.key_length", U32),
    KeyRow("{arch}.attention.value_length", U32, "{arch}.attention.value_length", U32),
    KeyRow("{arch}.attention.rope_dimension_count", U32, "{arch}.rope.dimension_count", U32),
    KeyRow("{arch}.rope.freq_base", F32, "{arch}.rope.freq_base", F32),
    KeyRow("{arch}.attention.indexer.head_count", U32, "{arch}.attention.indexer.head_count", U32),
    KeyRow("{arch}.attention.indexer.key_length", U32, "{arch}.attention.indexer.key_length", U32),
    KeyRow("{arch}.attention.indexer.top_k", U32, "{arch}.attention.indexer.top_k", U32),
    KeyRow("{arch}.attention.indexer.pool_size", U32, "{arch}.attention.compress_ratios", I32_ARRAY,
           "nonzero_constant"),
    KeyRow("{arch}.linear_attention.head_count", U32, "{arch}.ssm.time_step_rank", U32),
    KeyRow("{arch}.linear_attention.qk_head_count", U32, "{arch}.ssm.group_count", U32),
    KeyRow("{arch}.linear_attention.head_dimension", U32, "{arch}.ssm.state_size", U32),
    KeyRow("{arch}.linear_attention.conv_kernel", U32, "{arch}.ssm.conv_kernel", U32),
    KeyRow("{arch}.hyper_connection.count", U32, "{arch}.hyper_connection.count", U32),
    KeyRow("{arch}.hyper_connection.low_rank", U32, "{arch}.hyper_connection.low_rank", U32),
    # llama.cpp's hyper-connection norm uses the RMS epsilon
    KeyRow("{arch}.hyper_connection.epsilon", F32, "{arch}.attention.layer_norm_rms_epsilon", F32),
    KeyRow("{arch}.layer_types", U32_ARRAY, "{arch}.attention.recurrent_layers", ArrayOf(BOOL),
           "recurrent_to_layer_types"),
    KeyRow("{arch}.ple.ngram_size", U32, "{arch}.ple.ngram_size", U32),
    KeyRow("{arch}.ple.heads_per_ngram", U32, "{arch}.ple.heads_per_ngram", U32),
    KeyRow("{arch}.ple.row_length", U32, "{arch}.embedding_length_per_layer_input", U32),
    KeyRow("{arch}.ple.conv_kernel", U32, "{arch}.ple.conv_kernel", U32),
    KeyRow("{arch}.ple.layer", U32, "{arch}.ple.layers", I32_ARRAY, "only_element"),
    KeyRow("{arch}.ple.eos_token_id", U32, "{arch}.ple.eos_token_id", U32),
    KeyRow("{arch}.ple.layer_multipliers", U64_ARRAY, "{arch}.ple.layer_multipliers", U64_ARRAY),
    KeyRow("{arch}.ple.head_offsets", U64_ARRAY, "{arch}.ple.head_offsets", U64_ARRAY),
    KeyRow("{arch}.ple.head_vocab_sizes", U64_ARRAY, "{arch}.ple.head_vocab_sizes", U64_ARRAY),
)

QWEN38_NEXT = ArchDialect(
    gguf_arch="qwen4exp",
    ds4_arch="qwen38-next",
    tensors=(),
    keys=_QWEN38_KEYS,
    relaid=(*_kept("token_embd.weight"), *_hc("attn"), *_hc("ffn"), *_QWEN38_GDN, *_QWEN38_QSA, *_QWEN38_FFN,
            *_QWEN38_PLE, *_kept("output_hc_down.weight", "output_hc_up.weight", "output_hc_norm.weight",
                                 "output.weight", "per_layer_token_embd.weight")),
    markers=("{arch}.layer_types",),
)

#: Architectures with no lossless ds4 table, and why (``redialect`` refuses them with this message).
_QWEN38_REFUSED = ("a re-dialect between llama.cpp's qwen4exp and ds4's qwen38-next would have to undo llama.cpp's "
                   "V-head tiling inside quantized payloads: blk.N.ssm_out.weight -> kda_output permutes input "
                   "columns in groups of linear_value_head_dim, which splits the 256-wide blocks of K-/I-quants, "
                   "and blk.N.ssm_a holds -exp(A_log) in tiled order; convert from the source checkpoint with "
                   "`quantkit convert --dialect ds4` instead")
UNSUPPORTED = {"qwen4exp": _QWEN38_REFUSED, "qwen38-next": _QWEN38_REFUSED}

ARCHS = {d.gguf_arch: d for d in (GLM5_NEXT, DEEPSEEK4)}
#: Architectures ds4 lays out differently, converted from the checkpoint only (llama.cpp arch -> table).
RELAID = {d.gguf_arch: d for d in (QWEN38_NEXT,)}
