"""IQ2_XXS, IQ2_XS, IQ3_XXS: byte-identity with ggml, reference vs fast, decoders, search tables.

The judges are ggml itself (``ggml_quantize_chunk`` and ``dequantize_row_*`` from llama-cpp-python's
libggml-base) and gguf-py's ``quants.dequantize``; nothing is compared against stored bytes.  ggml aborts the
process on inputs whose weighted distances overflow float32 (the corpus' ``huge``, ``wide_range`` and
``mixed_blocks`` families); those cases run ggml in a child process, and quantkit must raise where it aborts
and match its bytes where it does not.
"""
from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gguf_quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import quantkit
from quantkit.errors import EncodeError
from quantkit.formats import GGMLType, ImatrixUse, get_format
from quantkit.formats.iq_tables import NWANT, UNREACHABLE, tables
from quantkit.testing import corpus

IQUANTS = [GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ3_XXS]
ROW_LENGTHS = [256, 1536, 4096, 7168]
QK_K = 256
OVERFLOW_FAMILIES = ("huge", "wide_range", "mixed_blocks")      # ggml may abort on these
SAFE_FAMILIES = tuple(f for f in corpus.FAMILIES if f not in OVERFLOW_FAMILIES)
by_name = dict(ids=lambda t: t.name)

# Byte ranges of each block's fields, for failure reports.
FIELDS = {
    GGMLType.IQ2_XXS: [("d", 0, 2)] + [(f"sub{ib} grid", 2 + 8 * ib, 4) for ib in range(8)]
    + [(f"sub{ib} signs|scale", 6 + 8 * ib, 4) for ib in range(8)],
    GGMLType.IQ2_XS: [("d", 0, 2)] + [(f"group{g} grid|signs", 2 + 2 * g, 2) for g in range(32)]
    + [("scales", 66, 8)],
    GGMLType.IQ3_XXS: [("d", 0, 2)] + [(f"sub{ib} grid", 2 + 8 * ib, 8) for ib in range(8)]
    + [(f"sub{ib} signs|scale", 66 + 4 * ib, 4) for ib in range(8)],
}


def variants(qtype) -> list[str]:
    """Importance variants ggml accepts for the type (IQ2_XXS / IQ2_XS refuse to run without one)."""
    return [v for v in corpus.IMATRIX_VARIANTS if v != "none" or get_format(qtype).imatrix is ImatrixUse.OPTIONAL]


def block_diff(qtype, ours: np.ndarray, ref: np.ndarray, limit: int = 6) -> str:
    size = get_format(qtype).type_size
    bad = np.argwhere((ours != ref).reshape(ours.shape[0], -1, size).any(axis=2))
    lines = [f"{qtype.name}: {len(bad)} differing blocks in {len(np.unique(bad[:, 0]))} rows"]
    for row, blk in bad[:limit]:
        a, b = ours[row, blk * size:(blk + 1) * size], ref[row, blk * size:(blk + 1) * size]
        for field, off, length in FIELDS[qtype]:
            if not np.array_equal(a[off:off + length], b[off:off + length]):
                lines.append(f"  row {row} block {blk} {field}: ours {a[off:off + length].tobytes().hex()} "
                             f"ggml {b[off:off + length].tobytes().hex()}")
    return "\n".join(lines)


def assert_same(qtype, ours, ref):
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == np.uint8
    assert np.array_equal(ours, ref), block_diff(qtype, ours, ref)


def ggml_or_abort(ggml, tmp_path: Path, qtype, x: np.ndarray, im) -> np.ndarray | None:
    """ggml's encoding of x, computed in a forked child; None when ggml aborts (SIGABRT) there.

    ggml builds its search tables with OpenMP on first use, and libgomp hangs in a forked child once the parent
    has used it: the tables are built here, in the parent, before forking."""
    ggml.quantize(np.ones((1, QK_K), np.float32), qtype, np.ones(QK_K, np.float32))
    out_path = tmp_path / "ggml.npy"
    out_path.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:                                             # child: ggml is already loaded, numba is not used
        code = 1
        try:
            faulthandler.disable()                           # pytest's SIGABRT traceback dump
            os.environ["GGML_NO_BACKTRACE"] = "1"           # and ggml's gdb backtrace: abort quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            np.save(out_path, ggml.quantize(x, qtype, im))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return np.load(out_path)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT, f"child status {status}"
    return None


# ------------------------------------------------------------------------------------------------ encoders

@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_fast_encoder_matches_ggml_on_corpus(ggml, qtype):
    reports = corpus.sweep_encoder(ggml, qtype, families=SAFE_FAMILIES, variants=variants(qtype),
                                   lengths=ROW_LENGTHS)
    assert not reports, "\n".join(reports)


