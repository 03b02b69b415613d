"""``quantkit fixture capture|import|check``, ``quantkit score``, ``quantkit compare``: thin wrappers over
:mod:`quantkit.fixtures` and :mod:`quantkit.scoring` (formats and rules are documented there)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..extras import require_runtime
from . import one_output
from .executors import check_executor, executor_options
from ..io import jsontext

DEVICES = ("cpu", "cuda")
#: ``--arithmetic`` of the commands that run a model for parity with an engine (score, parity).
ARITHMETIC_OPTION = click.option(
    "--arithmetic", type=click.Choice(["float32", "ggml-cpu"]), default="float32", show_default=True,
    help="ggml-cpu: round each product's activations as llama.cpp's CPU backend does (Q8_K/Q8_0/F16 by weight "
         "type; MLA absorbed), for per-token parity with llama-perplexity -ctk f32 -ctv f32 -fa off")


def _template_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = jsontext.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--chat-template-kwargs") from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--chat-template-kwargs")
    return value


def _rendering(mode: str, kwargs: str | None):
    from ..fixtures.tokens import Rendering

    return Rendering(mode, _template_kwargs(kwargs))


_rendering_options = [
    click.option("--rendering", type=click.Choice(["chat", "raw"]), default="chat", show_default=True,
                 help="chat: the tokenizer's chat template around one user message; raw: the prompt text as is"),
    click.option("--chat-template-kwargs",
                 help='JSON object passed to the chat template, e.g. {"enable_thinking": false}'),
]


def _with(options):
    def apply(func):
        for option in reversed(options):
            func = option(func)
        return func
    return apply


#: ``quantkit generate`` and ``fixture capture --sample``.
sampling_options = [
    click.option("--temperature", type=float, default=0.6, show_default=True,
                 help="softmax temperature; 0 or below is greedy (the first maximum)"),
    click.option("--top-k", type=click.IntRange(min=0), default=20, show_default=True, help="0 is off"),
    click.option("--top-p", type=float, default=0.95, show_default=True,
                 help="nucleus mass from the full softmax, the crossing token kept; 0 or >= 1 is off"),
    click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True),
    click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True),
    click.option("--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True, help="ds4 law only"),
    click.option("--seed", type=click.IntRange(min=0, max=2 ** 64 - 1), default=0, show_default=True,
                 help="the request's stream: PCG64 (numpy.random.default_rng(seed)); the ds4 law: its generator state"),
    click.option("--law", type=click.Choice(["classic", "ds4", "top-k-renormalized"]), default="classic",
                 show_default=True, help="classic (quantkit.sampling); ds4 (DeepSeek/GLM engines, ds4's generator); "
                 "top-k-renormalized (the faulty law, for demonstrations)"),
]


def sampling_params(temperature, top_k, top_p, presence_penalty, frequency_penalty, min_p):
    from ..sampling import SamplingParams

    return SamplingParams(temperature, top_k, top_p, presence_penalty, frequency_penalty, min_p)


@click.group("fixture")
def fixture():
    """Capture, import and check ds4-style scoring fixtures."""


@fixture.command("capture")
@click.argument("source")
@click.option("--prompts", required=True, type=click.Path(exists=True, path_type=Path),
              help="prompts: a .jsonl file, a text file (one prompt per line) or a directory of *.txt")
@click.option("--tokens", type=click.IntRange(min=1), default=24, show_default=True,
              help="greedy continuation length per prompt (cut where the text does not round-trip)")
@click.option("--top-logprobs", type=click.IntRange(1, 64), default=20, show_default=True,
              help="alternatives recorded per continuation token")
@click.option("--label", required=True, help="the checkpoint label the fixture belongs to (e.g. 0731)")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="fixture directory")
@_with(_rendering_options)
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--tokenizer", type=click.Path(exists=True), help="tokenizer directory (default: the source's)")
@click.option("--force", is_flag=True, help="replace an existing output directory")
@click.option("--sample", is_flag=True, help="sample the continuations by --law with the settings below (each case "
              "its own request stream of --seed) instead of greedy")
@_with(sampling_options)
def capture(source, prompts, tokens, top_logprobs, label, out, rendering, chat_template_kwargs, device, tokenizer,
            force, sample, temperature, top_k, top_p, presence_penalty, frequency_penalty, min_p, seed, law):
    """Capture a fixture from SOURCE (safetensors checkpoint or GGUF): greedy (or --sample) continuations (the
    runtime with a KV cache) and top logprobs."""
    require_runtime("quantkit fixture capture")
    sampling = (sampling_params(temperature, top_k, top_p, presence_penalty, frequency_penalty, min_p), seed, law) \
        if sample else None
    from ..fixtures.capture import capture_fixture, read_prompts
    from ..fixtures.directory import check_label
    from ..io.atomic import check_output_dir
    from ..scoring.loading import describe_model, load_source

    # before the model runs (write_fixture checks again at its end)
    check_output_dir(out, inputs=[source, prompts, tokenizer], overwrite=force, what="fixture directory")
    prompt_list = read_prompts(prompts)
    codec, identity = describe_model(source, tokenizer=tokenizer)
    check_label(identity, label)
    model = load_source(identity, device=device)
    try:
        result = capture_fixture(model, codec, prompt_list, out, label=label, tokens=tokens, top_logprobs=top_logprobs,
                                 rendering=_rendering(rendering, chat_template_kwargs), overwrite=force,
                                 progress=lambda case: click.echo(f"{case.id} target={len(case.response)}", err=True),
                                 sampling=sampling)
    finally:
        model.close()
    total = sum(len(c.response) for c in result.cases)
    click.echo(f"fixture {result.path}: {len(result.cases)} cases, {total} target tokens "
               f"({tokens * len(result.cases) - total} cut by the text round trip), label {label}, "
               f"content {result.content_sha256[:16]}")


@fixture.command("import")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="fixture directory")
@click.option("--label", required=True, help="the checkpoint label the fixture belongs to (e.g. 0731)")
@click.option("--source", "source_model",
              help="the checkpoint (or GGUF) the fixture was captured from, to record its identity")
@_with(_rendering_options)
@click.option("--tokenizer", type=click.Path(exists=True), help="tokenizer directory (default: the source's)")
@click.option("--force", is_flag=True, help="replace an existing output directory")
def import_(src, out, label, source_model, rendering, chat_template_kwargs, tokenizer, force):
    """Check a ds4-style fixture directory SRC and write it with a quantkit identity record."""
    from ..fixtures.directory import import_fixture
    from ..io.atomic import check_output_dir
    from ..scoring.loading import describe_model
    from ..scoring.source import ModelIdentity

    check_output_dir(out, inputs=[src, source_model, tokenizer], overwrite=force, what="fixture directory")
    identity = ModelIdentity()
    if source_model is not None:
        require_runtime("quantkit fixture import --source")
        identity = describe_model(source_model, tokenizer=tokenizer)[1]
    result = import_fixture(src, out, label=label, source=identity,
                            rendering=_rendering(rendering, chat_template_kwargs), overwrite=force)
    click.echo(f"fixture {result.path}: {len(result.cases)} cases imported, label {label}, "
               f"content {result.content_sha256[:16]}")


@fixture.command("import-vectors")
@click.argument("vec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="fixture directory")
@click.option("--label", required=True, help="the checkpoint label the fixture belongs to (e.g. 0731)")
@click.option("--source", "source_model", help="the checkpoint (or GGUF) the vectors belong to, to record its "
              "identity")
@_with(_rendering_options)
@click.option("--tokenizer", type=click.Path(exists=True), help="tokenizer directory (default: the source's)")
@click.option("--force", is_flag=True, help="replace an existing output directory")
def import_vectors(vec, out, label, source_model, rendering, chat_template_kwargs, tokenizer, force):
    """Write ds4's logprob test vectors VEC (tests/test-vectors/official.vec; prompts found above it) as a fixture.

    ds4 renders them with its chat template, empty system prompt, thinking disabled: pass the matching
    --chat-template-kwargs."""
    from ..fixtures.directory import write_fixture
    from ..fixtures.ds4_vectors import read_vectors
    from ..io.atomic import check_output_dir
    from ..scoring.source import ModelIdentity

    check_output_dir(out, inputs=[vec, source_model, tokenizer], overwrite=force, what="fixture directory")
    cases = read_vectors(vec)
    identity = ModelIdentity()
    if source_model is not None:
        require_runtime("quantkit fixture import-vectors --source")
        from ..scoring.loading import describe_model

        identity = describe_model(source_model, tokenizer=tokenizer)[1]
    result = write_fixture(out, cases, label=label, source=identity,
                           rendering=_rendering(rendering, chat_template_kwargs), capture=None, overwrite=force)
    click.echo(f"fixture {result.path}: {len(result.cases)} cases imported from {vec.name}, "
               f"{sum(len(c.response) for c in result.cases)} reference tokens, label {label}, "
               f"content {result.content_sha256[:16]}")


@fixture.command("check")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
def check(path):
    """Read fixture PATH with every check scoring applies to it, and describe it."""
    from ..fixtures.directory import read_fixture

    result = read_fixture(path)
    with_api = sum(c.response is not None for c in result.cases)
    positions = sum(len(c.response) for c in result.cases if c.response is not None)
    identity = result.identity
    click.echo(f"fixture {result.path}: {len(result.cases)} cases ({with_api} with responses, {positions} "
               f"reference tokens), content {result.content_sha256[:16]}")
    click.echo(f"label {result.label!r}, source {identity.source!r}, rendering {result.rendering.mode}"
               + ("" if result.info is not None else " (no fixture.json: identity unknown)"))


@click.command("score")
@click.argument("model")
@click.argument("fixture_dir", metavar="FIXTURE", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out_arg", metavar="[OUT]", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path),
              help="the score table to write (OUT.tsv; as a third argument too)")
@click.option("--ctx", required=True, type=click.IntRange(min=2), help="context limit: prompt + continuation tokens "
              "per case; also the chunk length of --save-logits")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--allow-cross-checkpoint", is_flag=True,
              help="score even when the fixture belongs to another checkpoint (reported in the table)")
@click.option("--kld-base", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="llama-perplexity logits file of the base model: add its KLD statistics")
@click.option("--save-logits", type=click.Path(dir_okay=False, path_type=Path),
              help="write this model's logits over the fixture tokens in llama-perplexity's format")
@click.option("--tokenizer", type=click.Path(exists=True), help="tokenizer directory (default: the model's)")
@click.option("--sidecar", "sidecars", multiple=True,
              help="apply this sidecar beside the checkpoint directory MODEL (repeatable; recorded in the table)")
@click.option("--label", help="checkpoint label of a MODEL that carries none (no quantkit provenance, no -NNNN "
              "ending its file name); must agree with one it carries")
@click.option("--format", "table_format", type=click.Choice(["quantkit", "ds4", "ds4-nll"]), default="quantkit",
              show_default=True, help="ds4: score_official's 26-column table (ds4-nll: its 7 NLL columns) with the "
              "identity record in OUT.tsv.json")
@ARITHMETIC_OPTION
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="compute dtype: bfloat16 is a fast GPU mode (decoded weights rounded to bf16), outside float32's "
                   "tolerance; recorded in the table's evidence")
@click.option("-b", "--batch", type=click.IntRange(min=1), default=2048, show_default=True,
              help="tokens per forward pass: cases run shortest first, as many together as fit once padded to the "
                   "longest (1: each alone; --arithmetic ggml-cpu always runs each alone)")
@click.option("--support", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a support (drafter) GGUF meant for MODEL: refused unless it comes from MODEL's checkpoint "
                   "(recorded in the table)")
@click.option("--force", is_flag=True, help="replace an existing table (and --save-logits file)")
@executor_options
def score(model, fixture_dir, out_arg, out, ctx, device, allow_cross_checkpoint, kld_base, save_logits, tokenizer,
          sidecars, label, table_format, arithmetic, dtype, batch, support, force, executor, address, jobs):
    """Score MODEL (GGUF or checkpoint) on FIXTURE; write the per-case table -o OUT.tsv."""
    out = one_output(out, out_arg)
    require_runtime("quantkit score")
    check_executor("quantkit score", executor, address)
    if dtype != "float32" and arithmetic != "float32":
        raise click.UsageError(f"--arithmetic {arithmetic} computes in float32: not with --dtype {dtype}")
    if executor == "ray" and (kld_base is not None or save_logits is not None):
        raise click.UsageError("--kld-base and --save-logits evaluate one token stream in order: not with "
                               "--executor ray")
    from ..fixtures.directory import read_fixture
    from ..io.atomic import check_output, input_files
    from ..scoring.loading import describe_model, load_source, open_sidecars
    from ..scoring.score import plan_scoring, run_scoring
    from ..scoring.source import with_label
    from ..scoring.table import sidecar_path

    # before the long work: the outputs are writable and are none of the inputs (or each other)
    inputs = input_files([model, fixture_dir, kld_base, tokenizer])
    check_output(out, inputs=inputs, overwrite=force, what="score table")
    if table_format != "quantkit":
        check_output(sidecar_path(out), inputs=inputs, overwrite=force, what="score table's identity record")
    if save_logits is not None:
        check_output(save_logits, inputs=[*inputs, out], overwrite=force, what="--save-logits file")
    if kld_base is not None and not os.access(kld_base, os.R_OK):
        raise click.BadParameter(f"{kld_base}: not readable", param_hint="--kld-base")
    from ..validate.support import require_pair

    paired = require_pair(model, support)
    replace, applied = None, []
    if paired is not None:
        applied.append(paired)
    if sidecars:
        from ..swapset import sidecars_line

        replace = open_sidecars(model, sidecars)
        applied = [sidecars_line(model, sidecars)]
    fx = read_fixture(fixture_dir)
    codec, identity = describe_model(model, tokenizer=tokenizer)
    identity = with_label(identity, label)
    plan = plan_scoring(fx, codec, identity, ctx=ctx, allow_cross_checkpoint=allow_cross_checkpoint,
                        kld_base=kld_base, save_logits=save_logits is not None)

    def progress(s):
        click.echo(f"{s.id} prompt={s.prompt_tokens} target={s.target_tokens} avg_nll={s.avg_nll:.6f} "
                   f"lcp={s.greedy_lcp}", err=True)

    if executor == "ray":
        from ..scoring.rayscore import score_on_ray

        scores, width, loaded = score_on_ray(identity, plan.cases, device=device, sidecars=sidecars,
                                             arithmetic=arithmetic, dtype=dtype, address=address, workers=jobs,
                                             progress=progress, batch_tokens=batch)
        result = run_scoring(loaded, codec, plan, scored=(scores, width), batch_tokens=batch)
    else:
        source = load_source(identity, device=device, replace=replace, arithmetic=arithmetic, dtype=dtype)
        try:
            result = run_scoring(source, codec, plan, kld_base=kld_base, save_logits_to=save_logits,
                                 progress=progress, batch_tokens=batch)
        finally:
            source.close()
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    result.notes += applied
    result.write(out, layout=table_format)
    for line in result.trailer:
        click.echo(line)
    if result.kld is not None:
        click.echo("\n".join(result.kld.report_lines()))
    written = [str(out)] + ([str(sidecar_path(out))] if table_format != "quantkit" else []) \
        + ([str(save_logits)] if save_logits else [])
    click.echo("wrote " + " and ".join(written))


@click.command("compare")
@click.argument("old", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("new", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--resamples", type=click.IntRange(min=10_000), default=10_000, show_default=True,
              help="bootstrap resamples")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="bootstrap seed")
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path),
              help="the gate's thresholds (TOML; default: the shipped quantkit/scoring/policy.toml)")
@click.option("--baseline", help="recorded release figures to place NEW in: a shipped name "
              "(deepseek-v4.1-flash-general-100, glm-5.3-flash) or a .toml/.json file")
@click.option("--json", "as_json", is_flag=True, help="print the comparison as JSON")
def compare(old, new, resamples, seed, policy_path, baseline, as_json):
    """Compare score tables OLD.tsv and NEW.tsv of one fixture: deltas, case wins, paired bootstrap intervals, and
    the release gate's rules (NLL, first-token, greedy prefix, API top-1, pair order, top-token agreement).

    Exit codes: 0 no regression, 1 a blocker rule fired, 2 unusable input (tables, policy or baseline).
    Either table may be a quantkit table or a ds4 score_official table (with or without quantkit's OUT.tsv.json)."""
    from . import EXIT_CHECK_FAILED, EXIT_OK

    regression = run_compare(old, new, resamples=resamples, seed=seed, policy_path=policy_path, baseline=baseline,
                             as_json=as_json)
    sys.exit(EXIT_CHECK_FAILED if regression else EXIT_OK)


def run_compare(old, new, *, resamples: int = 10_000, seed: int = 0, policy_path=None, baseline=None,
                as_json: bool = False) -> bool:
    """Print the comparison of OLD and NEW; return whether the gate found a regression (a blocker rule fired)."""
    from ..scoring.compare import compare_tables
    from ..scoring.policy import load_baseline, load_policy
    from ..scoring.table import read_table

    policy = load_policy(policy_path)
    recorded = load_baseline(baseline) if baseline is not None else None
    result = compare_tables(read_table(old), read_table(new), resamples=resamples, seed=seed, policy=policy,
                            baseline=recorded)
    click.echo(jsontext.dumps(result.to_json(), indent=1) if as_json else "\n".join(result.report_lines()))
    return bool(result.failed)


COMMANDS = [fixture, score, compare]
