"""The checkpoint source: layouts, quantization detection, companions across shards, exact decoding per scheme,
expert slices, laziness, and a corpus of broken checkpoints.  Checkpoints are built with our writer and the
block-scaled encoders; decoded values are compared with the encoders' inputs through the pure decoders."""
import json

import ml_dtypes
import numpy as np
import pytest

from quantkit.errors import FormatError, MissingSourceError, QuantkitError, SourceError, UnsupportedError
from quantkit.formats import blockscaled as bs
from quantkit.io import checkpoint as ckpt
from quantkit.io.checkpoint import open_checkpoint
from quantkit.io.safetensors import write_safetensors

RNG = np.random.default_rng(99)


def weights(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def save_dir(directory, shards, config=None, index=True, hf_quant=None):
    """shards: {file name: ({tensor: array}, {tensor: dtype})}; writes an index when there are several."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for fname, (tensors, dtypes) in shards.items():
        write_safetensors(directory / fname, tensors, {"format": "pt"}, dtypes=dtypes)
        weight_map.update({name: fname for name in tensors})
    if index:
        (directory / ckpt.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (directory / ckpt.CONFIG_NAME).write_text(json.dumps(config))
    if hf_quant is not None:
        (directory / ckpt.HF_QUANT_CONFIG_NAME).write_text(json.dumps(hf_quant))
    return directory


FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}


def v3_checkpoint(directory, block=(128, 128)):
    w = weights(200, 300)
    codes, scale = bs.fp8_block_quantize(w, block)
    config = {"quantization_config": {**FP8_CONFIG["quantization_config"], "weight_block_size": list(block)}}
    shards = {  # the scale lives in the other shard: resolved through the index
        "model-00001-of-00002.safetensors": ({"l.weight": codes, "norm.weight": weights(300)}, {"l.weight": "F8_E4M3"}),
        "model-00002-of-00002.safetensors": ({"l.weight_scale_inv": scale}, None),
    }
    return save_dir(directory, shards, config), w, codes, scale


# ---------------------------------------------------------------------------------------------------------------
# layouts and API

def test_single_file_plain(tmp_path):
    t = {"a.weight": weights(4, 3), "b": weights(5).astype(np.float16), "c": np.arange(3, dtype=np.int32)}
    path = write_safetensors(tmp_path / "x.safetensors", t, {"format": "pt"})
    with open_checkpoint(path) as c:
        assert c.config == {} and c.metadata == {"format": "pt"} and c.quantization == "none"
        assert c.tensor_names() == ["a.weight", "b", "c"]
        info = c.tensor_info("b")
        assert (info.name, info.dtype, info.shape, info.nbytes, info.file) == ("b", "F16", (5,), 10, path)
        assert [i.name for i in c.tensor_infos()] == c.tensor_names()
        np.testing.assert_array_equal(c.tensor_f32("b"), t["b"].astype(np.float32))
        assert c.tensor_f32("a.weight").dtype == np.float32
        raw = c.raw("a.weight")
        assert not raw.flags.owndata and not raw.flags.writeable
        with pytest.raises(UnsupportedError, match="dtype I32"):
            c.tensor_f32("c")
        with pytest.raises(SourceError, match="fused 3-D"):
            c.tensor_f32("a.weight", expert=0)


def test_directory_with_model_safetensors_and_bf16(tmp_path):
    w = weights(3, 4).astype(ml_dtypes.bfloat16)
    save_dir(tmp_path, {"model.safetensors": ({"w": w}, None)}, config={"architectures": ["X"]}, index=False)
    with open_checkpoint(tmp_path) as c:
        assert c.config == {"architectures": ["X"]} and c.quantization == "none"
        np.testing.assert_array_equal(c.tensor_f32("w"), w.astype(np.float32))


def test_v3_sharded_fp8_block(tmp_path):
    path, w, codes, scale = v3_checkpoint(tmp_path)
    with open_checkpoint(path) as c:
        assert c.quantization == "fp8-block"
        assert c.companions("l.weight") == {"scale_inv": "l.weight_scale_inv"}
        assert c.tensor_info("l.weight_scale_inv").file.name == "model-00002-of-00002.safetensors"
        got = c.tensor_f32("l.weight")
        np.testing.assert_array_equal(got, bs.fp8_block_dequantize(codes, scale))
        assert np.abs(got - w).max() <= np.abs(w).max() * 2.0 ** -4
        np.testing.assert_array_equal(c.raw("l.weight").view(np.uint8), codes)


def test_v3_block_shape_comes_from_config(tmp_path):
    path, w, codes, scale = v3_checkpoint(tmp_path, block=(64, 32))
    with open_checkpoint(path) as c:
        assert c.block == (64, 32)
        np.testing.assert_array_equal(c.tensor_f32("l.weight"), bs.fp8_block_dequantize(codes, scale, (64, 32)))


def test_v4_fp8_e8m0_and_fp4_experts(tmp_path):
    attn = weights(130, 256)
    codes, scales = bs.fp8_block_quantize_e8m0(attn)
    expert = weights(8, 64)
    packed, escales = bs.fp4_e8m0_quantize(expert)
    tensors = {"layers.0.attn.wq.weight": codes, "layers.0.attn.wq.scale": scales,
               "layers.0.ffn.experts.3.w1.weight": packed, "layers.0.ffn.experts.3.w1.scale": escales}
    dtypes = {"layers.0.attn.wq.weight": "F8_E4M3", "layers.0.attn.wq.scale": "F8_E8M0",
              "layers.0.ffn.experts.3.w1.scale": "F8_E8M0"}
    config = {"quantization_config": {**FP8_CONFIG["quantization_config"], "scale_fmt": "ue8m0"}}
    save_dir(tmp_path, {"model.safetensors": (tensors, dtypes)}, config, index=False)
    with open_checkpoint(tmp_path) as c:
        assert c.quantization == "fp8-block-e8m0"
        assert c.companions("layers.0.attn.wq.weight") == {"scale": "layers.0.attn.wq.scale"}
        np.testing.assert_array_equal(c.tensor_f32("layers.0.attn.wq.weight"),
                                      bs.fp8_block_dequantize_e8m0(codes, scales))
        np.testing.assert_array_equal(c.tensor_f32("layers.0.ffn.experts.3.w1.weight"),
                                      bs.fp4_e8m0_dequantize(packed, escales))


@pytest.mark.parametrize("config", [{"expert_dtype": "fp4"}, None])
def test_v4_release_u8_scales_without_quantization_config(tmp_path, config):
    """Issue 18 #3: DeepSeek V4 releases store E8M0 scales as U8 too (the same bytes) and DeepSeek's own config has
    no quantization_config; llama.cpp's converter reads both, so do we (FP8 and packed FP4 told by dtype)."""
    attn = weights(130, 256)
    codes, scales = bs.fp8_block_quantize_e8m0(attn)
    packed, escales = bs.fp4_e8m0_quantize(weights(8, 64))
    tensors = {"layers.0.attn.wq.weight": codes, "layers.0.attn.wq.scale": scales,
               "layers.0.ffn.experts.3.w1.weight": packed, "layers.0.ffn.experts.3.w1.scale": escales}
    dtypes = {"layers.0.attn.wq.weight": "F8_E4M3", "layers.0.attn.wq.scale": "U8",
              "layers.0.ffn.experts.3.w1.weight": "I8", "layers.0.ffn.experts.3.w1.scale": "U8"}
    save_dir(tmp_path, {"model.safetensors": (tensors, dtypes)}, config, index=False)
    with open_checkpoint(tmp_path) as c:
        assert c.tensor_info("layers.0.ffn.experts.3.w1.scale").dtype == "U8"
        assert c.quantization == "fp8-block-e8m0"
        assert c.scheme("layers.0.ffn.experts.3.w1.weight") == ("fp4-e8m0", ("scale",))
        np.testing.assert_array_equal(c.tensor_f32("layers.0.attn.wq.weight"),
                                      bs.fp8_block_dequantize_e8m0(codes, scales))
        np.testing.assert_array_equal(c.tensor_f32("layers.0.ffn.experts.3.w1.weight"),
                                      bs.fp4_e8m0_dequantize(packed, escales))


def test_fp4_experts_alone_are_not_called_fp8(tmp_path):
    packed, escales = bs.fp4_e8m0_quantize(weights(8, 64))
    save_dir(tmp_path, {"model.safetensors": ({"e.weight": packed, "e.scale": escales, "b.weight": weights(4, 4)},
                                              {"e.weight": "I8", "e.scale": "U8"})}, {"expert_dtype": "fp4"},
             index=False)
    with open_checkpoint(tmp_path) as c:
        assert c.quantization == "fp4-e8m0"


def test_transformers_ue8m0_scale_inv(tmp_path):
    """transformers' FP8 integration stores E8M0 block scales as ``weight_scale_inv`` (float8_e8m0fnu)."""
    dense = weights(130, 128)
    codes, scales = bs.fp8_block_quantize_e8m0(dense)
    packed, escales = bs.fp4_e8m0_quantize(weights(4, 64))
    tensors = {"a.weight": codes, "a.weight_scale_inv": scales, "e.weight": packed, "e.weight_scale_inv": escales}
    dtypes = {"a.weight": "F8_E4M3", "a.weight_scale_inv": "F8_E8M0", "e.weight_scale_inv": "F8_E8M0"}
    config = {"quantization_config": {**FP8_CONFIG["quantization_config"], "scale_fmt": "ue8m0"}}
    save_dir(tmp_path, {"model.safetensors": (tensors, dtypes)}, config, index=False)
    with open_checkpoint(tmp_path) as c:
        assert c.quantization == "fp8-block-e8m0"
        np.testing.assert_array_equal(c.tensor_f32("a.weight"), bs.fp8_block_dequantize_e8m0(codes, scales))
        np.testing.assert_array_equal(c.tensor_f32("e.weight"), bs.fp4_e8m0_dequantize(packed, escales))


def fused_fp4_checkpoint(directory):
    experts = weights(3, 4, 64)
    parts = [bs.fp4_e8m0_quantize(e) for e in experts]
    packed = np.stack([p for p, _ in parts])
    scales = np.stack([s for _, s in parts])
    save_dir(directory, {"model.safetensors": ({"e.weight": packed, "e.scale": scales}, {"e.scale": "F8_E8M0"})},
             index=False)
    return directory, parts


def test_fused_expert_slices(tmp_path):
    path, parts = fused_fp4_checkpoint(tmp_path)
    with open_checkpoint(path) as c:   # no config: the quantization comes from the tensors on disk
        assert c.quantization == "fp4-e8m0"
        for e, (p, s) in enumerate(parts):
            np.testing.assert_array_equal(c.tensor_f32("e.weight", expert=e), bs.fp4_e8m0_dequantize(p, s))
        full = c.tensor_f32("e.weight")
        assert full.shape == (3, 4, 64)
        np.testing.assert_array_equal(full[2], c.tensor_f32("e.weight", expert=2))
        with pytest.raises(SourceError, match="expert 3 out of range"):
            c.tensor_f32("e.weight", expert=3)


@pytest.mark.parametrize("convention", bs.NVFP4_CONVENTIONS)
def test_nvfp4_both_conventions_with_fused_per_expert_global_scales(tmp_path, convention):
    packed_key, scale_key, global_key = bs.NVFP4_TENSORS[convention]
    dense = weights(6, 32)
    q = bs.nvfp4_quantize(dense, convention)
    experts = [bs.nvfp4_quantize(weights(4, 32), convention) for _ in range(2)]
    tensors = {f"m.{k}": v for k, v in q.items()}
    tensors.update({f"x.{k}": np.stack([e[k].reshape(-1) if k == global_key else e[k] for e in experts])
                    for k in (packed_key, scale_key, global_key)})
    tensors["x." + global_key] = tensors["x." + global_key].reshape(2)
    act = "input_scale" if convention == "modelopt" else "input_global_scale"
    tensors[f"m.{act}"] = np.array(1.5, np.float32)
    dtypes = {f"{p}.{scale_key}": "F8_E4M3" for p in "mx"}
    if convention == "modelopt":
        config = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}
    else:
        config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}
    save_dir(tmp_path, {"model.safetensors": (tensors, dtypes)}, config, index=False)
    with open_checkpoint(tmp_path) as c:
        assert c.quantization == f"nvfp4-{convention}"
        name = f"m.{packed_key}"
        assert c.companions(name) == {scale_key: f"m.{scale_key}", global_key: f"m.{global_key}", act: f"m.{act}"}
        def decoded(parts):
            return bs.nvfp4_dequantize(parts[packed_key], parts[scale_key], parts[global_key], convention)

        np.testing.assert_array_equal(c.tensor_f32(name), decoded(q))
        for e, eq in enumerate(experts):
            np.testing.assert_array_equal(c.tensor_f32(f"x.{packed_key}", expert=e), decoded(eq))


