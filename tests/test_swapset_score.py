"""``quantkit score --sidecar``: a checkpoint scored with sidecars applied, measured against the plain checkpoint.

The replacement values are checked against the reference decoders themselves (compressed-tensors' and ModelOpt's
NVFP4 dequantization, compressed-tensors' FP8 per tensor / channel / 128x128 block; E8M0 blocks in float64 with
ml_dtypes' own E4M3 and E8M0 tables); the runtime's logits with a sidecar equal those of a checkpoint rewritten with
the reference-dequantized tensors (an independent path); the score tables record the sidecars, ``quantkit compare``
pairs them, and ``quantkit swapset record`` keeps the comparison in the manifest.  Bad input: one line, non-zero.
"""
import json
import shutil
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.fixtures.directory import Case, write_fixture
from quantkit.fixtures.tokens import Rendering
from quantkit.io.safetensors import SafetensorsFile, write_safetensors
from quantkit.runtime import load_model, logits
from quantkit.scoring.loading import describe_model
from quantkit.scoring.table import read_table
from quantkit.swapset import SwapsetRequest, build_swapset, sidecar_replacements, validate_sidecar
from quantkit.swapset.encodings import encoding_by_name
from quantkit.swapset.inventory import scan
from quantkit.swapset.manifest import read_manifest
from quantkit.testing.tiny_models import TinyCheckpointCache

ENCODINGS = [("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"), ("fp8-tensor", None), ("fp8-channel", None),
             ("fp8-block128", None), ("fp8-block128-e8m0", None)]
PRESETS = {"fp8-tensor": "FP8", "fp8-channel": "FP8_DYNAMIC", "fp8-block128": "FP8_BLOCK"}
PROMPTS = [("case_0", "def foo(x):", " return x + 1"), ("case_1", "import os\n", "import sys\n"),
           ("case_2", "class A:", "\n    pass"), ("case_3", "for i in", " range(10):")]
CTX = 32
TOKENS = np.arange(1, 24)
NV, FP8, DRAFT = "nv-experts", "fp8-attn", "draft"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return TinyCheckpointCache(tmp_path_factory.getbasetemp() / "swapset-tiny")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(out, code, match):
    assert out.exit_code == code, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], out.output


# ---------------------------------------------------------------------------------------------------------------
# the references' dequantization

def _e4m3(a):
    return torch.from_numpy(np.array(a).view(np.uint8)).view(torch.float8_e4m3fn)


def _reference_2d(encoding: str, t: dict) -> np.ndarray:
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    if encoding == "nvfp4-compressed-tensors":
        from compressed_tensors.compressors.nvfp4.base import unpack_fp4_from_uint8

        packed = torch.from_numpy(np.array(t["weight_packed"]))
        x = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
        return dequantize(x, _e4m3(t["weight_scale"]).to(torch.float32), dtype=torch.float32,
                          args=preset_name_to_scheme("NVFP4", ["Linear"]).weights,
                          global_scale=torch.from_numpy(np.array(t["weight_global_scale"]).reshape(1))).numpy()
    if encoding == "nvfp4-modelopt":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # it warns that this transformers version is untested
            from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
        packed = np.array(t["weight"])
        q = NVFP4QTensor(torch.Size((packed.shape[0], 2 * packed.shape[1])), torch.float32, torch.from_numpy(packed))
        return q.dequantize(dtype=torch.float32, scale=_e4m3(t["weight_scale"]), block_sizes={-1: 16},
                            double_scale=torch.from_numpy(np.array(t["weight_scale_2"]))).numpy()
    if encoding == "fp8-block128-e8m0":
        # exact: an E4M3 value times a power of two, in float64, rounded once to float32
        codes = np.ascontiguousarray(t["weight"]).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        scales = np.ascontiguousarray(t["weight_scale_inv"]).view(np.uint8).view(ml_dtypes.float8_e8m0fnu)
        full = np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)[:codes.shape[0], :codes.shape[1]]
        return (codes * full).astype(np.float32)
    import compressed_tensors.compressors as compressors

    scale = t["weight_scale_inv" if encoding == "fp8-block128" else "weight_scale"]
    out = compressors.NaiveQuantizationCompressor.decompress(
        {"weight": _e4m3(t["weight"]), "weight_scale": torch.from_numpy(np.array(scale))},
        preset_name_to_scheme(PRESETS[encoding], ["Linear"]))
    return out["weight"].numpy()


