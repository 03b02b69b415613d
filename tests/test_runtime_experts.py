"""The grouped and sorted experts paths (:mod:`quantkit.runtime.experts`) against transformers' eager per-expert
loop, on the CPU: the grouped product equals per-expert products, and every tiny architecture's quantized GGUF gives
the eager loop's logits through either path (within the runtime's tolerance: the same float32 products, summed in
another order).  The CUDA runtime runs the grouped path by default (tests/test_runtime_gpu.py compares it with the
CPU runtime), the CPU runtime the sorted one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.errors import UnsupportedError
from quantkit.runtime import experts as grouped
from quantkit.runtime import load_model, logits
from test_runtime import ARCH_NAMES, RELATIVE_TOLERANCE, ggufs, token_ids  # noqa: F401  (fixture)


def per_expert(x, weight, experts, transposed):
    out = []
    for row, e in zip(x, experts.tolist()):
        w = weight[e] if transposed else weight[e].T
        out.append(row[None] @ w)
    return torch.cat(out)


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_linear_equals_per_expert_products(transposed):
    gen = torch.Generator().manual_seed(0)
    n_experts, rows_in, rows_out = 6, 48, 40
    experts = torch.sort(torch.randint(0, n_experts - 1, (200,), generator=gen)).values   # the last expert idle
    counts = torch.bincount(experts, minlength=n_experts)
    x = torch.randn(200, rows_in, generator=gen)
    shape = (n_experts, rows_in, rows_out) if transposed else (n_experts, rows_out, rows_in)
    weight = torch.randn(*shape, generator=gen)
    got = grouped.grouped_linear(x, weight, experts, counts, transposed)
    ref = per_expert(x, weight, experts, transposed)
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_grouped_experts_give_the_eager_logits(ggufs, arch, monkeypatch):
    calls = []
    real = grouped.grouped_linear
    monkeypatch.setattr(grouped, "grouped_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = ggufs(arch, "mixed")
    ids = token_ids(arch, 64)
    eager = logits(load_model(path, experts="eager"), ids)
    got = logits(load_model(path, experts="grouped"), ids)
    assert calls, f"{arch}: the grouped path never ran"
    scale = float(np.abs(eager).max())
    assert float(np.abs(got - eager).max()) <= RELATIVE_TOLERANCE * scale


def test_layers_over_the_decode_budget_run_the_eager_loop(ggufs, monkeypatch):
    calls = []
    monkeypatch.setattr(grouped, "MAX_DECODED_BYTES", 0)
    monkeypatch.setattr(grouped, "grouped_linear", lambda *a, **k: calls.append(1))
    path = ggufs("qwen3_moe", "mixed")
    ids = token_ids("qwen3_moe", 64)
    assert np.array_equal(logits(load_model(path, experts="grouped"), ids), logits(load_model(path, experts="eager"),
                                                                                ids))
    assert not calls


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sorted_experts_give_the_eager_logits(ggufs, arch, monkeypatch):
    """The CPU default: the eager loop's products over rows sorted once (one expert's weights at a time), the
    eager loop's arithmetic."""
    calls = []
    real = grouped.sorted_experts_forward
    monkeypatch.setattr(grouped, "sorted_experts_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    grouped.register()      # the interface holds the function itself: register the counting one
    path = ggufs(arch, "mixed")
    ids = token_ids(arch, 64)
    eager = logits(load_model(path, experts="eager"), ids)
    got = logits(load_model(path), ids)
    monkeypatch.undo()
    grouped.register()
    assert calls, f"{arch}: the sorted path never ran"
    assert np.array_equal(got, eager)       # the same products, row for row, and the same sums


def test_sorted_experts_sum_many_slots_as_the_eager_loop():
    """More slots than two (summed in expert order, as the eager loop sums them), a top-k that leaves experts idle,
    and one token: the eager loop's results, bit for bit."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    gen = torch.Generator().manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=4)
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(generator=gen)
        module.down_proj.normal_(generator=gen)
    for tokens, top_k in ((50, 4), (1, 4), (30, 1)):
        x = torch.randn(tokens, 64, generator=gen)
        index = torch.stack([torch.randperm(5, generator=gen)[:top_k] for _ in range(tokens)])    # expert 5 idle
        weights = torch.rand(tokens, top_k, generator=gen)
        with torch.no_grad():
            ref = grouped._eager(module)(module, x, index, weights)
            got = grouped.sorted_experts_forward(module, x, index, weights)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert torch.equal(got, ref)


def test_unknown_experts_mode_is_refused(ggufs):
    with pytest.raises(UnsupportedError, match="experts mode"):
        load_model(ggufs("qwen3_moe", "mixed"), experts="fast")
