"""GGUFs quantkit did not write: made by llama.cpp's own ``convert_hf_to_gguf.py`` and llama-quantize (the C API
``llama_model_quantize`` behind it, through llama-cpp-python), from the tiny models of the seed architectures.

* The runtime rebuilds the model config from the file's own keys (no ``quantkit.source.config``): the logits equal
  those of the same file loaded with the source ``config.json`` (bit for bit), and those of the source checkpoint
  (within the runtime's tolerance).
* ``validate FOREIGN.gguf --source DIR`` proves llama.cpp Q4_K_M files (with and without an imatrix) byte for byte (exit 0); a flipped payload
  byte is named (exit 1); tensors it cannot prove are counted with the reason (exit 1); without a source only the
  structure is checked, and the report says so.
* The converter's F32 files and llama-quantize's Q4_K_M files score with llama.cpp's per-token NLL within 1e-3
  (llama-cpp-python, F32 KV cache, every position's logits): the Q4_K_M files with ``arithmetic="ggml-cpu"`` (products
  with packed weights and SiLU run by libggml-cpu itself, MLA absorbed as llama.cpp runs it); in float32 only their
  mean NLL agrees within 1e-2 (single tokens move by up to ~0.2 nat).
* ``ggml_ref.mul_mat`` reproduces every 2-D weight product of llama.cpp's graph bit for bit, with and without
  llama.cpp's weight repacking.
* ``inspect`` and ``imatrix info --model`` read the file.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.errors import UnsupportedError
from quantkit.io.gguf_reader import GGUFFile
from quantkit.runtime import SOURCE_CONFIG_KEY, load_model, logits
from quantkit.testing.foreign_files import without_quantkit_keys
from quantkit.testing.tiny_models import build_tiny_model
import llama_cpu
from test_arch import PRE_TOKENIZER, run_converter
from test_convert_interop import GGML_ABORT, llama_logits

pytestmark = [pytest.mark.interop, pytest.mark.slow]

#: Sources llama.cpp's converter accepts (DeepSeek V4: only the official layout with FP4 experts).
CONVERTER_SOURCES = {"qwen3_moe": ("per-expert", "f32"), "deepseek_v3": ("per-expert", "f32"),
                     "glm5_next": ("per-expert", "f32"), "qwen4_exp": ("per-expert", "f32"),
                     "deepseek_v4": ("official", "fp4-experts")}
#: Past 128 tokens DeepSeek V4's heavily compressed layer emits its first compressed entry.
TOKENS = {"deepseek_v4": 160}
DEFAULT_TOKENS = 48
RELATIVE_TOLERANCE = 1e-4
#: Architectures quantized with llama-quantize and validated (glm5_next's ssm_a is -exp(A_log) in float32 torch,
#: one ulp from quantkit's correctly rounded value: tests/test_arch.py NEG_EXP_TENSORS).
QUANTIZED = ("qwen3_moe", "deepseek_v3")
NLL_TOLERANCE = 1e-3
#: Q4_K_M files whose ggml-cpu logits equal llama.cpp's bit for bit: every op of the tiny DeepSeek V3 that ggml
#: computes its own way runs in libggml-cpu (products, latent attention's products and softmax, SiLU, sigmoid);
#: Qwen3-MoE's attention still runs in torch (its logits agree within 3e-7).
BIT_EXACT = ("deepseek_v3",)
Q4_MEAN_NLL_TOLERANCE = 1e-2
TEXT = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, item):\n")

#: llama-quantize's C API in a child process (a ggml abort must not end the test session).
#: With an imatrix file, its entries are read with gguf-py and divided as llama-quantize's tool does
#: (``in_sum2 / count`` per matrix, float32) and passed as the C API's ``llama_model_imatrix_data`` array.
QUANTIZE_RUNNER = """
import ctypes, sys
import numpy as np
import gguf
import llama_cpp
src, out, ftype, imatrix = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, ftype)
params.nthread = 2
keep = []
if imatrix:
    reader = gguf.GGUFReader(imatrix)
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    entries = (llama_cpp.llama_model_imatrix_data * (len(tensors) + 1))()
    i = 0
    for key, sums in tensors.items():
        if not key.endswith(".in_sum2"):
            continue
        counts = tensors[key[: -len(".in_sum2")] + ".counts"].reshape(-1)
        values = np.ascontiguousarray((sums.reshape(len(counts), -1) / counts[:, None]).astype(np.float32).ravel())
        keep.append(values)
        entries[i].name = key[: -len(".in_sum2")].encode()
        entries[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = values.size
        i += 1
    entries[i].name = None
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    # what the llama-quantize tool records about the imatrix it used
    overrides = (llama_cpp.llama_model_kv_override * 3)()
    overrides[0].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
    overrides[0].key = b"quantize.imatrix.file"
    overrides[0].value.val_str = imatrix.encode()[:127]
    overrides[1].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
    overrides[1].key = b"quantize.imatrix.entries_count"
    overrides[1].value.val_i64 = i
    params.kv_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_kv_override))
rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
sys.exit(rc)
"""


def token_ids(arch: str) -> list[int]:
    _, tok = build_tiny_model(arch, dtype="f32")
    ids = tok(TEXT).input_ids
    n = TOKENS.get(arch, DEFAULT_TOKENS)
    return (ids * (n // len(ids) + 1))[:n]


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory, llama_cpp_src):
    """arch -> (source checkpoint, llama.cpp's F32 conversion of it), each made once."""
    root = tmp_path_factory.mktemp("foreign")
    made: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            source = tiny_checkpoints.get(arch, *CONVERTER_SOURCES[arch])
            out = root / f"{arch}-llama-cpp-f32.gguf"
            run_converter(source, out, PRE_TOKENIZER[arch])
            made[arch] = (source, out)
        return made[arch]
    return get


def quantize(src: Path, out: Path, ftype: str = "LLAMA_FTYPE_MOSTLY_Q4_K_M", imatrix: Path | None = None) -> Path:
    result = subprocess.run([sys.executable, "-c", QUANTIZE_RUNNER, str(src), str(out), ftype, str(imatrix or "")],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if GGML_ABORT.search(line)]
        raise AssertionError(f"llama_model_quantize failed (exit {result.returncode}): "
                             + " | ".join(errors[:3] or result.stderr.splitlines()[-3:]))
    return out


@pytest.fixture(scope="module")
def q4_k_m(converted, tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign-q4")
    made: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            source, f32 = converted(arch)
            made[arch] = (source, quantize(f32, root / f"{arch}-Q4_K_M.gguf"))
        return made[arch]
    return get


def validate(*args: str):
    return CliRunner().invoke(main, ["validate", *map(str, args)])


# -- the config comes from the file's keys ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", [a for a in CONVERTER_SOURCES if a != "qwen4_exp"])
def test_llama_cpp_conversion_runs_without_the_source_config(converted, arch):
    source, path = converted(arch)
    with GGUFFile(path) as f:
        assert SOURCE_CONFIG_KEY not in f.metadata and "quantkit.version" not in f.metadata
    ids = token_ids(arch)
    rebuilt = logits(load_model(path), ids)
    given = logits(load_model(path, config=json.loads((source / "config.json").read_text())), ids)
    assert np.array_equal(rebuilt, given)
    if CONVERTER_SOURCES[arch][1] == "f32":    # the file holds the source values exactly
        expected = logits(load_model(source), ids)
        assert np.abs(rebuilt - expected).max() <= RELATIVE_TOLERANCE * np.abs(expected).max()


def test_qwen4_exp_llama_cpp_conversion_is_refused_naming_the_ratios(converted):
    """llama.cpp's converter writes all-zero compression ratios for qwen4_exp (INTEROP.md): its QSA never engages,
    which transformers' Qwen4-Exp cannot express; the rebuild says so instead of running another model."""
    _, path = converted("qwen4_exp")
    with pytest.raises(UnsupportedError, match="compress_ratios"):
        load_model(path)


def test_qwen4_exp_config_is_rebuilt_from_keys(tiny_checkpoints, tmp_path):
    """quantkit's own qwen4_exp conversion (correct ratios) without its recorded config runs the same."""
    source = tiny_checkpoints.get("qwen4_exp", "per-expert", "f32")
    ours = tmp_path / "qwen4.gguf"
    recipe = tmp_path / "f32.toml"
    recipe.write_text('name = "f32"\narchitectures = ["qwen4_exp"]\n[defaults]\ntype = "F32"\n'
                      '[[rule]]\nclass = "hc"\ntype = "F32"\n[[rule]]\nclass = "indexer"\ntype = "F32"\n')
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(ours), "--recipe", str(recipe),
                                       "--pre-tokenizer", PRE_TOKENIZER["qwen4_exp"], "--no-progress"])
    assert result.exit_code == 0, result.output
    bare = without_quantkit_keys(ours, tmp_path / "qwen4-bare.gguf")
    ids = token_ids("qwen4_exp")
    assert np.array_equal(logits(load_model(bare), ids), logits(load_model(ours), ids))


