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

TYPES = [GGMLType.Q8_0, GGMLType.MXFP4, GGMLType.NVFP4, GGMLType.Q4_K, GGMLType.Q2_K, GGMLType.IQ2_XXS]
WITH_IMATRIX = {GGMLType.Q4_K, GGMLType.Q2_K, GGMLType.IQ2_XXS}
NEEDS_IMATRIX = {GGMLType.IQ2_XXS}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device"))]
by_name = dict(ids=lambda t: t.name)


def _lengths(qtype, device: str) -> list[int]:
    block = get_format(qtype).block_size
    if qtype in NEEDS_IMATRIX and device == "cpu":
        return [256]                    # IQ2_XXS's eager search is slow on the CPU; CUDA runs every length
    return [256, 1536] if block == 256 else corpus.row_lengths(block)


def _imatrix_cases(qtype, n: int, seed: int = 0):
    if qtype not in WITH_IMATRIX:
        return {"none": None}
    rng = np.random.default_rng([n, seed])
    extreme = (10.0 ** rng.uniform(-38, 38, n)).astype(np.float32)
    extreme[rng.random(n) < 0.1] = 0.0
    cases = {**{v: corpus.imatrix(v, n, seed) for v in corpus.IMATRIX_VARIANTS},
             "all_zeros": np.zeros(n, np.float32),
             "spiky": rng.lognormal(0.0, 4.0, n).astype(np.float32),
             "extreme": extreme}
    if qtype in NEEDS_IMATRIX:
        del cases["none"]
    return cases


def _check(ggml, qtype, x, im, device, label) -> str | None:
    """None when the GPU bytes equal ggml's; where ggml would abort the process (IQ2_XXS on rows whose weighted
    distances overflow), quantkit's CPU encoder raises instead, and the GPU encoder must raise the same error."""
    fmt = get_format(qtype)
    try:
        quantkit.encode(x, qtype, im)
    except EncodeError as cpu_error:
        with pytest.raises(EncodeError) as gpu_error:
            gpu_encode.encode(x, qtype, im, device=device)
        return None if str(gpu_error.value) == str(cpu_error) else f"{label}: {gpu_error.value} != {cpu_error}"
    ours = gpu_encode.encode(x, qtype, im, device=device)
    return corpus.block_mismatch(ours, ggml.quantize(x, qtype, im), x, fmt.type_size, fmt.block_size, label)


def _sweep(ggml, qtype, device, families=corpus.FAMILIES, seed=0) -> list[str]:
    reports = []
    for fam in families:
        for n in _lengths(qtype, device):
            x = corpus.family(fam, 3, n, seed)
            for variant, im in _imatrix_cases(qtype, n, seed).items():
                report = _check(ggml, qtype, x, im, device, f"{qtype.name} {device} {fam} imatrix={variant} n={n}")
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
    n = 512
    rng = np.random.default_rng(5)
    families = ("gaussian", "heavy_tailed", "outliers", "mixed_blocks")
    if qtype in NEEDS_IMATRIX and device == "cpu":
        families = families[::3]        # IQ2_XXS's eager search is slow on the CPU; CUDA runs every family
    for fam in families:
        for scale_exp in rng.integers(-38, 38, 4):
            with np.errstate(over="ignore"):
                x = (corpus.family(fam, 2, n, int(scale_exp) & 7) * np.float32(10.0 ** scale_exp)).astype(np.float32)
            x[~np.isfinite(x)] = 0.0
            for variant, im in _imatrix_cases(qtype, n).items():
                report = _check(ggml, qtype, x, im, device, f"{qtype.name} {fam}·1e{scale_exp} {variant}")
                assert report is None, report


@pytest.mark.parametrize("device", DEVICES)
def test_iq2_xxs_row_aborts_with_its_first_failing_sub_block(ggml, device):
    """ggml aborts at the first sub-block that fails: here sub-block 0 (no neighbour at a finite distance), though
    sub-block 1, with the 1.8e19 outlier, ends with a NaN scale (a larger reason number).  Found by hypothesis: the
    eager encoder reported the largest reason of the row."""
    x = np.full((1, 256), 3.2483271e14, np.float32)
    x[0, 32] = 1.8410821e19
    report = _check(ggml, GGMLType.IQ2_XXS, x, np.ones(256, np.float32), device, "IQ2_XXS first failing sub-block")
    assert report is None, report
    with pytest.raises(EncodeError, match="every neighbour"):
        quantkit.encode(x, GGMLType.IQ2_XXS, np.ones(256, np.float32))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(TYPES), data=st.data())
