"""Causal attention of one sequence per row in one Triton launch (CUDA, float32): the runtime's SDPA for scoring
passes (:mod:`quantkit.runtime.attention`).

torch has no float32 flash kernel: its memory-efficient one computes on the CUDA cores (no tensor cores), 12.3 ms of
a 2,048-token pass of the bench's 7.6B MoE on an H200 (24 layers, 16 heads of 128).  Here each program takes
``BM`` queries of one head and walks the keys before them ``BN`` at a time with the running maximum and sum of
flash attention; key tiles wholly before the queries skip the causal mask.  Grouped-query heads read their
key/value head in place (no repeated copy).  Products run as the packed products' do (:mod:`.triton_matmul`):
``bf16x3`` on the tensor cores, within about 3 x 2^-18 of float32 each; so the result equals the float32
attention up to those products and the order of the sums (tests/test_runtime_gpu.py states the bound).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_matmul import FLOAT32_PRECISION

#: Queries per program, keys per step, warps and pipeline stages (bench/causal_attention.py on the H200, 16
#: heads of 128, 2,048 tokens).  BM must be a multiple of BN (the tiles before the queries' first are whole).
BM, BN = 128, 64
WARPS, STAGES = 8, 3


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, values, PRECISION: tl.constexpr):
    """Flash attention's running softmax: fold a tile of scores ``s [rows, keys]`` and its ``values [keys,
    channels]`` into the unnormalized output ``acc``, the rows' running maximum ``m_i`` and sum ``l_i``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p, values, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _step(acc, m_i, l_i, qt, k_rows, v_rows, rows, start, n, scaling, sk_n, sv_n, d, CAUSAL: tl.constexpr,
          BN: tl.constexpr, PRECISION: tl.constexpr):
    cols = start + tl.arange(0, BN)
    cols_ok = cols < n
    kt = tl.load(k_rows + cols[:, None].to(tl.int64) * sk_n + d[None, :], mask=cols_ok[:, None], other=0.0)
    s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION) * scaling
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    vt = tl.load(v_rows + cols[:, None].to(tl.int64) * sv_n + d[None, :], mask=cols_ok[:, None], other=0.0)
    return online_softmax_step(acc, m_i, l_i, s, vt, PRECISION)


@triton.jit
def _causal_attention_kernel(q, k, v, out, n, scaling, heads, groups,
                             sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_n, so_h,
                             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    m0 = tl.program_id(0) * BM
    b = (tl.program_id(1) // heads).to(tl.int64)
    h = tl.program_id(1) % heads
    kv_head = h // groups
    rows = m0 + tl.arange(0, BM)
    rows_ok = rows < n
    d = tl.arange(0, D)
    qt = tl.load(q + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_n + d[None, :], mask=rows_ok[:, None],
                 other=0.0)
    k_rows = k + b * sk_b + kv_head * sk_h
    v_rows = v + b * sv_b + kv_head * sv_h
    m_i = tl.zeros((BM,), dtype=tl.float32) + float("-inf")
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    for start in range(0, m0, BN):              # keys before every query of the block
        acc, m_i, l_i = _step(acc, m_i, l_i, qt, k_rows, v_rows, rows, start, n, scaling, sk_n, sv_n, d, False,
                              BN, PRECISION)
    for start in range(m0, tl.minimum(m0 + BM, n), BN):
        acc, m_i, l_i = _step(acc, m_i, l_i, qt, k_rows, v_rows, rows, start, n, scaling, sk_n, sv_n, d, True,
                              BN, PRECISION)
    dst = out + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_n + d[None, :]
    tl.store(dst, acc / l_i[:, None], mask=rows_ok[:, None])


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`causal_attention` takes these ``[batch, heads, n, dim]`` tensors: float32 on CUDA, as many
    keys as queries, one head size (a power of two, 16 to 128: the launch's tiles of 256 channels do not fit the
    H200's shared memory) for all, rows of unit stride, key/value heads dividing the query heads."""
    dim = query.shape[-1]
    return (query.is_cuda and query.dtype == key.dtype == value.dtype == torch.float32
            and key.shape == value.shape and key.shape[2] == query.shape[2] and key.shape[0] == query.shape[0]
            and key.shape[-1] == dim and 16 <= dim <= 128 and dim & (dim - 1) == 0
            and query.shape[1] % key.shape[1] == 0
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """``softmax(scaling q k^T + causal mask) v`` for ``query [batch, heads, n, dim]`` and ``key``, ``value
    [batch, kv_heads, n, dim]`` (query head ``h`` reads key/value head ``h // (heads / kv_heads)``, as
    transformers' ``repeat_kv``): ``[batch, n, heads, dim]``, contiguous."""
    batch, heads, n, dim = query.shape
    out = torch.empty(batch, n, heads, dim, dtype=torch.float32, device=query.device)
    if out.numel():
        _causal_attention_kernel[(triton.cdiv(n, BM), batch * heads)](
            query, key, value, out, n, scaling, heads, heads // key.shape[1],
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2),
            D=dim, BM=BM, BN=BN, PRECISION=FLOAT32_PRECISION, num_warps=WARPS, num_stages=STAGES)
    return out
