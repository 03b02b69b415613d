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
5. **Space**: the output's filesystem must hold what is still to be written plus a reserve (by default 1% of the
   file, 1 MiB to 1 GiB; ``reserve_bytes`` sets it).
6. **Header**: ``<out>.journal`` is started with the size and mtime of every source file, then ``<out>.partial``
   is created at full size (in that order: a partial never exists without its journal); or, with ``resume``,
   both are checked against this layout (the journal's layout hash and source files' size and mtime, then each
   source file's SHA-256 against the journal's, waiting for this run's own hashes, the partial's size and header
   bytes, and the SHA-256 of every payload the journal lists).
7. **Payloads**: the remaining tensors, largest first (one worker: in the file's order), in worker processes
   (:mod:`quantkit.convert.pool`; at most one per CPU and what the memory holds), each written at its planned offset
   and journaled with its SHA-256 as it completes; a progress bar shows tensors, bytes and the ETA.  Meanwhile
   background threads hash the source files (:class:`~quantkit.convert.source.Hashing`; the only time the source is
   hashed: the journal records these hashes once they are all known), so reading the source twice overlaps the
   encoding instead of preceding it, and read the partial back behind the tensors
   (:class:`~quantkit.convert.readback.ReadBack`): each payload against its journal hash, and the whole file's
   SHA-256 with the final header, in file order.  With ``device`` cuda the tensors stream through the GPU
   (:mod:`quantkit.convert.gpu_stream`) and those threads number half the CPUs.  With ``executor="ray"`` the tensors
   are Ray tasks on a cluster instead (:mod:`quantkit.convert.raypool`: same interface, so journal and resume are the
   same).
8. **Finish**: every tensor accounted for and read back, the header with the real hashes replaces the pending
   one and is checked against the layout, the journal notes the rename, the partial is fsynced and renamed to
   ``out``; the journal is removed.

The whole run holds an exclusive lock on ``<out>.lock`` (:func:`quantkit.io.atomic.output_lock`): a second
conversion to the same output is refused, whatever its options.  No output path may be an input (a source file,
the imatrix, the recipe file, or a link to one).  Nothing ever appears under the final name before step 8, and
nothing unverified: after an error, a crash, a full disk or Ctrl-C the partial and the journal stay; running
again with ``resume`` continues where the journal ends and produces the same bytes as an uninterrupted run
(also when the earlier run was killed between its rename and the journal's removal).  Any change to the plan
(recipe, imatrix, options that reach the metadata) changes the layout hash, and any change to a source file its
size, mtime or SHA-256: a resume that would keep tensors is refused, naming the file.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

from ..arch import get_arch
from ..errors import (EncodeError, FormatError, MissingSourceError, OutOfSpaceError, OutputExistsError,
                      OutputPathError, QuantkitError, SourceError, UnsupportedError, ValidationError)
from ..imatrix import Imatrix
from ..io.atomic import LOCK_SUFFIX, check_output, input_files, is_out_of_space, output_lock, same_file
from ..io.checkpoint import open_checkpoint
from ..io.gguf import KV
from ..io.gguf_writer import PARTIAL_SUFFIX, GGUFWriter, Layout, pwrite_all, plan_layout
from ..recipes import Recipe, load_recipe
from ..resources import available_cpus
from .consistency import check_config_against_tensors
from .gpu_stream import STEP_SECONDS, STEP_WALL_SECONDS
from .journal import Journal, JournalState, journal_path, read_journal
from .plan import Plan, PlannedTensor, build_plan, source_outputs
from .pool import (TensorDone, WorkerPool, WorkerSetup, bound_jobs, out_of_space, partial_gone, partial_identity,
                   worker_memory)
from .provenance import merged_metadata, provenance_metadata
from .readback import ReadBack
from .source import FileHash, Hashing, ResolvedSource, file_stats, provenance_files, resolve_source
from .tensors import TensorJob, imatrix_shapes, load_model_imatrix

#: Free space kept on the output's filesystem beyond the bytes still to be written, by default: this fraction of
#: the file, at least FREE_SPACE_RESERVE_MIN_BYTES and at most FREE_SPACE_RESERVE_BYTES (a fixed 1 GiB refused a
#: 7.8 MB conversion onto a 20 MB filesystem).  ``ConvertRequest.reserve_bytes`` sets it outright.
FREE_SPACE_RESERVE_FRACTION = 0.01
FREE_SPACE_RESERVE_MIN_BYTES = 1 << 20
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
    support: str | None = None
    """Write the support (drafter) file of this kind instead of the model (:data:`quantkit.convert.plan.
    SUPPORT_KINDS`)."""
    reserve_bytes: int | None = None
    """Free space to keep beyond the file; None: :func:`free_space_reserve` of the file's size."""
    progress: bool = True
    device: str = "cpu"
    """Where tensors are encoded: "cpu", or "cuda" for the types with a GPU encoder (same bytes)."""
    executor: str = "process"
    """Where tensors are produced: ``process`` (worker processes here) or ``ray`` (:mod:`quantkit.convert.raypool`)."""
    address: str | None = None
    """Ray cluster address; None: a local cluster of ``jobs`` CPUs, started and stopped by the run."""
    transfer: str = "auto"
    """How Ray tasks deliver payloads: ``write`` into the shared partial, ``return`` bytes, or ``auto``."""


#: The executors ``ConvertRequest.executor`` names.
EXECUTORS = ("process", "ray")


@dataclass
class Prepared:
    """A resolved source, its plan, and the imatrix conformed to the model (None without one); the jobs, the
    files the conversion reads, and how many workers will run."""

    source: ResolvedSource
    plan: Plan
    imatrix: Imatrix | None
    imatrix_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    jobs: dict[str, TensorJob] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    """The source files whose hashes the file records (shards read, config and tokenizer files)."""
    inputs: list[Path] = field(default_factory=list)
    """Every file the conversion reads (``files``, the imatrix, the recipe file): never an output."""
    workers: int = 1
    workers_note: str | None = None
    """Why ``workers`` is below the jobs asked for (CPUs, memory), if it is."""


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
    """Seconds spent checking the device (``--device cuda``: torch's import), writing (or checking) the header,
    producing tensors, waiting for the source hashes and the read-back, finishing."""
    finished_earlier: bool = False
    """An earlier run had renamed the verified file into place when it was killed: nothing left to do."""
    sha256: str | None = None
    """The whole file's SHA-256, read back while it was written (None when ``finished_earlier``)."""
    stream_seconds: dict[str, float] = field(default_factory=dict)
    """On a GPU at ``-j 1``: seconds per step of the stream (:data:`quantkit.convert.gpu_stream.STEP_SECONDS`)."""
    stream_wall_seconds: dict[str, float] = field(default_factory=dict)
    """The same steps' wall-clock seconds, threads overlapping counted once
    (:data:`quantkit.convert.gpu_stream.STEP_WALL_SECONDS`)."""
    remade: list[str] = field(default_factory=list)
    """Journaled tensors whose bytes in the partial were not what the journal says (made again)."""
    from_journal: list[tuple[str, str, int]] = field(default_factory=list)
    """(name, SHA-256, bytes) of each tensor taken from the journal (``resumed`` of them), read back before use."""

    def report(self) -> dict:
        busy = sum(d.seconds for d in self.produced)
        return {"path": str(self.path), "file_size": self.file_size, "tensors": self.tensors,
                "resumed": self.resumed, "jobs": self.jobs, "wall_seconds": self.wall_seconds,
                "tensor_seconds": busy, "phases": self.phases, "stream_seconds": self.stream_seconds,
                "stream_wall_seconds": self.stream_wall_seconds,
                "produced": [{"name": d.name, "sha256": d.sha256, "nbytes": d.nbytes, "seconds": d.seconds}
                             for d in self.produced],
                "from_journal": [{"name": name, "sha256": sha256, "nbytes": nbytes}
                                 for name, sha256, nbytes in self.from_journal], "remade": list(self.remade)}


# -- preparing ----------------------------------------------------------------------------------------------------

def prepare(request: ConvertRequest) -> Prepared:
    """Steps 1-2: resolve the source, check the imatrix against the model, build the plan."""
    source = resolve_source(request.source)
    recipe = request.recipe if isinstance(request.recipe, Recipe) else load_recipe(request.recipe)
    imatrix, shapes = None, {}
    with open_checkpoint(source.path) as ckpt:   # headers parsed once for the imatrix, the plan and the shards
        if request.imatrix is not None:
            amap = get_arch(str(ckpt.config.get("model_type"))).bind(ckpt.config)
            shapes = imatrix_shapes(source_outputs(ckpt, amap))
            imatrix = load_model_imatrix(request.imatrix, amap, shapes,
                                         allow_synthetic=request.allow_synthetic_imatrix)
        plan = build_plan(ckpt, recipe,
                          imatrix=None if imatrix is None else {n: e.in_sum2 for n, e in imatrix.entries.items()},
                          bootstrap=request.bootstrap, label=request.label, pre_tokenizer=request.pre_tokenizer,
                          dialect=request.dialect, support=request.support)
        shards = ckpt.shard_paths()
    check_config_against_tensors(plan.metadata, {o.gguf_name: o.shape
                                                 for o in [t.output for t in plan.tensors] + list(plan.skipped)})
    jobs = {t.name: make_job(t, imatrix) for t in plan.tensors}
    files = provenance_files(source, shards)
    recipe_file = request.recipe if isinstance(request.recipe, str) and Path(request.recipe).is_file() else None
    inputs = [*files, *input_files([request.imatrix, recipe_file])]
    workers, note = bound_jobs(request.jobs, worker_memory(jobs.values()))
    return Prepared(source, plan, imatrix, shapes, jobs, files, inputs, workers, note)


_KINDS = {None: "encode", "copy": "copy", "mxfp4-repack": "mxfp4-repack", "nvfp4-repack": "nvfp4-repack",
          "nvfp4-scale": "nvfp4-scale", "fp8-rows": "engram-rows"}


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


def free_space_reserve(file_size: int) -> int:
    """The default reserve: :data:`FREE_SPACE_RESERVE_FRACTION` of the file, within [1 MiB, 1 GiB]."""
    return min(FREE_SPACE_RESERVE_BYTES, max(FREE_SPACE_RESERVE_MIN_BYTES,
                                             int(file_size * FREE_SPACE_RESERVE_FRACTION)))


def _check_output(out: Path, partial: Path, journal: Path, request: ConvertRequest) -> bool:
    """Whether to resume; refuses to touch an existing output or an unfinished run unless told.  ``--force``
    replaces the output; with ``--resume`` it continues the unfinished run (an interrupted ``--force`` re-run,
    whose old output is still there), without it the unfinished run starts over."""
    if out.exists() and not request.force:
        raise OutputExistsError("output exists; refusing to replace it" + (
            " (to continue the unfinished conversion and replace it, pass --resume --force)"
            if request.resume and partial.exists() else ""), path=out)
    if not request.resume:
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


def _finished_earlier(out: Path, partial: Path, jpath: Path, layout: Layout, fingerprint: str,
                      stats: list[FileHash]) -> bool:
    """Whether an earlier run of this plan was killed after renaming its verified partial to ``out`` but before
    removing the journal (its ``renaming`` line names the header ``out`` must have)."""
    if partial.exists() or not jpath.is_file() or not out.is_file() or out.stat().st_size != layout.file_size:
        return False
    renaming = read_journal(jpath, fingerprint, stats).renaming
    with open(out, "rb") as f:
        return renaming is not None and hashlib.sha256(f.read(len(layout.header))).hexdigest() == renaming


def _check_space(out: Path, layout: Layout, partial: Path, resuming: bool, reserve: int | None) -> None:
    allocated = partial.stat().st_blocks * 512 if resuming and partial.exists() else 0
    reserve = free_space_reserve(layout.file_size) if reserve is None else reserve
    needed = max(0, layout.file_size - allocated) + reserve
    free = shutil.disk_usage(out.parent).free
    if free < needed:
        raise OutOfSpaceError(f"not enough free space: {needed:,} bytes needed ({layout.file_size:,} for the file "
                              f"less {allocated:,} already written, plus a {reserve:,}-byte reserve), {free:,} "
                              f"free (a smaller reserve: --free-space-reserve BYTES)", path=out.parent)


#: Errors of a tensor's source bytes (a non-finite weight, a malformed scale): the partial output of a run that
#: met one is removed, where an interruption, a full disk or a lost worker keep it for ``--resume``.
SOURCE_DATA_ERRORS = (EncodeError, SourceError, FormatError)


def _check_source_hashes(source: Path, journaled: JournalState, hashes: list[FileHash]) -> None:
    """Refuse to keep journaled payloads made from other bytes: a source edited in place keeping its size and mtime
    passes the journal's first check, not this one."""
    for h in hashes:
        if journaled.source_sha256.get(h.name) != h.sha256:
            raise ValidationError(f"source file {h.name!r} changed since the partial output was started: its "
                                  f"SHA-256 differs from the journal's (size and modification time unchanged); "
                                  f"start over with --force", path=source / h.name if source.is_dir() else source)


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


def _file_order(layout: Layout, names) -> list[str]:
    """In the file's order: the whole-file hash (:class:`~.readback.ReadBack`) follows right behind.  On a GPU,
    where no tensor takes long, and with one worker, this costs no balance between workers."""
    return sorted(names, key=lambda n: layout.tensor(n).offset)


def _pool(prepared: Prepared, request: ConvertRequest):
    """The executor's pool (same interface): worker processes here, or Ray tasks on a cluster."""
    if request.executor == "ray":
        from .raypool import RayPool

        return RayPool(prepared.workers, request.address, request.transfer)
    if request.executor != "process":
        raise ValueError(f"executor must be one of {EXECUTORS}, not {request.executor!r}")
    return WorkerPool(prepared.workers)


def _write_header(partial: Path, header: bytes) -> None:
    fd = os.open(partial, os.O_RDWR)
    try:
        pwrite_all(fd, header, 0)
    finally:
        os.close(fd)


def check_outputs(prepared: Prepared, request: ConvertRequest, report: Path | None = None,
                  manifest: Path | None = None) -> None:
    """Before any work: no output path (the GGUF, its partial, journal and lock, the report) is an input, and each
    can be created; the report and the release ``manifest`` are neither the GGUF nor its working files (the journal
    is removed at the end, the partial renamed) nor each other; an existing report is kept unless ``force``."""
    out = Path(request.out)
    own = {"output": out, "partial output": out.with_name(out.name + PARTIAL_SUFFIX), "journal": journal_path(out),
           "lock": out.with_name(out.name + LOCK_SUFFIX)}
    for path in own.values():
        check_output(path, inputs=prepared.inputs, overwrite=True, what="output")
    if report is not None and manifest is not None:
        own["release manifest"] = manifest
    for what, path in (("report", report), ("release manifest", manifest)):
        for kind, taken in own.items():
            if path is not None and kind != what and same_file(path, taken):
                raise OutputPathError(f"the {what} would be this conversion's {kind}: choose another path",
                                      path=path)
    if report is not None:
        check_output(report, inputs=[*prepared.inputs, out], overwrite=request.force, what="report")


def execute(prepared: Prepared, request: ConvertRequest,
            completed: Callable[[ConvertResult], None] | None = None) -> ConvertResult:
    """Steps 3-8 (see the module docstring), holding the output's lock throughout.  ``completed(result)`` runs
    once the output has its name and before the journal is removed (the CLI writes the release manifest there): a
    run interrupted in between leaves the journal's ``renaming`` line, so ``--resume`` finishes it."""
    out = Path(request.out)
    check_outputs(prepared, request)
    clock = _Clock()
    with output_lock(out):
        stats = file_stats(prepared.files)
        # the source hashes and the workers' start overlap torch's import here, the header and the tensors
        hashing = Hashing(prepared.files, stats, jobs=_helper_threads(prepared, request))
        warming = None
        try:
            with _pool(prepared, request) as pool:
                warming = _check_device(prepared, request)
                clock.lap("device")
                return _execute(prepared, request, out, clock, pool, stats, hashing, completed)
        except OSError as exc:
            partial = out.with_name(out.name + PARTIAL_SUFFIX)
            if is_out_of_space(exc):
                raise out_of_space(exc.filename or partial) from None
            if exc.errno == errno.EFBIG:   # the filesystem's (FAT32: 4 GiB) or ``ulimit -f``'s: no resume gets past it
                if not request.resume:     # an earlier run's work stays, for a resume where the limit is lifted
                    partial.unlink(missing_ok=True)
                    journal_path(out).unlink(missing_ok=True)
                kept = "the partial and its journal are kept" if request.resume else "nothing is kept"
                raise OutputPathError(f"the output is larger than one file may be there (the filesystem's or the "
                                      f"process's file size limit); {kept}: write it to another filesystem",
                                      path=exc.filename or partial) from None
            raise
        finally:
            hashing.cancel()
            if warming is not None:   # it may be loading torch's extension build: never exit in the middle
                warming.join()


def _check_device(prepared: Prepared, request: ConvertRequest) -> threading.Thread | None:
    """``--device`` other than cpu: torch imports and sees that device (else a one-line error); with one job a
    thread (returned) starts the context and loads the encoders' kernels while the first tensors are read."""
    if request.device == "cpu":
        return None
    try:
        from ..kernels.gpu_encode import check_device
    except ImportError as exc:
        raise UnsupportedError(f"--device {request.device} needs torch (pip install 'quantkit[runtime]'): "
                               f"{exc}") from None
    check_device(request.device)
    if prepared.workers != 1 or request.executor != "process":   # else the encoding happens in other processes
        return None
    from ..formats.warm import encoder_kinds
    from ..kernels.gpu_encode import warm_device

    warming = threading.Thread(target=_quietly, args=(warm_device, request.device,
                                                      encoder_kinds(prepared.jobs.values())),
                               daemon=True, name="quantkit-gpu-warm")
    warming.start()
    return warming


def _quietly(fn, *args) -> None:
    """``fn(*args)`` in a helper thread: a failure shows up again, with its tensor, where the work needs it."""
    with contextlib.suppress(Exception):
        fn(*args)


def _helper_threads(prepared: Prepared, request: ConvertRequest) -> int:
    """Threads hashing the source and verifying payloads: as many as workers on the CPU (which they keep busy);
    half the CPUs beside a GPU conversion, whose workers leave them idle."""
    return prepared.workers if request.device == "cpu" else max(prepared.workers, available_cpus() // 2)


def _execute(prepared: Prepared, request: ConvertRequest, out: Path, clock: _Clock, pool, stats: list[FileHash],
             hashing: Hashing, completed: Callable[[ConvertResult], None] | None) -> ConvertResult:
    helpers = _helper_threads(prepared, request)
    steps_before, walls_before = Counter(STEP_SECONDS), Counter(STEP_WALL_SECONDS)
    plan, source, jobs = prepared.plan, prepared.source, prepared.jobs
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    jpath = journal_path(out)

    def layout_with(hashes: list[FileHash]) -> Layout:
        provenance = provenance_metadata(jobs=list(jobs.values()), recipe=plan.recipe, recipe_tag=plan.name_tag,
                                         source=source, file_hashes=hashes, imatrix=prepared.imatrix,
                                         imatrix_given=request.imatrix, label=plan.label, support=plan.support)
        return file_layout(plan, provenance, jobs.values())

    layout = layout_with([replace(s, sha256=PENDING_SHA256) for s in stats])
    for name, job in jobs.items():
        if layout.tensor(name).nbytes != job.nbytes:
            raise QuantkitError(f"the plan sized this tensor {job.nbytes} bytes, the layout "
                                f"{layout.tensor(name).nbytes}", tensor=name)
    fingerprint = hashlib.sha256(layout.header).hexdigest()
    if request.resume and not request.force and _finished_earlier(out, partial, jpath, layout, fingerprint, stats):
        result = ConvertResult(out, layout.file_size, len(jobs), len(jobs), [], clock.total(), prepared.workers,
                               clock.phases, finished_earlier=True)
        return _complete(result, completed, jpath)
    resuming = _check_output(out, partial, jpath, request)
    journaled = read_journal(jpath, fingerprint, stats) if resuming else JournalState()
    resuming = bool(journaled.done)   # a partial with no tensor journaled yet holds nothing worth keeping
    _check_space(out, layout, partial, resuming, request.reserve_bytes)

    writer = GGUFWriter(out, layout, overwrite=True)   # output and partial: checked by _check_output
    redone: list[str] = []
    if resuming:
        _check_source_hashes(source.path, journaled, hashing.result())
        _write_header(partial, layout.header)   # back to pending hashes, had a run died while finishing
        # a payload that is not what its journal line says (a page lost in a crash) is made again
        redone = writer.resume(journaled.done, verify=True, threads=helpers, redo_damaged=True)
        for name in redone:
            del journaled.done[name]
        journal = Journal.reopen(jpath)
    else:   # the journal first: a partial never exists without the journal that says what it holds
        journal = Journal.create(jpath, fingerprint, stats)
        writer.write_header()
    writer.close()
    done = dict(journaled.done)
    identity = partial_identity(partial)
    setup = WorkerSetup(str(source.path), plan.model_type, request.imatrix, str(partial), jobs,
                        {n: layout.data_offset + t.offset for n, t in layout.tensors.items()},
                        prepared.imatrix_shapes, request.allow_synthetic_imatrix, identity, request.device)
    todo = [n for n in jobs if n not in done]
    balance = request.device == "cpu" and prepared.workers > 1
    todo = _order(jobs, todo) if balance else _file_order(layout, todo)
    produced: list[TensorDone] = []
    final: dict[str, Layout] = {}

    def final_header() -> bytes:
        """The header with the source hashes (called by the read-back thread: waits for them)."""
        final["layout"] = found = layout_with(hashing.result())
        if len(found.header) != len(layout.header) or found.file_size != layout.file_size:
            raise QuantkitError(f"the header with the source hashes is {len(found.header)} bytes, with them "
                                f"pending {len(layout.header)}: the hashes must not change the layout",
                                path=partial)
        return found.header

    hashes_journaled = resuming   # a kept journal has them already (checked above)

    def journal_hashes() -> None:
        nonlocal hashes_journaled
        journal.record_sources(hashing.result())
        hashes_journaled = True

    readback = None
    unusable = False
    try:
        readback = ReadBack(partial, identity, layout, journaled.done, final_header, threads=helpers)
        clock.lap("header")
        with _progress(sum(j.nbytes for j in jobs.values()), sum(jobs[n].nbytes for n in done), len(jobs),
                       len(done), request.progress, out.name) as advance, \
                contextlib.closing(pool.run(setup, todo)) as results:
            for result in results:
                if not hashes_journaled and hashing.done():   # before this tensor's line: the earliest they can go
                    journal_hashes()
                journal.record(result.name, result.sha256)
                done[result.name] = result.sha256
                readback.written(result.name, result.sha256)
                produced.append(result)
                advance(result.nbytes)
        clock.lap("tensors")
        if not hashes_journaled:
            journal_hashes()
        sha256 = readback.result()   # never rename bytes nobody checked
        clock.lap("hash")
    except SOURCE_DATA_ERRORS:
        unusable = True
        raise
    finally:
        if readback is not None:
            readback.cancel()
        journal.close()
        if unusable:   # --resume would meet the same bytes, and a fixed source is another source: nothing to keep
            partial.unlink(missing_ok=True)
            jpath.unlink(missing_ok=True)

    final_layout = final["layout"]
    if partial_identity(partial) != identity:
        raise partial_gone(partial)
    _write_header(partial, final_layout.header)
    writer = GGUFWriter(out, final_layout, overwrite=request.force)
    writer.resume(done, verify=False)   # the header just written is checked; the payloads were read back
    journal = Journal.reopen(jpath)
    try:
        journal.record_renaming(hashlib.sha256(final_layout.header).hexdigest())
    finally:
        journal.close()
    writer.finish()
    clock.lap("finish")
    steps, walls = ({step: seconds - before[step] for step, seconds in counter.items() if seconds != before[step]}
                    for counter, before in ((STEP_SECONDS, steps_before), (STEP_WALL_SECONDS, walls_before)))
    result = ConvertResult(out, layout.file_size, len(jobs), len(jobs) - len(todo), produced, clock.total(),
                           prepared.workers, clock.phases, sha256=sha256, stream_seconds=steps,
                           stream_wall_seconds=walls,
                           from_journal=[(n, h, jobs[n].nbytes) for n, h in journaled.done.items() if n in jobs],
                           remade=redone)
    return _complete(result, completed, jpath)


def _complete(result: ConvertResult, completed: Callable[[ConvertResult], None] | None, jpath: Path) -> ConvertResult:
    """The caller's records of a renamed output, then the journal's removal: the last step, so that whatever
    interrupts the records leaves a run that ``--resume`` finishes."""
    if completed is not None:
        try:
            completed(result)
        except OSError as exc:
            if not is_out_of_space(exc):
                raise
            raise OutOfSpaceError("no space left on the device for the conversion's records (release manifest, "
                                  f"report); the output {result.path} is complete: free some space, then run the "
                                  "same command again with --resume to write them",
                                  path=exc.filename or result.path) from None
    jpath.unlink(missing_ok=True)
    return result


def convert(request: ConvertRequest) -> ConvertResult:
    """Plan and write the GGUF (the whole of ``quantkit convert`` but printing)."""
    return execute(prepare(request), request)


__all__ = ["EXECUTORS", "FREE_SPACE_RESERVE_BYTES", "ConvertRequest", "ConvertResult", "Prepared", "check_outputs", "convert",
           "execute", "file_layout", "free_space_reserve", "make_job", "prepare"]