def test_arbitrary_floats_match_ggml_on_cpu(ggml, qtype, data):
    x, im = corpus.draw_case(data, get_format(qtype).block_size, max_blocks=2)
    if im is None and qtype in NEEDS_IMATRIX:
        im = np.ones(x.shape[1], np.float32)
    report = _check(ggml, qtype, x, im, "cpu", qtype.name)
    assert report is None, report


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, **by_name)
def test_chunked_stream_equals_cpu_encoder(qtype, device):
    """A tensor streamed through the device in many small chunks (an odd last one) equals quantkit's CPU
    encoder, with and without importance."""
    rng = np.random.default_rng(7)
    rows, n = (13 if device == "cpu" and qtype in NEEDS_IMATRIX else 37), 1024
    x = (rng.standard_normal((rows, n)) * np.exp(rng.normal(0, 2, (rows, 1)))).astype(np.float32)
    ims = [] if qtype in NEEDS_IMATRIX else [None]
    ims += [corpus.imatrix("with_zeros", n, 1)] if qtype in WITH_IMATRIX else []
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
    assert gpu_encode.supports("IQ2_XXS") and not gpu_encode.supports("IQ3_XXS")


def test_checks_input_like_the_cpu_encoder():
    x = np.zeros((2, 64), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(EncodeError, match="row 1"):
        gpu_encode.encode(x, "Q8_0", device="cpu", name="blk.0.w")
    with pytest.raises(EncodeError, match="multiple of"):
        gpu_encode.encode(np.zeros((1, 48), np.float32), "Q8_0", device="cpu")
    with pytest.raises(EncodeError, match="negative"):
        gpu_encode.encode(np.ones((1, 256), np.float32), "Q4_K", -np.ones(256, np.float32), device="cpu")
    with pytest.raises(EncodeError, match="requires an importance matrix"):
        gpu_encode.encode(np.ones((1, 256), np.float32), "IQ2_XXS", device="cpu")
    assert gpu_encode.encode(np.zeros((0, 256), np.float32), "Q2_K", device="cpu").shape == (0, 84)


def test_iq2_xxs_abort_names_the_row_in_the_whole_tensor():
    """Rows ggml would abort on raise the CPU encoder's error, numbered in the whole tensor across chunks."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((6, 256)) * 0.02).astype(np.float32)
    x[4] = corpus.family("mixed_blocks", 1, 256)[0]        # 1e30-scaled blocks: weighted distances overflow
    im = corpus.imatrix("random", 256)
    with pytest.raises(EncodeError) as cpu_error:
        quantkit.encode(x, "IQ2_XXS", im)
    with pytest.raises(EncodeError) as gpu_error:
        gpu_encode.encode(x, "IQ2_XXS", im, device="cpu", chunk_weights=512)
    assert "row 4" in str(gpu_error.value) and str(gpu_error.value) == str(cpu_error.value)


# ------------------------------------------------------------------------------------------------ convert --device

def _convert_example(tmp_path, name: str, *more: str):
    from click.testing import CliRunner

    from quantkit import examples
    from quantkit.cli import main

    out = tmp_path / f"{name}.gguf"
    result = CliRunner().invoke(main, ["convert", str(examples.example_model_dir()), "-o", str(out), "--recipe",
                                       str(examples.example_recipe("tiny-moe-iq2xxs-w2q2k")), "--imatrix",
                                       str(examples.example_imatrix()), "--pre-tokenizer", examples.PRE_TOKENIZER,
                                       "--no-progress", "-j", "1", *more])
    return result, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_convert_on_cuda_writes_the_cpu_file(tmp_path):
    """The bundled model's IQ2_XXS / Q2_K / Q8_0 layout converted with --device cuda: the same file, byte for byte."""
    on_cpu, cpu_out = _convert_example(tmp_path, "cpu")
    on_gpu, gpu_out = _convert_example(tmp_path, "cuda", "--device", "cuda")
    assert on_cpu.exit_code == 0 and on_gpu.exit_code == 0, on_cpu.output + on_gpu.output
    assert cpu_out.read_bytes() == gpu_out.read_bytes()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
def test_convert_on_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    result, out = _convert_example(tmp_path, "cuda", "--device", "cuda")
    assert result.exit_code != 0
    assert "sees no CUDA device" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_convert_on_cuda_runs_one_job_unless_told(tmp_path, monkeypatch):
    """Without -j, --device cuda runs one worker (each further one imports torch and holds a GPU context: -j 4 was
    slower than -j 1 on an H200); -j still sets it, and on the CPU the default stays the CPUs available."""
    from click.testing import CliRunner

    from quantkit import examples
    from quantkit.cli import main
    from quantkit.convert import execute
    from quantkit.resources import available_cpus

    seen = []

    def planned(request):
        seen.append((request.device, request.jobs))
        raise KeyboardInterrupt     # stop before any work
    monkeypatch.setattr(execute, "prepare", planned)
    for more in (["--device", "cuda"], ["--device", "cuda", "-j", "3"], []):
        CliRunner().invoke(main, ["convert", str(examples.example_model_dir()), "-o", str(tmp_path / "x.gguf"),
                                  "--recipe", str(examples.example_recipe("tiny-moe-q4_k")), *more])
    assert seen == [("cuda", 1), ("cuda", 3), ("cpu", available_cpus())]


#: Builds of kq_search.cu's CUDA kernels: nvcc's on a GPU, and on the CPU the same CUDA code on emulated thread
#: blocks (quantkit.testing.cuda_emulation), so CI runs the kernels' thread and warp code too.
CUDA_BUILDS = [pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
               "emulated"]


def _cuda_build(build: str):
    """(the extension, the device of its tensors) for a :data:`CUDA_BUILDS` entry."""
    if build == "cuda":
        ext = gpu_encode.search_extension("cuda")
        assert ext is not None, "kq_search.cu did not build with this CUDA toolkit"
        return ext, "cuda"
    if gpu_encode.search_extension("cpu") is None:
        pytest.skip("no C++ compiler for torch extensions")
    from quantkit.testing.cuda_emulation import emulated_extension

    return emulated_extension(), "cpu"


def _same_floats(a, b) -> bool:
    """Equal bits, any NaN as one (a NaN's payload differs between CUDA paths and never reaches the bytes)."""
    return torch.equal(*(torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)
                         for t in (a, b)))


