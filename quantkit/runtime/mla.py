"""Multi-head latent attention as llama.cpp runs it: ``attn_k_b`` absorbed into the query, ``attn_v_b`` applied to
the attention output (llama.cpp's ``deepseek2`` graph when the file has both tensors).

transformers expands the latent into per-head keys and values (``kv_b_proj``), then attends; llama.cpp attends in
the latent space (one key/value head: the normalized latent, with the shared rotary key) and multiplies each head's
query by its ``attn_k_b`` matrix first and its output by ``attn_v_b`` after.  In exact arithmetic the two are equal;
with ggml's activation rounding (:mod:`.ggml_arithmetic`) they differ, because the rounded operands differ (the
per-head no-position query and the per-head latent output, not the latent itself).  :func:`absorbed_forward`
replaces the attention module's forward while :func:`~.ggml_arithmetic.ggml_activations` is active.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .ggml_arithmetic import activation_type, engine, ggml_product, round_activations, weight_activation_type


#: transformers MLA classes whose forward :func:`absorbed_forward` reproduces (others keep their own forward).
LATENT_ATTENTIONS = ("DeepseekV3Attention", "Glm5NextTextAttention")
#: Of those, the nope-only sparse ones (GLM-5.3-Flash: the indexer's selection as the mask; llama.cpp's
#: ``glm5-next`` graph), whose forward :func:`sparse_absorbed_forward` reproduces.
SPARSE_LATENT_ATTENTIONS = ("Glm5NextTextAttention",)


def is_latent_attention(module) -> bool:
    """An MLA module :func:`absorbed_forward` can stand in for."""
    return type(module).__name__ in LATENT_ATTENTIONS


def _absorbed_parts(weight) -> tuple[str, str] | None:
    """The GGUF names of ``kv_b_proj``'s ``attn_k_b`` and ``attn_v_b`` tensors, when it is packed from both."""
    from .packed import PackedTensor

    if not isinstance(weight, PackedTensor):
        return None
    by_suffix = {name.rsplit(".", 2)[-2]: name for name in weight.plan.gguf_names}
    if {"attn_k_b", "attn_v_b"} - set(by_suffix):
        return None
    return by_suffix["attn_k_b"], by_suffix["attn_v_b"]


def _logf(x) -> np.float32:
    """C's ``logf``, taken as correctly rounded (glibc's is, on the values used here)."""
    return np.float32(math.log(float(x)))


def llama_kq_scale(config, head_dim: int) -> float:
    """llama.cpp's float32 ``kq_scale`` for its ``deepseek2`` graph: ``mscale² / sqrtf(head_dim)`` with YaRN's
    ``mscale`` computed as llama-context.cpp and deepseek2.cpp compute it (``yarn_attn_factor`` first divided by
    ``1 + 0.1 ln(factor)``, then multiplied back), in float32: an ulp from ``float32(transformers' scaling)``,
    which moves the softmax."""
    f32, one = np.float32, np.float32(1.0)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    attn_factor, freq_scale, log_mul = one, one, f32(0.0)
    if rope.get("rope_type", rope.get("type")) == "yarn":
        freq_scale = one / f32(rope["factor"])
        factor = one / freq_scale
        if rope.get("mscale_all_dim"):      # the GGUF holds 0.1 * mscale_all_dim; llama.cpp divides by 0.1f
            log_mul = f32(0.1 * rope["mscale_all_dim"]) / f32(0.1)
        # get_mscale(factor, m) / get_mscale(factor, mscale_all_dim) with m = mscale_all_dim for deepseek2: 1
        attn_factor = one if log_mul != 0 else (f32(0.1) * _logf(factor) + one if factor > one else one)
        attn_factor = attn_factor * (one / (one + f32(0.1) * _logf(factor)))
    original = attn_factor * (one + f32(0.1) * _logf(one / freq_scale))
    mscale = original * (one + f32(0.1) * log_mul * _logf(one / freq_scale))
    return float(one * mscale * mscale / np.sqrt(f32(head_dim)))