# -- validate -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", QUANTIZED)
def test_llama_quantize_q4_k_m_is_proven_byte_for_byte(q4_k_m, arch, tmp_path):
    source, path = q4_k_m(arch)
    with GGUFFile(path) as f:
        types = {t.type.name for t in f.tensors.values()}
        total = len(f.tensors)
    assert {"Q4_K", "Q6_K"} <= types
    report_path = tmp_path / "report.json"
    result = validate(path, "--source", source, "--payload", "full", "--report", report_path)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    proof = next(c for c in report["checks"] if c["check"] == "payload.proof")
    assert proof["status"] == "passed" and proof["detail"] == f"{total} of {total} tensors proven"
    assert f"valid ({total} of {total} tensors proven)" in result.output
    assert all(t["compared"] == "full" and t["match"] for t in report["tensors"]) and len(report["tensors"]) == total
    sampled = validate(path, "--source", source)
    assert sampled.exit_code == 0, sampled.output


def test_a_quantkit_file_re_quantized_by_llama_quantize_is_proven_as_a_foreign_one(tiny_checkpoints, tmp_path):
    """llama-quantize keeps the keys it finds: a quantkit F32 conversion quantized to Q4_K_M still recorded
    quantkit's F32 recipe, was re-planned as it, and failed (28 differences) with no way to prove it."""
    source = tiny_checkpoints.get("qwen3_moe", *CONVERTER_SOURCES["qwen3_moe"])
    recipe = tmp_path / "f32.toml"
    recipe.write_text('name = "f32"\narchitectures = ["qwen3_moe"]\n[defaults]\ntype = "F32"\n')
    f32 = tmp_path / "f32.gguf"
    made = CliRunner().invoke(main, ["convert", str(source), "-o", str(f32), "--recipe", str(recipe), "--no-progress",
                                     "--pre-tokenizer", PRE_TOKENIZER["qwen3_moe"]])
    assert made.exit_code == 0, made.output
    q4 = quantize(f32, tmp_path / "q4.gguf")
    with GGUFFile(q4) as f:
        assert "quantkit.recipe.text" in f.metadata        # the case: quantkit's provenance copied
    result = validate(q4, "--source", source, "--payload", "full")
    assert result.exit_code == 0, result.output
    assert "re-quantized by another tool" in result.output and "tensors proven" in result.output
    # quantkit's own file is still re-planned from its recipe
    own = validate(f32, "--source", source)
    assert own.exit_code == 0 and "re-quantized" not in own.output


def test_llama_quantize_drops_trailing_unit_dimensions_and_the_tensor_is_still_proven(converted, tmp_path):
    """llama-quantize writes ggml_n_dims dimensions: GLM-5.3's KDA convolutions [1, 256, 1, 4] are stored as
    [256, 1, 4], the same ggml tensor. Validate compares shapes as ggml sees them (they were "shape differs", and
    no GLM file llama-quantize made could pass)."""
    source, f32 = converted("glm5_next")
    path = quantize(f32, tmp_path / "glm5_next-Q8_0.gguf", "LLAMA_FTYPE_MOSTLY_Q8_0")
    with GGUFFile(path) as f:
        total = len(f.tensors)
        assert list(f.tensors["blk.0.ssm_conv1d_k.weight"].shape) == [256, 1, 4]
    result = validate(path, "--source", source, "--payload", "full")
    assert result.exit_code == 0 and f"valid ({total} of {total} tensors proven)" in result.output, result.output
    assert validate(path, "--source", source).exit_code == 0


def test_a_tensor_neither_compared_nor_unproven_fails_the_proof():
    """The proof counts every tensor of the file: one the audit skipped without a reason of its own (an inventory
    difference) is not proven, and "valid (81 of 84 tensors proven)" was possible."""
    from quantkit.validate.foreign import proof_check

    compared = [{"match": True, "compared": "full"}] * 3
    proof = proof_check(5, compared, {"x": "quantkit cannot encode TQ1_0"}, "full")
    assert proof.status == "failed" and proof.detail.endswith("1 not compared (see inventory.tensors)"), proof.detail
    assert proof_check(4, compared, {"x": "why"}, "full").detail == "3 of 4 tensors proven, 1 unproven (1: why)"


