"""The tiny checkpoints every later test builds on: they load back into transformers unchanged, their re-encoded
variants decode (through quantkit's checkpoint reader) to what an independent dequantization of the stored bytes
gives, and the official DeepSeek V4 layout carries the names llama.cpp's converter reads."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from quantkit.testing import llama_src
from quantkit.errors import UnsupportedError
from quantkit.io.checkpoint import open_checkpoint
from quantkit.testing import tiny_tokenizer
from quantkit.testing.tiny_checkpoints import ENCODINGS, PLAIN_ENCODINGS
from quantkit.testing.tiny_models import (ARCHS, TinyCheckpointCache, build_tiny_model, build_tiny_tokenizer, describe,
                                          get_arch, save_tiny_checkpoint, seeded_model, tiny_config)

#: llama.cpp's source tree (the converter is not part of the llama-cpp-python wheel).
LLAMA_CPP_SRC = llama_src.source_dir()
QUANTIZED = [e for e in ENCODINGS if e not in PLAIN_ENCODINGS]
FP8_MAX_ERROR = 0.07   # E4M3 with per-block scales: ~2-4 % relative Frobenius error on Gaussian weights
FP4_MAX_ERROR = 0.2    # E2M1 with 16/32-element scales: ~10-15 %
PROMPT = "def mean(values):\n    return sum(values) / len(values)\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyCheckpointCache:
    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny"))


class Stored(NamedTuple):
    dtype: str          # safetensors dtype
    raw: np.ndarray     # the bytes, uint8
    shape: tuple[int, ...]


def _state(directory: Path) -> dict[str, Stored]:
    """Every tensor of every shard, parsed from the file bytes (independently of quantkit's reader)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        data = path.read_bytes()
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_len])
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            raw = np.frombuffer(data, np.uint8, end - begin, 8 + header_len + begin)
            out[name] = Stored(info["dtype"], raw, tuple(info["shape"]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the tokenizer

def test_tokenizer_is_a_deterministic_byte_level_bpe():
    first = tiny_tokenizer.base_bpe_json()
    tiny_tokenizer.base_bpe_json.cache_clear()
    assert tiny_tokenizer.base_bpe_json() == first
    vocab = json.loads(first)["model"]["vocab"]
    assert len(vocab) == tiny_tokenizer.BPE_VOCAB_SIZE
    tok = build_tiny_tokenizer("qwen3_moe")
    ids = tok(PROMPT).input_ids
    assert tok.decode(ids) == PROMPT
    assert len(ids) < len(PROMPT.encode()) / 2          # merges were learned, not just bytes


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_special_tokens_sit_where_the_release_puts_them(arch):
    spec = get_arch(arch).tokenizer
    tok = build_tiny_tokenizer(arch)
    ids = tiny_tokenizer.special_ids(spec)
    for i, token in enumerate(spec.leading):
        assert tok.convert_tokens_to_ids(token) == ids[token] == i
    n_base = tiny_tokenizer.BPE_VOCAB_SIZE
    for i, token in enumerate(spec.trailing):
        assert tok.convert_tokens_to_ids(token) == ids[token] == len(spec.leading) + n_base + i
    assert len(tok) <= tiny_config(arch).get_text_config().vocab_size


# ---------------------------------------------------------------------------------------------------------------
# transformers round trip

RELOADS = [(arch, layout, encoding) for arch in sorted(ARCHS)
           for layout, encoding in (("per-expert", "bf16"), ("per-expert", "f32"), ("fused", "bf16"))]
RELOADS += [("deepseek_v4", "official", "bf16")]


@pytest.mark.parametrize("arch,layout,encoding", RELOADS)
def test_saved_checkpoint_reloads_with_identical_logits(tiny, arch, layout, encoding):
    model, tok = build_tiny_model(arch, dtype="f32" if encoding == "f32" else "bf16")
    directory = tiny.get(arch, layout, encoding)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    reloaded = getattr(transformers, get_arch(arch).auto_class).from_pretrained(directory).eval()
    with torch.no_grad():
        expected, got = model(ids).logits, reloaded(ids).logits
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    # every tensor, including those a short prompt leaves unused (compressors, indexers, vision tower)
    want, have = model.state_dict(), reloaded.state_dict()
    assert have.keys() == want.keys()
    assert [k for k in want if have[k].dtype != want[k].dtype or not torch.equal(have[k], want[k])] == []
    assert transformers.AutoTokenizer.from_pretrained(directory)(PROMPT).input_ids == ids[0].tolist()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_constant_initialised_tensor_is_perturbed(tiny, arch):
    tensors = _state(tiny.get(arch, "per-expert", "f32"))
    constant = [name for name, t in tensors.items()
                if t.dtype == "F32" and np.prod(t.shape) > 1 and np.unique(_f32(t)).size == 1]
    assert constant == []


def test_hash_routes_pick_distinct_experts():
    model, _ = build_tiny_model("deepseek_v4", dtype="f32")
    table = model.model.layers[0].mlp.gate.tid2eid
    assert table.shape == (model.config.vocab_size, model.config.num_experts_per_tok)
    assert bool((table[:, 0] != table[:, 1]).all())
    assert set(table.unique().tolist()) == set(range(model.config.n_routed_experts))


def test_models_are_seeded():
    config = tiny_config("qwen3_moe")
    a, b, c = (seeded_model("Qwen3MoeForCausalLM", config, seed) for seed in (0, 0, 1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point() and sa[k].numel() > 1)


# ---------------------------------------------------------------------------------------------------------------
# config keys llama.cpp's converter needs (INTEROP.md "What llama.cpp's converter needs")

def _converter_view(directory: Path) -> dict:
    """The hparams llama.cpp's converter works from: AutoConfig(...).to_dict(), text_config moved to the root,
    then (deepseek4 only) the raw config.json keys it lacks."""
    hp = transformers.AutoConfig.from_pretrained(directory).to_dict()
    hp = {**hp, **hp.get("text_config", {})}
    raw = json.loads((directory / "config.json").read_text())
    return hp, raw


def test_converter_keys_deepseek_v3(tiny):
    hp, _ = _converter_view(tiny.get("deepseek_v3"))
    assert hp["scoring_func"] == "sigmoid"


def test_converter_keys_glm5_next(tiny):
    hp, _ = _converter_view(tiny.get("glm5_next"))
    assert hp["mla_use_nope"] is True and hp["qk_rope_head_dim"] == 0
    assert hp["first_k_dense_replace"] == hp["mlp_layer_types"].count("dense") == 1
    assert hp["linear_attn_config"]["num_heads"] == hp["num_attention_heads"]
    assert hp["linear_attn_config"]["head_dim"] == hp["linear_head_dim"]
    assert {"linear_attention", "indexed_attention"} == set(hp["layer_types"])
    assert {"full", "shared"} == set(hp["indexer_types"][i] for i, t in enumerate(hp["layer_types"])
                                     if t == "indexed_attention")
    assert hp["index_n_heads"] >= 16


def test_converter_keys_qwen4_exp(tiny):
    hp, raw = _converter_view(tiny.get("qwen4_exp"))
    assert hp["ple_embed_dim"] == hp["hidden_size"]
    assert hp["output_gate_type"] == "sigmoid"
    assert raw["text_config"]["layer_types"] == ["linear_attention", "full_attention"]
    assert hp["indexer_n_heads"] >= 16
    assert hp["ple_layer_ids"] and hp["split_ngram_parts"] > 1


@pytest.mark.parametrize("layout,encoding", [("per-expert", "bf16"), ("official", "fp4-experts")])
def test_converter_keys_deepseek_v4(tiny, layout, encoding):
    hp, raw = _converter_view(tiny.get("deepseek_v4", layout, encoding))
    hp = {**raw, **hp}
    assert raw["compress_ratios"] == [0, 4, 128]          # every ratio llama.cpp accepts, one layer each
    assert raw["num_hash_layers"] == 1 and raw["qk_rope_head_dim"] == 64
    assert raw["rope_scaling"]["type"] == "yarn"
    assert hp["hc_mult"] == 4
    assert hp["index_head_dim"] % 64 == 0 and hp["index_n_heads"] >= 16
    config = transformers.AutoConfig.from_pretrained(tiny.get("deepseek_v4", layout, encoding))
    expected = tiny_config("deepseek_v4")
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "qk_rope_head_dim"):
        assert getattr(config, key) == getattr(expected, key)


# ---------------------------------------------------------------------------------------------------------------
# re-encoded checkpoints: quantkit's reader against an independent dequantization

def _f32(stored: Stored) -> np.ndarray:
    view = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu, "F32": np.float32,
            "BF16": ml_dtypes.bfloat16}[stored.dtype]
    return stored.raw.view(view).astype(np.float32).reshape(stored.shape)


def _fp4(packed: np.ndarray, rows: int) -> np.ndarray:
    """E2M1 values of packed bytes (element 2i in the low nibble)."""
    b = packed.reshape(rows, -1)
    nibbles = np.stack([b & 0xF, b >> 4], axis=-1).reshape(rows, -1)
    return nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _blocks(scale: np.ndarray, rows: int, cols: int, br: int, bc: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, br, axis=0)[:rows], bc, axis=1)[:, :cols]


