"""RMSNorm in one Triton launch (CUDA, float32): ``weight * (x * rsqrt(mean(x²) + eps))`` over the last axis
(or over groups of it; or with ``1 + weight``, Qwen3.8's form).

transformers' RMSNorm runs it as six elementwise and reduction kernels (square, mean, add, rsqrt, two products),
each a pass over the activations; a 7.6B MoE's pass has ~100 of them (two per layer over the hidden states, two
over the query and key heads).  The arithmetic is transformers': float32 squares summed (in another order: a
tree per row), the mean, the CUDA ``rsqrtf`` (libdevice's), ``x * r``, then ``weight *``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: Values per program: rows of the last axis are taken together up to this many.
_BLOCK_VALUES = 8192


@triton.jit
def _rms_norm_kernel(x, weight, out, rows, eps, D: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr,
                     GROUPS: tl.constexpr, PLUS_ONE: tl.constexpr):
    row = tl.program_id(0) * R + tl.arange(0, R)[:, None]
    col = tl.arange(0, BLOCK)[None, :]
    ok = (row < rows) & (col < D)
    offset = row.to(tl.int64) * D + col
    v = tl.load(x + offset, mask=ok, other=0.0)
    mean = tl.math.div_rn(tl.sum(v * v, 1), D * 1.0)
    r = libdevice.rsqrt(mean + eps)
    if GROUPS == 1:
        w = tl.load(weight + col, mask=col < D, other=0.0)
    else:                                  # a weight row spans GROUPS rows of x: each normalized on its own
        w = tl.load(weight + (row % GROUPS) * D + col, mask=ok, other=0.0)
    if PLUS_ONE:
        w = 1.0 + w
    tl.store(out + offset, w * (v * r[:, None]), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, group: int | None = None,
             plus_one: bool = False) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x², last axis) + eps))`` for contiguous float32 CUDA ``x`` and ``weight``
    (``weight``: one value per position of the last axis).  ``group``: each run of ``group`` values of the last
    axis is normalized on its own (Qwen3.8's norms over its hyper-connection streams); ``plus_one``: the scale is
    ``1 + weight`` (Qwen3.8's ``Qwen4ExpTextRMSNorm``)."""
    d = group or x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // d
    block = triton.next_power_of_2(d)
    r = max(1, _BLOCK_VALUES // block)
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, r),)](x, weight, out, rows, eps, D=d, BLOCK=block, R=r,
                                                  GROUPS=x.shape[-1] // d, PLUS_ONE=plus_one,
                                                  num_warps=8 if r * block >= 4096 else 4)
    return out
