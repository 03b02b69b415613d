"""``quantkit validate``: audit an artifact against its format, its plan and its source.

:func:`validate` takes a GGUF file or a swapset sidecar and returns a :class:`~.report.Report` listing every
check.  For a GGUF file, in order:

1. **structure** (:mod:`.structure`, :mod:`.rowdata`): what the reader verifies on open, then layout, file size,
   padding, finite block scales, metadata and provenance keys;
   an Engram file's hash spec against its tables (:mod:`.engram`: ``engram.spec``; invalid Engram rows are
   reported by ``structure.scales``);
2. **inventory** (:mod:`.replan`): the file re-planned from its source and recipe (recorded in the artifact unless
   given) and compared tensor by tensor, key by key, size and header bytes; the source's recorded file hashes
   (``provenance.source``);
3. **payload** (:mod:`.payload`): every tensor, or a sample, re-encoded from the source with the converter's own
   code (:func:`quantkit.convert.tensors.pieces`) and compared byte for byte, with each tensor's dequantized error against a per-type bound;
4. **name** (:mod:`.naming`, only when the file name claims something): the recipe types, imatrix and checkpoint
   label its name claims (:mod:`quantkit.names`) against its tensors and provenance (``name.claims``).

A GGUF quantkit did not write (no recorded recipe, none given: llama.cpp's converter and llama-quantize, ...) is
validated by :mod:`.foreign`: its plan is inferred from the file (each tensor's stored type), each tensor re-encoded
from ``source`` and compared, and the verdict counts the tensors proven and those that could not be (with why);
without a source only the structure is checked, and the report says so.

Input that cannot be read (not GGUF, truncated, malformed header, missing source or recipe) raises a
:class:`~quantkit.errors.QuantkitError`; everything else is a check in the report.  ``structure_only`` skips 2
and 3 (no source needed).  A path ending ``.json`` or ``.safetensors`` is a sidecar: it is handed to
:func:`quantkit.swapset.validate_sidecar` and its checks are reported as ``sidecar.<check>``.  A transport
manifest (``<file>.transport.json``) or a llama.cpp split shard (``<stem>-00001-of-00003.gguf``) is validated as
transport parts by :mod:`.transport`: the parts' sizes and hashes and the whole file's hash without assembling it,
or the shard set's split keys and tensor index.

Bytes read: ``none`` and ``full`` read every payload byte of the artifact once; ``sample`` reads the header and the
sampled regions only (the report's ``io`` section counts them).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..errors import UnsupportedError
from ..evidence import evidence
from ..io.gguf import ggml_dims
from ..io.gguf_reader import GGUFFile
from .foreign import foreign_plan, is_foreign, proof_check, source_hash_check, unverified_checks
from .foreign import metadata_check as foreign_metadata_check
from .foreign import tensors_check as foreign_tensors_check
from .engram import row_stores, spec_check
from .naming import name_checks
from .support import target_check
from .payload import PAYLOAD_MODES, audit
from .replan import describe_inputs, inventory_checks, replan, source_check, tampered_recipe
from .report import FAILED, PASSED, Check, Report, skipped
from ..transport.manifest import is_manifest
from .transport import is_shard, validate_manifest, validate_shards
from .structure import (ArtifactReader, ScaleScan, header_check, layout_checks, metadata_check, padding_check,
                        provenance_check, scan_tensor, shapes_check)

SIDECAR_SUFFIXES = (".json", ".safetensors")
INVENTORY_CHECKS = ("inventory.tensors", "inventory.metadata", "inventory.file_size", "inventory.header",
                    "provenance.source")


def validate(artifact: str | os.PathLike, *, source: str | None = None, recipe: str | None = None,
             imatrix: str | None = None, payload: str = "sample", seed: int = 0, structure_only: bool = False,
             command: Sequence[str] | None = None, target: str | os.PathLike | None = None) -> Report:
    """Validate ``artifact`` (see the module docstring).  The report's evidence record
    (:func:`quantkit.evidence.evidence`) gives the artifact's SHA-256 and size and ``command`` (default
    ``sys.argv``).  With ``target``, ``artifact`` is a support (drafter) file that must come from the same
    checkpoint as the GGUF ``target`` (:mod:`.support`: ``support.target``)."""
    if payload not in PAYLOAD_MODES:
        raise UnsupportedError(f"payload mode {payload!r} is not one of {PAYLOAD_MODES}")
    path = Path(artifact)
    if is_manifest(path):
        report = validate_manifest(path, payload)
    elif is_shard(path):
        asked = {"--source": source, "--recipe": recipe, "--imatrix": imatrix, "--target": target,
                 "--payload full": payload == "full" or None}
        report = validate_shards(path, [option for option, value in asked.items() if value is not None])
    elif path.suffix in SIDECAR_SUFFIXES:
        report = _sidecar(path, payload, seed)
    else:
        sequential = structure_only or payload != "sample"
        with GGUFFile(path) as f, ArtifactReader(path, f.file_size, sequential=sequential) as reader:
            report = _gguf(f, reader, source=source, recipe=recipe, imatrix=imatrix, payload=payload, seed=seed,
                           structure_only=structure_only)
            if target is not None:
                report.checks.append(target_check(f, target))
    # the CPU re-encodes payloads in the converter's own types: no model runs, so no dtype
    report.evidence = evidence(artifact=path, device="cpu", command=command)
    return report


def _gguf(f: GGUFFile, reader: ArtifactReader, *, source, recipe, imatrix, payload: str, seed: int,
          structure_only: bool) -> Report:
    mode = "none" if structure_only else payload
    if recipe is None and is_foreign(f):
        return _foreign(f, reader, source=None if structure_only else source, imatrix=imatrix, mode=mode, seed=seed)
    report = Report(str(f.path), "gguf", mode, seed)
    not_replanned = "--structure-only" if structure_only else tampered_recipe(f, recipe)
    plan = None if not_replanned else replan(f, source=source, recipe=recipe, imatrix=imatrix)
    if plan is not None and recipe is None and requantized(f, plan):
        report = _foreign(f, reader, source=source or str(plan.prepared.source.path), imatrix=imatrix, mode=mode,
                          seed=seed)
        report.notes.insert(0, "re-quantized by another tool (llama-quantize keeps the keys it finds): the tensor "
                               "types and general.file_type are not those of the recorded quantkit recipe, which "
                               "describes the file it was made from; proven as a file quantkit did not write")
        return report
    scan = ScaleScan(row_stores(f))
    if plan is None:
        payload_checks = [skipped(name, not_replanned) for name in ("payload.bytes", "payload.error")]
    else:
        payload_checks, report.tensors = audit(f, plan, reader, scan, mode, seed)
    _scan_rest(f, reader, scan, report.tensors, mode)
    scope = "sampled regions only" if mode == "sample" else "every block"
    report.checks = [header_check(f), *layout_checks(f), padding_check(reader, f, payloads=mode != "sample"),
                     scan.check(f.tensors, scope), metadata_check(f), shapes_check(f), provenance_check(f)]
    report.checks += [c for c in (spec_check(f),) if c is not None]
    if plan is None:
        report.checks += [skipped(name, not_replanned) for name in INVENTORY_CHECKS]
    else:
        report.source, report.recipe, report.imatrix = describe_inputs(plan)
        report.checks += [*inventory_checks(f, plan, reader), source_check(f, plan, shards_hashed=mode == "full")]
        report.notes = list(plan.notes)
    report.checks += payload_checks + name_checks(f)
    if mode == "sample":
        report.sampled_bytes = (sum(t["bytes_compared"] for t in report.tensors),
                                sum(t.nbytes for t in f.tensors.values()))
    report.io = {"artifact_bytes": f.file_size, "header_bytes": f.data_offset,
                 "artifact_bytes_read": reader.bytes_read,
                 "source_files_hashed_bytes": 0 if plan is None else plan.hashed_bytes}
    return report


def requantized(f: GGUFFile, plan) -> bool:
    """Whether ``f`` is a quantkit artifact another tool re-quantized: the planned tensors by name and shape, some
    in other types, and a ``general.file_type`` the plan's types do not give (an edited tensor type alone keeps
    quantkit's file type, and fails the inventory)."""
    planned = plan.layout.tensors
    if set(planned) != set(f.tensors) or any(ggml_dims(planned[n].shape) != ggml_dims(t.shape)
                                             for n, t in f.tensors.items()):
        return False
    recorded, expected = f.metadata.get("general.file_type"), plan.layout.metadata.get("general.file_type")
    return (any(planned[n].type != t.type for n, t in f.tensors.items()) and recorded is not None
            and expected is not None and recorded.value != expected.value)


