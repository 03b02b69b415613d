"""Qwen3.8 Flash Next's gated delta rule in chunks (quantkit.runtime.gdn) against transformers' torch reference,
``torch_chunk_gated_delta_rule``: outputs and final states within 1e-5 of the largest, with and without an
initial state, lengths off the 64-token chunk, strong decays, one and two value heads per key head (that the
runtime's scoring passes use it: tests/test_runtime_kda.py)."""
from __future__ import annotations

import pytest
import torch

import transformers.models.qwen4_exp.modeling_qwen4_exp as qwen4
from quantkit.runtime import gdn

BOUND = 1e-5


def transformers_gdn():
    function = qwen4.torch_chunk_gated_delta_rule
    return getattr(function, "theirs", function)


def inputs(n, key_heads, value_heads, decay, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, n, key_heads, 32, generator=gen) for _ in range(2))
    v = torch.randn(2, n, value_heads, 24, generator=gen)
    g = -torch.rand(2, n, value_heads, generator=gen) * decay
    return q, k, v, g, torch.rand(2, n, value_heads, generator=gen)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("n, heads, decay, initial", [(100, (3, 3), 0.3, False), (64, (2, 4), 0.3, True),
                                                      (200, (2, 4), 8.0, False), (130, (3, 6), 8.0, True),
                                                      (7, (1, 2), 0.3, False)])
def test_chunk_gdn_equals_transformers(n, heads, decay, initial, device):
    q, k, v, g, beta = (x.to(device) for x in inputs(n, *heads, decay, seed=n))
    state = (torch.randn(2, heads[1], 32, 24, generator=torch.Generator().manual_seed(1)).to(device)
             if initial else None)
    want, want_state = transformers_gdn()(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    got, got_state = gdn.chunk_gdn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got_state.shape == want_state.shape
    assert float((got - want).abs().max()) <= BOUND * float(want.abs().max())
    assert float((got_state - want_state).abs().max()) <= BOUND * float(want_state.abs().max())
    assert gdn.chunk_gdn(q, k, v, g=g, beta=beta, initial_state=state)[1] is None
