"""The sparse-attention indexers of the seed architectures, made fit for the runtime's scoring passes.

**Qwen3.8 Flash Next** (transformers' ``Qwen4ExpTextQSAIndexer``): the selection for all queries at once.

transformers selects each query's key blocks in a Python loop over the queries, with a ``nonzero`` (a wait for the
device) per query: a 2048-token pass of the bench's 2B synthetic model scored at 463 tok/s on an H200
(bench/results/score-vs-llamacpp-2026-12-03b.md).  In the runtime's scoring passes the mask is the plain causal
one (one sequence per row from position 0, no cache; :func:`.attention.one_sequence_per_row`), so every query sees
the same key blocks, the first ``(query + 1) // ratio`` of them complete: :func:`causal_selection_mask` pools the
blocks once, scores every query against every block in one product, keeps each query's ``budget // ratio``
best complete blocks (``topk``) and its incomplete tail, as the loop does.  Each block's pooled key and each
(query, block) score are computed with transformers' operations in its order; only the products are batched
(the scores may round differently in the last bit, which can matter only at an exact tie for the last block a
query keeps).  Memory: at most :data:`SCORE_VALUES` per-head scores at a time.

The same selection serves the chunks of a long sequence through the cache (:func:`.attention.causal_chunks`):
the queries are then the chunk's, the keys every position cached so far.  Other passes (a cache otherwise, a mask
with padding) keep transformers' loop.

**GLM-5.3-Flash** (``Glm5NextTextIndexer``): transformers drops the key pools that no row completes with a boolean
index (``pool_keys[:, keep]``), whose size the host must read from the device: a wait that made CUDA graph capture
fail, so every glm5 pass ran eagerly (bench/results/score-vs-llamacpp-2026-12-03b.md).  In the scoring passes
:func:`every_pool` keeps every pool, complete or not, so the shapes follow the input's alone.  A pool no row
completes is never a candidate (its ``pool_valid`` is false), so the selected tokens are the same (a product one
pool wider may round a score differently in the last bit, which can matter only at an exact tie); they come in
another order in ``topk_indices``, which the attention turns into a mask (order-free).
"""
from __future__ import annotations

import math
import sys

import torch

from .attention import in_causal_chunks, in_one_sequence_per_row, replace_method

#: transformers classes :func:`install` replaces the forward of.
INDEXERS = ("Qwen4ExpTextQSAIndexer",)
#: transformers classes :func:`install` replaces the pooling (``get_pooled_states``) of.
POOLING_INDEXERS = ("Glm5NextTextIndexer",)
#: Per-head (query, block) scores computed at once, float32 (128 MiB): queries go in groups that fit (a 2,048-token
#: pass of the bench's Qwen3.8 synthetic, 16 heads x 512 blocks, in one).
SCORE_VALUES = 1 << 25


