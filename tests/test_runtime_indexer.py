"""The runtime's all-queries sparse-attention indexer (quantkit.runtime.indexer) against transformers' own
per-query loop, on the tiny Qwen3.8 Flash Next model's indexer: the same selection mask, bit for bit, under the
plain causal mask of a scoring pass (lengths where no block is complete, where every block is kept, and where
the budget leaves most out; two sequences per pass)."""
from __future__ import annotations

import copy

import pytest
import torch

from quantkit.runtime.indexer import INDEXERS, causal_selection_mask
from quantkit.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def qwen4():
    model, _ = build_tiny_model("qwen4_exp", dtype="f32")
    indexer = next(m for m in model.modules() if type(m).__name__ in INDEXERS)
    rotary = next(m for m in model.modules() if type(m).__name__ == "Qwen4ExpTextRotaryEmbedding")
    return indexer, rotary


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("n", [3, 40, 300, 1000])
def test_selection_equals_transformers_loop(qwen4, n, device):
    indexer, rotary = (copy.deepcopy(module).to(device) for module in qwen4)     # the tiny model is shared
    gen = torch.Generator().manual_seed(n)
    hidden = torch.randn(2, n, indexer.index_qk_proj.in_features, generator=gen).to(device)
    positions = torch.arange(n, device=device)[None].expand(2, n)
    with torch.no_grad():
        cos_sin = rotary(hidden, positions)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None].expand(2, 1, n, n)
        want = indexer.forward(hidden, cos_sin, causal, None)
        got = causal_selection_mask(indexer, hidden, cos_sin)
    assert got.shape == (2, 1, n, n)
    assert torch.equal(got, want & causal)
    if n // indexer.compress_ratio > indexer.block_topk:         # the budget left blocks out: a real selection
        assert not torch.equal(got, causal)