def _independent(state: dict[str, Stored], name: str) -> np.ndarray:
    """Dequantize stored weight ``name`` from its raw bytes by the conventions of FORMATS.md."""
    weight = state[name]
    rows, cols = weight.shape
    module = name.rsplit(".", 1)[0]
    scale_name = name + "_scale_inv" if name + "_scale_inv" in state else module + ".scale"
    if weight.dtype == "F8_E4M3":                           # block FP8, 128x128 scales (F32 or E8M0)
        return _f32(weight) * _blocks(_f32(state[scale_name]), rows, cols, 128, 128)
    n = 2 * cols
    if weight.dtype == "I8":                                # FP4 + E8M0 per 32
        return _fp4(weight.raw, rows) * _blocks(_f32(state[scale_name]), rows, n, 1, 32)
    block = _f32(state[module + ".weight_scale"])           # NVFP4: E4M3 per 16
    if module + ".weight_scale_2" in state:                 # ModelOpt: a multiplier
        factor = block * _f32(state[module + ".weight_scale_2"]).reshape(())
    else:                                                   # compressed-tensors: a divisor
        factor = block / _f32(state[module + ".weight_global_scale"]).reshape(())
    return _fp4(weight.raw, rows) * _blocks(factor.astype(np.float32), rows, n, 1, 16)


