"""KDA's decayed products in one Triton launch (CUDA, float32): :func:`quantkit.runtime.kda.decayed_products`.

``out[i, j] = sum_c a_ic b_jc exp(g_ic - g_jc)`` over each 64-token chunk, ``j < i`` (``j <= i`` with
``diagonal``), is computed by the torch code in sub-chunks of 16 tokens: between two sub-chunks through the decay
at the query sub-chunk's first token ``r`` (one product of ``a exp(g - g_r)`` by ``b exp(g_r - g)``), within a
sub-chunk pair by pair.  In torch that forms ``[.., 4, 64, dim]`` and ``[.., 4, 16, 16, dim]`` float32 tensors
(exponents, their ``exp``, the products: ~268 MB each for the bench's 2B GLM-5.3 at 2,048 tokens) and reads them
back, ~1 ms a call on an H200.  Here each program computes one sub-chunk row of one chunk's ``[64, 64]`` from
``a``, ``b`` and ``g`` alone, in registers: the same factors, the products on the tensor cores' float32 path
(``ieee``: no TF32 rounding) and the pairwise sums as trees, so only the order of the sums differs (and
``exp``: Triton's, within a few units in the last place of torch's).  tests/test_runtime_kda.py holds it to the
torch code and to float64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Channels per step (a product needs at least 16).
_STEP = 32


@triton.jit
def _decayed_kernel(a, b, g, out, DIM: tl.constexpr, N: tl.constexpr, SUB: tl.constexpr, BC: tl.constexpr,
                    DIAGONAL: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    base = chunk * N * DIM
    i = p * SUB + tl.arange(0, SUB)                         # this program's query rows
    t = tl.arange(0, SUB)
    out_rows = out + chunk * N * N + i[:, None] * N
    # earlier sub-chunks: a exp(g - g_r) times b exp(g_r - g), r the first query row (both factors <= 1)
    for q in range(0, p):
        j = q * SUB + t
        acc = tl.zeros((SUB, SUB), dtype=tl.float32)
        for c0 in range(0, DIM, BC):
            c = c0 + tl.arange(0, BC)[None, :]
            g_ref = tl.load(g + base + p * SUB * DIM + c)
            at_i = base + i[:, None] * DIM + c
            at_j = base + j[:, None] * DIM + c
            a_ref = tl.load(a + at_i) * tl.exp(tl.load(g + at_i) - g_ref)
            b_ref = tl.load(b + at_j) * tl.exp(g_ref - tl.load(g + at_j))
            acc = tl.dot(a_ref, tl.trans(b_ref), acc, input_precision="ieee")
        tl.store(out_rows + j[None, :], acc)
    # the sub-chunk itself: each pair's decay on its own
    ii = i[:, None, None]
    jj = i[None, :, None]
    if DIAGONAL:
        keep = jj <= ii
    else:
        keep = jj < ii
    acc = tl.zeros((SUB, SUB), dtype=tl.float32)
    for c0 in range(0, DIM, BC):
        c = c0 + tl.arange(0, BC)[None, None, :]
        at_i = base + ii * DIM + c
        at_j = base + jj * DIM + c
        decay = tl.where(keep, tl.exp(tl.load(g + at_i) - tl.load(g + at_j)), 0.0)
        acc += tl.sum(tl.load(a + at_i) * tl.load(b + at_j) * decay, 2)
    tl.store(out_rows + i[None, :], acc)
    # later sub-chunks: 0
    for q in range(p + 1, N // SUB):
        tl.store(out_rows + (q * SUB + t)[None, :], tl.zeros((SUB, SUB), dtype=tl.float32))


def fits(a: torch.Tensor) -> bool:
    """Whether :func:`decayed_products` takes ``a`` (and ``b``, ``g`` alike): float32 on CUDA, whole steps of
    channels."""
    dim = a.shape[-1]
    return a.is_cuda and a.dtype == torch.float32 and dim >= _STEP and dim % _STEP == 0


def decayed_products(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, diagonal: bool, sub: int) -> torch.Tensor:
    """:func:`quantkit.runtime.kda.decayed_products` of float32 CUDA ``a, b, g [..., n, dim]`` with sub-chunks of
    ``sub`` tokens."""
    *lead, n, dim = a.shape
    a, b, g = (x.contiguous() for x in (a, b, g))
    out = torch.empty(*lead, n, n, dtype=torch.float32, device=a.device)
    chunks = a.numel() // (n * dim)
    if chunks:
        _decayed_kernel[(chunks, n // sub)](a, b, g, out, DIM=dim, N=n, SUB=sub, BC=_STEP, DIAGONAL=diagonal,
                                            num_warps=4)
    return out
