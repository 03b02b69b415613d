"""safetensors reader/writer (against the `safetensors` library in both directions, a corpus of malformed files,
byte mutation fuzzing) and the atomic output helpers."""
import hashlib
import json
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.errors import FormatError, MissingSourceError, OutputExistsError, QuantkitError, TruncatedFileError
from quantkit.io.atomic import atomic_output, sha256_file
from quantkit.io.safetensors import DTYPES, SafetensorsFile, write_safetensors

RNG = np.random.default_rng(7)


def sample_tensors():
    """One array of every dtype (F4 as packed bytes), with awkward shapes: scalar, empty, odd sizes."""
    return {
        "f64": RNG.standard_normal((3,)),
        "f32": RNG.standard_normal((2, 3)).astype(np.float32),
        "f16": RNG.standard_normal((5,)).astype(np.float16),
        "bf16": RNG.standard_normal((3, 1)).astype(ml_dtypes.bfloat16),
        "e4m3": RNG.integers(0, 256, 7, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
        "e5m2": RNG.integers(0, 256, 3, dtype=np.uint8).view(ml_dtypes.float8_e5m2),
        "e8m0": RNG.integers(0, 255, (2, 2), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
        "i64": np.array(-5, np.int64),
        "i32": RNG.integers(-9, 9, 3).astype(np.int32),
        "i16": RNG.integers(-9, 9, 3).astype(np.int16),
        "i8": RNG.integers(-9, 9, 5).astype(np.int8),
        "u8": RNG.integers(0, 255, (0, 4)).astype(np.uint8),
        "u16": np.arange(3, dtype=np.uint16),
        "u32": np.arange(3, dtype=np.uint32),
        "u64": np.arange(3, dtype=np.uint64),
        "bool": np.array([True, False, True]),
        "fp4": RNG.integers(0, 256, (2, 3), dtype=np.uint8),
    }


def write(path, tensors, metadata=None, **kw):
    return write_safetensors(path, tensors, metadata, dtypes={"fp4": "F4"} if "fp4" in tensors else None, **kw)


# ---------------------------------------------------------------------------------------------------------------
# round trips and agreement with the safetensors library

def test_roundtrip_every_dtype(tmp_path):
    tensors = sample_tensors()
    path = write(tmp_path / "a.safetensors", tensors, {"format": "pt", "note": "x"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "note": "x"}
        assert f.names() == sorted(tensors)
        assert f.entry("fp4").dtype == "F4" and f.entry("fp4").shape == (2, 6)
        for name, arr in tensors.items():
            got = f.array(name)
            assert got.dtype == arr.dtype and got.shape == arr.shape, name
            assert got.tobytes() == arr.tobytes(), name
            assert not got.flags.writeable
    assert {f.entry(n).dtype for n in tensors} == set(DTYPES)


def test_header_layout_alignment_and_order_invariance(tmp_path):
    tensors = sample_tensors()
    a = write(tmp_path / "a.safetensors", tensors)
    b = write(tmp_path / "b.safetensors", dict(reversed(list(tensors.items()))))
    assert a.read_bytes() == b.read_bytes()
    n = struct.unpack("<Q", a.read_bytes()[:8])[0]
    assert (8 + n) % 8 == 0 and a.read_bytes()[8 + n - 1:8 + n] in (b" ", b"}")
    with SafetensorsFile(a) as f:
        for e in f.entries.values():      # every tensor aligned to its element size
            assert (e.begin - f.data_offset) % max(1, DTYPES[e.dtype].bits // 8) == 0


def test_bytes_equal_safetensors_numpy_and_it_reads_ours(tmp_path):
    tensors = {k: v for k, v in sample_tensors().items()
               if v.dtype.kind in "fiub" and k not in ("e4m3", "e5m2", "e8m0", "bf16", "fp4")}
    ours = write(tmp_path / "ours.safetensors", tensors, {"format": "np"})
    theirs = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(tensors, str(theirs), metadata={"format": "np"})
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = safetensors.numpy.load_file(str(ours))
    for name, arr in tensors.items():
        np.testing.assert_array_equal(loaded[name], arr)


def torch_view(arr, dtype):
    return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8).copy()).view(dtype).reshape(arr.shape)


def test_torch_f8_bf16_f4_both_directions(tmp_path):
    arrays = sample_tensors()
    names = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
             "e8m0": torch.float8_e8m0fnu, "f32": torch.float32}
    as_torch = {n: torch_view(arrays[n], d) for n, d in names.items()}
    as_torch["fp4"] = torch.from_numpy(arrays["fp4"].copy()).view(torch.float4_e2m1fn_x2)
    ours = write(tmp_path / "ours.safetensors", {n: arrays[n] for n in [*names, "fp4"]}, {"k": "v"})
    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(as_torch, str(theirs), metadata={"k": "v"})
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = safetensors.torch.load_file(str(ours))
    for name, t in as_torch.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert loaded[name].view(torch.uint8).numpy().tobytes() == t.view(torch.uint8).numpy().tobytes()
    with SafetensorsFile(theirs) as f:      # and we read theirs
        for name in as_torch:
            assert f.array(name).tobytes() == arrays[name].tobytes()


def test_writer_dtype_overrides(tmp_path):
    codes = np.arange(6, dtype=np.uint8).reshape(2, 3)
    path = write_safetensors(tmp_path / "x.safetensors", {"w": codes, "s": np.ones(2, np.uint16)},
                             dtypes={"w": "F8_E4M3", "s": "BF16"})
    with SafetensorsFile(path) as f:
        assert f.array("w").dtype == ml_dtypes.float8_e4m3fn and f.array("w").view(np.uint8).tolist() == codes.tolist()
        assert f.array("s").dtype == ml_dtypes.bfloat16
    big_endian = np.arange(3, dtype=">i4")
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    path = write_safetensors(tmp_path / "y.safetensors", {"be": big_endian, "f": fortran})
    with SafetensorsFile(path) as f:
        assert f.array("be").tolist() == [0, 1, 2] and f.array("f").tolist() == fortran.tolist()


@pytest.mark.parametrize("tensors, kw, match", [
    ({"a": np.zeros(2, np.float32)}, {"dtypes": {"a": "F99"}}, "unknown dtype 'F99'"),
    ({"a": np.zeros(2, np.float32)}, {"dtypes": {"a": "F16"}}, "needs 2-byte elements"),
    ({"a": np.zeros(2, np.float32)}, {"dtypes": {"a": "F4"}}, "packed bytes"),
    ({"a": np.zeros(2, np.float32)}, {"dtypes": {"b": "F32"}}, "not being written"),
    ({"a": np.zeros(2, object)}, {}, "cannot store numpy dtype object"),
    ({"a": [1, 2]}, {}, "expected a numpy array"),
    ({"__metadata__": np.zeros(2)}, {}, "invalid tensor name"),
    ({"a": np.zeros(2)}, {"metadata": {"k": 1}}, "str to str"),
])
def test_writer_refuses_bad_input(tmp_path, tensors, kw, match):
    with pytest.raises(FormatError, match=match):
        write_safetensors(tmp_path / "x.safetensors", tensors, **kw)
    assert not list(tmp_path.iterdir())


def test_writer_refuses_existing_output(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(1)})
    with pytest.raises(OutputExistsError, match="x.safetensors"):
        write_safetensors(path, {"a": np.ones(1)})
    write_safetensors(path, {"a": np.ones(1)}, overwrite=True)
    assert SafetensorsFile(path).array("a").tolist() == [1.0]


