"""``quantkit convert``: plan, then write the planned GGUF, resumably, with its provenance inside.

Steps (:func:`convert`):

1. **Resolve** the source (a directory, or a Hugging Face repo id: :mod:`quantkit.convert.source`), load the
   recipe and, with ``imatrix``, the imatrix: refused when made from synthetic/fixture data (unless allowed),
   renamed from Hugging Face to GGUF names where needed, and checked against the model's tensors (an entry naming
   a tensor the model lacks, or with another row length or matrix count, is an error naming the first one).
2. **Plan** (:func:`quantkit.convert.plan.build_plan`), and check that the config describes the tensors
   (:mod:`quantkit.convert.consistency`); ``dry_run`` stops here.
3. **Jobs**: one :class:`~quantkit.convert.tensors.TensorJob` per planned tensor, with the matrices (experts) the
   imatrix never observed marked for bootstrap importance (decided from the imatrix counts, before encoding, so
   the header can record them).
4. **Layout**: the provenance keys (:mod:`quantkit.convert.provenance`) after the plan's metadata, with every
   source file's SHA-256 still pending (:data:`PENDING_SHA256`: a digest has a fixed length, so the header's size
   and every offset are already final); the file is laid out (:func:`quantkit.io.gguf_writer.plan_layout`).
5. **Space**: the output's filesystem must hold what is still to be written plus ``reserve_bytes``.
6. **Header**: ``<out>.partial`` is created at full size and ``<out>.journal`` started with the size and mtime of
   every source file; or, with ``resume``, both are checked against this layout (the journal's layout hash and
   source files, the partial's size and header bytes, and the SHA-256 of every payload the journal lists).
7. **Payloads**: the remaining tensors, largest first, in ``jobs`` worker processes
   (:mod:`quantkit.convert.pool`), each written at its planned offset and journaled with its SHA-256 as it
   completes; a progress bar shows tensors, bytes and the ETA.  Meanwhile background threads hash the source
   files (:class:`~quantkit.convert.source.Hashing`; hashes journaled earlier are reused), so reading the source
   twice overlaps the encoding instead of preceding it.
8. **Finish**: every tensor accounted for, the header with the real hashes replaces the pending one, the partial
   is fsynced and renamed to ``out``; the journal is removed.

Nothing ever appears under the final name before step 8.  After an error, a crash or Ctrl-C the partial and the
journal stay; running again with ``resume`` continues where the journal ends and produces the same bytes as an
uninterrupted run.  Any change to the plan (recipe, imatrix, options that reach the metadata) changes the layout
hash, and any change to a source file its size or mtime: a resume is refused.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

from ..arch import get_arch
from ..errors import MissingSourceError, OutputExistsError, QuantkitError
from ..imatrix import Imatrix
from ..io.checkpoint import open_checkpoint
from ..io.gguf import KV
from ..io.gguf_writer import PARTIAL_SUFFIX, GGUFWriter, Layout, pwrite_all, plan_layout
from ..recipes import Recipe, load_recipe
from .consistency import check_config_against_tensors
from .journal import Journal, journal_path, read_journal
from .plan import Plan, PlannedTensor, build_plan, inspect_sources
from .pool import TensorDone, WorkerPool, WorkerSetup
from .provenance import merged_metadata, provenance_metadata
from .source import FileHash, Hashing, ResolvedSource, file_stats, provenance_files, resolve_source
from .tensors import TensorJob, imatrix_shapes, load_model_imatrix

#: Free space kept on the output's filesystem beyond the bytes still to be written.
FREE_SPACE_RESERVE_BYTES = 1 << 30
#: Stands in for each source file's SHA-256 until it is known: a hex digest is always 64 characters, so the header
#: has its final size and every offset is final from the start.
PENDING_SHA256 = "0" * 64


@dataclass(frozen=True)
class ConvertRequest:
    """Everything ``quantkit convert`` is asked to do."""

    source: str
    out: Path
    recipe: str | Recipe
    imatrix: str | None = None
    bootstrap: bool = False
    allow_synthetic_imatrix: bool = False
    jobs: int = 1
    resume: bool = False
    force: bool = False
    label: str | None = None
    pre_tokenizer: str | None = None
    dialect: str | None = None
    """GGUF dialect of names, keys and order (:mod:`quantkit.arch.dialects`); None: the recipe's, else llama.cpp."""
    reserve_bytes: int = FREE_SPACE_RESERVE_BYTES
    progress: bool = True


@dataclass
class Prepared:
    """A resolved source, its plan, and the imatrix conformed to the model (None without one)."""

    source: ResolvedSource
    plan: Plan
    imatrix: Imatrix | None
    imatrix_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class ConvertResult:
    path: Path
    file_size: int
    tensors: int
    resumed: int
    """Tensors taken from the journal of an earlier run."""
    produced: list[TensorDone]
    wall_seconds: float
    jobs: int
    phases: dict[str, float]
    """Seconds spent hashing the source, writing (or checking) the header, producing tensors, finishing."""

    def report(self) -> dict:
        busy = sum(d.seconds for d in self.produced)
        return {"path": str(self.path), "file_size": self.file_size, "tensors": self.tensors,
                "resumed": self.resumed, "jobs": self.jobs, "wall_seconds": self.wall_seconds,
                "tensor_seconds": busy, "phases": self.phases,
                "produced": [{"name": d.name, "sha256": d.sha256, "nbytes": d.nbytes, "seconds": d.seconds}
                             for d in self.produced]}


