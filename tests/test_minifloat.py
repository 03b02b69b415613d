"""Small float codecs: every code decoded against ml_dtypes and against the format definition written out here;
encode(decode(c)) == c; ties to even at every midpoint; saturation and special inputs."""
import math

import ml_dtypes
import numpy as np
import pytest

from quantkit.errors import EncodeError, FormatError
from quantkit.formats import minifloat as mf

F32 = np.float32

# name: (encode, decode, ml_dtypes type, number of codes)
CODECS = {
    "e4m3": (mf.e4m3_encode, mf.e4m3_decode, ml_dtypes.float8_e4m3fn, 256),
    "e5m2": (mf.e5m2_encode, mf.e5m2_decode, ml_dtypes.float8_e5m2, 256),
    "e2m1": (mf.e2m1_encode, mf.e2m1_decode, ml_dtypes.float4_e2m1fn, 16),
    "e8m0": (mf.e8m0_encode, mf.e8m0_decode, ml_dtypes.float8_e8m0fnu, 256),
}


def first_principles(name: str, code: int) -> float:
    """The value of one code, straight from the format definitions (independent of quantkit's tables)."""
    if name == "e8m0":
        return math.nan if code == 0xFF else math.ldexp(1.0, code - 127)
    exp_bits, man_bits, bias, bits = {"e4m3": (4, 3, 7, 8), "e5m2": (5, 2, 15, 8), "e2m1": (2, 1, 1, 4)}[name]
    sign = -1.0 if code >> (bits - 1) else 1.0
    e = (code >> man_bits) & ((1 << exp_bits) - 1)
    m = code & ((1 << man_bits) - 1)
    if name == "e4m3" and e == 15 and m == 7:
        return math.nan
    if name == "e5m2" and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - man_bits)
    return sign * (1 + m / 2 ** man_bits) * 2.0 ** (e - bias)


def all_codes(name):
    return np.arange(CODECS[name][3], dtype=np.uint8)


@pytest.mark.parametrize("name", CODECS)
def test_decode_every_code_matches_ml_dtypes_and_definition(name):
    _, decode, mltype, _ = CODECS[name]
    codes = all_codes(name)
    ours = decode(codes)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, codes.view(mltype).astype(np.float32))
    expected = np.array([first_principles(name, int(c)) for c in codes], dtype=np.float64)
    np.testing.assert_array_equal(ours.astype(np.float64), expected)  # every value is exact in float32


def test_anchor_values():
    assert mf.E4M3_MAX == 448.0 and mf.e4m3_decode(np.uint8(0x01)) == 2.0 ** -9
    assert np.isnan(mf.e4m3_decode(np.array([0x7F, 0xFF], np.uint8))).all()
    assert mf.E5M2_MAX == 57344.0 and mf.e5m2_decode(np.uint8(0x7C)) == np.inf
    np.testing.assert_array_equal(mf.E2M1_VALUES[:8], [0, .5, 1, 1.5, 2, 3, 4, 6])
    assert mf.e8m0_decode(np.uint8(127)) == 1.0 and mf.e8m0_decode(np.uint8(0)) == 2.0 ** -127
    assert mf.e8m0_decode(np.uint8(254)) == 2.0 ** 127


@pytest.mark.parametrize("name", CODECS)
def test_encode_decode_roundtrip_every_non_nan_code(name):
    encode, decode, _, _ = CODECS[name]
    codes = all_codes(name)
    values = decode(codes)
    keep = ~np.isnan(values)
    np.testing.assert_array_equal(encode(values[keep]), codes[keep])


