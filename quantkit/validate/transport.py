"""Validate transport parts without assembling them: a transport manifest, or a set of llama.cpp split shards.

A manifest (``<file>.transport.json``): every part present with its size; every part's SHA-256 (reordered parts
named as such); the whole file's SHA-256, computed in the same pass from the parts in order (for GGUF shards, from
the merged header and the shards' data sections), so the file is proven without being written.  ``--payload
none`` stops after the sizes.

A shard (``<stem>-00001-of-00003.gguf``, any of the set, holding ``split.count``): every shard of the set present
and readable, each saying it is shard ``k`` of ``N`` (``split.no``, ``split.count``), the first holding the file's metadata and the
others only the split keys, and the tensors of all shards adding up to ``split.tensors.count`` with no name twice.
That is structure only, and the verdict says so: no shard's bytes are compared with anything; options that ask
for a comparison (``--source`` ...) are refused, not ignored.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from ..errors import CorruptDataError, FormatError, MissingSourceError, QuantkitError, ValidationError
from ..io.gguf_reader import GGUFFile
from ..transport.assemble import check_part_file, mismatch_error, plan_assembly
from ..transport.manifest import load_manifest
from ..transport.split import SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS_COUNT, shard_name
from ..transport.stream import copy_range
from .report import Check, Report, check, skipped

SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_shard(path: Path) -> bool:
    """A shard of a set: named as one, and holding the split keys or unreadable (the set's checks name why).  A
    whole GGUF that only bears such a name (no ``split.count``) is a file like any other."""
    if SHARD_NAME.match(path.name) is None:
        return False
    try:
        with GGUFFile(path) as f:
            return SPLIT_COUNT in f.metadata
    except (QuantkitError, OSError):
        return True


def validate_manifest(path: Path, payload: str) -> Report:
    m = load_manifest(path)
    report = Report(str(path), f"transport manifest ({m.kind})", "none" if payload == "none" else "full", 0)
    problems = []
    for i in range(len(m.parts)):
        try:
            check_part_file(m, i)
        except (MissingSourceError, CorruptDataError) as exc:
            problems.append(str(exc))
    report.checks.append(check("transport.parts", problems, f"{len(m.parts)} parts present with their sizes"))
    if payload == "none":
        report.checks += [skipped(name, "--payload none") for name in ("transport.part_hashes", "transport.file_hash")]
        return report
    report.checks += _hash_parts(m, problems)
    report.io = {"artifact_bytes": sum(p.size for p in m.parts)}
    return report


def _hash_parts(m, size_problems: list[str]) -> list[Check]:
    """``transport.part_hashes`` over every part present with its manifest size, and ``transport.file_hash`` from
    the same pass when the parts are complete and match; parts that do not make the file (GGUF shards out of order,
    a wrong ``file.size``) fail it, as ``transport assemble`` refuses them."""
    plan, merge_problem = None, None
    if not size_problems:
        try:
            plan = plan_assembly(m)
        except (CorruptDataError, FormatError) as exc:
            merge_problem = f"the parts do not make {m.file.name}: {exc}"
    whole = hashlib.sha256()
    if plan is not None and plan.header:
        whole.update(plan.header)
    problems, hashed = [], 0
    for i, part in enumerate(m.parts):
        path = m.part_path(i)
        if not path.is_file() or path.stat().st_size != part.size:
            continue
        hashed += 1
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            if plan is not None and plan.header:   # GGUF shards: the header is the shard's own, not the file's
                seg = plan.segments[i]
                copy_range(f.fileno(), 0, seg.source_offset, None, 0, [digest], src_path=path)
                copy_range(f.fileno(), seg.source_offset, seg.length, None, 0, [digest, whole], src_path=path)
            else:
                copy_range(f.fileno(), 0, part.size, None, 0, [digest, whole] if plan is not None else [digest],
                           src_path=path)
        if digest.hexdigest() != part.sha256:
            problems.append(str(mismatch_error(m, i, digest.hexdigest(), path)))
    if not hashed:
        part_hashes = skipped("transport.part_hashes", "no part is present with its size")
    else:
        left_out = "" if hashed == len(m.parts) else \
            f" ({len(m.parts) - hashed} of {len(m.parts)} not hashed: missing or of the wrong size)"
        part_hashes = check("transport.part_hashes", problems, f"{hashed} parts match their SHA-256{left_out}")
    if merge_problem is not None:
        file_hash = check("transport.file_hash", [merge_problem])
    elif plan is None or problems:
        file_hash = skipped("transport.file_hash", "a part's SHA-256 differs" if plan is not None else
                            "a part is missing or has the wrong size")
    else:
        found = whole.hexdigest()
        file_hash = check("transport.file_hash", [] if found == m.file.sha256 else [
            f"{m.file.name}: SHA-256 {found} from the parts, the manifest says {m.file.sha256}"],
            f"{m.file.name}: {m.file.sha256} ({m.file.size:,} bytes) from the parts in order")
    return [part_hashes, file_hash]


SHARDS_SCOPE = ("structure only: no shard's bytes compared (validate FILE.transport.json to prove every shard's "
                "SHA-256, or merge the shards and validate the file against its source)")


def validate_shards(path: Path, against: list[str]) -> Report:
    """The shard set ``path`` belongs to, checked for structure; ``against`` names the options that ask for more
    (``--source`` ...), which a shard set cannot give: refused rather than silently ignored."""
    if against:
        raise ValidationError(f"{' and '.join(against)}: a llama.cpp shard set is checked for structure only; to "
                              f"compare its payload, merge it (llama-gguf-split --merge, or quantkit transport "
                              f"assemble with its manifest) and validate the merged file", path=path)
    match = SHARD_NAME.match(path.name)
    stem, count = match["stem"], int(match["count"])
    if not path.is_file():   # the file named: an input that is not there (its siblings are the report's business)
        raise MissingSourceError("no such file", path=path)
    paths = [path.with_name(shard_name(stem, i, count)) for i in range(count)]
    report = Report(str(path), f"gguf split shards ({count})", "none", 0, scope=SHARDS_SCOPE)
    missing = [f"{p}: shard {i + 1} of {count} is missing" for i, p in enumerate(paths) if not p.is_file()]
    report.checks.append(check("shards.present", missing, f"{count} shards present"))
    key_problems, tensor_problems, names, declared = [], [], {}, None
    for i, p in enumerate(paths):
        if not p.is_file():
            continue
        try:
            with GGUFFile(p) as f:
                meta, tensors = f.metadata, list(f.tensors)
        except FormatError as exc:
            key_problems.append(f"shard {i + 1} of {count} is not a readable GGUF file: {exc}")
            continue
        no, n = (meta[k].value if k in meta else None for k in (SPLIT_NO, SPLIT_COUNT))
        if no != i or n != count:
            key_problems.append(f"{p.name}: {SPLIT_NO} = {no}, {SPLIT_COUNT} = {n}; its name says shard {i} (from 0) "
                                f"of {count}")
        others = [k for k in meta if k not in SPLIT_KEYS]
        if i == 0:
            declared = meta[SPLIT_TENSORS_COUNT].value if SPLIT_TENSORS_COUNT in meta else None
            if "general.architecture" not in meta:
                key_problems.append(f"{p.name}: the first shard lacks the file's metadata (general.architecture)")
        elif others:
            key_problems.append(f"{p.name}: keys other than the split keys outside the first shard: {others[:3]}")
        if not tensors:
            tensor_problems.append(f"{p.name}: holds no tensor")
        for name in tensors:
            if name in names:
                tensor_problems.append(f"{p.name}: tensor {name!r} is also in {names[name]}")
            names[name] = p.name
    if not missing and declared != len(names):
        tensor_problems.append(f"the shards hold {len(names)} tensors, the first says {SPLIT_TENSORS_COUNT} = "
                               f"{declared}")
    report.checks.append(check("shards.keys", key_problems, f"{SPLIT_NO}/{SPLIT_COUNT} agree with the names; "
                                                            f"metadata in the first shard"))
    report.checks.append(Check("shards.tensors", "skipped", "a shard is missing") if missing and not tensor_problems
                         else check("shards.tensors", tensor_problems, f"{len(names)} tensors = {SPLIT_TENSORS_COUNT}, "
                                                                       f"none twice"))
    return report
