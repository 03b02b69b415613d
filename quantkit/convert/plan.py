"""The conversion plan: what ``quantkit convert`` will write, decided before anything is encoded.

:func:`build_plan` reads the checkpoint's headers and ``config.json`` (and the few small tensors some
architectures turn into metadata), maps every source tensor to its GGUF tensor (:mod:`quantkit.arch`), resolves
the recipe (:mod:`quantkit.recipes`) and sizes every tensor.  The result is data: printable
(:meth:`Plan.summary`, what ``--dry-run`` shows), JSON-serializable (:meth:`Plan.to_json`), and the input of the
executor, which adds the provenance keys, lays the file out (:meth:`Plan.layout`) and encodes each tensor.

Per tensor (:class:`PlannedTensor`): the GGUF tensor and its sources, the GGML type, the deciding rule, the type
it fell back from (row length), where its importance comes from, whether its bytes carry the source values
unchanged, and its byte size ``rows * get_format(qtype).row_bytes(row length)``.

Importance (``importance``):

* ``none``: the type ignores importance (Q8_0, the float types, and MXFP4/NVFP4, the lossless targets), or the
  type uses importance optionally and neither an imatrix entry nor bootstrap importance exists for the tensor;
* ``imatrix``: the imatrix has an entry for the tensor and the type uses importance;
* ``bootstrap``: no imatrix entry, ``bootstrap=True``: weight energy (sum of w^2 per column) stands in.

A type that requires importance (IQ2_XXS, IQ2_XS) without an imatrix entry and without bootstrap is an error at
plan time, listing the tensors.  An imatrix entry naming a tensor the model does not have, or holding a number of
values other than the row length (or the row length times the leading dimension of a 3-D tensor: one vector per
expert, or per head of MLA's ``attn_k_b``/``attn_v_b``), is an error too: it was made for another model.

Lossless carry-over (``lossless``): ``copy`` (float source written as the same float type, values unchanged),
``fp8-rows`` (an FP8 E4M3 table with E8M0 scales per 32 values of a row -- V4.1 Engram -- written as an I8 row
store ``[rows, n + n/32]``: each row's codes then its scales, :mod:`quantkit.engram.rows`),
``mxfp4-repack`` (packed FP4 + E8M0 per 32 -> MXFP4), ``nvfp4-repack`` (NVFP4 -> GGUF NVFP4) and
``nvfp4-scale``: the F32 ``<name>.scale`` tensor planned right after an NVFP4 tensor, holding its global scale
as a multiplier (shape ``[1]``, or ``[experts]`` for stacked experts).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from ..arch import ROW_TABLE_CLASSES, SUPPORT_KINDS, Arch, ArchMap, OutputTensor, get_arch
from ..arch import transforms
from ..arch.dialects import (LAYOUT_A_LOG, LAYOUT_CONV, LLAMA_CPP, TensorMove, arch_dialect, is_native,
                              relaid_dialect, relaid_metadata, relaid_tensors, translate)
from ..errors import RecipeError, SourceError, SupportError, UnsupportedError
from ..formats.api import tensor_nbytes
from ..formats.registry import GGMLType, ImatrixUse, get_format
from ..io.checkpoint import Checkpoint, open_checkpoint
from ..io.gguf import KV, type_name
from ..io.gguf_writer import Layout, TensorSpec, plan_layout
from ..recipes import Recipe, Resolution, load_recipe, resolve
from ..recipes import name_tag as file_name_tag

#: Tensors an MTP support file carries besides the MTP blocks (llama.cpp's ``--mtp`` export keeps the same three).
MTP_SHARED_TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight"})
#: Version of :meth:`Plan.to_json`'s layout (independent of the package version).
PLAN_FORMAT_VERSION = 1
IMPORTANCE_KINDS = ("imatrix", "bootstrap", "none")
#: Source encodings whose weights are packed FP4 (two values per byte unless stored as ``F4``).
PACKED_FP4_ENCODINGS = frozenset({"fp4-e8m0", "nvfp4-modelopt", "nvfp4-compressed-tensors"})
_PLAIN_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_INTEGER_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"})
#: Metadata arrays longer than this are summarized in JSON by count and SHA-256 (vocabularies, merges).
JSON_ARRAY_LIMIT = 64
#: Tensors listed by name in one error message.
MAX_NAMED_TENSORS = 8
NVFP4_SCALE_SUFFIX = ".scale"
#: Source encoding of an FP8 E4M3 matrix with one E8M0 scale per 32 values of each row (:func:`row_scaled_fp8`).
ROW_SCALED_FP8 = "fp8-e8m0-rows"
ROW_SCALE_BLOCK = 32


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor of the plan."""

    output: OutputTensor
    qtype: GGMLType
    rule: str
    fallback_from: GGMLType | None
    importance: str
    lossless: str | None
    nbytes: int
    llama_cpp_name: str | None = None
    """The llama.cpp name, where the dialect renamed the tensor: imatrices name tensors the llama.cpp way."""

    @property
    def name(self) -> str:
        return self.output.gguf_name

    @property
    def imatrix_name(self) -> str:
        """The name this tensor's imatrix entry has."""
        return self.llama_cpp_name or self.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.output.shape, dtype=np.int64))

    def to_json(self) -> dict[str, Any]:
        o = self.output
        return {"name": o.gguf_name, "class": o.tensor_class, "layer": o.layer, "shape": list(o.shape),
                "type": self.qtype.name, "rule": self.rule,
                "fallback_from": self.fallback_from.name if self.fallback_from is not None else None,
                "importance": self.importance, "lossless": self.lossless, "nbytes": self.nbytes,
                "assembly": o.assembly,
                "sources": [{"name": m.hf_name, "expert": m.expert, "shard": m.shard, "transform": list(m.transform)}
                            for m in o.sources]}


