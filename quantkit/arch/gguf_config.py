"""The transformers config of a GGUF file, rebuilt from its own hyperparameter keys (files quantkit did not write).

This is the reverse of what llama.cpp's ``convert_hf_to_gguf.py`` writes (``TextModel.set_gguf_parameters`` and
each model's override, with gguf-py's key names), which the architecture modules mirror key for key
(``quantkit.arch.<arch>.metadata``).  Per GGUF architecture, a :class:`ConfigSpec` holds:

- ``keys``: plain one-key-one-field entries (:class:`Key`: ``<arch>.<key>`` -> config field), the table;
- ``constants``: fields llama.cpp hard-codes for the architecture (so its files cannot say otherwise);
- ``derive``: the few fields that come from several keys, from an array or from a tensor shape (MLA head dims,
  layer schedules, the YaRN multiplier), one small function per architecture.

Floats are stored as float32; each is read back as the shortest decimal that rounds to the same float32
(``1e-06``, not ``9.99999997e-07``), which is what the source config held whenever it was written in decimal.

Correctness is checked where the config is used: the runtime derives the metadata the rebuilt config implies
(:meth:`quantkit.arch.ArchMap.metadata`) and compares it with every hyperparameter key of the file, so a table
error cannot run silently.

Dialects: the tables are written in llama.cpp's key names.  A file in another dialect (ds4's) is first seen through
:func:`llama_cpp_view`, the single place where its keys and tensor names are translated to llama.cpp's (the runtime
and foreign-file validation read every GGUF through it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from ..errors import FormatError, UnsupportedError
from ..io.gguf import KV
from .base import GATING_FUNCS

_MISSING = object()
#: llama.cpp's expert gating ids -> the config's ``scoring_func`` (the converter's mapping, reversed).
GATING_NAMES = {v: k for k, v in GATING_FUNCS.items()}
#: Tokenizer keys -> config fields (the special tokens the model config also names).
TOKEN_FIELDS = (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                ("pad_token_id", "tokenizer.ggml.padding_token_id"))


def f32_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 as ``value``."""
    return float(str(np.float32(value)))