# ---------------------------------------------------------------------------------------------------------------
# malformed files

def raw_file(path, header, data=b"", length=None):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# (header, data, length override, error type, message fragment, tensor named in the message)
MALFORMED = {
    "short file": (None, b"", None, TruncatedFileError, "header length", None),
    "oversized header length": ({}, b"", 2 ** 62, FormatError, "exceeds the cap", None),
    "header length past EOF": ({"a": entry()}, b"", 10_000, TruncatedFileError, "past the end", None),
    "invalid JSON": (b'{"a": ', b"", None, FormatError, "not valid UTF-8 JSON", None),
    "invalid UTF-8": (b'{"\xff": 1}', b"", None, FormatError, "not valid UTF-8 JSON", None),
    "not an object": (b"[1, 2]", b"", None, FormatError, "JSON object", None),
    "duplicate key": (b'{"a": {}, "a": {}}', b"", None, FormatError, "duplicate key", None),
    "NaN literal": (b'{"a": NaN}', b"", None, FormatError, "NaN", None),
    "metadata not str": ({"__metadata__": {"k": 1}}, b"", None, FormatError, "__metadata__", None),
    "entry missing key": ({"w": {"dtype": "F32", "shape": [2]}}, b"", None, FormatError, "exactly the keys", "w"),
    "entry extra key": ({"w": {**entry(), "x": 1}}, b"\0" * 8, None, FormatError, "exactly the keys", "w"),
    "unknown dtype": ({"w": entry("F12")}, b"\0" * 8, None, FormatError, "unknown dtype 'F12'", "w"),
    "negative dim": ({"w": entry(shape=(-2,))}, b"\0" * 8, None, FormatError, "non-negative ints", "w"),
    "bool dim": ({"w": entry(shape=(True,))}, b"\0" * 8, None, FormatError, "non-negative ints", "w"),
    "bad offsets": ({"w": {**entry(), "data_offsets": [0]}}, b"\0" * 8, None, FormatError, "data_offsets", "w"),
    "end before begin": ({"w": entry(shape=(0,), offsets=(8, 0))}, b"", None, FormatError, "before begin", "w"),
    "offsets outside the file": ({"w": entry()}, b"\0" * 4, None, TruncatedFileError, "past the end", "w"),
    "not starting at 0": ({"w": entry(offsets=(4, 12))}, b"\0" * 12, None, FormatError, "contiguous", "w"),
    "gap": ({"a": entry(), "w": entry(offsets=(12, 20))}, b"\0" * 20, None, FormatError, "gap", "w"),
    "overlap": ({"a": entry(), "w": entry(offsets=(4, 12))}, b"\0" * 12, None, FormatError, "overlaps", "w"),
    "trailing bytes": ({"w": entry()}, b"\0" * 9, None, FormatError, "covered exactly", None),
    "dtype x shape != range": ({"w": entry("F16", (2,))}, b"\0" * 8, None, FormatError, "needs 4 bytes", "w"),
    "shape too big": ({"w": entry(shape=(2 ** 62, 2 ** 62))}, b"\0" * 8, None, FormatError, "more bytes", "w"),
    "F4 half byte": ({"w": entry("F4", (3,), (0, 2))}, b"\0" * 2, None, FormatError, "whole number of bytes", "w"),
    "F4 odd last dim": ({"w": entry("F4", (2, 3), (0, 3))}, b"\0" * 3, None, FormatError, "even last", "w"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_raise_named_errors(tmp_path, case):
    header, data, length, error, fragment, tensor = MALFORMED[case]
    path = tmp_path / "bad.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02\x03")
    else:
        raw_file(path, header, data, length)
    with pytest.raises(error) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert fragment in message and str(path) in message
    if tensor is not None:
        assert f"tensor {tensor!r}" in message
    assert isinstance(info.value, QuantkitError)


def test_header_cap_is_a_keyword(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(3)}, {"k": "v" * 200})
    with pytest.raises(FormatError, match="exceeds the cap of 64 bytes"):
        SafetensorsFile(path, max_header_bytes=64)
    assert SafetensorsFile(path, max_header_bytes=1024).names() == ["a"]


