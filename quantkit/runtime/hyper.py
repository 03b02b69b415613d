"""Hyper-connections (DeepSeek V4, GLM-5.3-Flash) and DeepSeek V4's grouped output projection on CUDA in float32.

transformers' hyper-connection code is a chain of small eager operations on ``[tokens, 4, 4]`` and
``[tokens, 4, hidden]`` tensors; :mod:`quantkit.kernels.triton_hyper` computes a hyper-connection's weights and
collapsed input in one launch after its map, and DeepSeek V4's mix of the streams after each block in one more.
GLM-5.3's decoder layer mixes the streams in its own long forward, which stays transformers'.

DeepSeek V4's ``o_a_proj`` (``DeepseekV4GroupedLinear``) multiplies each group of heads by its own rows of the
weight through ``torch.bmm`` of the decoded weight, in float32 without tensor cores; here each group is one fused
packed product (:meth:`~quantkit.runtime.packed.PackedTensor.fused_linear_rows`).

Installed by the loader on a float32 CUDA model only; anything the kernels do not take runs transformers' code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import replace_method
from .packed import PackedTensor

#: transformers hyper-connection classes whose forward :func:`install` replaces (the same code in both).
HYPER_CONNECTIONS = ("DeepseekV4HyperConnection", "Glm5NextTextHyperConnection")
#: Decoder layers whose stream mix :func:`install` replaces (their forward is the two blocks and two mixes).
MIXING_LAYERS = ("DeepseekV4DecoderLayer",)
GROUPED_OUTPUTS = ("DeepseekV4GroupedLinear",)


def install(model) -> None:
    for module in model.modules():
        kind = type(module).__name__
        if kind in HYPER_CONNECTIONS:
            replace_method(module, "forward", hyper_connection)
        elif kind in MIXING_LAYERS:
            replace_method(module, "forward", mixing_layer)
        elif kind in GROUPED_OUTPUTS:
            replace_method(module, "forward", grouped_output)


def hyper_connection(module, theirs, hidden_streams: torch.Tensor):
    """``(post, comb, collapsed)`` of a hyper-connection module for the streams ``[batch, n, N, hidden]``."""
    if not hidden_streams.is_cuda:
        return theirs(hidden_streams)
    from ..kernels import triton_hyper     # Triton comes with CUDA builds of torch only

    base, scale = module.base, module.scale
    if not (triton_hyper.fits(hidden_streams) and hidden_streams.dim() == 4
            and all(not isinstance(p, PackedTensor) and p.dtype == torch.float32 for p in (base, scale))):
        return theirs(hidden_streams)
    batch, length, n, d = hidden_streams.shape
    raw = F.linear(hidden_streams.view(batch, length, n * d), module.fn)
    return triton_hyper.hyper_weights(hidden_streams, raw, base, scale, module.input_norm.eps, module.hc_eps,
                                      module.hc_sinkhorn_iters)


def mix(h: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block, as transformers' DeepSeek V4 decoder layer mixes them."""
    if h.is_cuda:
        from ..kernels import triton_hyper

        if triton_hyper.fits(h) and block_out.dtype == post.dtype == comb.dtype == h.dtype:
            return triton_hyper.hyper_mix(h, block_out, post, comb)
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


def mixing_layer(layer, theirs, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None, **kwargs):
    """transformers' DeepSeek V4 decoder layer, its two mixes by :func:`mix`."""
    post, comb, collapsed = layer.attn_hc(hidden_states)
    attn_output, _ = layer.self_attn(layer.input_layernorm(collapsed), **kwargs)
    hidden_states = mix(hidden_states, attn_output, post, comb)
    post, comb, collapsed = layer.ffn_hc(hidden_states)
    mlp_output = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=input_ids)
    return mix(hidden_states, mlp_output, post, comb)


def grouped_output(module, theirs, x: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4GroupedLinear``: group ``g`` of ``x [..., groups, k]`` times rows ``g`` of the weight, each a
    fused packed product into its columns of the output ``[..., groups, rows]``."""
    weight, groups = module.weight, module.n_groups
    # a function mode (ggml-cpu arithmetic) must see the product: transformers' bmm
    if (not isinstance(weight, PackedTensor) or x.dtype != weight.dtype or not x.is_cuda
            or torch._C._is_torch_function_mode_enabled()):
        return theirs(x)
    *lead, _, k = x.shape
    rows = weight.shape[0] // groups
    by_group = x.reshape(-1, groups, k)
    out = torch.empty(by_group.shape[0], groups * rows, dtype=x.dtype, device=x.device)
    for g in range(groups):
        if weight.fused_linear_rows(by_group[:, g], g * rows, rows, out=out, out_col=g * rows) is None:
            return theirs(x)
    return out.view(*lead, groups, rows)
