"""SDPA that stays linear in memory for grouped-query attention in float32 on CUDA.

transformers' ``sdpa`` attention hands grouped-query attention to torch as ``enable_gqa=True`` when there is no
mask (scoring: causal, no padding).  On CUDA only the flash and cuDNN kernels take that flag, and they compute in
half precision: in float32 torch falls back to the math kernel, which holds a ``[heads, n, n]`` score matrix per
layer (2.7 GB at 8192 tokens for four heads, 69 GB at 16K tokens for 16).  :func:`sdpa_attention_forward` repeats
the key/value heads instead (what transformers does with a mask; ``heads x n x head_dim`` more memory, linear in
n), so torch's memory-efficient kernel runs: attention memory is then O(n), no score matrix.  The product is
the same attention: the wrapper is installed as transformers' ``sdpa`` function for the process (it changes
nothing but the kernel choice, and only for float32 CUDA tensors).
"""
from __future__ import annotations

import torch

_WRAPPED = "_quantkit_sdpa"


class _OneGroup:
    """An attention module as transformers' SDPA function sees it, with key/value heads already repeated."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def install() -> None:
    """Make transformers' ``sdpa`` attention repeat key/value heads for float32 CUDA tensors (idempotent)."""
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.modeling_utils import AttentionInterface

    original = AttentionInterface._global_mapping["sdpa"]
    if getattr(original, _WRAPPED, False):
        return

    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1 and attention_mask is None and query.is_cuda and query.dtype == torch.float32:
            return original(_OneGroup(module), query, repeat_kv(key, groups), repeat_kv(value, groups),
                            attention_mask, *args, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(sdpa_attention_forward, _WRAPPED, True)
    AttentionInterface.register("sdpa", sdpa_attention_forward)
