"""``quantkit transport split|assemble`` (the work is :mod:`quantkit.transport`) and ``quantkit fetch``.

Exit codes: 0 done; 1 a part or a download whose bytes differ from the manifest (corrupt, truncated, reordered);
2 a missing part or manifest, a bad size, an output that exists, a full filesystem (the partial output and its
journal stay: the same command resumes).
"""
from __future__ import annotations

import sys
from pathlib import Path

import click


def _progress_default() -> bool:
    return sys.stderr.isatty()


class SizeParam(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        from ..transport.sizes import parse_size

        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.group("transport")
def transport():
    """Split an artifact into verifiable transport parts and assemble it back."""


@transport.command("split")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--part-size", required=True, type=SizeParam(),
              help="largest part: 3MB, 49GB (powers of 1000), 1.5GiB (powers of 1024), or bytes; for shards, their "
                   "padded tensor bytes (headers not counted), as llama-gguf-split --split-max-size counts")
@click.option("-o", "--output-dir", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="directory for the parts and the manifest (<file>.transport.json); created if missing")
@click.option("--gguf/--bytes", "gguf", default=None,
              help="llama.cpp split shards at tensor boundaries, or plain byte ranges [default: shards for .gguf]")
@click.option("--force", is_flag=True, help="replace existing parts and manifest")
@click.option("--progress/--no-progress", default=_progress_default, help="progress bar on stderr")
def split(file, part_size, out_dir, gguf, force, progress):
    """Split FILE into parts of at most --part-size and write their manifest (per-part and whole SHA-256)."""
    from ..transport.sizes import format_size
    from ..transport.split import split_file

    m = split_file(file, out_dir, part_size, gguf=gguf, force=force, progress=progress)
    what = "llama.cpp split shards" if m.kind == "gguf-split" else "byte parts"
    click.echo(f"wrote {len(m.parts)} {what} of {m.file.name} ({format_size(m.file.size)}, sha256 {m.file.sha256}) "
               f"and {m.path}")


@transport.command("assemble")
@click.argument("manifest", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the file to write (an interrupted run resumes from <output>.partial)")
@click.option("--force", is_flag=True, help="replace an existing output")
@click.option("--progress/--no-progress", default=_progress_default, help="progress bar on stderr")
def assemble(manifest, out, force, progress):
    """Assemble the file MANIFEST describes: every part checked by size and SHA-256, resumable, renamed at the end."""
    from ..transport.assemble import assemble as run
    from ..transport.sizes import format_size

    result = run(manifest, out, force=force, progress=progress)
    resumed = f", {result.resumed_parts} verified from an earlier run" if result.resumed_parts else ""
    for note in result.problems_repaired:
        click.echo(f"note: {note}", err=True)
    click.echo(f"wrote {result.output} ({format_size(result.size)}) from {result.parts} parts{resumed}; every "
               f"part matched its SHA-256")


@click.command("fetch")
@click.argument("repo")
@click.argument("files", nargs=-1, required=True)
@click.option("-o", "--output-dir", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="where the files go (an interrupted download resumes from <file>.partial)")
@click.option("--manifest", help="transport manifest to verify every file against (a local file, or the name of one "
                                 "in the repository)")
@click.option("--revision", help="branch, tag or commit (default: main)")
@click.option("--force", is_flag=True, help="replace existing files")
@click.option("--progress/--no-progress", default=_progress_default, help="progress bar on stderr")
def fetch(repo, files, out_dir, manifest, revision, force, progress):
    """Download FILES of Hugging Face repository REPO (HF_ENDPOINT, HF_TOKEN honored), resuming an interrupted
    download, each verified against --manifest's size and SHA-256 before it gets its final name."""
    from ..transport.fetch import fetch as run

    def report(got):   # as each file is done: a later file's failure does not hide the ones already there
        resumed = f", resumed after {got.resumed_bytes:,} bytes" if got.resumed_bytes else ""
        check = "matches the manifest" if got.verified else "no manifest given: not verified"
        there = "already there, " if got.already_there else ""
        click.echo(f"{got.path}: {there}{got.size:,} bytes, sha256 {got.sha256} ({check}{resumed})")

    run(repo, list(files), out_dir, manifest=manifest, revision=revision, force=force, progress=progress,
        on_fetched=report)


COMMANDS = [transport, fetch]
