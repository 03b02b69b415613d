"""The runtime's all-queries sparse-attention indexer (quantkit.runtime.indexer) against transformers' own
per-query loop, on the tiny Qwen3.8 Flash Next model's indexer: the same selection mask, bit for bit, under the
plain causal mask of a scoring pass (lengths where no block is complete, where every block is kept, and where
the budget leaves most out; two sequences per pass)."""
from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch

from quantkit.runtime.indexer import INDEXERS, POOLING_INDEXERS, causal_selection_mask, every_pool
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


@pytest.fixture(scope="module")
def glm5():
    model, _ = build_tiny_model("glm5_next", dtype="f32")
    return next(m for m in model.modules() if type(m).__name__ in POOLING_INDEXERS)


def _selected(topk_indices: torch.Tensor, n: int) -> torch.Tensor:
    """The tokens each query attends to, as a ``[batch, queries, n]`` boolean (what the attention builds)."""
    counts = torch.zeros(*topk_indices.shape[:2], n, dtype=torch.int32, device=topk_indices.device)
    counts.scatter_add_(-1, topk_indices.clamp(0, n - 1).long(), topk_indices.ge(0).to(torch.int32))
    return counts.ne(0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("n", [5, 47, 300, 700])
def test_every_pool_selects_what_transformers_selects(glm5, n, device):
    """GLM-5.3-Flash's indexer with every key pool kept (no boolean index, so a CUDA graph can hold it) selects the
    same tokens for every query as transformers' pooling, which drops the pools no row completes: a full row, a
    right-padded one (a scoring pass's shorter case) and a left-padded one."""
    indexer = copy.deepcopy(glm5).to(device)
    gen = torch.Generator().manual_seed(n)
    hidden = torch.randn(3, n, indexer.hidden_size, generator=gen).to(device)
    q_resid = torch.randn(3, n, indexer.q_lora_rank, generator=gen).to(device)
    mask = torch.ones(3, n, dtype=torch.bool, device=device)
    mask[1, n - n // 3:] = False
    mask[2, : n // 4] = False
    with torch.no_grad():
        want = indexer(hidden, q_resid, mask, None)
        indexer.get_pooled_states = lambda packed_states: every_pool(indexer, packed_states)
        got = indexer(hidden, q_resid, mask, None)
    assert got.shape == want.shape
    selected = _selected(got, n)
    assert torch.equal(selected, _selected(want, n))
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril() & mask[:, None, :] & mask[:, :, None]
    assert not (selected & ~causal).any()
    if n // indexer.index_kpool > indexer.index_topk // indexer.index_kpool:    # a real selection
        assert not torch.equal(selected, causal)


def test_selection_of_chunks_through_the_cache_equals_transformers_loop(monkeypatch):
    """A long sequence's chunks through the cache (:func:`quantkit.runtime.attention.causal_chunks`): each chunk's
    selection, its queries against every key cached so far, equals transformers' loop over the queries bit for
    bit (two sequences, 300 tokens in chunks of 100: blocks left out by the budget; queries scored in groups), and
    the cache then holds the same index keys."""
    from quantkit.runtime import indexer as runtime_indexer
    from quantkit.runtime.attention import causal_chunks

    model, _ = build_tiny_model("qwen4_exp", dtype="f32")
    model.eval()
    runtime_indexer.install(model)
    # the same gated-delta-net arithmetic on both sides (the runtime's chunk_gdn rounds otherwise), so that the
    # indexers see the same hidden states
    code = sys.modules[type(model).__module__]
    monkeypatch.setattr(code, "torch_chunk_gated_delta_rule",
                        getattr(code.torch_chunk_gated_delta_rule, "theirs", code.torch_chunk_gated_delta_rule))
    seen = {"ours": [], "theirs": []}
    batched = []
    mask = runtime_indexer.causal_selection_mask
    monkeypatch.setattr(runtime_indexer, "SCORE_VALUES", 1000)     # queries in several groups
    monkeypatch.setattr(runtime_indexer, "causal_selection_mask",
                        lambda *a, **k: batched.append(1) or mask(*a, **k))
    for module in model.modules():
        if type(module).__name__ in INDEXERS:
            def recorded(*args, _forward=module.forward, **kwargs):
                out = _forward(*args, **kwargs)
                seen[side].append(out)
                return out
            module.forward = recorded
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 300), generator=torch.Generator().manual_seed(3))
    caches = {}
    for side in ("theirs", "ours"):
        cache = None
        with torch.no_grad(), (causal_chunks() if side == "ours" else contextlib.nullcontext()):
            for start in range(0, 300, 100):
                cache = model(input_ids=ids[:, start:start + 100], past_key_values=cache,
                              use_cache=True).past_key_values
        caches[side] = cache
        if side == "theirs":
            assert not batched
    assert batched and len(seen["ours"]) == len(seen["theirs"]) > 0
    real_selection = False
    for got, want in zip(seen["ours"], seen["theirs"]):
        n, kv = got.shape[-2:]
        causal = torch.arange(kv)[None, :] <= torch.arange(kv - n, kv)[:, None]
        assert torch.equal(got, want & causal)
        real_selection |= not torch.equal(got, causal.expand_as(got))
    assert real_selection
    keys = [(layer.indexer_keys, theirs.indexer_keys) for layer, theirs in zip(caches["ours"].layers,
            caches["theirs"].layers) if getattr(theirs, "indexer_keys", None) is not None]
    assert keys and all(ours.shape[1] == 300 and torch.equal(ours, theirs) for ours, theirs in keys)
