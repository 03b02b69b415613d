"""Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: every byte equal to ggml's ggml_quantize_chunk, decoders bit-equal to ggml and
gguf-py, reference encoder equal to the fast one."""
import numpy as np
import pytest
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

import quantkit
from quantkit.formats import GGMLType
from quantkit.testing import corpus

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("family", corpus.FAMILIES)
@pytest.mark.parametrize("qtype", TYPES)
def test_fast_encoder_matches_ggml(ggml, qtype, family):
    reports = corpus.sweep_encoder(ggml, qtype, families=[family])
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_encoder_matches_ggml(ggml, qtype):
    reports = corpus.sweep_encoder(ggml, qtype, lengths=[96, 256, 1536], reference=True)
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_per_expert_imatrix_slices_match_ggml(ggml, qtype):
    n, n_expert = 1536, 3
    w = np.stack([corpus.family("gaussian", 4, n, seed=e) for e in range(n_expert)])
    im = np.stack([corpus.imatrix("random" if e % 2 else "with_zeros", n, seed=e) for e in range(n_expert)])
    ours = quantkit.encode_experts(w, qtype, im)
    ref = np.stack([ggml.quantize(w[e], qtype, im[e]) for e in range(n_expert)])
    assert np.array_equal(ours, ref)
    if qtype != "Q8_0":  # the slices must matter: expert 0's imatrix on expert 1 gives other bytes
        assert not np.array_equal(ours[1], ggml.quantize(w[1], qtype, im[0]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), qtype=st.sampled_from(TYPES))
def test_arbitrary_floats_match_ggml(ggml, data, qtype):
    x, im = corpus.draw_case(data, 32)
    ref = ggml.quantize(x, qtype, im)
    assert np.array_equal(quantkit.encode(x, qtype, im), ref)
    assert np.array_equal(quantkit.encode(x, qtype, im, reference=True), ref)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's overflowing casts on huge/tiny scales
@pytest.mark.parametrize("family", corpus.FAMILIES)
def test_q8_0_matches_gguf_py(family):
    x = corpus.family(family, 4, 1536)
    assert np.array_equal(quantkit.encode(x, "Q8_0"), gguf_quantize(x, GGMLType.Q8_0))


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_decoder_matches_ggml_and_gguf_py(ggml, qtype):
    reports = corpus.sweep_decoder(ggml, qtype)
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_bytes_do_not_depend_on_thread_count(qtype):
    one, many = corpus.encode_at_thread_counts(qtype, corpus.family("outliers", 8, 1024),
                                               corpus.imatrix("random", 1024))
    assert np.array_equal(one, many)


def _tie_blocks() -> np.ndarray:
    """Blocks where a scan's order decides the result: +a and -a both of largest |x| (either first, in the same or
    different lanes of the kernels' min/max tree), and min or max a zero of both signs."""
    rng = np.random.default_rng(7)
    blocks = []
    for first, second in ((3, 11), (11, 3), (0, 31), (31, 0), (5, 13)):
        for sign in (1, -1):
            b = rng.uniform(-0.5, 0.5, 32)
            b[first], b[second] = sign * 0.75, -sign * 0.75
            blocks.append(b)
    for z0, z1 in ((0.0, -0.0), (-0.0, 0.0)):
        for sign in (1, -1):
            for p0, p1 in ((2, 9), (17, 4)):
                b = sign * rng.uniform(0.1, 1.0, 32)
                b[p0], b[p1] = z0, z1
                blocks.append(b)
        b = np.zeros(32)
        b[6], b[21] = z0, z1
        blocks.append(b)
    return np.asarray(blocks, np.float32).reshape(1, -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_order_dependent_min_max_match_ggml(ggml, qtype):
    x = _tie_blocks()
    assert np.array_equal(quantkit.encode(x, qtype), ggml.quantize(x, qtype))
