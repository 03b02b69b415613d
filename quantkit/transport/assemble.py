"""Assemble a file from its transport parts: check, preflight, copy while hashing, resume, rename.

In order:

1. every part exists (a missing one is a :class:`MissingSourceError` naming it, exit 2) and has the manifest's
   size (a truncated or longer part is a :class:`CorruptDataError` naming it, exit 1); GGUF shards also parse and
   say they are shard ``i`` of ``N`` (``split.no``, ``split.count``) in the manifest's order;
2. free space: the filesystem of the output must hold the bytes still to write, else :class:`OutOfSpaceError`
   naming the directory and the bytes needed, before anything is written;
3. parts are copied in order into ``<output>.partial``, each hashed while it is copied; a part whose SHA-256
   differs from the manifest is refused by name (:class:`CorruptDataError`; when its bytes are another part's,
   the message says the parts are reordered).  After each verified part the partial is synced and the part's
   index added to the journal ``<output>.transport-journal`` (written to a temporary name and renamed), both in the
   background (:class:`~quantkit.transport.stream.Syncer`) while the next part is copied: a part is journaled only
   after a sync that began once its last byte was written succeeded, and never after a part whose sync failed (an
   ``OSError`` naming that part, the partial and journal kept for the resume);
4. on success the partial is synced and renamed to ``output`` and the journal removed.  (The partial is managed
   here, not by :func:`quantkit.io.atomic.atomic_output`, which deletes its partial on failure: that would throw
   away the work a resume keeps, the same reason :class:`~quantkit.io.gguf_writer.GGUFWriter` manages its own.)

An interrupted run (killed, out of space, a corrupt part) leaves the partial and the journal and never a file
under the final name; the same command resumes: parts the journal lists are re-read from the partial and hashed
against the manifest before they are skipped (a mismatch is copied again), so a resumed output is verified as
completely as an uninterrupted one.

Byte parts: the whole file's SHA-256 is implied by the part hashes in order (the manifest's per-part hashes were
taken from the same bytes), so it is not computed a second time: a second digest of every byte costs a third of the
throughput on two cores.  A manifest whose ``file.sha256`` disagrees with its parts (edited by hand) is what
``quantkit validate MANIFEST`` finds: it hashes every part and the whole.  GGUF shards: the merged file's bytes are
not the shards' bytes (the header is made from the first shard's), so the whole file's SHA-256 is computed while copying
and compared with the manifest's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CorruptDataError, FormatError, MissingSourceError, OutOfSpaceError, OutputExistsError
from ..io.atomic import check_output, fsync_path, is_out_of_space, output_lock
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import plan_layout
from .manifest import Manifest, load_manifest
from .split import SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS_COUNT
from .stream import Syncer, copy_range, progress_bar

PARTIAL_SUFFIX = ".partial"
JOURNAL_SUFFIX = ".transport-journal"
JOURNAL_FORMAT = "quantkit-transport-journal"


@dataclass
class Segment:
    """Where part ``index`` goes: ``length`` bytes from ``source_offset`` of the part to ``offset`` of the
    output (for a GGUF shard, its data section; the bytes before it are hashed, not copied)."""

    index: int
    offset: int
    source_offset: int
    length: int


@dataclass
class Plan:
    manifest: Manifest
    segments: list[Segment]
    header: bytes = b""
    """GGUF shards: the merged file's header and padding (written first)."""


@dataclass
class AssembleResult:
    output: Path | str
    """The assembled file (its name while the copy runs)."""
    size: int
    parts: int
    resumed_parts: int
    problems_repaired: list[str] = field(default_factory=list)


def _label(m: Manifest, i: int) -> str:
    return f"part {i + 1} of {len(m.parts)}"


def check_part_file(m: Manifest, i: int) -> None:
    """Step 1's file check of part ``i``: present, with its manifest size."""
    path = m.part_path(i)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise MissingSourceError(f"{_label(m, i)} is missing", path=path) from None
    if size != m.parts[i].size:
        how = "truncated" if size < m.parts[i].size else "longer than it should be"
        raise CorruptDataError(f"{_label(m, i)} is {how}: {size:,} bytes, the manifest says {m.parts[i].size:,}",
                               path=path)


