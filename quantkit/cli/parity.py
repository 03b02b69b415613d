"""``quantkit parity``: an engine's logits, sampled streams and hidden states against quantkit's reference
(:mod:`quantkit.scoring.parity`)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..io import jsontext
from ..extras import require_runtime
from . import EXIT_CHECK_FAILED
from .score import ARITHMETIC_OPTION, DEVICES, _rendering, _rendering_options, _with

_file = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("parity")
@click.argument("model")
@click.option("--logits", "logits_dump", type=_file,
              help="the engine's logits: a llama-perplexity --kl-divergence-base file, ds4 --dump-logprobs JSON, "
                   "or .npy [positions, vocab]")
@click.option("--stream", "streams", type=_file, multiple=True,
              help="a sampled stream: JSON {tokens, seed, temperature, top_k, top_p, ..., law} (repeatable)")
@click.option("--hidden", type=_file, help="the engine's per-layer hidden states: .npy [layers, positions, ...] "
              "or .npz (one array per layer)")
@click.option("--prompt", help="the prompt the engine ran (rendered with --rendering)")
@click.option("--tokens", "tokens_file", type=_file, help="the token ids the engine ran: JSON list or .npy "
              "(instead of --prompt)")
@click.option("--confident", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="a reference top-1 at least this probable must be in the engine's top 8")
@click.option("--min-top1", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="smallest share of positions whose top-1 tokens agree that passes")
@click.option("--max-mean-kld", type=click.FloatRange(min=0), default=0.01, show_default=True,
              help="largest mean KLD (nats) of the engine's distributions from the reference's that passes")
@click.option("--cosine-bar", type=click.FloatRange(-1, 1), default=0.9997, show_default=True,
              help="smallest per-layer cosine of hidden states that passes")
@_with(_rendering_options)
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--tokenizer", type=click.Path(exists=True), help="tokenizer directory (default: the model's)")
@ARITHMETIC_OPTION
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def parity(model, logits_dump, streams, hidden, prompt, tokens_file, confident, min_top1, max_mean_kld, cosine_bar,
           rendering, chat_template_kwargs, device, tokenizer, arithmetic, as_json):
    """Compare an engine's output on MODEL (GGUF or checkpoint) with quantkit's reference: exit 0 when every
    check passes, 1 on a divergence, 2 when an input cannot be used."""
    from ..scoring.parity import (compare_hidden, compare_logits, compare_stream, read_hidden_dump,
                                  read_logits_dump, read_stream, read_token_ids)

    if not (logits_dump or streams or hidden):
        raise click.UsageError("nothing to compare: give --logits, --stream or --hidden")
    if prompt is not None and tokens_file is not None:
        raise click.UsageError("--prompt and --tokens are exclusive")
    # every engine input is read and checked before the model is loaded
    dump = read_logits_dump(logits_dump) if logits_dump else None
    stream_inputs = [read_stream(p) for p in streams]
    hidden_dump = read_hidden_dump(hidden) if hidden else None
    tokens = read_token_ids(tokens_file) if tokens_file else None
    needs_tokens = (dump is not None and dump[0] != "llama") or stream_inputs or hidden_dump is not None
    if needs_tokens and prompt is None and tokens is None:
        raise click.UsageError("--stream, --hidden and .npy or ds4 logits need the engine's input: give --prompt "
                               "or --tokens")
    require_runtime("quantkit parity")
    from ..fixtures.tokens import TextCodec
    from ..runtime import load_model, logits
    from ..runtime.loader import check_token_ids, hidden_states
    from ..scoring.loading import RuntimeSource, load_tokenizer, model_identity
    from ..scoring.score import kld_against

    codec = None
    if prompt is not None or (dump is not None and dump[0] == "llama"):
        codec = TextCodec(load_tokenizer(model, tokenizer))
    if prompt is not None:
        tokens = codec.render(prompt, _rendering(rendering, chat_template_kwargs))
    runtime = load_model(model, device=device, arithmetic=arithmetic)
    report: dict = {"model": str(model), "passed": True}
    lines: list[str] = []
    try:
        if tokens is not None:
            check_token_ids(runtime, tokens)

        def reference(ids):
            return logits(runtime, ids)

        if dump is not None:
            source = RuntimeSource(runtime, model_identity(model, codec)) if dump[0] == "llama" else None
            result = compare_logits(*dump, reference, tokens, runtime.vocab_size, confident=confident,
                                    min_top1=min_top1, max_mean_kld=max_mean_kld,
                                    kld_against=lambda path, each: kld_against(source, codec, path,
                                                                               runtime.vocab_size, each))
            report["logits"] = result.to_json()
            lines += result.report_lines()
        for (stream_tokens, params, seed, law), path in zip(stream_inputs, streams):
            result = compare_stream(stream_tokens, params, seed, reference, tokens, runtime.vocab_size, law)
            report.setdefault("streams", []).append({"file": str(path), **result.to_json()})
            lines += result.report_lines()
        if hidden_dump is not None:
            result = compare_hidden(hidden_dump, hidden_states(runtime, tokens), bar=cosine_bar)
            report["hidden"] = result.to_json()
            lines += result.report_lines()
    finally:
        runtime.close()
    report["passed"] = all(part["passed"] for part in [report.get("logits"), report.get("hidden"),
                                                         *report.get("streams", [])] if part is not None)
    click.echo(jsontext.dumps(report, indent=1) if as_json else "\n".join(lines + [
        "parity: " + ("pass" if report["passed"] else "DIVERGENCE")]))
    if not report["passed"]:
        sys.stdout.flush()
        sys.exit(EXIT_CHECK_FAILED)


COMMANDS = [parity]