def sorted_positive_codes(name):
    """Positive finite codes in increasing value (their numeric order is their code order)."""
    _, decode, _, n = CODECS[name]
    codes = np.arange(n // 2 if name != "e8m0" else 255, dtype=np.uint8)
    values = decode(codes)
    codes = codes[np.isfinite(values)]
    assert (np.diff(decode(codes)) > 0).all()
    return codes


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_midpoints_round_to_even_and_neighbours_to_nearest(name):
    encode, decode, _, n = CODECS[name]
    sign = np.uint8(n // 2)
    codes = sorted_positive_codes(name)
    lo, hi = codes[:-1], codes[1:]
    mid = ((decode(lo).astype(np.float64) + decode(hi).astype(np.float64)) / 2).astype(np.float32)
    assert (mid.astype(np.float64) * 2 == decode(lo).astype(np.float64) + decode(hi)).all()  # midpoints exact
    even = np.where(lo % 2 == 0, lo, hi)
    np.testing.assert_array_equal(encode(mid), even)
    np.testing.assert_array_equal(encode(-mid), even | sign)
    np.testing.assert_array_equal(encode(np.nextafter(mid, F32(0))), lo)
    np.testing.assert_array_equal(encode(np.nextafter(mid, F32(np.inf))), hi)


def test_e8m0_ties_round_up():
    codes = sorted_positive_codes("e8m0")[:-1]
    value = mf.e8m0_decode(codes)
    mid = value * F32(1.5)   # midpoint between 2^k and 2^(k+1); exact (2^-127 * 1.5 is a float32 subnormal)
    np.testing.assert_array_equal(mf.e8m0_encode(mid), codes + 1)
    np.testing.assert_array_equal(mf.e8m0_encode(np.nextafter(mid, F32(0))), codes)


def test_e8m0_float32_subnormal_inputs_round_to_nearest_power_of_two():
    tiny = F32(2.0 ** -127)
    x = np.array([tiny * F32(1.4), tiny * F32(1.5), tiny, tiny / 2, F32(2.0 ** -149)], np.float32)
    np.testing.assert_array_equal(mf.e8m0_encode(x), [0, 1, 0, 0, 0])


def test_saturation_and_overflow():
    big = np.array([449, 464, 480, 1e30, np.inf], np.float32)
    np.testing.assert_array_equal(mf.e4m3_encode(big), [0x7E] * 5)
    np.testing.assert_array_equal(mf.e4m3_encode(-big), [0xFE] * 5)
    np.testing.assert_array_equal(mf.e2m1_encode(np.array([6.5, 7, 1e30, np.inf, -np.inf], F32)),
                                  [7, 7, 7, 7, 15])
    # E5M2 is IEEE: 61440 (midpoint of 57344 and 65536) ties to the even code 0x7C = inf.
    np.testing.assert_array_equal(mf.e5m2_encode(np.array([np.nextafter(F32(61440), F32(0)), 61440, 1e30,
                                                            np.inf, -np.inf], F32)),
                                  [0x7B, 0x7C, 0x7C, 0x7C, 0xFC])
    np.testing.assert_array_equal(mf.e8m0_encode(np.array([2.0 ** 127 * 1.5, 3e38], F32)), [0xFF, 0xFF])


def test_special_inputs():
    nan = np.array([np.nan, -np.nan], np.float32)
    np.testing.assert_array_equal(mf.e4m3_encode(nan), [0x7F, 0xFF])
    np.testing.assert_array_equal(mf.e5m2_encode(nan), [0x7E, 0xFE])
    with pytest.raises(EncodeError, match="NaN"):
        mf.e2m1_encode(np.array([1.0, np.nan], np.float32))
    np.testing.assert_array_equal(mf.e8m0_encode(np.array([0, -0.0, -1, np.inf, np.nan], F32)), [0xFF] * 5)
    neg_zero = np.array([-0.0, -1e-30], np.float32)
    np.testing.assert_array_equal(mf.e4m3_encode(neg_zero), [0x80, 0x80])
    np.testing.assert_array_equal(mf.e2m1_encode(neg_zero), [0x8, 0x8])


def wide_random(n=200_000, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp2(rng.uniform(-30, 20, n))).astype(np.float32)


def test_encoders_agree_with_ml_dtypes_where_ml_dtypes_rounds_the_same_way():
    x = wide_random()
    within = np.clip(x, -448, 448)   # ml_dtypes gives NaN past 464 where we saturate
    np.testing.assert_array_equal(mf.e4m3_encode(within), within.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    np.testing.assert_array_equal(mf.e5m2_encode(x), x.astype(ml_dtypes.float8_e5m2).view(np.uint8))
    np.testing.assert_array_equal(mf.e2m1_encode(x), x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    normal = np.abs(x)[np.abs(x) >= 2.0 ** -126]
    np.testing.assert_array_equal(mf.e8m0_encode(normal), normal.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8))


def test_encode_is_nearest_value():
    """Against a brute-force nearest search over the decoded table (ties excluded by the midpoint test)."""
    x = np.clip(wide_random(20_000, seed=1), -448, 448)
    table = mf.E4M3_VALUES[sorted_positive_codes("e4m3")].astype(np.float64)
    nearest = np.abs(np.abs(x)[:, None].astype(np.float64) - table[None, :]).min(axis=1)
    got = np.abs(mf.e4m3_decode(mf.e4m3_encode(x)).astype(np.float64) - x)
    np.testing.assert_array_equal(got, nearest)


def test_shapes_and_dtypes_preserved():
    x = np.zeros((3, 4, 5), np.float32)
    for encode, _, _, _ in CODECS.values():
        out = encode(x)
        assert out.shape == x.shape and out.dtype == np.uint8
    assert mf.e4m3_encode(F32(1.0)) == 0x38


def test_decoders_accept_one_byte_types_and_reject_others():
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(mf.e4m3_decode(codes.view(ml_dtypes.float8_e4m3fn)), mf.e4m3_decode(codes))
    np.testing.assert_array_equal(mf.e8m0_decode(codes.view(np.int8)), mf.e8m0_decode(codes))
    with pytest.raises(FormatError, match="1-byte"):
        mf.e4m3_decode(codes.astype(np.float32))
    with pytest.raises(FormatError, match="0..15"):
        mf.e2m1_decode(np.array([16], np.uint8))


def test_fp4_packing_layout():
    codes = np.array([[1, 2, 3, 15], [0, 8, 7, 9]], np.uint8)
    packed = mf.pack_fp4(codes)
    np.testing.assert_array_equal(packed, [[0x21, 0xF3], [0x80, 0x97]])   # element 2i low, 2i+1 high
    np.testing.assert_array_equal(mf.unpack_fp4(packed), codes)
    np.testing.assert_array_equal(mf.unpack_fp4(packed.view(np.int8)), codes)
    with pytest.raises(FormatError, match="even"):
        mf.pack_fp4(np.zeros((2, 3), np.uint8))
    with pytest.raises(FormatError, match="0..15"):
        mf.pack_fp4(np.array([16, 0], np.uint8))


def test_e8m0_from_exponent():
    np.testing.assert_array_equal(mf.e8m0_from_exponent(np.array([-127, 0, 127])), [0, 127, 254])
    with pytest.raises(FormatError, match="out of range"):
        mf.e8m0_from_exponent(np.array([128]))
