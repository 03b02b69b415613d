"""Small float codecs: FP8 E4M3fn, FP8 E5M2, E8M0 and FP4 E2M1, as numpy code <-> float32 functions.

Codes are ``uint8`` arrays (one code per byte; FP4 codes in 0..15).  Decoders also accept ``int8`` and the 1-byte
``ml_dtypes`` types (their bytes are the codes).  Every decoder is exact: each code's value is a float32.

Layouts (sign bit first; ``e`` the exponent field, ``m`` the mantissa field, ``M`` mantissa bits, ``B`` bias):
value = (-1)^s * 2^(e-B) * (1 + m/2^M) for e > 0 and (-1)^s * 2^(1-B) * m/2^M for e == 0 (subnormals).

=========  ====  ====  ======  ==================================================================
format     bits  M     bias    specials
=========  ====  ====  ======  ==================================================================
E4M3fn     8     3     7       no inf; 0x7F/0xFF NaN; max 448 (0x7E); subnormals 2^-9 * m
E5M2       8     2     15      IEEE: e=31 is inf (m=0) or NaN (m!=0); max 57344 (0x7B)
E2M1       4     1     1       no inf, no NaN; magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; sign bit 3
E8M0       8     -     127     unsigned exponent only: 2^(c-127) for c in 0..254; 0xFF NaN; no zero
=========  ====  ====  ======  ==================================================================

Encoders take float32 and round to nearest, ties to even (the even mantissa), exactly; the sign bit of the
input is kept, so -0.0 and small negatives that round to zero give the negative-zero code.
Out of range and special inputs:

- E4M3fn saturates: |x| above 448 (and +-inf) gives +-448.  NaN gives 0x7F / 0xFF (by the NaN's sign bit).
  (ml_dtypes and torch instead give NaN for |x| >= 464; quantizers clamp first, so scale codes agree.)
- E5M2 follows IEEE: values that round past 57344 give +-inf (the tie at 61440 rounds to inf), inf stays inf,
  NaN gives 0x7E / 0xFE, as ml_dtypes and torch do.
- E2M1 saturates to +-6 (and +-inf to +-6).  It has no NaN: NaN input raises :class:`EncodeError`.
- E8M0 has no mantissa, so "even" means nothing: ties round up to the larger power of two (1.5 -> 2, 3 -> 4),
  as ml_dtypes and torch do.  Positive values below 2^-127 give code 0 (2^-127).  Zero, negatives, inf, NaN and
  values that round past 2^127 give 0xFF (NaN), as ml_dtypes does (torch maps zero to code 0 and ignores the
  sign).  For float32 subnormal inputs (below 2^-126) we round to the nearest power of two in the linear
  domain; ml_dtypes and torch round some of those differently (1.4 * 2^-127 gives 2^-126 there).

FP4 packing (:func:`pack_fp4` / :func:`unpack_fp4`): byte i of a row holds element 2i in the low nibble and
element 2i+1 in the high nibble (compressed-tensors, ModelOpt, DeepSeek V4 routed experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import EncodeError, FormatError


@dataclass(frozen=True)
class MiniFloat:
    """A sign + exponent + mantissa float of at most 8 bits; ``kind`` says how the top exponent is used."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    kind: str  # "ieee": top exponent is inf/NaN; "fn": only all-ones is NaN; "finite": no specials

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def min_exp(self) -> int:
        """Exponent of the smallest normal value; subnormals share its quantum 2^(min_exp - man_bits)."""
        return 1 - self.bias


E4M3 = MiniFloat("E4M3fn", 4, 3, 7, "fn")
E5M2 = MiniFloat("E5M2", 5, 2, 15, "ieee")
E2M1 = MiniFloat("E2M1", 2, 1, 1, "finite")

E8M0_BIAS = 127
E8M0_NAN = 0xFF


