"""The machinery behind the architecture tables: rules, mappings, output plans and GGUF metadata entries.

An architecture module (``deepseek_v4``, ``glm5_next``, ...) is data: an :class:`Arch` whose ``rules`` map
Hugging Face tensor names to GGUF tensor names, a tensor class and the transform steps of
:mod:`quantkit.arch.transforms`, plus the functions that normalize its ``config.json``, check its constraints and
derive its GGUF metadata.  This module interprets those tables.

Name resolution (:meth:`ArchMap.resolve`)
    1. ``aliases`` (regex, replacement) rewrite layout variants onto the names the rules are written for (e.g. the
       ``model.language_model.`` prefix of vision-language checkpoints, or transformers' renamed DeepSeek V4 keys).
    2. The first rule whose pattern matches the whole name, and whose ``when`` condition holds, claims it.
       Patterns are literal names with placeholders: ``{L}`` layer, ``{E}`` expert, ``{S}`` shard, ``{*}`` anything.
    3. A name no rule claims may be a quantization companion of a claimed weight (``.scale``,
       ``.weight_scale_inv``, NVFP4 scales, ...): it resolves like its weight, with ``role`` naming the companion.
    4. Anything else is a :class:`~quantkit.errors.SourceError`.

A rule has zero or more targets.  Zero targets means the tensor is claimed but not written (vision towers, MTP
blocks llama.cpp does not load, hash constants that become metadata); the rule says why.  Several targets mean one
source tensor feeds several GGUF tensors (MLA ``kv_b`` -> ``attn_k_b`` and ``attn_v_b``; a fused 3-D ``gate_up``
-> ``ffn_gate_exps`` and ``ffn_up_exps``), each with its own transform.

A GGUF tensor is built from one source, or from one source per expert (stacked on a new leading axis, expert
order), or from one source per shard (concatenated along rows, shard order): :meth:`ArchMap.outputs` groups,
checks and sizes them; :meth:`ArchMap.assemble` builds one.

Metadata entries are ``(key, KV(value, type))`` pairs with the types of :mod:`quantkit.io.gguf`.  A key set twice
keeps its first position and takes the last value, as gguf-py's writer does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from gguf.constants import GGUFValueType

from ..errors import QuantkitError, SourceError
from ..io import jsontext
from ..io.gguf import KV, ArrayOf
from . import transforms

Shape = tuple[int, ...]
Hparams = dict[str, Any]

#: Support (drafter) files ``convert --support`` writes (a recipe's ``support``).
SUPPORT_KINDS = ("mtp", "dspark")

#: Every tensor class a rule may name, with what it covers.  Recipes select tensors by these names.
TENSOR_CLASSES: Mapping[str, str] = {
    "token_embd": "input token embedding table",
    "output": "output head (lm_head)",
    "norm": "RMS/layer norm weights and biases",
    "routed_gate": "routed experts' gate projection (w1), stacked [experts, ff, embd]",
    "routed_up": "routed experts' up projection (w3), stacked [experts, ff, embd]",
    "routed_down": "routed experts' down projection (w2), stacked [experts, embd, ff]",
    "shared_expert": "shared experts' gate/up/down projections",
    "dense_ffn": "dense (non-MoE) layers' gate/up/down projections",
    "router": "expert router (gate) weights and the shared-expert gate",
    "bias": "expert score-correction (routing) biases and projection biases",
    "hash_routing": "token id -> expert id tables of hash-routed layers (I32)",
    "attn_q": "attention query projections (q, q_a, q_b)",
    "attn_kv": "attention key/value projections (k, v, kv_a, k_b, v_b, wkv)",
    "attn_output": "attention output projections (o, wo_a, wo_b)",
    "sinks": "attention sink logits",
    "compressor": "compressed-attention key/value and gate projections",
    "ape": "learned absolute position biases of compressors and k-pools",
    "indexer": "sparse-attention indexer projections",
    "kda_qk": "KDA linear attention q and k projections",
    "kda_v": "KDA linear attention v projection",
    "kda_output": "KDA linear attention output projection",
    "kda_gate": "KDA forget/output gate low-rank projections and beta projection",
    "gdn_qkv": "gated delta net fused q/k/v input projection",
    "gdn_gate": "gated delta net output gate (z) projection",
    "gdn_ab": "gated delta net alpha/beta projections",
    "gdn_output": "gated delta net output projection",
    "conv": "short (causal) convolution kernels",
    "ssm_param": "recurrent decay parameters (A, dt bias)",
    "hc": "hyper-connection (mHC) mixing weights, biases, scales and norms",
    "ple": "per-layer n-gram embedding key/value projections",
    "ngram_table": "per-layer n-gram (PLE) embedding table",
    "engram": "Engram hashed n-gram table (DeepSeek V4.1): FP8 E4M3 rows with E8M0 scales, a native row store",
    "engram_proj": "Engram value/key projection (wkv)",
    "mtp": "multi-token-prediction (NextN) block tensors",
    "vision": "vision tower and projector (not part of the text GGUF)",
    "metadata": "tensors whose values are written as GGUF metadata",
    "quant_aux": "quantization side tensors no GGUF tensor needs (kv-cache scales)",
}

#: Names recipes may use for several classes at once.
CLASS_GROUPS: Mapping[str, frozenset[str]] = {
    "routed_experts": frozenset({"routed_gate", "routed_up", "routed_down"}),
    "attn_proj": frozenset({"attn_q", "attn_kv", "attn_output"}),
    "kda": frozenset({"kda_qk", "kda_v", "kda_output", "kda_gate"}),
    "gdn": frozenset({"gdn_qkv", "gdn_gate", "gdn_ab", "gdn_output"}),
    "linear_attn": frozenset({"kda_qk", "kda_v", "kda_output", "kda_gate",
                              "gdn_qkv", "gdn_gate", "gdn_ab", "gdn_output"}),
    "ffn": frozenset({"dense_ffn", "shared_expert", "routed_gate", "routed_up", "routed_down"}),
}

#: Row tables: looked up by row (hashed n-grams -> rows), never multiplied whole; engines keep them on disk and read
#: the rows a token needs, so plans and reports count them apart from the resident weights.
ROW_TABLE_CLASSES = frozenset({"ngram_table", "engram"})

#: Quantization companions: (suffix, suffix of the weight it belongs to, role).  Tried only for names no rule
#: claims, longest suffix first.  The two NVFP4 global-scale conventions get different roles on purpose: ModelOpt's
#: ``weight_scale_2`` multiplies, compressed-tensors' ``weight_global_scale`` divides.
COMPANIONS: tuple[tuple[str, str, str], ...] = (
    (".weight_global_scale", ".weight", "global_scale_divisor"),
    (".input_global_scale", ".weight", "input_scale_divisor"),
    (".weight_scale_inv", ".weight", "block_scale"),
    (".weight_scale_2", ".weight", "global_scale"),
    (".weight_packed", ".weight", "weight"),          # compressed-tensors names the packed weight itself so
    (".weight_shape", ".weight", "packed_shape"),
    (".weight_scale", ".weight", "block_scale"),
    (".input_scale", ".weight", "input_scale"),
    (".scale", ".weight", "block_scale"),
)

_PLACEHOLDERS = {"{L}": r"(?P<layer>\d+)", "{E}": r"(?P<expert>\d+)", "{S}": r"(?P<shard>\d+)",
                 "{M}": r"(?P<mtp>\d+)", "{*}": r".+"}
_PLACEHOLDER_SPLIT = re.compile(r"(\{L\}|\{E\}|\{S\}|\{M\}|\{\*\})")


def compile_pattern(pattern: str) -> re.Pattern:
    """A literal tensor-name template with placeholders -> an anchored regex."""
    parts = _PLACEHOLDER_SPLIT.split(pattern)
    return re.compile("".join(_PLACEHOLDERS.get(p, re.escape(p)) for p in parts))


@dataclass(frozen=True)
class Target:
    """One GGUF tensor a source feeds: name template (``{layer}``), class and transform steps."""

    gguf: str
    tensor_class: str
    steps: tuple[str, ...] = ()
    part: int | None = None
    """Column part: sources with parts 0, 1, ... of one GGUF tensor are concatenated along the row (columns)."""


@dataclass(frozen=True)
class Rule:
    """Source names matching ``pattern`` (and ``when``) feed ``targets``; no targets: claimed, not written."""

    pattern: str
    targets: tuple[Target, ...]
    tensor_class: str
    when: str | None = None
    dropped: str | None = None
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # a malformed table is a bug in quantkit, reported when the architecture module is imported
        if self.tensor_class not in TENSOR_CLASSES:
            raise QuantkitError(f"rule {self.pattern!r}: unknown tensor class {self.tensor_class!r}")
        for target in self.targets:
            if target.tensor_class not in TENSOR_CLASSES:
                raise QuantkitError(f"rule {self.pattern!r}: unknown tensor class {target.tensor_class!r}")
            for step in target.steps:
                transforms.get_step(step)
        if bool(self.targets) == bool(self.dropped):
            raise QuantkitError(f"rule {self.pattern!r}: give targets or a drop reason, not both")
        object.__setattr__(self, "regex", compile_pattern(self.pattern))


def rule(pattern: str, gguf: str, tensor_class: str, *steps: str, when: str | None = None) -> Rule:
    """One source -> one GGUF tensor."""
    return Rule(pattern, (Target(gguf, tensor_class, tuple(steps)),), tensor_class, when)


def column_part(pattern: str, gguf: str, tensor_class: str, part: int) -> Rule:
    """One source -> columns ``part`` of a GGUF tensor built from several sources side by side (DeepSeek V4's MTP
    ``e_proj`` and ``h_proj`` -> ``nextn.eh_proj``, as llama.cpp's converter concatenates them)."""
    return Rule(pattern, (Target(gguf, tensor_class, (), part),), tensor_class)


def split(pattern: str, *targets: Target, when: str | None = None) -> Rule:
    """One source -> several GGUF tensors, each with its own transform."""
    return Rule(pattern, tuple(targets), targets[0].tensor_class, when)


def drop(pattern: str, tensor_class: str, reason: str, when: str | None = None) -> Rule:
    """A source tensor that is claimed but not written, and why."""
    return Rule(pattern, (), tensor_class, when, reason)


#: Tensors llama.cpp's converter discards for every architecture (buffers recomputed at load).
COMMON_DROPS: tuple[Rule, ...] = (
    drop("{*}.rotary_emb.inv_freq", "metadata", "recomputed from the rope metadata"),
    drop("{*}.attention.masked_bias", "metadata", "attention mask buffer"),
    drop("{*}.k_scale", "quant_aux", "kv-cache quantization scale, unused in GGUF"),
    drop("{*}.v_scale", "quant_aux", "kv-cache quantization scale, unused in GGUF"),
)


@dataclass(frozen=True)
class TensorMapping:
    """Where one source tensor goes: a GGUF tensor (``gguf_name`` None: claimed but not written)."""

    hf_name: str
    gguf_name: str | None
    tensor_class: str
    layer: int | None
    expert: int | None
    shard: int | None
    transform: tuple[str, ...]
    part: int | None = None
    """Column part of a GGUF tensor assembled side by side (:func:`column_part`)."""
    role: str = "weight"
    """``weight``, or the companion role (``block_scale``, ``global_scale``, ...) decoded together with it."""
    dropped: str | None = None
    """Why a claimed tensor is not written."""


@dataclass(frozen=True)
class OutputTensor:
    """One GGUF tensor of the plan: name, class, numpy-order shape, dtype and the sources that build it."""

    gguf_name: str
    tensor_class: str
    layer: int | None
    shape: Shape
    dtype: str
    sources: tuple[TensorMapping, ...]
    """One mapping, or one per expert (expert order), or one per shard (shard order), or one per column part."""
    assembly: str
    """``single``, ``stack_experts``, ``concat_shards`` or ``concat_columns``."""


Condition = Callable[[Hparams, Mapping[str, int]], bool]


@dataclass(frozen=True)
class InputGroups:
    """A 2-D GGUF weight that llama.cpp multiplies as several matrices, each with its own slice of the input
    (DeepSeek V4's ``attn_output_a``: loaded ``[group_dim, rank, groups]``, one group of heads per matrix).

    Its importance is one vector of the row length, the statistics of every group pooled (what quantkit collects
    and llama-quantize checks the length of); ``llama-imatrix`` stores the groups side by side instead (``groups``
    times the row length, one count per group's tokens), which :meth:`quantkit.imatrix.Imatrix.conform` folds.
    """

    gguf: str
    """GGUF name template (``{L}`` for the block index)."""
    hparam: str
    """Hyperparameter holding the number of groups."""
    gguf_key: str
    """GGUF metadata key holding it in a model file (``{arch}`` for the architecture name)."""
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", compile_pattern(self.gguf))


@dataclass(frozen=True)
class Arch:
    """One architecture's tables and functions; :meth:`bind` a config to use them."""

    model_type: str
    gguf_arch: str
    rules: tuple[Rule, ...]
    normalize: Callable[[Mapping[str, Any]], Hparams]
    """config.json (as a dict) -> hyperparameters with transformers' defaults and the derived keys."""
    check: Callable[[Hparams], None]
    """Raise SourceError naming the config key when llama.cpp cannot run this configuration."""
    metadata: Callable[["MetadataBuilder", Hparams, "MetadataInputs"], None]
    block_count: Callable[[Hparams], int]
    expert_count: Callable[[Hparams], int]
    aliases: tuple[tuple[str, str], ...] = ()
    conditions: Mapping[str, Condition] = field(default_factory=dict)
    special_token_fallbacks: tuple[tuple[str, str], ...] = ()
    """(type, token content) set from the tokenizer's added tokens when the tokenizer files leave them unset."""
    shard_count_key: str | None = None
    """Hyperparameter giving how many shards a sharded source tensor has."""
    default_chat_template: Callable[[str], str] | None = None
    """Checkpoint directory name -> the chat template llama.cpp's converter writes when the tokenizer files carry
    none (None: it writes none)."""
    input_groups: tuple[InputGroups, ...] = ()
    """Weights llama.cpp multiplies as several matrices of input slices (see :class:`InputGroups`)."""
    support_rules: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)
    """Support file kind (``mtp``) -> rules tried before the others when writing that file, for a map whose
    default rules drop those blocks: their blocks (placeholder ``{M}``) follow the main ones, and the file's
    metadata counts them (block count, ``nextn_predict_layers``), as llama.cpp's converter writes its ``--mtp``
    export."""
    support_archs: Mapping[str, "Arch"] = field(default_factory=dict)
    """Support file kind -> the map of a support file that is a GGUF architecture of its own (DeepSeek V4's DSpark
    drafter: llama.cpp's ``dflash``), bound to the same config by :meth:`bind`."""
    mtp_applies: Callable[[Hparams], bool] = lambda hp: True
    """Whether :attr:`mtp_rules` and :attr:`support_rules` describe this checkpoint's ``mtp.*`` tensors (False:
    they hold something else, e.g. DeepSeek V4 DSpark's draft stages, and the default rules drop them)."""
    mtp_rules: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)
    """GGUF dialect -> rules tried before the others when a main file keeps the MTP blocks its default rules drop
    (``convert`` unless the recipe skips class ``mtp``), under the names that dialect's engine loads them by.
    Blocks named ``blk.{layer}`` are counted as :attr:`support_rules`' are; others (``{mtp}``: the MTP block's
    own index) are not blocks of the file, though their tensors keep the block index ``num_hidden_layers + K``
    (recipe ``layers``)."""

    def group_counts(self, names: Iterable[str], count: Callable[[InputGroups], int]) -> dict[str, int]:
        """Number of input groups of each of ``names`` that has more than one; ``count`` reads a declaration's
        number (from a config's hyperparameters or a GGUF file's metadata)."""
        out = {}
        for declared in self.input_groups:
            matched = [n for n in names if declared.regex.fullmatch(n)]
            groups = count(declared) if matched else 1
            if groups > 1:
                out.update(dict.fromkeys(matched, groups))
        return out

    def bind(self, config: Mapping[str, Any], support: str | None = None, mtp_dialect: str | None = None
             ) -> "ArchMap":
        """Normalize and check ``config``; the result resolves names and derives metadata (of the ``support``
        file of that kind, when given: :attr:`support_rules`; of a main file keeping the MTP blocks under
        ``mtp_dialect``'s names, when given: :attr:`mtp_rules`)."""
        model_type = config.get("model_type")
        if model_type != self.model_type:
            raise SourceError(f"config is for model_type {model_type!r}, this map is for {self.model_type!r}",
                              field="model_type")
        if support in self.support_archs:
            return self.support_archs[support].bind(config)
        hp = self.normalize(config)
        self.check(hp)
        return ArchMap(self, hp, config, support, mtp_dialect)


