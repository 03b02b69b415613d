"""Validate a GGUF that quantkit did not write (llama.cpp's ``convert_hf_to_gguf.py`` + ``llama-quantize``, ...).

Such a file records no recipe and no provenance, so its plan is inferred from the file itself: each tensor's
stored type is its recipe.  Each tensor name is mapped back to the source tensors it comes from through the
architecture map (:meth:`quantkit.arch.ArchMap.outputs`, whose GGUF names are llama.cpp's; a file in another
dialect is first seen through :func:`quantkit.arch.gguf_config.llama_cpp_view`), and a tensor is **proven** when
re-encoding its source to the stored type gives the stored bytes (every byte with ``--payload full``, the sampled
experts and rows with ``sample``).

A tensor quantkit cannot reproduce is **unproven**, with the reason, never passed silently:

- no source tensor maps to its name (a tensor the writer adds);
- quantkit has no encoder for its type;
- its type requires an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S) and none was given, or the imatrix has no entry
  for it; or its type uses importance, the file records an imatrix (``quantize.imatrix.file``) and none was given;
- the imatrix never observed some of its experts (llama-quantize weighs those with ones; quantkit's converter
  does not make that choice).

Importance follows llama-quantize: a type that uses importance gets the imatrix entry when one exists, none
otherwise.  FP4 sources stored as MXFP4 are compared as the lossless repack llama.cpp's converter makes.

The checks: ``inventory.tensors`` (every file tensor has a source of the same shape; every tensor the source maps
to is in the file), ``inventory.metadata`` (every hyperparameter key the source config implies, where the file
has it, holds the same value), ``payload.bytes`` / ``payload.error`` (:mod:`.payload`) and ``payload.proof``
("N of M tensors proven, K unproven (reasons)": failed when K > 0).  Without a source only the structure is
checked, and the report says so.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..arch import OutputTensor, get_arch
from ..arch.dialects import DS4, dialect_of, translate
from ..arch.gguf_config import llama_cpp_view
from ..convert.plan import inspect_sources
from ..convert.source import ResolvedSource, provenance_files, resolve_source
from ..convert.tensors import TensorJob, imatrix_shapes, load_model_imatrix
from ..errors import QuantkitError, SourceError, UnsupportedError
from ..formats.api import tensor_nbytes
from ..formats.registry import GGMLType, ImatrixUse, get_format
from ..io.checkpoint import open_checkpoint
from ..io.gguf import ggml_dims
from ..io.gguf_reader import GGUFFile
from .replan import SourceFileHashes, _show, _same_kv
from .report import FAILED, PASSED, SKIPPED, Check, check

#: Keys that describe the writer or the tokenizer, not the model's hyperparameters.
UNCOMPARED_KEY_PREFIXES = ("general.", "tokenizer.", "quantize.", "quantkit.", "GGUF.", "split.")
#: Reasons listed per unproven tensor kind in the proof check's detail.
REASONS_SHOWN = 4


def is_foreign(f: GGUFFile) -> bool:
    """A file without quantkit's recorded recipe: its plan must be inferred from the file itself."""
    return "quantkit.recipe.text" not in f.metadata


@dataclass
class ForeignPlan(SourceFileHashes):
    """The plan read off a foreign file: a job per provable tensor, a reason per unproven one."""

    source: ResolvedSource
    model_type: str
    jobs: dict[str, TensorJob]
    unproven: dict[str, str]
    outputs: dict[str, OutputTensor]
    expected_metadata: dict
    imatrix_path: str | None
    imatrix_shapes: dict[str, tuple[int, int]]
    stored: dict[str, str] = field(default_factory=dict)
    """llama.cpp tensor name -> the name stored in the file (:func:`~quantkit.arch.gguf_config.llama_cpp_view`)."""
    file_metadata: dict = field(default_factory=dict)
    """The file's keys under llama.cpp's names (its dialect's keys translated), as ``expected_metadata``'s."""
    files: list[Path] = field(default_factory=list)
    computed_hashes: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hashed_bytes: int = 0

    def stored_name(self, name: str) -> str:
        return self.stored.get(name, name)

    @property
    def source_path(self) -> Path:
        return self.source.path



