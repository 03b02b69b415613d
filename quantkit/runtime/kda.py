"""GLM-5.3-Flash's Kimi delta attention (KDA) in chunks, the same algorithm as transformers' torch reference with
fewer and smaller operations.

transformers' ``chunk_kimi_delta_attention`` (the path it takes without flash-linear-attention) forms, for every
64-token chunk, ``[64, 64, head_dim]`` tensors of per-channel decays (``exp(g_i - g_j)`` for each query i, key j
and channel) for the whole sequence at once: ~1 GB per layer for the bench's 2B model at 2,048 tokens.  It then
inverts each chunk's ``(I - A)`` by a Python loop of 63 steps, and runs a second ``[64, 64, head_dim]`` decay
product inside its loop over the chunks.  On an H200 these made GLM's pass ~935 ``mul``, 854 elementwise and 1,046
``sum`` launches (bench/results/score-vs-llamacpp-2026-12-03d.md).

:func:`chunk_kda` computes the same quantities:

* Decayed products ``sum_c a_ic b_jc exp(g_ic - g_jc)`` (the chunk's ``A`` and its intra-chunk attention) in
  sub-chunks of :data:`SUB` tokens, as flash-linear-attention does: between two sub-chunks, through the cumulative
  decay at the query sub-chunk's first token ``r`` (``exp(g_i - g_r) * exp(g_r - g_j)``, both factors at most 1
  since ``g`` only decreases, so nothing overflows), one matrix product; within a sub-chunk, transformers' own
  ``[16, 16, head_dim]`` form.  The decay tensors are a quarter of transformers'.
* ``(I - A)^-1`` by one batched triangular solve (the loop's forward substitution computes exactly that).
* The recurrence over chunks with everything that does not depend on the state hoisted out of the loop, and in
  it (as in :mod:`.gdn`) the state read by the queries and keys in one product, the output and the new state
  each in one fused multiply-add, on contiguous chunk-major slices.

Only float rounding differs (products split at ``r``, sums in another order): tests/test_runtime_kda.py holds it
to transformers' function within 1e-5 (outputs and final states, with and without an initial state, strong
decays included; on the CPU and on CUDA).  :func:`install` puts it in place of transformers' function inside
the runtime's passes.  On an H200 the bench's 2B GLM-5.3 took 103.8 ms a 2,048-token pass against 121.1 with
transformers' function (CUDA graph replays, same call), its peak device memory 2.51 GiB against 4.64
(bench/results/seed-cuda-2026-12-03.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import replace_in_passes

#: Tokens per chunk (transformers' and flash-linear-attention's).
CHUNK = 64
#: Tokens per sub-chunk of the decayed products.
SUB = 16
#: transformers modules whose ``chunk_kimi_delta_attention`` :func:`install` replaces.
MODULES = ("transformers.models.glm5_next.modeling_glm5_next",)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' (and flash-linear-attention's) l2norm of the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def decayed_products(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """``out[..., i, j] = sum_c a[..., i, c] * b[..., j, c] * exp(g[..., i, c] - g[..., j, c])`` for ``j < i``
    (``j <= i`` with ``diagonal``), 0 above; ``a, b, g [..., CHUNK, dim]``, ``g`` non-increasing along the chunk.
    On CUDA in one launch where it fits (:mod:`quantkit.kernels.triton_decay`: the same factors, in registers)."""
    if a.is_cuda:
        from ..kernels import triton_decay

        if triton_decay.fits(a):
            return triton_decay.decayed_products(a, b, g, diagonal, SUB)
    *lead, n, dim = a.shape
    parts = n // SUB
    a_s, b_s, g_s = (t.reshape(*lead, parts, SUB, dim) for t in (a, b, g))
    # between sub-chunks: through the decay at the first token r of the query's sub-chunk
    g_ref = g_s[..., :1, :]                                                      # [..., parts, 1, dim]
    a_ref = a_s * (g_s - g_ref).exp()                                            # exp(g_i - g_r) <= 1
    earlier = torch.arange(n, device=a.device)[None, :] < (torch.arange(parts, device=a.device) * SUB)[:, None]
    exponent = (g_ref - g.unsqueeze(-3)).masked_fill(~earlier[..., None], float("-inf"))
    out = torch.matmul(a_ref, (b.unsqueeze(-3) * exponent.exp()).transpose(-1, -2))   # [..., parts, SUB, n]
    # within a sub-chunk: each pair's decay formed on its own, as transformers does
    keep = torch.ones(SUB, SUB, dtype=torch.bool, device=a.device).tril(0 if diagonal else -1)
    decay = (g_s.unsqueeze(-2) - g_s.unsqueeze(-3)).masked_fill(~keep[..., None], float("-inf")).exp()
    inner = (a_s.unsqueeze(-2) * b_s.unsqueeze(-3) * decay).sum(-1)           # [..., parts, SUB, SUB]
    blocks = out.view(*lead, parts, SUB, parts, SUB)
    blocks.diagonal(dim1=-4, dim2=-2).copy_(inner.movedim(-3, -1))             # the diagonal blocks were 0
    return out.view(*lead, n, n)


def chunk_kda(query, key, value, g, beta, chunk_size=CHUNK, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``chunk_kimi_delta_attention`` (same arguments and results): ``query, key, value, g
    [batch, n, heads, dim]``, ``beta [batch, n, heads]``."""
    if chunk_size != CHUNK:
        raise ValueError(f"KDA chunks of {chunk_size} tokens (this implementation takes {CHUNK})")
    initial_dtype = query.dtype
    query, key, value, beta, g = (x.transpose(1, 2).contiguous().to(torch.float32)
                                  for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    batch, heads, n, k_dim = key.shape
    v_dim = value.shape[-1]
    pad = (CHUNK - n % CHUNK) % CHUNK
    query = F.pad(query, (0, 0, 0, pad)) * (query.shape[-1] ** -0.5)
    key, value, g = (F.pad(x, (0, 0, 0, pad)) for x in (key, value, g))
    beta = F.pad(beta, (0, pad))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, value, g, k_beta, v_beta = (x.reshape(batch, heads, -1, CHUNK, x.shape[-1])
                                            for x in (query, key, value, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    # the chunk's (I - A)^-1, A strictly lower: transformers' loop is this forward substitution
    a = -decayed_products(k_beta, key, g, diagonal=False)
    eye = torch.eye(CHUNK, dtype=a.dtype, device=a.device)
    attn = torch.linalg.solve_triangular(eye - a, eye.expand_as(a), upper=False, unitriangular=True)
    value = attn @ v_beta
    from_start = g.exp()                                                # decay since the chunk's start
    k_cumdecay = attn @ (k_beta * from_start)
    intra = decayed_products(query, key, g, diagonal=True)
    last = g[..., -1:, :]                                               # [batch, heads, chunks, 1, k_dim]
    # chunk-major, batch and heads as one, so that the loop's slices are contiguous: the state read by the
    # decayed queries and keys at once ([chunks, rows, 2 CHUNK, k_dim]), the keys decayed to the chunk's end
    readers = torch.cat([query * from_start, k_cumdecay], dim=-2)
    k_to_end = (key * (last - g).exp()).transpose(-1, -2)              # [batch, heads, chunks, k_dim, CHUNK]
    end_decay = last.transpose(-1, -2).exp()                            # [batch, heads, chunks, k_dim, 1]
    rows = batch * heads
    readers, k_to_end, end_decay, value, intra = (
        x.transpose(0, 2).transpose(1, 2).reshape(x.shape[2], rows, *x.shape[-2:]).contiguous()
        for x in (readers, k_to_end, end_decay, value, intra))
    state = (torch.zeros(rows, k_dim, v_dim, dtype=value.dtype, device=value.device) if initial_state is None
             else initial_state.to(value).reshape(rows, k_dim, v_dim))
    out = torch.empty_like(value)
    for i in range(value.shape[0]):
        read = torch.bmm(readers[i], state)                               # [q_decayed; k_cumdecay] @ state
        v_new = value[i] - read[:, CHUNK:]
        torch.baddbmm(read[:, :CHUNK], intra[i], v_new, out=out[i])
        state = torch.baddbmm(state * end_decay[i], k_to_end[i], v_new)
    out = out.view(-1, batch, heads, CHUNK, v_dim).permute(1, 0, 3, 2, 4)   # [batch, chunks, CHUNK, heads, v_dim]
    out = out.reshape(batch, -1, heads, v_dim)[:, :n].contiguous().to(initial_dtype)
    return out, (state.view(batch, heads, k_dim, v_dim) if output_final_state else None)


def install() -> None:
    """Use :func:`chunk_kda` for transformers' KDA layers inside the runtime's passes, on the CPU and on CUDA
    (:func:`.attention.replace_in_passes`); for the modules of :data:`MODULES` already imported."""
    replace_in_passes(MODULES, "chunk_kimi_delta_attention", lambda *args, **kwargs: chunk_kda(*args, **kwargs))