# -- preparing ----------------------------------------------------------------------------------------------------

def prepare(request: ConvertRequest) -> Prepared:
    """Steps 1-2: resolve the source, check the imatrix against the model, build the plan."""
    source = resolve_source(request.source)
    recipe = request.recipe if isinstance(request.recipe, Recipe) else load_recipe(request.recipe)
    imatrix, shapes = None, {}
    if request.imatrix is not None:
        with open_checkpoint(source.path) as ckpt:
            amap = get_arch(str(ckpt.config.get("model_type"))).bind(ckpt.config)
            outputs = amap.outputs(inspect_sources(ckpt)[0])
        shapes = imatrix_shapes(outputs)
        imatrix = load_model_imatrix(request.imatrix, amap, shapes, allow_synthetic=request.allow_synthetic_imatrix)
    plan = build_plan(source.path, recipe,
                      imatrix=None if imatrix is None else {n: e.in_sum2 for n, e in imatrix.entries.items()},
                      bootstrap=request.bootstrap, label=request.label, pre_tokenizer=request.pre_tokenizer,
                      dialect=request.dialect)
    check_config_against_tensors(plan.metadata, {o.gguf_name: o.shape
                                                 for o in [t.output for t in plan.tensors] + list(plan.skipped)})
    return Prepared(source, plan, imatrix, shapes)


_KINDS = {None: "encode", "copy": "copy", "mxfp4-repack": "mxfp4-repack", "nvfp4-repack": "nvfp4-repack",
          "nvfp4-scale": "nvfp4-scale"}


def make_job(t: PlannedTensor, imatrix) -> TensorJob:
    """The job of one planned tensor; matrices the imatrix never observed are marked for bootstrap importance."""
    bootstrap: set[int | None] = set()
    if t.importance == "imatrix":
        matrices = range(t.output.shape[0]) if len(t.output.shape) == 3 else (None,)
        bootstrap = {m for m in matrices if imatrix.importance(t.imatrix_name, expert=m) is None}
    return TensorJob(t.name, t.qtype, t.output, t.nbytes, _KINDS[t.lossless], t.importance, frozenset(bootstrap),
                     t.imatrix_name)


# -- executing ----------------------------------------------------------------------------------------------------

def file_layout(plan: Plan, provenance: list[tuple[str, KV]], jobs: Iterable[TensorJob]) -> Layout:
    """The file's layout (step 4): the plan's metadata, then the ``provenance`` keys, then the jobs' tensors in
    order."""
    return plan_layout(merged_metadata(plan.metadata, provenance), [(j.name, j.output.shape, j.qtype) for j in jobs])


def _check_output(out: Path, partial: Path, journal: Path, request: ConvertRequest) -> bool:
    """Whether to resume; refuses to touch an existing output or an unfinished run unless told."""
    if out.exists() and not request.force:
        raise OutputExistsError("output exists; refusing to replace it", path=out)
    if not request.resume or request.force:
        if partial.exists() and not request.force:
            raise OutputExistsError("an unfinished conversion exists (a partial output); pass --resume to continue "
                                    "it or --force to start over", path=partial)
        return False
    if not partial.exists():
        return False       # nothing to resume: start afresh
    if not journal.is_file():
        raise MissingSourceError("the partial output has no journal, so its content cannot be trusted; pass "
                                 "--force to start over", path=journal)
    return True


def _check_space(out: Path, layout: Layout, partial: Path, resuming: bool, reserve: int) -> None:
    allocated = partial.stat().st_blocks * 512 if resuming and partial.exists() else 0
    needed = max(0, layout.file_size - allocated) + reserve
    free = shutil.disk_usage(out.parent).free
    if free < needed:
        raise QuantkitError(f"not enough free space: {needed:,} bytes needed ({layout.file_size:,} for the file "
                            f"less {allocated:,} already written, plus a {reserve:,}-byte reserve), {free:,} free",
                            path=out.parent)


@contextlib.contextmanager
def _progress(total: int, done_bytes: int, tensors: int, done_tensors: int, enabled: bool, name: str):
    from tqdm import tqdm

    bar = tqdm(total=total, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=name,
               disable=not enabled, dynamic_ncols=True, smoothing=0.05)
    state = {"tensors": done_tensors}

    def advance(nbytes: int) -> None:
        state["tensors"] += 1
        bar.set_postfix_str(f"{state['tensors']}/{tensors} tensors", refresh=False)
        bar.update(nbytes)

    bar.set_postfix_str(f"{done_tensors}/{tensors} tensors")
    try:
        yield advance
    finally:
        bar.close()


