"""Routed experts as grouped products: tokens sorted by expert, every active expert of a layer in one product.

transformers' eager experts loop over the experts in Python, one expert's weights decoded and two small products
per routed expert; on CUDA that is thousands of launches per forward pass and the reason the runtime scored at a
few percent of llama.cpp's speed.  :func:`grouped_experts_forward` (registered with transformers' experts
interface as :data:`GROUPED`) instead:

1. sorts the (token, expert) pairs by expert and counts the tokens of each expert;
2. in float32 (:data:`.packed.FUSED_DTYPES`), where every GGUF tensor of the projections is resident on the
   device in a type the fused kernels read (:data:`quantkit.kernels.triton_matmul.FUSED_TYPES`: Q8_0, Q4_K,
   Q2_K, IQ2_XXS, MXFP4, NVFP4, BF16, F32) and holds whole rows of them, multiplies the sorted rows by the
   packed weights in one launch per GGUF tensor over all active experts
   (:func:`quantkit.kernels.triton_matmul.grouped_linear`): the weights are decoded in registers by the
   bit-exact Triton decoders, nothing decoded reaches global memory; the sort, counts and tile table come from
   one routing kernel, and the products read each token and write each weighted result where they are
   (:func:`_fused_forward`: no gathered or un-sorted copies);
3. otherwise decodes each stacked expert tensor of the layer whole (one Triton launch per GGUF tensor, float32)
   into a transient tensor of the compute dtype (:meth:`.packed.PackedTensor.materialize`) and multiplies every
   expert's tokens in one grouped product: ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` in older
   torch) for bfloat16 on CUDA, otherwise one batched product over the experts' rows padded to the busiest
   expert's count (:func:`grouped_linear`), exact float32 products as the eager loop computes them, only summed
   in another order.

On the decoded path (3) weights are materialized in global memory, one layer's experts at a time (about
``4 x experts x rows x cols`` bytes in float32); a projection whose decoded experts would exceed
:data:`MAX_DECODED_BYTES` (a 671B model's layer: 256 experts of 7168 x 2048, 15-30 GB per projection in float32)
runs the eager loop instead, so memory stays bounded by one expert, and so do few tokens (fewer (token, expert)
pairs than experts: decoding with a KV cache), where the eager loop decodes only the routed experts.  The fused
path (2) reads only the packed bytes, so it runs for any size and any number of tokens.  Experts with biases, a
post-expert norm, interleaved gate/up rows, transposed weights or expert parallelism run the eager loop.

On the CPU (float32 arithmetic) :func:`sorted_experts_forward` (:data:`SORTED`) runs the eager loop's products, one
routed expert's weights at a time (so a model larger than memory still streams), over rows sorted by expert once:
no one-hot mask, per-expert searches or index_add_, ~6% of a 4 x 512-token pass of the example GGUF
(bench/results/score-cpu-vs-llamacpp-2026-12-03.md), and in float32 the eager loop's arithmetic bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: The name the runtime registers :func:`grouped_experts_forward` under in transformers' experts interface.
GROUPED = "quantkit_grouped"
#: The name :func:`sorted_experts_forward` is registered under.
SORTED = "quantkit_sorted"
#: The most bytes one projection's decoded experts (all of them, in the compute dtype) may take for the grouped
#: path; larger layers run the eager loop.
MAX_DECODED_BYTES = 4 << 30
#: Values of ``load_model(experts=)``: ``auto`` is grouped on CUDA and sorted on the CPU with float32 arithmetic,
#: eager otherwise (``ggml-cpu`` arithmetic).
EXPERTS_MODES = ("auto", "grouped", "sorted", "eager")


def _grouped_mm():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                   transposed: bool = False) -> torch.Tensor:
    """``x[i] @ weight[experts[i]].T`` for every row ``i`` of ``x`` (rows sorted by expert; ``counts[e]`` rows
    per expert), in one product.  ``weight``: ``[experts, out, in]``, or ``[experts, in, out]`` if ``transposed``.
    """
    mat_b = weight if transposed else weight.transpose(-2, -1)         # [experts, in, out]
    grouped = _grouped_mm()
    if grouped is not None and x.is_cuda and x.dtype == torch.bfloat16:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return grouped(x, mat_b, offs=offsets)
    # one batched product over [experts, busiest, in]: an expert's rows padded with zeros to the busiest count
    busiest = int(counts.max())      # the one wait for the device per product
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[experts]
    padded = x.new_zeros(weight.shape[0], busiest, x.shape[1])
    padded[experts, slot] = x
    return torch.bmm(padded, mat_b)[experts, slot]


def _fusable(weight) -> bool:
    """Whether ``weight`` is a packed weight the fused products multiply without decoding it."""
    fused = getattr(weight, "fused", None)
    return fused is not None and fused() is not None


def _fused_forward(module, up, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """Path 2 of the module doc: the pairs sorted and tiled by one routing kernel
    (:func:`~quantkit.kernels.triton_matmul.route`); the gate/up product reads each sorted row's token where it
    is, the down product writes each row, times its routing weight, to its (token, slot) place; one sum over the
    slots.  The same products, weights and sum as gathering, multiplying and un-sorting with torch (path 3's
    steps), without their copies."""
    from ..kernels.triton_matmul import Routed, route

    tokens, top_k = top_k_index.shape
    order, counts, tiles = route(top_k_index.reshape(-1).contiguous(), module.num_experts)
    h = up.fused_linear(hidden_states, counts, tiles, Routed(gather=order, gather_div=top_k))
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    weights = top_k_weights.reshape(-1).to(torch.float32).contiguous()
    out = module.down_proj.fused_linear(h, counts, tiles, Routed(scatter=order, weights=weights))
    return out.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _unpacked(weight: torch.Tensor) -> torch.Tensor:
    """A packed weight decoded whole (all experts, into a fresh transient tensor); any other tensor as itself."""
    materialize = getattr(weight, "materialize", None)
    return materialize() if materialize is not None else weight


def _decoded_bytes(module) -> int:
    """Bytes of the largest projection's weights decoded whole (shape queries decode nothing)."""
    up = module.gate_up_proj if module.has_gate else module.up_proj
    return max(w.numel() * w.element_size() for w in (up, module.down_proj))