@dataclass(frozen=True)
class MetadataInputs:
    """What metadata needs besides the config."""

    tensor_values: Callable[[str], np.ndarray] | None = None
    """Reads a source tensor by HF name (values some architectures store as metadata)."""
    tensor_shapes: Mapping[str, Shape] | None = None
    """Source tensor shapes by HF name (decoded, numpy order)."""
    tokenizer_dir: Path | None = None
    """The checkpoint directory holding the tokenizer files (metadata derived from the tokenizer: Engram)."""


class MetadataBuilder:
    """Ordered GGUF metadata; ``{arch}`` in keys is the GGUF architecture name."""

    def __init__(self, arch: str):
        self.arch = arch
        self.entries: dict[str, KV] = {}

    def put(self, key: str, value: Any, vtype: GGUFValueType | ArrayOf) -> None:
        self.entries[key.format(arch=self.arch)] = KV(value, vtype)

    def u32(self, key: str, value: int) -> None:
        self.put(key, _as_int(value, key.format(arch=self.arch)), GGUFValueType.UINT32)

    def f32(self, key: str, value: float) -> None:
        self.put(key, _as_real(value, key.format(arch=self.arch)), GGUFValueType.FLOAT32)

    def boolean(self, key: str, value: bool) -> None:
        self.put(key, bool(value), GGUFValueType.BOOL)

    def string(self, key: str, value: str) -> None:
        self.put(key, str(value), GGUFValueType.STRING)

    def array(self, key: str, values: Sequence[Any], item: GGUFValueType) -> None:
        if len(values) == 0:
            return  # gguf-py writes no key for an empty array
        self.put(key, list(values), ArrayOf(item))

    def u32_or_array(self, key: str, value: int | Sequence[int]) -> None:
        """gguf-py's ``add_head_count`` & co.: an int is UINT32, a per-layer list an INT32 array."""
        if isinstance(value, (list, tuple)):
            self.array(key, [_as_int(v, key.format(arch=self.arch)) for v in value], GGUFValueType.INT32)
        else:
            self.u32(key, value)

    def items(self) -> list[tuple[str, KV]]:
        return list(self.entries.items())


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SourceError(f"expected an integer, found {value!r}", field=key)
    return int(value)