def test_llama_cpp_deepseek_v4_is_proven_with_its_integer_table(converted, tmp_path):
    """llama.cpp's conversion of the official DeepSeek V4 layout (FP4 experts dequantized to F32) carries the hash
    routing table ``ffn_gate_tid2eid`` as I32: proven as the copy it is, where it was "unproven: quantkit cannot
    encode I32" and every llama.cpp-made V4 file failed validation."""
    source, path = converted("deepseek_v4")
    with GGUFFile(path) as f:
        total = len(f.tensors)
        assert any(t.type.name == "I32" for t in f.tensors.values())
    result = validate(path, "--source", source, "--payload", "full")
    assert result.exit_code == 0 and f"valid ({total} of {total} tensors proven)" in result.output, result.output


def every_matrix_imatrix(path: Path, gguf_path: Path) -> Path:
    """A seeded imatrix observing every matrix (expert) of every block weight of ``gguf_path``."""
    from quantkit.imatrix import Entry, make_imatrix, save_imatrix

    rng = np.random.default_rng(11)
    entries = {}
    with GGUFFile(gguf_path) as f:
        for t in f.tensors.values():
            if t.name.startswith("blk.") and len(t.shape) in (2, 3) and t.type.name == "F32":
                mats = t.shape[0] if len(t.shape) == 3 else 1
                entries[t.name] = Entry((rng.random((mats, t.shape[-1])) * 8).astype(np.float32),
                                        rng.integers(1, 9, mats).astype(np.float32))
    save_imatrix(make_imatrix(entries, datasets=["synthetic:foreign"], chunk_count=8, synthetic=True), path)
    return path


def test_llama_quantize_with_an_imatrix_is_proven_with_it(converted, tmp_path):
    source, f32 = converted("qwen3_moe")
    imatrix = every_matrix_imatrix(tmp_path / "imatrix.gguf", f32)
    path = quantize(f32, tmp_path / "Q4_K_M-imatrix.gguf", imatrix=imatrix)
    with GGUFFile(path) as f:
        total = len(f.tensors)
    result = validate(path, "--source", source, "--imatrix", imatrix, "--payload", "full")
    assert result.exit_code == 0, result.output
    assert f"valid ({total} of {total} tensors proven)" in result.output
    # without it, the tensors that used it are unproven (not reported as differing, not passed)
    result = validate(path, "--source", source, "--payload", "full")
    assert result.exit_code == 1, result.output
    assert "unproven" in result.output and "quantized with an imatrix" in result.output


@pytest.mark.parametrize("arch", QUANTIZED)
def test_flipped_payload_byte_is_named(q4_k_m, arch, tmp_path):
    source, path = q4_k_m(arch)
    bad = tmp_path / "flipped.gguf"
    shutil.copy(path, bad)
    with GGUFFile(bad) as f:
        t = f.tensors["blk.1.ffn_down_exps.weight"]
        at = f.data_offset + t.offset + t.nbytes // 2 + 100       # inside a block's quants, past expert 0
    data = bytearray(bad.read_bytes())
    data[at] ^= 0x10
    bad.write_bytes(bytes(data))
    result = validate(bad, "--source", source, "--payload", "full")
    assert result.exit_code == 1, result.output
    assert "blk.1.ffn_down_exps.weight: 1 of" in result.output and "INVALID" in result.output


def test_without_source_only_the_structure_is_checked(q4_k_m, tmp_path):
    """No payload is read without --source (sample mode): the scales check says so rather than passing over
    0 bytes; --payload full scans every block and finds a NaN scale."""
    _, path = q4_k_m("qwen3_moe")
    result = validate(path)
    assert result.exit_code == 0, result.output
    assert "structure checks only" in result.output
    assert "valid (structure only: no tensor proven (pass --source))" in result.output
    assert "skipped structure.scales      no payload bytes read" in result.output, result.output
    bad = tmp_path / "nan-scale.gguf"
    bad.write_bytes(path.read_bytes())
    with GGUFFile(bad) as f:
        t = next(t for t in f.tensors.values() if t.type.name == "Q8_0")
        at = f.data_offset + t.offset + 5 * 34                    # block 5's F16 scale
    with open(bad, "r+b") as fh:
        fh.seek(at)
        fh.write(np.float16(np.nan).tobytes())
    result = validate(bad, "--payload", "full")
    assert result.exit_code == 1 and "failed  structure.scales" in result.output, result.output


