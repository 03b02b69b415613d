"""``quantkit convert`` against llama.cpp (the vendored tree of llama-cpp-python 0.3.36), on tiny models of the five
architectures:

* F32 conversions run in llama.cpp with an F32 KV cache give the logits transformers gives on the source, within
  1e-5 of the largest logit (qwen4_exp on a sequence short enough that its sparse attention does not engage:
  INTEROP.md documents the genuine difference once it does; deepseek_v4 on one long enough that its compressed
  attention does);
* our conversions equal the output of llama.cpp's own ``convert_hf_to_gguf.py`` tensor for tensor (names, shapes,
  types, bytes) and key for key, with recipes that make its choices (F32; DeepSeek V4's lossless MXFP4 experts,
  Q8_0 for FP8 sources and BF16 kept BF16; NVFP4 repacked with its ``.scale``), except the differences listed in
  :data:`INTENDED_DIFFERENCES` with their reasons;
* Q2-style and Q4_K conversions of each architecture, from the source encodings releases use, load and run.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.imatrix import Entry, make_imatrix, save_imatrix
from quantkit.testing.tiny_models import ARCHS as TINY_ARCHS
from quantkit.testing.tiny_models import TinyCheckpointCache, build_tiny_model
from quantkit.testing.recipe_texts import F32_RECIPE, Q2_FALLBACK_RECIPE as Q2_RECIPE
import llama_cpu
from test_arch import (EXPECTED_DIFFERENCES, PRE_TOKENIZER, reference_value, run_converter, same_payload,
                       same_value)

pytestmark = [pytest.mark.interop, pytest.mark.slow]
ARCHS = tuple(TINY_ARCHS)

#: What llama.cpp's converter makes of DeepSeek V4's official FP8 + FP4 release: MXFP4 experts (lossless), Q8_0
#: for every FP8 source, BF16 sources kept BF16, F32 elsewhere.
V4_CONVERTER_RECIPE = """name = "v4-as-llama-cpp"
architectures = ["deepseek_v4"]
[defaults]
type = "F32"
[[rule]]
class = "routed_experts"
type = "source"
[[rule]]
class = "attn_proj"
type = "Q8_0"
[[rule]]
class = "shared_expert"
type = "Q8_0"
[[rule]]
class = "indexer"
name = 'blk\\.\\d+\\.indexer\\.attn_q_b\\.weight'
type = "Q8_0"
[[rule]]
class = "token_embd"
type = "source"
[[rule]]
class = "output"
type = "source"
[[rule]]
class = "router"
type = "source"
[[rule]]
class = "compressor"
type = "source"
"""
#: What llama.cpp's converter makes of a ModelOpt NVFP4 Qwen3-MoE: NVFP4 repacked where the source is NVFP4.
NVFP4_CONVERTER_RECIPE = """name = "nvfp4-as-llama-cpp"
architectures = ["qwen3_moe"]
[defaults]
type = "F32"
[[rule]]
class = "routed_experts"
type = "source"
[[rule]]
class = "attn_proj"
type = "source"
"""
#: (source layout, encoding, recipe or recipe text) compared with llama.cpp's converter on the same source.
CONVERTER_CASES = {
    "qwen3_moe": ("per-expert", "f32", F32_RECIPE), "deepseek_v3": ("per-expert", "f32", F32_RECIPE),
    "glm5_next": ("per-expert", "f32", F32_RECIPE), "qwen4_exp": ("per-expert", "f32", F32_RECIPE),
    "deepseek_v4": ("official", "fp4-experts", V4_CONVERTER_RECIPE),
    "qwen3_moe-nvfp4": ("per-expert", "nvfp4-modelopt", NVFP4_CONVERTER_RECIPE),
}
#: Differences from the converter's file that are intended, with the reason (each line must occur).
INTENDED_DIFFERENCES = {
    # llama.cpp loads the activation scales of NVFP4 weights (``.input_scale``) but no graph uses them; quantkit
    # converts weights and their scales only.
    "qwen3_moe-nvfp4": lambda config: sorted(
        f"tensor {name} only in the converter's file" for layer in range(2)
        for name in [f"blk.{layer}.attn_{p}.input_scale" for p in ("k", "output", "q", "v")]
        + [f"blk.{layer}.ffn_{p}_exps.input_scale" for p in ("down", "gate", "up")]),
}
#: Keys compared besides the architecture's own: ``general.*`` other than these are names the converter guesses
#: from the directory name; ``quantkit.*`` is quantkit's provenance.
GENERAL_KEYS = ("general.architecture", "general.file_type", "general.quantization_version")
#: Tokens run through both engines; qwen4_exp stays below the length where its sparse attention engages,
#: deepseek_v4 goes past 128 so that its compressed attention does.
SEQUENCE_LENGTH = {"qwen3_moe": 64, "deepseek_v3": 64, "glm5_next": 64, "qwen4_exp": 16, "deepseek_v4": 160}
LOGIT_TOLERANCE = 1e-5
#: (Q2-style recipe, Q4_K recipe, source layout, source encoding) loaded in llama.cpp.
RELEASE_CASES = {
    "qwen3_moe": (Q2_RECIPE, "q4_k_m-control", "per-expert", "nvfp4-modelopt"),
    "deepseek_v3": (Q2_RECIPE, "q4_k_m-control", "per-expert", "fp8-block"),
    "glm5_next": ("glm-5.3-flash-q2", "glm-5.3-flash-q4k", "per-expert", "fp8-block"),
    "qwen4_exp": ("qwen3.8-flash-next-q2", "qwen3.8-flash-next-q4", "per-expert", "bf16"),
    "deepseek_v4": ("deepseek-v4-flash-iq2xxs-w2q2k", "deepseek-v4-flash-q4k-experts", "official", "fp4-experts"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyCheckpointCache:
    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny-interop"))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert-interop")


def recipe_arg(work: Path, recipe: str) -> str:
    """A shipped recipe name as is; recipe text written to a file."""
    if "\n" not in recipe:
        return recipe
    name = recipe.split('"')[1]
    path = work / f"{name}.toml"
    path.write_text(recipe)
    return str(path)


def convert(work: Path, source: Path, out: Path, recipe: str, arch: str, *extra: str) -> Path:
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), "--recipe", recipe_arg(work, recipe),
                                       "--pre-tokenizer", PRE_TOKENIZER[arch], "--no-progress", "-j", "1", *extra])
    assert result.exit_code == 0, result.output
    return out


def load_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


#: Runs a GGUF in llama.cpp (F32 KV cache, one batch) in a child process: a failed ggml assertion aborts the
#: process, which must not take the test session with it.
LLAMA_RUNNER = """
import sys
import numpy as np
import llama_cpp
path, out, tokens = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
if sys.argv[4] == "no-repack":      # llama-cli's --no-repack: weights stay in ggml's plain CPU buffers
    default_params = llama_cpp.llama_model_default_params

    def no_repack_params():
        params = default_params()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama_cpp.llama_model_default_params = no_repack_params
