"""``quantkit convert``: a checkpoint and a recipe in, a GGUF out (the work is :mod:`quantkit.convert.execute`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import EXIT_INTERRUPTED
from .executors import check_executor, default_jobs


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
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=default_jobs, show_default="CPUs available",
              help="worker processes (1: encode in this process); lowered to the CPUs available and to what the "
                   "memory holds, with a note")
@click.option("--resume", is_flag=True, help="continue an interrupted conversion of the same plan")
@click.option("--force", is_flag=True, help="replace an existing output, report or unfinished conversion")
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
@click.option("--progress/--no-progress", default=True, show_default=True, help="show a progress bar")
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
            pre_tokenizer, report, reserve, dialect, progress, executor, address, transfer):
    """Convert checkpoint SOURCE (a directory or a Hugging Face repo id) to a GGUF laid out by a recipe."""
    from ..convert.execute import ConvertRequest, check_outputs, execute, prepare
    from ..io.atomic import atomic_output

    if not dry_run:
        check_executor("quantkit convert", executor, address)
    request = ConvertRequest(source=source, out=out, recipe=recipe, imatrix=imatrix, bootstrap=bootstrap,
                             allow_synthetic_imatrix=allow_synthetic_imatrix, jobs=jobs, resume=resume, force=force,
                             label=label, pre_tokenizer=pre_tokenizer, reserve_bytes=reserve, dialect=dialect,
                             progress=progress, executor=executor, address=address, transfer=transfer)
    prepared = prepare(request)
    click.echo(prepared.plan.summary())
    if prepared.workers_note:
        click.echo(f"note: {prepared.workers_note}", err=True)
    if dry_run:
        return
    check_outputs(prepared, request, report)
    try:
        result = execute(prepared, request)
    except KeyboardInterrupt:
        click.echo("interrupted: the partial output and its journal are kept; run again with --resume to continue",
                   err=True)
        sys.exit(EXIT_INTERRUPTED)
    if report is not None:
        with atomic_output(report, overwrite=force) as tmp:
            tmp.write_text(json.dumps({"name_tag": prepared.plan.name_tag, **result.report()}, indent=1) + "\n")
    if result.finished_earlier:
        click.echo(f"{result.path} was already complete (an earlier run finished it)")
        return
    click.echo(f"wrote {result.path} ({result.file_size:,} bytes, {result.tensors} tensors"
               + (f", {result.resumed} from the journal" if result.resumed else "")
               + f") in {result.wall_seconds:.1f} s with {result.jobs} job{'s' if result.jobs > 1 else ''}")


COMMANDS = [convert]
