"""Long sequences (issue 16): a 16384-token case scored in one pass equals the chunked reference.

The chunked reference runs the same sequence in 2048-token chunks through transformers' KV cache (each chunk's
queries against the cached keys, with a mask), the one-pass run is :func:`quantkit.runtime.logits` (causal SDPA,
no mask).  The CUDA variant (tests/test_runtime_gpu.py) also multiplies packed weights in the one pass and
decodes them in the reference, and bounds the pass's device memory."""
from __future__ import annotations

import numpy as np
import torch

from test_runtime import ggufs  # noqa: F401  (the GGUF fixture of the CPU tests)

LONG_TOKENS = 16384
CHUNK = 2048
#: Mean NLL: issue 16's bound (relative); each token's NLL: absolute.
MEAN_NLL_RELATIVE = 1e-3
TOKEN_NLL_ABSOLUTE = 1e-3


def chunked_logits(model, ids: np.ndarray, chunk: int = CHUNK) -> torch.Tensor:
    """float64 logits of ``ids`` computed ``chunk`` tokens at a time through the model's KV cache."""
    rows, cache = [], None
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = torch.as_tensor(ids[start:start + chunk], device=model.device)[None]
            out = model.module(input_ids=piece, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0].double())
    return torch.cat(rows)


def token_nll(logits: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    """Each next token's negative log-likelihood (float64) from ``logits [n, vocab]``."""
    target = torch.as_tensor(ids[1:], device=logits.device)
    x = logits[:-1].double()
    return torch.logsumexp(x, dim=-1) - x.gather(1, target[:, None])[:, 0]


def assert_same_nll(got: torch.Tensor, want: torch.Tensor) -> None:
    mean_got, mean_want = float(got.mean()), float(want.mean())
    assert abs(mean_got - mean_want) <= MEAN_NLL_RELATIVE * abs(mean_want), (mean_got, mean_want)
    assert float((got - want).abs().max()) <= TOKEN_NLL_ABSOLUTE


def test_16k_token_nll_equals_the_chunked_reference(ggufs):
    from quantkit.runtime import load_model, logits

    model = load_model(ggufs("qwen3_moe", "mixed"))
    ids = np.random.default_rng(16).integers(0, model.vocab_size, LONG_TOKENS)
    full = torch.from_numpy(logits(model, ids.tolist()))
    ref = chunked_logits(model, ids)
    got, want = token_nll(full, ids), token_nll(ref, ids)
    print("16K NLL", float(got.mean()), float(want.mean()), "max token diff", float((got - want).abs().max()))
    assert_same_nll(got, want)