def _decode_table(fmt: MiniFloat) -> np.ndarray:
    """Value of every code, from the layout (float64 arithmetic is exact here), as float32."""
    codes = np.arange(1 << fmt.bits)
    sign = np.where(codes >> (fmt.bits - 1), -1.0, 1.0)
    e = (codes >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
    m = codes & ((1 << fmt.man_bits) - 1)
    magnitude = np.where(e == 0, np.ldexp(m.astype(np.float64), fmt.min_exp - fmt.man_bits),
                         np.ldexp((m + (1 << fmt.man_bits)).astype(np.float64), e - fmt.bias - fmt.man_bits))
    values = sign * magnitude
    top = e == (1 << fmt.exp_bits) - 1
    if fmt.kind == "ieee":
        values = np.where(top & (m == 0), sign * np.inf, np.where(top, np.nan, values))
    elif fmt.kind == "fn":
        values = np.where(top & (m == (1 << fmt.man_bits) - 1), np.nan, values)
    return values.astype(np.float32)


E4M3_VALUES = _decode_table(E4M3)
E5M2_VALUES = _decode_table(E5M2)
E2M1_VALUES = _decode_table(E2M1)
#: Largest finite code of each format's positive half, and its value.
E4M3_MAX_CODE, E5M2_MAX_CODE, E2M1_MAX_CODE = 0x7E, 0x7B, 0x7
E4M3_MAX = float(E4M3_VALUES[E4M3_MAX_CODE])    # 448
E5M2_MAX = float(E5M2_VALUES[E5M2_MAX_CODE])    # 57344
E2M1_MAX = float(E2M1_VALUES[E2M1_MAX_CODE])    # 6
E8M0_VALUES = np.append(np.ldexp(np.float32(1), np.arange(256 - 1) - E8M0_BIAS).astype(np.float32),
                        np.float32(np.nan))


def as_codes(codes, what: str = "codes") -> np.ndarray:
    """View a 1-byte array (uint8, int8, ml_dtypes float8/float4) as its uint8 codes, without copying."""
    a = np.asarray(codes)
    if a.dtype.itemsize != 1:
        raise FormatError(f"{what}: expected 1-byte codes (uint8/int8/float8), got dtype {a.dtype}")
    return a.view(np.uint8)


def _round_to(fmt: MiniFloat, x) -> np.ndarray:
    """Round float32 ``x`` to ``fmt``; returns the unsigned code as int32, unclamped (may exceed the max code).

    With ``e`` the exponent of the leading bit of |x|, clamped below at ``min_exp``, the quantum is
    2^(e - M) and q = rint(|x| / quantum) (np.rint: ties to even; the scaling is exact).  The code is then
    ((e - min_exp) << M) + q: q in [2^M, 2^(M+1)] for normals, where q == 2^(M+1) carries into the next
    exponent, and q < 2^M for subnormals.  Infinity rounds as the largest float32 (past every max code);
    NaN gives 0 here and callers replace it.
    """
    a = np.nan_to_num(np.abs(x), nan=0.0, posinf=np.finfo(np.float32).max)
    _, e2 = np.frexp(a)  # a = f * 2**e2 with f in [0.5, 1): the leading bit is 2**(e2 - 1); frexp(0) = (0, 0)
    e = np.maximum(np.where(a > 0, e2 - 1, fmt.min_exp), fmt.min_exp)
    q = np.rint(np.ldexp(a, fmt.man_bits - e)).astype(np.int32)
    return ((e - fmt.min_exp) << fmt.man_bits) + q


def _sign_bit(x: np.ndarray, fmt: MiniFloat) -> np.ndarray:
    return ((x.view(np.uint32) >> 31).astype(np.uint8) << (fmt.bits - 1)).astype(np.uint8)


def _as_float32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def e4m3_encode(x) -> np.ndarray:
    """float32 -> FP8 E4M3fn codes; ties to even; saturates at +-448; NaN -> 0x7F/0xFF."""
    x = _as_float32(x)
    code = np.minimum(_round_to(E4M3, x), E4M3_MAX_CODE).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0x7F), code)
    return code | _sign_bit(x, E4M3)


