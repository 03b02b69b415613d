"""Block-scaled source encodings: decoders against independent float64 arithmetic (values from ml_dtypes,
scales expanded by explicit loops), quantize->dequantize error bounds, scale rules, edge blocks, shape checks."""
import ml_dtypes
import numpy as np
import pytest

from quantkit.errors import EncodeError, FormatError
from quantkit.formats import blockscaled as bs

F32 = np.float32
RNG = np.random.default_rng(1234)


def e4m3_f64(codes):
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def e2m1_f64(codes):
    return np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def unpack_f64(packed):
    """Packed FP4 [rows, m] -> float64 [rows, 2m] by an explicit loop over bytes (low nibble = even element)."""
    p = np.asarray(packed).view(np.uint8)
    out = np.empty((p.shape[0], 2 * p.shape[1]))
    for r in range(p.shape[0]):
        for i in range(p.shape[1]):
            out[r, 2 * i] = e2m1_f64(p[r, i] & 0xF)
            out[r, 2 * i + 1] = e2m1_f64(p[r, i] >> 4)
    return out


def per_element(scale, block, shape):
    """Each element's block value, by looping over elements (independent of the library's np.repeat)."""
    out = np.empty(shape, np.float64)
    for i in range(shape[0]):
        for j in range(shape[1]):
            out[i, j] = scale[i // block[0], j // block[1]]
    return out


def random_codes(shape, nan_codes=(0x7F, 0xFF)):
    c = RNG.integers(0, 256, shape, dtype=np.uint8)
    return np.where(np.isin(c, nan_codes), np.uint8(0), c)


def weights(rows, n, spread=4.0):
    return (RNG.standard_normal((rows, n)) * np.exp(RNG.uniform(-spread, spread, (rows, 1)))).astype(np.float32)


def e2m1_half_step(v):
    """Half the E2M1 spacing at magnitude v (v <= 6)."""
    return np.where(v < 2, 0.25, np.where(v < 4, 0.5, 1.0))


# ---------------------------------------------------------------------------------------------------------------
# decode exactness

def test_fp8_v3_decode_is_the_rounded_exact_product():
    shape, block = (70, 45), (32, 16)             # partial edge blocks on both axes
    codes = random_codes(shape)
    scale = (RNG.uniform(0.5, 2, (3, 3)) * np.exp2(RNG.integers(-20, 5, (3, 3)))).astype(np.float32)
    got = bs.fp8_block_dequantize(codes, scale, block)
    exact = e4m3_f64(codes) * per_element(scale, block, shape)   # exact in float64 (4 x 24 bits)
    np.testing.assert_array_equal(got, exact.astype(np.float32))


def test_fp8_e8m0_decode_is_exact():
    shape, block = (130, 260), (128, 128)
    codes = random_codes(shape)
    scales = RNG.integers(100, 150, (2, 3), dtype=np.uint8)
    got = bs.fp8_block_dequantize_e8m0(codes, scales, block)
    exact = e4m3_f64(codes) * per_element(np.exp2(scales.astype(np.float64) - 127), block, shape)
    np.testing.assert_array_equal(got.astype(np.float64), exact)


def test_fp4_e8m0_decode_is_exact():
    packed = RNG.integers(-128, 128, (5, 48), dtype=np.int8)     # 96 values per row = 3 groups of 32
    scales = RNG.integers(90, 160, (5, 3), dtype=np.uint8)
    got = bs.fp4_e8m0_dequantize(packed, scales)
    exact = unpack_f64(packed) * per_element(np.exp2(scales.astype(np.float64) - 127), (1, 32), (5, 96))
    np.testing.assert_array_equal(got.astype(np.float64), exact)


@pytest.mark.parametrize("convention", bs.NVFP4_CONVENTIONS)
def test_nvfp4_decode_mirrors_reference_float32_order(convention):
    packed = RNG.integers(0, 256, (6, 24), dtype=np.uint8)      # 48 values = 3 blocks of 16
    scales = random_codes((6, 3))
    g = np.array([0.0123], np.float32) if convention == "compressed-tensors" else np.array(3.7e-3, np.float32)
    got = bs.nvfp4_dequantize(packed, scales, g, convention)
    s64, g64 = e4m3_f64(scales), np.float64(g.reshape(()))
    # ModelOpt: f32(s * g) then f32(v * that); compressed-tensors: f32(s / g) then f32(v * that).  float64
    # then float32 is the correctly rounded float32 result for one *, / of float32 operands.
    block_scale = (s64 * g64 if convention == "modelopt" else s64 / g64).astype(np.float32).astype(np.float64)
    expected = (unpack_f64(packed) * per_element(block_scale, (1, 16), (6, 48))).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
    exact = unpack_f64(packed) * per_element(s64 * g64 if convention == "modelopt" else s64 / g64, (1, 16), (6, 48))
    np.testing.assert_allclose(got, exact, rtol=2.0 ** -22, atol=0)   # two float32 roundings at most


# ---------------------------------------------------------------------------------------------------------------
# quantize -> dequantize

def test_fp8_v3_roundtrip_bound_and_scale_rule():
    w = weights(200, 300)
    w[130:, 260:] *= 50                            # the partial corner block has its own scale
    codes, scale = bs.fp8_block_quantize(w)
    assert codes.dtype == np.uint8 and scale.dtype == np.float32 and scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            amax = np.abs(w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]).max()
            assert scale[i, j] == F32(max(amax, bs.AMAX_FLOOR)) / F32(448)
    deq = bs.fp8_block_dequantize(codes, scale)
    s = per_element(scale, (128, 128), w.shape)
    # E4M3 keeps 4 significant bits (relative error <= 2^-4) down to its subnormal quantum 2^-9 * s.
    bound = np.maximum(np.abs(w) * 2.0 ** -4, 2.0 ** -10 * s) * 1.001
    assert (np.abs(deq - w) <= bound).all()


