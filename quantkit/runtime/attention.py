"""transformers' SDPA attention as the runtime runs it: linear in memory for grouped-query attention in float32 on
CUDA, in blocks of queries for causal float32 attention on the CPU.

transformers' ``sdpa`` attention hands grouped-query attention to torch as ``enable_gqa=True`` when there is no
mask (scoring: causal, no padding).  On CUDA only the flash and cuDNN kernels take that flag, and they compute in
half precision: in float32 torch falls back to the math kernel, which holds a ``[heads, n, n]`` score matrix per
layer (2.7 GB at 8192 tokens for four heads, 69 GB at 16K tokens for 16).  :func:`sdpa_attention_forward` repeats
the key/value heads instead (what transformers does with a mask; ``heads x n x head_dim`` more memory, linear in
n), so torch's memory-efficient kernel runs: attention memory is then O(n), no score matrix.  The product is
the same attention: the wrapper is installed as transformers' ``sdpa`` function for the process (it changes
nothing but the kernel choice, and only for float32 tensors).

On the CPU in float32, causal attention without a mask (scoring: every position of every row) runs as
:func:`blocked_causal_attention` instead of torch's CPU flash kernel: the queries in blocks of :data:`CPU_BLOCK`
positions, each block one batched product with the keys up to its end (the causal half, to a block), a softmax and
one product with the values; a key/value head's query heads share its products.  The same attention (exact softmax,
not the flash kernel's running one: float32 rounding apart), in ~25% less time at 512 positions (4 x 4 heads of 64
on two cores: 5.6 ms against 7.5 ms per layer).

Inside :func:`one_sequence_per_row` transformers' search of the position ids for several sequences packed in one
row is skipped (the runtime's rows are one sequence each, positions ``0..n-1``): it reads a flag back from the
device (a host wait per pass) and, while a CUDA graph is being captured, skips that read and builds an explicit
``[n, n]`` mask instead of SDPA's causal kernel, so a captured pass would compute otherwise than the eager one.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

_WRAPPED = "_quantkit_sdpa"
#: Query positions per block of :func:`blocked_causal_attention` (64 was fastest of 32-256 at 512 positions).
CPU_BLOCK = 64
#: Arguments of transformers' SDPA function that :func:`blocked_causal_attention` does not implement (when set).
_UNBLOCKED = ("position_bias", "cache", "softcap", "s_aux", "sinks")
_ONE_SEQUENCE = contextvars.ContextVar("quantkit_one_sequence_per_row", default=False)


@contextlib.contextmanager
def one_sequence_per_row():
    """Forward passes inside have one sequence per row, positions from 0 (see the module doc)."""
    token = _ONE_SEQUENCE.set(True)
    try:
        yield
    finally:
        _ONE_SEQUENCE.reset(token)


class _OneGroup:
    """An attention module as transformers' SDPA function sees it, with key/value heads already repeated."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def blocked_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scaling: float | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[batch, heads, n, d]`` over ``key`` / ``value`` ``[batch, kv_heads, n, d|dv]``
    (query head ``h`` reads key/value head ``h // (heads // kv_heads)``, as transformers' ``repeat_kv``), as
    ``[batch, n, heads, dv]`` (contiguous; the layout transformers' attention functions return).  See the module
    doc."""
    batch, heads, n, d = query.shape
    kv_heads, dv = key.shape[1], value.shape[-1]
    group = heads // kv_heads
    scale = d ** -0.5 if scaling is None else scaling
    # rows (position, head of the group) of each key/value head: [batch * kv_heads, n * group, d], scaled on the way
    rows = torch.empty(batch, kv_heads, n, group, d, dtype=query.dtype)
    torch.mul(query.transpose(1, 2).reshape(batch, n, kv_heads, group, d).permute(0, 2, 1, 3, 4), scale, out=rows)
    rows = rows.view(batch * kv_heads, n * group, d)
    keys = key.reshape(batch * kv_heads, n, d)
    values = value.reshape(batch * kv_heads, n, dv)
    out = torch.empty(batch * kv_heads, n * group, dv, dtype=query.dtype)
    block = min(CPU_BLOCK, n)
    # a block's own positions: row (i, g) sees key j <= i
    later = (torch.arange(block)[:, None] < torch.arange(block)[None, :]).repeat_interleave(group, 0)
    for start in range(0, n, block):
        end = min(start + block, n)
        scores = torch.bmm(rows[:, start * group:end * group], keys[:, :end].transpose(1, 2))
        scores[:, :, start:].masked_fill_(later[:(end - start) * group, :end - start], float("-inf"))
        torch.bmm(torch.softmax(scores, -1), values[:, :end], out=out[:, start * group:end * group])
    return out.view(batch, kv_heads, n, group, dv).permute(0, 2, 1, 3, 4).contiguous().view(batch, n, heads, dv)


def _blockable(module, query, key, attention_mask, dropout, kwargs) -> bool:
    """Whether a call of transformers' SDPA function is the causal, unmasked float32 CPU attention
    :func:`blocked_causal_attention` computes."""
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return (attention_mask is None and bool(is_causal) and not dropout and query.device.type == "cpu"
            and query.dtype == key.dtype == torch.float32 and query.shape[2] == key.shape[2] > 1
            and query.shape[1] % key.shape[1] == 0 and not kwargs.get("output_attentions")
            and all(kwargs.get(name) is None for name in _UNBLOCKED))


def install() -> None:
    """Make transformers' ``sdpa`` attention repeat key/value heads for float32 CUDA tensors, run causal float32 CPU
    attention as :func:`blocked_causal_attention`, and its packed-sequence search answer "none" inside
    :func:`one_sequence_per_row` (idempotent)."""
    from transformers import masking_utils
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.modeling_utils import AttentionInterface

    search = masking_utils.find_packed_sequence_indices
    if not getattr(search, _WRAPPED, False):
        def find_packed_sequence_indices(position_ids):
            return None if _ONE_SEQUENCE.get() else search(position_ids)

        setattr(find_packed_sequence_indices, _WRAPPED, True)
        masking_utils.find_packed_sequence_indices = find_packed_sequence_indices

    original = AttentionInterface._global_mapping["sdpa"]
    if getattr(original, _WRAPPED, False):
        return

    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        if not args and _blockable(module, query, key, attention_mask, kwargs.get("dropout", 0.0), kwargs):
            return blocked_causal_attention(query, key, value, kwargs.get("scaling")), None
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1 and attention_mask is None and query.is_cuda and query.dtype == torch.float32:
            return original(_OneGroup(module), query, repeat_kv(key, groups), repeat_kv(value, groups),
                            attention_mask, *args, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(sdpa_attention_forward, _WRAPPED, True)
    AttentionInterface.register("sdpa", sdpa_attention_forward)
