"""ggml's scalar C idioms as vectorized numpy, for the readable reference encoders.

Each function mirrors one C expression of ``ggml-quants.c`` (x86-64 build, no fused multiply-add) on float32
arrays, element by element:

- :func:`c_int`: ``(int)v`` — truncation; NaN, ±inf and |v| ≥ 2³¹ give INT32_MIN (what cvttss2si returns).
  Stores into ``int8_t``/``uint8_t`` keep the low byte (:func:`low_byte`, :func:`as_int8`).
- :func:`roundf`: C ``roundf`` — round half away from zero.
- :func:`nearest_int`: ggml's ``nearest_int`` — add 1.5·2²³ in float32 and read the low 22 mantissa bits:
  round half to even for |v| < 2²² (NaN gives 0).
- :func:`first_argmax`: the index a ``if (a < v[j])`` / ``if (v[j] > a)`` scan keeps: the first maximum.
- :func:`f16_bits`: ``GGML_FP32_TO_FP16`` — IEEE round to nearest even, overflow to ±inf, NaN to ±0x7E00.
- :func:`seq_sum`: a float32 ``s += term(j)`` loop in index order (np.sum would sum pairwise and round
  differently).
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
_INT32_MIN = np.int64(-2147483648)
_TWO_POW_31 = F32(2.0 ** 31)
_ROUND_MAGIC = F32(12582912.0)  # 1.5 * 2**23


def c_int(v: np.ndarray) -> np.ndarray:
    """``(int)v`` on x86 as int64: truncation toward zero, INT32_MIN when out of range or NaN."""
    ok = np.abs(v) < _TWO_POW_31
    return np.where(ok, np.where(ok, v, F32(0)).astype(np.int64), _INT32_MIN)


def low_byte(i: np.ndarray) -> np.ndarray:
    """An int stored into ``uint8_t``: its low byte."""
    return (np.asarray(i) & 0xFF).astype(np.uint8)


def as_int8(i: np.ndarray) -> np.ndarray:
    """An int stored into ``int8_t``: its low byte, signed (int64 result)."""
    return ((np.asarray(i, dtype=np.int64) + 128) & 0xFF) - 128


def roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` (half away from zero) of float32 ``v``, as float32."""
    t = np.trunc(v)
    with np.errstate(invalid="ignore"):
        frac = v - t  # exact: the fractional part of a float32
    return np.where(frac >= F32(0.5), t + F32(1), np.where(frac <= F32(-0.5), t - F32(1), t)).astype(F32)


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int`` of float32 ``v`` (int64)."""
    with np.errstate(invalid="ignore", over="ignore"):
        biased = (np.asarray(v, dtype=F32) + _ROUND_MAGIC).astype(F32)
    return (biased.view(np.int32).astype(np.int64) & 0x007FFFFF) - 0x00400000


def first_argmax(a: np.ndarray) -> np.ndarray:
    """Index of the first maximum along the last axis (keepdims), as a strict ``>`` scan finds it."""
    return np.argmax(a, axis=-1)[..., None]


def take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[..., idx]`` per row, keeping dims."""
    return np.take_along_axis(a, idx, axis=-1)


def f16_bits(v: np.ndarray) -> np.ndarray:
    """float32 → IEEE half, as little-endian bytes [..., 2] (uint8)."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.asarray(v, dtype=F32).astype("<f2")
    return h.view(np.uint8).reshape(h.shape + (2,))


def seq_sum(terms: np.ndarray, start=None) -> np.ndarray:
    """Σ over the last axis, accumulated in float32 in index order from ``start`` (default 0)."""
    s = np.zeros(terms.shape[:-1], F32) if start is None else np.asarray(start, dtype=F32).copy()
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(terms.shape[-1]):
            s = (s + terms[..., j]).astype(F32)
    return s


def safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """float32 ``num / den`` with C semantics (x/0 = ±inf or NaN) and no numpy warnings."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (np.asarray(num, dtype=F32) / np.asarray(den, dtype=F32)).astype(F32)


def recip_or_zero(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` (NaN is true in C)."""
    return np.where(d != F32(0), safe_div(F32(1), d), F32(0)).astype(F32)