def test_fp8_e8m0_roundtrip_bound_and_scale_rule():
    w = weights(129, 257)
    codes, scales = bs.fp8_block_quantize_e8m0(w)
    assert scales.shape == (2, 3)
    s = np.exp2(scales.astype(np.float64) - 127)
    for i in range(2):
        for j in range(3):
            amax = np.abs(w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]).max()
            assert amax / 448 <= s[i, j] < 2 * amax / 448      # the power of two at or above amax/448
    assert (np.abs(e4m3_f64(codes)) <= 448).all()
    deq = bs.fp8_block_dequantize_e8m0(codes, scales)
    bound = np.maximum(np.abs(w) * 2.0 ** -4, 2.0 ** -10 * per_element(s, (128, 128), w.shape)) * 1.001
    assert (np.abs(deq - w) <= bound).all()


def test_fp4_e8m0_roundtrip_bound_and_layout():
    w = weights(7, 128)
    packed, scales = bs.fp4_e8m0_quantize(w)
    assert packed.dtype == np.int8 and packed.shape == (7, 64) and scales.shape == (7, 4)
    s = per_element(np.exp2(scales.astype(np.float64) - 127), (1, 32), w.shape)
    amax = np.abs(w.reshape(7, 4, 32)).max(axis=2)
    assert (amax / 6 <= s[:, ::32]).all() and (s[:, ::32] < 2 * amax / 6).all()
    deq = bs.fp4_e8m0_dequantize(packed, scales)
    np.testing.assert_array_equal(deq.astype(np.float64), unpack_f64(packed) * s)
    assert (np.abs(deq - w) <= e2m1_half_step(np.abs(w) / s) * s).all()


def nvfp4_effective_scale(q, convention):
    keys = bs.NVFP4_TENSORS[convention]
    s, g = e4m3_f64(q[keys[1]]), np.float64(q[keys[2]].reshape(()))
    return (s * g if convention == "modelopt" else s / g).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("convention", bs.NVFP4_CONVENTIONS)
