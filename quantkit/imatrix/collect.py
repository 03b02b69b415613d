"""Collect an importance matrix by running the source model in transformers, as ``llama-imatrix`` does in llama.cpp.

The model is transformers' own, built by the runtime (:func:`quantkit.runtime.load_model`) from the checkpoint:
matrices are :class:`~quantkit.runtime.packed.PackedTensor` weights assembled from the checkpoint per use through a
bounded cache (:class:`quantkit.runtime.weights.CheckpointWeights`), so a model larger than memory streams its
layers.

What is accumulated: for every weight that maps (through the architecture maps) to a GGUF tensor named ``blk.*``
(and ``output.weight`` with ``process_output``), Σx² over every input vector ``x`` the weight is multiplied with,
and how many vectors that was; for stacked routed experts, per expert and only over the tokens routed to it.

How: the model runs with transformers' eager experts implementation and SDPA or eager attention (routed experts of
transformers' standard layout through :func:`grouped_experts_forward`, the eager computation grouped), under a
``torch.overrides.TorchFunctionMode`` that sees every ``F.linear`` / ``bmm`` / ``matmul`` call.  A call whose
second operand is (a view of) a model parameter is attributed to that parameter, and for a stacked expert
parameter ``[E, out, in]`` the view's storage offset tells which expert (``gate_up_proj[e]`` in the eager expert
loop).  A packed weight has no storage: it is recognized by identity, and the fresh tensors it answers a cast, a
view or ``weight[e]`` with are aliased to it (and to expert ``e``).  This needs no per-architecture hook for linear
layers, experts or grouped projections (DeepSeek V4's ``o_a_proj`` multiplies each group's heads through ``bmm``;
its GGUF tensor ``attn_output_a`` is one 2-D matrix, so its entry has one row-length-sized vector summed over
groups, the size llama-quantize checks for; llama-imatrix instead writes ``o_groups`` times that length, which
llama-quantize refuses and :meth:`~quantkit.imatrix.model.Imatrix.conform` folds into this form).

Inputs the source model never forms: MLA's ``kv_b_proj`` becomes GGUF ``attn_k_b`` (multiplying each head's
``q_nope``) and ``attn_v_b`` (multiplying each head's attention-weighted latent) in llama.cpp's absorbed
attention.  A forward hook on those attention modules (DeepSeek V3, GLM-5) forms both from ``q_b_proj``'s output,
``kv_b_proj``'s input (the normalized latent) and the eager attention weights, one matrix per head.

``all_experts``: every routed-expert module first runs with every token routed to every expert (weights zero,
output discarded) to record statistics, then once more with the real routing and recording muted, so the
model's output, and every later layer's input, is unchanged.

Chunks follow llama-imatrix: the text is tokenized once (with the tokenizer's BOS when it adds one), cut into
``ctx``-token chunks, and the first token of each chunk is replaced by BOS when the tokenizer adds one.  Each chunk
runs as its own sequence; as llama-imatrix with ``-b`` larger than ``-c``, ``batch // ctx`` chunks run in one
forward pass (a batch of sequences: larger products, a fraction of the per-operation cost), and their sums are one
step of the accumulation.  The grouping changes the order of float64 additions, so it is part of the inputs'
identity (a resume state, and Ray workers, keep the same groups).  Differences from llama-imatrix: matrix products with fewer than 16 rows are recorded
too (llama-imatrix skips them), and sums accumulate in float64.

Memory: the accumulators (one float64 row per column per matrix), one chunk's activations, the cache of
assembled weights (``max_memory`` bytes, default half the available memory) and the weight being used.  Without
``max_memory``, weights decoded for one chunk are also kept for the next (up to
:data:`quantkit.resources.KEEP_FRACTION` of the available memory: each weight is decoded once per run, not once per
chunk; the assembled payloads' cache has its own half, see :mod:`quantkit.runtime.weights`); with it, nothing
decoded is kept, so ``max_memory`` bounds what stays in memory.  With ``max_memory`` on CUDA, weights are also streamed to the device
per use rather than all placed there.

Resume: after the forward pass that completes each further ``save_every`` chunks, the accumulators go to ``<out>.resume.gguf`` (an imatrix GGUF recording the
chunks done and the inputs' identity); a later run with the same inputs continues from there.

Provenance: the checkpoint's identity, ``source_digest`` and ``source_files``
(:func:`~quantkit.imatrix.provenance.source_provenance`), from the SHA-256 of the files convert records
(:func:`quantkit.convert.source.provenance_files`), hashed in a background thread while the model loads and
runs (a Hugging Face cache's blob names are their SHA-256: those files are not read for it).
"""
from __future__ import annotations

import functools
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import __version__
from ..arch import ArchMap, get_arch
from ..convert.source import Hashing, ResolvedSource, file_stats, provenance_files
from ..errors import SourceError, UnsupportedError, ValidationError
from ..io.atomic import input_files, sha256_file
from ..io.checkpoint import open_checkpoint
from ..io.gguf_writer import PARTIAL_SUFFIX
from .formats import imatrix_output, load_imatrix, save_imatrix
from .model import Entry, Imatrix, make_imatrix
from .names import OUTPUT_HEAD, column_map
from .provenance import EXAMPLE_MARKER, source_provenance
from ..io import jsontext