def _lossless(qtype: GGMLType, encoding: str, output: OutputTensor) -> str:
    if qtype == GGMLType.MXFP4 and encoding == "fp4-e8m0":
        return "mxfp4-repack"
    if qtype == GGMLType.I32 and output.dtype == "int32":   # an integer table (V4's hash routing), as convert copies it
        return "copy"
    return "encode"


def _job(name: str, qtype: GGMLType, output: OutputTensor, encoding: str, imatrix, imatrix_used: str | None
         ) -> tuple[TensorJob | None, str]:
    """The job proving one tensor, or None and why it cannot be proven (``imatrix_used``: the imatrix file the
    artifact records, when it records one)."""
    fmt = get_format(qtype)
    kind = _lossless(qtype, encoding, output)
    if kind == "encode" and not fmt.can_encode:
        return None, f"quantkit cannot encode {qtype.name}"
    if kind == "encode" and fmt.imatrix is not ImatrixUse.IGNORED and imatrix is None and imatrix_used is not None:
        return None, f"{qtype.name} quantized with an imatrix ({imatrix_used!r}); pass --imatrix"
    importance = "none"
    if kind == "encode" and fmt.imatrix is not ImatrixUse.IGNORED and imatrix is not None and name in imatrix.entries:
        importance = "imatrix"
        matrices = range(output.shape[0]) if len(output.shape) == 3 else (None,)
        unobserved = [m for m in matrices if imatrix.importance(name, expert=m) is None]
        if unobserved:
            return None, f"the imatrix never observed matrices {unobserved[:4]} (llama-quantize weighs them 1)"
    elif kind == "encode" and fmt.imatrix is ImatrixUse.REQUIRED:
        return None, (f"{qtype.name} requires the imatrix the file was made with (pass --imatrix)" if imatrix is None
                      else f"{qtype.name} requires importance and the imatrix has no entry for it")
    return TensorJob(name, qtype, output, tensor_nbytes(qtype, output.shape), kind, importance), ""


def _source_values(ckpt, name: str):
    """A source tensor as metadata takes it: integers as stored (hash constants), floats as float32."""
    info = ckpt.tensor_info(name)
    return np.asarray(ckpt.raw(name)) if info.dtype.startswith(("I", "U")) else ckpt.tensor_f32(name)