def test_imatrix_types_without_the_imatrix_are_unproven(tiny_checkpoints, tmp_path):
    """An IQ2_XXS file (made by quantkit, its provenance removed) validated without its imatrix: the IQ2_XXS
    tensors are counted unproven with the reason, and the verdict is not a pass."""
    source = tiny_checkpoints.get("qwen3_moe", "per-expert", "f32")
    ours = tmp_path / "iq2.gguf"
    recipe = tmp_path / "iq2.toml"
    recipe.write_text('name = "iq2"\narchitectures = ["qwen3_moe"]\n[defaults]\ntype = "Q8_0"\n'
                      '[[rule]]\nclass = "routed_experts"\ntype = "IQ2_XXS"\n')
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(ours), "--recipe", str(recipe),
                                       "--bootstrap-importance", "--pre-tokenizer", "qwen2", "--no-progress"])
    assert result.exit_code == 0, result.output
    bare = without_quantkit_keys(ours, tmp_path / "iq2-bare.gguf")
    with GGUFFile(bare) as f:
        total = len(f.tensors)
        iq2 = sum(t.type.name == "IQ2_XXS" for t in f.tensors.values())
    assert iq2 == 6
    result = validate(bare, "--source", source, "--payload", "full")
    assert result.exit_code == 1, result.output
    assert (f"{total - iq2} of {total} tensors proven, {iq2} unproven ({iq2}: IQ2_XXS requires the imatrix the file "
            f"was made with (pass --imatrix))") in result.output


# -- scoring ------------------------------------------------------------------------------------------------------

def nll(rows: np.ndarray, ids: list[int]) -> np.ndarray:
    """Per-token NLL of ``ids[1:]`` from float32 logits rows (float64 log-softmax)."""
    x = rows[:-1].astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
    return logz - x[np.arange(len(ids) - 1), ids[1:]]


@pytest.mark.parametrize("arch", QUANTIZED)
def test_llama_cpp_files_score_the_nll_llama_cpp_gives(converted, q4_k_m, arch, monkeypatch):
    """Every token's NLL within 1e-3 of llama.cpp's: the converter's F32 file in float32; the Q4_K_M file with
    ``arithmetic="ggml-cpu"``, whose products with packed weights and SiLU run in libggml-cpu itself (llama.cpp's
    default weight placement included: Q4_K weights repacked into interleaved blocks for the AVX2 kernels).

    Emulating ggml's activation rounding and multiplying in torch is not enough: a value next to a Q8 rounding
    boundary rounds either way with float32 sums in another order, and every later token attending to it moves.
    llama.cpp against itself shows it: with ``--no-repack`` (another summation order for Q4_K) the tiny DeepSeek V3
    moves by up to 0.009 nat per token (printed).  In float32 the Q4_K_M file's mean NLL agrees within
    :data:`Q4_MEAN_NLL_TOLERANCE` only (printed with top-1 agreement: the tiny random models' near-uniform logits tie
    often, so BENCH.md's 99% bar is for real models)."""
    from quantkit.runtime import ggml_arithmetic

    monkeypatch.setattr(ggml_arithmetic, "REPACK", llama_cpu.repack())   # as llama_logits places the weights
    ids = token_ids(arch)
    _, f32 = converted(arch)
    ours, theirs = nll(logits(load_model(f32), ids), ids), nll(llama_logits(f32, ids), ids)
    assert np.abs(ours - theirs).max() <= NLL_TOLERANCE
    _, path = q4_k_m(arch)
    reference = llama_logits(path, ids)
    theirs = nll(reference, ids)
    unpacked = nll(llama_logits(path, ids, repack=False), ids)
    engine_rows = logits(load_model(path, arithmetic="ggml-cpu"), ids)
    engine = nll(engine_rows, ids)
    rows = logits(load_model(path), ids)
    plain = nll(rows, ids)
    top1 = float(np.mean(rows.argmax(axis=1) == reference.argmax(axis=1)))
    print(f"{arch} Q4_K_M: mean NLL llama.cpp {theirs.mean():.6f} (--no-repack {unpacked.mean():.6f}, max "
          f"per-token |diff| between the two {np.abs(unpacked - theirs).max():.3g}), quantkit ggml-cpu "
          f"{engine.mean():.6f} (max per-token |diff| {np.abs(engine - theirs).max():.3g}), float32 "
          f"{plain.mean():.6f} (max {np.abs(plain - theirs).max():.3g}, top-1 agreement {top1:.3f})")
    assert np.abs(engine - theirs).max() <= NLL_TOLERANCE
    if arch in BIT_EXACT and llama_cpu.repack():   # measured against llama.cpp's default placement only
        assert np.array_equal(engine_rows.view(np.uint32), reference.view(np.uint32))
    assert abs(plain.mean() - theirs.mean()) <= Q4_MEAN_NLL_TOLERANCE