def _quantized_weights(state: dict[str, Stored]) -> list[str]:
    return sorted(n for n, t in state.items()
                  if t.dtype in ("F8_E4M3", "I8", "U8") and re.search(r"\.weight(_packed)?$", n))


def _encoded_cases():
    for arch in sorted(ARCHS):
        for encoding in QUANTIZED:
            yield pytest.param(arch, "per-expert", encoding, id=f"{arch}-{encoding}")
    for encoding in ("fp8-e8m0", "fp4-experts"):
        yield pytest.param("deepseek_v4", "official", encoding, id=f"deepseek_v4-official-{encoding}")


def _shards(encoding: str) -> int:
    """Some encodings are tested sharded, so the reader resolves companions across shards."""
    return 2 if encoding in ("fp8-block-ue8m0", "nvfp4-compressed-tensors") else 1


@pytest.mark.parametrize("arch,layout,encoding", list(_encoded_cases()))
def test_encoded_checkpoint_decodes_to_the_independent_dequantization(tiny, arch, layout, encoding):
    directory = tiny.get(arch, layout, encoding, shards=_shards(encoding))
    state = _state(directory)
    plain = _state(tiny.get(arch, layout, "bf16"))
    weights = _quantized_weights(state)
    assert weights
    routed = [n for n in plain if re.search(r"\.experts\.\d+\.", n)]
    assert routed and all(n in weights or n.replace(".weight", ".weight_packed") in weights for n in routed)
    with open_checkpoint(directory) as ckpt:
        for name in weights:
            expected = _independent(state, name)
            got = ckpt.tensor_f32(name)
            assert got.dtype == np.float32 and np.array_equal(got, expected), name
            # and the stored codes do encode the BF16 release weight (relative Frobenius error)
            source = _f32(plain[name.replace(".weight_packed", ".weight")])
            error = np.linalg.norm(expected - source) / np.linalg.norm(source)
            assert error < (FP8_MAX_ERROR if state[name].dtype == "F8_E4M3" else FP4_MAX_ERROR), (name, error)
        # everything that was not quantized is stored exactly as in the BF16 release
        assert set(plain) - set(state) <= {n.replace(".weight_packed", ".weight") for n in weights}
        for name in [n for n in plain if n in state and n not in weights]:
            assert state[name].dtype == plain[name].dtype and np.array_equal(state[name].raw, plain[name].raw), name