def _scan_rest(f: GGUFFile, reader: ArtifactReader, scan: ScaleScan, tensors: list[dict], mode: str) -> None:
    """Outside ``sample`` mode every block is scanned: those the payload audit did not read are read now."""
    if mode == "sample":
        return
    compared = {t["name"] for t in tensors if t["compared"] == "full"}
    for t in f.tensors.values():
        if t.name not in compared:
            scan_tensor(reader, f, t, scan)


def _foreign(f: GGUFFile, reader: ArtifactReader, *, source, imatrix, mode: str, seed: int) -> Report:
    """A file quantkit did not write: the plan is inferred from the file (:mod:`.foreign`)."""
    report = Report(str(f.path), "gguf", mode, seed)
    scan = ScaleScan(row_stores(f))
    plan = None
    if source is None:
        why = "made outside quantkit and no --source given: structure checks only"
        payload_checks = unverified_checks(len(f.tensors), why)
        report.scope = "structure only: no tensor proven (pass --source)"
    else:
        plan, problems = foreign_plan(f, source, imatrix)
        checks, report.tensors = audit(f, plan, reader, scan, mode, seed)
        proof = (skipped("payload.proof", "--payload none: no tensor re-encoded") if mode == "none" else
                 proof_check(len(f.tensors), report.tensors, plan.unproven, mode))
        payload_checks = [foreign_tensors_check(f, plan, problems), foreign_metadata_check(f, plan), *checks, proof]
        report.scope = proof.detail
    _scan_rest(f, reader, scan, report.tensors, mode)
    scope = "sampled regions only" if mode == "sample" else "every block"
    report.checks = [header_check(f), *layout_checks(f), padding_check(reader, f, payloads=mode != "sample"),
                     scan.check(f.tensors, scope), metadata_check(f), shapes_check(f),
                     skipped("structure.provenance", "not written by quantkit: no quantkit.* provenance keys")]
    report.checks += [c for c in (spec_check(f),) if c is not None]
    if plan is not None:
        report.source = {"path": str(plan.source.path), "repo": plan.source.repo_id, "revision": plan.source.revision}
        report.recipe = {"name": "inferred from the file's tensor types", "sha256": None, "from": "artifact"}
        report.imatrix = None if imatrix is None else {"path": str(imatrix), "sha256": None}
        report.notes = list(plan.notes)
        payload_checks.insert(2, source_hash_check(plan))
    report.checks += payload_checks + name_checks(f)
    report.io = {"artifact_bytes": f.file_size, "header_bytes": f.data_offset,
                 "artifact_bytes_read": reader.bytes_read,
                 "source_files_hashed_bytes": 0 if plan is None else plan.hashed_bytes}
    return report


def _sidecar(path: Path, payload: str, seed: int) -> Report:
    from ..swapset import validate_sidecar

    found = validate_sidecar(path, full=payload == "full")
    report = Report(str(path), "sidecar", payload, seed)
    report.checks = [Check(f"sidecar.{c['check']}", PASSED if c["ok"] else FAILED, c["detail"])
                     for c in found.checks]
    return report


__all__ = ["PAYLOAD_MODES", "Report", "validate"]