DEFAULT_CTX = 512
#: Tokens per forward pass (llama-imatrix's ``-b`` default): ``batch // ctx`` chunks run together.
DEFAULT_BATCH = 2048
DEFAULT_SAVE_EVERY = 10
#: Largest calibration text read (bytes); a larger one is cut into several runs and merged.
MAX_TEXT_BYTES = 1 << 30
RESUME_SUFFIX = ".resume.gguf"
#: Provenance fields a resume state must share with the run that continues it.
RESUME_IDENTITY = ("source_files", "text_sha256", "ctx", "chunks_per_pass", "all_experts", "process_output", "dtype")
MLA_STEPS = ("kv_b_k", "kv_b_v")
ROUTED_CLASSES = frozenset({"routed_gate", "routed_up", "routed_down"})
DTYPES = ("float32", "bfloat16", "float16")
#: Hidden-state values of one forward pass (tokens x hidden size) per torch thread of the default thread count
#: (:attr:`CollectOptions.threads`).
VALUES_PER_THREAD = 1 << 18
#: ``torch.Tensor`` methods whose result is still the weight they are called on, for the product it feeds:
#: casts (any weight), and views of a packed weight (a fresh tensor holding the same values).
CAST_METHODS = ("float", "to", "type", "contiguous")
PACKED_VIEW_METHODS = ("t", "transpose", "permute", "view", "reshape", "unflatten")
#: ``torch.Tensor`` methods selecting one expert's matrix of a stacked packed weight (``weight[e]``).
PACKED_SELECT_METHODS = ("__getitem__", "select")


# -- accumulators -------------------------------------------------------------------------------------------------

class Accumulators:
    """float64 Σx² ``[n_mat, n]`` and counts ``[n_mat]`` per GGUF tensor, created on first use (as llama-imatrix
    creates an entry at the first product it sees).

    Products add into the current forward pass's sums; :meth:`fold` then adds a pass's sums to the totals, pass
    after pass.  That order of additions (within a pass, then pass by pass) is the same whether every pass runs in
    this process or passes run in other processes whose sums are folded here in order
    (:mod:`quantkit.imatrix.raycollect`), so both give the same bits."""

    def __init__(self, device):
        self.device = device
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, Any] = {}
        self._chunk: dict[str, tuple[Any, Any]] = {}

    def _slot(self, name: str, n_mat: int, n: int):
        import torch

        if name not in self._chunk:
            self._chunk[name] = (torch.zeros((n_mat, n), dtype=torch.float64, device=self.device),
                                 torch.zeros(n_mat, dtype=torch.float64, device=self.device))
        sums = self._chunk[name][0]
        earlier = self.sums.get(name)
        if sums.shape != (n_mat, n) or (earlier is not None and earlier.shape != (n_mat, n)):
            found = tuple(sums.shape) if sums.shape != (n_mat, n) else tuple(earlier.shape)
            raise SourceError(f"inputs of {n_mat} x {n} values, earlier {found}: the model multiplies "
                              f"this weight in two different ways", tensor=name)
        return self._chunk[name]

    def add(self, name: str, n_mat: int, mat: int | None, sq_sum, rows: int) -> None:
        """Add one product's Σx² (``[n]``, or ``[n_mat, n]`` with ``mat`` None: every matrix saw ``rows``)."""
        sums, counts = self._slot(name, n_mat, int(sq_sum.shape[-1]))
        if mat is None:
            sums += sq_sum
            counts += rows
        else:
            sums[mat] += sq_sum
            counts[mat] += rows

    def take_chunk(self) -> dict[str, tuple[Any, Any]]:
        """The current pass's (sums, counts) per tensor; the next product starts a new pass."""
        chunk, self._chunk = self._chunk, {}
        return chunk

    def fold(self, chunk: dict[str, tuple[Any, Any]]) -> None:
        """Add one pass's sums and counts (tensors or arrays) to the totals, in name order."""
        import torch

        for name in sorted(chunk):
            sums, counts = (v.to(self.device) if isinstance(v, torch.Tensor)
                            else torch.from_numpy(np.array(v, np.float64)).to(self.device) for v in chunk[name])
            if name not in self.sums:
                self.sums[name] = torch.zeros_like(sums)
                self.counts[name] = torch.zeros_like(counts)
            if self.sums[name].shape != sums.shape:
                raise SourceError(f"inputs of {tuple(sums.shape)} values, earlier {tuple(self.sums[name].shape)}: "
                                  f"the model multiplies this weight in two different ways", tensor=name)
            self.sums[name] += sums
            self.counts[name] += counts

    def entries(self) -> dict[str, Entry]:
        """The totals as float32 entries (products recorded since the last fold first end their chunk)."""
        if self._chunk:
            self.fold(self.take_chunk())
        out = {}
        for name in sorted(self.sums):
            sums = self.sums[name].cpu().numpy()
            if not np.isfinite(sums).all():
                raise SourceError("non-finite input activations (the model produced NaN or Inf)", tensor=name)
            out[name] = Entry(sums.astype(np.float32), self.counts[name].cpu().numpy().astype(np.float32))
        return out

    def load(self, imatrix: Imatrix) -> None:
        import torch

        for name, e in imatrix.entries.items():
            self.sums[name] = torch.as_tensor(e.in_sum2, dtype=torch.float64, device=self.device).clone()
            self.counts[name] = torch.as_tensor(e.counts, dtype=torch.float64, device=self.device).clone()


