"""``quantkit convert`` on tiny checkpoints: payloads equal ggml's own encoding of the source (per-expert importance
included), provenance reads back, lossless paths keep the source bits, bad input stops with one line and no file
under the final name, and a resumed run after an error, a crash, Ctrl-C or a dead worker writes the same bytes as
an uninterrupted one."""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from gguf.quants import dequantize

from quantkit.arch import get_arch
from quantkit.cli import main
from quantkit.convert import execute as execute_module
from quantkit.convert.journal import Journal, JournalState, journal_path, read_journal
from quantkit.convert.plan import inspect_sources
from quantkit.resources import available_cpus
from quantkit.convert.repack import mxfp4_from_fp4_e8m0, nvfp4_from_modelopt_layout, nvfp4_tensor_scale
from quantkit.convert.source import FileHash, Hashing
from quantkit.errors import EncodeError, FormatError, ValidationError
from quantkit.formats import blockscaled
from quantkit.formats.minifloat import e2m1_decode, e4m3_decode
from quantkit.formats.registry import GGMLType
from quantkit.imatrix import Entry, make_imatrix, save_imatrix
from quantkit.io.atomic import sha256_file
from quantkit.io.checkpoint import open_checkpoint
from quantkit.io.gguf_reader import GGUFFile
from quantkit.io.safetensors import SafetensorsFile, write_safetensors
from quantkit.recipes import load_recipe
from quantkit import ggml_ref
from quantkit.testing.recipe_texts import PRE_TOKENIZER as PRE, Q2_RECIPE, SOURCE_RECIPE
from quantkit.testing.tiny_models import TinyCheckpointCache

RECIPE = "q4_k_m-control"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyCheckpointCache:
    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny-convert"))


@pytest.fixture(scope="module")
def qwen(tiny) -> Path:
    return tiny.get("qwen3_moe", "per-expert", "bf16")


def run(*args: str, jobs: int = 1):
    return CliRunner().invoke(main, ["convert", *map(str, args), "--no-progress", "-j", str(jobs)])


def one_line_error(result) -> str:
    assert result.exit_code not in (0, None), result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def leftovers(out: Path) -> set[str]:
    return {p.name for p in out.parent.iterdir() if p.name.startswith(out.name)}


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def decoded_outputs(ckpt_dir: Path) -> tuple[object, dict, dict]:
    """(arch map, GGUF name -> OutputTensor, loader) for building GGUF tensors from the source independently."""
    ckpt = open_checkpoint(ckpt_dir)
    amap = get_arch(ckpt.config["model_type"]).bind(ckpt.config)
    outputs = {o.gguf_name: o for o in amap.outputs(inspect_sources(ckpt)[0])}

    def load(name):
        if ckpt.tensor_info(name).dtype in ("I32", "I64"):
            return np.asarray(ckpt.raw(name))
        return ckpt.tensor_f32(name)
    return amap, outputs, load


def energy(w: np.ndarray) -> np.ndarray:
    """Σ w² per column in float64, rounded once: the bootstrap importance, written independently here."""
    w = w.astype(np.float64)
    return (w * w).sum(axis=0).astype(np.float32)


# -- the happy path ---------------------------------------------------------------------------------------------

def random_imatrix(path: Path, ckpt_dir: Path, unobserved: dict[str, list[int]], seed: int = 0):
    """A synthetic GGUF imatrix for every 2-D/3-D weight of the model, some experts never observed."""
    _, outputs, _ = decoded_outputs(ckpt_dir)
    rng = np.random.default_rng(seed)
    entries = {}
    for name, o in outputs.items():
        if len(o.shape) < 2 or not name.startswith("blk.") or "ffn_gate_inp" in name:
            continue
        mats = o.shape[0] if len(o.shape) == 3 else 1
        counts = rng.integers(5, 50, mats).astype(np.float32)
        sums = (rng.random((mats, o.shape[-1])) * counts[:, None]).astype(np.float32)
        for e in unobserved.get(name, []):
            counts[e], sums[e] = 0, 0
        entries[name] = Entry(sums, counts)
    imatrix = make_imatrix(entries, datasets=["synthetic:unit-test"], chunk_count=7, chunk_size=64, synthetic=True)
    save_imatrix(imatrix, path)
    return imatrix


