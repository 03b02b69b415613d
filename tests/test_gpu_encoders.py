"""torch encoders (quantkit.kernels.gpu_encode): every byte equal to ggml's ggml_quantize_chunk.

The same code runs on the CPU (always, so CI covers it) and on CUDA (skipped without a GPU).  The judge is ggml
itself; on CUDA the bytes are also compared with quantkit's CPU encoders on large inputs streamed in chunks.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import quantkit  # noqa: E402
from quantkit.errors import EncodeError, UnsupportedError  # noqa: E402
from quantkit.formats import GGMLType, get_format  # noqa: E402
from quantkit.kernels import gpu_encode  # noqa: E402
from quantkit.testing import corpus  # noqa: E402

TYPES = [GGMLType.Q8_0, GGMLType.MXFP4, GGMLType.NVFP4, GGMLType.Q4_K, GGMLType.Q2_K]
WITH_IMATRIX = {GGMLType.Q4_K, GGMLType.Q2_K}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device"))]
by_name = dict(ids=lambda t: t.name)


def _lengths(qtype) -> list[int]:
    block = get_format(qtype).block_size
    return [256, 1536] if block == 256 else corpus.row_lengths(block)


def _imatrix_cases(qtype, n: int, seed: int = 0):
    if qtype not in WITH_IMATRIX:
        return {"none": None}
    rng = np.random.default_rng([n, seed])
    extreme = (10.0 ** rng.uniform(-38, 38, n)).astype(np.float32)
    extreme[rng.random(n) < 0.1] = 0.0
    return {**{v: corpus.imatrix(v, n, seed) for v in corpus.IMATRIX_VARIANTS},
            "all_zeros": np.zeros(n, np.float32),
            "spiky": rng.lognormal(0.0, 4.0, n).astype(np.float32),
            "extreme": extreme}


def _sweep(ggml, qtype, device, families=corpus.FAMILIES, seed=0) -> list[str]:
    fmt = get_format(qtype)
    reports = []
    for fam in families:
        for n in _lengths(qtype):
            x = corpus.family(fam, 3, n, seed)
            for variant, im in _imatrix_cases(qtype, n, seed).items():
                ours = gpu_encode.encode(x, qtype, im, device=device)
                report = corpus.block_mismatch(ours, ggml.quantize(x, qtype, im), x, fmt.type_size,
                                               fmt.block_size, f"{fmt.name} {device} {fam} imatrix={variant} n={n}")
                if report:
                    reports.append(report)
    return reports


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, **by_name)
def test_matches_ggml_on_parity_corpus(ggml, qtype, device):
    reports = _sweep(ggml, qtype, device)
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, **by_name)
def test_matches_ggml_on_scaled_families(ggml, qtype, device):
    """Every family scaled across float32's range (1e-38 … 1e37): K-quant searches near under/overflow."""
    fmt = get_format(qtype)
    n = 512
    rng = np.random.default_rng(5)
    for fam in ("gaussian", "heavy_tailed", "outliers", "mixed_blocks"):
        for scale_exp in rng.integers(-38, 38, 4):
            with np.errstate(over="ignore"):
                x = (corpus.family(fam, 2, n, int(scale_exp) & 7) * np.float32(10.0 ** scale_exp)).astype(np.float32)
            x[~np.isfinite(x)] = 0.0
            for variant, im in _imatrix_cases(qtype, n).items():
                ours = gpu_encode.encode(x, qtype, im, device=device)
                report = corpus.block_mismatch(ours, ggml.quantize(x, qtype, im), x, fmt.type_size,
                                               fmt.block_size, f"{fmt.name} {fam}·1e{scale_exp} {variant}")
                assert report is None, report


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(TYPES), data=st.data())
def test_arbitrary_floats_match_ggml_on_cpu(ggml, qtype, data):
    fmt = get_format(qtype)
    x, im = corpus.draw_case(data, fmt.block_size, max_blocks=2)
    ours = gpu_encode.encode(x, qtype, im, device="cpu")
    expected = ggml.quantize(x, qtype, im if qtype in WITH_IMATRIX else None)
    assert np.array_equal(ours, expected), corpus.block_mismatch(ours, expected, x, fmt.type_size,
                                                                  fmt.block_size, fmt.name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, **by_name)
def test_chunked_stream_equals_cpu_encoder(qtype, device):
    """A tensor streamed through the device in many small chunks (an odd last one) equals quantkit's CPU
    encoder, with and without importance."""
    rng = np.random.default_rng(7)
    rows, n = 37, 1024
    x = (rng.standard_normal((rows, n)) * np.exp(rng.normal(0, 2, (rows, 1)))).astype(np.float32)
    ims = [None] + ([corpus.imatrix("with_zeros", n, 1)] if qtype in WITH_IMATRIX else [])
    for im in ims:
        ours = gpu_encode.encode(x, qtype, im, device=device, chunk_weights=5 * n)
        assert np.array_equal(ours, quantkit.encode(x, qtype, im))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", TYPES, **by_name)
def test_cuda_large_tensor_equals_cpu_encoder(qtype):
    """A 4096 x 4096 tensor (several default-size chunks) on CUDA equals quantkit's CPU encoder."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((4096, 4096)) * 0.02).astype(np.float32)
    x[7, :64] = 0.0
    x[9, 100] = 40.0
    im = corpus.imatrix("random", 4096, 2) if qtype in WITH_IMATRIX else None
    ours = gpu_encode.encode(x, qtype, im, device="cuda", chunk_weights=1 << 22)
    assert np.array_equal(ours, quantkit.encode(x, qtype, im))


def test_refuses_types_without_gpu_encoder():
    with pytest.raises(UnsupportedError, match="no GPU encoder for Q6_K"):
        gpu_encode.encode(np.zeros((1, 256), np.float32), "Q6_K", device="cpu")
    assert gpu_encode.supports("Q4_K") and not gpu_encode.supports("IQ2_XXS")


def test_checks_input_like_the_cpu_encoder():
    x = np.zeros((2, 64), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(EncodeError, match="row 1"):
        gpu_encode.encode(x, "Q8_0", device="cpu", name="blk.0.w")
    with pytest.raises(EncodeError, match="multiple of"):
        gpu_encode.encode(np.zeros((1, 48), np.float32), "Q8_0", device="cpu")
    with pytest.raises(EncodeError, match="negative"):
        gpu_encode.encode(np.ones((1, 256), np.float32), "Q4_K", -np.ones(256, np.float32), device="cpu")
    assert gpu_encode.encode(np.zeros((0, 256), np.float32), "Q2_K", device="cpu").shape == (0, 84)