def _eager(module):
    """The experts class's own (eager) forward, which transformers' experts decorator wraps."""
    return type(module).forward.__wrapped__


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's forward as grouped products (see the module doc)."""
    # the attributes are set by transformers' experts decorator, the only caller
    up = self.gate_up_proj if self.has_gate else self.up_proj
    fused = (not self.is_transposed and _fusable(up) and _fusable(self.down_proj)
             and hidden_states.dtype == up.dtype == self.down_proj.dtype)
    if (self.has_bias or self.has_post_expert_norm or not self.is_concatenated or self._is_expert_parallel
            or (not fused and (top_k_index.numel() < self.num_experts or _decoded_bytes(self) > MAX_DECODED_BYTES))):
        return _eager(self)(self, hidden_states, top_k_index, top_k_weights)
    if fused:
        return _fused_forward(self, up, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    experts = pairs[order]
    # bincount on CUDA waits for the device (it reads the largest id); a scatter of ones does not
    counts = torch.zeros(self.num_experts, dtype=torch.int64, device=pairs.device).index_add_(
        0, pairs, torch.ones_like(pairs, dtype=torch.int64))
    x = hidden_states[order // top_k]
    transposed = self.is_transposed
    h = grouped_linear(x, _unpacked(up), experts, counts, transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = grouped_linear(h, _unpacked(self.down_proj), experts, counts, transposed)
    out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def sorted_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's forward as the eager loop's per-expert products over rows sorted by expert
    (see the module doc): each expert's rows, in the eager loop's order, multiplied by its weights and scaled by
    their routing weights, and each token's results summed in expert order: in float32, the eager loop's
    arithmetic."""
    if self.has_bias or self.has_post_expert_norm or not self.is_concatenated or self._is_expert_parallel \
            or self.is_transposed:
        return _eager(self)(self, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    # pair k * tokens + t (slot-major); stable: an expert's rows in the eager loop's order (slot, then token), so
    # its product is the eager loop's product, row for row
    pairs = top_k_index.t().reshape(-1)
    order = torch.argsort(pairs, stable=True)
    counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
    x = hidden_states.index_select(0, order % tokens)
    weights = top_k_weights.t().reshape(-1).index_select(0, order)[:, None]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    out = torch.empty(pairs.numel(), hidden_states.shape[-1], device=hidden_states.device,
                      dtype=torch.promote_types(hidden_states.dtype, weights.dtype))
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            h = F.linear(x[rows], up[expert])
            h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
            # the routing weight scales each row while it is in cache, not in a pass of its own
            torch.mul(F.linear(h, self.down_proj[expert]), weights[rows], out=out[rows])
            start += n
    # each token's rows, ascending (so in expert order, the eager loop's order of summation), summed in one pass
    # (embedding_bag: 4x faster here than a gather and a sum, and than index_add_)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    bags = position.view(top_k, tokens).t().sort(dim=1).values
    return F.embedding_bag(bags, out, mode="sum").to(hidden_states.dtype)


def register() -> None:
    """Make :data:`GROUPED` and :data:`SORTED` valid ``experts_implementation`` values of transformers
    (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(GROUPED, grouped_experts_forward)
    ExpertsInterface.register(SORTED, sorted_experts_forward)
