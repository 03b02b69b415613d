"""Does the config agree with the tensors?  The hyperparameters a GGUF loader checks tensor shapes against.

llama.cpp creates every tensor with dimensions computed from the metadata and refuses a file whose tensors differ,
so a ``config.json`` that does not describe its weights (an edited hidden size, a vocabulary or expert count of
another model) must stop the conversion, not produce a file nothing can load.  The checks (:data:`CHECKS`), each
applied where both the key and the tensor exist, with numpy-order shapes:

==========================================  =============================================  ========================
GGUF key (config key)                       tensors                                        must equal
==========================================  =============================================  ========================
``{arch}.embedding_length`` (hidden_size)   ``token_embd.weight``, ``output.weight``       the row length
``tokenizer.ggml.tokens`` (vocab_size)      ``token_embd.weight``, ``output.weight``       the row count
``{arch}.expert_count`` (num_experts)       ``blk.N.ffn_{gate,up,down}_exps.weight``       dimension 0
``{arch}.expert_feed_forward_length``       ``blk.N.ffn_{gate,up}_exps.weight`` / ``down``  dimension 1 / 2
(moe_intermediate_size)
==========================================  =============================================  ========================

and the attention heads (:func:`_head_disagreements`), where llama.cpp sizes the projections from them: ``attn_q`` rows
= heads x key length (x 2 where the query carries its gate: :data:`QUERY_FACTOR`), ``attn_k`` / ``attn_v`` rows =
the layer's key-value heads x key / value length, ``attn_q_b`` rows = heads x the MLA key length, ``attn_k_b``
one slice per head.  Key and value lengths default to the embedding length / heads, as llama.cpp's do.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator, Mapping, NamedTuple

import numpy as np

from ..errors import SourceError
from ..io.gguf import KV

# (GGUF key, config key for the message, tensor-name regex, dimension that must equal the value, or "count")
CHECKS: tuple[tuple[str, str, str, int | str], ...] = (
    ("{arch}.embedding_length", "hidden_size", r"(token_embd|output)\.weight", -1),
    ("tokenizer.ggml.tokens", "vocab_size", r"(token_embd|output)\.weight", 0),
    ("{arch}.expert_count", "num_experts", r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", 0),
    ("{arch}.expert_feed_forward_length", "moe_intermediate_size", r"blk\.\d+\.ffn_(gate|up)_exps\.weight", 1),
    ("{arch}.expert_feed_forward_length", "moe_intermediate_size", r"blk\.\d+\.ffn_down_exps\.weight", 2),
)


#: GGUF architectures whose heads are checked -> rows of ``attn_q`` per head and key length (Qwen3-Next's
#: query projection carries the output gate: twice the rows).
QUERY_FACTOR = {"qwen3moe": 1, "qwen4exp": 2, "deepseek2": 1, "deepseek4": 1, "glm5-next": 1}
_HEAD_TENSOR = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_q_b|attn_k_b)\.weight")


def _plain(value):
    """A key's value with a file's arrays (numpy, as the reader gives them) as lists, as the converter builds them."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def _value(kv: KV) -> int | None:
    """An integer key's value, a string array's length (the vocabulary); None for per-layer arrays."""
    if isinstance(kv.value, (list, np.ndarray)):
        return len(kv.value)
    return kv.value if isinstance(kv.value, int) and not isinstance(kv.value, bool) else None


class Disagreement(NamedTuple):
    """A tensor whose shape its hyperparameters contradict."""

    tensor: str
    field: str
    """The config.json field behind the GGUF key."""
    detail: str
    """``"<what the keys give> for tensor 'name', which has shape [...]"``."""


def disagreements(metadata: Iterable[tuple[str, KV]], shapes: Mapping[str, tuple[int, ...]]
                  ) -> Iterator[Disagreement]:
    """Every tensor of ``shapes`` (numpy order, llama.cpp's names) whose shape the keys contradict, in order."""
    meta = dict(metadata)
    arch_kv = meta.get("general.architecture")
    arch = arch_kv.value if arch_kv is not None else ""
    for key_template, config_key, pattern, dim in CHECKS:
        key = key_template.format(arch=arch)
        if key not in meta or (value := _value(meta[key])) is None:
            continue
        regex = re.compile(pattern)
        for name in sorted(shapes):
            shape = shapes[name]
            if regex.fullmatch(name) and len(shape) >= (dim + 1 if dim >= 0 else -dim) and shape[dim] != value:
                yield Disagreement(name, config_key, f"{value} ({key}) for tensor {name!r}, which has shape "
                                                     f"{list(shape)}")
    if arch in QUERY_FACTOR:
        yield from _head_disagreements(meta, arch, shapes)


def check_config_against_tensors(metadata: Iterable[tuple[str, KV]], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`SourceError` naming the config key, the tensor and both values at the first disagreement."""
    for found in disagreements(metadata, shapes):
        raise SourceError(f"config.json gives {found.detail}: the config does not describe these weights",
                          field=found.field, tensor=found.tensor)


def _head_disagreements(meta: Mapping[str, KV], arch: str, shapes: Mapping[str, tuple[int, ...]]
                        ) -> Iterator[Disagreement]:
    def get(key: str):
        kv = meta.get(f"{arch}.{key}")
        return None if kv is None else _plain(kv.value)

    heads, embd = get("attention.head_count"), get("embedding_length")
    if not isinstance(heads, int) or heads <= 0 or not isinstance(embd, int):
        return
    kv_heads = get("attention.head_count_kv")
    key_len = get("attention.key_length") or embd // heads
    value_len = get("attention.value_length") or embd // heads
    mla_key_len = get("attention.key_length_mla")
    for name in sorted(shapes):
        if not (m := _HEAD_TENSOR.fullmatch(name)):
            continue
        layer, kind, shape = int(m.group(1)), m.group(2), shapes[name]
        layer_kv = kv_heads[layer] if isinstance(kv_heads, list) and layer < len(kv_heads) else kv_heads
        if kind == "attn_k_b":
            want, config_key = heads, "num_attention_heads"
        elif kind in ("attn_q", "attn_q_b"):
            if kind == "attn_q" and layer_kv == 0:      # a layer without attention heads (GLM's KDA layers)
                continue
            want = heads * (mla_key_len or key_len) * (QUERY_FACTOR[arch] if kind == "attn_q" else 1)
            config_key = "num_attention_heads"
        elif isinstance(layer_kv, int) and layer_kv > 0:
            want = layer_kv * (key_len if kind == "attn_k" else value_len)
            config_key = "num_key_value_heads"
        else:
            continue
        if len(shape) >= 2 and shape[0] != want:
            yield Disagreement(name, config_key, f"{want} rows ({heads} attention heads, {layer_kv} key-value heads, "
                                                 f"key length {key_len}) for tensor {name!r}, which has shape "
                                                 f"{list(shape)}")