def _engine_attention(ggml, store, parts, q_nope, q_rot, latent, k_rot, mask, scale):
    """Latent attention with every product and the softmax in libggml-cpu (llama.cpp's graph with an F32 KV cache,
    no flash attention): ``q_nope [b, heads, s, nope]``, ``q_rot [b, heads, s, rope]``, ``latent [b, 1, t, rank]``,
    ``k_rot [b, 1, t, rope]``, ``mask [b, s, t]`` (0 or -inf); the heads' outputs ``[b, heads, s, v]``."""
    from ..formats.registry import GGMLType

    key_name, value_name = parts
    outputs = []
    for b in range(q_nope.shape[0]):
        heads = range(q_nope.shape[1])
        q_latent = torch.stack([ggml_product(ggml, key_name, store, q_nope[b, h], h, expert=False) for h in heads])
        query = torch.cat((q_latent, q_rot[b]), dim=-1).float().numpy()               # [heads, s, rank + rope]
        key = np.ascontiguousarray(torch.cat((latent[b, 0], k_rot[b, 0]), dim=-1).float().numpy())
        scores = np.stack([ggml.mul_mat(GGMLType.F32, key.view(np.uint8), key.shape[0], query[h]) for h in heads])
        weights = ggml.soft_max(scores, mask[b], scale)
        values = np.ascontiguousarray(latent[b, 0].float().numpy().T)                 # [rank, t]
        out_latent = [torch.from_numpy(ggml.mul_mat(GGMLType.F32, values.view(np.uint8), values.shape[0],
                                                    weights[h])) for h in heads]
        outputs.append(torch.stack([ggml_product(ggml, value_name, store, out_latent[h], h, expert=False)
                                    for h in heads]))
    return torch.stack(outputs).to(q_nope.dtype)


def _part_activation_types(weight) -> tuple[str, str]:
    """Activation types of ``kv_b_proj``'s key half (``attn_k_b``) and value half (``attn_v_b``)."""
    from .packed import PackedTensor

    if not isinstance(weight, PackedTensor):
        kind = weight_activation_type(weight) or "F32"
        return kind, kind
    tensors = weight.assembler.store.weights.tensors
    by_suffix = {name.rsplit(".", 2)[-2]: activation_type(tensors[name].qtype) for name in weight.plan.gguf_names}
    whole = by_suffix.get("attn_kv_b")
    return by_suffix.get("attn_k_b", whole), by_suffix.get("attn_v_b", whole)


def sparse_absorbed_forward(module):
    """A forward for a GLM-5.3-Flash attention module (:data:`SPARSE_LATENT_ATTENTIONS`) that attends in the latent
    space as llama.cpp's ``glm5-next`` graph does (``build_dsa_layer``, no flash attention): each head's query
    through its ``attn_k_b`` matrix, scores against the normalized latent, ggml's softmax with the indexer's
    selection (its own or the previous full layer's) as the mask and ``kq_scale = 1/sqrtf(qk_head_dim)``, the
    latent output through ``attn_v_b``.  transformers expands the latent into per-head keys and values instead:
    with ggml's activation rounding that moves the attention output by ~1e-4, enough to flip a near-tie in a later
    layer's expert routing (the tiny GLM-5.3's F16 file: 0.51 nat at one token against llama.cpp).  Without
    libggml, or without both ``attn_k_b`` and ``attn_v_b``, transformers' forward runs."""
    theirs = type(module).forward.__get__(module)
    parts = _absorbed_parts(module.kv_b_proj.weight)
    kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(module.qk_head_dim)))        # 1.0f / sqrtf(n_embd_head_k)
    heads, v_dim, rank = module.num_heads, module.v_head_dim, module.kv_lora_rank

    def forward(hidden_states, attention_mask, past_key_values=None, prev_topk_indices=None, **kwargs):
        ggml = engine()
        if ggml is None or parts is None or module.qk_rope_head_dim:
            return theirs(hidden_states, attention_mask, past_key_values=past_key_values,
                          prev_topk_indices=prev_topk_indices, **kwargs)
        batch, length = hidden_states.shape[:-1]
        q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
        q_nope = module.q_b_proj(q_resid).view(batch, length, heads, module.qk_head_dim).transpose(1, 2)
        compressed = module.kv_a_proj_with_mqa(hidden_states)
        latent = module.kv_a_layernorm(compressed[..., :rank]).view(batch, 1, length, rank)
        k_rot = compressed[..., rank:].reshape(batch, 1, length, 0)
        if past_key_values is not None:
            latent, k_rot = past_key_values.update(latent, k_rot, module.layer_idx)
        if module.indexer is not None:
            topk_indices = module.indexer(hidden_states=hidden_states, q_resid=q_resid,
                                          attention_mask=attention_mask, past_key_values=past_key_values)
        elif prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        else:
            topk_indices = prev_topk_indices
        # [batch, 1, length, keys]: boolean (visible) for sdpa, additive (0 / large negative) for eager
        visible = module.build_attention_mask_from_topk(topk_indices, q_nope, latent.shape[-2])[:, 0]
        blocked = ~visible if visible.dtype == torch.bool else visible < 0
        mask = np.where(blocked.cpu().numpy(), np.float32(-np.inf), np.float32(0.0)).astype(np.float32)
        out = _engine_attention(ggml, module.kv_b_proj.weight.assembler.store, parts, q_nope, q_nope[..., :0],
                                latent, k_rot, mask, kq_scale)
        out = out.transpose(1, 2).reshape(batch, length, heads * v_dim)
        return module.o_proj(out), None, topk_indices if module.next_skip_topk else None

    return forward


