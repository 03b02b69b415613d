"""Which weights the fused products multiply packed, and how a reordered GGUF tensor is read, checked on the CPU.

The fused products (quantkit.kernels.triton_matmul) need CUDA; here a stand-in with the same signature decodes
the payload and multiplies, so the plumbing around the kernels is what is tested: which parts are fused, and
the row and column orders of GGUF tensors that llama.cpp's layout reorders (Qwen3.8 Flash Next's gated-delta-net
projections: value heads grouped by key head).  The kernels themselves are tested on CUDA
(tests/test_runtime_gpu.py: bit-exact decoding, products within 2^-16, the runtime against the CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.formats.api import decode
from quantkit.formats.registry import GGMLType, layout
from quantkit.runtime import load_model, logits
from quantkit.runtime.packed import PackedTensor
from test_runtime import RELATIVE_TOLERANCE, ggufs, token_ids  # noqa: F401  (ggufs: the CPU tests' fixture)

#: The types quantkit.kernels.triton_matmul multiplies packed (importing it needs Triton).
FUSED = {GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q2_K, GGMLType.IQ2_XXS, GGMLType.MXFP4, GGMLType.NVFP4,
         GGMLType.BF16, GGMLType.F32}


def _values(payload: torch.Tensor, qtype: GGMLType, rows: int) -> torch.Tensor:
    raw = payload.reshape(rows, -1).numpy()
    fmt = layout(qtype)
    return torch.from_numpy(decode(raw, qtype, (rows, raw.shape[1] // fmt.type_size * fmt.block_size)))


class _DecodingMatmul:
    """quantkit.kernels.triton_matmul's dense product, as decode-then-multiply on the CPU."""

    FUSED_TYPES = FUSED

    @staticmethod
    def linear(x, payload, qtype, n, *, out=None, out_col=0, scale=None, precision=None, config=None):
        product = x @ _values(payload, qtype, n).T
        if scale is not None:
            product = product * scale
        if out is None:
            return product
        out[:, out_col:out_col + n] = product
        return out


class _DecodingTriton:
    """quantkit.kernels.triton_dequant's ``dequantize``, on the CPU."""

    TRITON_TYPES = FUSED

    @staticmethod
    def dequantize(payload, qtype):
        rows = payload.reshape(-1, payload.shape[-1]).shape[0]
        return _values(payload.contiguous(), qtype, rows).reshape(-1)


def _fused_on_cpu(model) -> None:
    """Make ``model``'s store multiply its matrices packed, as a CUDA store does, with the stand-ins above (routed
    experts, 3-D, stay decoded: the stand-in has no grouped product)."""
    store = model.store
    store._matmul, store._triton = _DecodingMatmul, _DecodingTriton
    for name, stored in store.weights.tensors.items():
        if stored.qtype in FUSED and len(stored.shape) == 2:
            data = store.weights.data(name)
            store._on_device[name] = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy()).reshape(
                data.shape[0], -1)


def _packed(model) -> dict[str, PackedTensor]:
    return {t.plan.name: t for module in model.module.modules() for t in module._buffers.values()
            if isinstance(t, PackedTensor)}


def test_reordered_projections_multiply_packed(ggufs):
    """Qwen3.8 Flash Next's gated-delta-net projections, whose GGUF rows (value heads grouped by key head) or
    columns llama.cpp reorders, are multiplied packed, and the logits equal the decoding path's."""
    path = ggufs("qwen4_exp", "mixed")
    ids = token_ids("qwen4_exp", 48)
    expected = logits(load_model(path), ids)
    model = load_model(path)
    _fused_on_cpu(model)
    weights = _packed(model)
    reordered = {name: t.fused() for name, t in weights.items() if "linear_attn" in name and t.fused()
                 and any(p.out_rows is not None or p.in_cols is not None for p in t.fused())}
    assert any(p.out_rows is not None for parts in reordered.values() for p in parts), sorted(weights)
    assert any(p.in_cols is not None for parts in reordered.values() for p in parts), sorted(weights)
    unfused = [name for name, t in weights.items() if len(t.plan.shape) == 2 and t.fused() is None]
    assert unfused == [], unfused
    got = logits(model, ids)
    assert np.abs(got - expected).max() <= RELATIVE_TOLERANCE * np.abs(expected).max()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next"])
def test_fused_matrices_give_the_decoding_paths_logits(ggufs, arch):
    """Every architecture's logits with its matrices multiplied packed equal the decoding path's."""
    path = ggufs(arch, "mixed")
    ids = token_ids(arch, 48)
    expected = logits(load_model(path), ids)
    model = load_model(path)
    _fused_on_cpu(model)
    got = logits(model, ids)
    assert any(t.fused() for t in _packed(model).values())
    assert np.abs(got - expected).max() <= RELATIVE_TOLERANCE * np.abs(expected).max()