n = max(64, len(tokens))
llm = llama_cpp.Llama(model_path=path, n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, flash_attn=False,
                      type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, n_threads=2, verbose=False)
llm.eval(tokens)
np.save(out, np.array(llm.scores[: len(tokens)], dtype=np.float32))
"""


GGML_ABORT = re.compile(r"\.(c|cpp|h):\d+: ")   # ggml's "file.cpp:135: message" abort lines


def llama_logits(path: Path, tokens: list[int], repack: bool = True) -> np.ndarray:
    """llama.cpp's float32 logits of every position (F32 KV cache, no flash attention, 2 threads); ``repack=False``
    is llama.cpp's ``--no-repack`` (no interleaved copies of the weights for its CPU matrix kernels), also on CPUs
    with AMX (tests/llama_cpu.py)."""
    repack = llama_cpu.repack(repack)
    out = path.with_suffix(".logits.npy" if repack else ".no-repack.logits.npy")
    result = subprocess.run([sys.executable, "-c", LLAMA_RUNNER, str(path), str(out), ",".join(map(str, tokens)),
                             "repack" if repack else "no-repack"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if GGML_ABORT.search(line)]
        raise AssertionError(f"llama.cpp failed on {path.name} (exit {result.returncode}): "
                             + " | ".join(errors[:3] or result.stderr.splitlines()[-3:]))
    return np.load(out)


def tokens_for(arch: str) -> list[int]:
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(0, 256, SEQUENCE_LENGTH[arch])]   # byte tokens: never special


# -- logits parity ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_f32_conversion_logits_equal_transformers(tiny, work, arch):
    import torch

    source = tiny.get(arch, "per-expert", "f32")
    out = convert(work, source, work / f"{arch}-f32-parity.gguf", F32_RECIPE, arch)
    tokens = tokens_for(arch)
    ours = llama_logits(out, tokens)
    model, _ = build_tiny_model(arch, dtype="f32")
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    scale = float(np.abs(reference).max())
    diff = np.abs(ours - reference).max(axis=1)
    assert diff.max() <= LOGIT_TOLERANCE * scale, (
        f"max |diff| {diff.max():.3g} (relative {diff.max() / scale:.3g}) at position {int(diff.argmax())}")


# -- llama.cpp's converter -------------------------------------------------------------------------------------

def tensor_differences(ours: gguf.GGUFReader, theirs: gguf.GGUFReader) -> list[str]:
    mine = {t.name: t for t in ours.tensors}
    ref = {t.name: t for t in theirs.tensors}
    problems = [f"tensor {n} only in the converter's file" for n in sorted(set(ref) - set(mine))]
    problems += [f"tensor {n} only in quantkit's file" for n in sorted(set(mine) - set(ref))]
    for name in sorted(set(mine) & set(ref)):
        a, b = mine[name], ref[name]
        if a.tensor_type != b.tensor_type or list(a.shape) != list(b.shape):
            problems.append(f"tensor {name}: {a.tensor_type.name}{list(a.shape)}, converter "
                            f"{b.tensor_type.name}{list(b.shape)}")
        elif not same_payload(name, np.asarray(b.data), np.asarray(a.data)):
            problems.append(f"tensor {name}: bytes differ ({a.tensor_type.name})")
    return problems


def metadata_differences(ours: gguf.GGUFReader, theirs: gguf.GGUFReader) -> list[str]:
    def compared(reader):
        return {k: f for k, f in reader.fields.items()
                if not k.startswith(("GGUF.", "general.", "quantkit.")) or k in GENERAL_KEYS}

    mine, ref = compared(ours), compared(theirs)
    problems = []
    for key in sorted(set(mine) | set(ref)):
        if key not in mine or key not in ref:
            problems.append(f"key {key} only in {'the converter' if key in ref else 'quantkit'}")
            continue
        (a, types_a), (b, types_b) = reference_value(mine[key]), reference_value(ref[key])
        if types_a != types_b:
            problems.append(f"key {key}: type {types_a}, converter {types_b}")
        elif not same_value(b, a, types_a):
            problems.append(f"key {key}: {str(a)[:80]}, converter {str(b)[:80]}")
    return problems


@pytest.mark.parametrize("case", list(CONVERTER_CASES))
def test_conversion_equals_llama_cpp_converter(tiny, work, case):
    arch = case.split("-")[0]
    layout, encoding, recipe = CONVERTER_CASES[case]
    source = tiny.get(arch, layout, encoding)
    theirs_path = work / f"{case}-converter.gguf"
    run_converter(source, theirs_path, PRE_TOKENIZER[arch])
    ours_path = convert(work, source, work / f"{case}-quantkit.gguf", recipe, arch)
    ours, theirs = gguf.GGUFReader(ours_path), gguf.GGUFReader(theirs_path)
    config = load_config(source)
    expected = sorted(EXPECTED_DIFFERENCES.get(arch, lambda c: [])(config)
                      + INTENDED_DIFFERENCES.get(case, lambda c: [])(config))
    assert sorted(tensor_differences(ours, theirs) + metadata_differences(ours, theirs)) == expected
    llama_logits(ours_path, tokens_for(arch)[:8])   # and llama.cpp runs it


# -- release layouts load --------------------------------------------------------------------------------------

def synthetic_imatrix(path: Path, gguf_path: Path) -> Path:
    """An imatrix for every block weight of a converted file, with expert 1 of every expert tensor unobserved."""
    rng = np.random.default_rng(5)
    entries = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if not t.name.startswith("blk.") or len(shape) not in (2, 3) or t.tensor_type == gguf.GGMLQuantizationType.I32:
            continue
        mats = shape[0] if len(shape) == 3 else 1
        counts = np.full(mats, 16, np.float32)
        sums = (rng.random((mats, shape[-1])) * 16).astype(np.float32)
        if "_exps" in t.name:
            counts[1], sums[1] = 0, 0
        entries[t.name] = Entry(sums, counts)
    save_imatrix(make_imatrix(entries, datasets=["synthetic:interop"], chunk_count=4, synthetic=True), path)
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_release_layouts_load_in_llama_cpp(tiny, work, arch):
    q2, q4, layout, encoding = RELEASE_CASES[arch]
    source = tiny.get(arch, layout, encoding)
    tokens = tokens_for(arch)[:24]
    q4_path = convert(work, source, work / f"{arch}-q4.gguf", q4, arch)
    if arch == "glm5_next":   # calibrated: an imatrix with unobserved experts (bootstrap fills them in)
        imatrix = synthetic_imatrix(work / "glm-imatrix.gguf", q4_path)
        importance = ["--imatrix", str(imatrix), "--allow-synthetic-imatrix"]
    else:
        importance = ["--bootstrap-importance"]
    q2_path = convert(work, source, work / f"{arch}-q2.gguf", q2, arch, *importance)
    for path in (q2_path, q4_path):
        logits = llama_logits(path, tokens)
        assert logits.shape == (len(tokens), 512) and np.isfinite(logits).all(), path.name
    types = {t.tensor_type.name for t in gguf.GGUFReader(q2_path).tensors}
    assert "IQ2_XXS" in types and "Q2_K" in types
    assert os.path.getsize(q2_path) < os.path.getsize(q4_path)
