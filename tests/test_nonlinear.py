"""IQ4_NL and IQ4_XS: every byte equal to ggml's ggml_quantize_chunk (with and without an importance matrix),
decoders bit-equal to ggml and gguf-py, reference encoder equal to the fast one."""
import numba
import numpy as np
import pytest
from gguf.quants import IQ4_NL as GGUF_IQ4_NL
from hypothesis import given, settings
from hypothesis import strategies as st

import quantkit
from quantkit.formats import get_format
from quantkit.formats.nonlinear import KVALUES_IQ4NL, best_index
from quantkit.kernels import nonlinear_numba
from quantkit.testing import corpus

TYPES = ["IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("family", corpus.FAMILIES)
@pytest.mark.parametrize("qtype", TYPES)
def test_fast_encoder_matches_ggml(ggml, qtype, family):
    reports = corpus.sweep_encoder(ggml, qtype, families=[family])
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_encoder_matches_ggml(ggml, qtype):
    reports = corpus.sweep_encoder(ggml, qtype, lengths=[256, 768], reference=True)
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_per_expert_imatrix_slices_match_ggml(ggml, qtype):
    n, n_expert = 1536, 3
    w = np.stack([corpus.family("heavy_tailed", 4, n, seed=e) for e in range(n_expert)])
    im = np.stack([corpus.imatrix("random" if e % 2 else "with_zeros", n, seed=e) for e in range(n_expert)])
    ours = quantkit.encode_experts(w, qtype, im)
    assert np.array_equal(ours, np.stack([ggml.quantize(w[e], qtype, im[e]) for e in range(n_expert)]))
    assert not np.array_equal(ours[1], ggml.quantize(w[1], qtype, im[0]))  # the slice matters


@settings(max_examples=60, deadline=None)
@given(data=st.data(), qtype=st.sampled_from(TYPES))
def test_arbitrary_floats_match_ggml(ggml, data, qtype):
    x, im = corpus.draw_case(data, get_format(qtype).block_size, max_blocks=2)
    ref = ggml.quantize(x, qtype, im)
    assert np.array_equal(quantkit.encode(x, qtype, im), ref)
    assert np.array_equal(quantkit.encode(x, qtype, im, reference=True), ref)


def test_levels_come_from_gguf_py():
    assert KVALUES_IQ4NL.tolist() == list(GGUF_IQ4_NL.kvalues)


@numba.njit
def _kernel_best_index(v):
    return nonlinear_numba.best_index(v)


def test_best_index_reference_equals_kernel_on_every_midpoint():
    v = KVALUES_IQ4NL.astype(np.float64)
    mids = (v[:-1] + v[1:]) / 2
    x = np.concatenate([v, mids, np.nextafter(mids, -np.inf), np.nextafter(mids, np.inf), [-1e9, 1e9, np.nan]])
    x = x.astype(np.float32)
    kernel = np.array([_kernel_best_index(v) for v in x])
    assert np.array_equal(best_index(x), kernel)


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_decoder_matches_ggml_and_gguf_py(ggml, qtype):
    reports = corpus.sweep_decoder(ggml, qtype)
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("qtype", TYPES)
def test_bytes_do_not_depend_on_thread_count(qtype):
    one, many = corpus.encode_at_thread_counts(qtype, corpus.family("outliers", 8, 1024),
                                               corpus.imatrix("random", 1024))
    assert np.array_equal(one, many)