def reference_decode(encoding: str, t: dict) -> np.ndarray:
    """A module's sidecar tensors ({suffix: array}) dequantized by the reference; fused stacks per expert."""
    weight = t["weight_packed" if encoding == "nvfp4-compressed-tensors" else "weight"]
    if weight.ndim == 2:
        return _reference_2d(encoding, t)
    return np.stack([_reference_2d(encoding, {s: a if a.size == 1 else a[e] for s, a in t.items()})
                     for e in range(weight.shape[0])])


def module_arrays(payload: SafetensorsFile, manifest: dict, module: dict) -> dict:
    enc = encoding_by_name(manifest["encoding"], {t["name"][len(module["output_module"]) + 1:]
                                                  for t in manifest["tensors"]
                                                  if t["module"] == module["output_module"]})
    return {s: payload.array(f"{module['output_module']}.{s}") for s in enc.weight_suffixes}


def rewritten(model_dir, names, out):
    """A copy of the checkpoint (no sidecars) whose tensors the sidecars replace hold the references'
    dequantized values as F32: the independent path to the logits a sidecar should give."""
    out.mkdir()
    sidecar_files = {p for c in scan(model_dir) for p in c.files}
    for p in model_dir.iterdir():
        if p.is_file() and p not in sidecar_files:
            shutil.copy(p, out / p.name)
    f = SafetensorsFile(out / "model.safetensors")
    tensors = {n: np.array(f.array(n)) for n in f.names()}
    dtypes = {n: e.dtype for n, e in f.entries.items()}
    f.close()
    for name in names:
        manifest = read_manifest(model_dir / f"{name}.json")
        payload = SafetensorsFile(model_dir / f"{name}.safetensors")
        for module in manifest["modules"]:
            weight = module["source_tensor"]
            tensors[weight] = reference_decode(manifest["encoding"], module_arrays(payload, manifest, module))
            dtypes[weight] = "F32"
        payload.close()
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"}, dtypes=dtypes, overwrite=True)
    return out


def run_logits(path, replace=None):
    model = load_model(path, replace=replace)
    try:
        return logits(model, TOKENS)
    finally:
        model.close()


# ---------------------------------------------------------------------------------------------------------------
# replacement values

@pytest.mark.parametrize("fmt,convention", ENCODINGS)
def test_replacement_values_are_what_the_reference_decodes(tmp_path, tiny, fmt, convention):
    d = shutil.copytree(tiny.get("qwen3_moe"), tmp_path / "model")
    result = build_swapset(SwapsetRequest(d, families=("attn",), fmt=fmt, convention=convention))
    replacements = sidecar_replacements(d, [result.plan.name])
    payload = SafetensorsFile(result.safetensors)
    manifest = result.manifest
    assert set(replacements) == {m["source_tensor"] for m in manifest["modules"]} and len(replacements) == 8
    for module in manifest["modules"]:
        expected = reference_decode(manifest["encoding"], module_arrays(payload, manifest, module))
        value = replacements[module["source_tensor"]]()
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, expected, err_msg=module["module"])


def test_fused_expert_stacks_are_replaced_per_expert(tmp_path, tiny):
    """transformers' fused layout (``mlp.experts.gate_up_proj [E, 2I, H]``, no ``.weight`` suffix): the experts
    family selects the stacks, and the runtime runs them with the per-expert dequantized values."""
    d = shutil.copytree(tiny.get("qwen3_moe", layout="fused"), tmp_path / "model")
    result = build_swapset(SwapsetRequest(d, families=("experts",), fmt="nvfp4", convention="compressed-tensors"))
    replacements = sidecar_replacements(d, [result.plan.name])
    assert sorted(replacements) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                    for p in ("down_proj", "gate_up_proj")]
    assert replacements["model.layers.0.mlp.experts.gate_up_proj"]().shape == (8, 512, 256)
    plain, applied = run_logits(d), run_logits(d, replacements)
    np.testing.assert_array_equal(applied, run_logits(rewritten(d, [result.plan.name], tmp_path / "rewritten")))
    assert not np.array_equal(applied, plain)


# ---------------------------------------------------------------------------------------------------------------
# scoring through the CLI

