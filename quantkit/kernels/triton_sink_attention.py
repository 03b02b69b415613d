"""DeepSeek V4's sliding-window attention with sinks in one Triton launch (CUDA, float32):
:func:`quantkit.runtime.sliding.banded_sink_attention`.

The torch band scores each block of ``W`` queries against ``2W`` raw keys and every compressed entry with cuBLAS's
float32 products (no tensor cores), then runs scale, mask, sink, softmax and the value product as separate passes
over ``[heads, n, 2W + c]`` float32 tensors, with copies to and from the blocked layout: 1.1-2.3 ms a layer of
the bench's 2B V4 at 2,048 tokens on an H200.  Here each program takes ``BM`` queries of one head and walks the
raw keys its queries can see (``q - W + 1 .. q``, read ``BN`` at a time) and then the compressed entries, with the
running maximum and sum of flash attention; the model's additive mask is read at each position scored (a tile it
hides entirely is skipped), and the sink starts the running sum (its logit, unscaled, is the first maximum, so no
row is ever empty).  Keys are the values (one key/value head).  Products run as the packed products' do
(:mod:`.triton_matmul`): ``bf16x3`` on the tensor cores, within about 3 x 2^-18 of float32 each; so the result
equals transformers' eager attention up to those products and the order of the sums (tests/test_runtime_sliding.py
states the bound).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_causal_attention import online_softmax_step
from .triton_matmul import FLOAT32_PRECISION

#: Queries per program, keys per step, head channels per product step, output channels per program, warps and
#: pipeline stages.  Measured on the H200 at the bench's V4 shapes (bench/sliding_attention.py, 16 heads of 512,
#: 2,048 tokens): 16 queries with the whole 512-channel row per program beat 32-64 queries with 128-256 channels
#: (each program scoring anew), heads sharing a program's key tiles, and a key tile read once for both products
#: (its registers spill: 10-33 ms).
BM, BN, BD, DV = 16, 32, 64, 512
WARPS, STAGES = 4, 2


@triton.jit
def _scores_step(acc, m_i, l_i, q_rows, kv, mask_rows, rows_ok, start, end, scaling, skv_n, sm_k,
                 D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, out_cols, PRECISION: tl.constexpr):
    cols = start + tl.arange(0, BN)
    cols_ok = cols < end
    bias = tl.load(mask_rows + cols[None, :] * sm_k, mask=rows_ok[:, None] & cols_ok[None, :], other=float("-inf"))
    if tl.max(tl.max(bias, 1), 0) > float("-inf"):           # a tile the mask hides entirely adds nothing
        s = tl.zeros((q_rows.shape[0], BN), dtype=tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            qt = tl.load(q_rows + d[None, :], mask=rows_ok[:, None], other=0.0)
            kt = tl.load(kv + cols[:, None] * skv_n + d[None, :], mask=cols_ok[:, None], other=0.0)
            s = tl.dot(qt, tl.trans(kt), s, input_precision=PRECISION)
        v = tl.load(kv + cols[:, None] * skv_n + out_cols[None, :], mask=cols_ok[:, None], other=0.0)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s * scaling + bias, v, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _sink_attention_kernel(q, kv, mask, sinks, out, n, c, width, scaling, heads,
                           sq_b, sq_h, sq_n, skv_b, skv_n, sm_b, sm_q, sm_k, so_b, so_n, so_h,
                           D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                           DV: tl.constexpr, PRECISION: tl.constexpr):
    m0 = tl.program_id(0) * BM
    b = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    out_cols = tl.program_id(2) * DV + tl.arange(0, DV)
    rows = m0 + tl.arange(0, BM)
    rows_ok = rows < n
    q_rows = q + b.to(tl.int64) * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_n
    mask_rows = mask + b.to(tl.int64) * sm_b + rows[:, None].to(tl.int64) * sm_q
    kv = kv + b.to(tl.int64) * skv_b
    m_i = tl.zeros((BM,), dtype=tl.float32) + tl.load(sinks + h)   # the sink's logit: exp(sink - m_i) = 1
    l_i = tl.zeros((BM,), dtype=tl.float32) + 1.0
    acc = tl.zeros((BM, DV), dtype=tl.float32)
    # raw keys the block's queries can see: m0 - W + 1 .. m0 + BM - 1 (the mask hides the rest)
    first = tl.maximum(m0 - width + 1, 0) // BN * BN
    last = tl.minimum(m0 + BM, n)
    for start in range(first, last, BN):
        acc, m_i, l_i = _scores_step(acc, m_i, l_i, q_rows, kv, mask_rows, rows_ok, start, last, scaling, skv_n,
                                     sm_k, D, BN, BD, out_cols, PRECISION)
    for start in range(n, n + c, BN):
        acc, m_i, l_i = _scores_step(acc, m_i, l_i, q_rows, kv, mask_rows, rows_ok, start, n + c, scaling, skv_n,
                                     sm_k, D, BN, BD, out_cols, PRECISION)
    dst = out + b.to(tl.int64) * so_b + h * so_h + rows[:, None].to(tl.int64) * so_n + out_cols[None, :]
    tl.store(dst, acc / l_i[:, None], mask=rows_ok[:, None])


def fits(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether :func:`sink_attention` takes these: float32 CUDA tensors, channels in whole product steps, rows
    of unit stride, one mask for all heads."""
    return (query.is_cuda and query.dtype == key.dtype == mask.dtype == torch.float32 and mask.shape[1] == 1
            and query.shape[-1] % BD == 0 and query.stride(-1) == 1 and key.stride(-1) == 1)


def sink_attention(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                   width: int, scaling: float) -> torch.Tensor:
    """:func:`quantkit.runtime.sliding.banded_sink_attention`'s result for ``query [batch, heads, n, dim]``, keys
    (= values) ``key [batch, 1, n + c, dim]``, the additive ``mask [batch, 1, n, n + c]``, ``sinks [heads]`` and
    the sliding window ``width``: ``[batch, n, heads, dim]``."""
    batch, heads, n, dim = query.shape
    c = key.shape[2] - n
    dv = dim if dim <= DV and dim & (dim - 1) == 0 else DV if dim % DV == 0 else BD
    out = torch.empty(batch, n, heads, dim, dtype=torch.float32, device=query.device)
    sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    grid = (triton.cdiv(n, BM), batch * heads, dim // dv)
    _sink_attention_kernel[grid](
        query, key, mask, sinks, out, n, c, width, scaling, heads,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(2),
        mask.stride(0), mask.stride(2), mask.stride(3), out.stride(0), out.stride(1), out.stride(2),
        D=dim, BM=BM, BN=BN, BD=BD, DV=dv, PRECISION=FLOAT32_PRECISION, num_warps=WARPS, num_stages=STAGES)
    return out