def foreign_plan(f: GGUFFile, source: str, imatrix: str | None) -> tuple[ForeignPlan, list[str]]:
    """The plan inferred from ``f`` against ``source``, and the inventory problems found on the way."""
    resolved = resolve_source(source)
    view = llama_cpp_view(f.metadata, f.tensors)
    if view.relaid_table is not None:
        raise UnsupportedError(f"proving a {view.relaid_table.ds4_arch} file quantkit did not write is not "
                               f"implemented (its tensors are built from the checkpoint rows, not from llama.cpp's "
                               f"tensors); structure checks run without --source", path=f.path)
    metadata, stored, relaid = view.metadata, view.stored, view.relaid
    by_name = {name: f.tensors[s] for name, s in stored.items() if name not in relaid}
    with open_checkpoint(resolved.path) as ckpt:
        model_type = ckpt.config.get("model_type")
        if not isinstance(model_type, str):
            raise SourceError("no config.json in the checkpoint" if not ckpt.has_config else
                              f"config.json gives no model_type (found {model_type!r})", path=ckpt.path,
                              field="model_type")
        table = get_arch(model_type)
        amap = table.bind(ckpt.config, mtp_dialect=dialect_of(f.metadata) if _keeps_mtp(f, table.gguf_arch) else None)
        shapes, encodings = inspect_sources(ckpt)
        outputs = {o.gguf_name: o for o in amap.outputs(shapes)}
        expected = dict(amap.metadata(None, tensor_values=lambda name: _source_values(ckpt, name),
                                      tensor_shapes=shapes))
        shards = ckpt.shard_paths()
    arch = metadata.get("general.architecture")
    if arch is not None and arch.value != amap.arch.gguf_arch:
        raise SourceError(f"the artifact is a {arch.value!r} model, the source a {model_type!r} one "
                          f"({amap.arch.gguf_arch!r})", path=resolved.path, field="model_type")
    shape_table = imatrix_shapes(outputs.values())
    loaded = None if imatrix is None else load_model_imatrix(imatrix, amap, shape_table, allow_synthetic=True)
    recorded = f.metadata.get("quantize.imatrix.file")
    imatrix_used = None if recorded is None else str(recorded.value)
    problems, jobs = [], {}
    # the payload audit compares stored bytes with llama.cpp-layout encodings: a tensor the file's dialect lays
    # out otherwise is named, not compared (quantkit redialect converts it, checked both ways)
    unproven = {move.source: f"stored in the {dialect_of(f.metadata)} dialect's own layout ({move.layout}); not "
                             f"compared" for move in relaid.values()}
    for name, t in by_name.items():
        o = outputs.get(name)
        if o is None:
            unproven[t.name] = "no source tensor maps to it"
            continue
        if ggml_dims(t.shape) != ggml_dims(o.shape):
            problems.append(f"{t.name}: shape {list(t.shape)}, the source gives {list(o.shape)}")
            continue
        encoding = {encodings[m.hf_name] for m in o.sources}
        job, why = _job(name, t.type, o, encoding.pop() if len(encoding) == 1 else "mixed", loaded, imatrix_used)
        if job is None:
            unproven[name] = why
        else:
            jobs[name] = job
    problems += [f"missing {n} ({list(o.shape)}): the source maps a tensor the file lacks" for n, o in outputs.items()
                 if n not in by_name and n not in relaid]
    plan = ForeignPlan(resolved, model_type, jobs, unproven, outputs, expected, imatrix, shape_table, stored,
                       dict(metadata))
    plan.files = provenance_files(resolved, shards)
    plan.notes.append("not written by quantkit: the plan is the file's own tensor types (each tensor re-encoded "
                      "from the source to its stored type)")
    return plan, problems


def _keeps_mtp(f: GGUFFile, gguf_arch: str) -> bool:
    """Whether the file carries the MTP blocks the architecture's default map drops (:attr:`quantkit.arch.base.Arch.
    mtp_rules`): llama.cpp counts them (``nextn_predict_layers``), ds4 names them ``mtp.K.*``."""
    return f"{gguf_arch}.nextn_predict_layers" in f.metadata or any(n.startswith("mtp.") for n in f.tensors)


# -- checks -------------------------------------------------------------------------------------------------------

def tensors_check(f: GGUFFile, plan: ForeignPlan, problems: list[str]) -> Check:
    return check("inventory.tensors", problems,
                 passed=f"{len(f.tensors)} tensors: each maps to the source with its shape"
                        + (f" ({len(plan.unproven)} without a source)" if any(
                            r == "no source tensor maps to it" for r in plan.unproven.values()) else ""))


def metadata_check(f: GGUFFile, plan: ForeignPlan) -> Check:
    """Every hyperparameter the source config implies equals the file's, where the file has the key: compared under
    llama.cpp's names (a ds4-dialect file's keys translated, so its own types and meanings are not differences),
    and a ds4 file's keys that llama.cpp has no name for against the source's translation to ds4's; a llama.cpp
    file's hyperparameter key the source does not imply (RoPE scaling added) is a difference too."""
    problems, compared, absent = [], 0, []
    for key, kv, found in _expected_pairs(f, plan):
        if found is None:
            absent.append(key)
            continue
        compared += 1
        if not _same_kv(found, kv):
            problems.append(f"{key}: {_show(found)}, the source config gives {_show(kv)}")
    if absent:
        plan.notes.append(f"{len(absent)} hyperparameter keys the source implies are not in the file: "
                          f"{', '.join(absent[:6])}")
    arch = f.metadata.get("general.architecture")
    if arch is not None and dialect_of(f.metadata) != DS4:   # ds4's keys seen as llama.cpp's add some by design
        for key, kv in f.metadata.items():   # one the source does not imply changes what llama.cpp computes (RoPE)
            if key.startswith(f"{arch.value}.") and key not in plan.expected_metadata:
                problems.append(f"{key}: {_show(kv)}, which the source config does not imply")
    return check("inventory.metadata", problems,
                 passed=f"{compared} hyperparameter keys equal what the source config implies")


