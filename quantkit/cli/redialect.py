"""``quantkit redialect``: rename a GGUF's tensors and keys into the other dialect, payloads unchanged (GLM's A_log,
stored as -exp(A_log) by llama.cpp, comes from the checkpoint for ds4: ``--source``)."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("redialect")
@click.argument("gguf", metavar="IN.gguf", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "to", required=True, type=click.Choice(["ds4", "llama.cpp"]), help="the dialect to write")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the GGUF file to write")
@click.option("--source", "checkpoint", metavar="DIR",
              help="the checkpoint directory (or Hugging Face repo id) IN.gguf was converted from; read for "
                   "llama.cpp -> ds4 of a GLM file, whose A_log llama.cpp stores only as -exp(A_log)")
@click.option("--force", is_flag=True, help="replace an existing output")
def redialect(gguf, to, out, checkpoint, force):
    """Write IN.gguf under ds4's or llama.cpp's tensor names, keys and order; every payload byte is copied and
    hash-checked, except GLM's A_log (llama.cpp stores -exp(A_log)): computed for llama.cpp; for ds4 read from
    --source and checked to give the file's -exp(A_log) (refused without it)."""
    from ..convert.redialect import redialect as run

    result = run(gguf, out, to=to, force=force, source=checkpoint)
    how = "read from the source checkpoint" if to == "ds4" else "mapped to -exp(A_log)"
    click.echo(f"wrote {result.path} ({result.file_size:,} bytes): {result.source_dialect} -> {result.dialect}, "
               f"{result.tensors} tensors, {result.copied} payloads copied unchanged"
               + (f", {len(result.mapped)} A_log payload{'s' * (len(result.mapped) != 1)} {how}" if result.mapped
                  else ""))


COMMANDS = [redialect]
