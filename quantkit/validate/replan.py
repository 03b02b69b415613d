"""Re-plan an artifact from its source and recipe, and compare the inventory: tensors, metadata, size, header.

What the re-plan needs comes from the artifact's provenance keys unless given (``--source``/``--recipe``/
``--imatrix`` override):

- **recipe**: ``quantkit.recipe.text``, parsed again;
- **source**: ``quantkit.source.repo`` at ``quantkit.source.revision``, from the local Hugging Face cache only
  (validation never downloads); an artifact converted from a plain directory records no path, so ``--source``;
- **imatrix**: ``quantize.imatrix.file`` when that file still exists and hashes to ``quantkit.imatrix.sha256``;
- **label**: ``quantkit.checkpoint_label``; **pre-tokenizer**: detected from the source's tokenizer, else the
  recorded ``tokenizer.ggml.pre`` (tiny or retrained vocabularies hash to nothing llama.cpp knows);
- **bootstrap importance** (``--bootstrap-importance`` of convert): inferred from ``quantkit.imatrix.calibration``;
  when that cannot tell (an imatrix plus bootstrapped tensors), both plans are made and the one whose
  ``quantkit.imatrix.bootstrap`` matches the artifact is kept;
- **support kind** (a drafter): ``quantkit.support.kind``; a source that holds no drafter of that kind, like a
  source of another architecture, is not the checkpoint the artifact was made from (ValidationError, exit 2).

The expected file is then laid out exactly as ``quantkit convert`` lays it out (plan metadata, then the provenance
keys of :mod:`quantkit.convert.provenance`), with three kinds of key taken from the artifact rather than computed:

- *run* keys, which describe the run and not the content: ``quantkit.version`` (the version that converted it;
  reported when it differs) and ``quantize.imatrix.file`` (the imatrix path as typed then);
- *identity* keys the source cannot always tell: ``quantkit.source.repo`` / ``quantkit.source.revision`` when the
  source was given as a plain directory (a Hugging Face snapshot knows its revision, and a different one is a
  difference);
- source file hashes not computed in this run (:data:`SHARD_SUFFIX` files outside ``--payload full``); those the
  run does compute are compared in the ``provenance.source`` check.

Inventory checks: ``inventory.tensors`` (missing, extra, different name/shape/type/offset, order),
``inventory.metadata`` (missing, extra, different keys: type and canonical encoding of the value, order),
``inventory.file_size`` and ``inventory.header`` (the header bytes equal the re-planned header).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from gguf.constants import GGUFValueType, Keys

from ..arch.dialects import dialect_of
from ..convert.execute import ConvertRequest, Prepared, file_layout, prepare
from ..convert.provenance import provenance_metadata
from ..convert.source import FileHash, ResolvedSource, hash_files, resolve_source
from ..convert.tensors import TensorJob
from ..errors import (MissingSourceError, RecipeError, SourceError, SupportError, UnsupportedError,
                      ValidationError)
from ..imatrix.bootstrap import BOOTSTRAP_KEY, CALIBRATION_KEY
from ..io.atomic import sha256_file
from ..io.gguf import KV, ArrayOf, type_name
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import Layout, plan_layout
from ..recipes import Recipe, load_recipe
from ..recipes.model import parse_recipe, text_sha256
from .report import Check, check, printable
from .structure import ArtifactReader

#: Source files hashed only when every payload is re-encoded (``--payload full``): the weight shards.
SHARD_SUFFIX = ".safetensors"
RUN_KEYS = ("quantkit.version", "quantize.imatrix.file")
IDENTITY_KEYS = ("quantkit.source.repo", "quantkit.source.revision")
#: Characters of a metadata value shown in a difference.
VALUE_CHARS_SHOWN = 60


class SourceFileHashes:
    """What a plan of the payload audit does with its source files (``files``, ``computed_hashes``,
    ``hashed_bytes``): the re-plan of a quantkit artifact and the plan read off a foreign one share it."""

    @property
    def shards(self) -> list[Path]:
        return [p for p in self.files if p.name.endswith(SHARD_SUFFIX)]

    def hash_file(self, path: Path) -> None:
        self.computed_hashes[path.name] = sha256_file(path)
        self.hashed_bytes += path.stat().st_size


@dataclass
class Replan(SourceFileHashes):
    """The re-planned artifact: the conversion's inputs, its jobs, the expected layout, and the source hashes."""

    prepared: Prepared
    jobs: dict[str, TensorJob]
    layout: Layout
    recipe_from: str
    imatrix_path: str | None
    recorded_hashes: dict[str, str]
    """Source file name -> SHA-256 the artifact records."""
    computed_hashes: dict[str, str] = field(default_factory=dict)
    """Source file name -> SHA-256 computed in this run."""
    files: list[Path] = field(default_factory=list)
    """The source files a conversion of this plan hashes (shards, configs, tokenizer)."""
    notes: list[str] = field(default_factory=list)
    hashed_bytes: int = 0

    def stored_name(self, name: str) -> str:
        """The artifact's name of planned tensor ``name`` (the same: quantkit writes llama.cpp's names)."""
        return name

    @property
    def source_path(self) -> Path:
        return self.prepared.source.path

    @property
    def model_type(self) -> str:
        return self.prepared.plan.model_type

    @property
    def imatrix_shapes(self) -> dict[str, tuple[int, int]]:
        return self.prepared.imatrix_shapes