@pytest.mark.parametrize("encoding,suffix", [("nvfp4-modelopt", ".weight_scale_2"),
                                             ("nvfp4-compressed-tensors", ".weight_global_scale")])
def test_nvfp4_global_scale_is_shared_by_fused_groups(tiny, encoding, suffix):
    state = _state(tiny.get("qwen3_moe", "per-expert", encoding, shards=_shards(encoding)))
    plain = _state(tiny.get("qwen3_moe", "per-expert", "bf16"))
    config = tiny_config("qwen3_moe")
    groups = [[f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in range(config.num_hidden_layers)]
    groups += [[f"model.layers.{i}.mlp.experts.{e}.{p}_proj" for p in ("gate", "up")]
               for i in range(config.num_hidden_layers) for e in range(config.num_experts)]
    for modules in groups:
        scales = {_f32(state[m + suffix]).item() for m in modules}
        amax = np.float32(max(np.abs(_f32(plain[m + ".weight"])).max() for m in modules))
        expected = amax / np.float32(2688) if encoding.endswith("modelopt") else np.float32(2688) / amax
        assert len(scales) == 1 and np.isclose(scales.pop(), expected, rtol=1e-6), modules


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_small_sensitive_tensors_stay_unquantized(tiny, arch):
    state = _state(tiny.get(arch, "per-expert", "fp8-block"))
    kept = [n for n in state if re.search(r"(norm|\.gate\.weight$|lm_head|embed|hc|hyper_connection|\.ple\.|"
                                          r"A_log|dt_bias|e_score_correction|position_bias|sinks|visual)", n)
            and not n.endswith("_scale_inv")]
    assert kept and all(state[n].dtype in ("BF16", "F32", "I64") for n in kept)


# ---------------------------------------------------------------------------------------------------------------
# sharding

@pytest.mark.parametrize("arch,encoding,shards", [("qwen3_moe", "fp8-block", 3), ("glm5_next", "fp4-experts", 2),
                                                  ("deepseek_v4", "bf16", 4)])
def test_sharded_checkpoint_index_is_exact_and_splits_a_scale_from_its_weight(tiny, arch, encoding, shards):
    directory = tiny.get(arch, "per-expert", encoding, shards=shards)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    files = sorted(directory.glob("*.safetensors"))
    assert [f.name for f in files] == [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    held = {}
    for f in files:
        with safe_open(f, "np") as s:
            assert list(s.keys())
            held.update(dict.fromkeys(s.keys(), f.name))
    assert held == weight_map
    assert index["metadata"]["total_size"] == sum(t.raw.nbytes for t in _state(directory).values())
    if encoding != "bf16":
        split = [n for n in weight_map if n.endswith("_scale_inv")
                 and weight_map[n] != weight_map[n[: -len("_scale_inv")]]]
        assert split


# ---------------------------------------------------------------------------------------------------------------
# the official DeepSeek V4 layout against llama.cpp's converter

def _converter_names() -> tuple[set[str], set[str], list[str]]:
    """root_map and layer_map keys and the expert patterns of ``DeepseekV4Model._map_dsv4_tensor_name``."""
    path = LLAMA_CPP_SRC / "conversion" / "deepseek.py"
    if not path.is_file():
        pytest.fail(f"llama.cpp source not found at {path}: run python -m quantkit.testing.llama_src")
    tree = ast.parse(path.read_text())
    function = next(node for node in ast.walk(tree)
                    if isinstance(node, ast.FunctionDef) and node.name == "_map_dsv4_tensor_name")
    maps = {}
    for node in ast.walk(function):
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict):
            maps[node.target.id] = {ast.literal_eval(k) for k in node.value.keys}
    patterns = [node.value for node in ast.walk(function)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "experts" in node.value]
    return maps["root_map"], maps["layer_map"], patterns


def test_official_layout_has_the_names_llama_cpp_converts(tiny):
    root_map, layer_map, expert_patterns = _converter_names()
    config = tiny_config("deepseek_v4")
    state = _state(tiny.get("deepseek_v4", "official", "fp4-experts"))
    for name, tensor in state.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in state:
            # dequant_model folds an FP8 weight's .scale into it; _write_mxfp4_expert_tensor reads expert scales
            owner = state[name[: -len(".scale")] + ".weight"].dtype
            assert owner in ("F8_E4M3", "I8") and tensor.dtype == "F8_E8M0", name
            continue
        if name in root_map:
            continue
        suffix = re.match(r"layers\.\d+\.(.+)$", name).group(1)
        assert suffix in layer_map or any(re.match(p, suffix) for p in expert_patterns), name
    assert root_map <= set(state)
    hash_layers = config.mlp_layer_types.count("hash_moe")
    for layer, layer_type in enumerate(config.layer_types):
        ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}[
            layer_type]
        expected = {k for k in layer_map if "nextn" not in k and "bias_vl" not in k
                    and ("compressor" not in k or ratio) and ("indexer" not in k or ratio == 4)
                    and ("tid2eid" not in k or layer < hash_layers) and (k != "ffn.gate.bias" or layer >= hash_layers)}
        present = {n.split(".", 2)[2] for n in state if n.startswith(f"layers.{layer}.")}
        assert expected <= present, (layer, sorted(expected - present))
        for expert in range(config.n_routed_experts):
            for proj in ("w1", "w2", "w3"):
                weight = state[f"layers.{layer}.ffn.experts.{expert}.{proj}.weight"]
                scale = state[f"layers.{layer}.ffn.experts.{expert}.{proj}.scale"]
                assert (weight.dtype, scale.dtype) == ("I8", "F8_E8M0")
                # repack_mxfp4_blocks: packed [rows, n/2], scale [rows, n/32]
                assert scale.shape == (weight.shape[0], 2 * weight.shape[1] // 32)
    assert state["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    assert all(state[n].dtype == "F32" for n in state if re.search(r"hc_|attn_sink|\.ape$|norm", n))


# ---------------------------------------------------------------------------------------------------------------
# requests that do not exist

@pytest.mark.parametrize("arch,layout,encoding", [
    ("qwen3_moe", "official", "bf16"), ("deepseek_v4", "official", "fp8-block"), ("glm5_next", "fused", "fp8-block"),
    ("qwen3_moe", "per-expert", "int3"), ("qwen3_moe", "interleaved", "bf16"), ("llama", "per-expert", "bf16")])
def test_unsupported_requests_are_refused(tmp_path, arch, layout, encoding):
    with pytest.raises(UnsupportedError):
        save_tiny_checkpoint(arch, tmp_path / "out", layout=layout, encoding=encoding)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_describe_names_every_layer(arch):
    description = describe(arch)
    assert len(description["layers"]) == description["config"]["num_hidden_layers"]
    assert description["converter_keys"] == get_arch(arch).converter_keys(tiny_config(arch))