def test_payloads_and_provenance(qwen, tmp_path):
    """Every payload equals ggml's ggml_quantize_chunk of the source tensor (expert by expert, with that expert's
    imatrix slice or, where the imatrix never observed it, Σw²); the provenance keys read back."""
    unobserved = {"blk.0.ffn_gate_exps.weight": [2, 3, 4], "blk.1.ffn_down_exps.weight": [7]}
    imx_path = tmp_path / "imatrix.gguf"
    imatrix = random_imatrix(imx_path, qwen, unobserved)
    out = tmp_path / "q.gguf"
    refused = run(qwen, "-o", out, "--recipe", RECIPE, "--imatrix", imx_path, "--pre-tokenizer", PRE)
    assert "synthetic" in one_line_error(refused) and not leftovers(out)
    result = run(qwen, "-o", out, "--recipe", RECIPE, "--imatrix", imx_path, "--allow-synthetic-imatrix",
                 "--label", "0731", "--pre-tokenizer", PRE)
    assert result.exit_code == 0, result.output
    assert leftovers(out) == {"q.gguf"}   # no partial, no journal left
    # the plan says which experts take bootstrap importance (its importance line counts whole tensors: imatrix)
    assert "bootstrap   4 matrices of 2 imatrix tensors the imatrix never observed" in result.stdout

    amap, outputs, load = decoded_outputs(qwen)
    f = GGUFFile(out)
    assert set(f.tensors) == set(outputs)
    for name, t in f.tensors.items():
        w = amap.assemble(outputs[name], load)
        if t.type in (GGMLType.F32, GGMLType.BF16, GGMLType.F16):
            expected = ggml_ref.quantize(w.reshape(-1, w.shape[-1]), t.type)
        else:
            entry = imatrix.entries.get(name)
            mats = w if w.ndim == 3 else w[None]
            parts = []
            for e, m in enumerate(mats):
                im = None
                if entry is not None:
                    im = energy(m) if entry.counts[e] == 0 else entry.in_sum2[e] / entry.counts[e]
                parts.append(ggml_ref.quantize(m, t.type, im))
            expected = np.concatenate([p.reshape(-1) for p in parts])
        assert np.array_equal(f.data(name).reshape(-1), expected.reshape(-1)), name

    meta = {k: kv.value for k, kv in f.metadata.items()}
    recipe = load_recipe(RECIPE)
    assert meta["general.file_type"] == 15                 # LlamaFileType.MOSTLY_Q4_K_M: Q4_K holds most weights
    assert meta["general.quantization_version"] == 2
    assert meta["quantize.imatrix.file"] == str(imx_path)
    assert meta["quantize.imatrix.dataset"] == "synthetic:unit-test"
    assert meta["quantize.imatrix.entries_count"] == len(imatrix.entries)
    assert meta["quantize.imatrix.chunks_count"] == 7
    assert meta["quantkit.imatrix.sha256"] == sha256_file(imx_path)
    assert meta["quantkit.imatrix.synthetic"] is True
    assert meta["quantkit.recipe.text"] == recipe.text
    assert meta["quantkit.recipe.sha256"] == hashlib.sha256(recipe.text.encode()).hexdigest()
    # qwen3_moe has no dense or shared FFN down projection: the recipe's FFNDown rule decides no tensor and the
    # file's tag leaves it out (the recipe's own tag lists it)
    assert meta["quantkit.recipe.name"] == RECIPE
    assert recipe.name_tag == "Q4K-w2Q6K-FFNDownQ6K-AttnVQ6K-OutQ6K"
    assert meta["quantkit.recipe.tag"] == "Q4K-w2Q6K-AttnVQ6K-OutQ6K"
    files = sorted(p for p in qwen.iterdir() if p.suffix in (".json", ".safetensors"))
    assert meta["quantkit.source.files"] == [p.name for p in files]
    assert meta["quantkit.source.sha256"] == [sha256_file(p) for p in files]
    assert "quantkit.source.revision" not in meta                 # a plain directory has no known revision
    assert meta["quantkit.checkpoint_label"] == "0731"
    assert meta["quantkit.version"]
    assert sorted(meta["quantkit.imatrix.bootstrap"]) == ["blk.0.ffn_gate_exps.weight:2-4",
                                                          "blk.1.ffn_down_exps.weight:7"]
    assert meta["quantkit.imatrix.calibration"] == "imatrix+bootstrap"
    assert meta["quantkit.calibration.routed_gate"] == "imatrix+bootstrap"
    assert meta["quantkit.calibration.routed_up"] == "imatrix"
    assert meta["quantkit.calibration.norm"] == "none"
    # 2 layers x 8 experts; layer 0 lost experts 2-4, layer 1 expert 7 (an expert counts when all its tensors saw it)
    assert meta["quantkit.imatrix.coverage"] == "observed 12 of 16 experts (75.00%)"


