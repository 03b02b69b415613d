"""Architecture maps: every tensor of every tiny checkpoint resolves to one GGUF tensor of the right class, bad
inputs fail with the config key or tensor named, the normalized configs agree with transformers' own config
classes, and (``interop``) an F32 conversion planned by the maps equals llama.cpp's own ``convert_hf_to_gguf.py``
output tensor for tensor (names, shapes, bytes) and metadata key for key, except the differences listed in
:data:`EXPECTED_DIFFERENCES` with their reasons."""
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
from gguf.constants import GGUFValueType

from quantkit.arch import ARCHITECTURES, CLASS_GROUPS, TENSOR_CLASSES, get_arch
from quantkit.arch import transforms
from quantkit.arch.tokenizer import detect_pre_tokenizer, tokenizer_metadata
from quantkit.testing import llama_src
from quantkit.errors import SourceError, UnsupportedError
from quantkit.io.checkpoint import open_checkpoint
from quantkit.io.gguf import ArrayOf
from quantkit.testing.tiny_models import TinyCheckpointCache

LLAMA_CPP_SRC = llama_src.source_dir()
ARCHS = ("qwen3_moe", "deepseek_v3", "glm5_next", "qwen4_exp", "deepseek_v4")

#: Every checkpoint variant the maps must read: (arch, layout, encoding).
VARIANTS = [(arch, layout, "bf16") for arch in ARCHS for layout in ("per-expert", "fused")] + [
    ("deepseek_v4", "official", "bf16"), ("deepseek_v4", "official", "fp4-experts"),
    ("deepseek_v3", "per-expert", "fp8-block"), ("qwen3_moe", "per-expert", "nvfp4-modelopt"),
    ("qwen3_moe", "per-expert", "nvfp4-compressed-tensors"), ("glm5_next", "per-expert", "fp8-block"),
]

#: The tiny tokenizers are retrained BPEs whose check-text hash llama.cpp does not know: both sides get the name.
PRE_TOKENIZER = {"qwen3_moe": "qwen2", "deepseek_v3": "deepseek-v3", "deepseek_v4": "deepseek-v3",
                 "glm5_next": "glm4", "qwen4_exp": "qwen35"}
#: What llama.cpp's converter reads for each architecture (it rejects the others: fused 3-D experts for glm5/qwen4,
#: every DeepSeek V4 layout but the official one with FP4 experts).
CONVERTER_SOURCES = {"qwen3_moe": ("per-expert", "bf16"), "deepseek_v3": ("per-expert", "fp8-block"),
                     "glm5_next": ("per-expert", "bf16"), "qwen4_exp": ("per-expert", "bf16"),
                     "deepseek_v4": ("official", "fp4-experts")}
#: ``general.*`` keys other than the architecture are the GGUF writer's (quantkit.convert): file type,
#: quantization version, names (the converter guesses name/basename/finetune/size label from the directory name).
ARCH_GENERAL_KEYS = frozenset({"general.architecture"})


def _qwen4_ratios_line(config: dict) -> str:
    text = config["text_config"]
    ratios = [0 if t == "linear_attention" else text["indexer_compress_ratio"] for t in text["layer_types"]]
    return f"key qwen4exp.attention.compress_ratios: {ratios}, converter {[0] * len(ratios)}"


#: Intended differences from llama.cpp's converter (exactly these lines must come out of the comparison).
EXPECTED_DIFFERENCES = {
    # The converter marks layers named "full_attention"; transformers renames them "indexed_attention" when it
    # loads the config (the converter reads AutoConfig's view), so it writes all-zero ratios and QSA never engages.
    "qwen4_exp": lambda config: [_qwen4_ratios_line(config)],
}
#: Tensors computed as -exp(A_log): quantkit rounds exp correctly (float64, once), the converter uses PyTorch's
#: float32 exp; they may differ by one unit in the last place.
NEG_EXP_TENSORS = re.compile(r"blk\.\d+\.ssm_a$")