def test_modelopt_declared_by_hf_quant_config(tmp_path):
    q = bs.nvfp4_quantize(weights(2, 16), "modelopt")
    tensors = {f"m.{k}": v for k, v in q.items()}
    save_dir(tmp_path, {"model.safetensors": (tensors, {"m.weight_scale": "F8_E4M3"})}, {}, index=False,
             hf_quant={"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}})
    with open_checkpoint(tmp_path) as c:
        assert c.quantization == "nvfp4-modelopt"


def test_open_reads_headers_only_and_maps_one_shard_per_access(tmp_path, monkeypatch):
    path, *_ = v3_checkpoint(tmp_path)
    mapped = []
    real = np.memmap

    def spy(filename, *args, **kwargs):
        mapped.append(str(filename))
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", spy)
    with open_checkpoint(path) as c:
        c.tensor_infos()
        c.companions("l.weight")
        assert mapped == []
        c.raw("norm.weight")
        assert [p.rsplit("/", 1)[1] for p in mapped] == ["model-00001-of-00002.safetensors"]


# ---------------------------------------------------------------------------------------------------------------
# broken checkpoints

def test_index_naming_a_missing_shard(tmp_path):
    path, *_ = v3_checkpoint(tmp_path)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingSourceError) as info:
        open_checkpoint(path)
    assert "model-00002-of-00002.safetensors" in str(info.value) and "l.weight_scale_inv" in str(info.value)


def test_index_naming_a_tensor_absent_from_its_shard(tmp_path):
    path, *_ = v3_checkpoint(tmp_path)
    index = json.loads((path / ckpt.INDEX_NAME).read_text())
    index["weight_map"]["ghost.weight"] = "model-00002-of-00002.safetensors"
    (path / ckpt.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SourceError, match="ghost.weight") as info:
        open_checkpoint(path)
    assert "model-00002-of-00002.safetensors" in str(info.value) and "no such tensor" in str(info.value)


@pytest.mark.parametrize("shard", ["../x.safetensors", "sub/x.safetensors", ""])
def test_index_shard_must_be_a_plain_name(tmp_path, shard):
    save_dir(tmp_path, {"a.safetensors": ({"w": weights(2)}, None)})
    (tmp_path / ckpt.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(SourceError, match="plain file name"):
        open_checkpoint(tmp_path)


def test_unknown_dtype_in_a_shard_names_file_and_tensor(tmp_path):
    save_dir(tmp_path, {"model.safetensors": ({"w": weights(2)}, None)}, index=False)
    raw = (tmp_path / "model.safetensors").read_bytes().replace(b'"F32"', b'"F33"')
    (tmp_path / "model.safetensors").write_bytes(raw)
    with pytest.raises(FormatError, match="unknown dtype 'F33'") as info:
        open_checkpoint(tmp_path)
    assert "model.safetensors" in str(info.value) and "tensor 'w'" in str(info.value)


def test_missing_companion(tmp_path):
    codes, _ = bs.fp8_block_quantize(weights(4, 4))
    save_dir(tmp_path, {"model.safetensors": ({"l.weight": codes, "k_scale_inv": np.ones(1, np.float32)},
                                              {"l.weight": "F8_E4M3"})}, FP8_CONFIG, index=False)
    with open_checkpoint(tmp_path) as c:
        with pytest.raises(MissingSourceError, match="without its block scale") as info:
            c.tensor_f32("l.weight")
        assert "tensor 'l.weight'" in str(info.value) and "model.safetensors" in str(info.value)
    q = bs.nvfp4_quantize(weights(2, 16), "modelopt")
    save_dir(tmp_path / "n", {"model.safetensors": ({"m.weight": q["weight"], "m.weight_scale_2": q["weight_scale_2"]},
                                                    None)}, index=False)
    with open_checkpoint(tmp_path / "n") as c:
        with pytest.raises(MissingSourceError, match="no weight_scale"):
            c.tensor_f32("m.weight")


def test_scale_shape_mismatch_names_tensor_and_file(tmp_path):
    codes, scale = bs.fp8_block_quantize(weights(200, 300))
    save_dir(tmp_path, {"model.safetensors": ({"l.weight": codes, "l.weight_scale_inv": scale[:, :2].copy()},
                                              {"l.weight": "F8_E4M3"})}, FP8_CONFIG, index=False)
    with open_checkpoint(tmp_path) as c:
        with pytest.raises(FormatError, match=r"has shape \(2, 2\), expected \(2, 3\)") as info:
            c.tensor_f32("l.weight")
        assert "tensor 'l.weight'" in str(info.value) and "model.safetensors" in str(info.value)
        assert "l.weight_scale_inv" in str(info.value)


def test_companion_with_wrong_dtype(tmp_path):
    codes, scale = bs.fp8_block_quantize(weights(4, 4))
    save_dir(tmp_path, {"model.safetensors": ({"l.weight": codes, "l.weight_scale_inv": scale.astype(np.float16)},
                                              {"l.weight": "F8_E4M3"})}, FP8_CONFIG, index=False)
    with open_checkpoint(tmp_path) as c, pytest.raises(FormatError, match="must be F32, found F16"):
        c.tensor_f32("l.weight")


def test_fused_companion_without_expert_axis(tmp_path):
    packed = np.zeros((3, 4, 32), np.int8)
    scales = np.full((4, 2), 127, np.uint8)       # one expert's scales for a 3-expert weight
    save_dir(tmp_path, {"model.safetensors": ({"e.weight": packed, "e.scale": scales}, {"e.scale": "F8_E8M0"})},
             index=False)
    with open_checkpoint(tmp_path) as c, pytest.raises(FormatError, match="expert axis") as info:
        c.tensor_f32("e.weight", expert=0)
    assert "tensor 'e.scale'" in str(info.value)


def fp8_tensors():
    codes, scale = bs.fp8_block_quantize(weights(4, 4))
    return {"l.weight": codes, "l.weight_scale_inv": scale}, {"l.weight": "F8_E4M3"}


@pytest.mark.parametrize("config, tensors, error, match", [
    ({}, "fp8", SourceError, "declares no quantization_config but the tensors on disk are fp8-block"),
    (FP8_CONFIG, "plain", SourceError, "declares fp8 quantization but the tensors on disk are none"),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "fp8", SourceError,
     "declares nvfp4-modelopt"),
    ({"quantization_config": {"quant_method": "awq"}}, "plain", UnsupportedError, "'awq'"),
    ({"quantization_config": {**FP8_CONFIG["quantization_config"], "weight_block_size": [128]}}, "fp8",
     SourceError, "weight_block_size"),
    ({}, "mixed", SourceError, "mix quantization schemes"),
    ({}, "bare fp8", SourceError, "no scale tensors of a known scheme"),
])
def test_quantization_cross_check(tmp_path, config, tensors, error, match):
    plain = ({"w": weights(2)}, None)
    t, d = fp8_tensors()
    contents = {"plain": plain, "fp8": (t, d), "bare fp8": ({"l.weight": t["l.weight"]}, d),
                "mixed": ({**t, "m.weight_global_scale": np.ones(1, np.float32)}, d)}[tensors]
    save_dir(tmp_path, {"model.safetensors": contents}, config, index=False)
    with pytest.raises(error, match=match) as info:
        open_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("case", ["missing path", "empty dir", "bad config", "config not object", "wrong suffix",
                                  "unknown tensor", "bad index"])
def test_other_source_errors(tmp_path, case):
    save_dir(tmp_path / "ok", {"model.safetensors": ({"w": weights(2)}, None)}, index=False)
    target, error, match = {
        "missing path": (tmp_path / "nope", MissingSourceError, "no such checkpoint"),
        "empty dir": (tmp_path / "empty", MissingSourceError, "neither"),
        "bad config": (tmp_path / "ok", SourceError, "not valid JSON"),
        "config not object": (tmp_path / "ok", SourceError, "must be a JSON object"),
        "wrong suffix": (tmp_path / "x.bin", SourceError, ".safetensors file"),
        "unknown tensor": (tmp_path / "ok", MissingSourceError, "tensor 'zz'"),
        "bad index": (tmp_path / "ok", SourceError, "weight_map"),
    }[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.bin").write_bytes(b"")
    if case == "bad config":
        (tmp_path / "ok" / ckpt.CONFIG_NAME).write_text("{not json")
    if case == "config not object":
        (tmp_path / "ok" / ckpt.CONFIG_NAME).write_text("[1]")
    if case == "bad index":
        (tmp_path / "ok" / ckpt.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": 3}}))
    with pytest.raises(error, match=match) as info:
        if case == "unknown tensor":
            open_checkpoint(target).tensor_f32("zz")
        else:
            open_checkpoint(target)
    assert isinstance(info.value, QuantkitError)