@dataclass
class Plan:
    """What a conversion writes: tensors with types and sizes, and the GGUF metadata (before provenance)."""

    source: Path
    model_type: str
    recipe: Recipe
    tensors: list[PlannedTensor]
    metadata: list[tuple[str, KV]]
    label: str | None = None
    """Checkpoint label (e.g. ``0731``), recorded by the executor."""
    bootstrap: bool = False
    imatrix_entries: int | None = None
    """Entries of the imatrix given (None: no imatrix)."""
    skipped: list[OutputTensor] = field(default_factory=list)
    unused_rules: list[str] = field(default_factory=list)
    """Each rule that decided no tensor, with why (:meth:`quantkit.recipes.Resolution.explain_unused`)."""
    resolution: Resolution | None = field(default=None, repr=False)
    dialect: str = LLAMA_CPP
    """GGUF dialect of the names, keys and order (:mod:`quantkit.arch.dialects`)."""
    support: str | None = None
    """The support (drafter) file this plan writes instead of the model (:func:`support_plan`), or None."""

    @property
    def name_tag(self) -> str:
        """The tag of the planned file: only rules that decide a tensor's type here count."""
        return file_name_tag(self.recipe, self.resolution)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def row_tables(self) -> list[PlannedTensor]:
        """The disk-only row tables (Engram, n-gram): read by row, apart from the resident weights."""
        return [t for t in self.tensors if t.output.tensor_class in ROW_TABLE_CLASSES]

    def layout(self, extra_metadata: Iterable[tuple[str, Any]] = ()) -> Layout:
        """The GGUF layout of the planned file (plus ``extra_metadata``, e.g. provenance keys)."""
        return plan_layout([*self.metadata, *extra_metadata],
                           [TensorSpec(t.name, t.output.shape, t.qtype) for t in self.tensors])

    def class_totals(self) -> dict[str, dict[str, Any]]:
        """Per tensor class: tensors, elements, bytes, bits per weight and tensors per type."""
        totals: dict[str, dict[str, Any]] = {}
        for t in self.tensors:
            entry = totals.setdefault(t.output.tensor_class, {"tensors": 0, "elements": 0, "bytes": 0,
                                                              "types": Counter()})
            entry["tensors"] += 1
            entry["elements"] += t.n_elements
            entry["bytes"] += t.nbytes
            entry["types"][t.qtype.name] += 1
        for entry in totals.values():
            entry["bpw"] = _bpw(entry["bytes"], entry["elements"])
            entry["types"] = dict(sorted(entry["types"].items()))
        return totals

    def to_json(self) -> dict[str, Any]:
        layout = self.layout()
        elements = sum(t.n_elements for t in self.tensors)
        return {
            "format": "quantkit-plan", "version": PLAN_FORMAT_VERSION, "dialect": self.dialect,
            "support": self.support,
            "source": str(self.source), "model_type": self.model_type, "label": self.label,
            "recipe": self.recipe.to_dict(), "name_tag": self.name_tag,
            "importance": {"imatrix_entries": self.imatrix_entries, "bootstrap": self.bootstrap},
            "totals": {"tensors": len(self.tensors), "elements": elements, "tensor_bytes": self.tensor_bytes,
                       "bpw": _bpw(self.tensor_bytes, elements), "file_bytes": layout.file_size},
            "classes": self.class_totals(),
            "row_tables": {"tensors": [t.name for t in self.row_tables],
                           "bytes": sum(t.nbytes for t in self.row_tables),
                           "resident_bytes": self.tensor_bytes - sum(t.nbytes for t in self.row_tables)},
            "tensors": [t.to_json() for t in self.tensors],
            "skipped": [o.gguf_name for o in self.skipped],
            "unused_rules": list(self.unused_rules),
            "metadata": [{"key": key, "type": type_name(kv.type), "value": _json_value(kv.value)}
                         for key, kv in self.metadata],
        }

    def summary(self) -> str:
        """The dry-run report: per class and in total tensors, types, bytes and bits per weight; the name tag."""
        layout = self.layout()
        lines = [f"source      {self.source} ({self.model_type})",
                 f"recipe      {self.recipe.name} ({self.recipe.where()}, sha256 {self.recipe.sha256[:16]})",
                 f"name tag    {self.name_tag}" + (f"  label {self.label}" if self.label else ""),
                 *([f"support     {self.support} drafter file: "
                    + ("the DSpark drafter's stages and heads" if self.support == "dspark" else "the MTP blocks")
                    + (" with the embedding, output norm and head"
                       if self.support == "mtp" and self.dialect == LLAMA_CPP else "")
                    + "; pair it only with a target of this checkpoint"] if self.support else []),
                 "", f"{'class':<16}{'tensors':>8}  {'bytes':>12}  {'bpw':>7}  types"]
        totals = self.class_totals()
        for cls, e in sorted(totals.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])):
            types = ", ".join(f"{name} x{n}" for name, n in e["types"].items())
            lines.append(f"{cls:<16}{e['tensors']:>8}  {_human(e['bytes']):>12}  {e['bpw']:>7.3f}  {types}")
        elements = sum(e["elements"] for e in totals.values())
        by_type = Counter()
        for t in self.tensors:
            by_type[t.qtype.name] += t.nbytes
        lines.append(f"{'total':<16}{len(self.tensors):>8}  {_human(self.tensor_bytes):>12}  "
                     f"{_bpw(self.tensor_bytes, elements):>7.3f}  "
                     + ", ".join(f"{name} {_human(n)}" for name, n in by_type.most_common()))
        lines.append(f"file        {layout.file_size:,} bytes ({_human(layout.file_size)}) before provenance keys; "
                     f"{len(self.metadata)} metadata keys")
        if self.row_tables:
            table_bytes = sum(t.nbytes for t in self.row_tables)
            classes = ", ".join(sorted({t.output.tensor_class for t in self.row_tables}))
            lines.append(f"disk-only   {len(self.row_tables)} row tables ({classes}), {_human(table_bytes)}, read by "
                         f"row; resident weights {_human(self.tensor_bytes - table_bytes)}")
        importance = Counter(t.importance for t in self.tensors)
        source = (f"imatrix with {self.imatrix_entries} entries" if self.imatrix_entries is not None
                  else "no imatrix") + (", bootstrap importance" if self.bootstrap else "")
        lines.append("importance  " + ", ".join(f"{k} {importance[k]}" for k in IMPORTANCE_KINDS) + f" ({source})")
        lossless = Counter(t.lossless for t in self.tensors if t.lossless)
        if lossless:
            lines.append("lossless    " + ", ".join(f"{k} {n}" for k, n in sorted(lossless.items())))
        fallbacks = [t for t in self.tensors if t.fallback_from is not None]
        if fallbacks:
            lines.append(f"fallbacks   {len(fallbacks)}: " + ", ".join(
                f"{t.name} {t.fallback_from.name}->{t.qtype.name}" for t in fallbacks[:MAX_NAMED_TENSORS])
                + (" ..." if len(fallbacks) > MAX_NAMED_TENSORS else ""))
        if self.skipped:
            lines.append(f"skipped     {len(self.skipped)}: " + ", ".join(
                sorted({o.tensor_class for o in self.skipped})))
        for explanation in self.unused_rules:
            lines.append(f"unused      {explanation}")
        return "\n".join(lines)


