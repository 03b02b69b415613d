"""F32, F16, BF16: encodings byte-equal to ggml's ggml_quantize_chunk, decodings bit-equal to ggml's row
converters and gguf-py."""
import ctypes

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

import quantkit
from quantkit.formats import GGMLType, get_format
from quantkit.testing import corpus

TYPES = ["F32", "F16", "BF16"]


@pytest.mark.parametrize("qtype", TYPES)
def test_encoder_matches_ggml(ggml, qtype):
    reports = corpus.sweep_encoder(ggml, qtype, lengths=[96, 4096])
    assert not reports, "\n".join(reports[:3])


@settings(max_examples=100, deadline=None)
@given(data=st.data(), qtype=st.sampled_from(TYPES))
def test_arbitrary_floats_match_ggml(ggml, data, qtype):
    x, _ = corpus.draw_case(data, 8)
    assert np.array_equal(quantkit.encode(x, qtype), ggml.quantize(x, qtype))


def test_bf16_rounding_edges_match_ggml(ggml):
    """Every tie and near-tie of the 16-bit cut, subnormals, the overflow into inf, and ±0."""
    hi = np.arange(0, 0x7F80, 7, dtype=np.uint32) << 16
    low = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    bits = (hi[:, None] | low[None, :]).ravel()
    bits = np.concatenate([bits, bits | np.uint32(0x80000000), [0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF]])
    x = bits.astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)][: x.size // 8 * 8].reshape(-1, 8)
    assert np.array_equal(quantkit.encode(x, "BF16"), ggml.quantize(x, "BF16"))


def test_f16_and_bf16_match_gguf_py():
    x = np.concatenate([corpus.family(f, 2, 256) for f in corpus.FAMILIES])
    with np.errstate(over="ignore"):
        assert np.array_equal(quantkit.encode(x, "F16"), gguf_quantize(x, GGMLType.F16).view(np.uint8))
    assert np.array_equal(quantkit.encode(x, "BF16"), gguf_quantize(x, GGMLType.BF16).reshape(x.shape[0], -1))


def _ggml_row(ggml, fn_name: str, src: np.ndarray, n: int) -> np.ndarray:
    fn = getattr(ggml.library(), fn_name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    y = np.zeros(n, np.float32)
    fn(np.ascontiguousarray(src).ctypes.data, y.ctypes.data, n)
    return y


@pytest.mark.parametrize("qtype, ggml_fn", [("F16", "ggml_fp16_to_fp32_row"), ("BF16", "ggml_bf16_to_fp32_row"),
                                            ("F32", None)])
def test_reference_decoder_matches_ggml_and_gguf_py(ggml, qtype, ggml_fn):
    fmt = get_format(qtype)
    every_pattern = np.arange(1 << 16, dtype=np.uint32).astype("<u2").view(np.uint8)  # NaN, inf, subnormals
    rng = np.random.default_rng(1)
    data = every_pattern if fmt.type_size == 2 else rng.integers(0, 256, 4 << 12, dtype=np.uint8)
    ours = fmt.decode_reference(data.reshape(-1, fmt.type_size)).ravel()
    ggml_out = _ggml_row(ggml, ggml_fn, data, ours.size) if ggml_fn else data.view(np.float32)
    assert corpus.same_bits(ours, ggml_out)
    theirs = np.asarray(gguf_dequantize(data, fmt.qtype)).ravel()
    keep = np.ones(ours.size, bool)
    if qtype == "F16":  # gguf-py's cast keeps signaling NaNs signaling; ggml quiets them (see floats.py)
        keep = ~(np.isnan(theirs) & (theirs.view(np.uint32) & np.uint32(0x00400000) == 0))
        assert keep.size - keep.sum() == 2 * 511  # the halves 0x7C01..0x7DFF and their negatives
    assert corpus.same_bits(ours[keep], theirs[keep])
