"""Resolve a recipe against a model's GGUF tensors: skip, candidates, precedence, protected defaults, default type,
row-length fallbacks and lossless source encodings (the rules are the package docstring)."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from ..arch import OutputTensor
from ..errors import RecipeError
from ..formats.registry import GGMLType, get_format
from .model import Defaults, Recipe, Rule

#: Classes kept in F32 unless a rule naming the class says otherwise (routing and recurrence parameters are
#: tiny and quality-sensitive; position biases are added by ggml ops that take no BF16 operand on CPU).
KEEP_F32_CLASSES = frozenset({"router", "norm", "bias", "ssm_param", "sinks", "conv", "ape"})
#: Classes kept in their source precision (llama.cpp's stock mixes quantize them: a measured quality loss).
KEEP_SOURCE_CLASSES = frozenset({"hc", "indexer"})
#: F32 source tensors up to this many values are kept in F32 (biases, gains, scalars; weight matrices are larger).
SMALL_F32_ELEMENTS = 4096

F32, F16, BF16, I32 = GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.I32
#: Source encodings (as :func:`quantkit.convert.plan.source_encoding` names them) stored as a GGUF float type.
FLOAT_ENCODINGS: Mapping[str, GGMLType] = {"F32": F32, "F16": F16, "BF16": BF16}
#: Source encoding -> (GGUF type holding it without loss, how the executor carries it over).
LOSSLESS: Mapping[str, tuple[GGMLType, str]] = {
    "F32": (F32, "copy"),
    "F16": (F16, "copy"),
    "BF16": (BF16, "copy"),
    "fp4-e8m0": (GGMLType.MXFP4, "mxfp4-repack"),
    "nvfp4-modelopt": (GGMLType.NVFP4, "nvfp4-repack"),
    "nvfp4-compressed-tensors": (GGMLType.NVFP4, "nvfp4-repack"),
    "fp8-e8m0-rows": (GGMLType.I8, "fp8-rows"),
}
#: Classes written in their native encoding unless a rule naming the class chooses a type (never requantized
#: by default: the V4.1 Engram tables are disk-only row stores engines read as stored).
KEEP_NATIVE_CLASSES = frozenset({"engram"})
#: Transform steps that change values (the others only slice, permute or reshape; quantkit.arch.transforms).
VALUE_CHANGING_STEPS = frozenset({"plus_one", "neg_exp", "to_int32"})
#: GGUF tensors for which llama.cpp's generic loading pass reads an optional ``<name>.scale`` (llama-model.cpp,
#: "load optional per-tensor/per-expert .scale tensors"): only these can carry NVFP4's global scale.
NVFP4_SCALED = re.compile(r"blk\.\d+\.(attn_(q|k|v|output|qkv|gate)|ffn_(gate|up|down)(_shexp|_exps)?"
                          r"|ssm_(in|out|alpha|beta)|nextn\.(eh_proj|shared_head_head))\.weight")
#: Unclaimed tensors named in one error message.
MAX_NAMED_TENSORS = 8


@dataclass(frozen=True)
class Choice:
    """The type one GGUF tensor gets and why."""

    qtype: GGMLType
    rule: str
    """The deciding rule's label (``rule 3 (line 17)``, ``[defaults] type``, ``default: norm stays F32``)."""
    fallback_from: GGMLType | None = None
    """The rule's type, when the row length made the fallback necessary."""
    lossless: str | None = None
    """``copy``, ``mxfp4-repack``, ``nvfp4-repack`` or ``fp8-rows`` when the GGUF bytes carry the source values
    unchanged."""