@pytest.mark.parametrize("build", CUDA_BUILDS)
@pytest.mark.parametrize("n, nmax, use_mad", [(16, 3, True), (16, 3, False), (32, 15, False)])
def test_fused_search_equals_eager_search(build, n, nmax, use_mad):
    """kq_search.cu's qkx_kernel (make_qkx2/qkx3_quants, a thread per lane) against the eager torch search."""
    ext, device = _cuda_build(build)
    rng = np.random.default_rng(n + nmax)
    x = corpus.family("mixed_blocks", 64, 4096, 3).reshape(-1, n).T.copy()
    x[:, :1000] = (rng.standard_normal((n, 1000)) * 0.02).astype(np.float32)
    xt = torch.from_numpy(x).to(device)
    wt = xt.abs() if use_mad else torch.from_numpy(rng.gamma(0.7, 1.0, x.shape).astype(np.float32)).to(device)
    fused = ext.qkx_search_lanes(xt, wt, nmax, float(np.float32(-0.9)), float(np.float32(0.05)), 36, use_mad)
    eager = gpu_encode.make_qkx_quants(xt, wt, nmax, -0.9, 0.05, 36, use_mad)
    assert torch.equal(fused[0], eager[0].to(torch.int32))
    for what, a, b in zip(("scale", "min"), fused[1:], eager[1:]):
        assert _same_floats(a, b), f"{what}: {int((a != b).sum())} lanes differ"