def test_worker_processes_write_the_same_bytes(qwen, tmp_path):
    single, pooled = tmp_path / "a.gguf", tmp_path / "b.gguf"
    recipe = write_recipe(tmp_path / "q2.toml", Q2_RECIPE)
    for out, jobs in ((single, 1), (pooled, 2)):
        result = run(qwen, "-o", out, "--recipe", recipe, "--bootstrap-importance", "--pre-tokenizer", PRE,
                     "--report", out.with_suffix(".json"), jobs=jobs)
        assert result.exit_code == 0, result.output
    assert sha256_file(single) == sha256_file(pooled)
    # one worker has nobody to balance with: it takes the tensors in the file's order, the whole-file hash right
    # behind it (several take the largest first)
    in_file = GGUFFile(single).tensors
    assert [d["name"] for d in json.loads(single.with_suffix(".json").read_text())["produced"]] == sorted(
        in_file, key=lambda n: in_file[n].offset)
    report = json.loads(pooled.with_suffix(".json").read_text())
    assert report["jobs"] == min(2, available_cpus()) and len(report["produced"]) == report["tensors"]
    f = GGUFFile(pooled)
    assert {d["name"]: d["sha256"] for d in report["produced"]} == {
        n: hashlib.sha256(f.data(n)).hexdigest() for n in f.tensors}
    meta = {k: kv.value for k, kv in f.metadata.items()}
    assert meta["quantkit.imatrix.calibration"] == "bootstrap" and "quantize.imatrix.file" not in meta
    assert "blk.0.ffn_gate_exps.weight:0-7" in meta["quantkit.imatrix.bootstrap"]


def test_dry_run_writes_nothing(qwen, tmp_path):
    out = tmp_path / "q.gguf"
    result = run(qwen, "-o", out, "--recipe", RECIPE, "--pre-tokenizer", PRE, "--dry-run")
    assert result.exit_code == 0 and "name tag" in result.stdout and "routed_gate" in result.stdout
    assert not leftovers(out)
    # options for what a conversion writes are refused, not ignored
    for option in (["--report", tmp_path / "r.json"], ["--release-manifest", tmp_path / "m.json"],
                   ["--address", "127.0.0.1:6379"]):
        result = run(qwen, "-o", out, "--recipe", RECIPE, "--pre-tokenizer", PRE, "--dry-run", *option)
        assert result.exit_code == 2 and option[0] in result.output, result.output
    assert not leftovers(out) and not list(tmp_path.glob("*.json"))


def test_hugging_face_repo_id_from_the_local_cache(qwen, tmp_path, monkeypatch):
    """A repo id resolves through huggingface_hub's cache (offline); the commit is recorded, and the hashes of files
    linked to blobs named by their SHA-256 are taken from the cache."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--quantkit--tiny-qwen"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in qwen.iterdir():
        blob = repo / "blobs" / (sha256_file(path) if path.suffix == ".safetensors"
                                 else hashlib.sha1(path.read_bytes()).hexdigest())
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "q.gguf"
    result = run("quantkit/tiny-qwen", "-o", out, "--recipe", "q8_0", "--pre-tokenizer", PRE)
    assert result.exit_code == 0, result.output
    meta = {k: kv.value for k, kv in GGUFFile(out).metadata.items()}
    assert meta["quantkit.source.repo"] == "quantkit/tiny-qwen" and meta["quantkit.source.revision"] == commit
    files = dict(zip(meta["quantkit.source.files"], meta["quantkit.source.sha256"]))
    assert files == {p.name: sha256_file(p) for p in qwen.iterdir() if p.suffix in (".json", ".safetensors")}
    missing = run("quantkit/not-cached", "-o", tmp_path / "x.gguf", "--recipe", "q8_0")
    assert "quantkit/not-cached" in one_line_error(missing)


# -- lossless paths -----------------------------------------------------------------------------------------------

def test_mxfp4_repack_keeps_every_value(tiny, tmp_path):
    """Packed FP4 + E8M0 experts become MXFP4 blocks whose gguf-py decoding equals the source decoding exactly."""
    src = tiny.get("deepseek_v4", "official", "fp4-experts")
    out = tmp_path / "v4.gguf"
    result = run(src, "-o", out, "--recipe", write_recipe(tmp_path / "r.toml", SOURCE_RECIPE),
                 "--pre-tokenizer", "deepseek-v3")
    assert result.exit_code == 0, result.output
    f = GGUFFile(out)
    ckpt = open_checkpoint(src)
    for layer in range(3):
        t = f.tensor(f"blk.{layer}.ffn_up_exps.weight")
        assert t.type == GGMLType.MXFP4
        got = dequantize(f.data(t.name), GGMLType.MXFP4).reshape(t.shape)
        for e in range(t.shape[0]):
            name = f"layers.{layer}.ffn.experts.{e}.w3"
            want = blockscaled.fp4_e8m0_dequantize(ckpt.raw(name + ".weight"), ckpt.raw(name + ".scale"))
            assert np.array_equal(got[e], want), (layer, e)


def payload_and_metadata(path: Path) -> tuple[dict, dict]:
    """Tensors (type, shape, bytes) and metadata of a GGUF, without quantkit's provenance keys (source hashes)."""
    with GGUFFile(path) as f:
        tensors = {n: (t.type, t.shape, bytes(f.data(n))) for n, t in f.tensors.items()}
        meta = {k: kv.value.tolist() if isinstance(kv.value, np.ndarray) else kv.value
                for k, kv in f.metadata.items() if not k.startswith("quantkit.source.")}
    return tensors, meta