def _as_real(value: Any, key: str) -> float:
    """A config value written as FLOAT32: a finite number (a NaN or a string in a config.json is not one)."""
    number = jsontext.finite(value)
    if number is None:
        raise SourceError(f"expected a finite number, found {value!r}", field=key)
    return number


class ArchMap:
    """An :class:`Arch` bound to one normalized config."""

    def __init__(self, arch: Arch, hp: Hparams, config: Mapping[str, Any], support: str | None = None,
                 mtp_dialect: str | None = None):
        self.arch = arch
        self.hp = hp
        self.config = config
        self.block_count = arch.block_count(hp)
        self.mtp_blocks = 0
        """MTP blocks this map adds past the model's own (set by :meth:`outputs` from the blocks found)."""
        self.rules = arch.rules
        extra = arch.support_rules.get(support) if support is not None else arch.mtp_rules.get(mtp_dialect)
        self._mtp_limit = 0
        if extra is not None and arch.mtp_applies(hp):
            self.rules = extra + arch.rules
            self._mtp_limit = int(hp.get("num_nextn_predict_layers") or 0)
        self.expert_count = arch.expert_count(hp)
        self._aliases = tuple((re.compile(p), r) for p, r in arch.aliases)
        self._matchers = tuple((r.regex.fullmatch, r) for r in self.rules + COMMON_DROPS)   # tried in this order

    # -- names -------------------------------------------------------------------------------------------------

    def canonical_name(self, hf_name: str) -> str:
        name = hf_name
        for regex, replacement in self._aliases:
            name = regex.sub(replacement, name, count=1)
        return name

    def _match(self, name: str, hf_name: str) -> tuple[TensorMapping, ...] | None:
        for fullmatch, r in self._matchers:
            m = fullmatch(name)
            if m is None:
                continue
            groups = {k: int(v) for k, v in m.groupdict().items() if v is not None}
            mtp = groups.pop("mtp", None)
            if mtp is not None:   # MTP block K is block num_hidden_layers + K
                if mtp >= self._mtp_limit:
                    raise SourceError(f"MTP block {mtp} is outside the config's {self._mtp_limit} "
                                      f"(num_nextn_predict_layers)", tensor=hf_name)
                groups["layer"] = self.hp["num_hidden_layers"] + mtp
            if r.when is not None and not self.arch.conditions[r.when](self.hp, groups):
                continue
            layer, expert, shard = groups.get("layer"), groups.get("expert"), groups.get("shard")
            self._check_indices(hf_name, layer, expert, r)
            if not r.targets:
                return (TensorMapping(hf_name, None, r.tensor_class, layer, expert, shard, (), dropped=r.dropped),)
            # a GGUF tensor without a block index (e.g. the PLE table) belongs to no layer
            # an MTP block's tensors keep its block index under any name (recipes select them by layers)
            return tuple(TensorMapping(hf_name, t.gguf.format(layer=layer, mtp=mtp), t.tensor_class,
                                       layer if "{layer}" in t.gguf or mtp is not None else None, expert, shard,
                                       t.steps, t.part)
                         for t in r.targets)
        return None

    def _check_indices(self, hf_name: str, layer: int | None, expert: int | None, r: Rule) -> None:
        if r.dropped:
            return
        # a drafter of its own blocks alone (block_count 0: DSpark's stages) has them counted from the checkpoint
        if layer is not None and self.block_count and layer >= self.block_count + self._mtp_limit:
            raise SourceError(f"layer {layer} is outside the model's {self.block_count} blocks "
                              f"(num_hidden_layers and MTP layers of the config)", tensor=hf_name)
        if expert is not None and expert >= self.expert_count:
            raise SourceError(f"expert {expert} is outside the config's {self.expert_count} routed experts",
                              tensor=hf_name)

    def resolve(self, hf_name: str) -> tuple[TensorMapping, ...]:
        """The GGUF tensor(s) a source tensor feeds; SourceError for a name no rule claims."""
        name = self.canonical_name(hf_name)
        found = self._match(name, hf_name)
        if found is not None:
            return found
        for suffix, weight_suffix, role in COMPANIONS:
            if name.endswith(suffix):
                base = self._match(name[: -len(suffix)] + weight_suffix, hf_name)
                if base is not None:
                    return tuple(replace(m, role=role) for m in base)
        raise SourceError(f"no {self.arch.model_type} rule claims this tensor (unknown layout or a tensor of "
                          f"another model)", tensor=hf_name)

    # -- plan --------------------------------------------------------------------------------------------------

    def input_group_counts(self, gguf_names: Iterable[str]) -> dict[str, int]:
        """GGUF weight -> number of input groups, for the weights llama.cpp multiplies as several matrices
        (:class:`InputGroups`; the others are left out)."""
        return self.arch.group_counts(list(gguf_names), lambda d: _as_int(self.hp.get(d.hparam), d.hparam))

    @property
    def rules_key(self) -> tuple:
        """What, besides the config, decides how this map resolves names: equal keys and one config, equal
        :meth:`outputs` (a main file's map keeping no MTP blocks is the default map)."""
        return self.arch.model_type, self.arch.gguf_arch, tuple(self.rules), self._mtp_limit

    def outputs(self, source_shapes: Mapping[str, Shape]) -> list[OutputTensor]:
        """Group every source into GGUF tensors, check completeness and compute each GGUF shape.

        ``source_shapes`` holds every tensor of the checkpoint (decoded weight shapes, numpy order); companions
        and dropped tensors are resolved (so unknown names still fail) but produce no output.
        """
        groups: dict[str, list[tuple[TensorMapping, Shape]]] = {}
        for hf_name, shape in source_shapes.items():
            for m in self.resolve(hf_name):
                if m.role == "weight" and m.gguf_name is not None:
                    groups.setdefault(m.gguf_name, []).append((m, tuple(int(d) for d in shape)))
        outputs = [self._output(name, members) for name, members in groups.items()]
        n = self.block_count   # MTP blocks named as blocks of the file (blk.N) count as blocks; ds4's mtp.K do not
        self.mtp_blocks = len({o.layer for o in outputs
                               if o.layer is not None and o.layer >= n and o.gguf_name.startswith("blk.")})
        self._check_blocks(outputs)
        return outputs

    def _output(self, gguf_name: str, members: list[tuple[TensorMapping, Shape]]) -> OutputTensor:
        first = members[0][0]
        for m, _ in members:
            if (m.tensor_class, m.layer, m.transform) != (first.tensor_class, first.layer, first.transform):
                raise SourceError(f"sources {first.hf_name!r} and {m.hf_name!r} both map to {gguf_name!r} with "
                                  f"different classes, layers or transforms")
        dtype = "int32" if "to_int32" in first.transform else "float32"
        if first.part is not None:
            return self._columns(gguf_name, members, dtype)
        if first.expert is not None:
            return self._stacked(gguf_name, members, dtype)
        if first.shard is not None:
            return self._concatenated(gguf_name, members, dtype)
        if len(members) > 1:
            names = ", ".join(repr(m.hf_name) for m, _ in members)
            raise SourceError(f"several source tensors map to {gguf_name!r}: {names} (a checkpoint holding two "
                              f"layouts of the same weight?)")
        shape = transforms.output_shape(first.transform, members[0][1], self.hp)
        return OutputTensor(gguf_name, first.tensor_class, first.layer, shape, dtype, (first,), "single")

    def _slots(self, gguf_name: str, members: list[tuple[TensorMapping, Shape]], key: str, expected: int | None
               ) -> list[tuple[TensorMapping, Shape]]:
        by_slot: dict[int, tuple[TensorMapping, Shape]] = {}
        for m, shape in members:
            slot = getattr(m, key)
            if slot is None:
                raise SourceError(f"{gguf_name!r} mixes per-{key} sources with {m.hf_name!r}")
            if slot in by_slot:
                raise SourceError(f"{key} {slot} of {gguf_name!r} comes from both {by_slot[slot][0].hf_name!r} and "
                                  f"{m.hf_name!r}")
            by_slot[slot] = (m, shape)
        count = len(by_slot) if expected is None else expected
        missing = sorted(set(range(count)) - set(by_slot))
        extra = sorted(set(by_slot) - set(range(count)))
        if missing or extra:
            raise SourceError(f"{gguf_name!r} needs {key}s 0..{count - 1}: missing {missing[:8]}, unexpected "
                              f"{extra[:8]} (the config declares {count})")
        return [by_slot[i] for i in range(count)]

    def _stacked(self, gguf_name: str, members, dtype: str) -> OutputTensor:
        ordered = self._slots(gguf_name, members, "expert", self.expert_count)
        shapes = {transforms.output_shape(m.transform, s, self.hp) for m, s in ordered}
        if len(shapes) != 1:
            raise SourceError(f"experts of {gguf_name!r} have different shapes: {sorted(shapes)}")
        m0 = ordered[0][0]
        return OutputTensor(gguf_name, m0.tensor_class, m0.layer, (len(ordered), *shapes.pop()), dtype,
                            tuple(m for m, _ in ordered), "stack_experts")

    def _concatenated(self, gguf_name: str, members, dtype: str) -> OutputTensor:
        count = self.hp.get(self.arch.shard_count_key) if self.arch.shard_count_key else None
        ordered = self._slots(gguf_name, members, "shard", count)
        shapes = [transforms.output_shape(m.transform, s, self.hp) for m, s in ordered]
        tails = {s[1:] for s in shapes}
        if len(tails) != 1:
            raise SourceError(f"shards of {gguf_name!r} have different row shapes: {sorted(tails)}")
        m0 = ordered[0][0]
        return OutputTensor(gguf_name, m0.tensor_class, m0.layer, (sum(s[0] for s in shapes), *tails.pop()), dtype,
                            tuple(m for m, _ in ordered), "concat_shards")

    def _columns(self, gguf_name: str, members, dtype: str) -> OutputTensor:
        ordered = self._slots(gguf_name, members, "part", None)
        shapes = [transforms.output_shape(m.transform, s, self.hp) for m, s in ordered]
        if len({s[:-1] for s in shapes}) != 1 or any(len(s) != 2 for s in shapes):
            raise SourceError(f"the column parts of {gguf_name!r} are not matrices of one row count: {shapes}")
        m0 = ordered[0][0]
        return OutputTensor(gguf_name, m0.tensor_class, m0.layer, (shapes[0][0], sum(s[1] for s in shapes)), dtype,
                            tuple(m for m, _ in ordered), "concat_columns")

    def _check_blocks(self, outputs: Iterable[OutputTensor]) -> None:
        seen = {o.layer for o in outputs if o.layer is not None}
        blocks = self.block_count + self.mtp_blocks
        missing = sorted(set(range(blocks)) - seen)
        if missing:
            text_config = self.config.get("text_config")
            given = "num_hidden_layers" in self.config or (isinstance(text_config, Mapping)
                                                          and "num_hidden_layers" in text_config)
            blocks = (f"declares {self.block_count} blocks" if given else
                      f"gives no num_hidden_layers (the architecture's default: {self.block_count} blocks)")
            raise SourceError(f"the config {blocks} and the checkpoint holds {self.mtp_blocks} MTP blocks, but no "
                              f"tensor maps to blocks {missing[:8]}", field="num_hidden_layers")

    def assemble(self, output: OutputTensor, load: Callable[[str], np.ndarray],
                 out: np.ndarray | None = None) -> np.ndarray:
        """Build one GGUF tensor from its sources; ``load(hf_name)`` returns a decoded source array.

        Sources are loaded and transformed one at a time and written into ``out``: an array of the planned shape
        (any dtype the values cast to exactly, e.g. the BF16 payload of moved BF16 values), or a new one of the
        planned dtype when None.  Only one transformed source exists besides the result, never a list of them and
        their stack.  A single source without ``out`` is returned as it comes (no copy)."""
        if out is None and output.assembly == "single":
            part = transforms.apply(output.sources[0].transform, load(output.sources[0].hf_name), self.hp)
            self._check_part(output, output.sources[0], part, output.shape)
            return part
        if out is None:
            out = np.empty(output.shape, np.dtype(output.dtype))
        if tuple(out.shape) != tuple(output.shape):
            raise SourceError(f"{output.gguf_name!r}: asked to assemble into shape {list(out.shape)}, the plan says "
                              f"{list(output.shape)}")
        start = 0
        for i, m in enumerate(output.sources):
            part = transforms.apply(m.transform, load(m.hf_name), self.hp)
            if output.assembly == "concat_columns":
                slot = out[:, start:start + part.shape[-1]]
                self._check_part(output, m, part, slot.shape)
                slot[...] = part
                start += part.shape[-1]
                continue
            if output.assembly == "stack_experts":
                slot = out[i]
            elif output.assembly == "concat_shards":
                slot = out[start:start + (part.shape[0] if part.ndim else 0)]
            else:
                slot = out
            self._check_part(output, m, part, slot.shape)
            slot[...] = part
            start += slot.shape[0] if slot.ndim else 0
        if output.assembly == "concat_shards" and start != out.shape[0]:
            raise SourceError(f"{output.gguf_name!r}: its shards give {start} rows, the plan says {out.shape[0]} "
                              f"(source shapes differ from the planned ones)")
        return out

    @staticmethod
    def _check_part(output: OutputTensor, source: TensorMapping, part: np.ndarray, shape: Shape) -> None:
        if tuple(part.shape) != tuple(shape) or part.dtype != np.dtype(output.dtype):
            raise SourceError(f"{output.gguf_name!r}: source {source.hf_name!r} gave {part.dtype}{list(part.shape)}, "
                              f"the plan says {output.dtype}{list(shape)} (source shapes differ from the planned "
                              f"ones)")

    # -- metadata ----------------------------------------------------------------------------------------------

    def metadata(self, tokenizer_dir=None, *, tensor_values: Callable[[str], np.ndarray] | None = None,
                 tensor_shapes: Mapping[str, Shape] | None = None, pre_tokenizer: str | None = None,
                 chat_template: str | None = None) -> list[tuple[str, KV]]:
        """GGUF metadata: ``general.architecture``, the hyperparameters and (with ``tokenizer_dir``) the
        tokenizer; ``chat_template`` (else the architecture's default) is written when the tokenizer has none.  ``general.file_type``, ``general.quantization_version``, names and provenance are the
        writer's."""
        from .tokenizer import tokenizer_metadata

        meta = MetadataBuilder(self.arch.gguf_arch)
        meta.string("general.architecture", self.arch.gguf_arch)
        hp = dict(self.hp, num_hidden_layers=self.block_count + self.mtp_blocks) if self.mtp_blocks else self.hp
        self.arch.metadata(meta, hp, MetadataInputs(tensor_values, tensor_shapes,
                                                    Path(tokenizer_dir) if tokenizer_dir is not None else None))
        if self.mtp_blocks and self.block_count:   # a drafter of its own blocks alone (DSpark) has no trunk
            meta.u32("{arch}.nextn_predict_layers", self.mtp_blocks)
        if tokenizer_dir is not None:
            if chat_template is None and self.arch.default_chat_template is not None:
                chat_template = self.arch.default_chat_template(Path(tokenizer_dir).absolute().name)
            for key, kv in tokenizer_metadata(tokenizer_dir, self.hp, config=self.config, pre_tokenizer=pre_tokenizer,
                                              chat_template=chat_template,
                                              fallbacks=self.arch.special_token_fallbacks):
                meta.entries[key] = kv
        return meta.items()


