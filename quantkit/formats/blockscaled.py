"""Block-scaled source encodings of released checkpoints: encoders and exact decoders (pure functions, no I/O).

All functions take and return 2-D arrays ``[rows, n]`` (one matrix; callers slice fused experts).  Codes are
``uint8`` (1-byte ml_dtypes arrays are accepted as input).  Shapes are checked; a scale array whose shape does
not match the weight raises :class:`FormatError` naming the expected and found shapes.

**DeepSeek V3 FP8** (``quant_method: fp8``, ``weight_block_size: [128, 128]``): weight F8_E4M3 ``[M, N]`` and
``<weight>_scale_inv`` F32 ``[ceil(M/b0), ceil(N/b1)]``; edge blocks are partial.  Decode: w = f32(e4m3 * s),
one float32 rounding of the exact product (as ``weight.float() * scale`` does).  Encode (ours; releases ship
without their quantizer): amax per block floored at :data:`AMAX_FLOOR`, s = f32(amax / 448),
codes = e4m3(f32(w / s)) saturating.

**DeepSeek V4 FP8** (``scale_fmt: ue8m0``): weight F8_E4M3 and ``<prefix>.scale`` F8_E8M0 per block.  Decode:
w = e4m3 * 2^(c-127), exact.  Encode: s = 2^ceil(log2(amax / 448)) (the power of two at or above amax/448, as
DeepSeek's ``fast_round_scale``), so w / s never saturates; codes = e4m3(w / s).

**Packed FP4 + E8M0 per 32** (V4 routed experts, OCP MX layout): ``weight`` I8 ``[rows, n/2]`` (byte i: element
2i low nibble, 2i+1 high) and ``scale`` E8M0 ``[rows, n/32]``.  Decode: e2m1 * 2^(c-127), exact.  Encode:
s = 2^ceil(log2(amax / 6)) (the ModelOpt / DeepSeek convention; GGUF's MXFP4 uses floor(log2 amax) - 2).

**NVFP4**: blocks of 16 along the row, E4M3 block scale, F32 per-tensor scale; packing as above.

- ModelOpt: ``weight`` U8, ``weight_scale`` E4M3 = e4m3(clamp(f32(amax_blk / f32(6 * gs)), 2^-9, 448)) with a
  zero block scale replaced by 1.0, ``weight_scale_2`` gs = f32(amax / 2688) (a multiplier, shape ``()``).
  Quantize: e2m1(f32(w / f32(scale * gs))).  Decode: f32(e2m1 * f32(scale * gs)).
- compressed-tensors: ``weight_packed`` U8, ``weight_scale`` E4M3 = e4m3(clamp(f32(gs * f32(amax_blk / 6)),
  +-448)) with a zero scale replaced by 0.125 (its FP8 eps), ``weight_global_scale``
  gs = f32(f32(1 / amax) * 2688) (torch's scalar / tensor; a divisor, shape ``(1,)``; amax floored at the
  smallest normal float32, a non-finite gs -> 1.0).
  Quantize: e2m1(clamp(f32(w / f32(scale / gs)), +-6)).  Decode: f32(e2m1 * f32(scale / gs)) -- the float32
  values compressed-tensors computes before its final cast to the model dtype.

Both references give a scaled value that is -0.0 (or rounds to zero from above) the code 0, and a negative value
that rounds to zero the code 8; we match that.  For an all-zero tensor ModelOpt would divide 0 by 0; we use
gs = 1.0 there (compressed-tensors does the same through its non-finite rule).
"""
from __future__ import annotations

import numpy as np

from ..errors import EncodeError, FormatError
from .minifloat import (E2M1_MAX, E4M3_MAX, as_codes, e2m1_decode, e2m1_encode, e4m3_decode,
                        e4m3_encode, e8m0_decode, e8m0_from_exponent, pack_fp4, unpack_fp4)

