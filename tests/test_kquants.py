"""K-quants (Q2_K … Q6_K): byte-identity with ggml for both encoder paths, reference vs fast, decoders.

The judges are ggml itself (``ggml_quantize_chunk`` / ``dequantize_row_*`` from llama-cpp-python's libggml-base)
and gguf-py's ``quants.dequantize``; nothing is compared against stored bytes.  The shared corpus
(:mod:`quantkit.testing.corpus`) is swept first; the K-quant cases below add what stresses these encoders in
particular: super-block-level structure (256-weight blocks of very different scale, a zero half block in a
live row), rows without negative or without positive weights (the min clamp), zero and extreme importance,
and per-expert importance slices.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quantkit
from quantkit.formats import GGMLType, ImatrixUse, get_format
from quantkit.formats.kquants import BLOCK_FIELDS, QK_K
from quantkit.testing import corpus

KQUANTS = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
ROW_LENGTHS = [256, 1536, 4096, 7168]
by_name = dict(ids=lambda t: t.name)


# ------------------------------------------------------------------------------------------------ K-quant cases

def kquant_families(n: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Two rows of each K-quant-specific family, float32 [rows, n], with a label per row."""
    rng = np.random.default_rng([n, seed])
    g = rng.standard_normal((2, n))
    block_scales = np.repeat(10.0 ** rng.uniform(-3, 3, (2, n // QK_K)), QK_K, axis=1)
    mixed = g * block_scales
    mixed[:, : QK_K // 2] = 0.0                                   # a zero half block inside a live row
    fams = {
        "block_scales": mixed,
        "positive": np.abs(g) + 0.5,                               # min > 0: clamped to 0
        "negative": -np.abs(g) * 0.03,
        "sparse": g * (rng.random((2, n)) < 0.1),
        "bf16_like": ((g * 0.02).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32),
        "student_t_1.5": rng.standard_t(1.5, (2, n)),
    }
    labels = [f"{name}[{r}]" for name in fams for r in range(2)]
    return np.concatenate([np.asarray(v, np.float32) for v in fams.values()]), labels


KQUANT_IMATRIX = ["none", "random", "with_zeros", "all_zeros", "spiky", "extreme"]


def kquant_imatrix(kind: str, n: int, seed: int = 0) -> np.ndarray | None:
    if kind in corpus.IMATRIX_VARIANTS:
        return corpus.imatrix(kind, n, seed)
    if kind == "all_zeros":
        return np.zeros(n, np.float32)
    rng = np.random.default_rng([n, seed])
    if kind == "spiky":                                           # importance from ~1e-7 to ~1e7
        return rng.lognormal(0.0, 4.0, n).astype(np.float32)
    if kind == "extreme":                                         # 1e-38 … 1e38 (weights overflow), some zeros
        im = (10.0 ** rng.uniform(-38, 38, n)).astype(np.float32)
        im[rng.random(n) < 0.1] = 0.0
        return im
    raise ValueError(kind)


def block_diff(qtype: GGMLType, ours: np.ndarray, ggml: np.ndarray, labels=None, limit: int = 8) -> str:
    """Which rows/blocks/fields differ, with both values, for the first ``limit`` differing blocks."""
    size = get_format(qtype).type_size
    bad = np.argwhere((ours != ggml).reshape(ours.shape[0], -1, size).any(axis=2))
    lines = [f"{qtype.name}: {len(bad)} differing blocks in {len(np.unique(bad[:, 0]))} rows"]
    for row, blk in bad[:limit]:
        a = ours[row, blk * size:(blk + 1) * size]
        b = ggml[row, blk * size:(blk + 1) * size]
        name = f" ({labels[row]})" if labels is not None else ""
        for field, off, length in BLOCK_FIELDS[qtype]:
            fa, fb = a[off:off + length], b[off:off + length]
            where = np.flatnonzero(fa != fb)
            if not where.size:
                continue
            if field in ("d", "dmin"):
                detail = f"ours {fa.view(np.float16)[0]!r} ggml {fb.view(np.float16)[0]!r}"
            else:
                shown = where[:8]
                detail = (f"{where.size} of {length} bytes differ, at {shown.tolist()}: ours {fa[shown].tolist()} "
                          f"ggml {fb[shown].tolist()}")
            lines.append(f"  row {row}{name} block {blk} field {field}: {detail}")
    return "\n".join(lines)


def assert_same(qtype, ours, ggml, labels=None):
    assert ours.shape == ggml.shape and ours.dtype == ggml.dtype == np.uint8
    assert np.array_equal(ours, ggml), block_diff(qtype, ours, ggml, labels)


# ------------------------------------------------------------------------------------------------ encoders

@pytest.mark.parametrize("qtype", KQUANTS, **by_name)
def test_fast_encoder_matches_ggml_on_shared_corpus(ggml, qtype):
    reports = corpus.sweep_encoder(ggml, qtype)
    assert not reports, "\n".join(reports)


@pytest.mark.parametrize("qtype", KQUANTS, **by_name)
def test_reference_encoder_matches_ggml_on_shared_corpus(ggml, qtype):
    reports = corpus.sweep_encoder(ggml, qtype, lengths=[512], reference=True)
    assert not reports, "\n".join(reports)


@pytest.mark.parametrize("kind", KQUANT_IMATRIX)
@pytest.mark.parametrize("qtype", KQUANTS, **by_name)
def test_fast_encoder_matches_ggml_on_kquant_cases(ggml, qtype, kind):
    for n in ROW_LENGTHS:
        x, labels = kquant_families(n)
        im = kquant_imatrix(kind, n)
        assert_same(qtype, quantkit.encode(x, qtype, im), ggml.quantize(x, qtype, im), labels)


@pytest.mark.parametrize("kind", KQUANT_IMATRIX)
@pytest.mark.parametrize("qtype", KQUANTS, **by_name)
def test_reference_encoder_matches_ggml_on_kquant_cases(ggml, qtype, kind):
    x, labels = kquant_families(512, seed=1)
    x, labels = x[::2], labels[::2]                     # one row per family keeps the slow reference quick
    im = kquant_imatrix(kind, 512)
    assert_same(qtype, quantkit.encode(x, qtype, im, reference=True), ggml.quantize(x, qtype, im), labels)


@pytest.mark.parametrize("with_imatrix", [False, True], ids=["no_imatrix", "expert_imatrix"])
@pytest.mark.parametrize("qtype", KQUANTS, **by_name)
def test_experts_match_ggml_per_expert_slices(ggml, qtype, with_imatrix):
    rng = np.random.default_rng(3)
    n_exp, rows, n = 4, 3, 1536
    w = rng.standard_normal((n_exp, rows, n)).astype(np.float32)
    w[2] *= 1e-3
    im = rng.uniform(0.0, 5.0, (n_exp, n)).astype(np.float32) if with_imatrix else None
    if im is not None:
        im[1] = 0.0                                      # an expert never routed to: zero importance
        im[3, ::3] = 0.0
    ours = quantkit.encode_experts(w, qtype, im)
    for e in range(n_exp):
        # llama-quantize hands expert e the slice imatrix + e * n_per_row.
        assert_same(qtype, ours[e], ggml.quantize(w[e], qtype, None if im is None else im[e]))


@pytest.mark.parametrize("qtype", KQUANTS, **by_name)
def test_bytes_do_not_depend_on_thread_count(qtype):
    x, _ = kquant_families(1536, seed=11)
    for im in (None, kquant_imatrix("random", 1536)):
        first, *others = corpus.encode_at_thread_counts(qtype, x, im)
        assert all(np.array_equal(first, other) for other in others)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(KQUANTS), family=st.sampled_from(corpus.FAMILIES), seed=st.integers(0, 2**31 - 1),
       scale_exp=st.integers(-38, 37), imatrix=st.sampled_from(KQUANT_IMATRIX))
def test_property_scaled_families_reference_fast_ggml(ggml, qtype, family, seed, scale_exp, imatrix):
    with np.errstate(over="ignore"):
        x = (corpus.family(family, 1, 2 * QK_K, seed) * np.float32(10.0 ** scale_exp)).astype(np.float32)
    x[~np.isfinite(x)] = 0.0
    im = kquant_imatrix(imatrix, 2 * QK_K, seed)
    theirs = ggml.quantize(x, qtype, im)
    assert_same(qtype, quantkit.encode(x, qtype, im), theirs)
    assert_same(qtype, quantkit.encode(x, qtype, im, reference=True), theirs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(KQUANTS), data=st.data())
def test_property_arbitrary_floats_reference_fast_ggml(ggml, qtype, data):
    x, im = corpus.draw_case(data, QK_K, max_blocks=2)
    theirs = ggml.quantize(x, qtype, im)
    assert_same(qtype, quantkit.encode(x, qtype, im), theirs)
    assert_same(qtype, quantkit.encode(x, qtype, im, reference=True), theirs)


def test_registry_declares_kquants():
    for qtype in KQUANTS:
        fmt = get_format(qtype)
        assert fmt.imatrix is ImatrixUse.OPTIONAL
        assert fmt.encode_reference is not None and fmt.encode_fast is not None and fmt.decode_reference
        assert fmt.block_size == QK_K
        _, off, size = BLOCK_FIELDS[qtype][-1]
        assert off + size == fmt.type_size


# ------------------------------------------------------------------------------------------------ decoders

@pytest.mark.parametrize("qtype", KQUANTS, **by_name)
def test_reference_decoder_matches_gguf_and_ggml(ggml, qtype):
    reports = corpus.sweep_decoder(ggml, qtype)
    assert not reports, "\n".join(reports)
