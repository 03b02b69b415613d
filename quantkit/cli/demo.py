"""``quantkit demo``: the main job on the bundled example model, end to end.

convert (with the bundled imatrix) -> validate (payload re-encoded) -> score on the bundled fixture -> compare
with an F16 control.  Each step is the ordinary command, invoked in-process, so the demo prints exactly what a
user sees running them one by one.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import click

DEMO_RECIPE = "tiny-moe-iq2xxs-w2q2k"
CONTROL_RECIPE = "tiny-moe-f16"
SCORE_CTX = 512


def _step(title: str) -> None:
    click.echo(f"\n== {title}")


@click.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="keep the artifacts here (default: a temporary directory, removed at the end)")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=2, show_default=True,
              help="convert worker processes (on a first run each compiles its own share of the encoders)")
@click.option("--force", is_flag=True, help="replace the artifacts of an earlier demo in --workdir")
@click.pass_context
def demo(ctx, workdir, jobs, force):
    """Convert the bundled model (IQ2_XXS/Q2_K recipe with its imatrix), validate, score and compare with F16."""
    from .. import examples
    from ..errors import OutputExistsError
    from ..extras import require_runtime
    from .convert import convert
    from .score import run_compare, score
    from .validate import validate

    require_runtime("quantkit demo")   # its scoring step; checked before the conversions, not after them
    source = str(examples.example_model_dir())
    with tempfile.TemporaryDirectory(prefix="quantkit-demo-") as tmp:
        out = Path(workdir) if workdir else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        candidate, control = out / "tiny-moe-q2.gguf", out / "tiny-moe-f16.gguf"
        earlier = sorted(p.name for p in out.iterdir() if p.name.startswith(("tiny-moe-q2.", "tiny-moe-f16.")))
        if earlier and not force:
            raise OutputExistsError(f"holds {', '.join(earlier)} of an earlier demo; pass --force to replace them",
                                    path=out)
        common = dict(source=source, allow_synthetic_imatrix=False, jobs=jobs, resume=False, force=True,
                      label=examples.FIXTURE_LABEL, pre_tokenizer=examples.PRE_TOKENIZER, report=None,
                      progress=True)

        _step(f"plan and convert {source} with {DEMO_RECIPE} and the bundled imatrix")
        ctx.invoke(convert, out=candidate, recipe=str(examples.example_recipe(DEMO_RECIPE)),
                   imatrix=str(examples.example_imatrix()), bootstrap=False, dry_run=False, **common)
        _step("validate the artifact against its source (every payload re-encoded and compared)")
        ctx.invoke(validate, artifact=candidate, source=source, recipe=None, imatrix=None, payload="full", seed=0,
                   structure_only=False, json_path=None)
        _step(f"F16 control ({CONTROL_RECIPE})")
        ctx.invoke(convert, out=control, recipe=str(examples.example_recipe(CONTROL_RECIPE)), imatrix=None,
                   bootstrap=False, dry_run=False, **common)
        tables = {}
        for name, model in (("F16 control", control), ("Q2 candidate", candidate)):
            _step(f"score the {name} on the bundled fixture")
            tables[name] = out / f"{model.stem}.tsv"
            ctx.invoke(score, model=str(model), fixture_dir=str(examples.example_fixture_dir()),
                       out=str(tables[name]), ctx=SCORE_CTX, device="cpu", allow_cross_checkpoint=False,
                       kld_base=None, save_logits=None, tokenizer=None, force=True)
        _step("compare: F16 control (old) vs Q2 candidate (new)")
        if run_compare(tables["F16 control"], tables["Q2 candidate"]):
            click.echo("(`quantkit compare` exits 1 on this pair: a 2-bit model regresses against its F16 control, "
                       "and in CI that blocks the release)")
        if workdir:
            click.echo(f"\nartifacts kept in {out}")


COMMANDS = [demo]