def mismatch_error(m: Manifest, i: int, found: str, path: Path) -> CorruptDataError:
    """The refusal of part ``i`` whose SHA-256 is ``found``: corrupt, or another part's bytes (reordered)."""
    other = next((j for j, p in enumerate(m.parts) if p.sha256 == found and j != i), None)
    if other is not None:
        return CorruptDataError(f"{_label(m, i)} holds the bytes of part {other + 1} ({m.parts[other].name}): the "
                                f"parts are reordered or renamed", path=path)
    return CorruptDataError(f"{_label(m, i)} is corrupt: SHA-256 {found}, the manifest says {m.parts[i].sha256}",
                            path=path)


def plan_assembly(m: Manifest) -> Plan:
    for i in range(len(m.parts)):
        check_part_file(m, i)
    if m.kind == "bytes":
        segments, offset = [], 0
        for i, part in enumerate(m.parts):
            segments.append(Segment(i, offset, 0, part.size))
            offset += part.size
        return Plan(m, segments)
    metadata, tensors, data_offsets = {}, [], []
    for i in range(len(m.parts)):
        path = m.part_path(i)
        try:
            with GGUFFile(path) as shard:
                shard_meta, shard_tensors, data_offset = dict(shard.metadata), list(shard.tensors.values()), \
                    shard.data_offset
        except FormatError as exc:
            raise CorruptDataError(f"{_label(m, i)} is corrupt: not a readable GGUF shard ({exc.detail})",
                                   path=path) from None
        no, count = (shard_meta.get(k).value if k in shard_meta else None for k in (SPLIT_NO, SPLIT_COUNT))
        if count != len(m.parts):
            raise CorruptDataError(f"{_label(m, i)} says {SPLIT_COUNT} = {count}, the manifest lists "
                                   f"{len(m.parts)} shards", path=path)
        if no != i:
            other = f"part {no + 1} ({m.parts[no].name})" if isinstance(no, int) and 0 <= no < len(m.parts) else no
            raise CorruptDataError(f"{_label(m, i)} is shard {other} ({SPLIT_NO} = {no}): the parts are reordered "
                                   f"or renamed", path=path)
        if i == 0:
            metadata = {k: v for k, v in shard_meta.items() if k not in SPLIT_KEYS}
            declared = shard_meta.get(SPLIT_TENSORS_COUNT)
        tensors.extend(shard_tensors)
        data_offsets.append(data_offset)
    if declared is None or declared.value != len(tensors):
        raise CorruptDataError(f"the shards hold {len(tensors)} tensors, the first says {SPLIT_TENSORS_COUNT} = "
                               f"{None if declared is None else declared.value}", path=m.part_path(0))
    layout = plan_layout(metadata, tensors)
    if layout.file_size != m.file.size:
        raise CorruptDataError(f"the shards merge into {layout.file_size:,} bytes, the manifest says "
                               f"{m.file.size:,}", path=m.path)
    segments, offset = [], layout.data_offset
    for i, data_offset in enumerate(data_offsets):
        length = m.parts[i].size - data_offset
        segments.append(Segment(i, offset, data_offset, length))
        offset += length
    if offset != m.file.size:
        raise CorruptDataError(f"the shards' data sections end at {offset:,}, the merged file has {m.file.size:,} "
                               f"bytes", path=m.path)
    return Plan(m, segments, layout.header + bytes(layout.data_offset - len(layout.header)))


def _read_journal(journal: Path, m: Manifest) -> set[int]:
    try:
        raw = json.loads(journal.read_text())
        done = raw["done"] if raw.get("format") == JOURNAL_FORMAT and raw.get("manifest") == m.identity() else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        done = None
    if not isinstance(done, list) or not all(isinstance(i, int) and 0 <= i < len(m.parts) for i in done):
        return set()   # unreadable or of another manifest: nothing is trusted, every part is copied again
    return set(done)


def _write_journal(journal: Path, m: Manifest, done: set[int]) -> None:
    tmp = journal.with_name(journal.name + ".tmp")
    tmp.write_text(json.dumps({"format": JOURNAL_FORMAT, "manifest": m.identity(), "done": sorted(done)}))
    os.replace(tmp, journal)


