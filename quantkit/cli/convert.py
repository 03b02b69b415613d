"""``quantkit convert``: a checkpoint and a recipe in, a GGUF out (the work is :mod:`quantkit.convert.execute`)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from ..io import jsontext
from ..evidence import artifact_sha256, remember_artifact_sha256

from . import EXIT_INTERRUPTED
from .executors import TorchDevice, check_executor, default_jobs


@click.command("convert")
@click.argument("source")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the GGUF file to write")
@click.option("--recipe", required=True, help="a recipe file or the name of a shipped recipe (quantkit recipes)")
@click.option("--imatrix", type=click.Path(exists=True, dir_okay=False),
              help="importance matrix (llama.cpp GGUF imatrix or legacy .dat); experts it never observed get "
                   "bootstrap importance, recorded in the file")
@click.option("--bootstrap-importance", "bootstrap", is_flag=True,
              help="weight-energy importance (sum of w^2 per column) for tensors without imatrix data")
@click.option("--allow-synthetic-imatrix", is_flag=True, help="accept an imatrix made from synthetic or fixture data")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              show_default="CPUs available; 1 with --device cuda",
              help="worker processes (1: encode in this process); lowered to the CPUs available and to what the "
                   "memory holds, with a note")
@click.option("--resume", is_flag=True, help="continue an interrupted conversion of the same plan")
@click.option("--force", is_flag=True, help="replace an existing output, report or unfinished conversion (with "
                                             "--resume: continue the unfinished one, then replace the output)")
@click.option("--label", help="checkpoint label recorded in the file (e.g. 0731)")
@click.option("--dry-run", is_flag=True, help="print the plan and stop")
@click.option("--pre-tokenizer", help="llama.cpp pre-tokenizer name, for tokenizers its hash table does not know")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path),
              help="write a JSON report: per tensor SHA-256, bytes and seconds, and the totals")
@click.option("--free-space-reserve", "reserve", type=click.IntRange(min=0), metavar="BYTES",
              help="free space to keep on the output's filesystem beyond the file [default: 1% of the file, "
                   "1 MiB to 1 GiB]")
@click.option("--dialect", type=click.Choice(["llama.cpp", "ds4"]),
              help="GGUF dialect: llama.cpp's tensor names and keys, or ds4's  [default: the recipe's dialect, "
                   "else llama.cpp]")
@click.option("--release-manifest", "manifest", type=click.Path(dir_okay=False, path_type=Path),
              help="write the release manifest (name, size, SHA-256, recipe, calibration, label, source) here; an "
                   "earlier release manifest there is replaced, any other file only with --force  "
                   "[default: <output stem>.release.json beside the output]")
@click.option("--progress/--no-progress", default=True, show_default=True, help="show a progress bar")
@click.option("--support", type=click.Choice(["mtp", "dspark"]),
              help="write the support (drafter) file instead: mtp, the MTP blocks (with the embedding and head in "
                   "llama.cpp's dialect; ds4's mtp.K.* alone with --dialect ds4); dspark, DeepSeek V4's DSpark "
                   "drafter (llama.cpp's dflash); each records the checkpoint identity its target must share")
@click.option("--device", type=TorchDevice(), default="cpu", show_default=True,
              help="encode Q8_0, MXFP4, NVFP4, Q4_K, Q2_K and IQ2_XXS tensors on this torch device (same bytes as "
                   "the CPU; other types stay on the CPU); with cuda one job unless -j says otherwise (-j 4 measured "
                   "slower than -j 1 on an H200: each worker imports torch and holds the GPU)")
@click.option("--executor", type=click.Choice(["process", "ray"]), default="process", show_default=True,
              help="worker processes on this machine, or Ray tasks on a cluster (the ray extra)")
@click.option("--address", metavar="HOST:PORT",
              help="with --executor ray: the cluster to join [default: a local cluster of --jobs CPUs, started "
                   "and stopped by this run]")
@click.option("--ray-transfer", "transfer", type=click.Choice(["auto", "write", "return"]), default="auto",
              show_default=True,
              help="with --executor ray: tasks write into the partial output (a shared filesystem), return bytes "
                   "to this process, or write where the partial is visible and return bytes elsewhere")
def convert(source, out, recipe, imatrix, bootstrap, allow_synthetic_imatrix, jobs, resume, force, label, dry_run,
            pre_tokenizer, report, reserve, dialect, manifest, progress, support, device, executor, address,
            transfer):
    """Convert checkpoint SOURCE (a directory or a Hugging Face repo id) to a GGUF laid out by a recipe."""
    from .. import names
    from ..convert.execute import ConvertRequest, check_outputs, execute, prepare
    from ..io.atomic import atomic_output, check_output

    if not dry_run:
        check_executor("quantkit convert", executor, address)
    elif address is not None and executor != "ray":
        raise click.UsageError("--address needs --executor ray")
    for given, option in ((report, "--report"), (manifest, "--release-manifest")):
        if dry_run and given is not None:   # nothing would be written: said, not ignored
            raise click.UsageError(f"{option} is written by a conversion; --dry-run writes nothing")
    if transfer != "auto" and executor != "ray":
        raise click.UsageError("--ray-transfer needs --executor ray")
    if jobs is None:    # one process feeds a GPU best: each more worker imports torch and holds a context of its own
        jobs = 1 if device != "cpu" and executor == "process" else default_jobs()
    request = ConvertRequest(source=source, out=out, recipe=recipe, imatrix=imatrix, bootstrap=bootstrap,
                             allow_synthetic_imatrix=allow_synthetic_imatrix, jobs=jobs, resume=resume, force=force,
                             label=label, pre_tokenizer=pre_tokenizer, reserve_bytes=reserve, dialect=dialect,
                             progress=progress, support=support, device=device, executor=executor,
                             address=address, transfer=transfer)
    started = time.perf_counter()
    prepared = prepare(request)
    planned = time.perf_counter() - started
    click.echo(prepared.plan.summary())
    unobserved = {name: len(job.bootstrap) for name, job in prepared.jobs.items() if job.bootstrap}
    if unobserved:   # decided per matrix against the imatrix, after the plan: its importance line counts tensors
        click.echo(f"bootstrap   {sum(unobserved.values())} matrices of {len(unobserved)} imatrix tensors the imatrix "
                   f"never observed (experts no token was routed to) take bootstrap importance")
    suggested = _suggested_name(prepared, label)
    if suggested is not None:
        click.echo(f"name        {suggested}" + ("" if suggested == out.name else f"  (suggested; writing {out.name})"))
        if label is not None and names.parse(suggested).label != label:
            click.echo(f"note: label {label!r} is recorded in the file; names carry a 4-digit label (0731) alone",
                       err=True)
    if prepared.workers_note:
        click.echo(f"note: {prepared.workers_note}", err=True)
    if dry_run:
        return
    manifest = manifest or names.manifest_path(out)
    check_outputs(prepared, request, report, manifest)
    # a quantkit release manifest is replaced (this output's own, stale); any other file only with --force
    check_output(manifest, inputs=[*prepared.inputs, out, *([report] if report else [])],
                 overwrite=force or names.is_release_manifest(manifest), what="release manifest")
    written = {}

    def records(result) -> None:
        """The release manifest and the report, written before convert removes its journal (see execute)."""
        if result.sha256 is not None:   # read back while it was written (quantkit.convert.readback)
            sha256 = result.sha256
            remember_artifact_sha256(result.path, sha256)
        else:   # an earlier run finished it: read it
            sha256, _ = artifact_sha256(result.path, progress=progress, reuse=False)
        record = names.release_manifest(result.path, sha256, suggested)
        with atomic_output(manifest, overwrite=True) as tmp:   # checked above, before the work
            tmp.write_text(jsontext.dumps(record, indent=1) + "\n")
        if report is not None:
            with atomic_output(report, overwrite=force) as tmp:
                tmp.write_text(jsontext.dumps({"format": "quantkit-convert-report", "version": 1,
                                           "name_tag": prepared.plan.name_tag, "suggested_name": suggested,
                                           "sha256": sha256, "release_manifest": str(manifest),
                                           "prepare_seconds": planned, **result.report()}, indent=1) + "\n")
        written["sha256"] = sha256

    try:
        result = execute(prepared, request, completed=records)
    except KeyboardInterrupt:
        click.echo(f"interrupted: {_interrupted_state(out, recorded=bool(written))}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    sha256 = written["sha256"]
    if result.remade:
        click.echo(f"note: {len(result.remade)} journaled tensor{'s' if len(result.remade) > 1 else ''} whose bytes "
                   f"in the partial were not what the journal says (a write lost in a crash) made again: "
                   f"{', '.join(result.remade[:3])}{', ...' if len(result.remade) > 3 else ''}", err=True)
    if result.finished_earlier:
        click.echo(f"{result.path} was already complete (an earlier run finished it)")
    else:
        click.echo(f"wrote {result.path} ({result.file_size:,} bytes, {result.tensors} tensors"
                   + (f", {result.resumed} from the journal" if result.resumed else "")
                   + f") in {result.wall_seconds:.1f} s with {result.jobs} job{'s' if result.jobs > 1 else ''}")
    click.echo(f"sha256 {sha256}; release manifest {manifest}")


def _interrupted_state(out: Path, recorded: bool) -> str:
    """What an interrupted convert left, and what to run next (``recorded``: its release manifest is written)."""
    from ..convert.journal import journal_path
    from ..io.gguf_writer import PARTIAL_SUFFIX

    if out.with_name(out.name + PARTIAL_SUFFIX).exists():
        return "the partial output and its journal are kept; run again with --resume to continue"
    if journal_path(out).exists() and out.exists():     # renamed into place, its records not written yet
        return f"{out.name} is complete; run again with --resume to finish its records (release manifest)"
    if recorded:
        return f"{out.name} and its release manifest were written"
    return "before any output was written; nothing is kept"


def _suggested_name(prepared, label: str | None) -> str | None:
    """The file name the artifact-name grammar gives this conversion (None: its tag is outside the grammar)."""
    from .. import names
    from ..convert.provenance import overall_calibration
    from ..errors import FormatError

    # as the file records it: an imatrix no tensor takes (a Q8_0 recipe) is no imatrix calibration
    calibrated = overall_calibration(list(prepared.jobs.values()), prepared.imatrix is not None).startswith("imatrix")
    try:
        return names.suggest(names.model_name(prepared.source.repo_id, prepared.source.path), prepared.plan.name_tag,
                             calibration="imatrix" if calibrated else None, label=label,
                             support=prepared.plan.support).render()
    except FormatError:
        return None


COMMANDS = [convert]