# -- what each parameter feeds --------------------------------------------------------------------------------------

@dataclass
class _Target:
    name: str
    n_mat: int
    mat: int | None
    """The matrix a per-expert parameter fills; None: a stacked parameter's view tells, or a single matrix."""
    order: Any = None
    """Source column of each GGUF column (torch LongTensor), None for the identity."""


@dataclass
class _Param:
    name: str
    param: Any
    targets: list[_Target]
    observers: list[Callable] = field(default_factory=list)
    stacked: bool = False
    unsupported: str | None = None


class _MLA:
    """Statistics of MLA's absorbed ``attn_k_b`` / ``attn_v_b``, formed from one attention module's pieces."""

    def __init__(self, module, k_name: str, v_name: str, acc: Accumulators):
        self.heads = int(module.num_heads)
        self.nope = int(module.qk_nope_head_dim)
        self.qk_head = int(module.qk_head_dim)
        self.rank = int(module.kv_lora_rank)
        self.k_name, self.v_name, self.acc = k_name, v_name, acc
        self.q = self.latent = None

    def on_query(self, x, out) -> None:
        self.q = out.detach()

    def on_latent(self, x, out) -> None:
        self.latent = x.detach()

    def after_attention(self, module, args, output) -> None:
        import torch

        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None or self.q is None or self.latent is None:
            raise UnsupportedError("MLA statistics need the eager attention weights, the query and the latent of "
                                   "the same forward pass", tensor=self.v_name)
        batch, tokens = self.q.shape[:2]
        q_nope = self.q.reshape(batch, tokens, self.heads, self.qk_head)[..., : self.nope].to(torch.float64)
        self.acc.add(self.k_name, self.heads, None, q_nope.square().sum(dim=(0, 1)), batch * tokens)
        latent = self.latent.reshape(batch, -1, self.rank).to(torch.float32)
        v_sums = torch.stack([torch.matmul(weights[:, h].to(torch.float32), latent).to(torch.float64)
                              .square().sum(dim=(0, 1)) for h in range(self.heads)])
        self.acc.add(self.v_name, self.heads, None, v_sums, batch * tokens)
        self.q = self.latent = None