#: scripts/llama_tensors.py: llama.cpp's float32 tensors for a token sequence (its eval callback).
TENSOR_DUMP = Path(__file__).resolve().parent.parent / "scripts" / "llama_tensors.py"


def llama_products(path: Path, ids: list[int], out: Path, repack: bool) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Every product of a 2-D GGUF weight in llama.cpp's graph, as (weight name, its float32 input rows, its
    output rows), read from scripts/llama_tensors.py's dump."""
    result = subprocess.run([sys.executable, str(TENSOR_DUMP), str(path), str(out), ",".join(map(str, ids)),
                             *([] if llama_cpu.repack(repack) else ["--no-repack"])], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    tensors = np.load(out)
    latest: dict[str, str] = {}          # graph name -> the dump key of its latest value
    products = []
    for line in Path(str(out) + ".order.txt").read_text().splitlines():
        key, op, _, sources = line.split("\t")
        sources = json.loads(sources.replace("'", '"'))
        if op == "MUL_MAT" and sources[0].endswith(".weight") and sources[1] in latest:
            x, y = tensors[latest[sources[1]]], tensors[key]
            if x.ndim == 4 and x.shape[:2] == (1, 1):
                products.append((sources[0], x[0, 0], y[0, 0]))
        latest[key.split("#")[0]] = key
    return products


def test_ggml_products_are_llama_cpps_own(q4_k_m, tmp_path):
    """``ggml_ref.mul_mat`` (one ``ggml_mul_mat`` through libggml-cpu) gives, bit for bit, every product of a 2-D
    weight that llama.cpp's graph computes on the tiny DeepSeek V3's Q4_K_M file (Q4_K, Q5_0, Q5_K, Q6_K weights),
    from the same inputs: with the weights repacked (llama.cpp's default, ``repack=True``) and without
    (``--no-repack``).  The two llama.cpp runs differ from each other (interleaved Q4_K kernels sum in another
    order), so each must match its own kind."""
    from quantkit import ggml_ref

    _, path = q4_k_m("deepseek_v3")
    ids = token_ids("deepseek_v3")
    with GGUFFile(path) as f:
        weights = {name: (t.type, np.array(f.data(name)), t.shape[0])
                   for name, t in f.tensors.items() if len(t.shape) == 2}
    differ = 0
    placements = (True, False) if llama_cpu.repack() else (False,)   # tests/llama_cpu.py
    for repack in placements:
        products = llama_products(path, ids, tmp_path / f"tensors-{repack}.npz", repack)
        assert {weights[name][0].name for name, _, _ in products} >= {"Q4_K", "Q5_0", "Q5_K", "Q6_K"}
        for name, x, y in products:
            qtype, payload, rows = weights[name]
            ours = ggml_ref.mul_mat(qtype, payload, rows, x, repack=repack)
            assert np.array_equal(ours.view(np.uint32), y.view(np.uint32)), f"{name} (repack={repack})"
            if repack and qtype.name == "Q4_K":
                differ += int(np.sum(ggml_ref.mul_mat(qtype, payload, rows, x).view(np.uint32) != y.view(np.uint32)))
    if True in placements:
        assert differ > 0   # repacking changes the Q4_K products: the two runs are told apart


# -- inspect and imatrix ------------------------------------------------------------------------------------------

def test_inspect_and_imatrix_info_read_the_file(q4_k_m, tmp_path):
    from quantkit.imatrix import Entry, make_imatrix, save_imatrix

    _, path = q4_k_m("qwen3_moe")
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    metadata = {m["key"]: m["value"] for m in json.loads(result.output)["metadata"]}
    assert metadata["general.architecture"] == "qwen3moe" and "quantkit.version" not in metadata
    entries = {}
    with GGUFFile(path) as f:
        for t in f.tensors.values():
            if t.name.startswith("blk.") and len(t.shape) in (2, 3):
                mats = t.shape[0] if len(t.shape) == 3 else 1
                entries[t.name] = Entry(np.ones((mats, t.shape[-1]), np.float32), np.ones(mats, np.float32))
    imatrix = tmp_path / "imatrix.gguf"
    save_imatrix(make_imatrix(entries, datasets=["synthetic:test"], chunk_count=1, synthetic=True), imatrix)
    result = CliRunner().invoke(main, ["imatrix", "info", str(imatrix), "--model", str(path)])
    assert result.exit_code == 0, result.output
    assert f"matches {path}" in result.output
