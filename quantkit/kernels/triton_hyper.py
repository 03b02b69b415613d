"""Manifold-constrained hyper-connections (DeepSeek V4, GLM-5.3-Flash) in two Triton launches (CUDA, float32).

transformers computes a hyper-connection's weights with ~140 small kernels per call (the RMS norm of the
streams, sigmoids, a softmax and 20 Sinkhorn iterations, each a sum and a division over ``[tokens, 4, 4]``), then
collapses the streams, and mixes them back after the block with a batched ``[4, 4] x [4, hidden]`` product per
token, a broadcast product and a sum (on the H200, a 2,048-token DeepSeek V4 pass spent ~9 ms of ~79 there).

* :func:`hyper_weights`: per token, from the streams ``h [tokens, N, D]`` and their raw map ``h @ fn.T`` (the
  RMS norm's per-token factor is applied to the map's outputs, not to its inputs: one scale per row of a linear
  map commutes with it), ``pre``, ``post``, the doubly-stochastic ``comb`` and the collapsed input
  ``sum_j pre_j h_j``, transformers' operations in their order;
* :func:`hyper_mix`: ``out[k] = post_k y + sum_j comb[j, k] h_j`` (the streams after a block).

Arithmetic is float32 throughout with correctly rounded divisions and libdevice's ``exp`` and ``rsqrt`` (as
torch's CUDA kernels); sums run in another order than torch's (a tree), so results differ from transformers' in
the last bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: Hidden values per program of :func:`hyper_mix` (and per step of :func:`hyper_weights`' loops).
BLOCK_D = 256


@triton.jit
def _sigmoid(x):
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))


@triton.jit
def _hyper_weights_kernel(h, mixes, base, scale, post, comb, collapsed, D, norm_eps, hc_eps,
                          N: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N)
    d = tl.arange(0, BLOCK)
    streams = h + t * N * D + j[:, None] * D
    squares = tl.zeros((N, BLOCK), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        v = tl.load(streams + d0 + d[None, :], mask=(d0 + d)[None, :] < D, other=0.0)
        squares += v * v
    r = libdevice.rsqrt(tl.math.div_rn(tl.sum(tl.sum(squares, 1), 0), (N * D) * 1.0) + norm_eps)
    row = mixes + t * (2 + N) * N
    s_pre = tl.load(scale)
    s_post = tl.load(scale + 1)
    s_comb = tl.load(scale + 2)
    pre = _sigmoid(tl.load(row + j) * r * s_pre + tl.load(base + j)) + hc_eps
    out_post = 2.0 * _sigmoid(tl.load(row + N + j) * r * s_post + tl.load(base + N + j))
    square = j[:, None] * N + j[None, :]
    c = tl.load(row + 2 * N + square) * r * s_comb + tl.load(base + 2 * N + square)
    c = libdevice.exp(c - tl.max(c, 1)[:, None])
    c = tl.math.div_rn(c, tl.sum(c, 1)[:, None]) + hc_eps
    c = tl.math.div_rn(c, tl.sum(c, 0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        c = tl.math.div_rn(c, tl.sum(c, 1)[:, None] + hc_eps)
        c = tl.math.div_rn(c, tl.sum(c, 0)[None, :] + hc_eps)
    tl.store(post + t * N + j, out_post)
    tl.store(comb + t * N * N + square, c)
    for d0 in range(0, D, BLOCK):
        keep = (d0 + d) < D
        v = tl.load(streams + d0 + d[None, :], mask=keep[None, :], other=0.0)
        tl.store(collapsed + t * D + d0 + d, tl.sum(pre[:, None] * v, 0), mask=keep)


@triton.jit
def _hyper_mix_kernel(h, y, post, comb, out, D, N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = d < D
    j = tl.arange(0, N)
    c = tl.load(comb + t * N * N + j[:, None] * N + j[None, :])           # c[j, k]
    p = tl.load(post + t * N + j)
    v = tl.load(h + t * N * D + j[:, None] * D + d[None, :], mask=keep[None, :], other=0.0)
    block_out = tl.load(y + t * D + d, mask=keep, other=0.0)
    mixed = tl.sum(c[:, :, None] * v[:, None, :], 0)                       # [k, BLOCK]
    tl.store(out + t * N * D + j[:, None] * D + d[None, :], p[:, None] * block_out[None, :] + mixed,
             mask=keep[None, :])


def fits(h: torch.Tensor) -> bool:
    """Whether the kernels take streams ``h [..., N, D]``: contiguous float32 on CUDA, ``N`` a power of two."""
    n = h.shape[-2] if h.dim() >= 2 else 0
    return (h.is_cuda and h.dtype == torch.float32 and h.is_contiguous() and n >= 1 and n & (n - 1) == 0)


def hyper_weights(h: torch.Tensor, raw_mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(post [..., N], comb [..., N, N], collapsed [..., D])`` of streams ``h [..., N, D]`` (see the module doc);
    ``raw_mixes [..., (2 + N) N]``: ``h`` flattened times the map, not normed; ``base``, ``scale``: the module's."""
    *lead, n, d = h.shape
    tokens = h.numel() // (n * d)
    post = torch.empty(*lead, n, dtype=h.dtype, device=h.device)
    comb = torch.empty(*lead, n, n, dtype=h.dtype, device=h.device)
    collapsed = torch.empty(*lead, d, dtype=h.dtype, device=h.device)
    if tokens:
        _hyper_weights_kernel[(tokens,)](h, raw_mixes.contiguous(), base.contiguous(), scale.contiguous(), post,
                                         comb, collapsed, d, norm_eps, hc_eps, N=n, ITERS=iters, BLOCK=BLOCK_D,
                                         num_warps=4)
    return post, comb, collapsed


def hyper_mix(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post[..., k] y + sum_j comb[..., j, k] h[..., j, :]`` for every stream ``k``: ``h [..., N, D]``,
    ``y [..., D]`` (the block's output)."""
    *lead, n, d = h.shape
    tokens = h.numel() // (n * d)
    out = torch.empty_like(h)
    if tokens:
        _hyper_mix_kernel[(tokens, triton.cdiv(d, BLOCK_D))](h, y.contiguous(), post.contiguous(),
                                                            comb.contiguous(), out, d, N=n, BLOCK=BLOCK_D,
                                                            num_warps=4)
    return out