@dataclass(frozen=True)
class Resolution:
    choices: dict[str, Choice | None]
    """GGUF name -> choice; None for tensors the recipe skips."""
    unused_rules: tuple[Rule, ...]
    """Rules that decided no tensor (e.g. a layer range beyond a small model, or rules every tensor of which a
    protection or a more specific rule decided)."""
    decided: Mapping[int, int] = field(default_factory=dict)
    """Rule index -> how many tensors the rule decided."""
    default_decided: int = 0
    """How many tensors ``[defaults] type`` decided."""
    passed_over: Mapping[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    """Rule index -> (GGUF name, label of what decided it instead) for each tensor the rule selects but did not
    decide: a protection (``default: norm stays F32``) or a more specific rule."""

    def explain_unused(self, rule: Rule) -> str:
        """Why ``rule`` (one of :attr:`unused_rules`) decided no tensor, for the plan."""
        passed = self.passed_over.get(rule.index, ())
        if not passed:
            return f"{rule.describe()}: matched no tensor of this model"
        by_winner: dict[str, list[str]] = {}
        for name, winner in passed:
            by_winner.setdefault(winner, []).append(name)
        parts = []
        for winner, names in by_winner.items():
            shown = ", ".join(names[:MAX_NAMED_TENSORS]) + (
                f" and {len(names) - MAX_NAMED_TENSORS} more" if len(names) > MAX_NAMED_TENSORS else "")
            parts.append(f"{winner} won for {len(names)} ({shown})")
        return f"{rule.describe()}: selects {len(passed)} tensors, decided none: " + "; ".join(parts)


def _steps(t: OutputTensor) -> set[str]:
    return {s for m in t.sources for s in m.transform}


def _protection(t: OutputTensor, encoding: str) -> tuple[str, GGMLType, str] | None:
    """(kind, type, reason) of a protected tensor: kind ``integer`` (no rule reaches it), ``class`` (reached by
    rules of its class) or ``shape`` (reached by rules with a name regex)."""
    cls = t.tensor_class
    if t.dtype == "int32":
        return "integer", I32, "default: integer table stays I32"
    if cls in KEEP_F32_CLASSES:
        return "class", F32, f"default: {cls} stays F32"
    if cls in KEEP_NATIVE_CLASSES:
        return "class", None, f"default: {cls} keeps its native encoding"
    if len(t.shape) == 1:
        return ("class" if cls in KEEP_SOURCE_CLASSES else "shape"), F32, "default: 1-D tensor stays F32"
    if cls in KEEP_SOURCE_CLASSES:
        qtype = FLOAT_ENCODINGS.get(encoding, F32)
        return "class", qtype, f"default: {cls} keeps its source precision ({qtype.name})"
    if encoding == "F32" and int(np.prod(t.shape)) <= SMALL_F32_ELEMENTS:
        return "shape", F32, f"default: small F32 tensor (<= {SMALL_F32_ELEMENTS} values) stays F32"
    return None


def _reaches(rule: Rule, kind: str | None) -> bool:
    """Whether a rule that selects a tensor may decide it.  A rule selecting a class-protected tensor names its
    class (no class group holds a protected class), so only shape-protected tensors need a name regex."""
    return kind in (None, "class") or (kind == "shape" and rule.name is not None)


def _error(recipe: Recipe, t: OutputTensor, message: str) -> RecipeError:
    return RecipeError(message, path=recipe.where(), tensor=t.gguf_name)


def _winner(recipe: Recipe, t: OutputTensor, candidates: list[Rule]) -> Rule:
    best = max(r.specificity for r in candidates)
    top = [r for r in candidates if r.specificity == best]
    for other in top[1:]:
        if (other.qtype, other.fallback) != (top[0].qtype, top[0].fallback):
            raise _error(recipe, t, f"{top[0].describe()} and {other.describe()} are equally specific and both "
                                    f"select this tensor with different types; narrow one (layers, name) or merge "
                                    f"them")
    return top[0]


def _apply(recipe: Recipe, t: OutputTensor, qtype: GGMLType | None, fallback: GGMLType | None, label: str,
           encoding: str) -> Choice:
    """The final type for ``t`` under a rule giving ``qtype`` (None: the source encoding) and ``fallback``."""
    steps = _steps(t)
    kept = None
    if qtype is None:
        if encoding not in LOSSLESS:
            raise _error(recipe, t, f"{label} keeps the source encoding, but {encoding} sources have no lossless "
                                    f"GGUF type (lossless: {', '.join(LOSSLESS)})")
        qtype, kept = LOSSLESS[encoding]
        blocking = steps & VALUE_CHANGING_STEPS if kept == "copy" else steps
        if blocking:
            raise _error(recipe, t, f"{label} keeps the source encoding, but the architecture map transforms this "
                                    f"tensor ({', '.join(sorted(blocking))}) on the way")
        if kept == "nvfp4-repack" and not NVFP4_SCALED.fullmatch(t.gguf_name):
            raise _error(recipe, t, f"{label} keeps NVFP4, but llama.cpp loads no '.scale' (NVFP4 global scale) "
                                    f"for this tensor; choose a type")
    block = get_format(qtype).block_size
    if len(t.shape) == 1 and block > 1:
        raise _error(recipe, t, f"{label} gives a 1-D tensor the block type {qtype.name}; 1-D tensors only take "
                                f"float types (narrow the rule with name)")
    row = int(t.shape[-1])
    final, fallback_from = qtype, None
    if row % block:
        if fallback is None:
            raise _error(recipe, t, f"row length {row} is not a multiple of {qtype.name}'s block size {block} and "
                                    f"{label} gives no fallback: add fallback = \"<type>\" with a block that "
                                    f"divides {row}")
        fb_block = get_format(fallback).block_size
        if row % fb_block:
            raise _error(recipe, t, f"row length {row} fits neither {qtype.name} (block {block}) nor {label}'s "
                                    f"fallback {fallback.name} (block {fb_block})")
        final, fallback_from, kept = fallback, qtype, None
    if kept is None and FLOAT_ENCODINGS.get(encoding) == final and not steps & VALUE_CHANGING_STEPS:
        kept = "copy"
    return Choice(final, label, fallback_from, kept)


def _choose(recipe: Recipe, t: OutputTensor, encoding: str, selecting: list[Rule]
            ) -> tuple[Choice | None, Rule | Defaults | None]:
    """The choice for ``t`` and what decided it: a rule, the defaults, or None (a protection, or unclaimed)."""
    protection = _protection(t, encoding)
    kind = protection[0] if protection else None
    candidates = [r for r in selecting if _reaches(r, kind)]
    if candidates:
        rule = _winner(recipe, t, candidates)
        return _apply(recipe, t, rule.qtype, rule.fallback, rule.label, encoding), rule
    if protection is not None:
        return _apply(recipe, t, protection[1], None, protection[2], encoding), None
    if recipe.defaults.given:
        d = recipe.defaults
        return _apply(recipe, t, d.qtype, d.fallback, d.label, encoding), d
    return None, None


def resolve(recipe: Recipe, outputs: Iterable[OutputTensor], encodings: Mapping[str, str]) -> Resolution:
    """Choose the type of every tensor in ``outputs``; ``encodings`` maps each GGUF name to its source encoding
    (``F32``, ``BF16``, ``fp8-block``, ``fp4-e8m0``, ``nvfp4-modelopt``, ..., ``int``, ``mixed``)."""
    skipped = recipe.skipped_classes
    choices: dict[str, Choice | None] = {}
    decided: Counter[int] = Counter()
    default_decided = 0
    passed_over: dict[int, list[tuple[str, str]]] = {}
    unclaimed: list[OutputTensor] = []
    for t in outputs:
        if t.tensor_class in skipped:
            choices[t.gguf_name] = None
            continue
        selecting = [r for r in recipe.rules if r.selects(t.tensor_class, t.layer, t.gguf_name)]
        choice, decider = _choose(recipe, t, encodings[t.gguf_name], selecting)
        if choice is None:
            unclaimed.append(t)
            continue
        choices[t.gguf_name] = choice
        if isinstance(decider, Rule):
            decided[decider.index] += 1
        elif isinstance(decider, Defaults):
            default_decided += 1
        for other in selecting:
            if other is not decider:
                passed_over.setdefault(other.index, []).append((t.gguf_name, choice.rule))
    if unclaimed:
        named = ", ".join(f"{t.gguf_name} ({t.tensor_class})" for t in unclaimed[:MAX_NAMED_TENSORS])
        more = f" and {len(unclaimed) - MAX_NAMED_TENSORS} more" if len(unclaimed) > MAX_NAMED_TENSORS else ""
        classes = ", ".join(sorted({t.tensor_class for t in unclaimed}))
        raise RecipeError(f"{len(unclaimed)} tensors are claimed by no rule and the recipe has no [defaults] type: "
                          f"{named}{more}; add rules for classes {classes}, a [defaults] type, or skip them",
                          path=recipe.where())
    return Resolution(choices, tuple(r for r in recipe.rules if r.index not in decided), dict(decided),
                      default_decided, {i: tuple(p) for i, p in passed_over.items()})
