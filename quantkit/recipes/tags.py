"""Name tags: the part of a published GGUF file name that says what its recipe does (rules: package docstring)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from ..formats.registry import GGMLType
from .model import SOURCE, Layers, layers_text

if TYPE_CHECKING:
    from .model import Recipe, Rule
    from .resolve import Resolution

#: The label of each class and class group in a name tag.
CLASS_LABELS: Mapping[str, str] = {
    "token_embd": "Embd", "output": "Out", "norm": "Norm", "routed_gate": "Gate", "routed_up": "Up",
    "routed_down": "Down", "shared_expert": "SExp", "dense_ffn": "Dense", "router": "Router", "bias": "Bias",
    "hash_routing": "Hash", "attn_q": "AQ", "attn_kv": "AKV", "attn_output": "AOut", "sinks": "Sinks",
    "compressor": "Comp", "ape": "APE", "indexer": "Idx", "kda_qk": "KDAqk", "kda_v": "KDAv",
    "kda_output": "KDAOut", "kda_gate": "KDAGate", "gdn_qkv": "GDNqkv", "gdn_gate": "GDNGate", "gdn_ab": "GDNab",
    "gdn_output": "GDNOut", "conv": "Conv", "ssm_param": "SSM", "hc": "HC", "ple": "PLE", "ngram_table": "NGram", "engram": "Engram",
    "engram_proj": "EngramProj",
    "mtp": "MTP", "vision": "Vision", "metadata": "Meta", "quant_aux": "QAux",
    # groups
    "routed_experts": "Experts", "attn_proj": "AProj", "kda": "KDA", "gdn": "GDN", "linear_attn": "LinAttn",
    "ffn": "FFN",
}
ROUTED = ("routed_gate", "routed_up", "routed_down")
#: Types that keep a tensor in floating point: choosing them is not a quantization choice, so no fragment.
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
#: Shown for a routed class no rule and no default type covers (such a recipe fails to plan anyway).
UNSET = "Unset"


def type_abbreviation(type_name: str | None) -> str:
    """``Q8_0`` -> ``Q8``, ``Q4_K`` -> ``Q4K``, ``IQ2_XXS`` -> ``IQ2XXS``, ``source`` -> ``Native``."""
    if type_name is None:
        return UNSET
    if type_name == SOURCE:
        return "Native"
    return type_name.removesuffix("_0").replace("_", "")


def _is_expert_rule(r: "Rule") -> bool:
    return r.name is None and r.tag is None and r.classes <= frozenset(ROUTED)


def _covers(outer: Layers | None, inner: Layers | None) -> bool:
    """Whether a rule for layers ``outer`` (None: all) applies to every layer of ``inner`` (None: all)."""
    if outer is None:
        return True
    return inner is not None and all(any(lo <= a and b <= hi for lo, hi in outer) for a, b in inner)


def _expert_types(rules: "list[Rule]", default: str | None, layers: Layers | None) -> tuple[str | None, ...]:
    """The type names that unnamed rules covering ``layers`` (or all layers) give gate, up and down there: the most
    specific rule wins, as in the plan."""
    types = []
    for cls in ROUTED:
        candidates = [r for r in rules if r.name is None and cls in r.classes and _covers(r.layers, layers)]
        if candidates:
            best = max(r.specificity for r in candidates)
            types.append(next(r for r in candidates if r.specificity == best).type_name)
        else:
            types.append(default)
    return tuple(types)


def _experts(types: tuple[str | None, ...], beside_ranges: bool) -> list[str]:
    gate, up, down = (type_abbreviation(t) for t in types)
    if gate == up == down:
        return [f"{gate}Experts"]
    head = [gate] if gate == up else [f"{gate}Gate", f"{up}Up"]
    if beside_ranges:
        if gate == up:
            head = [f"{gate}GateUp"]
        return head + [f"{down}Down"]
    return head + [f"w2{down}"]


def name_tag(recipe: "Recipe", resolution: "Resolution | None" = None) -> str:
    """The file-name tag ``recipe`` implies, e.g. ``IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8``.  With the
    ``resolution`` of a model, the tag of that model's file: only rules (and the default type) that decided at
    least one tensor's type count, so a rule every tensor of which a protection kept in F32 adds nothing."""
    rules = list(recipe.rules)
    default = recipe.defaults.type_name
    if resolution is not None:
        rules = [r for r in rules if resolution.decided.get(r.index, 0) > 0]
        if not resolution.default_decided:
            default = None
    expert_rules = [r for r in rules if _is_expert_rule(r)]
    fragments: list[str] = []
    if not expert_rules:
        if default is not None:
            fragments.append(type_abbreviation(default))
    else:
        ranges: list[Layers] = []
        for r in expert_rules:
            if r.layers is not None and r.layers not in ranges:
                ranges.append(r.layers)
        ranges.sort()
        for layers in ranges:   # each part its range: a part without one claims every layer
            fragments += [f"Layers{layers_text(layers)}{part}"
                          for part in _experts(_expert_types(rules, default, layers), True)]
        others = "-".join(_experts(_expert_types(rules, default, None), bool(ranges)))
        fragments.append(f"OtherExpertLayers{others}" if ranges else others)
    for r in rules:
        if _is_expert_rule(r) or r.tag == "" or r.qtype is None or r.qtype in FLOAT_TYPES:
            continue
        prefix = f"Layers{layers_text(r.layers)}" if r.layers is not None else ""
        fragments.append(f"{prefix}{r.tag or CLASS_LABELS[r.class_name]}{type_abbreviation(r.type_name)}")
    return "-".join(fragments)
