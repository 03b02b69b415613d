"""The encode/decode front door: type lookup, input checks and size arithmetic."""
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

import quantkit
from quantkit.errors import EncodeError, FormatError, UnsupportedError
from quantkit.formats import all_formats, get_format, tensor_nbytes


def test_registry_lists_every_gguf_type_with_gguf_sizes():
    formats = all_formats()
    for qtype, (block, size) in GGML_QUANT_SIZES.items():
        assert formats[qtype].block_size == block and formats[qtype].type_size == size


@pytest.mark.parametrize("key", ["q4_k", "Q4_K", 12])
def test_lookup_by_name_or_id(key):
    assert get_format(key).name == "Q4_K"


def test_unknown_type_lists_known_ones():
    with pytest.raises(UnsupportedError, match="known types: .*Q4_K"):
        get_format("Q9_Z")


def test_tensor_nbytes():
    assert tensor_nbytes("Q4_K", (3, 512)) == 3 * 2 * 144
    assert tensor_nbytes("F32", (7,)) == 28
    with pytest.raises(EncodeError, match="not a multiple"):
        tensor_nbytes("Q4_K", (3, 100))


def test_encode_rejects_nan_naming_row_and_tensor():
    x = np.zeros((4, 64), np.float32)
    x[2, 5] = np.nan
    with pytest.raises(EncodeError, match=r"blk\.0\.w.*row 2"):
        quantkit.encode(x, "Q8_0", name="blk.0.w")


def test_encode_rejects_inf_and_bad_row_length():
    with pytest.raises(EncodeError, match="non-finite"):
        quantkit.encode(np.full((1, 32), np.inf, np.float32), "Q8_0")
    with pytest.raises(EncodeError, match="multiple of Q8_0's block size 32"):
        quantkit.encode(np.zeros((1, 48), np.float32), "Q8_0")


@pytest.mark.parametrize("bad, message", [
    (np.ones(255, np.float32), "shape"),
    (np.array([np.nan] + [1.0] * 255, np.float32), "non-finite"),
    (np.array([-1.0] + [1.0] * 255, np.float32), "negative"),
])
def test_encode_rejects_bad_imatrix(bad, message):
    with pytest.raises(EncodeError, match=message):
        quantkit.encode(np.ones((1, 256), np.float32), "Q4_K", bad, name="t")


def test_types_that_require_an_imatrix_refuse_without_one():
    with pytest.raises(EncodeError, match=r"'blk\.3\.ffn_gate_exps\.weight'.*requires an importance"):
        quantkit.encode(np.ones((1, 256), np.float32), "IQ2_XXS", name="blk.3.ffn_gate_exps.weight")


def test_encode_experts_checks_imatrix_shape():
    w = np.ones((2, 1, 256), np.float32)
    with pytest.raises(EncodeError, match=r"expected \(2, 256\)"):
        quantkit.encode_experts(w, "Q4_K", np.ones((3, 256), np.float32))


def test_decode_checks_byte_count():
    with pytest.raises(FormatError, match="needs 34 bytes, got 33"):
        quantkit.decode(np.zeros(33, np.uint8), "Q8_0", (32,))


def test_q8_0_round_trip_shape():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    y = quantkit.decode(quantkit.encode(x, "Q8_0"), "Q8_0", x.shape)
    assert y.shape == x.shape and np.abs(y - x).max() < np.abs(x).max() / 100


@pytest.mark.parametrize("serial", [True, False], ids=["numpy", "parallel-kernel"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, np.float32(np.nan) * -1])
def test_nonfinite_row_check_finds_the_first_bad_row(bad, serial, monkeypatch):
    from quantkit.kernels import checks
    from quantkit.kernels.checks import first_nonfinite_row

    monkeypatch.setattr(checks, "SERIAL_CHECK_VALUES", 1 << 30 if serial else 0)

    x = np.full((300, 96), np.finfo(np.float32).max, np.float32)   # largest finite values are not flagged
    x[:, 1::2] *= -1
    assert first_nonfinite_row(x) == -1
    x[211, 95] = bad
    x[250, 0] = bad
    assert first_nonfinite_row(x) == 211
