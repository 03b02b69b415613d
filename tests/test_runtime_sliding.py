"""DeepSeek V4's attention as a band (quantkit.runtime.sliding) against transformers' eager attention: the same
attention from the sliding window's keys, the compressed entries and the sinks alone."""
from __future__ import annotations

import copy
import sys

import pytest
import torch

from quantkit.runtime import sliding
from quantkit.runtime.attention import one_sequence_per_row
from quantkit.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def v4():
    model, _ = build_tiny_model("deepseek_v4", dtype="f32")
    return model


def _eager(attention):
    """transformers' eager attention function of ``attention``'s module (outside a scoring pass, wrapped or not,
    transformers' own computation)."""
    return sys.modules[type(attention).__module__].eager_attention_forward


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("n", [7, 32, 45, 130])
@pytest.mark.parametrize("compressed", [0, 3, 20])
def test_band_equals_the_full_eager_attention(v4, n, compressed, device):
    """Random queries and keys, the sliding causal mask over the raw keys (two rows, the second right-padded)
    and a random block bias over the compressed entries: within float32 rounding of the eager result (on CUDA the
    one-launch kernel, quantkit.kernels.triton_sink_attention, its products in bf16x3)."""
    attention = next(m for m in v4.modules() if type(m).__name__ in sliding.ATTENTIONS)
    gen = torch.Generator().manual_seed(n * 100 + compressed)
    heads, dim, width = attention.num_heads, attention.head_dim, attention.sliding_window
    query = torch.randn(2, heads, n, dim, generator=gen) * 0.3        # scores of a few units: a spread softmax
    key = torch.randn(2, 1, n + compressed, dim, generator=gen)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = ((k <= q) & (k > q - width)).expand(2, 1, n, n).clone()
    visible[1, :, :, n - n // 3:] = False            # the padded tail of a shorter case
    bias = torch.rand(2, 1, n, compressed, generator=gen) < 0.5
    allowed = torch.cat([visible, bias], dim=-1)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        want, _ = _eager(attention)(attention, query, key, key, mask, attention.scaling)
        got = sliding.banded_sink_attention(attention, query.to(device), key.to(device), mask.to(device),
                                            attention.scaling).cpu()
    rows = allowed.any(-1)[:, 0]                      # rows with nothing visible are padding in the runtime
    assert got.shape == want.shape
    if device == "cpu":
        assert torch.allclose(got[rows], want[rows], rtol=1e-5, atol=1e-6)
    else:   # bf16x3 products, each within 2^-16 of sum |x y|: the scores' error moves each weight by up to twice it
        score_error = attention.scaling * float((query.abs() @ key.abs().transpose(-1, -2)).max())
        bound = 2.0 ** -16 * (2 * score_error + 1) * float(key.abs().max())
        assert float((got[rows] - want[rows]).abs().max()) <= bound


@pytest.mark.parametrize("n", [20, 77, 200])
def test_v4_logits_equal_with_the_band(v4, n, monkeypatch):
    """The tiny DeepSeek V4 model (sliding, compressed sparse and heavily compressed layers) gives the same
    logits in a scoring pass (the band) as transformers' eager pass, and the band ran in every layer."""
    model = copy.deepcopy(v4)
    calls = []
    band = sliding.banded_sink_attention
    monkeypatch.setattr(sliding, "banded_sink_attention", lambda *a: calls.append(1) or band(*a))
    ids = torch.randint(3, model.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        sliding.install(model)
        with one_sequence_per_row():
            got = model(input_ids=ids).logits
    assert len(calls) == model.config.num_hidden_layers
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