def _bpw(nbytes: int, elements: int) -> float:
    return 8.0 * nbytes / elements if elements else 0.0


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def _json_value(value: Any) -> Any:
    if isinstance(value, KV):
        return {"type": type_name(value.type), "value": _json_value(value.value)}
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        if len(items) > JSON_ARRAY_LIMIT:
            digest = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8",
                                                                                  "surrogateescape")).hexdigest()
            return {"count": len(items), "sha256": digest, "first": items[:JSON_ARRAY_LIMIT // 8]}
        return items
    return value


# -- sources -----------------------------------------------------------------------------------------------------

def source_encoding(ckpt: Checkpoint, name: str) -> str:
    """How a checkpoint weight is stored: ``F32``/``F16``/``BF16``/``F64``, ``int``, or the checkpoint's decoding
    scheme (``fp8-block``, ``fp8-block-e8m0``, ``fp4-e8m0``, ``nvfp4-modelopt``, ``nvfp4-compressed-tensors``)."""
    info = ckpt.tensor_info(name)
    if info.dtype in _PLAIN_DTYPES:
        return info.dtype
    companions = ckpt.companions(name)
    if info.dtype in _INTEGER_DTYPES and not companions:
        return "int"
    scheme = ckpt.scheme(info.name)[0]
    if scheme == "fp8-block-e8m0" and row_scaled_fp8(ckpt, name) is not None:
        return ROW_SCALED_FP8
    return scheme


def row_scaled_fp8(ckpt: Checkpoint, name: str) -> str | None:
    """The E8M0 scale tensor of an FP8 E4M3 matrix scaled per 32 values of each row (``[rows, n]`` with scales
    ``[rows, n/32]``: DeepSeek V4.1's Engram tables), or None for any other tensor."""
    info = ckpt.tensor_info(name)
    scale = ckpt.companions(name).get("scale")
    if info.dtype != "F8_E4M3" or scale is None or len(info.shape) != 2 or info.shape[1] % ROW_SCALE_BLOCK:
        return None
    scale_info = ckpt.tensor_info(scale)
    rows, n = (int(d) for d in info.shape)
    return scale if tuple(scale_info.shape) == (rows, n // ROW_SCALE_BLOCK) and rows > 1 else None


#: inspect_sources of each open checkpoint (its headers do not change while it is open; convert asks twice: for
#: the imatrix's shapes, then for the plan, ~0.5 s each on a 47k-tensor checkpoint).  Read-only for callers.
_INSPECTED: "weakref.WeakKeyDictionary[Checkpoint, tuple]" = weakref.WeakKeyDictionary()


def inspect_sources(ckpt: Checkpoint) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """From headers only: every tensor's decoded shape (numpy order; companions as stored) and every weight's
    encoding (:func:`source_encoding`)."""
    found = _INSPECTED.get(ckpt)
    if found is None:
        found = _INSPECTED[ckpt] = _inspect_sources(ckpt)
    return found


#: ArchMap.outputs over each open checkpoint's sources, per rules_key: (outputs, MTP blocks found).  Convert asks
#: twice with equal rules for a model without MTP blocks kept (the imatrix's shapes, the plan): resolving every
#: name is ~0.45 s of a 47k-tensor checkpoint's planning.
_OUTPUTS: "weakref.WeakKeyDictionary[Checkpoint, dict]" = weakref.WeakKeyDictionary()


def source_outputs(ckpt: Checkpoint, amap: ArchMap) -> list[OutputTensor]:
    """``amap.outputs`` of every source of ``ckpt`` (``amap`` bound to its config), computed once per open
    checkpoint and set of rules.  Read-only for callers."""
    if amap.config is not ckpt.config:
        return amap.outputs(inspect_sources(ckpt)[0])
    found = _OUTPUTS.setdefault(ckpt, {})
    if amap.rules_key not in found:
        found[amap.rules_key] = amap.outputs(inspect_sources(ckpt)[0]), amap.mtp_blocks
    outputs, amap.mtp_blocks = found[amap.rules_key]
    return outputs


def _inspect_sources(ckpt: Checkpoint) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    names = ckpt.tensor_names()
    companions = {c for n in names for c in ckpt.companions(n).values()}
    shapes, encodings = {}, {}
    for name in names:
        info = ckpt.tensor_info(name)
        shape = tuple(int(d) for d in info.shape)
        if name not in companions:
            encodings[name] = encoding = source_encoding(ckpt, name)
            if encoding in PACKED_FP4_ENCODINGS and info.dtype != "F4":  # F4 headers give the logical shape
                shape = shape[:-1] + (2 * shape[-1],)
        shapes[name] = shape
    return shapes, encodings


def _output_encoding(output: OutputTensor, encodings: Mapping[str, str]) -> str:
    found = {encodings[m.hf_name] for m in output.sources}
    return found.pop() if len(found) == 1 else "mixed"


def _tensor_values(ckpt: Checkpoint):
    def load(name: str) -> np.ndarray:
        info = ckpt.tensor_info(name)
        return np.asarray(ckpt.raw(name)) if info.dtype in _INTEGER_DTYPES else ckpt.tensor_f32(name)
    return load


# -- importance --------------------------------------------------------------------------------------------------

def _check_imatrix(imatrix: Mapping[str, Any], outputs: Mapping[str, OutputTensor], model_type: str) -> None:
    for name, values in imatrix.items():
        o = outputs.get(name)
        if o is None:
            raise SourceError(f"imatrix entry {name!r} names no tensor of this {model_type} model (an imatrix made "
                              f"for another model?)", field="imatrix")
        row = o.shape[-1]
        matrices = o.shape[0] if len(o.shape) == 3 else 1   # stacked experts, MLA's per-head attn_k_b/v_b
        count = int(np.size(values))
        if count not in (row, row * matrices):
            expected = f"{row}" + (f" or {row * matrices} ({matrices} matrices)" if matrices > 1 else "")
            raise SourceError(f"imatrix entry {name!r} has {count} values; the tensor needs {expected} (an imatrix "
                              f"made for another model?)", field="imatrix")


def _importance(qtype: GGMLType, name: str, imatrix: Mapping[str, Any] | None, bootstrap: bool) -> str | None:
    """The importance kind, or None where the type requires importance and none is available."""
    use = get_format(qtype).imatrix
    if use is ImatrixUse.IGNORED:
        return "none"
    if imatrix is not None and name in imatrix:
        return "imatrix"
    if bootstrap:
        return "bootstrap"
    return None if use is ImatrixUse.REQUIRED else "none"


# -- building ----------------------------------------------------------------------------------------------------

def _nvfp4_scale(weight: PlannedTensor) -> PlannedTensor:
    o = weight.output
    shape = (o.shape[0],) if o.assembly == "stack_experts" else (1,)
    scale = replace(o, gguf_name=o.gguf_name.removesuffix(".weight") + NVFP4_SCALE_SUFFIX, shape=shape)
    return PlannedTensor(scale, GGMLType.F32, weight.rule, None, "none", "nvfp4-scale",
                         tensor_nbytes(GGMLType.F32, shape))


def build_plan(source: str | os.PathLike | Checkpoint, recipe: Recipe | str | os.PathLike, *,
               imatrix: Mapping[str, Any] | None = None, bootstrap: bool = False, label: str | None = None,
               pre_tokenizer: str | None = None, dialect: str | None = None, support: str | None = None) -> Plan:
    """Plan the conversion of checkpoint ``source`` (a path, or a checkpoint the caller opened and keeps) with
    ``recipe`` (a Recipe, a file, or a shipped name).

    ``imatrix``: GGUF tensor name -> importance values (any array-like; only names and sizes are read here).
    ``bootstrap``: use weight energy where the imatrix has no entry.  ``label``: the checkpoint label.
    ``pre_tokenizer``: llama.cpp's pre-tokenizer name, for tokenizers its hash table does not know.
    ``dialect``: the GGUF dialect of names, keys and order (:mod:`quantkit.arch.dialects`); None: the recipe's
    ``dialect``, else llama.cpp's.  ``support``: plan the support (drafter) file of this kind instead
    (:func:`support_plan`); None: the recipe's ``support``, else the model.
    """
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    dialect = dialect or recipe.dialect or LLAMA_CPP
    if support is not None and recipe.support is not None and support != recipe.support:
        raise RecipeError(f"recipe {recipe.name!r} writes the {recipe.support} support file, not {support}",
                          path=recipe.where(), field="support")
    support = support or recipe.support
    with contextlib.nullcontext(source) if isinstance(source, Checkpoint) else open_checkpoint(source) as ckpt:
        model_type = ckpt.config.get("model_type")
        if not isinstance(model_type, str):
            raise SourceError("no config.json in the checkpoint" if not ckpt.has_config else
                              f"config.json gives no model_type (found {model_type!r})", path=ckpt.path,
                              field="model_type")
        arch = get_arch(model_type)
        recipe.check_architecture(model_type)
        # the main file keeps the MTP blocks the default map drops, under the dialect's names, unless skipped
        keep_mtp = "mtp" not in recipe.skipped_classes
        # a support file in a dialect whose engine names the MTP block itself (ds4's mtp.K.*) is cut from that
        # main file; llama.cpp's is its --mtp export (the map's support rules)
        native_support = support == "mtp" and dialect != LLAMA_CPP and dialect in arch.mtp_rules
        amap = arch.bind(ckpt.config, None if native_support else support,
                         mtp_dialect=dialect if keep_mtp and (support is None or native_support) else None)
        shapes, encodings = inspect_sources(ckpt)
        outputs = source_outputs(ckpt, amap)
        by_name = {o.gguf_name: o for o in outputs}
        if imatrix is not None:
            _check_imatrix(imatrix, by_name, model_type)
        resolution = resolve(recipe, outputs, {o.gguf_name: _output_encoding(o, encodings) for o in outputs})
        metadata = amap.metadata(ckpt.path if ckpt.path.is_dir() else None, tensor_values=_tensor_values(ckpt),
                                 tensor_shapes=shapes, pre_tokenizer=pre_tokenizer)

    tensors: list[PlannedTensor] = []
    skipped: list[OutputTensor] = []
    lacking: list[str] = []
    for o in outputs:
        choice = resolution.choices[o.gguf_name]
        if choice is None:
            skipped.append(o)
            continue
        importance = _importance(choice.qtype, o.gguf_name, imatrix, bootstrap)
        if importance is None:
            lacking.append(f"{o.gguf_name} ({choice.qtype.name}, {choice.rule})")
            continue
        if o.tensor_class == "engram" and importance != "none" and choice.lossless is None:
            raise RecipeError(f"{choice.rule} re-encodes the Engram table to {choice.qtype.name} with {importance} "
                              f"importance; Engram tables are re-encoded by row chunk, without whole-table "
                              f"statistics: choose a type that ignores importance (Q8_0, MXFP4) or type = "
                              f"\"source\"", path=recipe.where(), tensor=o.gguf_name)
        if choice.lossless == "fp8-rows":   # native rows: codes then scales, [rows, n + n/32] bytes
            o = replace(o, shape=(*o.shape[:-1], o.shape[-1] + o.shape[-1] // ROW_SCALE_BLOCK))
        planned = PlannedTensor(o, choice.qtype, choice.rule, choice.fallback_from, importance, choice.lossless,
                                tensor_nbytes(choice.qtype, o.shape))
        tensors.append(planned)
        if choice.lossless == "nvfp4-repack":
            tensors.append(_nvfp4_scale(planned))
    if lacking:
        more = f" and {len(lacking) - MAX_NAMED_TENSORS} more" if len(lacking) > MAX_NAMED_TENSORS else ""
        raise RecipeError(f"{len(lacking)} tensors get a type that requires importance, and there is "
                          f"{'no imatrix entry for them' if imatrix is not None else 'no imatrix'}: "
                          f"{', '.join(lacking[:MAX_NAMED_TENSORS])}{more}; pass an imatrix that covers them or "
                          f"bootstrap importance (--bootstrap-importance)", path=recipe.where())
    plan = Plan(ckpt.path, model_type, recipe, tensors, metadata, label=label, bootstrap=bootstrap,
                imatrix_entries=len(imatrix) if imatrix is not None else None, skipped=skipped,
                unused_rules=[resolution.explain_unused(r) for r in resolution.unused_rules], resolution=resolution)
    if support is not None:
        plan = support_plan(plan, support, amap.hp, arch,
                            shared=frozenset() if native_support else MTP_SHARED_TENSORS)
    if dialect == LLAMA_CPP:
        return plan
    table = relaid_dialect(arch.gguf_arch, dialect)
    return in_dialect(plan, dialect) if table is None else relaid_plan(plan, table, amap.hp, shapes)


def support_plan(plan: Plan, kind: str, hp: Mapping[str, Any], arch: Arch,
                 shared: frozenset[str] = MTP_SHARED_TENSORS) -> Plan:
    """The plan of a support file: for ``mtp``, the NextN/MTP blocks (blocks from ``num_hidden_layers`` on, and
    tensors built from ``mtp.*`` alone) with the ``shared`` tensors -- the token embedding, output norm and head,
    as llama.cpp's converter exports a draft with ``--mtp``; none for ds4's MTP file, whose ``mtp.K.*`` are all
    ds4.c binds from it -- and the model's metadata; the executor records the target's checkpoint identity
    (``quantkit.support.*``).  A kind with a map of its own in ``arch`` (the DSpark drafter,
    :attr:`quantkit.arch.base.Arch.support_archs`) was planned by that map: kept whole.  Refused
    (:class:`SupportError`, saying why) when the architecture map writes no MTP block from this checkpoint, and for
    ``dspark`` where no map has the drafter's tensors."""
    if kind not in SUPPORT_KINDS:
        raise UnsupportedError(f"unknown support kind {kind!r}; known: {', '.join(SUPPORT_KINDS)}", field="support")
    if kind in arch.support_archs:
        return replace(plan, support=kind)
    if kind == "dspark":
        raise SupportError(f"the {plan.model_type} map has no DSpark drafter (DeepSeek V4's is read from a "
                           f"checkpoint with dspark_* settings; V4.1's dspark.* have no public GGUF layout)",
                           field="support")
    main = hp["num_hidden_layers"]
    blocks = [t for t in plan.tensors if (t.output.layer is not None and t.output.layer >= main)
              or all(m.hf_name.startswith("mtp.") for m in t.output.sources)]
    if not blocks:
        raise SupportError(f"the {plan.model_type} map writes no MTP block from this checkpoint "
                           f"({_no_mtp_block(arch, hp)})", field="support")
    kept = [t for t in plan.tensors if t.name in shared or t in blocks]
    return replace(plan, tensors=kept, support=kind)


def _no_mtp_block(arch: Arch, hp: Mapping[str, Any]) -> str:
    """Why ``arch`` wrote no MTP block from a checkpoint: its ``mtp.*`` are another drafter's, the map has no MTP
    layout (its drop rule says why), or the checkpoint holds none."""
    if not arch.mtp_applies(hp):   # DeepSeek V4 with dspark_* settings: mtp.* are the DSpark stages
        other = next(iter(arch.support_archs), "another")
        return f"its mtp.* are a {other} drafter, not an MTP block: --support {other}"
    rules = [r for r in (*arch.rules, *arch.support_rules.get("mtp", ())) if r.tensor_class == "mtp"]
    if not any(r.targets for r in rules):
        dropped = next((r.dropped for r in rules if r.dropped), None)
        return "the map has no MTP layout" + (f": {dropped}" if dropped else "")
    return f"it holds none: num_nextn_predict_layers {hp.get('num_nextn_predict_layers') or 0}"


#: Transform steps the ds4 dialect replaces: ds4 keeps A_log itself and [C, 1, K] convolutions.
_DIALECT_STEPS = {LAYOUT_A_LOG: {"neg_exp": None}, LAYOUT_CONV: {"conv_4d": "conv_3d"}}


def in_dialect(plan: Plan, dialect: str) -> Plan:
    """The plan with GGUF names, shapes, order and metadata of ``dialect``; payloads are built the same way except
    where the dialect stores another layout (the transform steps of :data:`_DIALECT_STEPS`)."""
    table = arch_dialect(_arch_of_plan(plan), dialect)
    native = [t for t in plan.tensors if is_native(table, t.name)]   # built in the dialect's names already
    translated = [t for t in plan.tensors if not is_native(table, t.name)]
    translation = translate(plan.metadata, [(t.name, t.output.shape, t.qtype) for t in translated], to=dialect)
    if native and not table.keep_order:
        raise SourceError(f"{native[0].name}: a tensor built in the {dialect} dialect's names needs the table to "
                          f"keep the plan's order (a bug in the dialect tables)")
    by_name = {t.name: t for t in translated}
    tensors = [replace(by_name[move.source], output=dialect_output(by_name[move.source].output, move),
                       llama_cpp_name=move.source) for move in translation.moves]
    if native:   # the dialect keeps the plan's order: put them back where the plan has them
        moved = iter(tensors)
        tensors = [t if is_native(table, t.name) else next(moved) for t in plan.tensors]
    return replace(plan, tensors=tensors, metadata=translation.metadata, dialect=dialect)


def dialect_output(output: OutputTensor, move: TensorMove) -> OutputTensor:
    """The llama.cpp-dialect tensor ``output`` as ``move`` writes it in another dialect: its name and shape there,
    built from the same sources through the steps that dialect stores (:data:`_DIALECT_STEPS`)."""
    swap = _DIALECT_STEPS.get(move.layout, {})
    sources = tuple(replace(m, transform=tuple(swap.get(s, s) for s in m.transform if swap.get(s, s)))
                    for m in output.sources)
    return replace(output, gguf_name=move.name, shape=move.shape, sources=sources)


def _arch_of_plan(plan: Plan) -> str:
    return str(dict(plan.metadata)["general.architecture"].value)


def relaid_plan(plan: Plan, table, hp: Mapping[str, Any], source_shapes: Mapping[str, tuple[int, ...]]) -> Plan:
    """The plan in the ds4 dialect of an architecture ds4 lays out differently (:data:`quantkit.arch.dialects.ds4.
    RELAID`): each ds4 tensor built from the checkpoint rows the llama.cpp tensor is built from, through the table
    row's own transform steps (row slices, no head reordering), with the llama.cpp tensor's type."""
    by_name = {t.name: t for t in plan.tensors}
    tensors = []
    for ds4_name, llama_name, row in relaid_tensors(table, list(by_name)):
        t = by_name[llama_name]
        output = replace(t.output, gguf_name=ds4_name)
        if row.steps is not None:
            if len(t.output.sources) != 1:
                raise SourceError(f"ds4's {ds4_name} is built from one source tensor, the plan has "
                                  f"{len(t.output.sources)}", tensor=llama_name)
            source = replace(t.output.sources[0], transform=row.steps)
            shape = transforms.output_shape(row.steps, source_shapes[source.hf_name], hp)
            output = replace(output, shape=shape, sources=(source,))
        if row.columns_permuted and t.importance == "imatrix":
            raise RecipeError(f"ds4's {ds4_name} keeps the checkpoint's column order where llama.cpp tiles the V "
                              f"heads, so the imatrix entry {llama_name!r} does not apply column for column; give "
                              f"this tensor a type that ignores importance (Q8_0) or use bootstrap importance",
                              path=plan.recipe.where())
        tensors.append(replace(t, output=output, nbytes=tensor_nbytes(t.qtype, output.shape),
                               llama_cpp_name=llama_name))
    return replace(plan, tensors=tensors, metadata=relaid_metadata(plan.metadata, table), dialect="ds4")
