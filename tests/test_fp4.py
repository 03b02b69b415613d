"""MXFP4 and NVFP4 (GGUF blocks): every byte equal to ggml's ggml_quantize_chunk, MXFP4 also equal to gguf-py's
quantize, decoders bit-equal to ggml and gguf-py, reference encoder equal to the fast one."""
import numpy as np
import pytest
from gguf.quants import MXFP4 as GGUF_MXFP4
from gguf.quants import NVFP4 as GGUF_NVFP4
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

import quantkit
from quantkit.formats import GGMLType, get_format
from quantkit.formats.fp4 import e8m0_to_fp32_half, fp32_to_ue4m3, ue4m3_to_fp32_half
from quantkit.testing import corpus

TYPES = ["MXFP4", "NVFP4"]


@pytest.mark.parametrize("family", corpus.FAMILIES)
@pytest.mark.parametrize("qtype", TYPES)
def test_fast_encoder_matches_ggml(ggml, qtype, family):
    reports = corpus.sweep_encoder(ggml, qtype, families=[family], variants=["none", "random"])
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_encoder_matches_ggml(ggml, qtype):
    reports = corpus.sweep_encoder(ggml, qtype, variants=["none"], reference=True)
    assert not reports, "\n".join(reports[:3])


def _blocks_with_amax(amax: np.ndarray, block: int) -> np.ndarray:
    """One block per amax value: the value itself, its negation/half/quarter and zeros."""
    x = np.zeros((amax.size, block), np.float32)
    x[:, 0] = amax
    x[:, 1] = -amax / 2
    x[:, 2] = amax / 4
    x[:, 3] = -amax
    return x.reshape(1, -1)


def test_mxfp4_exponent_at_every_power_of_two(ggml):
    """log2f rounds up just below 2^k for large |k|: amax = 2^k and its float32 neighbours, every k."""
    p = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    amax = np.concatenate([p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf)),
                           (p.view(np.uint32) - np.uint32(44)).view(np.float32)])
    x = _blocks_with_amax(amax[np.isfinite(amax) & (amax > 0)], 32)
    for reference in (False, True):
        assert np.array_equal(quantkit.encode(x, "MXFP4", reference=reference), ggml.quantize(x, "MXFP4"))


def test_nvfp4_scale_rounding_across_every_binade(ggml):
    """ggml_fp32_to_ue4m3(amax/6): dense amax over all float32 binades, including the half-way mantissas."""
    rng = np.random.default_rng(3)
    e = np.arange(-149, 128)
    mant = np.concatenate([rng.random(4), (np.arange(16) + 0.5) / 16])
    amax = (6 * np.ldexp(1 + mant[None, :], e[:, None])).ravel()
    with np.errstate(over="ignore"):
        amax = amax.astype(np.float32)
    x = _blocks_with_amax(amax[np.isfinite(amax) & (amax > 0)], 16)
    x = x[:, : x.shape[1] // 64 * 64]
    for reference in (False, True):
        assert np.array_equal(quantkit.encode(x, "NVFP4", reference=reference), ggml.quantize(x, "NVFP4"))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), qtype=st.sampled_from(TYPES))
def test_arbitrary_floats_match_ggml(ggml, data, qtype):
    x, im = corpus.draw_case(data, get_format(qtype).block_size)
    ref = ggml.quantize(x, qtype, im)
    assert np.array_equal(quantkit.encode(x, qtype, im), ref)
    assert np.array_equal(quantkit.encode(x, qtype, im, reference=True), ref)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's log2(0) and casts
@pytest.mark.parametrize("family", corpus.FAMILIES)
def test_mxfp4_matches_gguf_py(family):
    x = corpus.family(family, 4, 1536)
    assert np.array_equal(quantkit.encode(x, "MXFP4"), gguf_quantize(x, GGMLType.MXFP4))


def test_scale_conversions_agree_with_gguf_py():
    codes = np.arange(256, dtype=np.uint8)
    assert corpus.same_bits(e8m0_to_fp32_half(codes), GGUF_MXFP4.e8m0_to_fp32_half(codes))
    assert corpus.same_bits(ue4m3_to_fp32_half(codes), GGUF_NVFP4.ue4m3_to_fp32(codes))
    rng = np.random.default_rng(5)
    x = np.ldexp(rng.random(20000) + 0.5, rng.integers(-140, 12, 20000)).astype(np.float32)
    assert np.array_equal(fp32_to_ue4m3(x), GGUF_NVFP4.fp32_to_ue4m3(x))


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_decoder_matches_ggml_and_gguf_py(ggml, qtype):
    reports = corpus.sweep_decoder(ggml, qtype)
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_bytes_do_not_depend_on_thread_count(qtype):
    one, many = corpus.encode_at_thread_counts(qtype, corpus.family("wide_range", 8, 1024))
    assert np.array_equal(one, many)
