"""Fast decoders: bit-identical to ggml's ``dequantize_row_*`` and to gguf-py's ``quants.dequantize``.

The references are ggml itself (libggml-base through ctypes) and gguf-py; nothing is compared with quantkit's
own earlier output.  Payloads are random bytes with every f16 (or f32) scale field forced finite, blocks ggml
quantized itself, and fully random bytes (non-finite scales: then NaN positions must agree, payloads may not).
"""
import ctypes
import warnings

import numba
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

import quantkit
from quantkit.errors import FormatError
from quantkit.formats import GGMLType, get_format
from quantkit.formats.api import NUMPY_DECODE_VALUES, decode
from quantkit.kernels.dequant import FAST_DECODERS

# Byte offsets of each type's little-endian f16 scale fields (ggml-common.h).  Random payloads get finite
# halves there so every decoded weight is finite and can be compared bit for bit.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q1_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "TQ1_0": [52], "TQ2_0": [64], "IQ4_NL": [0], "IQ4_XS": [0],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
}
F16_EXP = 0x7C00
F32_EXP = 0x7F800000


def _gguf_decodes(qtype) -> bool:
    try:
        gguf_dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
        return True
    except NotImplementedError:
        return False


GGUF_TYPES = [t for t in GGML_QUANT_SIZES if _gguf_decodes(t)]
ALL_TYPES = list(FAST_DECODERS)


def _finite_halves(h: np.ndarray) -> np.ndarray:
    h = h.copy()
    h[(h & F16_EXP) == F16_EXP] &= np.uint16(0xBFFF)     # exponent 31 -> 15
    return h


def random_blocks(qtype: GGMLType, n_blocks: int, seed: int) -> np.ndarray:
    """Random blocks of ``qtype`` whose scale fields hold finite values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    name = qtype.name
    for off in F16_FIELDS.get(name, []):
        b[:, off:off + 2] = _finite_halves(b[:, off:off + 2].copy().view(np.uint16)).view(np.uint8)
    if name == "F16":
        b[:] = _finite_halves(b.view(np.uint16)).view(np.uint8)
    if name in ("F32", "Q8_K"):
        d = b[:, 0:4].copy().view(np.uint32)
        d[(d & F32_EXP) == F32_EXP] &= np.uint32(0xBFFFFFFF)
        b[:, 0:4] = d.view(np.uint8)
    if name == "BF16":
        h = b.view(np.uint16)
        h[(h & 0x7F80) == 0x7F80] &= np.uint16(0xBFFF)
    if name == "IQ1_M":
        # d is spread over the top nibbles of the four u16 scales at 48..55; its exponent's top bit is bit 14
        # of the last one
        sc = b[:, 48:56].copy().view(np.uint16)
        d = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
        b[(d & F16_EXP) == F16_EXP, 55] &= np.uint8(0xBF)
    return b


def ggml_decode(ggml, qtype: GGMLType, blocks: np.ndarray) -> np.ndarray:
    """ggml's own decoder over all blocks: dequantize_row_<t>, or the row converters for F16/BF16."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    n = blocks.shape[0] * block_size
    if qtype in (GGMLType.F16, GGMLType.BF16):
        fn = getattr(ggml.library(), "ggml_fp16_to_fp32_row" if qtype == GGMLType.F16 else "ggml_bf16_to_fp32_row")
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        src = np.ascontiguousarray(blocks)
        y = np.zeros(n, np.float32)
        fn(src.ctypes.data, y.ctypes.data, n)
        return y
    return ggml.dequantize_row(qtype, blocks, n)