def test_truncated_file_is_eoferror(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(3), "b": np.ones(3)})
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(EOFError, match="tensor 'b'"):
        SafetensorsFile(path)


def test_file_changed_after_open_is_refused(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(3)})
    f = SafetensorsFile(path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(TruncatedFileError, match="size changed"):
        f.array("a")


def test_missing_file(tmp_path):
    with pytest.raises(MissingSourceError, match="nope.safetensors"):
        SafetensorsFile(tmp_path / "nope.safetensors")


def test_unknown_tensor(tmp_path):
    f = SafetensorsFile(write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(3)}))
    with pytest.raises(FormatError, match="tensor 'zz'"):
        f.array("zz")


VALID = None


def valid_file_bytes():
    global VALID
    if VALID is None:
        with tempfile.TemporaryDirectory() as d:
            VALID = write(Path(d) / "v.safetensors", sample_tensors(), {"format": "pt"}).read_bytes()
    return VALID


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_files_raise_only_quantkit_errors(data):
    raw = bytearray(valid_file_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        path.write_bytes(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))
        try:
            f = SafetensorsFile(path)
            for name in f.names():
                f.array(name).tobytes()
            f.close()
        except QuantkitError:
            pass


# ---------------------------------------------------------------------------------------------------------------
# atomic output

def test_atomic_output_success_and_refusal(tmp_path):
    target = tmp_path / "out.bin"
    with atomic_output(target) as partial:
        assert partial == tmp_path / "out.bin.partial"
        partial.write_bytes(b"one")
        assert not target.exists()
    assert target.read_bytes() == b"one" and not partial.exists()
    with pytest.raises(OutputExistsError, match="out.bin"):
        with atomic_output(target):
            pass
    with atomic_output(target, overwrite=True) as partial:
        partial.write_bytes(b"two")
    assert target.read_bytes() == b"two"


def test_atomic_output_cleans_up_on_error_and_replaces_stale_partial(tmp_path):
    target = tmp_path / "out.bin"
    (tmp_path / "out.bin.tmp").write_bytes(b"stale")
    with pytest.raises(RuntimeError):
        with atomic_output(target, suffix=".tmp") as partial:
            assert not partial.exists()       # the stale partial was removed
            partial.write_bytes(b"half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_refuses_a_file_that_appeared_meanwhile(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(OutputExistsError, match="appeared"):
        with atomic_output(target) as partial:
            partial.write_bytes(b"mine")
            target.write_bytes(b"theirs")
    assert target.read_bytes() == b"theirs" and not partial.exists()


def test_sha256_file_streams(tmp_path):
    payload = RNG.integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(payload)
    assert sha256_file(path, chunk=4096) == hashlib.sha256(payload).hexdigest() == sha256_file(path)
