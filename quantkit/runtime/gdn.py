"""Qwen3.8 Flash Next's gated delta rule in chunks, the same algorithm as transformers' torch reference with fewer
and smaller operations.

transformers' ``torch_chunk_gated_delta_rule`` (the path it takes without flash-linear-attention) repeats each
query/key head for the value heads it serves, then forms per value head the chunk's ``k_beta k^T`` and ``q k^T``,
solves the chunk's triangular system twice (once for the values, once for the decayed keys), and runs four
products and five other operations per chunk in its loop over the chunks.  On two CPU cores at the bench's 2B
shapes (2,048 tokens, 16 key heads serving 32 value heads of 128) copies were 35% of its time and products 20%.

:func:`chunk_gdn` computes the same quantities:

* ``k k^T`` and ``q k^T`` once per key head (``k_beta k^T`` is ``beta_i (k_i . k_j)``: the value head's betas
  scale rows of the shared product), decayed per value head;
* the chunk's ``(I + A)^-1`` by one triangular solve against the identity, then two products with it;
* in the loop, the state read by the queries and by the decayed keys in one product, and the output and the new
  state each in one fused multiply-add (``baddbmm``), everything that does not depend on the state hoisted.

Only float rounding differs (sums in another order): tests/test_runtime_gdn.py holds it to transformers' function
within 1e-5 (outputs and final states, with and without an initial state, lengths off the chunk, one and two
value heads per key head).  :func:`install` puts it in place of transformers' function inside the runtime's
passes, on the CPU and on CUDA (an H200: the 2B Qwen3.8's 2K pass 171.7 -> 164.3 ms, logits within 7.3e-6).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import replace_in_passes
from .kda import l2norm

#: Tokens per chunk (transformers' default).
CHUNK = 64
#: transformers modules whose ``torch_chunk_gated_delta_rule`` :func:`install` replaces.
MODULES = ("transformers.models.qwen4_exp.modeling_qwen4_exp",)


def chunk_gdn(query, key, value, g, beta, chunk_size=CHUNK, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` (same arguments and results): ``query, key [batch, n,
    key_heads, k_dim]``, ``value [batch, n, value_heads, v_dim]``, ``g, beta [batch, n, value_heads]``; each key
    head serves ``value_heads // key_heads`` consecutive value heads."""
    if chunk_size != CHUNK:
        raise ValueError(f"gated delta rule chunks of {chunk_size} tokens (this implementation takes {CHUNK})")
    initial_dtype = query.dtype
    batch, n, key_heads, k_dim = key.shape
    value_heads, v_dim = value.shape[-2:]
    group = value_heads // key_heads
    query, key, value, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query = query * (k_dim ** -0.5)
    pad = (CHUNK - n % CHUNK) % CHUNK
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    chunks = (n + pad) // CHUNK
    # chunk-major, so that the loop's slices are contiguous: key-head tensors [chunks, batch, key_heads, 1,
    # CHUNK, k_dim] (the 1 broadcasts over the key head's value heads), value-head tensors [chunks, batch,
    # key_heads, group, CHUNK, ...]
    query, key = (x.view(batch, key_heads, chunks, CHUNK, k_dim).permute(2, 0, 1, 3, 4).unsqueeze(3).contiguous()
                  for x in (query, key))
    value = value.view(batch, key_heads, group, chunks, CHUNK, v_dim).permute(3, 0, 1, 2, 4, 5).contiguous()
    beta, g = (x.view(batch, key_heads, group, chunks, CHUNK).permute(3, 0, 1, 2, 4).contiguous()
               for x in (beta, g))
    g = g.cumsum(dim=-1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(
        torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=g.device).triu(1), float("-inf")).exp()
    # k k^T and q k^T once per key head; system is transformers' ut_system (I + A, A its strict lower part)
    system = (key @ key.transpose(-1, -2)) * decay * beta.unsqueeze(-1)
    intra = (query @ key.transpose(-1, -2)) * decay
    eye = torch.eye(CHUNK, dtype=system.dtype, device=system.device)
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    from_start = g.exp().unsqueeze(-1)                                   # decay since the chunk's start
    new_values = inverse @ (value * beta.unsqueeze(-1))
    k_cumdecay = inverse @ (key * beta.unsqueeze(-1) * from_start)
    # the state read by the decayed queries and keys at once: [chunks, batch * value_heads, 2 CHUNK, k_dim]
    readers = torch.cat([query * from_start, k_cumdecay], dim=-2)
    k_to_end = (key * (g[..., -1:] - g).exp().unsqueeze(-1)).transpose(-1, -2)
    end_decay = g[..., -1:].exp().unsqueeze(-1)
    rows = batch * value_heads
    readers, k_to_end, end_decay, new_values, intra = (
        x.reshape(chunks, rows, *x.shape[-2:]) for x in (readers, k_to_end, end_decay, new_values, intra))
    state = (torch.zeros(rows, k_dim, v_dim, dtype=torch.float32, device=value.device) if initial_state is None
             else initial_state.to(torch.float32).reshape(rows, k_dim, v_dim))
    out = torch.empty(chunks, rows, CHUNK, v_dim, dtype=torch.float32, device=value.device)
    for i in range(chunks):
        read = torch.bmm(readers[i], state)                               # [q_decayed; k_cumdecay] @ state
        v_new = new_values[i] - read[:, CHUNK:]
        torch.baddbmm(read[:, :CHUNK], intra[i], v_new, out=out[i])
        state = torch.baddbmm(state * end_decay[i], k_to_end[i], v_new)
    out = out.view(chunks, batch, value_heads, CHUNK, v_dim).permute(1, 0, 3, 2, 4)   # [batch, chunks, CHUNK, ...]
    out = out.reshape(batch, -1, value_heads, v_dim)[:, :n].contiguous().to(initial_dtype)
    return out, (state.view(batch, value_heads, k_dim, v_dim) if output_final_state else None)


def install() -> None:
    """Use :func:`chunk_gdn` for transformers' gated-delta-net layers inside the runtime's passes
    (:func:`.attention.replace_in_passes`); for the modules of :data:`MODULES` already imported."""
    replace_in_passes(MODULES, "torch_chunk_gated_delta_rule", lambda *args, **kwargs: chunk_gdn(*args, **kwargs))