class _Clock:
    """Wall time per phase."""

    def __init__(self):
        self.start = self.mark = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.mark
        self.mark = now

    def total(self) -> float:
        return time.perf_counter() - self.start


def _order(jobs: dict[str, TensorJob], names) -> list[str]:
    """Largest first, so the last tensors running alone are small ones (name order breaks ties)."""
    return sorted(names, key=lambda n: (-int(jobs[n].nbytes), n))


def _write_header(partial: Path, header: bytes) -> None:
    fd = os.open(partial, os.O_RDWR)
    try:
        pwrite_all(fd, header, 0)
    finally:
        os.close(fd)


def execute(prepared: Prepared, request: ConvertRequest) -> ConvertResult:
    """Steps 3-8 (see the module docstring)."""
    clock = _Clock()
    plan, source = prepared.plan, prepared.source
    out = Path(request.out)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    jpath = journal_path(out)
    resuming = _check_output(out, partial, jpath, request)
    jobs = {t.name: make_job(t, prepared.imatrix) for t in plan.tensors}
    with open_checkpoint(source.path) as ckpt:
        shards = {ckpt.tensor_info(n).file for n in ckpt.tensor_names()}
    files = provenance_files(source, shards)
    stats = file_stats(files)

    def layout_with(hashes: list[FileHash]) -> Layout:
        provenance = provenance_metadata(jobs=list(jobs.values()), recipe=plan.recipe, recipe_tag=plan.name_tag,
                                         source=source, file_hashes=hashes, imatrix=prepared.imatrix,
                                         imatrix_given=request.imatrix, label=plan.label)
        return file_layout(plan, provenance, jobs.values())

    layout = layout_with([replace(s, sha256=PENDING_SHA256) for s in stats])
    for name, job in jobs.items():
        if layout.tensor(name).nbytes != job.nbytes:
            raise QuantkitError(f"the plan sized this tensor {job.nbytes} bytes, the layout "
                                f"{layout.tensor(name).nbytes}", tensor=name)
    fingerprint = hashlib.sha256(layout.header).hexdigest()
    _check_space(out, layout, partial, resuming, request.reserve_bytes)

    with WorkerPool(request.jobs) as pool:   # the workers start up while the header is written
        writer = GGUFWriter(out, layout, overwrite=request.force)
        if resuming:
            done, known = read_journal(jpath, fingerprint, stats)
            _write_header(partial, layout.header)   # back to pending hashes, had a run died while finishing
            writer.resume(done, verify=True)
            journal = Journal.reopen(jpath)
        else:
            writer.write_header()
            done, known = {}, {}
            journal = Journal.create(jpath, fingerprint, stats)
        writer.close()
        hashing = Hashing(files, stats, jobs=request.jobs, known=known)   # overlaps the encoding
        clock.lap("header")

        setup = WorkerSetup(str(source.path), plan.model_type, request.imatrix, str(partial), jobs,
                            {n: layout.data_offset + t.offset for n, t in layout.tensors.items()},
                            prepared.imatrix_shapes, request.allow_synthetic_imatrix)
        todo = _order(jobs, [n for n in jobs if n not in done])
        produced: list[TensorDone] = []
        try:
            with _progress(sum(j.nbytes for j in jobs.values()), sum(jobs[n].nbytes for n in done), len(jobs),
                           len(done), request.progress, out.name) as advance, \
                    contextlib.closing(pool.run(setup, todo)) as results:
                for result in results:
                    journal.record(result.name, result.sha256)
                    done[result.name] = result.sha256
                    produced.append(result)
                    advance(result.nbytes)
            clock.lap("tensors")
            hashes = hashing.result()
            for h in hashes:
                if known.get(h.name) != h:
                    journal.record_source(h)
            clock.lap("hash")
        finally:
            hashing.cancel()
            journal.close()

    final_layout = layout_with(hashes)
    if len(final_layout.header) != len(layout.header) or final_layout.file_size != layout.file_size:
        raise QuantkitError(f"the header with the source hashes is {len(final_layout.header)} bytes, with them "
                            f"pending {len(layout.header)}: the hashes must not change the layout", path=partial)
    _write_header(partial, final_layout.header)
    final = GGUFWriter(out, final_layout, overwrite=request.force)
    final.resume(done, verify=False)
    final.finish()
    jpath.unlink(missing_ok=True)
    clock.lap("finish")
    return ConvertResult(out, layout.file_size, len(jobs), len(jobs) - len(todo), produced, clock.total(),
                         request.jobs, clock.phases)


def convert(request: ConvertRequest) -> ConvertResult:
    """Plan and write the GGUF (the whole of ``quantkit convert`` but printing)."""
    return execute(prepare(request), request)


__all__ = ["FREE_SPACE_RESERVE_BYTES", "ConvertRequest", "ConvertResult", "Prepared", "convert", "execute",
           "file_layout", "make_job", "prepare"]