@pytest.mark.parametrize("variant", ["fp4-experts-u8-scales", "fp4-experts-no-config"])
def test_v4_release_variants_convert_like_the_release(tiny, tmp_path, variant):
    """Issue 18 #3: expert scales stored as U8, or a config without quantization_config (both read by llama.cpp's
    converter), convert to the same tensors and metadata as the release layout they hold the weights of."""
    src = tiny.get("deepseek_v4", "official", variant)
    with open_checkpoint(src) as ckpt:      # the variant is what it claims to be
        if variant.endswith("u8-scales"):
            assert ckpt.tensor_info("layers.0.ffn.experts.0.w1.scale").dtype == "U8"
            assert ckpt.tensor_info("layers.0.attn.wq_a.scale").dtype == "F8_E8M0"
        else:
            assert "quantization_config" not in ckpt.config and ckpt.config["expert_dtype"] == "fp4"
    recipe = write_recipe(tmp_path / "r.toml", SOURCE_RECIPE)
    outs = []
    for i, source in enumerate((tiny.get("deepseek_v4", "official", "fp4-experts"), src)):
        result = run(source, "-o", tmp_path / f"{i}.gguf", "--recipe", recipe, "--pre-tokenizer", "deepseek-v3")
        assert result.exit_code == 0, result.output
        outs.append(payload_and_metadata(tmp_path / f"{i}.gguf"))
    (release_tensors, release_meta), (tensors, meta) = outs
    assert GGMLType.MXFP4 in {t for t, _, _ in tensors.values()}
    assert tensors == release_tensors and meta == release_meta


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors"])
def test_nvfp4_repack_keeps_blocks_and_global_scale(tiny, tmp_path, convention):
    src = tiny.get("qwen3_moe", "per-expert", f"nvfp4-{convention}")
    out = tmp_path / "q.gguf"
    result = run(src, "-o", out, "--recipe", write_recipe(tmp_path / "r.toml", SOURCE_RECIPE), "--pre-tokenizer", PRE)
    assert result.exit_code == 0, result.output
    f = GGUFFile(out)
    ckpt = open_checkpoint(src)
    packed_key, scale_key, global_key = blockscaled.NVFP4_TENSORS[convention]
    t = f.tensor("blk.1.ffn_down_exps.weight")
    assert t.type == GGMLType.NVFP4
    blocks = dequantize(f.data(t.name), GGMLType.NVFP4).reshape(t.shape)
    scales = f.data("blk.1.ffn_down_exps.scale").view("<f4")
    for e in range(t.shape[0]):
        module = f"model.layers.1.mlp.experts.{e}.down_proj"
        packed = ckpt.raw(f"{module}.{packed_key}")
        codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        block_scales = e4m3_decode(ckpt.raw(f"{module}.{scale_key}").view(np.uint8))
        # the blocks hold exactly e2m1 x e4m3 (ggml's decoding), the .scale the global multiplier
        assert np.array_equal(blocks[e], (e2m1_decode(codes).reshape(len(codes), -1, 16)
                                          * block_scales[..., None]).reshape(blocks[e].shape))
        stored = ckpt.raw(f"{module}.{global_key}").reshape(())
        multiplier = stored if convention == "modelopt" else np.float32(1) / stored
        assert scales[e] == multiplier


def test_repack_functions_against_gguf_py():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 128)) * rng.uniform(0.01, 10, (4, 1))).astype(np.float32)
    packed, scales = blockscaled.fp4_e8m0_quantize(w)
    blocks = mxfp4_from_fp4_e8m0(packed, scales)
    assert np.array_equal(dequantize(blocks, GGMLType.MXFP4).reshape(w.shape),
                          blockscaled.fp4_e8m0_dequantize(packed, scales))
    bad = scales.copy()
    bad[2, 1] = 0xFF
    with pytest.raises(EncodeError, match="NaN"):
        mxfp4_from_fp4_e8m0(packed, bad)
    parts = blockscaled.nvfp4_quantize(w, "modelopt")
    nv = nvfp4_from_modelopt_layout(parts["weight"], parts["weight_scale"])
    want = blockscaled.nvfp4_dequantize(parts["weight"], parts["weight_scale"], np.float32(1), "modelopt")
    assert np.array_equal(dequantize(nv, GGMLType.NVFP4).reshape(w.shape), want)
    negative = parts["weight_scale"].copy()
    negative[0, 0] |= 0x80
    with pytest.raises(EncodeError, match="negative"):
        nvfp4_from_modelopt_layout(parts["weight"], negative)
    with pytest.raises(EncodeError, match="multiple of"):
        nvfp4_from_modelopt_layout(parts["weight"][:, :24], parts["weight_scale"][:, :3])
    assert nvfp4_tensor_scale(np.float32(0.25), "compressed-tensors") == np.float32(4.0)
    with pytest.raises(EncodeError, match="positive"):
        nvfp4_tensor_scale(np.float32(0.0), "modelopt")