@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_reference_encoder_matches_ggml_and_fast(ggml, qtype):
    # One super-block per family and variant: the reference is plain Python (~0.5 s per super-block).
    families = ("gaussian", "heavy_tailed", "constant", "outliers", "ties", "tiny", "signed_zeros")
    for variant in variants(qtype):
        x = np.concatenate([corpus.family(f, 1, QK_K, seed=5) for f in families])
        im = corpus.imatrix(variant, QK_K, seed=5)
        ref = quantkit.encode(x, qtype, im, reference=True)
        assert_same(qtype, ref, ggml.quantize(x, qtype, im))
        assert_same(qtype, ref, quantkit.encode(x, qtype, im))


@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_importance_edge_cases_match_ggml(ggml, qtype):
    """All-zero importance (every distance ties: ggml's neighbour order decides), importance from 1e-7 to 1e7,
    and one weight per group of 8 negated so the parity fix-up picks among equal costs."""
    rng = np.random.default_rng(7)
    n = 1536
    g = rng.standard_normal((3, n)).astype(np.float32)
    const = np.full((1, n), 0.5, np.float32)
    const[0, ::8] = -0.5                                     # one negative per group: odd parity, tied costs
    x = np.concatenate([g, const, np.abs(g[:1]) * 1e-3])
    for im in (np.zeros(n, np.float32), rng.lognormal(0.0, 4.0, n).astype(np.float32),
               np.where(rng.random(n) < 0.9, 0.0, 1.0).astype(np.float32)):
        assert_same(qtype, quantkit.encode(x, qtype, im), ggml.quantize(x, qtype, im))


@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_experts_match_ggml_per_expert_slices(ggml, qtype):
    rng = np.random.default_rng(3)
    n_exp, rows, n = 4, 2, 1536
    w = rng.standard_normal((n_exp, rows, n)).astype(np.float32)
    w[2] *= 1e-3
    im = rng.gamma(0.7, 1.0, (n_exp, n)).astype(np.float32)
    im[1] = 0.0                                              # an expert never routed to
    im[3, ::3] = 0.0
    ours = quantkit.encode_experts(w, qtype, im)
    for e in range(n_exp):
        # llama-quantize hands expert e the slice imatrix + e * n_per_row.
        assert_same(qtype, ours[e], ggml.quantize(w[e], qtype, im[e]))


@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_bytes_do_not_depend_on_thread_count(ggml, qtype):
    x = np.concatenate([corpus.family(f, 3, 1536, seed=11) for f in ("gaussian", "heavy_tailed", "outliers")])
    im = corpus.imatrix("with_zeros", 1536, seed=11)
    theirs = ggml.quantize(x, qtype, im)
    for ours in corpus.encode_at_thread_counts(qtype, x, im):
        assert_same(qtype, ours, theirs)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="runs ggml in a forked child, which it may abort")
@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_overflowing_weights_raise_where_ggml_aborts(ggml, tmp_path, qtype):
    aborted = []
    for fam in OVERFLOW_FAMILIES:
        for variant in variants(qtype):
            x = corpus.family(fam, 2, 512, seed=2)
            im = corpus.imatrix(variant, 512, seed=2)
            theirs = ggml_or_abort(ggml, tmp_path, qtype, x, im)
            if theirs is None:
                aborted.append((x, im))
                with pytest.raises(EncodeError, match=f"{qtype.name} cannot encode row .*ggml aborts"):
                    quantkit.encode(x, qtype, im)
            else:
                assert_same(qtype, quantkit.encode(x, qtype, im), theirs)
    assert aborted                                           # the abort path was exercised
    x, im = aborted[0]
    with pytest.raises(EncodeError, match="ggml aborts"):
        quantkit.encode(x, qtype, im, reference=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(IQUANTS), data=st.data())
def test_property_bounded_floats_fast_matches_ggml(ggml, qtype, data):
    """Any float32 weights up to 1e10 in magnitude (ggml aborts far above) and importance up to 1e6."""
    n = QK_K * data.draw(st.integers(1, 2))
    weights = st.floats(-1e10, 1e10, width=32)
    x = data.draw(arrays(np.float32, (data.draw(st.integers(1, 3)), n), elements=weights))
    im_strategy = arrays(np.float32, n, elements=st.floats(0, 1e6, width=32))
    im = data.draw(im_strategy if get_format(qtype).imatrix is ImatrixUse.REQUIRED else st.none() | im_strategy)
    assert_same(qtype, quantkit.encode(x, qtype, im), ggml.quantize(x, qtype, im))


