"""``quantkit imatrix``: inspect, merge, convert and collect importance matrices (thin: the work is in
:mod:`quantkit.imatrix`, imported inside each command so ``quantkit --help`` stays fast)."""
from __future__ import annotations

import click

from . import one_output
from .executors import TorchDevice, check_executor, executor_options
from ..io import jsontext

FORMAT_CHOICE = click.Choice(["gguf", "dat"])
#: Suffixes of a --max-memory size (binary: 8G is 8 GiB).
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ByteSize(click.ParamType):
    """A size in bytes: a number with an optional K, M, G or T suffix (powers of 1024), e.g. ``8G``, ``512M``."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in SIZE_UNITS else ""
        try:
            number = float(text[:len(text) - len(unit)])
        except ValueError:
            number = -1.0
        if not 0 <= number < float("inf"):
            self.fail(f"{value!r} is not a size (a number with an optional K, M, G or T suffix, e.g. 8G)", param, ctx)
        return int(number * SIZE_UNITS[unit])


@click.group("imatrix")
def imatrix():
    """Importance matrices (llama.cpp GGUF imatrix or legacy .dat): info, merge, convert, collect."""


@imatrix.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--all", "show_all", is_flag=True, help="list every tensor (default: summarize long tables)")
@click.option("--model", "model", type=click.Path(exists=True, dir_okay=False),
              help="a GGUF model: check that every entry names one of its tensors with the same length and "
                   "matrix count, and report per matrix (a legacy .dat gets its experts back)")
def info(path, as_json, show_all, model):
    """Entries, chunks, datasets, per-tensor statistics and expert coverage of an imatrix."""
    from ..imatrix import load_imatrix
    from ..imatrix.report import describe, render

    imx = load_imatrix(path)
    fit = None
    if model is not None:
        imx, fit = _conform_to_model(imx, model)
    report = describe(imx)
    if fit is not None:
        report["model"] = fit
    if as_json:
        click.echo(jsontext.dumps(report, indent=1))
    else:
        click.echo(render(report, show_all=show_all))
        if fit is not None:
            click.echo(f"matches {model}: every entry names one of its tensors with the same shape; "
                       f"{fit['covered']} of its {fit['tensors']} weight tensors covered"
                       + (f" (missing: {_listed(fit['missing'])})" if fit["missing"] else ""))
            if fit["other_checkpoint"]:
                recorded, model_source = imx.provenance["source_digest"], fit["model_source"]
                click.echo(f"note: collected from another checkpoint than the model was converted from (source "
                           f"digest {recorded[:16]}…, the model's {model_source[:16]}…)")


def _listed(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _conform_to_model(imx, model_path):
    """The imatrix checked against a GGUF model's tensors and laid out per matrix (legacy files get their
    experts back, llama-imatrix's per-group entries of grouped weights are folded), and how it fits the model:
    the weight tensors it covers and misses, and whether it records another checkpoint than the model's source
    (both record a source digest: the same model in another encoding, FP8 or BF16, differs too, so a note)."""
    from pathlib import Path

    from ..imatrix.names import expected_entries, gguf_input_groups
    from ..io.gguf_reader import GGUFFile
    from ..scoring.source import gguf_identity

    with GGUFFile(model_path) as f:
        shapes = {name: t.shape for name, t in f.tensors.items()}
        groups = gguf_input_groups(f.metadata, shapes, Path(model_path))
        model_source = gguf_identity(f.metadata, path=model_path).source
    expected = expected_entries(shapes)
    imx = imx.conform(expected, required=(), groups=groups)
    missing = sorted(name for name in expected if name not in imx.entries)
    recorded = imx.provenance.get("source_digest")
    return imx, {"tensors": len(expected), "covered": len(expected) - len(missing), "missing": missing,
                 "model_source": model_source,
                 "other_checkpoint": bool(recorded and model_source and recorded != model_source)}


@imatrix.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="merged imatrix")
@click.option("--format", "fmt", type=FORMAT_CHOICE, default=None, help="output format (default: by file name)")
@click.option("--chunk-size", type=int, default=None,
              help="tokens per chunk of legacy .dat inputs, when merged with GGUF imatrices")
@click.option("--force", is_flag=True, help="overwrite the output")
def merge(inputs, output, fmt, chunk_size, force):
    """Merge imatrices weighted by their counts (like llama-imatrix --in-file)."""
    from ..imatrix import load_imatrix, merge_imatrices, save_imatrix
    from ..imatrix.formats import imatrix_output
    from ..imatrix.merge import unchecked_inputs
    from ..io.atomic import input_files

    with imatrix_output(output, inputs=input_files(inputs), overwrite=force):
        loaded = [load_imatrix(p) for p in inputs]
        merged = merge_imatrices(loaded, chunk_size=chunk_size)
        for note in unchecked_inputs(loaded):
            click.echo(f"note: {note}", err=True)
        save_imatrix(merged, output, fmt=fmt, overwrite=force)
    click.echo(f"merged {len(inputs)} imatrices into {output}: {len(merged.entries)} entries, "
               f"{merged.chunk_count} chunks, {merged.coverage()}")


@imatrix.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst_arg", metavar="[DST]", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", "dst", type=click.Path(dir_okay=False), help="the file to write (DST)")
@click.option("--format", "fmt", type=FORMAT_CHOICE, default=None, help="output format (default: by file name)")
@click.option("--config", "config", type=click.Path(exists=True),
              help="config.json (or its checkpoint directory) to rename Hugging Face entry names to GGUF names")
@click.option("--force", is_flag=True, help="overwrite the output")
def convert(src, dst_arg, dst, fmt, config, force):
    """Convert SRC between the GGUF imatrix and the legacy .dat (and Hugging Face names to GGUF names); write it
    to -o DST."""
    dst = one_output(dst, dst_arg)
    from dataclasses import replace

    from ..imatrix import load_imatrix, save_imatrix
    from ..imatrix.formats import imatrix_output
    from ..io.atomic import input_files

    with imatrix_output(dst, inputs=input_files([src, config]), overwrite=force):
        imx = load_imatrix(src)
        if config is not None:
            from ..imatrix.names import to_gguf_names

            imx = to_gguf_names(imx, _arch_map(config))
        converted = replace(imx, provenance={**imx.provenance, "converted_from": imx.sha256 or ""})
        save_imatrix(converted, dst, fmt=fmt, overwrite=force)
    click.echo(f"wrote {dst}: {len(converted.entries)} entries, {converted.coverage()}")


def _arch_map(config_path):
    from pathlib import Path

    from ..arch import get_arch
    from ..errors import SourceError
    from ..io.config import check_config_sizes

    path = Path(config_path)
    path = path / "config.json" if path.is_dir() else path
    try:
        config = jsontext.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise SourceError(f"cannot read the config: {exc.strerror}", path=path) from None
    except ValueError as exc:
        raise SourceError(f"not valid JSON: {exc}", path=path) from None
    if not isinstance(config, dict):
        raise SourceError("must be a JSON object", path=path)
    check_config_sizes(config, path=path)
    return get_arch(config.get("model_type", "")).bind(config)


@imatrix.command()
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.option("--text", "text", required=True, type=click.Path(exists=True, dir_okay=False),
              help="calibration text (UTF-8)")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="imatrix to write (GGUF; llama.cpp's legacy format for a .dat name)")
@click.option("--ctx", default=512, show_default=True, help="tokens per chunk")
@click.option("-b", "--batch", type=click.IntRange(min=1), default=2048, show_default=True,
              help="tokens per forward pass (like llama-imatrix -b): batch / ctx chunks run together")
@click.option("--chunks", type=int, default=None, help="process at most this many chunks")
@click.option("--all-experts", is_flag=True,
              help="route every token to every expert for the statistics (the model's output is unchanged)")
@click.option("--process-output", is_flag=True, help="also collect the output head (output.weight)")
@click.option("--synthetic", is_flag=True, help="mark the result as made from synthetic or fixture text")
@click.option("--device", type=TorchDevice(), default="cpu", show_default=True, help="torch device (cpu, cuda, cuda:N)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="dtype the model runs in")
@click.option("--max-memory", type=ByteSize(), default=None,
              help="memory for the model's assembled weights (e.g. 8G; 0: none kept, each is read per use); a "
                   "larger model streams from the checkpoint (default: half the available memory)")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads the model runs on (like llama-imatrix -t; default: one per 2^18 values of a "
                   "pass's hidden states, at most one per core)")
@click.option("--save-every", type=click.IntRange(min=0), default=10, show_default=True,
              help="write the resume state every N chunks (0: never)")
@click.option("--restart", is_flag=True, help="ignore a resume state left by an interrupted run")
@click.option("--force", is_flag=True, help="overwrite the output")
@click.option("--progress/--no-progress", default=True, show_default=True, help="show a progress bar (as convert)")
@executor_options
def collect(source, text, output, ctx, batch, chunks, all_experts, process_output, synthetic, device, dtype, max_memory,
            threads, save_every, restart, force, progress, executor, address, jobs):
    """Run SOURCE (a Hugging Face checkpoint) over the text and collect its imatrix, like llama-imatrix."""
    from ..extras import require_runtime

    require_runtime("quantkit imatrix collect")
    check_executor("quantkit imatrix collect", executor, address)
    from ..imatrix.collect import CollectOptions, collect_imatrix

    opts = CollectOptions(ctx=ctx, batch=batch, chunks=chunks, all_experts=all_experts, process_output=process_output,
                          synthetic=synthetic, device=device, dtype=dtype, max_memory=max_memory,
                          threads=threads, save_every=save_every, restart=restart,
                          overwrite=force, progress=progress, executor=executor, address=address, workers=jobs)
    imx = collect_imatrix(source, text, output, opts)
    click.echo(f"wrote {output}: {len(imx.entries)} entries, {imx.chunk_count} chunks of {ctx} tokens, "
               f"{imx.coverage()}")


COMMANDS = [imatrix]
