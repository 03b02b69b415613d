"""Swapset encoders against the references themselves: compressed-tensors (PyPI) and NVIDIA ModelOpt (PyPI).

NVFP4, both conventions, and FP8 per-tensor / per-channel must be byte-identical to the reference encoders run on
the same float32 input (every corpus family); FP8 128x128 blocks match compressed-tensors' FP8_BLOCK except where
the DeepSeek-style encoder deliberately differs (documented below).  The end-to-end tests re-encode what a built
sidecar holds with the reference, group global scale included.
"""
import shutil
import warnings

import numpy as np
import pytest
import torch

from quantkit.formats import blockscaled
from quantkit.formats.minifloat import e4m3_decode, e4m3_encode
from quantkit.io.safetensors import SafetensorsFile
from quantkit.swapset import SwapsetRequest, build_swapset
from quantkit.swapset.encodings import fp8_scaled_quantize, get_encoding
from quantkit.testing.corpus import FAMILIES, family
from quantkit.testing.tiny_models import TinyCheckpointCache

ROWS, N = 48, 320
FP8_BLOCK_FAMILIES = ("gaussian", "heavy_tailed", "constant", "outliers", "ties", "huge")


def _need(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        pytest.fail(f"{module} is required for the swapset reference tests (the test extra)")


@pytest.fixture(scope="module")
def ct():
    """compressed-tensors' own NVFP4 and FP8 weight paths."""
    compressors = _need("compressed_tensors.compressors")
    quantization = _need("compressed_tensors.quantization")
    utils = _need("compressed_tensors.quantization.utils")

    class CT:
        @staticmethod
        def nvfp4(w, amax):
            scheme = quantization.preset_name_to_scheme("NVFP4", ["Linear"])
            a = torch.tensor(amax, dtype=torch.float32)
            gs = utils.generate_gparam(-a, a)
            x = torch.from_numpy(w.copy())
            scale, _ = utils.compute_dynamic_scales_and_zp(x, scheme.weights, module=None, global_scale=gs)
            out = compressors.NVFP4PackedCompressor.compress(
                {"weight": x, "weight_scale": scale, "weight_global_scale": gs}, scheme)
            return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).numpy() for k, v in out.items()}

        @staticmethod
        def input_global_scale(amax):
            a = torch.tensor(amax, dtype=torch.float32)
            return utils.generate_gparam(-a, a).numpy()

        @staticmethod
        def fp8(w, preset):
            """(codes, scale) of compressed-tensors' float-quantized compressor; the zero point is initialized as
            its ``initialize_module_for_quantization`` does (force_zero_point)."""
            scheme = quantization.preset_name_to_scheme(preset, ["Linear"])
            x = torch.from_numpy(w.copy())
            if preset == "FP8":
                lo, hi = torch.aminmax(x)
            elif preset == "FP8_DYNAMIC":
                lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
            else:
                b = scheme.weights.block_structure[0]
                padded = torch.zeros(-(-x.shape[0] // b) * b, -(-x.shape[1] // b) * b)
                padded[:x.shape[0], :x.shape[1]] = x
                blocks = padded.reshape(padded.shape[0] // b, b, padded.shape[1] // b, b)
                lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
            scale, zero_point = utils.calculate_qparams(lo, hi, scheme.weights)
            out = compressors.NaiveQuantizationCompressor.compress(
                {"weight": x, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
            return out["weight"].view(torch.uint8).numpy(), scale.numpy()

    return CT


@pytest.fixture(scope="module")
def modelopt():
    """NVIDIA ModelOpt's NVFP4QTensor (modelopt/torch/quantization/qtensor/nvfp4_tensor.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # it warns that this transformers version is untested
        return _need("modelopt.torch.quantization.qtensor.nvfp4_tensor").NVFP4QTensor


def _modelopt_nvfp4(NVFP4QTensor, w, amax):
    """ModelOpt's export path for a fused group: weights_scaling_factor_2 = group amax / (6 * 448)."""
    wsf2 = torch.tensor(amax, dtype=torch.float32) / (6.0 * 448.0)
    q, scale, scale_2 = NVFP4QTensor.quantize(torch.from_numpy(w.copy()), blockscaled.NVFP4_BLOCK,
                                              weights_scaling_factor_2=wsf2)
    return {"weight": q._quantized_data.numpy(), "weight_scale": scale.view(torch.uint8).numpy(),
            "weight_scale_2": scale_2.numpy()}


def _ours(convention, w, amax):
    return {k: a for k, (a, _) in get_encoding("nvfp4", convention).encode(w, amax).items()}


def _assert_same(ours, ref):
    assert set(ours) == set(ref)
    for key in ours:
        assert ours[key].dtype == ref[key].dtype or ours[key].dtype.itemsize == ref[key].dtype.itemsize
        np.testing.assert_array_equal(ours[key].reshape(ref[key].shape), ref[key], err_msg=key)


# ---------------------------------------------------------------------------------------------------------------
# NVFP4

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("group_factor", [1.0, 3.0])
def test_nvfp4_compressed_tensors_is_byte_identical(ct, name, group_factor):
    w = family(name, ROWS, N, seed=3)
    amax = float(np.float32(np.abs(w).max()) * np.float32(group_factor))   # > 1: a fused group's larger amax
    _assert_same(_ours("compressed-tensors", w, amax), ct.nvfp4(w, amax))


@pytest.mark.parametrize("name", [f for f in FAMILIES if f not in ("zeros", "signed_zeros")])
@pytest.mark.parametrize("group_factor", [1.0, 3.0])
def test_nvfp4_modelopt_is_byte_identical(modelopt, name, group_factor):
    w = family(name, ROWS, N, seed=3)
    amax = float(np.float32(np.abs(w).max()) * np.float32(group_factor))
    _assert_same(_ours("modelopt", w, amax), _modelopt_nvfp4(modelopt, w, amax))


def test_nvfp4_modelopt_all_zero_tensor_is_where_we_differ(modelopt):
    """ModelOpt divides 0 by 0 for an all-zero tensor (NaN block scales); we keep global 1.0, block scales 1.0."""
    w = np.zeros((16, 64), dtype=np.float32)
    ref = _modelopt_nvfp4(modelopt, w, 0.0)
    assert ref["weight_scale_2"] == 0 and np.isnan(e4m3_decode(ref["weight_scale"])).all()
    ours = _ours("modelopt", w, 0.0)
    assert ours["weight_scale_2"] == np.float32(1.0)
    assert (ours["weight_scale"] == e4m3_encode(np.float32(1.0))).all() and (ours["weight"] == 0).all()


def test_nvfp4_references_see_zero_blocks_and_subnormal_scales(ct, modelopt):
    """The corpus exercises both edge rules: zero blocks (ModelOpt scale 1.0, compressed-tensors 0.125) and E4M3
    subnormal block scales (exponent field 0), on which the byte-identity tests above ran."""
    w = family("mixed_blocks", ROWS, N, seed=3)
    amax = float(np.abs(w).max())
    zero_blocks = (np.abs(w.reshape(ROWS, -1, 16)).max(axis=2) == 0)
    assert zero_blocks.any()
    mo = _modelopt_nvfp4(modelopt, w, amax)["weight_scale"]
    c = ct.nvfp4(w, amax)["weight_scale"]
    assert (mo[zero_blocks] == e4m3_encode(np.float32(1.0))).all()
    assert (c[zero_blocks] == e4m3_encode(np.float32(0.125))).all()

    def subnormal(codes):
        return ((codes & 0x78) == 0) & ((codes & 0x07) != 0)

    w = family("wide_range", ROWS, N, seed=3)
    assert subnormal(_modelopt_nvfp4(modelopt, w, float(np.abs(w).max()))["weight_scale"]).any()
    assert subnormal(ct.nvfp4(w, float(np.abs(w).max()))["weight_scale"]).any()


@pytest.mark.parametrize("amax", [1e-30, 0.37, 16.0, 3.0e5])
def test_activation_scales_match_the_references(ct, amax):
    """ModelOpt: get_activation_scaling_factor (amax / (maxbound * 448), maxbound 6 for FP4);
    compressed-tensors: generate_gparam of the observed range."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nvfp4 = _need("modelopt.torch.quantization.qtensor.nvfp4_tensor").NVFP4QTensor

    class Quantizer:   # the attributes get_activation_scaling_factor reads from a calibrated TensorQuantizer
        is_enabled = True
        maxbound = 6.0

        @staticmethod
        def export_amax():
            return torch.tensor(amax, dtype=torch.float32)

    ours_mo = get_encoding("nvfp4", "modelopt").input_scale(amax)
    np.testing.assert_array_equal(ours_mo, nvfp4.get_activation_scaling_factor(Quantizer).numpy().reshape(()))
    ours_ct = get_encoding("nvfp4", "compressed-tensors").input_scale(amax)
    np.testing.assert_array_equal(ours_ct, ct.input_global_scale(amax))


# ---------------------------------------------------------------------------------------------------------------
# FP8

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("preset,per_channel", [("FP8", False), ("FP8_DYNAMIC", True)])
def test_fp8_tensor_and_channel_are_byte_identical(ct, name, preset, per_channel):
    w = family(name, ROWS, N, seed=4)
    codes, scale = fp8_scaled_quantize(w, per_channel)
    ref_codes, ref_scale = ct.fp8(w, preset)
    np.testing.assert_array_equal(codes, ref_codes)
    np.testing.assert_array_equal(scale, ref_scale.reshape(scale.shape))


@pytest.mark.parametrize("name", FP8_BLOCK_FAMILIES)
def test_fp8_block128_matches_compressed_tensors_fp8_block(ct, name):
    """DeepSeek-V3-style blocks (quantkit.formats.blockscaled) equal compressed-tensors' FP8_BLOCK weights wherever
    every block's amax is >= blockscaled.AMAX_FLOOR and no -0.0 occurs.  The two documented differences: a
    block below the floor gets scale floor/448 (compressed-tensors: amax/448, or float32 eps for a zero block),
    and -0.0 keeps code 0x80 (DeepSeek's cast) where compressed-tensors' zero point gives 0x00."""
    w = family(name, 300, 320, seed=5)   # partial edge blocks in both dimensions
    codes, scale_inv = blockscaled.fp8_block_quantize(w)
    ref_codes, ref_scale = ct.fp8(w, "FP8_BLOCK")
    np.testing.assert_array_equal(codes, ref_codes)
    np.testing.assert_array_equal(scale_inv, ref_scale)


# ---------------------------------------------------------------------------------------------------------------
# end to end: a built sidecar re-encoded by the references

@pytest.fixture(scope="module")
def glm5_bf16(tmp_path_factory):
    return TinyCheckpointCache(tmp_path_factory.getbasetemp() / "swapset-tiny").get("glm5_next", encoding="bf16")


@pytest.mark.parametrize("convention,family_name", [("modelopt", "inproj"), ("compressed-tensors", "mla"),
                                                    ("modelopt", "dense")])
def test_built_sidecar_is_what_the_reference_encodes(tmp_path, glm5_bf16, ct, modelopt, convention, family_name):
    model_dir = shutil.copytree(glm5_bf16, tmp_path / "model")
    result = build_swapset(SwapsetRequest(model_dir, families=(family_name,), fmt="nvfp4", convention=convention))
    from quantkit.io.checkpoint import open_checkpoint

    payload = SafetensorsFile(result.safetensors)
    with open_checkpoint(model_dir) as ckpt:
        groups = {}
        for m in result.manifest["modules"]:
            groups.setdefault(m["group"], []).append(m)
        assert any(len(g) > 1 for g in groups.values())     # q/k/v, q_a/kv_a, gate/up
        for members in groups.values():
            weights = {m["module"]: ckpt.tensor_f32(m["source_tensor"]) for m in members}
            group_amax = float(max(np.abs(w).max() for w in weights.values()))
            for m in members:
                w = weights[m["module"]]
                ref = ct.nvfp4(w, group_amax) if convention == "compressed-tensors" else \
                    _modelopt_nvfp4(modelopt, w, group_amax)
                for suffix, expected in ref.items():
                    stored = payload.array(f"{m['output_module']}.{suffix}").view(np.uint8) if expected.dtype == \
                        np.uint8 else payload.array(f"{m['output_module']}.{suffix}")
                    np.testing.assert_array_equal(stored.reshape(expected.shape), expected,
                                                  err_msg=f"{m['module']}.{suffix}")
            global_key = blockscaled.NVFP4_TENSORS[convention][2]
            globals_ = {float(payload.array(f"{m['output_module']}.{global_key}").reshape(())) for m in members}
            assert len(globals_) == 1      # one global scale per fused group