def same_payload(name: str, ref: np.ndarray, ours: np.ndarray) -> bool:
    """The converter's tensor ``name`` and quantkit's: the same bytes, or for :data:`NEG_EXP_TENSORS` (float32)
    within one unit in the last place (PyTorch's float32 exp is one unit off for about 1% of inputs, measured)."""
    if np.array_equal(ref.view(np.uint8), ours.view(np.uint8)):
        return True
    if not NEG_EXP_TENSORS.search(name) or ref.dtype != np.float32 or ours.dtype != np.float32 or ref.size != ours.size:
        return False
    ulps = np.abs(ref.view(np.int32).astype(np.int64) - ours.view(np.int32).astype(np.int64))
    return int(ulps.max()) <= 1


CONVERTER_RUNNER = """
import sys
sys.path.insert(0, {src!r} + "/gguf-py")
sys.path.insert(0, {src!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "f32", "--outfile", {out!r}, *{extra!r}]
convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyCheckpointCache:
    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny-arch"))


def load_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def decoded_sources(path: Path) -> tuple[dict, dict]:
    """(shapes, loader) of a checkpoint: decoded float32 shapes for weights, stored shapes for companions."""
    ckpt = open_checkpoint(path)
    companions = {c for n in ckpt.tensor_names() for c in ckpt.companions(n).values()}
    arrays = {}
    for name in ckpt.tensor_names():
        info = ckpt.tensor_info(name)
        if name in companions or info.dtype in ("I64", "I32"):
            arrays[name] = np.asarray(ckpt.raw(name))
        else:
            arrays[name] = ckpt.tensor_f32(name)
    ckpt.close()
    return {n: a.shape for n, a in arrays.items()}, arrays


# -- expected classes, written independently of the maps ----------------------------------------------------------

def expected_class(arch: str, gguf_name: str, layer_type: str | None) -> str:
    """The class a GGUF tensor should have, from its name (and, for GLM's KDA layers, the layer type)."""
    kda = arch == "glm5_next" and layer_type == "linear_attention"
    table = [
        (r"\.nextn\.", "mtp"), (r"(^|\.)(output_)?hc_", "hc"), (r"^token_embd\.", "token_embd"),
        (r"^output\.weight$", "output"), (r"per_layer_token_embd", "ngram_table"),
        (r"ffn_gate_exps", "routed_gate"), (r"ffn_up_exps", "routed_up"), (r"ffn_down_exps", "routed_down"),
        (r"ffn_gate_inp", "router"), (r"_shexp\.", "shared_expert"), (r"ffn_(gate|up|down)\.", "dense_ffn"),
        (r"exp_probs_b", "bias"), (r"tid2eid", "hash_routing"), (r"_ape\.", "ape"), (r"norm", "norm"),
        (r"ssm_conv1d|ple_conv1d", "conv"), (r"ssm_a$|ssm_dt\.", "ssm_param"), (r"ple_(key|value)", "ple"),
        (r"indexer", "indexer"), (r"attn_compressor_", "compressor"), (r"attn_sinks", "sinks"),
        (r"ssm_(f_a|f_b|g_a|g_b|beta)\.", "kda_gate" if kda else "gdn_ab"), (r"ssm_alpha", "gdn_ab"),
        (r"attn_qkv", "gdn_qkv"), (r"attn_gate", "gdn_gate"), (r"ssm_out", "gdn_output"),
        (r"attn_(q|k)\.", "kda_qk" if kda else None), (r"attn_v\.", "kda_v" if kda else "attn_kv"),
        (r"attn_output\.", "kda_output" if kda else "attn_output"),
        (r"attn_output_[ab]\.", "attn_output"), (r"attn_q(_a|_b)?\.", "attn_q"),
        (r"attn_(k|kv|kv_a_mqa|k_b|v_b)\.", "attn_kv"),
    ]
    for pattern, cls in table:
        if re.search(pattern, gguf_name) and cls is not None:
            return cls
    if re.search(r"attn_q\.", gguf_name):
        return "attn_q"
    if re.search(r"attn_k\.", gguf_name):
        return "attn_kv"
    raise AssertionError(f"no expected class for {gguf_name}")


# -- unit tests -------------------------------------------------------------------------------------------------

def test_registry_lists_the_architectures():
    # deepseek_v41 has no transformers model (so no tiny model in ARCHS): its map is tested in test_engram.py
    assert sorted(ARCHITECTURES) == sorted((*ARCHS, "deepseek_v41"))
    assert {get_arch(a).gguf_arch for a in ARCHITECTURES} == {"qwen3moe", "deepseek2", "glm5-next", "qwen4exp",
                                                              "deepseek4", "deepseek41"}
    with pytest.raises(UnsupportedError, match="llama"):
        get_arch("llama")


def test_class_groups_name_known_classes():
    for group, members in CLASS_GROUPS.items():
        assert members <= set(TENSOR_CLASSES), group


@pytest.mark.parametrize("arch,layout,encoding", VARIANTS)
def test_every_tiny_tensor_resolves_once(tiny, arch, layout, encoding):
    path = tiny.get(arch, layout, encoding)
    amap = get_arch(arch).bind(load_config(path))
    shapes, arrays = decoded_sources(path)
    outputs = amap.outputs(shapes)
    names = [o.gguf_name for o in outputs]
    assert len(names) == len(set(names))
    fed = {m.hf_name for o in outputs for m in o.sources}
    for name in shapes:
        mappings = amap.resolve(name)
        assert mappings and all(m.hf_name == name for m in mappings)
        if name not in fed:   # not a weight of any output: a companion or a claimed-but-dropped tensor
            assert all(m.role != "weight" or m.gguf_name is None for m in mappings), name
    layer_types = amap.hp.get("layer_types", [])
    for o in outputs:
        layer_type = layer_types[o.layer] if o.layer is not None and o.layer < len(layer_types) else None
        assert o.tensor_class == expected_class(arch, o.gguf_name, layer_type), o.gguf_name
        built = amap.assemble(o, arrays.__getitem__)
        assert built.shape == o.shape and str(built.dtype) == o.dtype


def test_layouts_of_one_model_give_the_same_gguf_tensors(tiny):
    """Per-expert, fused and official layouts of the same weights assemble to identical GGUF tensors."""
    for arch in ARCHS:
        layouts = ["per-expert", "fused"] + (["official"] if arch == "deepseek_v4" else [])
        built = []
        for layout in layouts:
            path = tiny.get(arch, layout, "bf16")
            amap = get_arch(arch).bind(load_config(path))
            shapes, arrays = decoded_sources(path)
            built.append({o.gguf_name: amap.assemble(o, arrays.__getitem__) for o in amap.outputs(shapes)})
        for other, layout in zip(built[1:], layouts[1:]):
            assert other.keys() == built[0].keys(), (arch, layout)
            for name, data in built[0].items():
                assert np.array_equal(data, other[name]), (arch, layout, name)


def test_companions_resolve_with_their_weight(tiny):
    amap = get_arch("deepseek_v4").bind(load_config(tiny.get("deepseek_v4", "official", "fp4-experts")))
    (scale,) = amap.resolve("layers.2.ffn.experts.5.w3.scale")
    assert (scale.gguf_name, scale.expert, scale.role) == ("blk.2.ffn_up_exps.weight", 5, "block_scale")
    (hc,) = amap.resolve("layers.1.hc_attn_scale")     # a weight whose name ends in "scale"
    assert (hc.gguf_name, hc.role) == ("blk.1.hc_attn_scale.weight", "weight")
    amap = get_arch("qwen3_moe").bind(load_config(tiny.get("qwen3_moe", "per-expert", "nvfp4-modelopt")))
    roles = {n: amap.resolve(f"model.layers.0.self_attn.q_proj.{n}")[0].role
             for n in ("weight_scale", "weight_scale_2", "input_scale", "weight_global_scale")}
    assert roles == {"weight_scale": "block_scale", "weight_scale_2": "global_scale", "input_scale": "input_scale",
                     "weight_global_scale": "global_scale_divisor"}


def test_resolution_details():
    v3 = get_arch("deepseek_v3").bind({"model_type": "deepseek_v3", "num_hidden_layers": 2, "n_routed_experts": 4})
    k_b, v_b = v3.resolve("model.layers.1.self_attn.kv_b_proj.weight")
    assert (k_b.gguf_name, k_b.transform, v_b.gguf_name, v_b.transform) == (
        "blk.1.attn_k_b.weight", ("kv_b_k",), "blk.1.attn_v_b.weight", ("kv_b_v",))
    (mtp,) = v3.resolve("model.layers.2.eh_proj.weight")      # the official MTP block is claimed, not written
    assert mtp.gguf_name is None and mtp.tensor_class == "mtp" and "MTP" in mtp.dropped
    (exp,) = v3.resolve("model.layers.1.mlp.experts.3.down_proj.weight")
    assert (exp.gguf_name, exp.tensor_class, exp.layer, exp.expert) == ("blk.1.ffn_down_exps.weight", "routed_down",
                                                                        1, 3)
    v4 = get_arch("deepseek_v4").bind({"model_type": "deepseek_v4", "num_hidden_layers": 3, "num_hash_layers": 1,
                                       "compress_ratios": [0, 4, 128]})
    (bias0,), (bias1,) = v4.resolve("layers.0.ffn.gate.bias"), v4.resolve("layers.1.ffn.gate.bias")
    assert bias0.gguf_name is None and bias1.gguf_name == "blk.1.exp_probs_b.bias"
    for name in ("model.embed_tokens.weight", "embed.weight"):
        assert v4.resolve(name)[0].gguf_name == "token_embd.weight"
    assert v4.resolve("model.layers.0.attn.norm.weight")[0].gguf_name == "blk.0.attn_kv_a_norm.weight"
    assert v4.resolve("layers.0.attn.compressor.norm.weight")[0].gguf_name == "blk.0.attn_compressor_norm.weight"
    q4 = get_arch("qwen4_exp").bind({"model_type": "qwen4_exp", "text_config": {"num_hidden_layers": 2,
                                     "ple_layer_ids": [1], "output_gate_type": "sigmoid", "indexer_n_heads": 2,
                                     "indexer_head_dim": 64, "indexer_budget": 8, "indexer_compress_ratio": 4,
                                     "eos_token_id": 3, "layer_types": ["linear_attention", "full_attention"]}})
    (shard,) = q4.resolve("model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_7.weight")
    assert (shard.gguf_name, shard.shard, shard.layer, shard.tensor_class) == (
        "per_layer_token_embd.weight", 7, None, "ngram_table")


def test_bad_tensors_are_named(tiny):
    path = tiny.get("qwen3_moe", "per-expert", "bf16")
    amap = get_arch("qwen3_moe").bind(load_config(path))
    shapes, _ = decoded_sources(path)
    cases = [
        ("model.layers.0.mlp.wrong_name.weight", "no qwen3_moe rule claims"),
        ("model.layers.9.self_attn.q_proj.weight", "layer 9 is outside"),
        ("model.layers.0.mlp.experts.8.up_proj.weight", "expert 8 is outside"),
    ]
    for name, message in cases:
        with pytest.raises(SourceError, match=message) as info:
            amap.outputs({**shapes, name: (256, 256)})
        assert info.value.tensor == name
    missing = {k: v for k, v in shapes.items() if k != "model.layers.1.mlp.experts.5.gate_proj.weight"}
    with pytest.raises(SourceError, match=r"missing \[5\]"):
        amap.outputs(missing)
    fused = {"model.layers.0.mlp.experts.down_proj": (8, 256, 256)}
    with pytest.raises(SourceError, match="mixes per-expert sources|comes from both"):
        amap.outputs({**shapes, **fused})
    no_layer1 = {k: v for k, v in shapes.items() if ".layers.1." not in k}
    with pytest.raises(SourceError, match=r"no tensor maps to blocks \[1\]") as info:
        amap.outputs(no_layer1)
    assert info.value.field == "num_hidden_layers"
    with pytest.raises(SourceError, match="qk_nope_head_dim"):
        v3 = get_arch("deepseek_v3").bind({"model_type": "deepseek_v3", "num_hidden_layers": 1})
        v3.outputs({"model.layers.0.self_attn.kv_b_proj.weight": (100, 512)})


@pytest.mark.parametrize("arch,patch,field", [
    ("deepseek_v4", {"hc_mult": 2}, "hc_mult"),
    ("deepseek_v4", {"compress_ratios": [0, 4, 64]}, "compress_ratios"),
    ("deepseek_v4", {"index_head_dim": 96}, "index_head_dim"),
    ("deepseek_v4", {"mlp_layer_types": ["moe", "hash_moe", "moe"], "num_hash_layers": 1}, "mlp_layer_types"),
    ("glm5_next", {"linear_attn_config": {"head_dim": 64, "num_heads": 2, "short_conv_kernel_size": 4}},
     "linear_num_heads"),
    ("glm5_next", {"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
    ("glm5_next", {"mlp_layer_types": ["sparse", "dense", "sparse"], "first_k_dense_replace": 1}, "mlp_layer_types"),
    ("qwen4_exp", {"output_gate_type": "silu"}, "output_gate_type"),
    ("qwen4_exp", {"ple_embed_dim": 128}, "ple_embed_dim"),
    ("qwen4_exp", {"indexer_n_heads": None}, "indexer_n_heads"),
    ("qwen4_exp", {"eos_token_id": None}, "eos_token_id"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
])
def test_constraints_name_the_config_key(tiny, arch, patch, field):
    config = load_config(tiny.get(arch, "per-expert", "bf16"))
    (config["text_config"] if "text_config" in config else config).update(patch)
    with pytest.raises(SourceError) as info:
        get_arch(arch).bind(config)
    assert info.value.field == field


def test_bind_rejects_another_model_type(tiny):
    with pytest.raises(SourceError) as info:
        get_arch("deepseek_v4").bind(load_config(tiny.get("deepseek_v3", "per-expert", "bf16")))
    assert info.value.field == "model_type"


@pytest.mark.parametrize("arch", ARCHS)
def test_normalized_defaults_match_transformers(arch):
    """Keys absent from config.json take transformers' defaults (the converter reads ``AutoConfig.to_dict()``)."""
    from transformers import AutoConfig

    module = sys.modules[f"quantkit.arch.{arch}"]
    minimal = {"model_type": arch}
    config = AutoConfig.for_model(arch).to_dict()
    reference = {**config, **config.get("text_config", {})}
    hp = get_arch(arch).normalize(minimal)
    for key in module.DEFAULTS:
        if key in reference:
            assert hp[key] == reference[key], key
    for key in ("layer_types", "mlp_layer_types", "qk_rope_head_dim", "head_dim", "ple_embed_dim", "image_token_id"):
        if key in reference and key in hp and reference[key] is not None:
            assert hp[key] == reference[key], key


def test_deepseek_v4_derives_what_transformers_drops(tiny):
    """compress_ratios, num_hash_layers and the compressed layers' YaRN keys from a transformers-saved config
    equal those of DeepSeek's own config (which llama.cpp's converter reads)."""
    official = load_config(tiny.get("deepseek_v4", "official", "bf16"))
    saved = load_config(tiny.get("deepseek_v4", "per-expert", "bf16"))
    for key in ("compress_ratios", "num_hash_layers", "rope_scaling", "qk_rope_head_dim"):
        saved.pop(key, None)
    arch = get_arch("deepseek_v4")
    a, b = arch.bind(official), arch.bind(saved)
    assert b.hp["compress_ratios"] == official["compress_ratios"]
    assert b.hp["num_hash_layers"] == official["num_hash_layers"]
    assert dict(a.metadata()) == dict(b.metadata())
    assert "deepseek4.rope.scaling.factor" in dict(b.metadata())


def test_deepseek_v3_defaults_to_sigmoid_gating(tiny):
    config = load_config(tiny.get("deepseek_v3", "per-expert", "bf16"))
    config.pop("scoring_func")
    assert dict(get_arch("deepseek_v3").bind(config).metadata())["deepseek2.expert_gating_func"].value == 2


def test_qwen4_exp_marks_indexed_layers_in_compress_ratios(tiny):
    config = load_config(tiny.get("qwen4_exp", "per-expert", "bf16"))
    text = config["text_config"]
    ratios = [text["indexer_compress_ratio"] if t != "linear_attention" else 0 for t in text["layer_types"]]
    for names in (text["layer_types"], ["indexed_attention" if t != "linear_attention" else t
                                        for t in text["layer_types"]]):
        text["layer_types"] = names
        meta = dict(get_arch("qwen4_exp").bind(config).metadata(
            tensor_values=lambda n: np.arange(3), tensor_shapes={f"x.{s}": (3,) for s in (
                "ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_offsets",
                "ple_embedding.ngram_heads_vocab_sizes")}))
        assert meta["qwen4exp.attention.compress_ratios"].value == ratios
        assert any(ratios)
    # without partial_rotary_factor transformers' rotary uses the whole head (the converter would assume 0.25)
    text["rope_parameters"].pop("partial_rotary_factor")
    meta = dict(get_arch("qwen4_exp").bind(config).metadata(
        tensor_values=lambda n: np.arange(3), tensor_shapes={f"x.{s}": (3,) for s in (
            "ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_offsets",
            "ple_embedding.ngram_heads_vocab_sizes")}))
    assert meta["qwen4exp.rope.dimension_count"].value == text["head_dim"]


def test_transform_steps_agree_with_their_shape_rules():
    hp = {"num_attention_heads": 2, "qk_nope_head_dim": 3, "v_head_dim": 4, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 2, "linear_value_head_dim": 3, "indexer_n_heads": 2,
          "indexer_head_dim": 2, "linear_num_heads": 2, "linear_head_dim": 3, "head_dim": 3}
    rng = np.random.default_rng(0)
    shapes = {"gate_half": (3, 8, 5), "up_half": (3, 8, 5), "kv_b_k": (14, 6), "kv_b_v": (14, 6),
              "neg_exp": (5,), "plus_one": (5,), "first_heads": (4,), "conv_4d": (6, 1, 4), "conv_3d": (6, 1, 4), "kda_conv_q": (18, 1, 4),
              "kda_conv_k": (18, 1, 4), "kda_conv_v": (18, 1, 4), "squeeze": (6, 1, 4),
              "gdn_qkv_v_order": (20, 5), "gdn_rows_v_order": (12, 5), "gdn_heads_order": (4,),
              "gdn_conv_v_order": (20, 4), "gdn_cols_v_order": (5, 12), "indexer_q": (6, 5), "indexer_k": (6, 5),
              "gdn_q_part": (20, 1, 4), "gdn_k_part": (20, 5), "gdn_v_part": (20, 5), "query_half": (12, 5),
              "gate_half_rows": (12, 5)}
    assert set(shapes) == set(transforms.STEPS) - {"to_int32"}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        y = transforms.apply((name,), x, hp)
        assert y.shape == transforms.output_shape((name,), shape, hp) and y.dtype == np.float32, name
    # the kv_b split keeps every value: k_b^T and v_b stacked per head rebuild kv_b
    x = rng.standard_normal((14, 6)).astype(np.float32)
    k_b, v_b = transforms.apply(("kv_b_k",), x, hp), transforms.apply(("kv_b_v",), x, hp)
    assert np.array_equal(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(14, 6), x)
    ids = np.array([[1, 2], [3, 4]], dtype=np.int64)
    assert transforms.apply(("to_int32",), ids, hp).dtype == np.int32
    with pytest.raises(SourceError, match="do not fit"):
        transforms.apply(("to_int32",), ids * (1 << 40), hp)
    # -exp is correctly rounded: the float64 result rounded once
    x = rng.standard_normal(1000).astype(np.float32)
    assert np.array_equal(transforms.apply(("neg_exp",), x, hp), (-np.exp(x.astype(np.float64))).astype(np.float32))


def test_tokenizer_pads_and_types(tiny):
    path = tiny.get("glm5_next", "per-expert", "bf16")
    amap = get_arch("glm5_next").bind(load_config(path))
    meta = dict(tokenizer_metadata(path, amap.hp, config=amap.config, pre_tokenizer="glm4",
                                   fallbacks=amap.arch.special_token_fallbacks))
    tokens, types = meta["tokenizer.ggml.tokens"].value, meta["tokenizer.ggml.token_type"].value
    data = json.loads((path / "tokenizer.json").read_text())
    assert len(tokens) == amap.hp["vocab_size"] == len(types)
    top = max(a["id"] for a in data["added_tokens"])
    assert tokens[top + 1] == f"[PAD{top + 1}]" and types[top + 1] == 5
    gmask = next(a["id"] for a in data["added_tokens"] if a["content"] == "[gMASK]")
    assert types[gmask] == 3 and meta["tokenizer.ggml.bos_token_id"].value == gmask
    assert meta["tokenizer.ggml.merges"].type == ArrayOf(GGUFValueType.STRING)
    with pytest.raises(SourceError, match="pre-tokenizer not recognised"):
        detect_pre_tokenizer(path)


# -- interop: llama.cpp's own converter --------------------------------------------------------------------------

def require_converter() -> None:
    """Fail (not skip: the interop tests are the reference) when llama.cpp's converter is not on disk."""
    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter not found under {LLAMA_CPP_SRC}: run python -m quantkit.testing.llama_src "
                    f"(or set QUANTKIT_LLAMA_CPP_SRC)")


def run_converter(model_dir: Path, out: Path, pre: str, *extra: str) -> None:
    require_converter()
    script = CONVERTER_RUNNER.format(src=str(LLAMA_CPP_SRC), pre=pre, model=str(model_dir), out=str(out),
                                     extra=list(extra))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    if result.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-4000:]}")


def reference_value(field) -> tuple[object, list[str]]:
    return field.contents(), [t.name for t in field.types]


def our_type(kv) -> list[str]:
    return ["ARRAY", kv.type.item.name] if isinstance(kv.type, ArrayOf) else [kv.type.name]


def same_value(ref, ours, types: list[str]) -> bool:
    if "FLOAT32" in types:   # the file holds float32; ours are Python floats written as float32
        return np.array_equal(np.asarray(ref, dtype=np.float32), np.asarray(ours, dtype=np.float32))
    return ref == ours


def compare_with_converter(arch: str, model_dir: Path, gguf_path: Path) -> list[str]:
    """Every difference between the map's F32 conversion and the converter's file, as readable lines."""
    amap = get_arch(arch).bind(load_config(model_dir))
    shapes, arrays = decoded_sources(model_dir)
    outputs = {o.gguf_name: o for o in amap.outputs(shapes)}
    reader = gguf.GGUFReader(gguf_path)
    ref_tensors = {t.name: t for t in reader.tensors}
    problems = [f"tensor {n} only in the converter's file" for n in sorted(set(ref_tensors) - set(outputs))]
    problems += [f"tensor {n} only in quantkit's plan" for n in sorted(set(outputs) - set(ref_tensors))]
    for name in sorted(set(outputs) & set(ref_tensors)):
        t, o = ref_tensors[name], outputs[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != o.shape:
            problems.append(f"tensor {name}: shape {o.shape}, converter {shape}")
            continue
        ours = amap.assemble(o, arrays.__getitem__)
        kind = t.tensor_type
        if kind == gguf.GGMLQuantizationType.Q8_0:      # the converter re-encodes FP8 sources as Q8_0
            same = np.array_equal(gguf.quants.quantize(ours, kind).reshape(-1), np.asarray(t.data).reshape(-1))
        elif kind in (gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.BF16):
            # FP4 experts repacked losslessly; deepseek4 keeps BF16 sources BF16 whatever the output type
            same = np.array_equal(gguf.quants.dequantize(t.data, kind).reshape(shape), ours)
        else:
            ref = np.asarray(t.data).reshape(shape)
            if ref.dtype != ours.dtype:
                problems.append(f"tensor {name}: dtype {ours.dtype}, converter {ref.dtype}")
                continue
            same = same_payload(name, ref, ours)
        if not same:
            problems.append(f"tensor {name}: data differs ({kind.name})")

    ours_meta = dict(amap.metadata(model_dir, pre_tokenizer=PRE_TOKENIZER[arch], tensor_values=arrays.__getitem__,
                                   tensor_shapes=shapes))
    ref_meta = {k: f for k, f in reader.fields.items()
                if not k.startswith(("GGUF.", "general.")) or k in ARCH_GENERAL_KEYS}
    for key in sorted(set(ref_meta) | set(ours_meta)):
        if key not in ours_meta or key not in ref_meta:
            problems.append(f"key {key} only in {'the converter' if key in ref_meta else 'quantkit'}")
            continue
        ref, types = reference_value(ref_meta[key])
        if our_type(ours_meta[key]) != types:
            problems.append(f"key {key}: type {our_type(ours_meta[key])}, converter {types}")
        elif not same_value(ref, ours_meta[key].value, types):
            problems.append(f"key {key}: {str(ours_meta[key].value)[:80]}, converter {str(ref)[:80]}")
    return problems


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """Lazily converts each architecture's tiny checkpoint with llama.cpp's converter (once per module)."""
    require_converter()
    out_dir = tmp_path_factory.mktemp("converted")
    done: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in done:
            layout, encoding = CONVERTER_SOURCES[arch]
            model_dir = tiny.get(arch, layout, encoding)
            out = out_dir / f"{arch}.gguf"
            run_converter(model_dir, out, PRE_TOKENIZER[arch])
            done[arch] = (model_dir, out)
        return done[arch]

    return get


@pytest.mark.interop
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_conversion_matches_llama_cpp_converter(converted, arch):
    model_dir, gguf_path = converted(arch)
    expected = EXPECTED_DIFFERENCES.get(arch, lambda config: [])(load_config(model_dir))
    assert compare_with_converter(arch, model_dir, gguf_path) == expected


@pytest.mark.interop
@pytest.mark.slow
def test_deepseek_v4_default_chat_template_follows_the_checkpoint_name(tiny, tmp_path):
    """Issue 18 #4: without a tokenizer template, the converter picks its 0731 template for a directory named
    ``...0731...`` and its DeepSeek V4 one otherwise; quantkit writes the same text (the plain name is covered by
    test_f32_conversion_matches_llama_cpp_converter)."""
    require_converter()
    source = tiny.get("deepseek_v4", *CONVERTER_SOURCES["deepseek_v4"])
    labelled = tmp_path / "DeepSeek-V4-Flash-tiny-0731"
    labelled.symlink_to(source, target_is_directory=True)
    out = tmp_path / "converter-0731.gguf"
    run_converter(labelled, out, PRE_TOKENIZER["deepseek_v4"])
    theirs = gguf.GGUFReader(out).fields["tokenizer.chat_template"].contents()
    amap = get_arch("deepseek_v4").bind(load_config(source))
    ours = dict(amap.metadata(labelled, pre_tokenizer=PRE_TOKENIZER["deepseek_v4"]))["tokenizer.chat_template"].value
    plain = dict(amap.metadata(source, pre_tokenizer=PRE_TOKENIZER["deepseek_v4"]))["tokenizer.chat_template"].value
    assert ours == theirs and plain != theirs