def test_nvfp4_roundtrip_bound_and_global_scale(convention):
    w = weights(16, 64, spread=3)
    q = bs.nvfp4_quantize(w, convention)
    packed_key, scale_key, global_key = bs.NVFP4_TENSORS[convention]
    assert set(q) == {packed_key, scale_key, global_key}
    assert q[packed_key].shape == (16, 32) and q[scale_key].shape == (16, 4) and q[scale_key].dtype == np.uint8
    amax = F32(np.abs(w).max())
    if convention == "modelopt":
        assert q[global_key].shape == () and q[global_key] == amax / F32(2688)
    else:
        assert q[global_key].shape == (1,) and q[global_key][0] == (F32(1) / amax) * F32(2688)
    deq = bs.nvfp4_dequantize(q[packed_key], q[scale_key], q[global_key], convention)
    t = per_element(nvfp4_effective_scale(q, convention), (1, 16), w.shape)
    v = np.abs(w) / t
    bound = e2m1_half_step(np.minimum(v, 6)) * t + np.maximum(np.abs(w) - 6 * t, 0)
    assert (np.abs(deq - w) <= bound * 1.0001).all()
    # Round-to-nearest on the effective grid: no other E2M1 value times t is closer, up to the float32
    # rounding of w / t (it can move a value across a midpoint by 2^-24 relative) and of the product.
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    best = np.abs(np.abs(w)[..., None] - grid * t[..., None]).min(axis=-1)
    assert (np.abs(deq - w) <= best + 2.0 ** -22 * (np.abs(w) + np.abs(deq))).all()


@pytest.mark.parametrize("convention", bs.NVFP4_CONVENTIONS)
def test_nvfp4_global_amax_override(convention):
    w = weights(4, 32)
    amax = float(np.abs(w).max())
    q = bs.nvfp4_quantize(w, convention, global_amax=2 * amax)
    g = q[bs.NVFP4_TENSORS[convention][2]].reshape(())
    assert g == (F32(2 * amax) / F32(2688) if convention == "modelopt" else (F32(1) / F32(2 * amax)) * F32(2688))


def test_nvfp4_zero_blocks_and_all_zero_tensor():
    w = weights(2, 32)
    w[0, :16] = 0
    w[1, 16:] = -0.0
    mo = bs.nvfp4_quantize(w, "modelopt")
    ct = bs.nvfp4_quantize(w, "compressed-tensors")
    assert mo["weight_scale"][0, 0] == 0x38 and mo["weight_scale"][1, 1] == 0x38        # 1.0 (ModelOpt rule)
    assert ct["weight_scale"][0, 0] == 0x20 and ct["weight_scale"][1, 1] == 0x20        # 0.125 (its FP8 eps)
    assert (mo["weight"][0, :8] == 0).all() and (ct["weight_packed"][1, 8:] == 0).all()  # -0.0 -> code 0
    zeros = np.zeros((3, 16), np.float32)
    for convention in bs.NVFP4_CONVENTIONS:
        q = bs.nvfp4_quantize(zeros, convention)
        keys = bs.NVFP4_TENSORS[convention]
        assert q[keys[2]].reshape(()) == 1.0 and not q[keys[0]].any()
        np.testing.assert_array_equal(bs.nvfp4_dequantize(*(q[k] for k in keys), convention), zeros)


def test_nvfp4_negative_values_rounding_to_zero_keep_the_sign_code():
    w = np.zeros((1, 16), np.float32)
    w[0, 0], w[0, 1] = 6.0, -1e-3
    q = bs.nvfp4_quantize(w, "modelopt")
    assert q["weight"][0, 0] == 0x87   # element 0 -> 7 (6.0), element 1 -> 8 (-0)


def test_nvfp4_subnormal_block_scales():
    w = np.zeros((3, 16), np.float32)
    w[0, 0] = 448.0                     # sets the global scale: gs = 448/2688, block scale = amax_blk * 448/448
    w[1, 0] = 2.0 ** -8                 # block scale 2^-8 = E4M3 subnormal 2 * 2^-9
    w[2, 0] = 1e-9                      # below 2^-9: ModelOpt clamps the block scale to 2^-9 (code 0x01)
    q = bs.nvfp4_quantize(w, "modelopt")
    np.testing.assert_array_equal(q["weight_scale"][:, 0], [0x7E, 0x02, 0x01])
    deq = bs.nvfp4_dequantize(q["weight"], q["weight_scale"], q["weight_scale_2"], "modelopt")
    assert deq[1, 0] == w[1, 0] and deq[2, 0] == 0
    ct = bs.nvfp4_quantize(w, "compressed-tensors")
    assert ct["weight_scale"][1, 0] == 0x02     # gs * amax_blk / 6 = 2688/448 * 2^-8 / 6 = 2^-8
    assert ct["weight_scale"][2, 0] == 0x20     # rounds to 0 in E4M3, replaced by 0.125


