"""Swapset families: which tensors of a checkpoint a sidecar replaces (tables, not logic).

A family is named per architecture and selects **linear weights** (stored 2-D ``[out, in]`` matrices, or fused
3-D ``[experts, out, in]`` stacks) by the tensor classes of :mod:`quantkit.arch`:

- ``classes``: the tensor classes it covers (a tensor that feeds several GGUF targets is in the family when any
  target's class is);
- ``include`` / ``exclude``: optional regexes searched in the *module* name (the canonical tensor name without
  ``.weight`` / ``.weight_packed``; a fused 3-D stack stored without a suffix, transformers' ``mlp.experts.
  gate_up_proj``, is its own module), to pick some members of a class (MLA ``q_a`` / ``kv_a`` but not ``q_b``);
- ``scope``: ``"main"`` covers the main model (tensors of no layer, and blocks below ``num_hidden_layers``);
  ``"mtp"`` covers only the multi-token-prediction block (class ``mtp``, or a block index past
  ``num_hidden_layers``).  So an MLA sidecar never touches the MTP block's attention and an MTP sidecar never
  touches the main model: two families of one architecture overlap only when their classes do;
- ``optional``: sidecars of the family are opt-in by default (``swapset status`` calls them optional rather
  than required when no record says otherwise).

1-D tensors (norms, biases), routers, convolutions and embeddings are never family members: a family whose
classes contain them (``mtp``) still selects only linear weights, and ``exclude`` names the 2-D non-linear
tensors of such classes (embedding tables, routers, indexer head weights).

:data:`FUSED_GROUPS` names the weights engines run as one matmul (q/k/v, gate/up, per-expert w1/w3, MLA
q_a/kv_a, GDN in_proj qkv/z): NVFP4 gives every member of a group one shared global scale.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

#: Tensor classes whose 2-D/3-D weights are linear layers a sidecar may re-encode.
LINEAR_CLASSES = frozenset({
    "output", "attn_q", "attn_kv", "attn_output", "compressor", "indexer", "kda_qk", "kda_v", "kda_output",
    "kda_gate", "gdn_qkv", "gdn_gate", "gdn_output", "dense_ffn", "shared_expert", "routed_gate", "routed_up",
    "routed_down", "ple", "mtp",
})
ROUTED = frozenset({"routed_gate", "routed_up", "routed_down"})
ATTENTION = frozenset({"attn_q", "attn_kv", "attn_output"})
#: Module names (in the MTP block) that are not linear layers although their class is: embeddings, norms,
#: routers (``...gate``), indexer head weights, hyper-connections, compressor position biases.
_MTP_NON_LINEAR = r"(embed|\bemb\b|norm|\.gate$|weights_proj|hc_|\.ape$|compress)"


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    classes: frozenset[str]
    include: str | None = None
    exclude: str | None = None
    scope: str = "main"
    optional: bool = False
    include_re: re.Pattern | None = field(init=False, repr=False, compare=False)
    exclude_re: re.Pattern | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "include_re", re.compile(self.include) if self.include else None)
        object.__setattr__(self, "exclude_re", re.compile(self.exclude) if self.exclude else None)

    def admits(self, module: str, classes: frozenset[str], mtp: bool) -> bool:
        """Whether a linear weight of ``module`` with ``classes`` (in the MTP block or not) is a member."""
        if mtp != (self.scope == "mtp") or not classes & self.classes:
            return False
        if self.include_re is not None and not self.include_re.search(module):
            return False
        return self.exclude_re is None or not self.exclude_re.search(module)


def _families(*families: Family) -> Mapping[str, Family]:
    return {f.name: f for f in families}


_LMHEAD = Family("lmhead", "output head (lm_head)", frozenset({"output"}))
_EXPERTS = Family("experts", "routed experts' gate/up/down projections", ROUTED)
_SHARED = Family("shared", "shared experts' gate/up/down projections", frozenset({"shared_expert"}), optional=True)
_DENSE = Family("dense", "dense (non-MoE) layers' gate/up/down projections", frozenset({"dense_ffn"}))
_ATTN = Family("attn", "attention q/k/v/output projections", ATTENTION)
_MTP = Family("mtp", "the multi-token-prediction (NextN) block's linear weights", LINEAR_CLASSES,
              exclude=_MTP_NON_LINEAR, scope="mtp", optional=True)

#: model_type -> family name -> family.
FAMILIES: Mapping[str, Mapping[str, Family]] = {
    "glm5_next": _families(
        Family("inproj", "KDA linear attention q/k/v input projections (in_proj)", frozenset({"kda_qk", "kda_v"})),
        Family("mla", "MLA q_a / kv_a projections and the indexer wq_b", frozenset({"attn_q", "attn_kv", "indexer"}),
               include=r"\.(q_a_proj|kv_a_proj_with_mqa|indexer\.wq_b)$"),
        _SHARED, _DENSE, _EXPERTS, _LMHEAD, _MTP,
    ),
    "deepseek_v4": _families(
        Family("mla", "attention q_a / kv projections and the indexer wq_b",
               frozenset({"attn_q", "attn_kv", "indexer"}),
               include=r"\.(attn\.wq_a|self_attn\.q_a_proj|attn\.wkv|self_attn\.kv_proj|attn\.indexer\.wq_b"
                       r"|self_attn\.compressor\.indexer\.q_b_proj)$"),
        _ATTN, _SHARED, _EXPERTS, _LMHEAD, _MTP,
    ),
    "deepseek_v3": _families(
        Family("mla", "MLA q_a / kv_a projections", frozenset({"attn_q", "attn_kv"}),
               include=r"\.(q_a_proj|kv_a_proj_with_mqa)$"),
        _ATTN, _SHARED, _DENSE, _EXPERTS, _LMHEAD, _MTP,
    ),
    "qwen4_exp": _families(
        Family("inproj", "gated delta net in_proj_qkv and in_proj_z", frozenset({"gdn_qkv", "gdn_gate"})),
        _ATTN, _SHARED, _EXPERTS, _LMHEAD, _MTP,
    ),
    "qwen3_moe": _families(_ATTN, _EXPERTS, _LMHEAD),
}

#: (regex on the module name, replacement) -> the fused group a module belongs to; first match wins; a module
#: matching none is its own group.
FUSED_GROUPS: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"^(.*)\.(q_proj|k_proj|v_proj)$", r"\1.qkv_proj"),
    (r"^(.*)\.(gate_proj|up_proj)$", r"\1.gate_up_proj"),
    (r"^(.*)\.(w1|w3)$", r"\1.w13"),
    (r"^(.*)\.(in_proj_qkv|in_proj_z)$", r"\1.in_proj_qkvz"),
    (r"^(.*)\.(q_a_proj|kv_a_proj_with_mqa|kv_proj)$", r"\1.fused_qkv_a_proj"),
    (r"^(.*)\.attn\.(wq_a|wkv)$", r"\1.attn.wqkv_a"),
))


def fused_group(module: str) -> str:
    """The fused group ``module`` belongs to (itself when it is not fused with anything)."""
    for pattern, replacement in FUSED_GROUPS:
        if pattern.match(module):
            return pattern.sub(replacement, module)
    return module