# -- hyperparameters ----------------------------------------------------------------------------------------------

def text_hparams(config: Mapping[str, Any], defaults: Mapping[str, Any],
                 root_defaults: Mapping[str, Any] | None = None) -> Hparams:
    """The converter's view of a config: transformers' ``to_dict()`` (every field, defaults filled in) with the
    ``text_config`` keys moved over the root ones.  ``defaults`` are the text model's field defaults (they live
    in ``text_config`` when there is one), ``root_defaults`` those of a vision-language wrapper config."""
    text = config.get("text_config")
    root = {**(root_defaults or {}), **config}
    if text is None:
        return {**defaults, **root}
    if not isinstance(text, Mapping):
        raise SourceError(f"expected an object, found {type(text).__name__}", field="text_config")
    return {**root, **defaults, **text}


def require(hp: Mapping[str, Any], key: str, kind: type | tuple[type, ...] = int) -> Any:
    """A hyperparameter that must be present with the given type."""
    if key not in hp or hp[key] is None:
        raise SourceError("required by the GGUF conversion but missing from config.json", field=key)
    value = hp[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise SourceError(f"expected {kind}, found {value!r}", field=key)
    if not isinstance(value, kind):
        raise SourceError(f"expected {getattr(kind, '__name__', kind)}, found {value!r}", field=key)
    return value


def first_present(hp: Mapping[str, Any], keys: Sequence[str]) -> Any:
    """gguf-py's ``find_hparam(..., optional=True)``: the value of the first key present (which may be None)."""
    for key in keys:
        if key in hp:
            return hp[key]
    return None


# Mirrors of the converter's ExpertGatingFuncType values.
GATING_FUNCS = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}