def test_zero_blocks_fp8_and_fp4():
    w = np.zeros((128, 256), np.float32)
    w[:, 128:] = 1.0
    codes, scale = bs.fp8_block_quantize(w)
    assert scale[0, 0] == bs.AMAX_FLOOR / F32(448) and not codes[:, :128].any()
    np.testing.assert_array_equal(bs.fp8_block_dequantize(codes, scale), w)
    codes, scales = bs.fp8_block_quantize_e8m0(w)
    np.testing.assert_array_equal(bs.fp8_block_dequantize_e8m0(codes, scales), w)
    packed, scales = bs.fp4_e8m0_quantize(w[:2])
    np.testing.assert_array_equal(bs.fp4_e8m0_dequantize(packed, scales), w[:2])


# ---------------------------------------------------------------------------------------------------------------
# shape and input checks

def test_scale_shape_mismatches_raise():
    codes = np.zeros((130, 200), np.uint8)
    with pytest.raises(FormatError, match=r"scale_inv has shape \(1, 2\), expected \(2, 2\)"):
        bs.fp8_block_dequantize(codes, np.ones((1, 2), np.float32))
    with pytest.raises(FormatError, match="float32"):
        bs.fp8_block_dequantize(codes, np.ones((2, 2), np.float64))
    with pytest.raises(FormatError, match=r"expected \(2, 2\)"):
        bs.fp8_block_dequantize_e8m0(codes, np.ones((2, 3), np.uint8))
    with pytest.raises(FormatError, match=r"expected \(3, 2\)"):
        bs.fp4_e8m0_dequantize(np.zeros((3, 32), np.int8), np.ones((3, 3), np.uint8))
    with pytest.raises(FormatError, match="multiple of the scale block 16"):
        bs.nvfp4_dequantize(np.zeros((3, 9), np.uint8), np.ones((3, 1), np.uint8), np.ones(1, np.float32),
                            "modelopt")
    with pytest.raises(FormatError, match=r"expected \(3, 2\)"):
        bs.nvfp4_dequantize(np.zeros((3, 16), np.uint8), np.ones((3, 1), np.uint8), np.ones(1, np.float32),
                            "modelopt")
    with pytest.raises(FormatError, match="one float32 value"):
        bs.nvfp4_dequantize(np.zeros((3, 8), np.uint8), np.ones((3, 1), np.uint8), np.ones(2, np.float32),
                            "compressed-tensors")
    with pytest.raises(FormatError, match="convention"):
        bs.nvfp4_dequantize(np.zeros((3, 8), np.uint8), np.ones((3, 1), np.uint8), np.ones(1, np.float32), "x")
    with pytest.raises(FormatError, match="block shape"):
        bs.fp8_block_dequantize(codes, np.ones((2, 2), np.float32), block=(0, 128))


def test_bad_encoder_input_raises():
    with pytest.raises(EncodeError, match="multiple of 16"):
        bs.nvfp4_quantize(np.ones((2, 24), np.float32), "modelopt")
    with pytest.raises(EncodeError, match="multiple of 32"):
        bs.fp4_e8m0_quantize(np.ones((2, 48), np.float32))
    with pytest.raises(EncodeError, match="non-finite value in row 1"):
        bs.fp8_block_quantize(np.array([[1, 2], [np.nan, 0]], np.float32))
    with pytest.raises(EncodeError, match="2-D"):
        bs.fp8_block_quantize_e8m0(np.ones(5, np.float32))
    with pytest.raises(EncodeError, match="global amax"):
        bs.nvfp4_quantize(np.ones((1, 16), np.float32), "compressed-tensors", global_amax=float("inf"))