@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny):
    """A qwen3_moe checkpoint with an NVFP4 experts sidecar, an FP8 attention sidecar and a draft head, a fixture
    of it, and score tables: plain, each sidecar, and both."""
    root = tmp_path_factory.mktemp("scored")
    d = shutil.copytree(tiny.get("qwen3_moe"), root / "model")
    # the fixture is made before the sidecars exist: sidecars beside a checkpoint do not change its identity
    identity = describe_model(d)[1]
    fx = write_fixture(root / "fixture", [Case(i, p, c, None) for i, p, c in PROMPTS], label="tiny-v1",
                       source=identity, rendering=Rendering("raw"), capture=None).path
    build_swapset(SwapsetRequest(d, families=("experts",), fmt="nvfp4", convention="compressed-tensors", name=NV))
    build_swapset(SwapsetRequest(d, families=("attn",), fmt="fp8-channel", name=FP8))
    build_swapset(SwapsetRequest(d, draft_lm_head=True, convention="modelopt", name=DRAFT))
    assert describe_model(d)[1] == identity
    tables = {}
    for key, names in (("plain", ()), (NV, (NV,)), (FP8, (FP8,)), ("both", (FP8, NV))):
        tables[key] = root / f"{key}.tsv"
        out = run("score", d, fx, tables[key], "--ctx", CTX, *(a for n in names for a in ("--sidecar", n)))
        assert out.exit_code == 0, out.output
    return d, fx, tables


@pytest.mark.parametrize("name", [NV, FP8])
def test_sidecar_logits_equal_the_rewritten_checkpoint(scored, tmp_path, name):
    d, fx, tables = scored
    other = rewritten(d, [name], tmp_path / "rewritten")
    applied = run_logits(d, sidecar_replacements(d, [name]))
    np.testing.assert_array_equal(applied, run_logits(other))
    assert not np.array_equal(applied, run_logits(d))
    # the table says the same: scoring the rewritten checkpoint (another digest) gives the sidecar's NLLs
    table = tmp_path / "rewritten.tsv"
    out = run("score", other, fx, table, "--ctx", CTX, "--allow-cross-checkpoint")
    assert out.exit_code == 0, out.output
    assert [s.nll for s in read_table(table).scores] == [s.nll for s in read_table(tables[name]).scores]
    assert [s.nll for s in read_table(table).scores] != [s.nll for s in read_table(tables["plain"]).scores]


def test_tables_record_the_sidecars_and_compare(scored):
    d, _, tables = scored
    sha = {n: read_manifest(d / f"{n}.json")["sidecar"]["sha256"] for n in (NV, FP8)}
    plain, nv, both = (read_table(tables[k]) for k in ("plain", NV, "both"))
    assert not any(line.startswith("sidecars") for line in plain.trailer)
    assert nv.trailer[-1] == f"sidecars {NV}={sha[NV]}"
    assert both.trailer[-1] == f"sidecars {FP8}={sha[FP8]} {NV}={sha[NV]}"
    assert nv.header["model"] == plain.header["model"] and nv.header["cross_checkpoint"] == []
    out = run("compare", tables["plain"], tables[NV], "--json")
    comparison = json.loads(out.output)
    assert out.exit_code == comparison["gate"]["exit_code"] in (0, 1), out.output     # 1: a blocker rule fired
    assert comparison["avg_nll"]["new"] != comparison["avg_nll"]["old"]
    assert comparison["verdict"] in ("better", "worse", "no established difference")


def test_record_keeps_the_comparison_in_the_manifest(scored):
    d, _, tables = scored
    out = run("swapset", "record", d, NV, tables["plain"], tables[NV])
    assert out.exit_code == 0, out.output
    expected = json.loads(run("compare", tables["plain"], tables[NV], "--json").output)
    quality = read_manifest(d / f"{NV}.json")["quality"]
    assert quality["comparison"] == expected and f"verdict={expected['verdict']}" in out.output
    assert quality["sidecar_sha256"] == read_manifest(d / f"{NV}.json")["sidecar"]["sha256"]
    assert quality["baseline_sidecars"] == {} and quality["method"] == "quantkit compare"
    assert validate_sidecar(d / f"{NV}.json").ok
    # measured on top of another sidecar: the baseline is the table with that sidecar
    out = run("swapset", "record", d, NV, tables[FP8], tables["both"])
    assert out.exit_code == 0, out.output
    assert list(read_manifest(d / f"{NV}.json")["quality"]["baseline_sidecars"]) == [FP8]

    before = (d / f"{NV}.json").read_bytes()
    one_line_error(run("swapset", "record", d, NV, tables["plain"], tables[FP8]), 2, "expected the baseline's plus")
    one_line_error(run("swapset", "record", d, NV, tables[NV], tables["both"]), 2, "already scored with sidecar")
    one_line_error(run("swapset", "record", d, NV, tables["plain"], tables["both"]), 2, "expected the baseline's plus")
    assert (d / f"{NV}.json").read_bytes() == before