def test_ngram_table_is_copied_byte_exact(tiny, tmp_path):
    src = tiny.get("qwen4_exp", "per-expert", "bf16")
    out = tmp_path / "q.gguf"
    result = run(src, "-o", out, "--recipe", "qwen3.8-flash-next-q4", "--pre-tokenizer", "qwen35")
    assert result.exit_code == 0, result.output
    f = GGUFFile(out)
    t = f.tensor("per_layer_token_embd.weight")
    assert t.type == GGMLType.BF16
    _, outputs, _ = decoded_outputs(src)
    ckpt = open_checkpoint(src)
    stored = b"".join(np.ascontiguousarray(ckpt.raw(m.hf_name)).view(np.uint8).tobytes()
                      for m in outputs[t.name].sources)
    assert f.data(t.name).tobytes() == stored


# -- bad input -----------------------------------------------------------------------------------------------------

def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensor(path: Path, name: str, change) -> None:
    with SafetensorsFile(path) as f:
        arrays = {n: np.array(f.array(n)) for n in f.names()}
        dtypes = {n: f.entry(n).dtype for n in f.names()}
    arrays[name] = change(arrays[name])
    write_safetensors(path, arrays, metadata={"format": "pt"}, dtypes=dtypes, overwrite=True)


def test_missing_shard(tiny, tmp_path):
    src = copy_checkpoint(tiny.get("qwen3_moe", "per-expert", "bf16", shards=3), tmp_path / "ckpt")
    (src / "model-00002-of-00003.safetensors").unlink()
    out = tmp_path / "q.gguf"
    line = one_line_error(run(src, "-o", out, "--recipe", RECIPE, "--pre-tokenizer", PRE))
    assert "model-00002-of-00003.safetensors" in line and "missing" in line
    assert not leftovers(out)


def test_index_naming_a_missing_tensor(tiny, tmp_path):
    src = copy_checkpoint(tiny.get("qwen3_moe", "per-expert", "bf16", shards=3), tmp_path / "ckpt")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.experts.9.up_proj.weight"] = "model-00001-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "q.gguf"
    line = one_line_error(run(src, "-o", out, "--recipe", RECIPE, "--pre-tokenizer", PRE))
    assert "model.layers.0.mlp.experts.9.up_proj.weight" in line and "no such tensor" in line
    assert not leftovers(out)


@pytest.mark.parametrize("change, message", [
    ({"num_local_experts": 6}, "expert 6 is outside"),
    ({"num_hidden_layers": 3}, r"num_hidden_layers.*declares 3 but the checkpoint's tensors hold 2"),
    ({"hidden_size": 128}, r"hidden_size.*config.json gives 128 \(qwen3moe.embedding_length\)"),
    ({"vocab_size": 640}, r"vocab_size.*declares 640 but the checkpoint's tensors hold 512"),
    ({"moe_intermediate_size": 512}, "moe_intermediate_size.*expert_feed_forward_length"),
])
def test_config_not_matching_the_tensors(qwen, tmp_path, change, message):
    src = copy_checkpoint(qwen, tmp_path / "ckpt")
    config = json.loads((src / "config.json").read_text())
    config.update(change)
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "q.gguf"
    result = run(src, "-o", out, "--recipe", RECIPE, "--pre-tokenizer", PRE)
    assert re.search(message, one_line_error(result))
    assert not leftovers(out)


@pytest.mark.parametrize("case", ["unknown tensor", "row length", "expert count"])
def test_imatrix_of_another_model(qwen, tmp_path, case):
    name = {"unknown tensor": "blk.7.attn_q.weight", "row length": "blk.0.attn_q.weight",
            "expert count": "blk.0.ffn_up_exps.weight"}[case]
    shape = {"unknown tensor": (1, 256), "row length": (1, 512), "expert count": (6, 256)}[case]
    imatrix = make_imatrix({name: Entry(np.ones(shape, np.float32), np.ones(shape[0], np.float32))},
                           datasets=["wiki.train"], chunk_count=3)
    path = tmp_path / "other.gguf"
    save_imatrix(imatrix, path)
    out = tmp_path / "q.gguf"
    line = one_line_error(run(qwen, "-o", out, "--recipe", RECIPE, "--imatrix", path, "--pre-tokenizer", PRE))
    assert name in line and ("another model" in line or "expert counts" in line)
    assert not leftovers(out)