def causal_selection_mask(indexer, hidden_states: torch.Tensor, position_embeddings: tuple,
                          cache=None) -> torch.Tensor:
    """The indexer's ``[batch, 1, n, kv]`` boolean selection mask for the queries ``hidden_states [batch, n,
    hidden]``, the last n of kv positions, under a plain causal mask (the query at position p sees keys 0..p):
    kv = n, or with ``cache`` (transformers' cache of a chunked pass, updated here as transformers' indexer
    does) the positions cached so far."""
    rotate = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    batch, n, _ = hidden_states.shape
    ratio, dim = indexer.compress_ratio, indexer.index_head_dim
    cos, sin = position_embeddings
    q, own_keys = torch.split(indexer.index_qk_proj(hidden_states),
                              [indexer.index_n_heads * dim, indexer.index_kv_heads * dim], dim=-1)
    q = rotate(indexer.q_layernorm(q.reshape(batch, n, -1, dim)), cos=cos[:, -n:], sin=sin[:, -n:], unsqueeze_dim=2)
    keys = own_keys.reshape(batch, n, dim)              # one key head (the config requires it)
    if cache is not None:
        keys = cache.update_indexer(keys, indexer.layer_idx)
    kv = keys.shape[1]
    blocks = kv // ratio
    device = hidden_states.device
    key_positions = torch.arange(kv, device=device)
    queries = key_positions[kv - n:]                            # the queries' positions
    mask = (key_positions[None, :] <= queries[:, None]).repeat(batch, 1, 1)
    if blocks == 0:
        return mask[:, None]
    starts = torch.arange(blocks, device=device) * ratio
    complete = (queries + 1) // ratio                          # complete blocks each query sees
    keep = min(indexer.block_topk, blocks)
    for b in range(batch):
        pooled = indexer.k_layernorm(keys[b, :blocks * ratio].view(blocks, ratio, dim).float().mean(dim=1)
                                     .to(keys.dtype))
        block_keys = rotate(pooled.unsqueeze(1), cos=cos[b].index_select(0, starts),
                            sin=sin[b].index_select(0, starts)).squeeze(1).float()
        step = max(1, SCORE_VALUES // (q.shape[2] * blocks))
        for first in range(0, n, step):
            rows = slice(first, min(first + step, n))
            scores = torch.matmul(q[b, rows].float(), block_keys.transpose(-1, -2)).transpose(-1, -2)
            scores = torch.relu(scores).sum(dim=-1) / math.sqrt(dim)          # [queries, blocks]
            seen = torch.arange(blocks, device=device)[None, :] < complete[rows, None]
            best = scores.masked_fill(~seen, float("-inf")).topk(keep, dim=-1).indices
            chosen = torch.zeros_like(seen).scatter_(-1, best, True) & seen
            # a query keeps the tokens of its chosen blocks and those past its last complete block
            tokens = chosen.repeat_interleave(ratio, dim=-1)
            tail = key_positions[None, :blocks * ratio] >= (complete[rows, None] * ratio)
            mask[b, rows, :blocks * ratio] &= tokens | tail
    return mask[:, None]


def every_pool(indexer, packed_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``Glm5NextTextIndexer``'s key pools (``packed_states [batch, n, keys | gate scores | valid]``) as its
    ``get_pooled_states`` forms them, every pool kept: pooled keys ``[batch, pools, dim]``, each pool's token
    indices (-1 where a token is missing or padding) and whether the pool is complete."""
    dim, size = indexer.head_dim, indexer.index_kpool
    keys, gate_scores, valid = packed_states.split([dim, dim, 1], dim=-1)
    valid = valid.squeeze(-1).bool()
    batch, n = valid.shape
    device = valid.device
    pools = -(-n // size)
    # pools start at each row's first real token (left padding shifts them)
    first = torch.where(valid.any(-1), valid.long().argmax(-1), torch.full((batch,), n, device=device))
    indices = first[:, None, None] + torch.arange(pools * size, device=device).view(1, pools, size)
    rows = torch.arange(batch, device=device)[:, None, None]
    inside = indices.clamp(0, n - 1)
    present = valid[rows, inside] & (indices < n)
    logits = gate_scores[rows, inside].float() + indexer.index_kpool_compress_ape.float()[None, None]
    weights = torch.nan_to_num(logits.masked_fill(~present[..., None], float("-inf")).softmax(dim=2))
    pooled = (weights.to(keys.dtype) * keys[rows, inside]).sum(dim=2)
    return pooled, indices.masked_fill(~present, -1), present.all(-1)


def install(model) -> None:
    """Give each indexer of ``model`` its scoring-pass form: the all-queries selection (:data:`INDEXERS`) for plain
    causal passes, every pool kept (:data:`POOLING_INDEXERS`) inside :func:`.attention.one_sequence_per_row`."""
    for module in model.modules():
        if type(module).__name__ in INDEXERS:
            replace_method(module, "forward", _causal_or_loop)
        elif type(module).__name__ in POOLING_INDEXERS:
            replace_method(module, "get_pooled_states", _every_pool_or_theirs)


def _every_pool_or_theirs(indexer, theirs, packed_states):
    return every_pool(indexer, packed_states) if in_one_sequence_per_row() else theirs(packed_states)


def _causal_or_loop(indexer, loop, hidden_states, position_embeddings, attention_mask, past_key_values=None):
    n = hidden_states.shape[1]
    plain = attention_mask is not None and attention_mask.dtype == torch.bool
    if (past_key_values is None and in_one_sequence_per_row() and plain
            and tuple(attention_mask.shape[-2:]) == (n, n)):
        return causal_selection_mask(indexer, hidden_states, position_embeddings)
    if past_key_values is not None and in_causal_chunks() and plain:
        mask = causal_selection_mask(indexer, hidden_states, position_embeddings, past_key_values)
        if mask.shape[-2:] != attention_mask.shape[-2:]:
            raise RuntimeError(f"a {tuple(attention_mask.shape)} attention mask for a {tuple(mask.shape)} "
                               f"selection")
        return mask
    return loop(hidden_states, position_embeddings, attention_mask, past_key_values)
