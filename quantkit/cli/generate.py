"""``quantkit generate``: continue a prompt through the runtime, greedy or sampled by the classic law
(:mod:`quantkit.sampling`, :mod:`quantkit.runtime.generate`)."""
from __future__ import annotations

import json

import click

from ..extras import require_runtime
from .score import DEVICES, _rendering, _rendering_options, _with, sampling_options, sampling_params

@click.command("generate")
@click.argument("model")
@click.option("--prompt", required=True, help="the prompt text")
@click.option("-n", "max_new_tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="tokens to generate (fewer when a non-text token such as EOS comes first)")
@_with(sampling_options)
@_with(_rendering_options)
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--stream-weights", is_flag=True, help="CUDA: keep payloads in host memory, copied per use")
@click.option("--no-cache", is_flag=True, help="run the whole sequence per token instead of the KV cache")
@click.option("--tokenizer", type=click.Path(exists=True), help="tokenizer directory (default: the model's)")
@click.option("--json", "as_json", is_flag=True, help="print the token ids, text and settings as JSON")
def generate(model, prompt, max_new_tokens, temperature, top_k, top_p, presence_penalty, frequency_penalty, min_p,
             seed, law, rendering, chat_template_kwargs, device, stream_weights, no_cache, tokenizer, as_json):
    """Continue PROMPT with MODEL (GGUF or checkpoint) and print the continuation on stdout."""
    require_runtime("quantkit generate")
    from ..fixtures.tokens import TextCodec
    from ..runtime import load_model, sample
    from ..sampling import Sampler
    from ..scoring.loading import load_tokenizer

    params = sampling_params(temperature, top_k, top_p, presence_penalty, frequency_penalty, min_p)
    Sampler(params, seed, law)          # settings the law refuses fail before the model loads
    codec = TextCodec(load_tokenizer(model, tokenizer))
    prompt_ids = codec.render(prompt, _rendering(rendering, chat_template_kwargs))
    if not prompt_ids:
        raise click.BadParameter("renders to no tokens: give some text", param_hint="--prompt")
    runtime = load_model(model, device=device, stream=stream_weights)
    try:
        context = _context_length(runtime.config)
        if context is not None and len(prompt_ids) + max_new_tokens > context:
            raise click.BadParameter(f"the prompt's {len(prompt_ids)} tokens and {max_new_tokens} more pass the "
                                     f"model's context of {context} tokens", param_hint="-n")
        result = sample(runtime, prompt_ids, max_new_tokens, params, seed, law=law,
                        stop=lambda token: not codec.is_text_token(token), use_cache=not no_cache)
    finally:
        runtime.close()
    text = codec.decode(result.tokens)
    if as_json:
        click.echo(json.dumps({"prompt_tokens": len(prompt_ids), "tokens": result.tokens, "text": text,
                               "sampling": {**params.to_json(), "seed": seed, "law": law}}, indent=1))
    else:
        click.echo(text)


def _context_length(config: dict) -> int | None:
    """The context the model was trained for (``max_position_embeddings``, of the text model where nested)."""
    text = config.get("text_config")
    value = (text if isinstance(text, dict) else config).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


COMMANDS = [generate]