def nan_checkpoint(qwen: Path, dst: Path, tensor: str) -> Path:
    src = copy_checkpoint(qwen, dst)

    def poison(a):
        a = a.copy()
        a[3, 5] = np.array(np.nan, dtype=ml_dtypes.bfloat16)
        return a
    rewrite_tensor(src / "model.safetensors", tensor, poison)
    return src


@pytest.mark.parametrize("jobs", [1, 2])
def test_nan_in_weights(qwen, tmp_path, jobs):
    """The error names the tensor and expert, and the partial output and journal are removed: --resume would
    stop at the same NaN, and a repaired source file is another source (its hash goes into the header), so they
    could never be finished.  The repaired source converts."""
    src = nan_checkpoint(qwen, tmp_path / "ckpt", "model.layers.1.mlp.experts.5.gate_proj.weight")
    out = tmp_path / "q.gguf"
    args = (src, "-o", out, "--recipe", RECIPE, "--pre-tokenizer", PRE)
    line = one_line_error(run(*args, jobs=jobs))
    assert "blk.1.ffn_gate_exps.weight[5]" in line and "non-finite" in line
    assert leftovers(out) == set()
    rewrite_tensor(src / "model.safetensors", "model.layers.1.mlp.experts.5.gate_proj.weight",
                   lambda a: np.nan_to_num(a.astype(np.float32)).astype(ml_dtypes.bfloat16))
    assert run(*args).exit_code == 0 and leftovers(out) == {"q.gguf"}


@pytest.mark.parametrize("qtype, value", [("F16", 1e5), ("Q8_0", 1e7)])
def test_a_finite_weight_beyond_the_types_range_is_refused(qwen, tmp_path, qtype, value):
    """A finite BF16 weight above F16's 65504 (or one whose Q8_0 block scale overflows F16) would be written as
    Inf, which llama.cpp refuses to load and validate fails: convert stops naming the tensor and row instead of
    reporting success."""
    src = copy_checkpoint(qwen, tmp_path / "ckpt")

    def huge(a):
        a = a.copy()
        a[3, 7] = np.array(value, dtype=ml_dtypes.bfloat16)
        return a
    rewrite_tensor(src / "model.safetensors", "model.layers.0.self_attn.q_proj.weight", huge)
    recipe = write_recipe(tmp_path / "r.toml", f'name = "wide"\narchitectures = ["qwen3_moe"]\n[defaults]\n'
                                               f'type = "{qtype}"\n')
    out = tmp_path / "q.gguf"
    line = one_line_error(run(src, "-o", out, "--recipe", recipe, "--pre-tokenizer", PRE))
    assert "blk.0.attn_q.weight" in line and "row 3" in line and f"encoded as {qtype}" in line, line
    assert not out.exists()


def test_outputs_written_into_the_source_directory_are_not_part_of_its_identity(qwen, tmp_path):
    """A conversion written into the checkpoint's own directory leaves its release manifest and report there: the
    next conversion of that directory records the same source and writes the same bytes, and the first one
    validates (they recorded the manifest as a source file: the outputs differed and validate failed)."""
    src = copy_checkpoint(qwen, tmp_path / "ckpt")
    args = ("--recipe", "q8_0", "--pre-tokenizer", PRE)
    assert run(src, "-o", tmp_path / "before.gguf", *args).exit_code == 0
    inside = src / "inside.gguf"
    result = run(src, "-o", inside, *args, "--report", src / "inside-report.json")
    assert result.exit_code == 0 and (src / "inside.release.json").is_file(), result.output
    assert run(src, "-o", tmp_path / "after.gguf", *args).exit_code == 0
    assert (tmp_path / "after.gguf").read_bytes() == (tmp_path / "before.gguf").read_bytes()
    validated = CliRunner().invoke(main, ["validate", str(inside), "--source", str(src), "--payload", "full"])
    assert validated.exit_code == 0, validated.output


