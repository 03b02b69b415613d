"""Greedy and sampled generation through the runtime, with transformers' KV cache.

:func:`greedy` and :func:`sample` continue one prompt (both through :func:`continuation`, which takes the rule that
chooses each token from its logits row):

1. prefill: one forward pass over the prompt with ``use_cache=True``; the model's own forward builds its cache
   (transformers' ``DynamicCache`` from the model config: attention keys/values, linear-attention conv and
   recurrent states, DeepSeek V4 compressor and indexer states, Qwen4 n-gram context, ...);
2. per step: the next token is chosen from the last logits row -- greedy: its first maximum (``numpy.argmax``, the
   scorer's greedy); sampled: the classic law of :mod:`quantkit.sampling`, every token drawn from the request's one
   PCG64 stream (``seed``), so a stream depends only on the logits rows and the seed; generation ends before a token ``stop`` refuses, or after ``max_new_tokens`` tokens; otherwise only the new
   token is run, with ``past_key_values`` (the last chosen token is never run).

So a continuation of ``n`` tokens costs one pass over the prompt plus ``n - 1`` one-token passes, where the
uncached path (``use_cache=False``: :func:`.loader.logits` over the whole sequence per token, the reference) costs
``n`` passes over ever longer sequences (every pass still decodes every packed weight, which bounds the gain on
small models: ``bench/fixture_capture.py``).  Both compute the same function in the model's compute dtype and
differ only by summation order: the tests run both on the tiny model of each of the five architectures
(deepseek_v4, glm5_next, qwen4_exp, qwen3_moe, deepseek_v3) with sequences long enough to engage every sparse or
compressed attention path (sliding window, compressors, indexers, past 128 tokens) and require identical tokens
and logits within ``1e-4 x max |logit|``; the largest difference measured is 1.1e-6 with max |logit| 1.3
(``bench/fixture_capture.py archs``).  No architecture needs the uncached path.  A sampled 64-token stream with
seed 0 is identical cached and uncached, with weights decoded per use and kept decoded, on every tiny architecture
(``tests/test_generate.py``, which also runs CUDA resident and streamed, cached and uncached, against the CPU
stream where a CUDA device is present).

Checks, as :func:`.loader.logits`: prompt ids outside the vocabulary raise :class:`~quantkit.errors.FixtureError`;
weights that decode to NaN/inf raise naming the GGUF tensor; non-finite logits raise
:class:`~quantkit.errors.ValidationError` naming the position and the first module whose output was not finite
(found by re-running the sequence so far uncached; if that pass is finite, the error says the cached pass alone
was not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import FixtureError, ValidationError
from ..sampling import Sampler, SamplingParams
from .loader import RuntimeModel, check_token_ids, logits


@dataclass(frozen=True)
class Generation:
    """A continuation and the logits rows it was chosen from."""

    tokens: list[int]
    logits: np.ndarray | None
    """float32 ``[steps, vocab]``: row ``i`` chose ``tokens[i]``; when ``stop`` ended the generation, the last row is
    the one whose maximum ``stop`` refused (so ``steps`` is ``len(tokens)`` or ``len(tokens) + 1``); None unless
    kept (``keep_logits``)."""


def greedy(model: RuntimeModel, prompt_ids: Sequence[int], max_new_tokens: int, *,
           stop: Callable[[int], bool] | None = None, use_cache: bool = True, keep_logits: bool = True) -> Generation:
    """Continue ``prompt_ids`` greedily for up to ``max_new_tokens`` tokens, ending before the first token ``stop``
    returns true for (module doc)."""
    return continuation(model, prompt_ids, max_new_tokens, lambda row: int(np.argmax(row)), stop=stop,
                        use_cache=use_cache, keep_logits=keep_logits)


def sample(model: RuntimeModel, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams, seed: int,
           *, law: str = "classic", stop: Callable[[int], bool] | None = None, use_cache: bool = True) -> Generation:
    """As :func:`greedy`, each token drawn by ``law`` (:mod:`quantkit.sampling`) from the PCG64 stream of ``seed``."""
    return continuation(model, prompt_ids, max_new_tokens, Sampler(params, seed, law).next, stop=stop,
                        use_cache=use_cache)


def continuation(model: RuntimeModel, prompt_ids: Sequence[int], max_new_tokens: int,
                 choose: Callable[[np.ndarray], int], *, stop: Callable[[int], bool] | None = None,
                 use_cache: bool = True, keep_logits: bool = True) -> Generation:
    """Continue ``prompt_ids`` with ``choose(logits row) -> token`` (module doc).  ``keep_logits=False`` keeps no
    rows (a vocabulary's float32 row a token adds up over a long generation)."""
    if max_new_tokens < 1:
        raise FixtureError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if use_cache:
        step = _cached_steps(model, [int(i) for i in check_token_ids(model, prompt_ids)])
    else:
        step = _uncached_steps(model, prompt_ids)
    tokens: list[int] = []
    rows = []
    row = next(step)
    while True:
        if keep_logits:
            rows.append(row)
        token = choose(row)
        if stop is not None and stop(token):
            break
        tokens.append(token)
        if len(tokens) == max_new_tokens:
            break
        row = step.send(token)
    step.close()
    return Generation(tokens, np.stack(rows) if keep_logits else None)


def _uncached_steps(model: RuntimeModel, prompt_ids: Sequence[int]):
    """Yields the last logits row of the sequence so far; is sent the next token."""
    ids = list(prompt_ids)
    while True:
        token = yield logits(model, np.asarray(ids))[-1]
        ids.append(token)


def _cached_steps(model: RuntimeModel, prompt_ids: list[int]):
    """As :func:`_uncached_steps`, running only the new tokens against the model's cache."""
    ids, new = list(prompt_ids), list(prompt_ids)
    past = None
    while True:
        input_ids = torch.as_tensor(new, dtype=torch.int64, device=model.device)[None]
        # no_grad, not inference_mode: see loader.logits
        with torch.no_grad(), model.forward_mode():
            out = model.module(input_ids=input_ids, past_key_values=past, use_cache=True)
        model.store.check()
        past = out.past_key_values
        rows = out.logits[0].float().cpu().numpy()
        if not np.isfinite(rows).all():
            _raise_non_finite(model, ids, len(ids) - len(new) + int(np.argwhere(~np.isfinite(rows))[0][0]))
        token = yield rows[-1]
        ids.append(token)
        new = [token]


def _raise_non_finite(model: RuntimeModel, ids: list[int], position: int) -> None:
    logits(model, np.asarray(ids[:position + 1]))       # raises naming the first non-finite module
    raise ValidationError(f"non-finite logits at position {position} of the cached pass, where the uncached pass "
                          "over the same tokens is finite", path=model.path)