def _expected_pairs(f: GGUFFile, plan: ForeignPlan):
    """(key, expected value, the file's value or None) for each compared hyperparameter key."""
    for key, kv in plan.expected_metadata.items():
        if not key.startswith(UNCOMPARED_KEY_PREFIXES):
            yield key, kv, plan.file_metadata.get(key)
    if dialect_of(f.metadata) != DS4 or plan.file_metadata.get("general.architecture") is None:
        return
    # ds4's own keys (its vocab_size, say) have no llama.cpp name: the source's keys translated to ds4's give them
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    source_keys = {**plan.expected_metadata, **({} if tokens is None else {"tokenizer.ggml.tokens": tokens})}
    try:
        ds4_keys = dict(translate(source_keys, [(n, o.shape, GGMLType.F32) for n, o in plan.outputs.items()],
                                  to=DS4).metadata)
    except QuantkitError as exc:
        plan.notes.append(f"ds4's own keys not compared: the source's keys do not translate to ds4's ({exc})")
        return
    for key, kv in ds4_keys.items():
        if key not in plan.expected_metadata and not key.startswith(UNCOMPARED_KEY_PREFIXES):
            yield key, kv, f.metadata.get(key)


def proof_check(total: int, results: list[dict], unproven: dict[str, str], mode: str) -> Check:
    """``N of M tensors proven, K unproven (reasons)``: failed when anything is unproven or differs."""
    proven = sum(1 for r in results if r["match"])
    differing = sum(1 for r in results if not r["match"])
    reasons = Counter(unproven.values())
    why = "; ".join(f"{count}: {reason}" for reason, count in reasons.most_common(REASONS_SHOWN))
    scope = " (sampled experts and rows)" if mode == "sample" and any(r["compared"] == "sample" for r in results) \
        else ""
    # tensors neither compared nor unproven for a reason: the inventory check names them (a shape, a type)
    uncompared = total - proven - differing - len(unproven)
    detail = f"{proven} of {total} tensors proven{scope}"
    if differing:
        detail += f", {differing} differ"
    if unproven:
        detail += f", {len(unproven)} unproven ({why})"
    if uncompared:
        detail += f", {uncompared} not compared (see inventory.tensors)"
    items = [f"{name}: {reason}" for name, reason in unproven.items()]
    return Check("payload.proof", FAILED if unproven or differing or uncompared else PASSED, detail, items)


def unverified_checks(total: int, why: str) -> list[Check]:
    """The checks a foreign file without a source cannot run, each saying so."""
    return [Check(name, SKIPPED, why) for name in ("inventory.tensors", "inventory.metadata", "payload.bytes",
                                                   "payload.error")] + [
        Check("payload.proof", SKIPPED, f"0 of {total} tensors proven: {why}")]


def source_hash_check(plan: ForeignPlan) -> Check:
    return Check("provenance.source", SKIPPED,
                 f"{plan.source.path}: the file records no source hashes to verify"
                 + (f" ({len(plan.computed_hashes)} shards hashed for the report)" if plan.computed_hashes else ""))


__all__ = ["ForeignPlan", "foreign_plan", "is_foreign", "metadata_check", "proof_check", "source_hash_check",
           "tensors_check", "unverified_checks"]