def rope_parameters(hp: Mapping[str, Any]) -> dict[str, Any]:
    """The converter's ``TextModel.rope_parameters``: ``rope_parameters`` (or ``rope_scaling``) with the global
    rope keys mirrored into it."""
    rp = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    rope_theta = first_present(hp, ["global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                                    "rotary_emb_base"])
    local_theta = first_present(hp, ["local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                                     "rope_local_base_freq"])
    partial = first_present(hp, ["partial_rotary_factor", "rope_pct", "rope_percent"])
    original = first_present(hp, ["original_max_position_embeddings"])
    if "full_attention" not in rp and "sliding_attention" not in rp:
        if local_theta is not None:
            rp["sliding_attention"] = {"rope_theta": local_theta}
        if "rope_theta" not in rp and rope_theta is not None:
            rp["rope_theta"] = rope_theta
        if "rope_type" not in rp and rp.get("type") is not None:
            rp["rope_type"] = rp["type"]
        if "partial_rotary_factor" not in rp and partial is not None:
            rp["partial_rotary_factor"] = partial
        if "original_max_position_embeddings" not in rp and original is not None:
            rp["original_max_position_embeddings"] = original
    return rp


def text_model_metadata(meta: MetadataBuilder, hp: Mapping[str, Any], block_count: int,
                        rp: Mapping[str, Any]) -> None:
    """The keys every text model gets (the converter's ``TextModel.set_gguf_parameters``), from ``hp`` and the
    rope parameters ``rp``."""
    meta.u32("{arch}.block_count", block_count)
    for key, names in (
        ("{arch}.context_length", ["max_position_embeddings", "n_ctx", "n_positions", "max_length",
                                   "max_sequence_length", "model_max_length"]),
        ("{arch}.embedding_length", ["hidden_size", "n_embd", "dim"]),
    ):
        if (value := first_present(hp, names)) is not None:
            meta.u32(key, value)
    for key, names in (
        ("{arch}.feed_forward_length", ["prefix_dense_intermediate_size", "dense_intermediate_size",
                                        "intermediate_size", "n_inner", "hidden_dim"]),
        ("{arch}.attention.head_count", ["num_attention_heads", "n_head", "n_heads"]),
        ("{arch}.attention.head_count_kv", ["num_key_value_heads", "n_kv_heads"]),
    ):
        if (value := first_present(hp, names)) is not None:
            meta.u32_or_array(key, value)
    if hp.get("is_causal") is False:
        meta.boolean("{arch}.attention.causal", False)

    params = rp.get("full_attention", rp)
    rope_type = params.get("rope_type")
    if rope_type is not None:
        factor = params.get("factor")
        if rope_type in ("linear", "yarn") and factor is not None:
            meta.string("{arch}.rope.scaling.type", rope_type)
            meta.f32("{arch}.rope.scaling.factor", factor)
            if rope_type == "yarn":
                meta.u32("{arch}.rope.scaling.original_context_length", require(params,
                                                                                "original_max_position_embeddings"))
                for key, names in (("yarn_ext_factor", ["extrapolation_factor"]),
                                   ("yarn_attn_factor", ["attention_factor", "attn_factor"]),
                                   ("yarn_beta_fast", ["beta_fast"]), ("yarn_beta_slow", ["beta_slow"])):
                    value = params.get(names[0], params.get(names[1])) if len(names) == 2 else params.get(names[0])
                    if value is not None:
                        meta.f32("{arch}.rope.scaling." + key, value)
        elif rope_type in ("su", "longrope"):
            meta.string("{arch}.rope.scaling.type", "longrope")
    if "mrope_section" in rp:
        sections = list(rp["mrope_section"]) + [0] * max(0, 4 - len(rp["mrope_section"]))
        meta.array("{arch}.rope.dimension_sections", sections[:4], GGUFValueType.INT32)
    if (theta := params.get("rope_theta")) is not None:
        meta.f32("{arch}.rope.freq_base", theta)
    if (local := (rp.get("sliding_attention") or {}).get("rope_theta")) is not None:
        meta.f32("{arch}.rope.freq_base_swa", local)
    if (eps := first_present(hp, ["rms_norm_eps", "norm_eps"])) is not None:
        meta.f32("{arch}.attention.layer_norm_rms_epsilon", eps)
    if (eps := first_present(hp, ["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"])) is not None:
        meta.f32("{arch}.attention.layer_norm_epsilon", eps)
    for key, names in (("{arch}.expert_count", ["num_local_experts", "num_experts", "n_routed_experts"]),
                       ("{arch}.expert_used_count", ["num_experts_per_tok", "num_experts_per_token", "top_k_experts"]),
                       ("{arch}.expert_group_count", ["n_group"]),
                       ("{arch}.expert_group_used_count", ["topk_group"])):
        if (value := first_present(hp, names)) is not None:
            meta.u32_or_array(key, value)
    score = first_present(hp, ["score_function", "scoring_func", "score_func", "moe_router_activation",
                               "moe_router_activation_func", "expert_selection_fn"])
    if score is not None:
        if score not in GATING_FUNCS:
            raise SourceError(f"unsupported expert gating function {score!r}; llama.cpp knows "
                              f"{sorted(GATING_FUNCS)}", field="scoring_func")
        meta.u32("{arch}.expert_gating_func", GATING_FUNCS[score])
    if (head_dim := hp.get("head_dim")) is not None:
        meta.u32("{arch}.attention.key_length", head_dim)
        meta.u32("{arch}.attention.value_length", head_dim)


def expert_rules(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
                 ) -> tuple[Rule, ...]:
    """Routed experts under ``prefix`` (``...experts``): per-expert 2-D weights stacked into 3-D GGUF tensors, and
    transformers' fused 3-D ``gate_up_proj`` [E, 2*ff, embd] (gate first) and ``down_proj`` [E, embd, ff]."""
    out = []
    for name, gguf, cls in ((gate, "ffn_gate_exps", "routed_gate"), (up, "ffn_up_exps", "routed_up"),
                            (down, "ffn_down_exps", "routed_down")):
        out.append(rule(f"{prefix}.{{E}}.{name}.weight", f"blk.{{layer}}.{gguf}.weight", cls))
    for suffix in ("", ".weight"):
        out.append(split(f"{prefix}.gate_up_proj{suffix}",
                         Target("blk.{layer}.ffn_gate_exps.weight", "routed_gate", ("gate_half",)),
                         Target("blk.{layer}.ffn_up_exps.weight", "routed_up", ("up_half",))))
        out.append(rule(f"{prefix}.down_proj{suffix}", "blk.{layer}.ffn_down_exps.weight", "routed_down"))
    return tuple(out)


def mla_rules(prefix: str) -> tuple[Rule, ...]:
    """Multi-head latent attention under ``prefix`` (DeepSeek V3 and GLM-5): low-rank q and kv projections, their
    norms, ``kv_b`` split into llama.cpp's ``attn_k_b``/``attn_v_b``, and the output projection."""
    return (
        rule(f"{prefix}.q_a_proj.weight", "blk.{layer}.attn_q_a.weight", "attn_q"),
        rule(f"{prefix}.q_a_layernorm.weight", "blk.{layer}.attn_q_a_norm.weight", "norm"),
        rule(f"{prefix}.q_b_proj.weight", "blk.{layer}.attn_q_b.weight", "attn_q"),
        rule(f"{prefix}.kv_a_proj_with_mqa.weight", "blk.{layer}.attn_kv_a_mqa.weight", "attn_kv"),
        rule(f"{prefix}.kv_a_layernorm.weight", "blk.{layer}.attn_kv_a_norm.weight", "norm"),
        split(f"{prefix}.kv_b_proj.weight",
              Target("blk.{layer}.attn_k_b.weight", "attn_kv", ("kv_b_k",)),
              Target("blk.{layer}.attn_v_b.weight", "attn_kv", ("kv_b_v",))),
        rule(f"{prefix}.o_proj.weight", "blk.{layer}.attn_output.weight", "attn_output"),
    )


def tied(hp: Hparams, groups: Mapping[str, int]) -> bool:
    """Condition: the output head is tied to the token embedding."""
    return bool(hp.get("tie_word_embeddings", False))


def mtp_layer(hp: Hparams, groups: Mapping[str, int]) -> bool:
    """Condition: the block index is past the main layers (a NextN/MTP block)."""
    return groups.get("layer", -1) >= hp["num_hidden_layers"]