# -- inputs ---------------------------------------------------------------------------------------------------

def _string(f: GGUFFile, key: str) -> str | None:
    """A recorded STRING value (None when absent or of another type: then it is reported as a difference)."""
    kv = f.metadata.get(key)
    return kv.value if kv is not None and kv.type is GGUFValueType.STRING else None


def _strings(f: GGUFFile, key: str) -> list[str]:
    kv = f.metadata.get(key)
    return list(kv.value) if kv is not None and kv.type == ArrayOf(GGUFValueType.STRING) else []


def tampered_recipe(f: GGUFFile, given: str | None) -> str | None:
    """Why the artifact cannot be re-planned from its own recipe: its recorded text does not hash to its recorded
    SHA-256 (an edited file, which ``structure.provenance`` fails); None when it can, or when ``given``."""
    text, recorded = _string(f, "quantkit.recipe.text"), _string(f, "quantkit.recipe.sha256")
    if given is not None or text is None or recorded is None:
        return None
    if text_sha256(text) == recorded:
        return None
    return "the recorded recipe does not hash to quantkit.recipe.sha256: pass --recipe to re-plan"


def _recipe(f: GGUFFile, given: str | None) -> tuple[Recipe, str]:
    if given is not None:
        return load_recipe(given), str(given)
    text = _string(f, "quantkit.recipe.text")
    if text is None:
        raise RecipeError("the artifact records no recipe (quantkit.recipe.text); pass --recipe", path=f.path)
    if printable(text) != text:
        raise RecipeError("the recorded recipe (quantkit.recipe.text) is not valid UTF-8; pass --recipe",
                          path=f.path)
    return parse_recipe(text, f"{f.path}:quantkit.recipe.text"), "artifact"


