"""The sizes a ``config.json`` declares, checked before anything is sized from them.

Converters, validators and the runtime size tables, loops and whole models from a config's layer, expert and
vocabulary counts; a config is a hand-editable file, so its numbers are untrusted input like a header length.
:func:`check_config_sizes` is the one place they are read and checked, before any allocation:

1. **Type and range.**  Every field of :data:`SIZE_FIELDS` that is present and not null must be an integer (not a
   bool, float or string) between its minimum and its cap.  The caps (``MAX_*``) are far above every released model
   (DeepSeek V3: 61 layers, 256 experts, vocabulary 129,280, hidden 7,168) and far below sizes that exhaust memory.
2. **Against the tensors.**  The declared counts must exist in the checkpoint headers: no more layers than layer
   indices present (``layers.N.`` / ``blk.N.``), no more experts than expert indices present (``experts.N.``) or
   stacked on the leading axis of 3-D expert tensors, no larger vocabulary than the embedding / head rows, and no
   width larger than the largest tensor dimension.  Checks with no matching tensor are skipped (a config alone
   cannot be cross-checked; its caps still hold).
3. **Against each other and the engines' asserts.**  The fields of :data:`NEEDED_FIELDS` may be absent (the
   architecture's default applies) but not null; no more experts used per token than routed experts; key-value
   heads dividing the attention heads (grouped-query attention); the epsilons and rope bases of
   :data:`REAL_FIELDS` finite numbers in range (llama.cpp asserts ``eps >= 0`` when it loads a file).

Nested ``text_config`` objects (vision-language checkpoints) are checked the same way.  The error is a
:class:`~quantkit.errors.SourceError` naming the file and the field.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from ..errors import SourceError
from . import jsontext

#: Most transformer blocks (MTP blocks included) a config may declare.
MAX_LAYERS = 1024
#: Most routed experts per layer.
MAX_EXPERTS = 16384
#: Largest vocabulary (released models: up to ~262k).
MAX_VOCAB = 1 << 22
#: Largest width: hidden, intermediate and head sizes, LoRA ranks.
MAX_WIDTH = 1 << 18
#: Most attention heads.
MAX_HEADS = 1 << 14
#: Longest context (only rotary tables are sized from it, but a larger one is a typo, not a model).
MAX_POSITIONS = 1 << 26

_LAYERS, _EXPERTS, _VOCAB, _WIDTH, _HEADS = "layers", "experts", "vocab", "width", "heads"

#: field -> (minimum, cap, what it counts: which cross-check applies).
SIZE_FIELDS: Mapping[str, tuple[int, int, str | None]] = {
    "num_hidden_layers": (1, MAX_LAYERS, _LAYERS),
    "num_nextn_predict_layers": (0, MAX_LAYERS, None),
    "first_k_dense_replace": (0, MAX_LAYERS, None),
    "num_local_experts": (1, MAX_EXPERTS, _EXPERTS),
    "num_experts": (1, MAX_EXPERTS, _EXPERTS),
    "n_routed_experts": (1, MAX_EXPERTS, _EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS, None),
    "n_shared_experts": (0, MAX_EXPERTS, None),
    "vocab_size": (1, MAX_VOCAB, _VOCAB),
    "hidden_size": (1, MAX_WIDTH, _WIDTH),
    "intermediate_size": (1, MAX_WIDTH, _WIDTH),
    "moe_intermediate_size": (1, MAX_WIDTH, _WIDTH),
    "shared_expert_intermediate_size": (0, MAX_WIDTH, _WIDTH),
    "head_dim": (0, MAX_WIDTH, _WIDTH),    # 0: derived from hidden_size and heads (GLM)
    "q_lora_rank": (1, MAX_WIDTH, _WIDTH),
    "kv_lora_rank": (1, MAX_WIDTH, _WIDTH),
    "qk_nope_head_dim": (0, MAX_WIDTH, _WIDTH),
    "qk_rope_head_dim": (0, MAX_WIDTH, _WIDTH),
    "v_head_dim": (1, MAX_WIDTH, _WIDTH),
    "num_attention_heads": (1, MAX_HEADS, _HEADS),
    "num_key_value_heads": (1, MAX_HEADS, _HEADS),
    "max_position_embeddings": (1, MAX_POSITIONS, None),
}

#: Size fields a model cannot do without: absent means the architecture's default, null is a broken config.
NEEDED_FIELDS = frozenset({"num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
                           "num_experts_per_tok"})
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")

#: Real-valued fields written into the GGUF: field -> (lowest allowed, whether the lowest is allowed itself).
REAL_FIELDS: Mapping[str, tuple[float, bool]] = {
    "rms_norm_eps": (0.0, True), "norm_eps": (0.0, True), "layer_norm_eps": (0.0, True),
    "layer_norm_epsilon": (0.0, True), "norm_epsilon": (0.0, True), "rope_theta": (0.0, False),
    "routed_scaling_factor": (0.0, False),
}

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blk|h)\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_STACKED_EXPERTS = re.compile(r"(experts|_exps)\b")
_EMBEDDING = re.compile(r"(?:^|\.)(embed_tokens|embed|wte|tok_embeddings|token_embd|lm_head|head|output)\.weight$")


def _present(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """What the tensors show of each counted kind (a kind no tensor shows is absent)."""
    found: dict[str, int] = {}

    def at_least(kind: str, value: int) -> None:
        found[kind] = max(found.get(kind, 0), value)

    for name, shape in shapes.items():
        if m := _LAYER_INDEX.search(name):
            at_least(_LAYERS, int(m.group(1)) + 1)
        if m := _EXPERT_INDEX.search(name):
            at_least(_EXPERTS, int(m.group(1)) + 1)
        elif len(shape) == 3 and _STACKED_EXPERTS.search(name):
            at_least(_EXPERTS, int(shape[0]))
        if len(shape) == 2 and _EMBEDDING.search(name):
            at_least(_VOCAB, int(shape[0]))
        if shape:
            at_least(_WIDTH, max(int(d) for d in shape))
    if _WIDTH in found:
        found[_HEADS] = found[_WIDTH]
    return found


_SHOWN_AS = {_LAYERS: "layer indices", _EXPERTS: "experts", _VOCAB: "embedding/output rows",
             _WIDTH: "largest tensor dimension", _HEADS: "largest tensor dimension"}


def check_config_sizes(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]] | None = None, *,
                       path: str | Path | None = None, prefix: str = "") -> None:
    """Raise :class:`SourceError` (naming ``path`` and the field) at the first size field of ``config`` that is
    not an integer in range, or that exceeds what the tensors ``shapes`` (name -> shape) hold (module doc)."""
    present = _present(shapes) if shapes else {}
    for key, (low, cap, kind) in SIZE_FIELDS.items():
        if key in NEEDED_FIELDS and key in config and config[key] is None:
            raise SourceError("is null: the model needs it (leave it out for the architecture's default)",
                              path=path, field=prefix + key)
        if key not in config or config[key] is None:
            continue
        value = config[key]
        field = prefix + key
        if isinstance(value, bool) or not isinstance(value, int):
            raise SourceError(f"expected an integer, found {value!r}", path=path, field=field)
        if not low <= value <= cap:
            raise SourceError(f"{value} is outside {low}..{cap:,}", path=path, field=field)
        if kind is not None and kind in present and value > present[kind]:
            raise SourceError(f"declares {value:,} but the checkpoint's tensors hold {present[kind]:,} "
                              f"({_SHOWN_AS[kind]}): the config does not describe these weights",
                              path=path, field=field)
    _check_related_sizes(config, path, prefix)
    _check_real_fields(config, path, prefix)
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping) and not prefix:
        check_config_sizes(text_config, shapes, path=path, prefix="text_config.")


def _check_related_sizes(config: Mapping[str, Any], path, prefix: str) -> None:
    """Fields that must agree with each other (their types and ranges are checked already)."""
    used = config.get("num_experts_per_tok")
    experts = next((config[k] for k in _EXPERT_COUNTS if config.get(k) is not None), None)
    if used is not None and experts is not None and used > experts:
        raise SourceError(f"{used} experts used per token but the model routes to {experts}",
                          path=path, field=prefix + "num_experts_per_tok")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and (kv_heads > heads or heads % kv_heads):
        raise SourceError(f"{kv_heads} key-value heads do not divide the {heads} attention heads",
                          path=path, field=prefix + "num_key_value_heads")


def _check_real_fields(config: Mapping[str, Any], path, prefix: str) -> None:
    for key, (low, low_allowed) in REAL_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if jsontext.finite(value) is None:
            raise SourceError(f"expected a finite number, found {value!r}", path=path, field=prefix + key)
        if value < low or (value == low and not low_allowed):
            raise SourceError(f"{value!r} is {'below' if low_allowed else 'not above'} {low:g}", path=path,
                              field=prefix + key)
