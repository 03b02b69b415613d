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
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

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


def _value(kv: KV) -> int | None:
    """An integer key's value, a string array's length (the vocabulary); None for per-layer arrays."""
    if isinstance(kv.value, list):
        return len(kv.value)
    return kv.value if isinstance(kv.value, int) and not isinstance(kv.value, bool) else None


def check_config_against_tensors(metadata: Iterable[tuple[str, KV]], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`SourceError` naming the config key, the tensor and both values at the first disagreement."""
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
                raise SourceError(f"config.json gives {value} ({key}) but tensor {name!r} has shape {list(shape)}: "
                                  f"the config does not describe these weights", field=config_key, tensor=name)