def _cached_source(repo: str, revision: str | None) -> ResolvedSource:
    """The recorded Hugging Face source from the local cache (never downloads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    from ..convert.source import DOWNLOAD_PATTERNS

    try:
        local = snapshot_download(repo, revision=revision, allow_patterns=list(DOWNLOAD_PATTERNS),
                                  local_files_only=True)
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as exc:
        where = printable(f"{repo}@{revision}" if revision else repo)
        raise MissingSourceError(f"the artifact's source {where!r} is not in the local Hugging Face cache "
                                 f"({printable(' '.join(str(exc).split()))[:120]}); pass --source DIR") from None
    return replace(resolve_source(local), given=repo, repo_id=repo)


def _source(f: GGUFFile, given: str | None) -> ResolvedSource:
    if given is not None:
        return resolve_source(given)
    repo = _string(f, "quantkit.source.repo")
    if repo is not None:
        return _cached_source(repo, _string(f, "quantkit.source.revision"))
    raise MissingSourceError("the artifact records no source repository (quantkit.source.repo: it was converted "
                             "from a local directory); pass --source DIR", path=f.path)


def _imatrix(f: GGUFFile, given: str | None) -> str | None:
    if given is not None:
        return str(given)
    recorded = _string(f, "quantkit.imatrix.sha256")
    if recorded is None:
        return None
    path = _string(f, "quantize.imatrix.file")
    if path and Path(path).is_file() and sha256_file(path) == recorded:
        return path
    raise MissingSourceError(f"the artifact was made with an imatrix (sha256 {printable(recorded[:16])!r}…, given as "
                             f"{printable(path or '')!r}) that is not available there; pass --imatrix FILE",
                             path=f.path)


def _pre_tokenizer(f: GGUFFile, source: Path) -> str | None:
    from ..arch.tokenizer import detect_pre_tokenizer

    recorded = _string(f, Keys.Tokenizer.PRE)
    if not (source / "tokenizer.json").is_file():
        return recorded
    try:
        return detect_pre_tokenizer(source)
    except (SourceError, UnsupportedError):
        return recorded


def _bootstrap_candidates(f: GGUFFile, imatrix: str | None) -> list[bool]:
    calibration = _string(f, CALIBRATION_KEY)
    if calibration == "bootstrap" and imatrix is None:
        return [True]
    if calibration == "imatrix+bootstrap" and imatrix is not None:
        return [False, True]   # unobserved experts alone, or also tensors the imatrix lacks: see the docstring
    return [False]


# -- planning ---------------------------------------------------------------------------------------------------

def _expected_provenance(f: GGUFFile, prepared: Prepared, jobs: dict[str, TensorJob], files: list[Path],
                         hashes: dict[str, str], imatrix_path: str | None, notes: list[str]) -> list[tuple[str, KV]]:
    plan = prepared.plan
    recorded_given = _string(f, "quantize.imatrix.file")
    entries = provenance_metadata(
        jobs=list(jobs.values()), recipe=plan.recipe, recipe_tag=plan.name_tag, source=prepared.source,
        file_hashes=[FileHash(p.name, 0, 0, hashes.get(p.name, "")) for p in files], imatrix=prepared.imatrix,
        imatrix_given=recorded_given if recorded_given is not None else imatrix_path, label=plan.label,
        support=plan.support)
    expected = dict(entries)
    for key in RUN_KEYS:
        if key in expected and key in f.metadata and f.metadata[key].type == expected[key].type:
            if f.metadata[key].value != expected[key].value and key == "quantkit.version":
                notes.append(f"converted by quantkit {f.metadata[key].value}, validated with "
                             f"{expected[key].value}")
            expected[key] = f.metadata[key]
    synthetic = f.metadata.get("quantkit.imatrix.synthetic")
    if synthetic is not None and synthetic.value is True:
        notes.append("the imatrix is marked synthetic (quantkit.imatrix.synthetic): not release calibration")
    for key in IDENTITY_KEYS:
        if key not in expected and key in f.metadata:
            notes.append(f"{key} = {f.metadata[key].value!r} is not verified: the source given does not know it")
            expected[key] = f.metadata[key]
    # identity keys taken from the artifact go where convert puts them: after the recipe keys, in order
    order = [k for k, _ in entries]
    anchor = "quantkit.recipe.tag"
    for key in IDENTITY_KEYS:
        if key not in order and key in expected:
            order.insert(order.index(anchor) + 1, key)
        anchor = key if key in order else anchor
    return [(k, expected[k]) for k in order]


def _require_same_architecture(f: GGUFFile, candidate: "Replan", resolved: ResolvedSource) -> None:
    """Another model's checkpoint is an input that does not belong (exit 2, one line), not a list of every tensor
    that differs."""
    key = "general.architecture"
    ours, theirs = f.metadata.get(key), candidate.layout.metadata.get(key)
    if ours is not None and theirs is not None and ours.value != theirs.value:
        raise ValidationError(f"the artifact is a {ours.value!r} model, the source a {candidate.model_type!r} one "
                              f"({theirs.value!r}): not the checkpoint it was made from", path=resolved.path,
                              field="model_type")


def replan(f: GGUFFile, *, source: str | None = None, recipe: str | None = None, imatrix: str | None = None
           ) -> Replan:
    """Re-plan ``f`` from its source and recipe (see the module docstring)."""
    recipe_obj, recipe_from = _recipe(f, recipe)
    resolved = _source(f, source)
    imatrix_path = _imatrix(f, imatrix)
    pre = _pre_tokenizer(f, resolved.path)
    label = _string(f, "quantkit.checkpoint_label")
    support = _string(f, "quantkit.support.kind")
    recorded_hashes = dict(zip(_strings(f, "quantkit.source.files"), _strings(f, "quantkit.source.sha256")))

    fallback: Replan | None = None
    failure: Exception | None = None
    for bootstrap in _bootstrap_candidates(f, imatrix_path):
        request = ConvertRequest(source=str(resolved.path), out=Path(f.path), recipe=recipe_obj,
                                 imatrix=imatrix_path, bootstrap=bootstrap, allow_synthetic_imatrix=True,
                                 label=label, pre_tokenizer=pre, progress=False, dialect=dialect_of(f.metadata),
                                 support=support)
        try:
            prepared = prepare(request)
        except RecipeError as exc:   # e.g. a type requires importance only bootstrap gives
            failure = failure or exc
            continue
        except SupportError as exc:   # quantkit made this drafter from its checkpoint: this source lacks it
            raise ValidationError(f"the artifact is a --support {support} drafter, but {exc.detail}: not the "
                                  f"checkpoint it was made from", path=resolved.path, field="support") from None
        candidate = _candidate(f, prepared, resolved, recipe_from, imatrix_path, recorded_hashes)
        _require_same_architecture(f, candidate, resolved)
        if _same_kv(candidate.layout.metadata.get(BOOTSTRAP_KEY), f.metadata.get(BOOTSTRAP_KEY)):
            return candidate
        fallback = fallback or candidate
    if fallback is None:
        raise failure
    return fallback


def _candidate(f: GGUFFile, prepared: Prepared, resolved: ResolvedSource, recipe_from: str,
               imatrix_path: str | None, recorded_hashes: dict[str, str]) -> Replan:
    """The re-plan of one set of convert options: jobs, source files and hashes, expected layout."""
    prepared.source = replace(prepared.source, given=resolved.given, repo_id=resolved.repo_id,
                              revision=resolved.revision)
    jobs, files = prepared.jobs, prepared.files
    small = [p for p in files if not p.name.endswith(SHARD_SUFFIX)]
    computed = {h.name: h.sha256 for h in hash_files(small)}
    notes: list[str] = []
    metadata = _expected_provenance(f, prepared, jobs, files, {**recorded_hashes, **computed}, imatrix_path, notes)
    layout = file_layout(prepared.plan, metadata, jobs.values())
    return Replan(prepared, jobs, layout, recipe_from, imatrix_path, recorded_hashes, computed, files, notes,
                  sum(p.stat().st_size for p in small))


# -- comparing ----------------------------------------------------------------------------------------------------

def _encoded(key: str, kv: KV) -> bytes:
    """The canonical GGUF encoding of one key/value pair (type included)."""
    return plan_layout([(key, kv)], []).header


def _same_kv(a: KV | None, b: KV | None) -> bool:
    if a is None or b is None:
        return a is b
    return _encoded("k", a) == _encoded("k", b)


def _show(kv: KV) -> str:
    value = kv.value
    if isinstance(kv.type, ArrayOf):
        items = list(value[:3]) if not isinstance(value, list) else value[:3]
        shown = f"[{len(value)} items] {items}" + ("…" if len(value) > 3 else "")
    else:
        shown = repr(value)
    shown = shown if len(shown) <= VALUE_CHARS_SHOWN else shown[:VALUE_CHARS_SHOWN] + "…"
    return f"{type_name(kv.type)} {shown}"


def _show_difference(found: KV, expected: KV) -> str:
    """Found and expected values; for two arrays of one type and length, the first item that differs (their first
    items alike say nothing of a token changed deep in a vocabulary)."""
    if isinstance(found.type, ArrayOf) and found.type == expected.type and len(found.value) == len(expected.value):
        def encoded(value, i):   # one item as its array type encodes it
            return _encoded("k", KV([value[i]], found.type))

        i = next((i for i in range(len(found.value)) if encoded(found.value, i) != encoded(expected.value, i)), None)
        if i is not None:
            item = f"item {i} of {len(found.value)}: {found.value[i]!r}, expected {expected.value[i]!r}"
            return f"{type_name(found.type)} " + (item if len(item) <= VALUE_CHARS_SHOWN else
                                                 item[:VALUE_CHARS_SHOWN] + "…")
    return f"{_show(found)}, expected {_show(expected)}"


def _first_difference(a: list, b: list) -> str:
    return next(f"{x!r} where {y!r} was expected" for x, y in zip(a, b) if x != y)


def tensors_check(f: GGUFFile, expected: Layout) -> Check:
    found, planned = f.tensors, expected.tensors
    problems = [f"missing {n} ({t.type.name}{list(t.shape)})" for n, t in planned.items() if n not in found]
    problems += [f"extra {n} ({t.type.name}{list(t.shape)})" for n, t in found.items() if n not in planned]
    for name, want in planned.items():
        got = found.get(name)
        if got is None:
            continue
        diffs = [f"{what} {g} (expected {w})" for what, g, w in
                 (("type", got.type.name, want.type.name), ("shape", list(got.shape), list(want.shape)),
                  ("offset", got.offset, want.offset)) if g != w]
        if diffs:
            problems.append(f"{name}: " + ", ".join(diffs))
    common_found = [n for n in found if n in planned]
    common_planned = [n for n in planned if n in found]
    if common_found != common_planned:
        problems.append(f"tensor order differs: {_first_difference(common_found, common_planned)}")
    return check("inventory.tensors", problems, passed=f"{len(planned)} tensors: names, shapes, types and offsets "
                                                         f"as planned")


def metadata_check(f: GGUFFile, expected: Layout) -> Check:
    found, planned = f.metadata, expected.metadata
    problems = [f"missing {k} ({_show(kv)})" for k, kv in planned.items() if k not in found]
    problems += [f"extra {k} ({_show(kv)})" for k, kv in found.items() if k not in planned]
    problems += [f"{k}: {_show_difference(found[k], kv)}" for k, kv in planned.items()
                 if k in found and not _same_kv(found[k], kv)]
    common_found = [k for k in found if k in planned]
    common_planned = [k for k in planned if k in found]
    if common_found != common_planned:
        problems.append(f"key order differs: {_first_difference(common_found, common_planned)}")
    return check("inventory.metadata", problems, passed=f"{len(planned)} keys with the planned types and values")


def size_and_header_checks(f: GGUFFile, expected: Layout, reader: ArtifactReader) -> list[Check]:
    size = [] if f.file_size == expected.file_size else [
        f"the file has {f.file_size:,} bytes, the plan {expected.file_size:,}"]
    n = min(len(expected.header), f.file_size)
    found = reader.read(0, n).tobytes()
    header = []
    if found != expected.header:
        at = next((i for i, (a, b) in enumerate(zip(found, expected.header)) if a != b), n)
        header.append(f"the header differs from the re-planned header at byte {at:,} (header of "
                      f"{len(expected.header):,} bytes)")
    return [check("inventory.file_size", size, passed=f"{expected.file_size:,} bytes as planned"),
            check("inventory.header", header, passed=f"{len(expected.header):,} header bytes identical to the plan")]


def source_check(f: GGUFFile, plan: Replan, *, shards_hashed: bool) -> Check:
    """Source revision, and every source file hash computed in this run against the recorded one."""
    problems = []
    source = plan.prepared.source
    recorded_revision = _string(f, "quantkit.source.revision")
    if source.revision is not None and recorded_revision is not None and source.revision != recorded_revision:
        problems.append(f"the source is revision {source.revision}, the artifact was made from {recorded_revision}")
    for name, digest in sorted(plan.computed_hashes.items()):
        recorded = plan.recorded_hashes.get(name)
        if recorded is not None and recorded != digest:
            problems.append(f"{name}: SHA-256 {digest[:16]}… differs from the recorded {recorded[:16]}…")
    verified = sum(1 for n in plan.computed_hashes if n in plan.recorded_hashes)
    scope = "" if shards_hashed else f"; the {len(plan.shards)} weight shards are hashed only with --payload full"
    where = source.repo_id + (f"@{source.revision}" if source.revision else "") if source.repo_id else str(source.path)
    return check("provenance.source", problems,
                 passed=f"{where}: {verified} of {len(plan.recorded_hashes)} recorded file hashes verified{scope}")


def inventory_checks(f: GGUFFile, plan: Replan, reader: ArtifactReader) -> list[Check]:
    return [tensors_check(f, plan.layout), metadata_check(f, plan.layout),
            *size_and_header_checks(f, plan.layout, reader)]


def describe_inputs(plan: Replan) -> tuple[dict, dict, dict | None]:
    """The source, recipe and imatrix the re-plan used, for the report."""
    source = plan.prepared.source
    recipe = plan.prepared.plan.recipe
    imatrix = plan.prepared.imatrix
    return ({"path": str(source.path), "repo": source.repo_id, "revision": source.revision},
            {"name": recipe.name, "sha256": recipe.sha256, "from": plan.recipe_from},
            None if imatrix is None else {"path": plan.imatrix_path, "sha256": imatrix.sha256})


__all__ = ["Replan", "describe_inputs", "inventory_checks", "replan", "source_check", "tampered_recipe"]
