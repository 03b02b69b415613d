"""GLM-5.3-Flash's KDA in chunks (quantkit.runtime.kda) against transformers' torch reference,
``chunk_kimi_delta_attention``: outputs and final states within 1e-5 of the largest, with and without an initial
state, lengths off the 64-token chunk, decays strong enough that a product split anywhere but inside the pair
would overflow; and the runtime's scoring passes use it (and Qwen3.8's gated delta rule, tests/test_runtime_gdn.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import transformers.models.glm5_next.modeling_glm5_next as glm5
from quantkit.runtime import gdn, kda

BOUND = 1e-5


def transformers_kda():
    function = glm5.chunk_kimi_delta_attention
    return getattr(function, "theirs", function)


def inputs(batch, n, heads, dim, decay, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, heads, dim, generator=gen) for _ in range(3))
    g = -torch.rand(batch, n, heads, dim, generator=gen) * decay
    return q, k, v, g, torch.rand(batch, n, heads, generator=gen)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("n, decay, initial", [(100, 0.3, False), (64, 0.3, True), (200, 8.0, False),
                                               (130, 8.0, True), (7, 0.3, False)])
def test_chunk_kda_equals_transformers(n, decay, initial, device):
    q, k, v, g, beta = (x.to(device) for x in inputs(2, n, 3, 32, decay, seed=n))
    state = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device) if initial else None
    want, want_state = transformers_kda()(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    got, got_state = kda.chunk_kda(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max()) <= BOUND * float(want.abs().max())
    assert float((got_state - want_state).abs().max()) <= BOUND * float(want_state.abs().max())
    assert kda.chunk_kda(q, k, v, g=g, beta=beta, initial_state=state)[1] is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("dim", [8, 128])
@pytest.mark.parametrize("diagonal", [False, True])
def test_decayed_products_equal_the_pairwise_sum(diagonal, dim, device):
    """Against float64 pair by pair, with steps of decay up to 20 per token (exp(20 x 16) overflows float32: the
    split at the query sub-chunk's first token keeps both factors at most 1).  On CUDA, 128 channels take the
    one-launch kernel (quantkit.kernels.triton_decay), 8 the torch code."""
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randn(2, kda.CHUNK, dim, generator=gen) for _ in range(2))
    g = (-torch.rand(2, kda.CHUNK, dim, generator=gen) * 20).cumsum(1)
    got = kda.decayed_products(a.to(device), b.to(device), g.to(device), diagonal).cpu()
    a64, b64, g64 = a.double(), b.double(), g.double()
    want = (a64[:, :, None] * b64[:, None] * (g64[:, :, None] - g64[:, None]).clamp(max=0).exp()).sum(-1)
    keep = torch.ones(kda.CHUNK, kda.CHUNK, dtype=torch.bool).tril(0 if diagonal else -1)
    want = want * keep
    assert torch.isfinite(got).all()
    assert float((got.double() - want).abs().max()) <= 1e-6 * float(want.abs().max())


@pytest.mark.parametrize("arch, module, function, layer", [
    ("glm5_next", kda, "chunk_kda", "Glm5NextTextLinearAttention"),
    ("qwen4_exp", gdn, "chunk_gdn", "Qwen4ExpTextGatedDeltaNet")])
def test_scoring_passes_use_it(ggufs, monkeypatch, arch, module, function, layer):
    """A GLM-5.3 (Qwen3.8) scoring pass runs its KDA (gated-delta-net) layers through the runtime's function (its
    logits against transformers': tests/test_runtime.py), a transformers model outside the runtime's passes
    through transformers' function."""
    from quantkit.runtime import load_model, logits
    from test_runtime import token_ids

    calls = []
    ours = getattr(module, function)
    monkeypatch.setattr(module, function, lambda *a, **k: calls.append(1) or ours(*a, **k))
    model = load_model(ggufs(arch, "f32"))
    ids = token_ids(arch, 70)
    logits(model, ids)
    layers = sum(type(m).__name__ == layer for m in model.module.modules())
    assert layers and len(calls) == layers
    with torch.no_grad():
        model.module(input_ids=torch.tensor([ids]), use_cache=False)
    assert len(calls) == layers
    assert np.isfinite(logits(model, ids)).all()


from test_runtime import ggufs  # noqa: E402,F401  (the GGUF fixture of the CPU tests)
