"""``quantkit validate``: audit a GGUF artifact (or a swapset sidecar) against its format, plan and source.

Exit codes: 0 valid; 1 a check failed (the report says which); 2 the artifact, source, recipe or imatrix cannot be
read.  With ``--report FILE`` the report is written there as JSON, also when the input cannot be read (then with
``exit_code`` 2 and the error); ``--json`` prints the same JSON instead of the summary.  The work is
:mod:`quantkit.validate`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..io import jsontext
from . import EXIT_BAD_INPUT

PAYLOAD_CHOICES = ("none", "sample", "full")


def _write_json(path: Path, data: dict, overwrite: bool) -> None:
    from ..io.atomic import atomic_output

    with atomic_output(path, overwrite=overwrite) as tmp:
        tmp.write_text(jsontext.dumps(data, indent=1, default=str) + "\n")


@click.command("validate")
@click.argument("artifact", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--source", help="source checkpoint directory or Hugging Face repo id (default: the repository the "
                               "artifact records, from the local cache)")
@click.option("--recipe", help="recipe file or shipped recipe name (default: the recipe text the artifact records)")
@click.option("--imatrix", type=click.Path(exists=True, dir_okay=False),
              help="importance matrix the artifact was made with (default: the recorded file, if it still matches)")
@click.option("--payload", type=click.Choice(PAYLOAD_CHOICES), default="sample", show_default=True,
              help="re-encode and compare no tensor, a sample (experts 0/middle/last, sampled table rows), or all")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="seed of the sampled experts and rows")
@click.option("--structure-only", is_flag=True, help="check the file alone: no source, no re-plan, no payload")
@click.option("--report", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="write the full report (every check, every tensor) as JSON to this file (as convert --report)")
@click.option("--json", "as_json", is_flag=True, help="print the full report as JSON instead of the summary")
@click.option("--force", is_flag=True, help="replace an existing --report file")
@click.option("--target", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="ARTIFACT is a support (drafter) file: refuse it unless TARGET comes from the same checkpoint")
def validate(artifact, source, recipe, imatrix, payload, seed, structure_only, json_path, as_json, force, target):
    """Validate ARTIFACT: structure, inventory against a re-plan, and payload bytes against the source.

    A GGUF quantkit did not write (llama.cpp's converter and llama-quantize, ...) is validated against --source with
    the plan read off the file (each tensor's stored type); the verdict counts the tensors proven and those that
    could not be, with the reason. Without --source only its structure is checked. A transport manifest
    (<file>.transport.json) is proven part by part and as a whole without assembling; a split shard
    (<stem>-00001-of-00003.gguf) checks its set: every shard present, split keys and tensor index consistent."""
    from ..errors import QuantkitError
    from ..io.atomic import check_output, input_files
    from ..validate import validate as run

    if json_path is not None:   # before the long work: never an input, never an existing file unless --force
        check_output(json_path, inputs=input_files([artifact, source, recipe, imatrix]), overwrite=force,
                     what="--report file")
    try:
        report = run(artifact, source=source, recipe=recipe, imatrix=imatrix, payload=payload, seed=seed,
                     structure_only=structure_only, target=target)
    except (QuantkitError, OSError) as exc:
        if json_path is not None or as_json:
            from ..evidence import evidence

            record = {"format": "quantkit-validation", "artifact": str(artifact), "ok": False,
                      "exit_code": EXIT_BAD_INPUT, "error": " ".join(str(exc).split()), "evidence": evidence()}
            if json_path is not None:
                _write_json(json_path, record, force)
            if as_json:
                click.echo(jsontext.dumps(record, indent=1, default=str))
        raise
    if json_path is not None:
        _write_json(json_path, report.to_json(), force)
    click.echo(jsontext.dumps(report.to_json(), indent=1, default=str) if as_json else report.render())
    if not report.ok:
        sys.exit(report.exit_code)


COMMANDS = [validate]