@pytest.fixture(scope="module")
def reference(qwen, tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted Q2 conversion (bootstrap importance) and its recipe."""
    root = tmp_path_factory.mktemp("reference")
    recipe = write_recipe(root / "q2.toml", Q2_RECIPE)
    out = root / "ref.gguf"
    result = run(qwen, "-o", out, "--recipe", recipe, "--bootstrap-importance", "--pre-tokenizer", PRE)
    assert result.exit_code == 0, result.output
    return out, recipe


def q2_args(qwen, out, recipe):
    return (qwen, "-o", out, "--recipe", recipe, "--bootstrap-importance", "--pre-tokenizer", PRE)


def count_produced(monkeypatch) -> list[str]:
    produced = []
    real = execute_module.WorkerPool.run

    def counting(self, setup, names):
        for done in real(self, setup, names):
            produced.append(done.name)
            yield done
    monkeypatch.setattr(execute_module.WorkerPool, "run", counting)
    return produced


def hashes_first(monkeypatch) -> None:
    """Every source hash known before the first tensor completes, so the journal's line of them precedes every
    tensor line (a tiny source usually hashes first anyway; the tests must not depend on it)."""
    real = Hashing.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.result()
    monkeypatch.setattr(Hashing, "__init__", init)


def journal_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in journal_path(out).read_text().splitlines()]


def test_write_error_then_resume(qwen, reference, tmp_path, monkeypatch):
    ref, recipe = reference
    out = tmp_path / "q.gguf"
    hashes_first(monkeypatch)
    real_pwrite, calls = os.pwrite, []

    def failing_pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 40:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    line = one_line_error(run(*q2_args(qwen, out, recipe)))
    assert "no space left" in line and "q.gguf.partial" in line and "--resume" in line
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert leftovers(out) == {"q.gguf.partial", "q.gguf.journal"}
    journaled = sum('"tensor"' in line for line in journal_path(out).read_text().splitlines())
    assert 0 < journaled < len(GGUFFile(ref).tensors)
    produced = count_produced(monkeypatch)
    result = run(*q2_args(qwen, out, recipe), "--resume")
    assert result.exit_code == 0, result.output
    assert len(produced) == len(GGUFFile(ref).tensors) - journaled   # journaled tensors were not redone
    assert sha256_file(out) == sha256_file(ref) and leftovers(out) == {"q.gguf"}


@pytest.mark.parametrize("jobs", [1, 2])
def test_crash_then_resume(qwen, reference, tmp_path, jobs):
    """A process killed (SIGKILL, no clean-up) right after journaling its third tensor resumes to the same bytes
    (its workers die with it), keeping the three tensors: the source hashes were journaled before them."""
    ref, recipe = reference
    out = tmp_path / "q.gguf"
    script = ("import os, signal, sys\n"
              "from quantkit.convert import journal, source\n"
              "hashing = source.Hashing.__init__\n"
              "def hashes_first(self, *a, **kw):\n"   # see hashes_first()
              "    hashing(self, *a, **kw)\n"
              "    self.result()\n"
              "source.Hashing.__init__ = hashes_first\n"
              "real = journal.Journal.record\n"
              "def record(self, *a):\n"
              "    real(self, *a)\n"
              "    record.n = getattr(record, 'n', 0) + 1\n"
              "    if record.n == 3:\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "journal.Journal.record = record\n"
              "from quantkit.cli import main\n"
              "main()\n")
    args = [str(a) for a in q2_args(qwen, out, recipe)] + ["--no-progress", "-j", str(jobs)]
    crashed = subprocess.run([sys.executable, "-c", script, "convert", *args], capture_output=True, text=True,
                             timeout=600)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert leftovers(out) == {"q.gguf.partial", "q.gguf.journal", "q.gguf.lock"}   # the lock died with its holder
    records = journal_records(out)
    assert [list(r)[0] for r in records] == ["journal", "source_sha256", "tensor", "tensor", "tensor"]
    hashes = records[1]["source_sha256"]
    assert "model.safetensors" in hashes and hashes == {n: sha256_file(qwen / n) for n in hashes}
    resumed = subprocess.run([sys.executable, "-c", "from quantkit.cli import main; main()", "convert", *args,
                              "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "3 from the journal" in resumed.stdout
    assert sha256_file(out) == sha256_file(ref)


def interrupt_after_lines(monkeypatch, out: Path, lines: int):
    """Make ``Journal.record`` raise KeyboardInterrupt (Ctrl-C) once ``out``'s journal holds more than ``lines``
    lines; returns the real method."""
    real = Journal.record

    def interrupt(self, *a):
        real(self, *a)
        if len(journal_path(out).read_text().splitlines()) > lines:
            raise KeyboardInterrupt
    monkeypatch.setattr(Journal, "record", interrupt)
    return real


def test_interrupted_before_the_source_hashes_resumes_from_scratch(qwen, reference, tmp_path, monkeypatch):
    """Tensors journaled before the source's hashes are known say nothing about what they were made from: a resume
    keeps none of them (without an error), starts a fresh journal and still ends with the reference bytes."""
    ref, recipe = reference
    out = tmp_path / "q.gguf"
    monkeypatch.setattr(Hashing, "done", lambda self: False)
    interrupt_after_lines(monkeypatch, out, 3)
    assert run(*q2_args(qwen, out, recipe)).exit_code == 130
    monkeypatch.undo()
    assert [list(r)[0] for r in journal_records(out)] == ["journal", "tensor", "tensor", "tensor"]
    produced = count_produced(monkeypatch)
    result = run(*q2_args(qwen, out, recipe), "--resume")
    assert result.exit_code == 0, result.output
    assert "from the journal" not in result.output and len(produced) == len(GGUFFile(ref).tensors)
    assert sha256_file(out) == sha256_file(ref) and leftovers(out) == {"q.gguf"}


def test_ctrl_c_then_resume(qwen, reference, tmp_path, monkeypatch):
    ref, recipe = reference
    out = tmp_path / "q.gguf"
    real = interrupt_after_lines(monkeypatch, out, 8)
    result = run(*q2_args(qwen, out, recipe))
    assert result.exit_code == 130 and "--resume" in result.stderr
    monkeypatch.setattr(Journal, "record", real)
    assert run(*q2_args(qwen, out, recipe), "--resume").exit_code == 0
    assert sha256_file(out) == sha256_file(ref)


def test_dead_worker_then_resume(qwen, reference, tmp_path, monkeypatch):
    """A worker killed mid-run (as by the OOM killer) is reported with the tensor it held; resume completes."""
    ref, recipe = reference
    out = tmp_path / "q.gguf"
    real = Journal.record

    def kill_workers(self, *a):
        real(self, *a)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
    monkeypatch.setattr(Journal, "record", kill_workers)
    line = one_line_error(run(*q2_args(qwen, out, recipe), jobs=2))
    assert "died" in line and "signal 9" in line
    monkeypatch.setattr(Journal, "record", real)
    assert run(*q2_args(qwen, out, recipe), "--resume", jobs=2).exit_code == 0
    assert sha256_file(out) == sha256_file(ref)


def test_existing_outputs_and_space(qwen, reference, tmp_path):
    ref, recipe = reference
    out = tmp_path / "q.gguf"
    out.write_bytes(b"keep me")
    assert "exists" in one_line_error(run(*q2_args(qwen, out, recipe)))
    assert out.read_bytes() == b"keep me"
    out.unlink()
    out.with_name("q.gguf.partial").write_bytes(b"old")
    assert "--resume" in one_line_error(run(*q2_args(qwen, out, recipe)))
    assert "no journal" in one_line_error(run(*q2_args(qwen, out, recipe), "--resume"))
    out.with_name("q.gguf.partial").unlink()
    request = execute_module.ConvertRequest(source=str(qwen), out=out, recipe=str(recipe), bootstrap=True,
                                            pre_tokenizer=PRE, reserve_bytes=1 << 60, progress=False)
    with pytest.raises(Exception, match="not enough free space"):
        execute_module.convert(request)
    assert not leftovers(out)


def test_resume_of_another_plan_is_refused(qwen, reference, tmp_path, monkeypatch):
    ref, recipe = reference
    out = tmp_path / "q.gguf"
    real = Journal.record

    def interrupt(self, *a):
        real(self, *a)
        raise KeyboardInterrupt
    monkeypatch.setattr(Journal, "record", interrupt)
    assert run(*q2_args(qwen, out, recipe)).exit_code == 130
    monkeypatch.setattr(Journal, "record", real)
    line = one_line_error(run(qwen, "-o", out, "--recipe", RECIPE, "--pre-tokenizer", PRE, "--resume"))
    assert "another plan" in line and leftovers(out) == {"q.gguf.partial", "q.gguf.journal"}


def test_journal_tolerates_a_cut_last_line(tmp_path):
    path = tmp_path / "x.journal"
    source = FileHash("a.safetensors", 3, 4, "")
    journal = Journal.create(path, "abc", [source])
    journal.record("t0", "0" * 64)   # before the source hashes: kept as well once they follow
    journal.record_sources([FileHash("a.safetensors", 3, 4, "f" * 64)])
    journal.record("t1", "1" * 64)
    journal.close()
    with open(path, "ab") as f:
        f.write(b'{"tensor": "t2", "sha')
    state = read_journal(path, "abc", [source])
    assert state.done == {"t0": "0" * 64, "t1": "1" * 64} and state.source_sha256 == {"a.safetensors": "f" * 64}
    with pytest.raises(ValidationError, match="another plan"):
        read_journal(path, "abd", [source])
    with pytest.raises(ValidationError, match="'a.safetensors' changed"):
        read_journal(path, "abc", [FileHash("a.safetensors", 3, 5, "")])
    Journal.reopen(path).close()
    assert path.read_bytes().endswith(b"\n")
    path.write_bytes(b'{"journal": 3, "layout_sha256": "abc", "sources": []}\nnot json\n{"tensor": "t"}\n')
    with pytest.raises(FormatError, match="line 2"):
        read_journal(path, "abc", [])
    path.write_bytes(b'{"journal": 3, "layout_sha256": "abc", "sources": []}\n{"tensor": "t", "sha256": "1"}\n')
    assert read_journal(path, "abc", []) == JournalState()   # no source hashes: nothing to keep
    path.write_bytes(b'{"journal": 2, "layout_sha256": "abc", "sources": []}\n')
    with pytest.raises(FormatError, match="not a version-3 conversion journal; start over with --force"):
        read_journal(path, "abc", [])