def e5m2_encode(x) -> np.ndarray:
    """float32 -> FP8 E5M2 codes; ties to even; overflow and inf -> inf (0x7C); NaN -> 0x7E (IEEE)."""
    x = _as_float32(x)
    inf_code = E5M2_MAX_CODE + 1
    code = np.minimum(_round_to(E5M2, x), inf_code).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0x7E), code)
    return code | _sign_bit(x, E5M2)


def e2m1_encode(x) -> np.ndarray:
    """float32 -> FP4 E2M1 codes (0..15, one per byte); ties to even; saturates at +-6; NaN raises."""
    x = _as_float32(x)
    if np.isnan(x).any():
        raise EncodeError("FP4 E2M1 has no NaN: NaN input at flat index "
                          f"{int(np.flatnonzero(np.isnan(x))[0])}")
    code = np.minimum(_round_to(E2M1, x), E2M1_MAX_CODE).astype(np.uint8)
    return code | _sign_bit(x, E2M1)


def e8m0_encode(x) -> np.ndarray:
    """float32 -> E8M0 codes: nearest power of two, ties up; see the module docstring for specials."""
    x = _as_float32(x)
    ok = np.isfinite(x) & (x > 0)
    f, e2 = np.frexp(np.where(ok, x, np.float32(1)))  # x = f * 2**e2, f in [0.5, 1)
    # x lies in [2^(e2-1), 2^e2); the midpoint 1.5 * 2^(e2-1) is f = 0.75.
    code = np.maximum(e2 - 1 + E8M0_BIAS + (f >= 0.75), 0)
    return np.where(ok & (code < E8M0_NAN), code, E8M0_NAN).astype(np.uint8)


def e8m0_from_exponent(exponent) -> np.ndarray:
    """E8M0 code of 2^exponent, for integer exponents in [-127, 127] (outside: FormatError)."""
    exponent = np.asarray(exponent)
    if exponent.size and (exponent.min() < -E8M0_BIAS or exponent.max() > E8M0_BIAS):
        raise FormatError(f"E8M0 exponent out of range [-127, 127]: found {int(exponent.min())}.."
                          f"{int(exponent.max())}")
    return (exponent + E8M0_BIAS).astype(np.uint8)


def e4m3_decode(codes) -> np.ndarray:
    """FP8 E4M3fn codes -> float32 (exact)."""
    return E4M3_VALUES[as_codes(codes, "E4M3 codes")]


def e5m2_decode(codes) -> np.ndarray:
    """FP8 E5M2 codes -> float32 (exact)."""
    return E5M2_VALUES[as_codes(codes, "E5M2 codes")]


def e8m0_decode(codes) -> np.ndarray:
    """E8M0 codes -> float32 2^(c-127) (exact; code 0 is the float32 subnormal 2^-127); 0xFF -> NaN."""
    return E8M0_VALUES[as_codes(codes, "E8M0 codes")]


def e2m1_decode(codes) -> np.ndarray:
    """FP4 E2M1 codes (0..15, one per byte) -> float32 (exact); a code above 15 raises FormatError."""
    c = as_codes(codes, "E2M1 codes")
    if c.size and c.max() > 0x0F:
        raise FormatError(f"E2M1 codes must be 0..15, found {int(c.max())}")
    return E2M1_VALUES[c]


def pack_fp4(codes) -> np.ndarray:
    """FP4 codes [..., n] (n even) -> bytes [..., n/2]: element 2i in the low nibble, 2i+1 in the high."""
    c = as_codes(codes, "FP4 codes")
    if c.ndim == 0 or c.shape[-1] % 2:
        raise FormatError(f"FP4 packing needs an even last dimension, got shape {c.shape}")
    if c.size and c.max() > 0x0F:
        raise FormatError(f"FP4 codes must be 0..15, found {int(c.max())}")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed) -> np.ndarray:
    """Bytes [..., m] -> FP4 codes [..., 2m] (the inverse of :func:`pack_fp4`)."""
    p = as_codes(packed, "packed FP4")
    if p.ndim == 0:
        raise FormatError("packed FP4 must have at least one dimension")
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out