def absorbed_forward(module):
    """A forward for ``module`` (see :func:`is_latent_attention`) that attends in the latent space."""
    if type(module).__name__ in SPARSE_LATENT_ATTENTIONS:
        return sparse_absorbed_forward(module)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, \
        apply_rotary_pos_emb_interleave

    key_kind, value_kind = _part_activation_types(module.kv_b_proj.weight)
    parts = _absorbed_parts(module.kv_b_proj.weight)
    kq_scale = llama_kq_scale(module.config, module.qk_head_dim)
    heads, nope, v_dim, rank = module.num_heads, module.qk_nope_head_dim, module.v_head_dim, module.kv_lora_rank

    def forward(hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        batch, length = hidden_states.shape[:-1]
        if module.q_lora_rank is None:
            q = module.q_proj(hidden_states)
        else:
            q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
        q = q.view(batch, length, heads, module.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [nope, module.qk_rope_head_dim], dim=-1)
        compressed = module.kv_a_proj_with_mqa(hidden_states)
        latent, k_rot = torch.split(compressed, [rank, module.qk_rope_head_dim], dim=-1)
        latent = module.kv_a_layernorm(latent).view(batch, 1, length, rank)
        k_rot = k_rot.view(batch, 1, length, module.qk_rope_head_dim)
        cos, sin = position_embeddings
        rotate = apply_rotary_pos_emb_interleave if module.config.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        if past_key_values is not None:
            latent, k_rot = past_key_values.update(latent, k_rot, module.layer_idx)

        ggml = engine()
        if ggml is not None and parts is not None:
            keys = latent.shape[-2]
            if attention_mask is not None:      # [batch, 1, length, keys]: additive (0 / large negative) or boolean
                window = attention_mask[:, 0, :, :keys]
                blocked = ~window if window.dtype == torch.bool else window < 0
            else:
                blocked = torch.ones(length, keys, dtype=torch.bool).triu(keys - length + 1)
            blocked = blocked.expand(batch, length, keys).cpu().numpy()
            mask = np.where(blocked, np.float32(-np.inf), np.float32(0.0)).astype(np.float32)
            out = _engine_attention(ggml, module.kv_b_proj.weight.assembler.store, parts, q_nope, q_rot, latent,
                                    k_rot, mask, kq_scale)
            out = out.transpose(1, 2).reshape(batch, length, heads * v_dim)
            return module.o_proj(out), None

        kv_b = module.kv_b_proj.weight.float().view(heads, nope + v_dim, rank)
        # [batch, heads, length, nope] x [heads, nope, rank]: each head's query in the latent space (attn_k_b)
        q_latent = torch.einsum("bhsn,hnr->bhsr", round_activations(q_nope, key_kind), kv_b[:, :nope])
        query = torch.cat((q_latent, q_rot), dim=-1)
        key = torch.cat((latent, k_rot), dim=-1)
        scores = torch.matmul(query, key.transpose(2, 3)) * module.scaling
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, : key.shape[-2]]
        elif length > 1:        # no mask given: causal over this call's positions (the last `length` keys)
            offset = key.shape[-2] - length
            future = torch.ones(length, key.shape[-2], dtype=torch.bool, device=scores.device).triu(offset + 1)
            scores = scores.masked_fill(future, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out_latent = torch.matmul(weights, latent)                     # [batch, heads, length, rank]
        # each head's latent output through its attn_v_b matrix [v, rank]
        out = torch.einsum("bhsr,hvr->bhsv", round_activations(out_latent, value_kind), kv_b[:, nope:])
        out = out.transpose(1, 2).reshape(batch, length, heads * v_dim)
        return module.o_proj(out), weights

    return forward