def assemble(manifest: str | os.PathLike | Manifest, output: str | os.PathLike, *, force: bool = False,
             progress: bool = False) -> AssembleResult:
    """Assemble the file ``manifest`` describes at ``output`` (see the module docstring)."""
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    output = Path(output)
    inputs = [m.path, *(m.part_path(i) for i in range(len(m.parts)))] if m.path else []
    check_output(output, inputs=inputs, overwrite=force)
    plan = plan_assembly(m)
    partial = output.with_name(output.name + PARTIAL_SUFFIX)
    journal = output.with_name(output.name + JOURNAL_SUFFIX)
    with output_lock(output):
        done = _read_journal(journal, m) if partial.exists() else set()
        if not done:
            partial.unlink(missing_ok=True)
        need = sum(s.length for s in plan.segments if s.index not in done) + len(plan.header)
        free = shutil.disk_usage(output.parent).free
        if free < need:
            raise OutOfSpaceError(f"needs {need:,} bytes free to assemble {m.file.name}, {free:,} available",
                                  path=output.parent)
        fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with Syncer() as syncer:
                result = _copy(plan, fd, partial, done, journal, progress, syncer)
                syncer.drain()
            os.fsync(fd)
        except OSError as exc:
            if is_out_of_space(exc):
                raise OutOfSpaceError(f"filesystem full while assembling {m.file.name}: free {need:,} bytes and run "
                                      f"the same command again to resume", path=partial) from None
            raise
        finally:
            os.close(fd)
        if output.exists() and not force:
            raise OutputExistsError("output appeared while assembling; refusing to replace it", path=output)
        os.replace(partial, output)
        fsync_path(output.parent, directory=True)
        journal.unlink(missing_ok=True)
    result.output = output
    return result


def _journal_part(syncer: Syncer, fd: int, partial: Path, journal: Path, m: Manifest, done: frozenset[int],
                  index: int) -> None:
    """A syncer step: make the partial durable up to part ``index``, then journal ``done`` (which lists it)."""
    try:
        syncer.sync(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror} (syncing {_label(m, index)} to disk; run the same command again to "
                                 f"resume)", str(partial)) from None
    _write_journal(journal, m, done)


def _copy(plan: Plan, fd: int, partial: Path, done: set[int], journal: Path, progress: bool,
          syncer: Syncer) -> AssembleResult:
    m = plan.manifest
    whole = hashlib.sha256() if plan.header else None   # byte parts: implied by the part hashes
    extra = [whole] if whole is not None else []
    if os.fstat(fd).st_size != m.file.size:
        os.ftruncate(fd, m.file.size)
    result = AssembleResult(m.file.name, m.file.size, len(m.parts), 0)
    with progress_bar(m.file.size, progress, m.file.name) as bar:
        if plan.header:
            os.pwrite(fd, plan.header, 0)
            whole.update(plan.header)
            bar.update(len(plan.header))
        for seg in plan.segments:
            path = m.part_path(seg.index)
            expected = m.parts[seg.index].sha256
            with open(path, "rb") as part:
                if seg.index in done:
                    digest = hashlib.sha256()
                    copy_range(part.fileno(), 0, seg.source_offset, None, 0, [digest], src_path=path)
                    resumed = [digest, *extra]
                    snapshot = [d.copy() for d in extra]
                    copy_range(fd, seg.offset, seg.length, None, 0, resumed, src_path=partial, advance=bar.update)
                    if digest.hexdigest() == expected:
                        result.resumed_parts += 1
                        continue
                    result.problems_repaired.append(f"{_label(m, seg.index)}: its bytes in the partial output did not "
                                                    f"match; copied again")
                    done.discard(seg.index)
                    if whole is not None:
                        whole = snapshot[0]
                        extra = [whole]
                    bar.update(-seg.length)
                digest = hashlib.sha256()
                copy_range(part.fileno(), 0, seg.source_offset, None, 0, [digest], src_path=path)
                copy_range(part.fileno(), seg.source_offset, seg.length, fd, seg.offset, [digest, *extra],
                           src_path=path, advance=bar.update, syncer=syncer)
            found = digest.hexdigest()
            if found != expected:
                raise mismatch_error(m, seg.index, found, path)
            done.add(seg.index)
            syncer.then(_journal_part, syncer, fd, partial, journal, m, frozenset(done), seg.index)
            syncer.check()
    if whole is not None and whole.hexdigest() != m.file.sha256:
        raise CorruptDataError(f"the merged file's SHA-256 is {whole.hexdigest()}, the manifest says {m.file.sha256} "
                               f"(every shard matched its own hash: the manifest does not describe these shards)",
                               path=m.path)
    return result
