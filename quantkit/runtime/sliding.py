"""DeepSeek V4's attention in the runtime's scoring passes: the sliding window computed as a band.

transformers runs V4's attention eagerly (learned per-head sinks; no SDPA path): every query is scored against
every raw key and every compressed entry, ``[heads, n, n + compressed]`` float32 scores per layer, then masked to
a sliding window of ``W`` raw keys (128 in the released models) plus the compressed entries the compressor's
block bias leaves.  At 2,048 tokens each query's raw keys are 8x the band's 2W, and the eager layers' products
were 26% of the bench's 2B V4 pass on an H200 (bench/results/score-vs-llamacpp-2026-12-03c.md); on two CPU cores
the band is 2.35-3.5x faster a layer at 2K tokens, 3.5-8.1x at 4K (bench/results/sliding-attention-2026-12-03.md).

:func:`banded_sink_attention` gives the same attention from the band alone.  Queries go in blocks of ``W``; a block
starting at ``s`` sees raw keys ``s - W .. s + W - 1`` at most (a query ``q`` sees ``q - W + 1 .. q``), so each
block is scored against that window of ``2W`` keys (one batched product over blocks, no copy of the keys), its mask
read from the model's own mask at those positions.  The compressed entries (a few hundred at most) are scored in
full with their block bias, as before.  The softmax runs over the window, the compressed entries and the sink, in
transformers' order (scale, mask, sink appended, max subtracted, softmax, sink dropped); the keys it leaves out are
masked in the full computation (weight exactly 0), so only summation order differs.

On CUDA in float32 the same attention is one Triton launch (:mod:`quantkit.kernels.triton_sink_attention`: no
score tensor in memory, 1.6-1.9x the torch band a layer on an H200, bench/results/score-vs-llamacpp-2026-12-04c.md).

Used inside :func:`.attention.one_sequence_per_row` only (the mask is then transformers' sliding causal one, no
cache); elsewhere transformers' eager function runs.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .attention import in_one_sequence_per_row

#: transformers attention classes whose module's ``eager_attention_forward`` :func:`install` wraps.
ATTENTIONS = ("DeepseekV4Attention",)
_WRAPPED = "_quantkit_banded"


def banded_sink_attention(module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor,
                          scaling: float) -> torch.Tensor:
    """V4 attention for ``query [batch, heads, n, dim]``, one key/value head ``key [batch, 1, n + c, dim]`` (n raw
    keys, then c compressed entries; keys are the values) and the additive ``mask [batch, 1, n, n + c]``, whose raw
    part is zero only within ``module.sliding_window`` keys of the query: ``[batch, n, heads, dim]``.  On CUDA in
    one launch where it fits (:mod:`quantkit.kernels.triton_sink_attention`)."""
    if query.is_cuda:
        from ..kernels import triton_sink_attention

        if triton_sink_attention.fits(query, key, mask):
            return triton_sink_attention.sink_attention(query, key, mask, module.sinks, module.sliding_window,
                                                        scaling)
    return torch_banded_sink_attention(module, query, key, mask, scaling)


def torch_banded_sink_attention(module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor,
                                scaling: float) -> torch.Tensor:
    """:func:`banded_sink_attention` in torch operations (any device and dtype)."""
    batch, heads, n, dim = query.shape
    width = module.sliding_window
    blocks = -(-n // width)
    raw, compressed = key[:, 0, :n], key[:, 0, n:]
    # windows[b, k] = raw keys k*W - W .. k*W + W - 1 (zeros outside 0..n-1, masked below)
    padded = F.pad(raw, (0, 0, width, blocks * width - n))
    windows = padded.unfold(1, 2 * width, width)                                  # [batch, blocks, dim, 2W]
    queries = F.pad(query, (0, 0, 0, blocks * width - n)).view(batch, heads, blocks, width, dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(batch, blocks, heads * width, dim)
    band = torch.matmul(queries, windows).view(batch, blocks, heads, width, 2 * width) * scaling
    band = band.permute(0, 2, 1, 3, 4).reshape(batch, heads, blocks * width, 2 * width)[:, :, :n]
    positions = torch.arange(n, device=query.device)
    keys = (positions // width * width - width)[:, None] + torch.arange(2 * width, device=query.device)
    inside = (keys >= 0) & (keys < n)
    band_mask = mask[:, :, :, :n].gather(-1, keys.clamp(0, n - 1).expand(*mask.shape[:2], n, 2 * width))
    band = band + band_mask.masked_fill(~inside, float("-inf"))
    parts = [band]
    if compressed.shape[1]:
        scores = torch.matmul(query, compressed.transpose(-1, -2).unsqueeze(1)) * scaling
        parts.append(scores + mask[:, :, :, n:])
    parts.append(module.sinks.reshape(1, -1, 1, 1).expand(batch, -1, n, -1))
    logits = torch.cat(parts, dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(key.dtype)
    weights = F.pad(probs[..., :2 * width], (0, 0, 0, blocks * width - n))
    weights = weights.view(batch, heads, blocks, width, 2 * width).permute(0, 2, 1, 3, 4)
    out = torch.matmul(weights.reshape(batch, blocks, heads * width, 2 * width), windows.transpose(-1, -2))
    out = out.view(batch, blocks, heads, width, dim).permute(0, 2, 1, 3, 4).reshape(batch, heads, -1, dim)[:, :, :n]
    if compressed.shape[1]:
        out = out + torch.matmul(probs[..., 2 * width:], compressed.unsqueeze(1))
    return out.transpose(1, 2).contiguous()


def install(model) -> None:
    """Wrap the eager attention function of each :data:`ATTENTIONS` class's transformers module in ``model`` with
    :func:`banded_sink_attention` for the scoring passes (idempotent; outside them the function is unchanged)."""
    for module in model.modules():
        if type(module).__name__ in ATTENTIONS:
            code = sys.modules[type(module).__module__]
            if not getattr(code.eager_attention_forward, _WRAPPED, False):
                code.eager_attention_forward = _banded_or_theirs(code.eager_attention_forward)


def _banded_or_theirs(theirs):
    def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        n = query.shape[2]
        if (in_one_sequence_per_row() and isinstance(attention_mask, torch.Tensor)
                and attention_mask.is_floating_point() and value is key
                and key.shape[1] == 1 and attention_mask.shape[-2] == n and attention_mask.shape[-1] == key.shape[2]
                and key.shape[2] >= n and getattr(module, "sliding_window", None) and not dropout):
            return banded_sink_attention(module, query, key, attention_mask, scaling), None
        return theirs(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    setattr(eager_attention_forward, _WRAPPED, True)
    return eager_attention_forward