class _Recorder:
    """Attributes matrix products to model parameters (see the module docstring); use :meth:`active`."""

    def __init__(self, params: list[_Param], acc: Accumulators):
        import torch

        from ..runtime.packed import PackedTensor

        # storage data pointer -> parameters in it (several when a loader sliced them out of one buffer)
        self.params: dict[int, list[_Param]] = {}
        # packed weights have no storage: id -> parameter
        self.packed: dict[int, _Param] = {}
        for p in params:
            if isinstance(p.param, PackedTensor):
                self.packed[id(p.param)] = p
            else:
                self.params.setdefault(p.param.untyped_storage().data_ptr(), []).append(p)
        self.acc = acc
        self.casts, self.views, self.selects = (frozenset(getattr(torch.Tensor, m) for m in methods) for methods in
                                                (CAST_METHODS, PACKED_VIEW_METHODS, PACKED_SELECT_METHODS))
        self.mute_experts = False
        self._aliases: dict[int, tuple[weakref.ref, tuple[_Param, int | None]]] = {}
        self._last_input: tuple[weakref.ref, int, Any] | None = None

    def lookup(self, w) -> tuple[_Param, int | None] | None:
        """The parameter (and expert) a tensor is a view of, or None."""
        import torch

        if not isinstance(w, torch.Tensor):
            return None
        alias = self._alias(w)
        if alias is not None:
            return alias
        packed = self._packed(w)
        if packed is not None:
            return None if packed.stacked else (packed, None)
        try:
            candidates = self.params.get(w.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None
        offset = w.storage_offset()
        for p in candidates or ():
            start = p.param.storage_offset()
            if not start <= offset < start + p.param.numel():
                continue
            if not p.stacked:
                return p, None
            expert = (offset - start) // p.param.stride(0)
            return (p, int(expert)) if w.dim() == 2 else None
        return None

    def _alias(self, w) -> tuple[_Param, int | None] | None:
        alias = self._aliases.get(id(w))
        return alias[1] if alias is not None and alias[0]() is w else None

    def _packed(self, w) -> _Param | None:
        p = self.packed.get(id(w))
        return p if p is not None and p.param is w else None

    def derive(self, func, args, out) -> None:
        """Alias a tensor made from a weight to that weight: a cast (``self.fn.float()``), and for a packed weight,
        which answers every operation with a fresh tensor, its views (:data:`PACKED_VIEW_METHODS`, and views of
        those) and one expert's matrix (``gate_up_proj[e]``)."""
        import torch

        if not args or not isinstance(out, torch.Tensor) or out is args[0]:
            return
        hit = None
        if func in self.casts:
            hit = self.lookup(args[0])
        elif func in self.views:
            packed = self._packed(args[0])
            hit = (packed, None) if packed is not None and not packed.stacked else self._alias(args[0])
        elif func in self.selects and len(args) == 2 and out.dim() == 2:
            packed = self._packed(args[0])
            index = args[1]
            if packed is None or not packed.stacked:
                return
            if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
                index = int(index)
            if isinstance(index, int):
                hit = (packed, index % packed.param.shape[0])
        if hit is not None:
            self._aliases[id(out)] = (weakref.ref(out), hit)

    def observe(self, hit: tuple[_Param, int | None], x, out) -> None:
        import torch

        p, expert = hit
        n = p.param.shape[-1]
        if not isinstance(x, torch.Tensor) or x.shape[-1] != n:
            return  # the parameter is not the weight of this product (e.g. used as the left operand)
        if p.unsupported is not None:
            raise UnsupportedError(f"multiplied as a weight, but {p.unsupported}", tensor=p.name)
        for observer in p.observers:
            observer(x, out)
        if not p.targets or (expert is not None and self.mute_experts):
            return
        rows = x.detach().reshape(-1, n)
        if rows.shape[0] == 0:
            return
        sq_sum = self._square_sums(x, rows)
        for t in p.targets:
            self.acc.add(t.name, t.n_mat, t.mat if t.mat is not None else (expert or 0),
                         sq_sum if t.order is None else sq_sum[t.order], rows.shape[0])

    def _square_sums(self, x, rows):
        """Σx² over ``rows`` (a view of ``x``) in float64; the last answer again when ``x`` is the same unchanged
        tensor (one input of several products: q, k and v projections)."""
        import torch

        last = self._last_input
        if last is not None and last[0]() is x and last[1] == x._version and last[2].shape[-1] == rows.shape[-1]:
            return last[2]
        sq_sum = rows.to(torch.float64, copy=True).square_().sum(dim=0)
        self._last_input = (weakref.ref(x), x._version, sq_sum)
        return sq_sum

    @contextmanager
    def active(self):
        import torch
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode

        recorder = self
        # product -> keyword names of its (input, weight) operands
        products = {F.linear: ("input", "weight"), torch.bmm: ("input", "mat2"), torch.Tensor.bmm: ("self", "mat2"),
                    torch.matmul: ("input", "other"), torch.Tensor.matmul: ("self", "other"),
                    torch.Tensor.__matmul__: ("self", "other")}

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                operands = products.get(func)
                if operands is not None:
                    x, w = (list(args) + [kwargs.get(k) for k in operands[len(args):]])[:2]
                    hit = recorder.lookup(w)
                    if hit is not None:
                        recorder.observe(hit, x, out)
                else:
                    recorder.derive(func, args, out)
                return out

        with Mode():
            yield
        self._aliases.clear()
        self._last_input = None


# -- routed experts, grouped ------------------------------------------------------------------------------------------

def groupable_experts(module) -> bool:
    """An experts module of transformers' standard layout (``use_experts_implementation`` with its defaults: stacked
    ``gate_up_proj`` [gate; up] and ``down_proj``, no biases, not transposed, no post-expert norm), whose eager
    forward is ``down(_apply_gate(gate_up(x))) * weight`` per expert, summed per token in expert order."""
    flags = ("has_gate", "is_concatenated", "has_bias", "is_transposed", "has_post_expert_norm", "_is_expert_parallel")
    found = tuple(getattr(module, f, None) for f in flags)
    return (found == (True, True, False, False, False, False) and callable(getattr(module, "_apply_gate", None))
            and all(hasattr(module, a) for a in ("gate_up_proj", "down_proj", "num_experts")))


def grouped_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts forward with the same bits and fewer operations: the token-expert pairs are
    sorted by expert once (within an expert in eager's order: by top-k slot, then token), each expert multiplies
    its rows as in the eager loop (the same products, which the recorder attributes per expert), the routing
    weights scale every row in one product, and each token's outputs are added in expert order, as eager's
    ``index_add_`` per expert adds them, but in ``top_k`` additions rather than one ``index_add_`` per expert
    (each a parallel region per row on the CPU)."""
    import torch
    import torch.nn.functional as F

    tokens, top_k = top_k_index.shape
    n_experts = int(module.num_experts)
    if tokens == 0 or bool((top_k_index >= n_experts).any()):     # expert-parallel sentinels: eager skips them
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)
    pairs = top_k_index.t().reshape(-1)                 # pair p = slot * tokens + token
    order = torch.argsort(pairs, stable=True)
    pair_token = order % tokens
    pair_weight = top_k_weights.t().reshape(-1)[order]
    counts = torch.bincount(pairs, minlength=n_experts).tolist()
    out = torch.empty((order.numel(), hidden_states.shape[-1]), dtype=hidden_states.dtype,
                      device=hidden_states.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        token_idx = pair_token[rows]
        current = module._apply_gate(F.linear(hidden_states[token_idx], module.gate_up_proj[expert]))
        out[rows] = F.linear(current, module.down_proj[expert])
        start += count
    out *= pair_weight[:, None]
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    slots = torch.argsort(top_k_index, dim=1, stable=True)     # each token's slots in expert order
    at = position.view(top_k, tokens).t().gather(1, slots)
    final = torch.zeros_like(hidden_states)
    for j in range(top_k):
        final += out[at[:, j]].to(final.dtype)
    return final


# -- the collector ------------------------------------------------------------------------------------------------

def _weights(module, recurse: bool = True) -> dict:
    """Name -> weight: the parameters, and the weights the runtime keeps packed (buffers holding a
    :class:`~quantkit.runtime.packed.PackedTensor`); tied weights once, under their first name."""
    from ..runtime.packed import PackedTensor

    found = dict(module.named_parameters(recurse=recurse))
    found.update((n, b) for n, b in module.named_buffers(recurse=recurse) if isinstance(b, PackedTensor))
    return found


class Collector:
    """Accumulates statistics over chunks run through ``model`` (a transformers model whose parameter names
    ``amap`` resolves).  Sets the model's experts implementation to eager, and its attention to eager where MLA's
    statistics need the attention weights (else SDPA where the model has it).  :meth:`close` removes every
    hook."""

    def __init__(self, model, amap: ArchMap, *, all_experts: bool = False, process_output: bool = False):
        import torch

        self.model = model
        self.amap = amap
        self._implementations = (model.config._experts_implementation, model.config._attn_implementation)
        model.set_experts_implementation("eager")
        model.set_attn_implementation("eager")
        # parts the runtime does not load (a vision tower) stay on the meta device
        self.device = next(w.device for w in _weights(model).values() if w.device.type != "meta")
        self.acc = Accumulators(self.device)
        self._hooks: list[Any] = []
        self._patched: list[Any] = []
        self.process_output = process_output
        by_name: dict[str, _Param] = {}
        mla_parts: dict[str, dict[str, str]] = {}
        for name, param in _weights(model).items():
            targets, mla, unsupported = self._targets(name, param)
            entry = _Param(name, param, targets, stacked=any(t.mat is None and t.n_mat > 1 for t in targets),
                           unsupported=unsupported)
            by_name[name] = entry
            for step, gguf_name in mla.items():
                mla_parts.setdefault(name, {})[step] = gguf_name
        self._attach_mla(mla_parts, by_name)
        if not mla_parts:
            self._fused_attention()
        watched = [p for p in by_name.values() if p.targets or p.observers or p.unsupported]
        self.recorder = _Recorder(watched, self.acc)
        self._group_experts()
        if all_experts:
            self._route_all_experts()
        self._torch = torch

    def _fused_attention(self) -> None:
        """torch's fused attention (SDPA) where the model supports it: attention weights are needed only for MLA's
        statistics, and the fused kernel saves the eager ``[heads, n, n]`` products and softmax."""
        try:
            self.model.set_attn_implementation("sdpa")
        except (ValueError, ImportError):    # the model has no SDPA path
            pass

    def _targets(self, name: str, param) -> tuple[list[_Target], dict[str, str], str | None]:
        """What a parameter feeds: statistics targets, MLA parts, and why its products cannot be recorded (a
        transform that changes the columns, e.g. a convolution kernel; an error only if it is multiplied)."""
        import torch

        targets, mla, unsupported = [], {}, None
        for m in self.amap.resolve(name):
            if m.gguf_name is None or m.role != "weight" or param.dim() < 2:
                continue
            if not (m.gguf_name.startswith("blk.") or (self.process_output and m.gguf_name == OUTPUT_HEAD)):
                continue
            step = next((s for s in m.transform if s in MLA_STEPS), None)
            if step is not None:
                mla[step] = m.gguf_name
                continue
            stacked = param.dim() == 3 and m.tensor_class in ROUTED_CLASSES and m.expert is None
            order = column_map(m, int(param.shape[-1]), self.amap.hp)
            if order is None or (param.dim() > 2 and not stacked):
                unsupported = f"its transform {m.transform} or shape {tuple(param.shape)} does not say what " \
                              f"{m.gguf_name!r} multiplies"
                continue
            identity = bool((order == np.arange(order.size)).all())
            order_t = None if identity else torch.as_tensor(order, device=param.device)
            if stacked:
                targets.append(_Target(m.gguf_name, int(param.shape[0]), None, order_t))
            else:
                n_mat = self.amap.expert_count if m.expert is not None else 1
                targets.append(_Target(m.gguf_name, n_mat, m.expert, order_t))
        return targets, mla, unsupported

    def _attach_mla(self, mla_parts: dict[str, dict[str, str]], by_name: dict[str, _Param]) -> None:
        modules = dict(self.model.named_modules())
        for pname, parts in mla_parts.items():
            if set(parts) != set(MLA_STEPS):
                raise UnsupportedError(f"MLA split incomplete: {sorted(parts)}", tensor=pname)
            attn_name = pname.rsplit(".", 2)[0]          # <attn>.kv_b_proj.weight
            attn = modules.get(attn_name)
            q_proj = getattr(attn, "q_b_proj", None) or getattr(attn, "q_proj", None)
            if attn is None or q_proj is None:
                raise UnsupportedError("an MLA kv_b projection outside an attention module with a query "
                                       "projection", tensor=pname)
            handler = _MLA(attn, parts["kv_b_k"], parts["kv_b_v"], self.acc)
            by_name[pname].observers.append(handler.on_latent)
            q_name = next(n for n, p in by_name.items() if p.param is q_proj.weight)
            by_name[q_name].observers.append(handler.on_query)
            self._hooks.append(attn.register_forward_hook(handler.after_attention))

    def _route_all_experts(self) -> None:
        import torch

        owners = {}
        for module_name, module in self.model.named_modules():
            for pname, param in _weights(module, recurse=False).items():
                full = f"{module_name}.{pname}" if module_name else pname
                if param.dim() == 3 and any(m.tensor_class in ROUTED_CLASSES for m in self.amap.resolve(full)):
                    owners[module_name] = (module, int(param.shape[0]))
        recorder = self.recorder

        for module, n_experts in owners.values():
            original = module.forward

            def forward(hidden_states, top_k_index, top_k_weights, _original=original, _n=n_experts):
                tokens = hidden_states.shape[0]
                every = torch.arange(_n, device=hidden_states.device).expand(tokens, _n)
                _original(hidden_states, every, torch.zeros((tokens, _n), dtype=top_k_weights.dtype,
                                                           device=top_k_weights.device))
                recorder.mute_experts = True
                try:
                    return _original(hidden_states, top_k_index, top_k_weights)
                finally:
                    recorder.mute_experts = False

            module.forward = forward
            if module not in self._patched:
                self._patched.append(module)

    def _group_experts(self) -> None:
        """Run the routed experts of transformers' standard layout through :func:`grouped_experts_forward`."""
        for module in self.model.modules():
            if groupable_experts(module):
                module.forward = functools.partial(grouped_experts_forward, module)
                self._patched.append(module)

    def run_chunks(self, input_ids) -> None:
        """Run chunks (``LongTensor[n, ctx]``, one sequence each) in one pass and accumulate their statistics."""
        self.acc.fold(self.run_chunks_alone(input_ids))

    def run_chunks_alone(self, input_ids) -> dict[str, tuple[Any, Any]]:
        """Run chunks in one pass and return their statistics (:meth:`Accumulators.take_chunk`) without adding
        them."""
        torch = self._torch
        keep = 0 if self.process_output else 1  # the head's product is needed only for its statistics
        with torch.no_grad(), self.recorder.active():
            self.model(input_ids=input_ids.to(self.device), use_cache=False, logits_to_keep=keep)
        return self.acc.take_chunk()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for module in self._patched:
            del module.forward
        self._hooks, self._patched = [], []
        experts, attention = self._implementations
        self.model.set_experts_implementation(experts)
        self.model.set_attn_implementation(attention)


# -- calibration text ---------------------------------------------------------------------------------------------

def read_text(path: str | os.PathLike) -> str:
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise SourceError(f"calibration text is {size} bytes, over the {MAX_TEXT_BYTES}-byte limit: split it and "
                          f"merge the imatrices", path=path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"calibration text is not UTF-8 ({exc.reason} at byte {exc.start})", path=path) from None
    if not text.strip():
        raise SourceError("calibration text is empty", path=path)
    return text.removesuffix("\n")  # llama-imatrix drops one trailing newline of the file


def calibration_chunks(tokenizer, text: str, ctx: int, n_chunks: int | None = None) -> list[list[int]]:
    """Token chunks as llama-imatrix forms them from ``text`` (see the module docstring)."""
    bos = tokenizer.bos_token_id
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    add_bos = bos is not None and probe[:1] == [bos]
    tokens = ([bos] if add_bos else []) + list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return chunk_tokens(tokens, ctx, n_chunks, bos if add_bos else None)


def check_ctx(ctx: int) -> None:
    if ctx < 1:
        raise SourceError(f"context length must be positive, got {ctx}", field="ctx")


def chunk_tokens(tokens: list[int], ctx: int, n_chunks: int | None, bos: int | None) -> list[list[int]]:
    """``ctx``-token chunks of ``tokens`` (at most ``n_chunks``), each starting with ``bos`` when given."""
    check_ctx(ctx)
    if n_chunks is not None and n_chunks < 1:
        raise SourceError(f"the chunk count must be positive, got {n_chunks}")
    available = len(tokens) // ctx
    if available < 1:
        raise SourceError(f"calibration text tokenizes to {len(tokens)} tokens, fewer than one chunk of {ctx}")
    count = available if n_chunks is None else min(n_chunks, available)
    chunks = [list(tokens[i * ctx:(i + 1) * ctx]) for i in range(count)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


# -- the command --------------------------------------------------------------------------------------------------

@dataclass
class CollectOptions:
    ctx: int = DEFAULT_CTX
    batch: int = DEFAULT_BATCH
    """Tokens per forward pass (llama-imatrix's ``-b``): :attr:`chunks_per_pass` chunks run together."""
    chunks: int | None = None
    all_experts: bool = False
    process_output: bool = False
    synthetic: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    max_memory: int | None = None
    """Bytes of assembled weights kept in memory (:class:`quantkit.runtime.weights.CheckpointWeights`); None: its
    default share of the available memory."""
    save_every: int = DEFAULT_SAVE_EVERY
    threads: int | None = None
    """torch threads the chunks run on (llama-imatrix's ``-t``); None: one per :data:`VALUES_PER_THREAD` of a
    pass's hidden states (tokens x hidden size), at most torch's default (one per core).  Small passes run faster
    on fewer: each operation is too small to share, and an operation split over threads waits for the slowest,
    so one thread whose core is busy with another process stalls the step by a scheduler time slice."""
    restart: bool = False
    overwrite: bool = False
    progress: bool = True
    executor: str = "process"
    """``process``: chunks run here; ``ray``: on Ray workers (:mod:`quantkit.imatrix.raycollect`)."""
    address: str | None = None
    """Ray cluster address; None: a local cluster of ``workers`` CPUs, started and stopped by the run."""
    workers: int = 1

    @property
    def chunks_per_pass(self) -> int:
        return max(1, self.batch // self.ctx)


def forward_passes(start: int, n_chunks: int, per_pass: int) -> list[range]:
    """Chunk indices ``start..n_chunks-1`` in passes of ``per_pass``, aligned to multiples of ``per_pass`` from
    chunk 0 (so a resumed run forms the passes an uninterrupted one does)."""
    return [range(i, min(i + per_pass, n_chunks)) for i in range(start, n_chunks, per_pass)]


def _read_checkpoint(source: Path) -> tuple[dict, list[Path]]:
    """The checkpoint's config and the files it reads (shards, config, tokenizer: convert's provenance files)."""
    path = source / "config.json"
    if not path.is_file():
        raise SourceError("no config.json: collection needs a Hugging Face checkpoint directory", path=source)
    try:
        config = jsontext.loads(path.read_bytes().decode("utf-8"))
    except ValueError as exc:   # UnicodeDecodeError included
        raise SourceError(f"config.json is not valid JSON: {exc}", path=path) from None
    if not isinstance(config, dict):
        raise SourceError("config.json must be a JSON object", path=path)
    with open_checkpoint(source) as ckpt:   # checks the config's sizes against the tensors, before anything is sized
        shards = ckpt.shard_paths()
    return config, provenance_files(ResolvedSource(source, str(source)), shards)


def resume_state(out: Path) -> Path:
    return out.with_name(out.name + RESUME_SUFFIX)


def collect_imatrix(source: str | os.PathLike, text_path: str | os.PathLike, out: str | os.PathLike,
                    options: CollectOptions | None = None) -> Imatrix:
    """Run ``source`` over the text, write the imatrix to ``out`` (atomically), and return it.  The options and
    the output (:func:`~quantkit.imatrix.formats.imatrix_output`, locked until the end) are checked first."""
    opts = options or CollectOptions()
    source, out = Path(source), Path(out)
    if opts.dtype not in DTYPES:
        raise SourceError(f"dtype {opts.dtype!r} is not one of {DTYPES}")
    if opts.threads is not None and opts.threads < 1:
        raise SourceError(f"the thread count must be positive, got {opts.threads}", field="threads")
    if opts.batch < 1:
        raise SourceError(f"the batch size must be positive, got {opts.batch}", field="batch")
    check_ctx(opts.ctx)
    state = resume_state(out)
    with imatrix_output(out, inputs=input_files([source, text_path]), overwrite=opts.overwrite,
                        also=[state, state.with_name(state.name + PARTIAL_SUFFIX)]):
        text = read_text(text_path)
        config, files = _read_checkpoint(source)
        # the source's identity is hashed in the background while the model loads and runs, as convert does (a
        # Hugging Face cache names its blobs by their SHA-256: those are not read)
        hashing = Hashing(files, file_stats(files))
        try:
            return _collect_source(source, text, text_path, config, out, opts, hashing)
        finally:
            hashing.cancel()


def _collect_source(source: Path, text: str, text_path, config: dict, out: Path, opts: CollectOptions,
                    hashing: Hashing) -> Imatrix:
    amap = get_arch(config.get("model_type", "")).bind(config)
    inputs = {"text_sha256": sha256_file(text_path), "ctx": str(opts.ctx), "chunks_per_pass": str(opts.chunks_per_pass),
              "all_experts": str(opts.all_experts).lower(), "process_output": str(opts.process_output).lower(),
              "dtype": opts.dtype}

    def identity() -> dict[str, str]:
        return {**source_provenance(hashing.result()), **inputs}

    import transformers

    chunks = calibration_chunks(transformers.AutoTokenizer.from_pretrained(source), text, opts.ctx, opts.chunks)
    if opts.executor == "ray":
        from .raycollect import collect_on_ray

        return collect_on_ray(source, config, amap, chunks, out, identity, opts, text_path)
    model = load_collection_model(source, config, opts)
    try:
        return _collect(model, amap, chunks, out, identity, opts, source, text_path)
    finally:
        model.close()


def load_collection_model(source: Path, config: dict, opts: CollectOptions):
    """The runtime model a collection runs (:func:`quantkit.runtime.load_model`) with the options' memory bounds."""
    import torch

    from ..resources import KEEP_FRACTION, memory_for
    from ..runtime import load_model

    # a memory bound on CUDA also streams the weights to the device per use instead of placing every one there
    keep = int(KEEP_FRACTION * memory_for("--max-memory")) if opts.max_memory is None else 0
    return load_model(source, opts.device, config=config, dtype=getattr(torch, opts.dtype),
                      stream=opts.max_memory is not None, cache_bytes=opts.max_memory, keep_bytes=keep)


@contextmanager
def collection_threads(model, opts: CollectOptions):
    """torch's threads while chunks run (:attr:`CollectOptions.threads`), restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    hidden = getattr(model.module.config.get_text_config(), "hidden_size", None)
    values = opts.chunks_per_pass * opts.ctx * int(hidden) if hidden else None
    run_threads = opts.threads or (max(1, min(threads, values // VALUES_PER_THREAD)) if values else threads)
    # set here, after loading: loading the decoders (numba's runtime) resets the process's OpenMP threads
    torch.set_num_threads(run_threads)
    try:
        yield run_threads
    finally:
        torch.set_num_threads(threads)


def _collect(model, amap: ArchMap, chunks: list[list[int]], out: Path, identity: Callable[[], dict[str, str]],
             opts: CollectOptions, source: Path, text_path) -> Imatrix:
    import torch

    collector = Collector(model.module, amap, all_experts=opts.all_experts, process_output=opts.process_output)

    def run(passes):
        for indices in passes:
            collector.run_chunks(torch.tensor([chunks[i] for i in indices], dtype=torch.long))
            model.store.check()     # a weight that decoded to NaN or infinity, named
            yield indices

    try:
        with collection_threads(model, opts):
            return accumulate(collector.acc, amap, len(chunks), run, out, identity, opts, source, text_path)
    finally:
        collector.close()


def accumulate(acc: Accumulators, amap: ArchMap, n_chunks: int, run: Callable, out: Path,
               identity: Callable[[], dict[str, str]], opts: CollectOptions, source: Path, text_path) -> Imatrix:
    """Resume from ``<out>.resume.gguf`` when it exists (unless ``restart``), let ``run(passes)`` fold the
    remaining chunks into ``acc`` pass by pass (:func:`forward_passes`; yielding each pass once it is folded),
    save the resume state at the first pass end after every ``save_every`` chunks, then write the imatrix to
    ``out`` and remove the resume state.  ``identity()``: the inputs' identity (:data:`RESUME_IDENTITY`), called
    only when needed as it waits for the source's hashes."""
    from tqdm import tqdm

    state = resume_state(out)
    done = _resume(acc, state, identity(), n_chunks) if state.exists() and not opts.restart else 0
    synthetic = opts.synthetic or (source / EXAMPLE_MARKER).is_file()

    def snapshot(n_done: int, **extra) -> Imatrix:
        provenance = {**identity(), "source": str(source), "source_model_type": amap.arch.model_type,
                      "quantkit_version": __version__, **extra}
        return make_imatrix(acc.entries(), datasets=[str(text_path)], chunk_count=n_done,
                            chunk_size=opts.ctx, synthetic=synthetic, provenance=provenance)

    saved = done
    with tqdm(initial=done, total=n_chunks, unit="chunk", disable=not opts.progress, desc="imatrix") as bar:
        for indices in run(forward_passes(done, n_chunks, opts.chunks_per_pass)):
            bar.update(len(indices))
            n_done = indices[-1] + 1
            if opts.save_every > 0 and n_done // opts.save_every > saved // opts.save_every and n_done < n_chunks:
                save_imatrix(snapshot(n_done, chunks_done=str(n_done)), state, fmt="gguf", overwrite=True)
                saved = n_done
    imatrix = snapshot(n_chunks)
    save_imatrix(imatrix, out, overwrite=opts.overwrite)   # GGUF, or legacy for a .dat name (as merge, convert)
    state.unlink(missing_ok=True)
    imatrix.path = out
    imatrix.sha256 = sha256_file(out)
    return imatrix


def _changed_files(was: str | None, now: str) -> str:
    """The files whose hashes differ between two ``source_files`` values (``name:sha256,...``)."""
    def hashes(text):
        return dict(item.rpartition(":")[::2] for item in (text or "").split(",") if item)

    before, after = hashes(was), hashes(now)
    changed = sorted(n for n in {*before, *after} if before.get(n) != after.get(n))
    return ", ".join(changed) if was else "the state records none: an older quantkit's"


def _resume(acc: Accumulators, state: Path, identity: dict[str, str], n_chunks: int) -> int:
    saved = load_imatrix(state)
    for key in RESUME_IDENTITY:
        was, now = saved.provenance.get(key), identity[key]
        if key == "source_files" and was != now:   # named, not every file's hash printed
            raise ValidationError(f"resume state was made from other source files ({_changed_files(was, now)}); "
                                  f"delete it or pass --restart", path=state)
        if was != now:
            raise ValidationError(f"resume state was made with other inputs ({key}: {was!r}, now {now!r}); delete "
                                  f"it or pass --restart", path=state)
    done = int(saved.provenance.get("chunks_done", "0"))
    if not 0 < done <= n_chunks or done % int(identity["chunks_per_pass"]) and done != n_chunks:
        raise ValidationError(f"resume state records {done} chunks done of {n_chunks}", path=state)
    acc.load(saved)
    return done