#: Block amax floor of our FP8/FP4 encoders (the clamp DeepSeek's V3.2 inference ``act_quant`` applies): keeps a
#: zero block's scale finite and non-zero.
AMAX_FLOOR = np.float32(1e-4)
#: Default DeepSeek FP8 block shape (``weight_block_size``).
DEFAULT_BLOCK = (128, 128)
MX_BLOCK = 32       # FP4 + E8M0 group along the row
NVFP4_BLOCK = 16    # NVFP4 group along the row
NVFP4_CONVENTIONS = ("modelopt", "compressed-tensors")
#: Keys of :func:`nvfp4_quantize`'s result per convention: packed weight, block scale, global scale.
NVFP4_TENSORS = {
    "modelopt": ("weight", "weight_scale", "weight_scale_2"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale"),
}
_E4M3_MIN_SUBNORMAL = np.float32(2.0 ** -9)
_CT_ZERO_SCALE = np.float32(0.125)   # compressed-tensors' eps for FP8 scales
_NVFP4_GLOBAL = np.float32(E2M1_MAX * E4M3_MAX)   # 2688


# ----------------------------------------------------------------------------------------------------------------
# shared helpers

def _matrix(w, what: str) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise EncodeError(f"{what}: expected a 2-D [rows, n] array, got shape {w.shape}")
    if not np.isfinite(w).all():
        row = int(np.argwhere(~np.isfinite(w))[0][0])
        raise EncodeError(f"{what}: non-finite value in row {row}")
    return w


def _check_block(block) -> tuple[int, int]:
    b = tuple(int(v) for v in block)
    if len(b) != 2 or min(b) <= 0:
        raise FormatError(f"block shape must be two positive ints, got {block!r}")
    return b


def _grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _check_scale_shape(scale: np.ndarray, expected: tuple[int, ...], what: str, weight_shape) -> None:
    if scale.shape != tuple(expected):
        raise FormatError(f"{what} has shape {scale.shape}, expected {tuple(expected)} for weight shape "
                          f"{tuple(weight_shape)}", field=what)


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """max |w| of each 2-D block; edge blocks are padded with zeros (which do not change a max of |w|)."""
    gr, gc = _grid(w.shape, block)
    padded = np.zeros((gr * block[0], gc * block[1]), dtype=np.float32)
    padded[:w.shape[0], :w.shape[1]] = np.abs(w)
    return padded.reshape(gr, block[0], gc, block[1]).max(axis=(1, 3))


def _expand(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """Per-block values broadcast to every element of a ``shape`` matrix (edge blocks cropped)."""
    return np.repeat(np.repeat(scale, block[0], axis=0)[:shape[0]], block[1], axis=1)[:, :shape[1]]


def _ceil_log2(x: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(x)) of positive finite float32 values (x = f * 2^e, f in [0.5, 1))."""
    f, e = np.frexp(x)
    return np.where(f == 0.5, e - 1, e)


def _pow2_scale_codes(amax: np.ndarray, qmax: float) -> np.ndarray:
    """E8M0 code of 2^ceil(log2(max(amax, AMAX_FLOOR) / qmax)) (float32 amax keeps it inside E8M0's range)."""
    return e8m0_from_exponent(_ceil_log2(np.maximum(amax, AMAX_FLOOR) / np.float32(qmax)))


def _e2m1_codes(scaled: np.ndarray) -> np.ndarray:
    """e2m1 codes of scaled values; adding +0.0 maps -0.0 to +0.0 so it gets code 0 as the references give."""
    return e2m1_encode(scaled + np.float32(0.0))


def _packed_fp4_values(packed, scales, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Unpacked e2m1 values [rows, n_blocks, block] and scale codes [rows, n_blocks], shapes checked."""
    p = as_codes(packed, "packed FP4")
    s = as_codes(scales, "FP4 block scales")
    if p.ndim != 2:
        raise FormatError(f"packed FP4 must be 2-D [rows, n/2], got shape {p.shape}")
    n = 2 * p.shape[1]
    if n % block:
        raise FormatError(f"packed FP4 row has {n} values, not a multiple of the scale block {block}")
    _check_scale_shape(s, (p.shape[0], n // block), "block scales", (p.shape[0], n))
    values = e2m1_decode(unpack_fp4(p)).reshape(p.shape[0], n // block, block)
    return values, s


# ----------------------------------------------------------------------------------------------------------------
# DeepSeek V3: FP8 E4M3 + F32 scale_inv per block

def fp8_block_quantize(w, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 [M, N] -> (E4M3 codes uint8 [M, N], scale_inv float32 [ceil(M/b0), ceil(N/b1)])."""
    w = _matrix(w, "fp8_block_quantize")
    block = _check_block(block)
    scale = np.maximum(_block_amax(w, block), AMAX_FLOOR) / np.float32(E4M3_MAX)
    return e4m3_encode(w / _expand(scale, block, w.shape)), scale


def fp8_block_dequantize(codes, scale_inv, block=DEFAULT_BLOCK) -> np.ndarray:
    """E4M3 codes [M, N] and F32 scale_inv per block -> float32 f32(e4m3 * scale_inv)."""
    c = as_codes(codes, "FP8 weight")
    block = _check_block(block)
    s = np.asarray(scale_inv)
    if c.ndim != 2:
        raise FormatError(f"FP8 weight must be 2-D, got shape {c.shape}")
    if s.dtype != np.float32:
        raise FormatError(f"scale_inv must be float32, got {s.dtype}", field="scale_inv")
    _check_scale_shape(s, _grid(c.shape, block), "scale_inv", c.shape)
    return e4m3_decode(c) * _expand(s, block, c.shape)


# ----------------------------------------------------------------------------------------------------------------
# DeepSeek V4: FP8 E4M3 + E8M0 per block

def fp8_block_quantize_e8m0(w, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 [M, N] -> (E4M3 codes uint8 [M, N], E8M0 scale codes uint8 [ceil(M/b0), ceil(N/b1)])."""
    w = _matrix(w, "fp8_block_quantize_e8m0")
    block = _check_block(block)
    scales = _pow2_scale_codes(_block_amax(w, block), E4M3_MAX)
    return e4m3_encode(w / _expand(e8m0_decode(scales), block, w.shape)), scales


def fp8_block_dequantize_e8m0(codes, scales, block=DEFAULT_BLOCK) -> np.ndarray:
    """E4M3 codes [M, N] and E8M0 codes per block -> float32 e4m3 * 2^(c-127) (exact)."""
    c = as_codes(codes, "FP8 weight")
    s = as_codes(scales, "E8M0 block scales")
    block = _check_block(block)
    if c.ndim != 2:
        raise FormatError(f"FP8 weight must be 2-D, got shape {c.shape}")
    _check_scale_shape(s, _grid(c.shape, block), "scale", c.shape)
    return e4m3_decode(c) * _expand(e8m0_decode(s), block, c.shape)


# ----------------------------------------------------------------------------------------------------------------
# Packed FP4 E2M1 + E8M0 per 32 along the row (DeepSeek V4 routed experts)

def fp4_e8m0_quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, n] (n % 32 == 0) -> (packed int8 [rows, n/2], E8M0 codes uint8 [rows, n/32])."""
    w = _matrix(w, "fp4_e8m0_quantize")
    rows, n = w.shape
    if n % MX_BLOCK:
        raise EncodeError(f"fp4_e8m0_quantize: row length {n} is not a multiple of {MX_BLOCK}")
    blocks = w.reshape(rows, n // MX_BLOCK, MX_BLOCK)
    scales = _pow2_scale_codes(np.abs(blocks).max(axis=2), E2M1_MAX)
    codes = _e2m1_codes(blocks / e8m0_decode(scales)[..., None]).reshape(rows, n)
    return pack_fp4(codes).view(np.int8), scales


def fp4_e8m0_dequantize(packed, scales) -> np.ndarray:
    """Packed FP4 [rows, n/2] (int8 or uint8) and E8M0 codes [rows, n/32] -> float32 [rows, n] (exact)."""
    values, s = _packed_fp4_values(packed, scales, MX_BLOCK)
    return (values * e8m0_decode(s)[..., None]).reshape(values.shape[0], -1)


# ----------------------------------------------------------------------------------------------------------------
# NVFP4: FP4 E2M1, E4M3 scale per 16, F32 per-tensor scale; ModelOpt and compressed-tensors conventions

def _check_convention(convention: str) -> None:
    if convention not in NVFP4_CONVENTIONS:
        raise FormatError(f"unknown NVFP4 convention {convention!r}; expected one of {NVFP4_CONVENTIONS}")


def nvfp4_quantize(w, convention: str, global_amax: float | None = None) -> dict[str, np.ndarray]:
    """float32 [rows, n] (n % 16 == 0) -> {suffix: array}, keys :data:`NVFP4_TENSORS` [convention].

    ``global_amax`` replaces max|w| in the global scale (engines want one global scale per fused q/k/v or
    gate/up group: pass the group's amax).  Block scales are E4M3 codes (uint8), the packed weight uint8.
    """
    _check_convention(convention)
    w = _matrix(w, "nvfp4_quantize")
    rows, n = w.shape
    if n % NVFP4_BLOCK:
        raise EncodeError(f"nvfp4_quantize: row length {n} is not a multiple of {NVFP4_BLOCK}")
    amax = np.float32(np.abs(w).max(initial=0.0) if global_amax is None else global_amax)
    if not np.isfinite(amax) or amax < 0:
        raise EncodeError(f"nvfp4_quantize: global amax must be finite and >= 0, got {amax}")
    blocks = w.reshape(rows, n // NVFP4_BLOCK, NVFP4_BLOCK)
    amax_blk = np.abs(blocks).max(axis=2)
    if convention == "modelopt":
        gs = amax / _NVFP4_GLOBAL if amax > 0 else np.float32(1.0)
        per_block = amax_blk / (np.float32(E2M1_MAX) * gs)
        per_block = np.where(per_block == 0, np.float32(1.0), per_block)
        scale_codes = e4m3_encode(np.clip(per_block, _E4M3_MIN_SUBNORMAL, np.float32(E4M3_MAX)))
        effective = e4m3_decode(scale_codes) * gs
        codes = _e2m1_codes(blocks / effective[..., None])
        global_out = np.asarray(gs, dtype=np.float32).reshape(())
    else:
        # torch evaluates ``2688 / amax`` (python scalar over tensor) as reciprocal(amax) * 2688; for a tiny
        # amax that overflows to inf, which the non-finite rule below turns into 1.0.
        with np.errstate(over="ignore"):
            gs = (np.float32(1.0) / np.maximum(amax, np.finfo(np.float32).tiny)) * _NVFP4_GLOBAL
        gs = gs if np.isfinite(gs) else np.float32(1.0)
        per_block = gs * (amax_blk / np.float32(E2M1_MAX))
        scale_codes = e4m3_encode(np.clip(per_block, -np.float32(E4M3_MAX), np.float32(E4M3_MAX)))
        scale_codes = np.where(e4m3_decode(scale_codes) == 0, e4m3_encode(_CT_ZERO_SCALE), scale_codes)
        effective = e4m3_decode(scale_codes) / gs
        scaled = np.clip(blocks / effective[..., None], -np.float32(E2M1_MAX), np.float32(E2M1_MAX))
        codes = _e2m1_codes(scaled)
        global_out = np.asarray(gs, dtype=np.float32).reshape(1)
    packed_key, scale_key, global_key = NVFP4_TENSORS[convention]
    return {packed_key: pack_fp4(codes.reshape(rows, n)), scale_key: scale_codes.astype(np.uint8),
            global_key: global_out}


def nvfp4_dequantize(packed, block_scale, global_scale, convention: str) -> np.ndarray:
    """Packed [rows, n/2], E4M3 block scales [rows, n/16], stored global scale -> float32 [rows, n].

    ``global_scale`` is what the checkpoint stores: ModelOpt's ``weight_scale_2`` (multiplier) or
    compressed-tensors' ``weight_global_scale`` (divisor); one element (shape ``()`` or ``(1,)``).
    """
    _check_convention(convention)
    values, s = _packed_fp4_values(packed, block_scale, NVFP4_BLOCK)
    g = np.asarray(global_scale)
    if g.size != 1 or g.dtype != np.float32:
        raise FormatError(f"NVFP4 global scale must be one float32 value, got dtype {g.dtype} shape {g.shape}",
                          field="global_scale")
    g = g.reshape(())
    scale = e4m3_decode(s) * g if convention == "modelopt" else e4m3_decode(s) / g
    return (values * scale[..., None]).reshape(values.shape[0], -1)
