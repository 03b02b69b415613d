"""Packed weights: GGUF payloads kept as bytes on the runtime device and decoded on use.

:class:`WeightStore` holds every payload once: on the CPU as the memory-mapped file itself (the operating system
pages weights in and out, so a model larger than memory streams from the file); on CUDA as ``uint8`` device
tensors, or, with ``stream=True``, as the mapped file again, copied to the device per use.  Its :meth:`~WeightStore
.decode` turns a payload (whole, one leading-axis slice, or some rows) into float32 with the bit-exact decoders:
numba on the CPU (:func:`quantkit.formats.api.decode`), Triton on CUDA (:mod:`quantkit.kernels.triton_dequant`;
types without a kernel decode on the CPU and are copied over).  An NVFP4 tensor's ``<name>.scale`` companion (its
global scale, one value or one per expert, llama.cpp's convention) multiplies the decoded values.

Decoded tensors are checked for NaN and infinity, each (GGUF tensor, leading-axis slice) on its first use only:
payloads are fixed (the mapped file, or a checkpoint's deterministic assembly) and the decoders deterministic, so
a payload that decoded finite once always does.  A decode of some rows is checked every time unless the whole
tensor has been.  The check runs on the device without waiting for it (:meth:`WeightStore.check`, called by
:func:`quantkit.runtime.logits` after each forward pass, and whenever :data:`MAX_PENDING_CHECKS` are waiting) and
raises a :class:`~quantkit.errors.FormatError` naming the GGUF tensor; a payload that failed is checked, and
fails, again on its next use.

:class:`PackedTensor` is what the transformers model sees in place of a weight: a tensor subclass with the right
shape, dtype and device and no storage.  Any operation on it rebuilds the weight (every GGUF tensor it comes from,
decoded and placed by its :class:`~quantkit.runtime.inverse.TensorPlan`: a strided copy where a part's rows and
columns are evenly spaced, an index scatter otherwise) and runs on the result, so the model's own code runs
unchanged.  Three operations decode less: ``weight[i]`` on fused 3-D experts (the routed expert only, read as
``weights.data(name, i)``: one expert's payload, so a checkpoint assembles only that expert), ``embedding(weight,
ids)`` (the rows looked up only) and shape queries (nothing).  On CUDA in float32 (:data:`FUSED_DTYPES`),
``F.linear`` by a packed weight whose GGUF tensors are resident in a type the fused kernels read, each holding
whole rows of it with no value step (:func:`fused_parts`), decodes nothing at all: one fused product per GGUF tensor
(:mod:`quantkit.kernels.triton_matmul`) multiplies the activations by the packed bytes; the routed experts do
the same through :meth:`PackedTensor.fused_linear` (:mod:`.experts`).  Such payloads are still decoded once, on
their first use, for the finiteness check.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ..errors import FormatError, UnsupportedError
from ..formats.api import decode as cpu_decode
from ..formats.registry import GGMLType, layout
from .ggml_arithmetic import ACTIVATION_ATTR, SLICE_ATTR, activation_type
from .inverse import VALUE_INVERSES, Part, TensorPlan
from .weights import PayloadCache

#: Compute dtypes whose products run fused (packed weights, :mod:`quantkit.kernels.triton_matmul`).  bfloat16
#: keeps decoding, then cuBLAS: on the H200 its fused products took 1.3-3x cuBLAS's time at 2048 rows (a Q8_0
#: 2048 x 2048 weight 0.16-0.19 ms vs 0.12 ms; the 32000-row head 1.4-2.0 ms vs 0.64 ms), and the 1B MoE scored
#: 25,553 tok/s fused against 58,588 decoded (bench/results/score-vs-llamacpp-2026-12-02b.md).  float32 runs
#: fused (measured with tf32x3 products; bf16x3 since, see triton_matmul): against cuBLAS's float32 products
#: (Q8_0 2048 x 2048: 0.50 vs 0.74 ms at 2048 rows), the 7.6B MoE 5,121 tok/s against 2,873 decoded (15,796 at
#: 2048 tokens with the tuned launches and CUDA graph replays, 0.88x llama-perplexity in the same run:
#: bench/results/score-vs-llamacpp-2026-12-02c.md), and no transient decoded weights (peak 4.92 vs 7.01 GiB).
FUSED_DTYPES = (torch.float32,)
#: Decoded tensors whose finiteness is awaited before the store synchronizes and checks them.
MAX_PENDING_CHECKS = 4096
_aten = torch.ops.aten
_INTEGER_TYPES = {GGMLType.I8: np.int8, GGMLType.I16: np.int16, GGMLType.I32: np.int32, GGMLType.I64: np.int64}


class WeightStore:
    """Payloads of a weight source on one device, and their decoding."""

    def __init__(self, weights, device: torch.device, *, stream: bool = False):
        self.weights = weights
        self.device = device
        self.stream = stream
        self._on_device: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[str, tuple[str, int | None] | None, torch.Tensor]] = []
        self._pending_keys: set[tuple[str, int | None]] = set()
        self._finite: set[tuple[str, int | None]] = set()
        self.first_checks = 0
        """Checks queued so far that prove a tensor (or slice) finite for its later uses: a forward pass that
        queues none decodes nothing for the first time, and may be captured as a CUDA graph."""
        self._triton = None
        self._matmul = None
        if device.type == "cuda":
            from ..kernels import triton_dequant, triton_matmul
            self._triton = triton_dequant
            self._matmul = triton_matmul

    # -- placement ------------------------------------------------------------------------------------------------

    def place(self, name: str) -> None:
        """Copy a payload to the device now (CUDA without streaming), and its ``.scale`` companion if any."""
        stored = self.weights.tensors[name]
        scale_name = scale_companion(name)
        if scale_name in self.weights.tensors:
            scale = self._decode_cpu(scale_name, self.weights.data(scale_name)).reshape(-1)
            self._scales[name] = scale.to(self.device)
        if self._triton is not None and not self.stream and stored.qtype in self._triton.TRITON_TYPES:
            data = self.weights.data(name)
            self._on_device[name] = _host_bytes(data).to(self.device).reshape(data.shape)

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() for t in self._on_device.values())

    # -- decoding -------------------------------------------------------------------------------------------------

    def _decode_cpu(self, name: str, raw: np.ndarray) -> torch.Tensor:
        stored = self.weights.tensors[name]
        if stored.qtype in _INTEGER_TYPES:
            return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(_INTEGER_TYPES[stored.qtype]).copy())
        fmt = layout(stored.qtype)
        shape = (*raw.shape[:-1], raw.shape[-1] // fmt.type_size * fmt.block_size)
        return torch.from_numpy(cpu_decode(raw, stored.qtype, shape))

    def decode(self, name: str, index: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """GGUF tensor ``name`` decoded on the device, flattened: float32 (integer types as themselves); whole,
        its slice ``index`` of the leading axis, or its rows ``rows`` (int64, 2-D tensors)."""
        stored = self.weights.tensors[name]
        on_gpu = self._triton is not None and stored.qtype in self._triton.TRITON_TYPES
        payload = self._on_device.get(name)
        if payload is not None:
            part = payload if index is None else payload[index]
            if rows is not None:
                part = part.reshape(-1, part.shape[-1])[rows.to(part.device)]
            values = self._triton.dequantize(part, stored.qtype)
        else:
            raw = self.weights.data(name, index)
            if rows is not None:
                raw = raw.reshape(-1, raw.shape[-1])[rows.cpu().numpy()]
            if on_gpu:      # streamed: the packed bytes travel, the device decodes
                values = self._triton.dequantize(_host_bytes(raw).to(self.device), stored.qtype)
            else:
                values = self._decode_cpu(name, raw).reshape(-1).to(self.device)
        if stored.qtype in _INTEGER_TYPES:
            return values
        scale = self._scales.get(name)
        if scale is not None:
            if scale.numel() == 1:
                values = values * scale
            elif index is not None:
                values = values * scale[index]
            else:
                values = (values.view(scale.numel(), -1) * scale[:, None]).reshape(-1)
        if (name, None) not in self._finite:
            self._expect_finite(name, values, (name, index) if rows is None else None)
        return values

    def resident(self, name: str) -> bool:
        """Whether the payload of ``name`` is on the device (CUDA without streaming, a type Triton decodes)."""
        return name in self._on_device

    def fusable(self, name: str):
        """The device payload of ``name`` when the fused products (:mod:`quantkit.kernels.triton_matmul`) can
        multiply by it packed; None otherwise (CPU, streamed, a type without a fused kernel)."""
        stored = self.weights.tensors[name]
        payload = self._on_device.get(name)
        if payload is None or self._matmul is None or stored.qtype not in self._matmul.FUSED_TYPES:
            return None
        return payload

    def expect_finite_payload(self, name: str) -> None:
        """Check a payload the fused products multiply by packed: decoded once, on its first use, so a payload
        with NaN or infinity is named as on the decoding path (:meth:`check`)."""
        key = (name, None)
        if key not in self._finite and key not in self._pending_keys:
            self.decode(name)

    # -- finiteness ------------------------------------------------------------------------------------------------

    def _expect_finite(self, name: str, values: torch.Tensor, key: tuple[str, int | None] | None) -> None:
        """Queue the check of ``values``; ``key`` is what it proves finite for later uses (None: nothing, only
        some rows were decoded)."""
        if key is not None and (key in self._finite or key in self._pending_keys):
            return
        self._pending.append((name, key, finite_flag(values)))
        if key is not None:
            self._pending_keys.add(key)
            self.first_checks += 1
        if len(self._pending) >= MAX_PENDING_CHECKS:
            self.check()

    def take_checks(self, start: int) -> list:
        """Remove and return the checks queued after the first ``start`` (:meth:`queued`): a CUDA graph's, whose
        flags each replay recomputes in place; :meth:`requeue` puts them back after a replay."""
        taken, self._pending = self._pending[start:], self._pending[:start]
        return taken

    def queued(self) -> int:
        return len(self._pending)

    def requeue(self, checks: list) -> None:
        self._pending.extend(checks)

    def check(self) -> None:
        """Raise FormatError naming the first decoded tensor that held NaN or infinity since the last check."""
        pending = self.take_checks(0)
        if pending:
            self.settle(pending, torch.stack([flag for _, _, flag in pending]).cpu())

    def settle(self, checks: list, flags: torch.Tensor) -> None:
        """:meth:`check` for ``checks`` taken from the queue (:meth:`take_checks`), ``flags`` their values on the
        host."""
        self._pending_keys.difference_update(key for _, key, _ in checks)
        self._finite.update(key for (_, key, _), ok in zip(checks, flags.tolist()) if ok and key is not None)
        if not bool(flags.all()):
            name = checks[int((~flags).nonzero()[0])][0]
            stored = self.weights.tensors[name]
            raise FormatError(f"{stored.qtype.name} payload decodes to NaN or infinity (a corrupt block or scale)",
                              path=getattr(self.weights, "path", None), tensor=name)


def finite_flag(values: torch.Tensor) -> torch.Tensor:
    """A 0-d boolean tensor: every value of ``values`` is finite.  A float64 sum of float32 values cannot
    overflow, so it is finite exactly when every value is: one reduction, no boolean tensor the size of a weight,
    and no wait for the device."""
    return torch.isfinite(values.sum(dtype=torch.float64))


def _host_bytes(raw: np.ndarray) -> torch.Tensor:
    """A CPU uint8 tensor over ``raw`` (a read-only file mapping is only read: torch's warning does not apply)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))


def scale_companion(gguf_name: str) -> str:
    """The name of an NVFP4 weight's global-scale tensor (``blk.0.attn_q.weight`` -> ``blk.0.attn_q.scale``)."""
    return gguf_name.removesuffix(".weight") + ".scale"


# -- rebuilding model tensors ----------------------------------------------------------------------------------------

class Assembler:
    """Builds model tensors from GGUF tensors by their plans (positions kept on the device).

    ``keep_bytes``: packed weights' built tensors (:meth:`weight`) are kept in a least-recently-used cache of at
    most this many bytes, so a weight used again (every forward pass of a calibration run) is not decoded again;
    0 (the default) keeps none.  The decoders are deterministic, so a kept tensor holds the values a new build
    would."""

    def __init__(self, store: WeightStore, keep_bytes: int = 0):
        self.store = store
        self._places: dict[tuple[str, str], Strided | torch.Tensor] = {}
        self.kept = PayloadCache(keep_bytes)

    def _place(self, plan: TensorPlan, part: Part) -> "Strided | torch.Tensor":
        """Where a part's values go in (one slice of) the model tensor: a strided view, else flat positions."""
        key = (plan.name, part.gguf_name)
        if key not in self._places:
            strided = Strided.of(part.rows, part.cols)
            self._places[key] = strided if strided is not None else \
                torch.from_numpy((part.rows[:, None] + part.cols[None, :]).reshape(-1)).to(self.store.device)
        return self._places[key]

    def _scatter(self, plan: TensorPlan, out: torch.Tensor, part: Part, values: torch.Tensor, batch: int) -> None:
        for step in reversed(part.values):
            inverse = VALUE_INVERSES[step]
            if inverse is not None:
                values = inverse(values)
        if part.rows is None:
            out.view(-1).copy_(values.reshape(-1))
            return
        place = self._place(plan, part)
        if isinstance(place, Strided):
            place.view(out, batch).copy_(values.reshape(place.shape(batch)))
        else:
            out.view(batch, -1)[:, place] = values.reshape(batch, -1).to(out.dtype)

    def build(self, plan: TensorPlan, dtype: torch.dtype, index: int | None = None) -> torch.Tensor:
        """The model tensor (or, for a sliced plan, its slice ``index``) in ``dtype`` on the store's device."""
        if plan.sliced:
            shape = plan.shape if index is None else plan.shape[1:]
            batch = plan.shape[0] if index is None else 1
        else:
            if index is not None:
                return self.build(plan, dtype)[index]
            shape, batch = plan.shape, 1
        if len(plan.parts) == 1 and plan.parts[0].rows is None and not plan.parts[0].values:
            return self.store.decode(plan.parts[0].gguf_name, index).reshape(shape).to(dtype)
        # placed straight into ``dtype``: the one rounding of the float32 values that converting afterwards made
        out = torch.empty(shape, dtype=dtype, device=self.store.device)
        for part in plan.parts:
            self._scatter(plan, out, part, self.store.decode(part.gguf_name, index), batch)
        return out

    def weight(self, plan: TensorPlan, dtype: torch.dtype, index: int | None = None) -> torch.Tensor:
        """:meth:`build`, answered from the cache of built weights when it holds the tensor (see the class doc)."""
        if self.kept.budget == 0:
            return self.build(plan, dtype, index)
        if index is not None and not plan.sliced:
            return self.weight(plan, dtype)[index]      # a view: the whole tensor is what is kept
        key = (plan.name, dtype, index)
        built = self.kept.get(key)
        if built is None:
            built = self.build(plan, dtype, index)
            self.kept.put(key, built)
        return built.detach()   # a fresh tensor object: dispatch must not return one it returned before

    def rows(self, plan: TensorPlan, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Rows ``ids`` of a 2-D model tensor that is one GGUF tensor unchanged; None for other plans."""
        if plan.sliced or len(plan.shape) != 2 or len(plan.parts) != 1 or plan.parts[0].rows is not None \
                or plan.parts[0].values:
            return None
        name = plan.parts[0].gguf_name
        if ids.is_cuda and self.store.resident(name):
            # every id's row, repeats decoded again: torch.unique would wait for the device (no CUDA graph)
            table = self.store.decode(name, rows=ids.reshape(-1))
            return table.to(dtype).reshape(*ids.shape, plan.shape[1])
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        table = self.store.decode(name, rows=unique).reshape(len(unique), plan.shape[1])
        return table.to(dtype)[inverse.to(table.device)].reshape(*ids.shape, plan.shape[1])


@dataclass(frozen=True)
class Strided:
    """Positions ``offset + r * row_stride + c * col_stride`` (r < rows, c < cols) of each slice of a contiguous
    tensor: a part whose rows and columns are both evenly spaced lands through a strided view (one copy) instead
    of an index scatter."""

    offset: int
    rows: int
    row_stride: int
    cols: int
    col_stride: int

    @staticmethod
    def of(rows: np.ndarray, cols: np.ndarray) -> "Strided | None":
        """The view of factored positions ``rows[r] + cols[c]`` (``cols[0] == 0``), None when not evenly spaced."""
        row_stride, col_stride = (int(a[1] - a[0]) if a.size > 1 else 0 for a in (rows, cols))
        if not (np.array_equal(rows, rows[0] + np.arange(rows.size, dtype=np.int64) * row_stride)
                and np.array_equal(cols, np.arange(cols.size, dtype=np.int64) * col_stride)) \
                or min(row_stride, col_stride) < 0:
            return None
        return Strided(int(rows[0]), rows.size, row_stride, cols.size, col_stride)

    def shape(self, batch: int) -> tuple[int, int, int]:
        return batch, self.rows, self.cols

    def view(self, out: torch.Tensor, batch: int) -> torch.Tensor:
        """The places in ``out`` (contiguous, ``batch`` slices), as a ``[batch, rows, cols]`` view."""
        return out.as_strided(self.shape(batch), (out.numel() // batch, self.row_stride, self.col_stride),
                               out.storage_offset() + self.offset)


@dataclass(frozen=True)
class FusedPart:
    """One GGUF tensor of a weight as the fused products read it: output rows ``first``..``first + rows`` (of
    each expert) are ``x @ payload.T``; in a dense weight whose GGUF rows or columns were reordered (Qwen3.8 Flash
    Next's gated-delta-net projections: llama.cpp groups the value heads by key head), output row
    ``out_rows[i]`` is GGUF row ``i`` and GGUF column ``c`` multiplies activation column ``in_cols[c]``."""

    gguf_name: str
    payload: torch.Tensor
    qtype: GGMLType
    first: int
    rows: int
    scale: torch.Tensor | None
    out_rows: torch.Tensor | None = None
    in_cols: torch.Tensor | None = None


def fused_parts(assembler: Assembler, plan: TensorPlan) -> tuple[FusedPart, ...] | None:
    """How the fused products multiply by ``plan``'s weight without decoding it: each GGUF tensor whole rows of
    the model tensor with no value step (a run of rows, of each expert, for a sliced plan; in any order, their
    columns too, for a dense one); None if any is not (or the store cannot multiply packed)."""
    store = assembler.store
    if len(plan.shape) != (3 if plan.sliced else 2):
        return None
    n, k = plan.shape[-2:]
    found = []
    for part in plan.parts:
        payload = store.fusable(part.gguf_name)
        if payload is None or part.values:
            return None
        out_rows = in_cols = None
        if part.rows is None:
            first, rows = 0, n
        else:
            if (part.cols.size != k or (part.rows % k).any()
                    or not np.array_equal(np.sort(part.cols), np.arange(k))):
                return None             # a GGUF row is not one whole model row
            model_rows, rows = part.rows // k, part.rows.size
            first = int(model_rows[0])
            reordered = not np.array_equal(model_rows, first + np.arange(rows, dtype=np.int64))
            permuted = not np.array_equal(part.cols, np.arange(k))
            if (reordered or permuted) and plan.sliced:
                return None
            if reordered:
                out_rows = torch.from_numpy(model_rows).to(payload.device)
            if permuted:
                in_cols = torch.from_numpy(part.cols).to(payload.device)
        qtype = store.weights.tensors[part.gguf_name].qtype
        found.append(FusedPart(part.gguf_name, payload.reshape(-1), qtype, first, rows,
                               store._scales.get(part.gguf_name), out_rows, in_cols))
    return tuple(found)


def _is_single_index(index) -> bool:
    """An integer, or a 0-d integer tensor: ``weight[index]`` picks one expert's matrix."""
    if isinstance(index, torch.Tensor):
        return index.dim() == 0 and not index.is_floating_point() and index.dtype != torch.bool
    return isinstance(index, int) and not isinstance(index, bool)


class PackedTensor(torch.Tensor):
    """A weight that exists only as GGUF payloads; operations on it decode what they need (see module doc)."""

    @staticmethod
    def __new__(cls, assembler: Assembler, plan: TensorPlan, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, plan.shape, dtype=dtype, device=assembler.store.device,
                                                   requires_grad=False)

    def __init__(self, assembler: Assembler, plan: TensorPlan, dtype: torch.dtype):
        self.assembler = assembler
        self.plan = plan

    def __repr__(self) -> str:
        return f"PackedTensor({self.plan.name}, shape={tuple(self.plan.shape)}, from {list(self.plan.gguf_names)})"

    def materialize(self) -> torch.Tensor:
        return self.assembler.weight(self.plan, self.dtype)

    def fused(self) -> tuple[FusedPart, ...] | None:
        """:func:`fused_parts` of this weight (found once); None in a compute dtype outside :data:`FUSED_DTYPES`."""
        if "_fused" not in self.__dict__:
            self.__dict__["_fused"] = fused_parts(self.assembler, self.plan) if self.dtype in FUSED_DTYPES else None
        return self.__dict__["_fused"]

    def fused_linear(self, x: torch.Tensor, counts: torch.Tensor | None = None,
                     tiles=None, routed=None) -> torch.Tensor | None:
        """``x @ W.T`` multiplied packed (no decoded weight), or None where the fused products do not apply.
        ``x``: ``[rows, in]`` in this weight's dtype.  A sliced (experts) weight multiplies rows sorted by expert,
        ``counts[e]`` rows of expert ``e`` (``tiles``: their :func:`~quantkit.kernels.triton_matmul.expert_tiles`,
        when already computed; ``routed``: a :class:`~quantkit.kernels.triton_matmul.Routed`, the rows read from
        or written to where they are)."""
        parts = self.fused()
        if parts is None or x.dtype != self.dtype or (counts is None) == self.plan.sliced:
            return None
        store = self.assembler.store
        matmul = store._matmul
        x = x.contiguous()
        rows = x.shape[0] if routed is None or routed.gather is None else routed.gather.numel()
        out = torch.empty(rows, self.plan.shape[-2], dtype=x.dtype, device=x.device)
        if counts is not None and tiles is None:
            tiles = matmul.expert_tiles(counts, rows)
        for part in parts:
            store.expect_finite_payload(part.gguf_name)
            if counts is None:
                xs = x if part.in_cols is None else x.index_select(1, part.in_cols)
                if part.out_rows is None:
                    matmul.linear(xs, part.payload, part.qtype, part.rows, out=out, out_col=part.first,
                                  scale=part.scale)
                else:
                    out.index_copy_(1, part.out_rows, matmul.linear(xs, part.payload, part.qtype, part.rows,
                                                                    scale=part.scale))
            else:
                matmul.grouped_linear(x, part.payload, part.qtype, part.rows, counts, out=out, out_col=part.first,
                                      scale=part.scale, tiles=tiles, routed=routed)
        return out

    def fused_linear_rows(self, x: torch.Tensor, first: int, rows: int, *, out: torch.Tensor,
                          out_col: int = 0) -> torch.Tensor | None:
        """``x @ W[first:first + rows].T`` of a dense weight, multiplied packed into ``out[:, out_col:out_col +
        rows]``; None where the fused products do not apply (the rows are not one GGUF tensor's, in order)."""
        parts = self.fused()
        if parts is None or self.plan.sliced or x.dtype != self.dtype:
            return None
        for part in parts:
            if part.first <= first and first + rows <= part.first + part.rows:
                if part.out_rows is not None or part.in_cols is not None:
                    return None
                self.assembler.store.expect_finite_payload(part.gguf_name)
                payload = part.payload.view(part.rows, -1)[first - part.first:first - part.first + rows]
                return self.assembler.store._matmul.linear(x, payload, part.qtype, rows, out=out, out_col=out_col,
                                                           scale=part.scale)
        return None

    @property
    def activation_type(self) -> str:
        """The form ggml's CPU backend converts activations to before multiplying by this weight
        (:mod:`.ggml_arithmetic`); one per weight, so every GGUF tensor it comes from must agree."""
        found = self.__dict__.get("_activation_type")
        if found is None:
            tensors = self.assembler.store.weights.tensors
            kinds = {activation_type(tensors[name].qtype) for name in self.plan.gguf_names}
            if len(kinds) != 1:
                raise UnsupportedError(f"its GGUF tensors {', '.join(self.plan.gguf_names)} take activations as "
                                       f"{' and '.join(sorted(kinds))}: ggml's arithmetic differs across its rows",
                                       tensor=self.plan.name)
            found = self.__dict__["_activation_type"] = kinds.pop()
        return found

    def expert(self, index) -> torch.Tensor:
        """``self[index]`` of a sliced (experts) weight: that expert's matrix alone, marked with the packed weight
        and the index for :mod:`.ggml_arithmetic`."""
        index = _index(index, self.shape[0])
        matrix = self.assembler.weight(self.plan, self.dtype, index)
        setattr(matrix, ACTIVATION_ATTR, self)
        setattr(matrix, SLICE_ATTR, index)
        return matrix

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The two uses every forward pass makes of a packed weight, answered here rather than through
        # __torch_dispatch__ (F.linear there is aten::t, then a product, each a trip through Python and tree_map):
        # on the CPU ~30 us a product, 2 of the ~10 ms a pass of the example model costs beyond its arithmetic.
        if func is F.linear:
            out = _fused_linear(*args, **kwargs)
            if out is not None:
                return out
            if isinstance(args[1], PackedTensor) and not isinstance(args[0], PackedTensor):
                args = (args[0], args[1].materialize(), *args[2:])
                with torch._C.DisableTorchFunctionSubclass():
                    return F.linear(*args, **kwargs)
        elif func is torch.Tensor.__getitem__ and isinstance(args[0], PackedTensor) and args[0].plan.sliced \
                and _is_single_index(args[1]):
            return args[0].expert(args[1])
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.select.int and isinstance(args[0], PackedTensor) and args[1] == 0 \
                    and args[0].plan.sliced:
            return args[0].expert(args[2])
        if func is _aten.embedding.default and isinstance(args[0], PackedTensor):
            picked = args[0].assembler.rows(args[0].plan, args[1], args[0].dtype)
            if picked is not None:
                return picked
        if func in (_aten.detach.default, _aten.alias.default) and isinstance(args[0], PackedTensor):
            return args[0]
        unpacked = tree_map(lambda a: a.materialize() if isinstance(a, PackedTensor) else a, (args, kwargs))
        out = func(*unpacked[0], **unpacked[1])
        if func.is_view and isinstance(args[0], PackedTensor) and isinstance(out, torch.Tensor):
            setattr(out, ACTIVATION_ATTR, args[0])     # weight.t(), weight.view(...)
        return out


def _fused_linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor | None:
    """``F.linear`` with a packed weight as one fused product, where it applies (else None)."""
    if not isinstance(weight, PackedTensor) or isinstance(x, PackedTensor) or weight.plan.sliced:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        out = weight.fused_linear(x.reshape(-1, x.shape[-1]))
        if out is None:
            return None
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


def _index(i, size: int) -> int:
    i = int(i)
    if not -size <= i < size:
        raise IndexError(f"index {i} is out of bounds for dimension 0 with size {size}")
    return i % size