@pytest.mark.parametrize("build", CUDA_BUILDS)
@pytest.mark.parametrize("n, nmax", [(8, 63), (16, 15)])
def test_fused_qp_quants_equals_eager(build, n, nmax):
    """kq_search.cu's qp_kernel (make_qp_quants, the imatrix paths' sub-block scale quantization) against the
    eager one."""
    ext, device = _cuda_build(build)
    rng = np.random.default_rng(n)
    x = np.abs(corpus.family("mixed_blocks", 64, 4096, 1)).reshape(n, -1)
    x[:, :500] = rng.gamma(0.5, 1.0, (n, 500))
    x[:, 500:520] = 0.0
    w = rng.gamma(0.7, 1.0, x.shape).astype(np.float32)
    w[:, 600:650] = 0.0
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(device)
    wt = torch.from_numpy(w).to(device)
    fused = ext.qp_quants_lanes(xt, wt, nmax)
    eager = gpu_encode.make_qp_quants(xt, nmax, wt)
    assert torch.equal(fused[0], eager[0].to(torch.int32))
    assert _same_floats(fused[1], eager[1])


def _fused_on_the_cpu(build: str, monkeypatch) -> None:
    """Route the CPU's encoders through kq_search.cu built for the CPU: its CPU branches ("cpu") or its CUDA kernels
    on emulated thread blocks ("emulated")."""
    if gpu_encode.search_extension("cpu") is None:
        pytest.skip("no C++ compiler for torch extensions")
    monkeypatch.setattr(gpu_encode, "FUSED_SEARCH_ON", {"cpu", "cuda"})
    if build == "emulated":
        monkeypatch.setitem(gpu_encode._EXTENSIONS, "cpu", _cuda_build(build)[0])


@pytest.mark.parametrize("build", ["cpu", "emulated"])
@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q4_K, GGMLType.Q2_K], **by_name)
def test_fused_encoders_on_the_cpu_match_ggml(ggml, build, qtype, monkeypatch):
    """kq_search.cu built for the CPU, two ways: its CPU branches (the per-lane functions in loops; "cpu") and its
    CUDA kernels on emulated thread blocks ("emulated"): the whole-encode kernels (IQ2_XXS; Q2_K and Q4_K with
    importance) and, without importance, the K-quant lane searches give ggml's bytes on the parity corpus, aborts
    included.  This is CI's check of the kernels; the CUDA tests run nvcc's build."""
    _fused_on_the_cpu(build, monkeypatch)
    reports = []
    for fam in corpus.FAMILIES:
        for n in (256, 1536):
            x = corpus.family(fam, 3, n, 0)
            for variant, im in _imatrix_cases(qtype, n).items():
                report = _check(ggml, qtype, x, im, "cpu", f"{qtype.name} {build} {fam} {variant} n={n}")
                reports += [report] if report else []
    assert not reports, "\n".join(reports[:3])


@pytest.mark.parametrize("device", [*DEVICES, "emulated"])
@pytest.mark.parametrize("qtype", sorted(WITH_IMATRIX, key=lambda t: t.name), **by_name)
def test_rows_with_their_own_importance_match_ggml_per_piece(ggml, qtype, device, monkeypatch):
    """One pass over several pieces, each row with its piece's importance (``imatrix[rows, n]``, as
    ``convert --device cuda`` encodes a tensor's experts): ggml's bytes for each piece encoded alone with its own.
    "emulated": the CUDA kernels on the CPU (:func:`_fused_on_the_cpu`)."""
    n = 256 if device == "cpu" else 1536        # the eager IQ2_XXS search is slow on the CPU
    if device == "emulated":
        _fused_on_the_cpu(device, monkeypatch)
        device = "cpu"
    pieces = [corpus.family(fam, 2, n, seed) for seed, fam in enumerate(corpus.FAMILIES[:4])]
    importances = [corpus.imatrix("random", n, seed) for seed in range(len(pieces))]
    importances[1] = corpus.imatrix("with_zeros", n, 1)
    dev = torch.device(device)
    rows_im = torch.from_numpy(np.concatenate([np.broadcast_to(im, p.shape) for p, im in zip(pieces, importances)]))
    got = gpu_encode.encode_tensor(torch.from_numpy(np.concatenate(pieces)).to(dev), qtype, rows_im.to(dev))
    want = np.concatenate([ggml.quantize(p, qtype, im) for p, im in zip(pieces, importances)])
    assert np.array_equal(got.cpu().numpy().reshape(want.shape), want)
