"""Per-architecture tables: Hugging Face tensor name -> GGUF tensor name, tensor class, layer/expert index,
transform; and the GGUF metadata llama.cpp's converter writes for the architecture.

Usage::

    amap = get_arch("deepseek_v4").bind(config)      # normalizes and checks config.json (SourceError names the key)
    amap.resolve("layers.3.ffn.experts.7.w1.weight")
    # (TensorMapping(gguf_name='blk.3.ffn_gate_exps.weight', tensor_class='routed_gate', layer=3, expert=7, ...),)
    plan = amap.outputs(source_shapes)                 # every GGUF tensor: name, class, shape, its sources
    array = amap.assemble(plan[0], load)               # one GGUF tensor from decoded source arrays
    entries = amap.metadata(tokenizer_dir, pre_tokenizer="deepseek-v3")   # [(key, KV(value, type)), ...]

:func:`get_arch` knows the architectures listed in :data:`ARCHITECTURES` (explicitly, no registration by import).
The machinery is in :mod:`quantkit.arch.base`, the transform steps in :mod:`quantkit.arch.transforms`, the
tokenizer keys in :mod:`quantkit.arch.tokenizer`.
"""
from __future__ import annotations

from typing import Mapping

from ..errors import UnsupportedError
from . import deepseek_v3, deepseek_v4, deepseek_v41, glm5_next, qwen3_moe, qwen4_exp
from .base import (CLASS_GROUPS, ROW_TABLE_CLASSES, SUPPORT_KINDS, TENSOR_CLASSES, Arch, ArchMap, OutputTensor,
                   TensorMapping)

#: model_type -> architecture, for every architecture quantkit converts.
ARCHITECTURES: Mapping[str, Arch] = {
    module.ARCH.model_type: module.ARCH
    for module in (deepseek_v4, deepseek_v41, glm5_next, qwen4_exp, qwen3_moe, deepseek_v3)
}


def get_arch(model_type: str) -> Arch:
    """The architecture for a config's ``model_type``."""
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedError(f"no architecture map for model_type {model_type!r}; known: "
                               f"{', '.join(sorted(ARCHITECTURES))}", field="model_type") from None


__all__ = ["ARCHITECTURES", "CLASS_GROUPS", "ROW_TABLE_CLASSES", "SUPPORT_KINDS", "TENSOR_CLASSES", "Arch", "ArchMap",
           "OutputTensor", "TensorMapping", "get_arch"]