def test_imatrix_use_matches_ggml(ggml):
    for qtype in IQUANTS:
        fmt = get_format(qtype)
        assert fmt.encode_reference and fmt.encode_fast and fmt.decode_reference
        assert ggml.requires_imatrix(qtype) == (fmt.imatrix is ImatrixUse.REQUIRED)
    assert get_format(GGMLType.IQ3_XXS).imatrix is ImatrixUse.OPTIONAL


@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.IQ2_XS], **by_name)
def test_missing_importance_is_refused(qtype):
    with pytest.raises(EncodeError, match="requires an importance matrix"):
        quantkit.encode(np.ones((1, QK_K), np.float32), qtype, None, name="blk.0.ffn_down")


# ------------------------------------------------------------------------------------------------ decoders

@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_reference_decoder_matches_gguf_and_ggml(ggml, qtype):
    from gguf.quants import dequantize

    fmt = get_format(qtype)
    n = 1024
    im = corpus.imatrix("random", n)
    inputs = [quantkit.encode(corpus.family(f, 2, n), qtype, im) for f in SAFE_FAMILIES]
    inputs.append(np.random.default_rng(0).integers(0, 256, (8, fmt.row_bytes(n)), dtype=np.uint8))
    for data in inputs:
        ours = fmt.decode_reference(data.reshape(-1, fmt.type_size)).reshape(data.shape[0], n)
        with np.errstate(all="ignore"):                     # random bytes hold inf/NaN scales
            gguf_out = np.asarray(dequantize(data, qtype), np.float32).reshape(ours.shape)
        ggml_out = np.stack([ggml.dequantize_row(qtype, row, n) for row in data])
        assert corpus.same_bits(ours, gguf_out)
        # ggml applies a minus sign by flipping the sign bit, also of a NaN (a NaN scale d); gguf-py and
        # quantkit multiply by -1.0, which keeps the NaN's sign.  Everything else is bit-identical.
        nan = np.isnan(ours)
        assert np.array_equal(nan, np.isnan(ggml_out))
        assert corpus.same_bits(ours[~nan], ggml_out[~nan])


# ------------------------------------------------------------------------------------------------ tables

@pytest.mark.parametrize("qtype", IQUANTS, **by_name)
def test_neighbour_lists_follow_ggml_definition(qtype):
    """Each reachable off-grid code lists exactly the grid points at its NWANT smallest distinct odd-lattice
    distances, ordered by (distance, index); grid codes map to themselves.  Checked by brute force."""
    t = tables(qtype)
    grid_pos = 2 * t.levels.astype(np.int64) + 1
    codes = (t.levels.astype(np.int64) << (t.bits * np.arange(t.dim))).sum(axis=1)
    assert np.array_equal(t.kmap[codes], np.arange(len(codes)))
    cls = getattr(gguf_quants, qtype.name)
    cls.init_grid()
    assert np.array_equal(t.values, cls.grid.reshape(cls.grid_shape))     # gguf-py's grid, unchanged
    assert np.array_equal(np.asarray(cls.grid_map, np.float32)[t.levels], t.values)
    rng = np.random.default_rng(0)
    reachable = [u for u in rng.integers(0, t.kmap.size, 3000) if t.kmap[u] != UNREACHABLE and t.kmap[u] < 0]
    assert len(reachable) > 100
    for u in reachable:
        levels = (int(u) >> (t.bits * np.arange(t.dim))) & ((1 << t.bits) - 1)
        d2 = ((grid_pos - (2 * levels + 1)) ** 2).sum(axis=1)
        cut = np.unique(d2)[NWANT - 1]
        expected = sorted(np.flatnonzero(d2 <= cut), key=lambda j: (d2[j], j))
        assert t.neighbours(int(u)).tolist() == expected


def test_grid_codes_match_ggml_source(llama_cpp_src):
    """The lattice codes derived from gguf-py's grids are ggml's own kgrid tables (iq2xs/iq3xs_init_impl)."""
    import re

    source = (llama_cpp_src / "ggml" / "src" / "ggml-quants.c").read_text()
    for qtype, name in [(GGMLType.IQ2_XXS, "kgrid_2bit_256"), (GGMLType.IQ2_XS, "kgrid_2bit_512"),
                        (GGMLType.IQ3_XXS, "kgrid_256")]:
        body = re.search(rf"static const uint16_t {name}\[\w+\] = \{{(.*?)\}};", source, re.S).group(1)
        ggml_codes = [int(v) for v in body.replace("\n", " ").split(",") if v.strip()]
        t = tables(qtype)
        ours = (t.levels.astype(np.int64) << (t.bits * np.arange(t.dim))).sum(axis=1)
        assert ours.tolist() == ggml_codes