class KeyReader:
    """A file's metadata and tensor shapes (numpy order), read by key suffix under ``<arch>.``."""

    def __init__(self, metadata: Mapping[str, KV], shapes: Mapping[str, tuple[int, ...]], path: Path, arch: str):
        self.metadata, self.shapes, self.path, self.arch = metadata, shapes, path, arch

    def full(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self.full(key) in self.metadata

    def get(self, key: str, default: Any = _MISSING) -> Any:
        kv = self.metadata.get(self.full(key))
        if kv is None:
            if default is _MISSING:
                raise FormatError("needed to rebuild the model config, missing from the file", path=self.path,
                                  field=self.full(key))
            return default
        value = kv.value
        return value.tolist() if isinstance(value, np.ndarray) else list(value) if isinstance(value, tuple) else value

    def number(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        return f32_decimal(value) if isinstance(value, float) else value

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise FormatError("needed to rebuild the model config, missing from the file", path=self.path,
                              tensor=name)
        return self.shapes[name]


@dataclass(frozen=True)
class Key:
    """``<arch>.<key>`` -> config ``field`` (absent and not ``required``: the field keeps transformers' default)."""

    field: str
    key: str
    required: bool = True


@dataclass(frozen=True)
class ConfigSpec:
    """How one GGUF architecture's keys become a transformers config (see the module doc)."""

    gguf_arch: str
    model_type: str
    model_class: str
    keys: tuple[Key, ...]
    constants: Mapping[str, Any] = field(default_factory=dict)
    derive: Callable[[KeyReader, dict], None] | None = None
    nested: bool = False
    """The model is a vision-language wrapper: the text fields go under ``text_config``."""
    root_keys: tuple[Key, ...] = ()
    """Keys of a wrapper's own fields (outside ``text_config``)."""


# -- shared pieces ------------------------------------------------------------------------------------------------

TEXT_KEYS = (
    Key("num_hidden_layers", "block_count"), Key("hidden_size", "embedding_length"),
    Key("max_position_embeddings", "context_length", required=False),
    Key("num_attention_heads", "attention.head_count"),
    Key("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    Key("num_experts_per_tok", "expert_used_count"),
)
MLA_KEYS = (
    Key("q_lora_rank", "attention.q_lora_rank", required=False), Key("kv_lora_rank", "attention.kv_lora_rank"),
    Key("qk_rope_head_dim", "rope.dimension_count"), Key("v_head_dim", "attention.value_length_mla"),
    Key("n_routed_experts", "expert_count"), Key("moe_intermediate_size", "expert_feed_forward_length"),
    Key("n_shared_experts", "expert_shared_count"), Key("routed_scaling_factor", "expert_weights_scale"),
    Key("n_group", "expert_group_count", required=False), Key("topk_group", "expert_group_used_count", required=False),
)


def _vocab(r: KeyReader) -> int:
    return r.shape("token_embd.weight")[0]


def _scoring(r: KeyReader, supported: tuple[str, ...], default: str | None = None) -> str:
    """The gating function the file names; llama.cpp's fallback for a file without the key is softmax."""
    gating = r.get("expert_gating_func", None)
    name = GATING_NAMES.get(gating, "softmax") if gating is not None else (default or "softmax")
    if name not in supported:
        raise UnsupportedError(f"expert gating {name!r} (id {gating}): transformers' {r.arch} model routes with "
                               f"{' or '.join(supported)} only", path=r.path, field=r.full("expert_gating_func"))
    return name


def _rope_scaling(r: KeyReader) -> dict[str, Any]:
    """``rope.scaling.*`` as rope parameters (empty without a scaling type)."""
    kind = r.get("rope.scaling.type", None)
    if kind is None or kind == "none":
        return {}
    out: dict[str, Any] = {"rope_type": kind, "factor": r.number("rope.scaling.factor")}
    for name, key in (("original_max_position_embeddings", "rope.scaling.original_context_length"),
                      ("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
                      ("attention_factor", "rope.scaling.yarn_attn_factor"),
                      ("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow")):
        if r.has(key):
            out[name] = r.number(key)
    return out


def _first(values: Any) -> Any:
    return values[0] if isinstance(values, list) else values


def _leading(count: int, total: int, first: str, rest: str) -> list[str]:
    return [first] * count + [rest] * (total - count)


# -- per architecture ---------------------------------------------------------------------------------------------

def _qwen3moe(r: KeyReader, c: dict) -> None:
    heads = c["num_attention_heads"]
    c["head_dim"] = r.get("attention.key_length", c["hidden_size"] // heads)
    c["num_key_value_heads"] = r.get("attention.head_count_kv", heads)
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": r.number("rope.freq_base"), **_rope_scaling(r)}


def _deepseek2(r: KeyReader, c: dict) -> None:
    c["scoring_func"] = _scoring(r, ("sigmoid",))
    if not r.has("attention.q_lora_rank"):
        c["q_lora_rank"] = None                            # a full-rank q_proj (transformers' default is a rank)
    c["num_key_value_heads"] = c["num_attention_heads"]    # MLA is written as MQA (head_count_kv 1)
    c["qk_nope_head_dim"] = r.get("attention.key_length_mla") - c["qk_rope_head_dim"]
    c["head_dim"] = c["qk_rope_head_dim"]
    c["first_k_dense_replace"] = r.get("leading_dense_block_count", 0)
    c["norm_topk_prob"] = bool(r.get("expert_weights_norm", False))
    rope = {"rope_type": "default", "rope_theta": r.number("rope.freq_base"), **_rope_scaling(r)}
    if r.has("rope.scaling.yarn_log_multiplier"):
        # the converter writes 0.1 * mscale_all_dim; llama.cpp's deepseek2 graph cancels YaRN's rope magnitude
        # factor, i.e. mscale == mscale_all_dim
        mscale = f32_decimal(r.number("rope.scaling.yarn_log_multiplier") / 0.1)
        rope.update(mscale=mscale, mscale_all_dim=mscale)
    c["rope_parameters"] = rope


def _glm5_next(r: KeyReader, c: dict) -> None:
    blocks = c.pop("num_hidden_layers")
    nextn = r.get("nextn_predict_layers", 0)
    c["num_hidden_layers"] = n = blocks - nextn
    c["num_nextn_predict_layers"] = nextn
    kv_heads = r.get("attention.head_count_kv")
    if not isinstance(kv_heads, list) or len(kv_heads) != blocks:
        raise FormatError(f"expected one entry per block ({blocks}), found {kv_heads!r}", path=r.path,
                          field=r.full("attention.head_count_kv"))
    c["layer_types"] = ["linear_attention" if h == 0 else "indexed_attention" for h in kv_heads[:n]]
    c["num_key_value_heads"] = c["num_attention_heads"]
    c["linear_num_heads"] = c["num_attention_heads"]       # llama.cpp requires it
    c["qk_nope_head_dim"] = r.get("attention.key_length_mla") - c["qk_rope_head_dim"]
    c["mlp_layer_types"] = _leading(r.get("leading_dense_block_count"), n, "dense", "sparse")
    c["norm_topk_prob"] = bool(r.get("expert_weights_norm", False))
    c["scoring_func"] = _scoring(r, ("sigmoid",), default="sigmoid")
    if r.has("attention.indexer.types"):
        c["indexer_types"] = ["full" if full else "shared" for full in r.get("attention.indexer.types")]
    if r.has("swiglu_clamp_exp"):
        c["swiglu_limit"] = f32_decimal(_first(r.get("swiglu_clamp_exp")))
    if r.has("rope.freq_base"):
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": r.number("rope.freq_base")}


def _deepseek4(r: KeyReader, c: dict) -> None:
    blocks = c["num_hidden_layers"]       # with the MTP blocks a main file keeps (nextn_predict_layers)
    nextn = r.get("nextn_predict_layers", 0)
    c["num_hidden_layers"], c["num_nextn_predict_layers"] = blocks - nextn, nextn
    c["scoring_func"] = _scoring(r, ("sqrtsoftplus", "sigmoid", "softmax"))
    c["norm_topk_prob"] = bool(r.get("expert_weights_norm", False))
    c["swiglu_limit"] = f32_decimal(_first(r.get("swiglu_clamp_exp")))
    ratios = r.get("attention.compress_ratios")
    if len(ratios) < blocks:   # llama.cpp's converter writes the config's list, the MTP block's ratio included
        raise FormatError(f"expected at least {blocks} ratios, found {len(ratios)}", path=r.path,
                          field=r.full("attention.compress_ratios"))
    c["compress_ratios"] = [int(x) for x in ratios]        # transformers' legacy keys, folded into layer_types
    c["num_hash_layers"] = r.get("hash_layer_count")
    c["qk_rope_head_dim"] = rope_dim = r.get("rope.dimension_count")
    factor = rope_dim / c["head_dim"]
    main = {"rope_type": "default", "rope_theta": r.number("rope.freq_base"), "partial_rotary_factor": factor}
    compress = {"rope_type": "default", **_rope_scaling(r), "rope_theta": r.number("attention.compress_rope_freq_base"),
                "partial_rotary_factor": factor}
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)        # what transformers' config injects (deepseek4 too)
    c["rope_parameters"] = {"main": main, "compress": compress}


def _qwen4exp(r: KeyReader, c: dict) -> None:
    n = c["num_hidden_layers"]
    c["head_dim"] = head_dim = r.get("attention.key_length")
    recurrent = r.get("attention.recurrent_layers")
    ratios = r.get("attention.compress_ratios")
    if len(recurrent) != n or len(ratios) != n:
        raise FormatError(f"attention.recurrent_layers and attention.compress_ratios need {n} entries",
                          path=r.path, field=r.full("attention.recurrent_layers"))
    c["layer_types"] = ["linear_attention" if lin else "indexed_attention" for lin in recurrent]
    sparse = sorted({int(x) for x, lin in zip(ratios, recurrent) if not lin})
    if len(sparse) != 1:
        raise UnsupportedError(f"transformers' Qwen4-Exp takes one indexer compression ratio for every attention "
                               f"layer, the file gives {sparse}", path=r.path,
                               field=r.full("attention.compress_ratios"))
    if sparse == [0]:
        raise UnsupportedError("every attention layer has compression ratio 0 (llama.cpp's converter writes that for "
                               "qwen4_exp: its QSA indexer never engages), which transformers' Qwen4-Exp cannot run; "
                               "convert the checkpoint with quantkit, whose file records the model's own settings",
                               path=r.path, field=r.full("attention.compress_ratios"))
    c["indexer_compress_ratio"] = sparse[0]
    c["linear_value_head_dim"] = r.get("ssm.inner_size") // c["linear_num_value_heads"]
    q_rows = r.shape(next(name for name in r.shapes if name.endswith(".indexer.k_proj.weight")))[0]
    c["indexer_kv_heads"] = q_rows // c["indexer_head_dim"]
    c["output_gate_type"] = "sigmoid"                      # llama.cpp hard-codes it
    sections = [int(s) for s in r.get("rope.dimension_sections", [])]
    while sections and sections[-1] == 0:
        sections.pop()
    rope = {"rope_type": "default", "rope_theta": r.number("rope.freq_base"),
            "partial_rotary_factor": r.get("rope.dimension_count") / head_dim, **_rope_scaling(r)}
    if sections:
        rope.update(mrope_section=sections, mrope_interleaved=True)
    c["rope_parameters"] = rope
    if not r.has("ple.layers"):
        return
    layers = r.get("ple.layers")
    c["ple_layer_ids"] = [int(i) + 1 for i in layers]
    heads = (c["ngram_size"] - 1) * c["heads_per_ngram"]
    c["ple_embed_dim"] = r.get("embedding_length_per_layer_input") * heads
    c["eos_token_id"] = r.get("ple.eos_token_id")
    sizes = [int(s) for s in r.get("ple.head_vocab_sizes")]
    # every base in (previous prime, sizes[0]] gives the same heads; sizes[0] is one of them
    c["ngram_vocab_size_base"] = sizes[0]
    rows = r.shape("per_layer_token_embd.weight")[0]
    total = sum(sizes)
    divisor = 128                                          # transformers' default, when it gives the stored rows
    c["make_ngram_vocab_size_divisible_by"] = divisor if -(-total // divisor) * divisor == rows else rows
    c["split_ngram_parts"] = 1


SPECS: Mapping[str, ConfigSpec] = {spec.gguf_arch: spec for spec in (
    ConfigSpec("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", TEXT_KEYS + (
        Key("num_experts", "expert_count"), Key("moe_intermediate_size", "expert_feed_forward_length"),
        Key("intermediate_size", "feed_forward_length", required=False)),
        # llama.cpp's qwen3moe always renormalizes the top-k weights and has no dense layers
        constants={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
                   "attention_bias": False},
        derive=_qwen3moe),
    ConfigSpec("deepseek2", "deepseek_v3", "DeepseekV3ForCausalLM", TEXT_KEYS + MLA_KEYS + (
        Key("intermediate_size", "feed_forward_length"),),
        constants={"hidden_act": "silu", "num_nextn_predict_layers": 0, "topk_method": "noaux_tc"},
        derive=_deepseek2),
    ConfigSpec("glm5-next", "glm5_next", "Glm5NextForConditionalGeneration", TEXT_KEYS + MLA_KEYS + (
        Key("intermediate_size", "feed_forward_length"), Key("linear_conv_kernel_dim", "ssm.conv_kernel"),
        Key("linear_head_dim", "kda.head_dim"), Key("linear_lower_bound", "kda.gate_lower_bound", required=False),
        Key("index_n_heads", "attention.indexer.head_count"), Key("index_head_dim", "attention.indexer.key_length"),
        Key("index_topk", "attention.indexer.top_k"), Key("index_kpool", "attention.indexer.kpool"),
        Key("index_kpool_always_select_tail", "attention.indexer.kpool_select_tail", required=False),
        Key("hc_mult", "hyper_connection.count"), Key("hc_sinkhorn_iters", "hyper_connection.sinkhorn_iterations"),
        Key("hc_eps", "hyper_connection.epsilon")),
        constants={"hidden_act": "silu"}, derive=_glm5_next, nested=True),
    ConfigSpec("deepseek4", "deepseek_v4", "DeepseekV4ForCausalLM", TEXT_KEYS + (
        Key("num_key_value_heads", "attention.head_count_kv"), Key("head_dim", "attention.key_length"),
        Key("n_routed_experts", "expert_count"), Key("q_lora_rank", "attention.q_lora_rank"),
        Key("sliding_window", "attention.sliding_window"), Key("moe_intermediate_size", "expert_feed_forward_length"),
        Key("n_shared_experts", "expert_shared_count"), Key("routed_scaling_factor", "expert_weights_scale"),
        Key("index_n_heads", "attention.indexer.head_count"), Key("index_head_dim", "attention.indexer.key_length"),
        Key("index_topk", "attention.indexer.top_k"), Key("o_groups", "attention.output_group_count"),
        Key("o_lora_rank", "attention.output_lora_rank"), Key("hc_mult", "hyper_connection.count"),
        Key("hc_sinkhorn_iters", "hyper_connection.sinkhorn_iterations"), Key("hc_eps", "hyper_connection.epsilon")),
        constants={"hidden_act": "silu", "num_nextn_predict_layers": 0}, derive=_deepseek4),
    ConfigSpec("qwen4exp", "qwen4_exp", "Qwen4ExpForConditionalGeneration", TEXT_KEYS + (
        Key("num_key_value_heads", "attention.head_count_kv"), Key("num_experts", "expert_count"),
        Key("moe_intermediate_size", "expert_feed_forward_length"),
        Key("shared_expert_intermediate_size", "expert_shared_feed_forward_length"),
        Key("linear_conv_kernel_dim", "ssm.conv_kernel"), Key("linear_key_head_dim", "ssm.state_size"),
        Key("linear_num_key_heads", "ssm.group_count"), Key("linear_num_value_heads", "ssm.time_step_rank"),
        Key("full_attention_interval", "full_attention_interval", required=False),
        Key("hc_count", "hyper_connection.count"), Key("hc_lowrank", "hyper_connection.low_rank"),
        Key("indexer_n_heads", "attention.indexer.head_count"), Key("indexer_head_dim", "attention.indexer.key_length"),
        Key("indexer_budget", "attention.indexer.top_k"), Key("ngram_size", "ple.ngram_size", required=False),
        Key("heads_per_ngram", "ple.heads_per_ngram", required=False),
        Key("ple_conv_kernel_size", "ple.conv_kernel", required=False)),
        constants={"hidden_act": "silu", "norm_topk_prob": True}, derive=_qwen4exp, nested=True,
        root_keys=(Key("image_token_id", "ple.image_token_id", required=False),)),
)}


class LlamaCppView(NamedTuple):
    """A GGUF seen under llama.cpp's names (:func:`llama_cpp_view`)."""

    metadata: Mapping[str, KV]
    stored: dict[str, str]
    """llama.cpp tensor name -> the name stored in the file."""
    relaid: dict[str, Any]
    """llama.cpp tensor name -> its :class:`~quantkit.arch.dialects.TensorMove`, for the few tensors the file's
    dialect stores in another layout (ds4's GLM ``kda_a_log`` holds ``A_log`` where llama.cpp's ``ssm_a`` holds
    ``-exp(A_log)``; its convolutions have another shape): readers convert those payloads with
    :func:`quantkit.arch.dialects.convert_payload`."""
    relaid_table: Any = None
    """For an architecture ds4 lays out differently (Qwen3.8's ``qwen38-next``): its
    :class:`~quantkit.arch.dialects.ArchDialect`.  Its tensors keep their stored names (no llama.cpp tensor holds
    the same values) and readers redirect the architecture map to them
    (:func:`quantkit.arch.dialects.relaid_mappings`); ``general.architecture`` reads as llama.cpp's."""


def llama_cpp_view(metadata: Mapping[str, KV], tensors: Mapping[str, Any]) -> LlamaCppView:
    """A file's keys under llama.cpp's names, and llama.cpp tensor name -> the name stored in the file.

    The one hook for other dialects: a ds4-dialect file is translated here through the llama.cpp <-> ds4 table
    (:mod:`quantkit.arch.dialects`); a llama.cpp file passes through unchanged.  Every reader of a GGUF that looks
    names up in the architecture tables (the runtime's :class:`~quantkit.runtime.weights.GGUFWeights`, foreign-file
    validation) goes through it, and payloads are read under the stored names.  ``tensors``: the file's tensor
    infos by name, in file order (``.shape`` in numpy order, ``.type``).
    """
    from .dialects import DS4, LAYOUT_SAME, LLAMA_CPP, arch_dialect, dialect_of, is_native, translate
    from .dialects.ds4 import RELAID

    if "general.architecture" not in metadata or dialect_of(metadata) != DS4:
        return LlamaCppView(metadata, {name: name for name in tensors}, {})
    relaid = next((t for t in RELAID.values() if t.ds4_arch == metadata["general.architecture"].value), None)
    if relaid is not None:
        renamed = {**metadata, "general.architecture": KV(relaid.gguf_arch, metadata["general.architecture"].type)}
        return LlamaCppView(renamed, {name: name for name in tensors}, {}, relaid)
    table = arch_dialect(metadata["general.architecture"].value, DS4)
    native = [n for n in tensors if is_native(table, n)]   # no llama.cpp name (V4's mtp.K.*): kept as stored
    translation = translate(metadata, [(n, tuple(t.shape), t.type) for n, t in tensors.items() if n not in native],
                            to=LLAMA_CPP)
    return LlamaCppView(dict(translation.metadata), {**{m.name: m.source for m in translation.moves},
                                                     **{n: n for n in native}},
                        {m.name: m for m in translation.moves if m.layout != LAYOUT_SAME})


def config_from_keys(metadata: Mapping[str, KV], shapes: Mapping[str, tuple[int, ...]], path: Path) -> dict:
    """The transformers ``config.json`` (as a dict) a GGUF's hyperparameter keys describe (see the module doc).

    ``metadata`` and ``shapes`` (numpy order) are under llama.cpp's names (:func:`llama_cpp_view`)."""
    arch_kv = metadata.get("general.architecture")
    if arch_kv is None:
        raise FormatError("needed to rebuild the model config, missing from the file", path=path,
                          field="general.architecture")
    spec = SPECS.get(arch_kv.value)
    if spec is None:
        raise UnsupportedError(f"no config rebuild for a {arch_kv.value!r} model (known: {sorted(SPECS)}); pass "
                               f"config= (the source config.json)", path=path, field="general.architecture")
    r = KeyReader(metadata, shapes, path, spec.gguf_arch)
    text: dict[str, Any] = {"vocab_size": _vocab(r), "tie_word_embeddings": "output.weight" not in shapes,
                            **spec.constants}
    for k in spec.keys:
        value = r.number(k.key, _MISSING if k.required else None)
        if value is not None:
            text[k.field] = value
    for name, key in TOKEN_FIELDS:
        if key in metadata:
            text[name] = metadata[key].value
    if spec.derive is not None:
        spec.derive(r, text)
    if not spec.nested:
        return {"model_type": spec.model_type, "architectures": [spec.model_class], **text}
    root = {k.field: value for k in spec.root_keys
            if (value := r.number(k.key, _MISSING if k.required else None)) is not None}
    return {"model_type": spec.model_type, "architectures": [spec.model_class],
            "tie_word_embeddings": text["tie_word_embeddings"], **root, "text_config": text}


__all__ = ["ConfigSpec", "Key", "KeyReader", "SPECS", "config_from_keys", "f32_decimal", "LlamaCppView", "llama_cpp_view"]