def gguf_decode(qtype: GGMLType, blocks: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(gguf_dequantize(blocks.reshape(-1), qtype), np.float32).reshape(-1)


def assert_bits_equal(ours: np.ndarray, ref: np.ndarray, what: str):
    ours = ours.reshape(-1)
    assert ours.dtype == np.float32 and ref.dtype == np.float32 and ours.shape == ref.shape
    diff = np.flatnonzero(ours.view(np.uint32) != ref.view(np.uint32))
    assert diff.size == 0, (f"{what}: {diff.size} weights differ, first at {diff[0]}: "
                            f"{ours[diff[0]]!r} vs {ref[diff[0]]!r}")


def assert_equal_nan_aware(ours: np.ndarray, ref: np.ndarray, what: str):
    """Same bits, or NaN on both sides (NaN payloads depend on operand order, which C leaves free)."""
    ours = ours.reshape(-1)
    same = (ours.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(ours) & np.isnan(ref))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, f"{what}: {bad.size} weights differ, first at {bad[0]}: {ours[bad[0]]!r} vs {ref[bad[0]]!r}"


def test_every_type_gguf_py_decodes_has_a_fast_decoder_in_the_registry():
    assert {GGMLType.F32, GGMLType.F16, GGMLType.Q4_K, GGMLType.IQ2_XXS, GGMLType.NVFP4} <= set(GGUF_TYPES)
    for t in GGUF_TYPES:
        assert t in FAST_DECODERS, t.name
        assert get_format(t).decode_fast is not None, t.name


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_ggml_and_gguf(qtype, ggml):
    n_blocks = 2048 if GGML_QUANT_SIZES[qtype][0] == 1 else 96
    blocks = random_blocks(qtype, n_blocks, seed=int(qtype))
    ours = FAST_DECODERS[qtype](blocks)
    assert ours.shape == (n_blocks, GGML_QUANT_SIZES[qtype][0]) and ours.dtype == np.float32
    assert not np.isnan(ours).any()
    if qtype != GGMLType.F32:          # ggml has no F32 "decoder"; gguf-py's is the raw view
        assert_bits_equal(ours, ggml_decode(ggml, qtype, blocks), f"{qtype.name} vs ggml")
    if qtype in GGUF_TYPES:
        assert_bits_equal(ours, gguf_decode(qtype, blocks), f"{qtype.name} vs gguf-py")


# ggml_quantize_chunk covers every type here except F32 and Q8_K (Q8_K is only an intermediate in ggml).
GGML_ENCODABLE = [t for t in ALL_TYPES if t not in (GGMLType.F32, GGMLType.Q8_K)]


@pytest.mark.parametrize("qtype", GGML_ENCODABLE, ids=lambda t: t.name)
def test_ggml_quantized_tensors_match_ggml_and_gguf(qtype, ggml):
    rng = np.random.default_rng(100 + int(qtype))
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[0, 7] = 40.0                                      # an outlier
    x[1] *= 1e-3                                        # a tiny row
    x[2, :256] = 0.0                                    # an all-zero super-block
    imatrix = rng.uniform(0.1, 2.0, 512).astype(np.float32) if qtype.name.startswith("IQ") else None
    data = ggml.quantize(x, qtype, imatrix)
    fmt = get_format(qtype)
    blocks = data.reshape(-1, fmt.type_size)
    ours = FAST_DECODERS[qtype](blocks)
    assert_bits_equal(ours, ggml_decode(ggml, qtype, blocks), f"{qtype.name} vs ggml")
    if qtype in GGUF_TYPES:
        assert_bits_equal(ours, gguf_decode(qtype, blocks), f"{qtype.name} vs gguf-py")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_unconstrained_bytes_agree_with_ggml_and_gguf_nan_aware(qtype, ggml):
    n_blocks = 4096 if GGML_QUANT_SIZES[qtype][0] == 1 else 512
    blocks = np.random.default_rng(7 + int(qtype)).integers(0, 256, (n_blocks, GGML_QUANT_SIZES[qtype][1]),
                                                            dtype=np.uint8)
    ours = FAST_DECODERS[qtype](blocks)
    if qtype != GGMLType.F32:
        assert_equal_nan_aware(ours, ggml_decode(ggml, qtype, blocks), f"{qtype.name} vs ggml")
    if qtype in GGUF_TYPES:
        assert_equal_nan_aware(ours, gguf_decode(qtype, blocks), f"{qtype.name} vs gguf-py")


def test_f16_and_bf16_every_bit_pattern_exactly_as_ggml(ggml):
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    for qtype in (GGMLType.F16, GGMLType.BF16):
        expected = ggml_decode(ggml, qtype, halves)
        ours = FAST_DECODERS[qtype](halves)
        assert_bits_equal(ours, expected, f"{qtype.name} vs ggml")   # NaN bits too
        assert_equal_nan_aware(ours, gguf_decode(qtype, halves), f"{qtype.name} vs gguf-py")
        # decode() takes the numpy reference below NUMPY_DECODE_VALUES, the numba kernel above: both give ggml's bits
        assert_bits_equal(decode(halves, qtype, (1 << 16,)), expected.reshape(-1), f"{qtype.name} small")
        many = np.tile(halves, (NUMPY_DECODE_VALUES // (1 << 16) + 1, 1))
        assert_bits_equal(decode(many, qtype, (len(many),)), np.tile(expected.reshape(-1), len(many) // len(halves)),
                          f"{qtype.name} large")


def test_small_f32_decode_keeps_every_bit():
    bits = np.random.default_rng(5).integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    bits[:4] = (0x7F800001, 0xFFC00000, 0x00000001, 0x80000000)   # signaling and quiet NaN, subnormal, -0
    assert_bits_equal(decode(bits.view(np.uint8), GGMLType.F32, (len(bits),)), bits.view(np.float32), "F32 small")


def test_every_scale_byte_of_mxfp4_and_nvfp4(ggml):
    nibbles = np.arange(256, dtype=np.uint8)
    mx = np.zeros((256, 17), np.uint8)
    mx[:, 0] = np.arange(256)                           # every E8M0 exponent, including 0, 1 and 0xFF
    mx[:, 1:] = np.roll(nibbles, 3)[:16]
    nv = np.zeros((256, 36), np.uint8)
    nv[:, :4] = np.arange(256)[:, None]                 # every UE4M3 byte, including 0x7F and 0xFF
    nv[:, 4:] = nibbles[np.arange(32) * 7 % 256]
    for qtype, blocks in ((GGMLType.MXFP4, mx), (GGMLType.NVFP4, nv)):
        ours = FAST_DECODERS[qtype](blocks)
        assert_bits_equal(ours, ggml_decode(ggml, qtype, blocks), f"{qtype.name} vs ggml")
        assert_bits_equal(ours, gguf_decode(qtype, blocks), f"{qtype.name} vs gguf-py")


@pytest.mark.parametrize("qtype", [GGMLType.F16, GGMLType.Q4_0, GGMLType.Q6_K, GGMLType.IQ2_XXS, GGMLType.IQ1_M],
                         ids=lambda t: t.name)
def test_result_does_not_depend_on_thread_count(qtype):
    blocks = random_blocks(qtype, 1000, seed=3)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = FAST_DECODERS[qtype](blocks)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = FAST_DECODERS[qtype](blocks)
    finally:
        numba.set_num_threads(threads)
    assert_bits_equal(one, many.reshape(-1), f"{qtype.name} 1 thread vs {numba.config.NUMBA_NUM_THREADS}")


@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.BF16, GGMLType.Q5_1, GGMLType.Q3_K, GGMLType.IQ3_S,
                                   GGMLType.NVFP4], ids=lambda t: t.name)
def test_decode_end_to_end_from_bytes(qtype, ggml):
    fmt = get_format(qtype)
    shape = (2, 3, 512)
    n_blocks = 6 * 512 // fmt.block_size
    raw = random_blocks(qtype, n_blocks, seed=11).tobytes()
    expected = gguf_decode(qtype, np.frombuffer(raw, np.uint8)).reshape(shape)
    for data in (raw, memoryview(raw), np.frombuffer(raw, np.uint8)):
        out = quantkit.decode(data, qtype, shape)
        assert out.shape == shape
        assert_bits_equal(out, expected.reshape(-1), f"decode {qtype.name}")
    with pytest.raises(FormatError, match=f"needs {len(raw)} bytes, got {len(raw) - 1}"):
        quantkit.decode(raw[:-1], qtype, shape)


def test_decoders_reject_misshapen_blocks():
    q4 = FAST_DECODERS[GGMLType.Q4_0]
    with pytest.raises(FormatError, match=r"Q4_0 decoder expects uint8\[n_blocks, 18\].*uint8\[2, 17\]"):
        q4(np.zeros((2, 17), np.uint8))
    with pytest.raises(FormatError, match="float32"):
        q4(np.zeros((2, 18), np.float32))
    with pytest.raises(FormatError, match=r"\[36\]"):
        q4(np.zeros(36, np.uint8))


def test_output_is_a_fresh_array():
    blocks = random_blocks(GGMLType.F32, 8, seed=5)
    before = blocks.copy()
    out = FAST_DECODERS[GGMLType.F32](blocks)
    out[:] = 0
    assert np.array_equal(blocks, before)
    assert np.shares_memory(out, blocks) is False


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_zero_blocks_decode_to_an_empty_array(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    out = FAST_DECODERS[qtype](np.zeros((0, type_size), np.uint8))
    assert out.shape == (0, block_size) and out.dtype == np.float32
