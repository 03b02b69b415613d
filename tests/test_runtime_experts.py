"""The grouped experts path (:mod:`quantkit.runtime.experts`) against transformers' eager per-expert loop, on the
CPU: the grouped product equals per-expert products, and every tiny architecture's quantized GGUF gives the eager
loop's logits (within the runtime's tolerance: the same float32 products, summed in another order).  The CUDA
runtime runs the grouped path by default (tests/test_runtime_gpu.py compares it with the CPU runtime)."""
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
    eager = logits(load_model(path), ids)
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
    assert np.array_equal(logits(load_model(path, experts="grouped"), ids), logits(load_model(path), ids))
    assert not calls


def test_unknown_experts_mode_is_refused(ggufs):
    with pytest.raises(UnsupportedError, match="experts mode"):
        load_model(ggufs("qwen3_moe", "mixed"), experts="fast")
