"""``quantkit swapset``: make sidecars, list families, and keep the sidecar inventory beside a checkpoint.

``quantkit swapset MODEL_DIR --family F --format ...`` makes a sidecar (the ``make`` subcommand, implied when the
first argument is not a subcommand name); ``quantkit swapset status MODEL_DIR`` and ``quantkit swapset gc
MODEL_DIR`` manage what is there; ``quantkit swapset record MODEL_DIR NAME PLAIN.tsv SIDECAR.tsv`` stores a
``quantkit compare`` of two score tables in the sidecar's manifest.  Library imports happen inside the commands.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..io import jsontext
from . import EXIT_CHECK_FAILED

FORMAT_CHOICES = ("nvfp4", "fp8-tensor", "fp8-channel", "fp8-block128", "fp8-block128-e8m0")
CONVENTION_CHOICES = ("modelopt", "compressed-tensors")
_MAKE = "make"


class _SwapsetGroup(click.Group):
    """A group whose first argument may be MODEL_DIR: then the ``make`` subcommand is implied."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [_MAKE, *args]
        return super().parse_args(ctx, args)


@click.group(cls=_SwapsetGroup)
def swapset():
    """Sidecars ("swapsets") that swap tensor families of a checkpoint for NVFP4 or FP8.

    \b
    quantkit swapset MODEL_DIR --family inproj --format nvfp4 [--convention modelopt]
    quantkit swapset MODEL_DIR --draft-lm-head --vocab-subset 32768 --calibration text.txt
    quantkit swapset MODEL_DIR --list-families
    quantkit swapset status MODEL_DIR [--record FILE]
    quantkit swapset gc MODEL_DIR --dry-run | --yes
    quantkit swapset record MODEL_DIR NAME PLAIN.tsv SIDECAR.tsv
    """


