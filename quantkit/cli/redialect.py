"""``quantkit redialect``: rename a GGUF's tensors and keys into the other dialect, payloads unchanged."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("redialect")
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "to", required=True, type=click.Choice(["ds4", "llama.cpp"]), help="the dialect to write")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the GGUF file to write")
@click.option("--force", is_flag=True, help="replace an existing output")
def redialect(source, to, out, force):
    """Write GGUF SOURCE under ds4's or llama.cpp's tensor names, keys and order; every payload byte is copied and
    hash-checked (GLM's A_log, stored differently by the two dialects, is mapped and proven reversible)."""
    from ..convert.redialect import redialect as run

    result = run(source, out, to=to, force=force)
    click.echo(f"wrote {result.path} ({result.file_size:,} bytes): {result.source_dialect} -> {result.dialect}, "
               f"{result.tensors} tensors, {result.copied} payloads copied unchanged"
               + (f", {len(result.mapped)} A_log payloads mapped" if result.mapped else ""))


COMMANDS = [redialect]