def test_record_refuses_a_table_that_does_not_identify_its_model(scored, tmp_path):
    """A ds4 table without its .json sidecar has no identity record: record crashed reading its model."""
    d, fx, tables = scored
    plain = tmp_path / "plain.tsv"
    assert run("score", d, fx, plain, "--ctx", CTX, "--format", "ds4").exit_code == 0
    Path(f"{plain}.json").unlink()
    one_line_error(run("swapset", "record", d, NV, plain, tables[NV]), 2, "does not identify the model")


def _with_first_matches(table, out):
    """``table`` with every case's first token matching: a baseline the sidecar's table (no first-token match on
    the tiny model) regresses from on the first_token rule, whatever its NLL does."""
    lines = []
    for line in table.read_text().splitlines():
        cols = line.split("\t")
        if cols[0].startswith("case_"):
            cols[5] = "1"
        elif line.startswith("# summary "):
            cols = [line.replace("first_match=0", f"first_match={len(PROMPTS)}")]
        lines.append("\t".join(cols))
    out.write_text("\n".join(lines) + "\n")
    return out


def test_record_records_the_gates_verdict_and_exits_1_on_a_regression(scored, tmp_path):
    """The recorded verdict is the release gate's, as compare's exit code says: a sidecar that lowers NLL
    (``comparison.verdict`` better) but fails a blocker rule is recorded, and reported, as a regression."""
    d, _, tables = scored
    baseline = _with_first_matches(tables["plain"], tmp_path / "plain-first.tsv")
    gate = run("compare", baseline, tables[NV])
    out = run("swapset", "record", d, NV, baseline, tables[NV])
    assert gate.exit_code == out.exit_code == 1, out.output
    quality = read_manifest(d / f"{NV}.json")["quality"]
    assert quality["verdict"] == quality["comparison"]["gate"]["verdict"] == "regression"
    assert quality["failed"] == quality["comparison"]["gate"]["failed"] and "first_token" in quality["failed"]
    headline = out.output.strip().splitlines()[-1]
    assert headline == (f"recorded in {NV}.json: verdict=regression (failed: {', '.join(quality['failed'])}); "
                        f"nll verdict={quality['comparison']['verdict']}")
    # no regression: exit 0, and the recorded verdict says so
    assert run("swapset", "record", d, NV, tables["plain"], tables[NV]).exit_code == 0
    assert read_manifest(d / f"{NV}.json")["quality"]["verdict"] == "no regression"


def test_bad_sidecar_requests_are_refused_with_one_line(scored, tmp_path):
    d, fx, _ = scored
    out_tsv = tmp_path / "out.tsv"
    one_line_error(run("score", d, fx, out_tsv, "--ctx", CTX, "--sidecar", "ghost"), 2, "no sidecar 'ghost'")
    one_line_error(run("score", d, fx, out_tsv, "--ctx", CTX, "--sidecar", DRAFT), 3, "agreement")
    one_line_error(run("score", d, fx, out_tsv, "--ctx", CTX, "--sidecar", NV, "--sidecar", NV), 2, "listed twice")
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_bytes(b"GGUF" + bytes(60))
    one_line_error(run("score", fake_gguf, fx, out_tsv, "--ctx", CTX, "--sidecar", NV), 2, "this is a GGUF")

    # a checkpoint changed after the sidecar was made: the sidecar is stale
    stale = shutil.copytree(d, tmp_path / "stale")
    f = SafetensorsFile(stale / "model.safetensors")
    tensors = {n: np.array(f.array(n)) for n in f.names()}
    dtypes = {n: e.dtype for n, e in f.entries.items()}
    f.close()
    changed = "model.layers.0.mlp.experts.3.up_proj.weight"
    tensors[changed] = -tensors[changed]
    write_safetensors(stale / "model.safetensors", tensors, {"format": "pt"}, dtypes=dtypes, overwrite=True)
    one_line_error(run("score", stale, fx, out_tsv, "--ctx", CTX, "--sidecar", NV), 2, f"sidecar '{NV}' does not match")
    assert not out_tsv.exists()
