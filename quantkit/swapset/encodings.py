"""Sidecar target encodings: how one linear weight is stored in a sidecar, encoded and decoded (pure numpy).

Every encoding stores a module's weight under ``<module>.<suffix>`` names, the suffixes of the engine convention:

======================  ===============================================================  ======================
encoding                tensors (suffix: dtype shape)                                    activation scale
======================  ===============================================================  ======================
``nvfp4-modelopt``      ``weight`` U8 [M, N/2], ``weight_scale`` F8_E4M3 [M, N/16],       ``input_scale`` F32 ()
                        ``weight_scale_2`` F32 () (multiplier)                           = amax / 2688
``nvfp4-compressed-``   ``weight_packed`` U8 [M, N/2], ``weight_scale`` F8_E4M3          ``input_global_scale``
``tensors``             [M, N/16], ``weight_global_scale`` F32 [1] (divisor)             F32 [1] = 2688 / amax
``fp8-tensor``          ``weight`` F8_E4M3 [M, N], ``weight_scale`` F32 [1]               ``input_scale`` F32
                                                                                         [1] = amax / 448
``fp8-channel``         ``weight`` F8_E4M3 [M, N], ``weight_scale`` F32 [M, 1]            as fp8-tensor
``fp8-block128``        ``weight`` F8_E4M3 [M, N], ``weight_scale_inv`` F32              none (dynamic
                        [ceil(M/128), ceil(N/128)] (DeepSeek V3)                         per-token groups)
``fp8-block128-e8m0``   ``weight`` F8_E4M3 [M, N], ``weight_scale_inv`` (or ``scale`` in  none
                        DeepSeek V4's upstream layout) F8_E8M0 per 128x128 block
======================  ===============================================================  ======================

NVFP4 codecs are :func:`quantkit.formats.blockscaled.nvfp4_quantize` (one global amax per fused group);
block FP8 are ``fp8_block_quantize`` / ``fp8_block_quantize_e8m0`` of the same module.  FP8 per-tensor and
per-channel follow compressed-tensors' ``float-quantized`` weights exactly (its ``calculate_qparams`` and
``quantize``): s = f32(amax / 448) over the tensor or each row, a zero s replaced by float32 eps,
codes = e4m3(clamp(f32(w / s), +-448) + 0.0) rounding to nearest even (adding its zero zero-point makes a
-0.0 quotient +0.0, code 0x00); decode f32(e4m3 * s).  The fp8 scales are
multipliers in both conventions, so ``--convention`` only matters for NVFP4.

Activation scales (static, from calibration amax): ModelOpt ``input_scale`` = f32(amax / 2688) as its
``get_activation_scaling_factor``; compressed-tensors ``input_global_scale`` = its ``generate_gparam``:
f32(1 / max(amax, tiny)) * 2688 (torch's scalar-over-tensor), non-finite -> 1.0; FP8 ``input_scale`` = amax / 448.

Fused 3-D weights ``[E, M, N]`` are encoded per expert and stacked; per-tensor scales become ``[E]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import EncodeError, FormatError, RecipeError, UnsupportedError
from ..formats import blockscaled
from ..formats.minifloat import E4M3_MAX, e4m3_decode, e4m3_encode

FORMATS = ("nvfp4", "fp8-tensor", "fp8-channel", "fp8-block128", "fp8-block128-e8m0")
CONVENTIONS = blockscaled.NVFP4_CONVENTIONS
FP8_BLOCK = (128, 128)
_FP32_EPS = np.finfo(np.float32).eps     # compressed-tensors' zero-scale replacement for float32 scales
_FP8_MAX = np.float32(E4M3_MAX)
_NVFP4_RANGE = np.float32(6.0 * E4M3_MAX)    # 2688 = E2M1 max * E4M3 max

Tensors = dict[str, tuple[np.ndarray, str]]   # suffix -> (array, safetensors dtype)
Specs = dict[str, tuple[tuple[int, ...], str]]   # suffix -> (shape, safetensors dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Encoding:
    """One sidecar encoding: its name, its suffixes with their roles, and its codec."""

    name: str
    weight_suffix: str
    roles: dict[str, str]                         # suffix -> role, weight first
    input_suffix: str | None
    _encode: Callable[[np.ndarray, float | None], Tensors]
    _decode: Callable[[dict[str, np.ndarray]], np.ndarray]
    _specs: Callable[[int, int], Specs]
    _input: Callable[[float], np.ndarray] | None = None
    col_block: int = 1                            # columns a row length must be a multiple of

    @property
    def weight_suffixes(self) -> tuple[str, ...]:
        return tuple(self.roles)

    def encode(self, w: np.ndarray, group_amax: float | None = None) -> Tensors:
        """float32 [M, N] or [E, M, N] -> {suffix: (array, dtype)}; ``group_amax`` is the fused group's amax."""
        if w.ndim == 2:
            return self._encode(w, group_amax)
        if w.ndim != 3:
            raise EncodeError(f"{self.name}: expected a 2-D or fused 3-D weight, got shape {w.shape}")
        per_expert = [self._encode(w[e], None) for e in range(w.shape[0])]
        out = {}
        for suffix, (first, dtype) in per_expert[0].items():
            stacked = np.stack([p[suffix][0] for p in per_expert])
            out[suffix] = (stacked.reshape(w.shape[0]) if first.size == 1 else stacked, dtype)
        return out

    def output_specs(self, shape: tuple[int, ...]) -> Specs:
        """The stored (shape, dtype) of every tensor :meth:`encode` gives for a weight of ``shape``."""
        if len(shape) == 2:
            return self._specs(*shape)
        if len(shape) != 3:
            raise EncodeError(f"{self.name}: expected a 2-D or fused 3-D weight, got shape {list(shape)}")
        return {suffix: ((shape[0],) if int(np.prod(s)) == 1 else (shape[0], *s), dtype)
                for suffix, (s, dtype) in self._specs(*shape[1:]).items()}

    def input_spec(self) -> tuple[tuple[int, ...], str] | None:
        """(shape, dtype) of the stored activation scale, or None."""
        return None if self._input is None else (self._input(1.0).shape, "F32")

    def decode(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """{suffix: array} as stored -> float32 weight (fused 3-D decoded per expert)."""
        w = tensors[self.weight_suffix]
        if w.ndim == 2:
            return self._decode(tensors)
        # a fused [E, M, N] weight: per-expert scales have the expert axis, a single value is shared
        return np.stack([self._decode({s: a if a.size == 1 else a[e] for s, a in tensors.items()})
                         for e in range(w.shape[0])])

    def input_scale(self, amax: float) -> np.ndarray | None:
        """The stored activation scale for an activation amax, or None when the encoding has none."""
        if self._input is None:
            return None
        if not np.isfinite(amax) or amax < 0:
            raise EncodeError(f"{self.name}: activation amax must be finite and >= 0, got {amax}")
        return self._input(amax)

    def check_shape(self, shape: tuple[int, ...], tensor: str) -> None:
        if shape[-1] % self.col_block:
            raise EncodeError(f"{self.name} needs rows that are a multiple of {self.col_block} values, "
                              f"the weight has shape {list(shape)}", tensor=tensor)


# -- NVFP4 ----------------------------------------------------------------------------------------------------

def _nvfp4(convention: str) -> Encoding:
    packed, scale, global_ = blockscaled.NVFP4_TENSORS[convention]
    global_role = "global_scale" if convention == "modelopt" else "global_scale_divisor"

    def encode(w, group_amax):
        parts = blockscaled.nvfp4_quantize(w, convention, global_amax=group_amax)
        return {packed: (parts[packed], "U8"), scale: (parts[scale], "F8_E4M3"), global_: (parts[global_], "F32")}

    def decode(t):
        return blockscaled.nvfp4_dequantize(t[packed], t[scale], t[global_], convention)

    if convention == "modelopt":
        def act(amax):
            return np.asarray(np.float32(amax) / _NVFP4_RANGE, dtype=np.float32).reshape(())
        input_suffix = "input_scale"
    else:
        def act(amax):
            with np.errstate(over="ignore", divide="ignore"):
                gs = (np.float32(1.0) / np.maximum(np.float32(amax), np.finfo(np.float32).tiny)) * _NVFP4_RANGE
            return np.asarray(gs if np.isfinite(gs) else np.float32(1.0), dtype=np.float32).reshape(1)
        input_suffix = "input_global_scale"

    def specs(m, n):
        return {packed: ((m, n // 2), "U8"), scale: ((m, n // blockscaled.NVFP4_BLOCK), "F8_E4M3"),
                global_: ((() if convention == "modelopt" else (1,)), "F32")}

    return Encoding(f"nvfp4-{convention}", packed, {packed: "weight", scale: "block_scale", global_: global_role},
                    input_suffix, encode, decode, specs, act, col_block=blockscaled.NVFP4_BLOCK)


# -- FP8 per tensor / per channel (compressed-tensors float-quantized) ------------------------------------------

def fp8_scaled_quantize(w: np.ndarray, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """float32 [M, N] -> (E4M3 codes uint8 [M, N], F32 scale [1] or [M, 1]); see the module docstring."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max(initial=0.0).reshape(1)
    scale = (amax / _FP8_MAX).astype(np.float32)
    scale = np.where(scale == 0, _FP32_EPS, scale).astype(np.float32)
    # + 0.0: compressed-tensors adds its (zero) zero point, which turns -0.0 into +0.0 (code 0x00, not 0x80)
    return e4m3_encode(np.clip(w / scale, -_FP8_MAX, _FP8_MAX) + np.float32(0.0)), scale


def fp8_scaled_dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """E4M3 codes [M, N] and a F32 scale [1] / [M, 1] -> float32 f32(e4m3 * s)."""
    c = np.asarray(codes)
    s = np.asarray(scale)
    if s.dtype != np.float32 or (s.size != 1 and s.shape != (c.shape[0], 1)):
        raise FormatError(f"FP8 weight_scale must be one F32 value or [{c.shape[0]}, 1] for weight shape "
                          f"{list(c.shape)}, found {s.dtype} {list(s.shape)}", field="weight_scale")
    return e4m3_decode(c) * (s.reshape(1) if s.size == 1 else s)


def _fp8_scaled(per_channel: bool) -> Encoding:
    def encode(w, group_amax):
        codes, scale = fp8_scaled_quantize(w, per_channel)
        return {"weight": (codes, "F8_E4M3"), "weight_scale": (scale, "F32")}

    def act(amax):
        scale = np.float32(amax) / _FP8_MAX
        return np.asarray(scale if scale > 0 else _FP32_EPS, dtype=np.float32).reshape(1)

    def specs(m, n):
        return {"weight": ((m, n), "F8_E4M3"), "weight_scale": (((m, 1) if per_channel else (1,)), "F32")}

    return Encoding("fp8-channel" if per_channel else "fp8-tensor", "weight",
                    {"weight": "weight", "weight_scale": "scale"}, "input_scale", encode,
                    lambda t: fp8_scaled_dequantize(t["weight"], t["weight_scale"]), specs, act)


# -- FP8 128x128 blocks ---------------------------------------------------------------------------------------

def _fp8_block(e8m0: bool, scale_suffix: str) -> Encoding:
    def encode(w, group_amax):
        if e8m0:
            codes, scales = blockscaled.fp8_block_quantize_e8m0(w, FP8_BLOCK)
            return {"weight": (codes, "F8_E4M3"), scale_suffix: (scales, "F8_E8M0")}
        codes, scale_inv = blockscaled.fp8_block_quantize(w, FP8_BLOCK)
        return {"weight": (codes, "F8_E4M3"), scale_suffix: (scale_inv, "F32")}

    def decode(t):
        if e8m0:
            return blockscaled.fp8_block_dequantize_e8m0(t["weight"], t[scale_suffix], FP8_BLOCK)
        return blockscaled.fp8_block_dequantize(t["weight"], t[scale_suffix], FP8_BLOCK)

    def specs(m, n):
        grid = (_cdiv(m, FP8_BLOCK[0]), _cdiv(n, FP8_BLOCK[1]))
        return {"weight": ((m, n), "F8_E4M3"), scale_suffix: (grid, "F8_E8M0" if e8m0 else "F32")}

    return Encoding("fp8-block128-e8m0" if e8m0 else "fp8-block128", "weight",
                    {"weight": "weight", scale_suffix: "block_scale"}, None, encode, decode, specs)


def get_encoding(fmt: str, convention: str | None = None, *, e8m0_scale_suffix: str = "weight_scale_inv") -> Encoding:
    """The encoding of ``--format fmt`` (NVFP4 needs a ``convention``; FP8 takes none).

    ``e8m0_scale_suffix`` names E8M0 block scales: ``weight_scale_inv`` (transformers) or ``scale`` (DeepSeek V4
    upstream names)."""
    if fmt not in FORMATS:
        raise UnsupportedError(f"unknown sidecar format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "nvfp4":
        if convention not in CONVENTIONS:
            raise RecipeError(f"NVFP4 needs a convention, one of {', '.join(CONVENTIONS)}; got {convention!r}")
        return _nvfp4(convention)
    if convention is not None:
        raise RecipeError(f"--convention applies to nvfp4 only; {fmt} scales are multipliers in every convention")
    if fmt in ("fp8-tensor", "fp8-channel"):
        return _fp8_scaled(fmt == "fp8-channel")
    e8m0 = fmt == "fp8-block128-e8m0"
    return _fp8_block(e8m0, e8m0_scale_suffix if e8m0 else "weight_scale_inv")


def encoding_by_name(name: str, suffixes: set[str] | None = None) -> Encoding:
    """An encoding from its manifest name (``nvfp4-modelopt``, ``fp8-block128-e8m0`` ...); ``suffixes`` (the
    stored ones) picks the E8M0 scale naming."""
    if name.startswith("nvfp4-"):
        return get_encoding("nvfp4", name.removeprefix("nvfp4-"))
    scale = "scale" if suffixes is not None and "scale" in suffixes else "weight_scale_inv"
    return get_encoding(name, e8m0_scale_suffix=scale)