def _names(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@swapset.command(_MAKE)
@click.argument("model_dir", type=_DIR)
@click.option("--family", "families", multiple=True, help="family or comma-separated families (--list-families)")
@click.option("--format", "fmt", type=click.Choice(FORMAT_CHOICES),
              help="target encoding (draft heads: nvfp4); nvfp4 needs --convention unless the checkpoint is NVFP4")
@click.option("--convention", type=click.Choice(CONVENTION_CHOICES),
              help="NVFP4 global-scale convention: modelopt (weight_scale_2 multiplies) or compressed-tensors "
                   "(weight_global_scale divides); required with --format nvfp4 unless the checkpoint is NVFP4, "
                   "whose convention is used")
@click.option("--name", help="sidecar name (default nvfp4-swapset-<families>, or fp8-swapset-<families>-<variant>, "
                             "e.g. fp8-swapset-attn-block128)")
@click.option("--source", "source_dir", type=_DIR, help="read tensors from this checkpoint (default MODEL_DIR)")
@click.option("--shared-experts", is_flag=True, help="serve shared experts as an extra routed expert")
@click.option("--draft-lm-head", is_flag=True, help="make an lm_head for the MTP drafter")
@click.option("--vocab-subset", type=int, help="keep the N most frequent tokens of --calibration (rounded up to 128)")
@click.option("--token-ids", "token_ids_file", type=_FILE, help="keep these token ids (whitespace-separated)")
@click.option("--calibration", type=_FILE, help="UTF-8 text: activation scales, token frequencies")
@click.option("--sample", type=_FILE, help="UTF-8 text for the draft head's agreement (default --calibration)")
@click.option("--supersedes", multiple=True, help="sidecar(s) this one replaces (comma-separated)")
@click.option("--optional/--required", "optional", default=None, help="opt-in sidecar (default by family)")
@click.option("--force", is_flag=True, help="replace an existing sidecar of the same name")
@click.option("--dry-run", is_flag=True, help="print the plan and write nothing")
@click.option("--list-families", is_flag=True, help="list the checkpoint's families and exit")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def make(model_dir, families, fmt, convention, name, source_dir, shared_experts, draft_lm_head, vocab_subset,
         token_ids_file, calibration, sample, supersedes, optional, force, dry_run, list_families, as_json):
    """Make a sidecar beside MODEL_DIR."""
    from ..swapset import SwapsetRequest, build_swapset, list_families as families_of, plan_swapset

    if (calibration or sample) and not (dry_run or list_families):
        from ..extras import require_runtime

        require_runtime("quantkit swapset --calibration/--sample")   # the reference model runs on torch

    if list_families:
        rows = families_of(model_dir)
        if as_json:
            click.echo(jsontext.dumps(rows, indent=1))
        else:
            for r in rows:
                flag = " (opt-in)" if r["optional"] else ""
                click.echo(f"{r['family']:10} {r['tensors']:5} tensors {_size(r['bytes']):>12}  "
                           f"{r['description']}{flag}")
        return
    arguments = {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                 for k, v in dict(model_dir=model_dir, families=families, fmt=fmt, convention=convention, name=name,
                                  source_dir=source_dir, shared_experts=shared_experts, draft_lm_head=draft_lm_head,
                                  vocab_subset=vocab_subset, token_ids_file=token_ids_file, calibration=calibration,
                                  sample=sample, supersedes=supersedes, optional=optional).items()}
    request = SwapsetRequest(model_dir, _names(families), fmt, convention, name, source_dir, shared_experts,
                             draft_lm_head, vocab_subset, token_ids_file, calibration, sample, _names(supersedes),
                             optional, force, arguments)
    if dry_run:
        plan = plan_swapset(request)
        summary = plan.summary()
        if as_json:
            click.echo(jsontext.dumps(summary, indent=1))
            return
        click.echo(f"plan {summary['name']}: {summary['encoding']}, {len(summary['modules'])} modules, "
                   f"{_size(summary['bytes'])}")
        for m in summary["modules"]:
            click.echo(f"  {m['origin']:14} {m['module']} -> {m['output_module']}")
        for other in summary["overrules"]:
            click.echo(f"{other}.json would stop superseding {summary['name']} (a cycle: the newest wins)")
        return
    result = build_swapset(request)
    m = result.manifest
    if as_json:
        click.echo(jsontext.dumps({"safetensors": str(result.safetensors), "manifest": str(result.manifest_path),
                               **{k: m[k] for k in ("name", "encoding", "sidecar", "calibration", "draft_lm_head")}},
                              indent=1))
        return
    origins = [mod["origin"] for mod in m["modules"]]
    click.echo(f"wrote {result.safetensors} ({_size(m['sidecar']['bytes'])}) and {result.manifest_path.name}: "
               f"{m['encoding']}, {origins.count('native')} native + {origins.count('self-quantized')} "
               f"self-quantized modules")
    for other in result.plan.overrules:
        click.echo(f"{other}.json no longer supersedes {m['name']} (a cycle: the newest wins)")
    info = m["draft_lm_head"]
    if info is not None:
        click.echo(f"draft head: {info['kept_rows']} of {info['source_rows']} rows ({info['selection']})")
        agreement = info["agreement"]
        if agreement is None:
            click.echo("agreement: not measured (no --calibration or --sample text)")
        else:
            click.echo(f"agreement with the source head over {agreement['positions']} positions: "
                       f"top-1 {agreement['top1']:.4f}, top-5 {agreement['top5']:.4f}, "
                       f"coverage {agreement['coverage']:.4f}")


@swapset.command()
@click.argument("model_dir", type=_DIR)
@click.option("--record", type=_FILE, help='JSON record naming the sidecars a run needs ({"sidecars": [...]})')
@click.option("--full", is_flag=True, help="also hash payloads and the tensors they replace")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def status(model_dir, record, full, as_json):
    """Classify every sidecar beside MODEL_DIR: required, optional, obsolete, stale or unknown."""
    from ..swapset import status as sidecar_status

    report = sidecar_status(model_dir, record, full=full)
    data = report.to_dict()
    if as_json:
        click.echo(jsontext.dumps(data, indent=1))
    else:
        for s in report.sidecars:
            click.echo(f"{s.state:9} {s.name:40} {_size(s.bytes):>12}  {s.reason}")
        for name in report.missing:
            click.echo(f"{'missing':9} {name:40} {'':>12}  named by the record, not beside the checkpoint")
        totals = ", ".join(f"{state} {_size(n)}" for state, n in data["bytes_by_state"].items() if n)
        click.echo(f"{len(report.sidecars)} sidecars" + (f": {totals}" if totals else ""))
    if record is not None and not report.record_satisfied:
        sys.exit(EXIT_CHECK_FAILED)


@swapset.command()
@click.argument("model_dir", type=_DIR)
@click.option("--dry-run", is_flag=True, help="list what would be removed")
@click.option("--yes", is_flag=True, help="remove obsolete sidecars")
@click.option("--record", type=_FILE, help="keep sidecars this record needs even when superseded")
def gc(model_dir, dry_run, yes, record):
    """Remove obsolete (superseded) sidecars beside MODEL_DIR: only files quantkit made (a quantkit manifest and
    the payload whose SHA-256 it records); other superseded files are listed and kept."""
    from ..swapset import gc as collect

    if dry_run == yes:
        raise click.UsageError("pass exactly one of --dry-run and --yes")
    report = collect(model_dir, dry_run=dry_run, record=record)
    verb = "would remove" if dry_run else "removed"
    for s in report.removed:
        click.echo(f"{verb} {s.name} ({_size(s.bytes)}; {s.reason}): {', '.join(s.files)}")
    for s, why in report.kept:
        click.echo(f"kept {s.name} ({_size(s.bytes)}; {s.reason}): {why}")
    click.echo(f"{verb} {len(report.removed)} sidecars, {_size(sum(s.bytes for s in report.removed))}"
               + (f"; kept {len(report.kept)} obsolete sidecars quantkit did not make" if report.kept else ""))


@swapset.command()
@click.argument("model_dir", type=_DIR)
@click.argument("name")
@click.argument("baseline", type=_FILE)
@click.argument("with_sidecar", type=_FILE)
@click.option("--resamples", type=click.IntRange(min=10_000), default=10_000, show_default=True,
              help="bootstrap resamples")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="bootstrap seed")
def record(model_dir, name, baseline, with_sidecar, resamples, seed):
    """Compare BASELINE.tsv with WITH_SIDECAR.tsv (scored with `quantkit score --sidecar NAME`) and store the
    result as sidecar NAME's quality block.

    Exit codes as `quantkit compare`'s: 0 no regression, 1 a blocker rule fired (recorded as a regression)."""
    from ..swapset import record_comparison

    comparison = record_comparison(model_dir, name, baseline, with_sidecar, resamples=resamples, seed=seed)
    click.echo("\n".join(comparison.report_lines()))
    failed = comparison.failed
    # the gate's verdict, as recorded; the NLL-only verdict beside it, as compare prints it
    click.echo(f"recorded in {name}.json: verdict={comparison.gate_verdict}"
               + (f" (failed: {', '.join(failed)})" if failed else "") + f"; nll verdict={comparison.verdict}")
    if failed:
        sys.exit(EXIT_CHECK_FAILED)


COMMANDS = [swapset]
