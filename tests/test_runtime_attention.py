"""The CPU's blocked causal attention (:func:`quantkit.runtime.attention.blocked_causal_attention`) against torch's
SDPA, and the calls transformers' ``sdpa`` function hands it (float32 CPU, causal, no mask) or leaves to torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantkit.runtime import attention


def _inputs(batch, heads, kv_heads, n, d, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # as the models make them: [batch, n, heads, d] projections seen as [batch, heads, n, d]
    q = torch.randn(batch, n, heads, d, generator=gen).transpose(1, 2)
    k = torch.randn(batch, n, kv_heads, d, generator=gen).transpose(1, 2)
    v = torch.randn(batch, n, kv_heads, dv, generator=gen).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("batch,heads,kv_heads,n,d,dv", [
    (4, 4, 2, 512, 64, 64),      # the example model's scoring pass
    (1, 8, 1, 200, 32, 32),      # n not a multiple of the block, one key/value head for eight
    (2, 3, 3, 7, 16, 24),        # fewer positions than a block, no grouping, values wider than keys
])
def test_blocked_causal_attention_is_sdpa(batch, heads, kv_heads, n, d, dv):
    q, k, v = _inputs(batch, heads, kv_heads, n, d, dv)
    scale = 0.3
    got = attention.blocked_causal_attention(q, k, v, scale)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                         enable_gqa=heads != kv_heads).transpose(1, 2)
    assert got.shape == (batch, n, heads, dv) and got.is_contiguous()
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    default = attention.blocked_causal_attention(q, k, v)       # transformers passes no scaling: 1 / sqrt(d)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads).transpose(1, 2)
    assert float((default - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


class _Module:
    num_key_value_groups = 2
    is_causal = True


def test_sdpa_hands_only_causal_unmasked_float32_cpu_calls_to_the_blocks(monkeypatch):
    from transformers.modeling_utils import AttentionInterface

    attention.install()
    sdpa = AttentionInterface._global_mapping["sdpa"]
    calls = []
    real = attention.blocked_causal_attention
    monkeypatch.setattr(attention, "blocked_causal_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v = _inputs(1, 4, 2, 33, 16, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    out, _ = sdpa(_Module(), q, k, v, None, dropout=0.0, scaling=None)
    assert calls == [1] and float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    mask = torch.ones(1, 1, 33, 33, dtype=torch.bool).tril()
    sdpa(_Module(), q, k, v, mask, dropout=0.0, scaling=None)                 # a mask: torch's kernels
    sdpa(_Module(), q.double(), k.double(), v.double(), None, dropout=0.0)    # not float32
    sdpa(_Module(), q[:, :, -1:], k, v, None, dropout=0.0)                    # one query (a KV-cache step)
    sdpa(_Module(), q, k, v, None, dropout=0.0, is_causal=False)              # bidirectional
    assert calls == [1]
