"""Malformed GGUF files: every one is refused through the CLI with exit 2 and exactly one line naming the problem.

The files are assembled field by field here, from the layout in ``quantkit.io.gguf``'s docstring (not with
quantkit's writer), so a test can cut or corrupt exactly one field.  The valid base file is first checked to be
readable by gguf-py, the reference reader.
"""
from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.cli import main

STRING, ARRAY, UINT32, UINT64, BOOL = 8, 9, 4, 10, 7
F32, Q8_0 = 0, 8


class Gguf:
    """A GGUF file built field by field; ``fields`` maps a label to the (start, end) bytes of that field."""

    def __init__(self):
        self.buf = bytearray()
        self.fields: dict[str, tuple[int, int]] = {}

    def add(self, label: str, data: bytes) -> "Gguf":
        self.fields[label] = (len(self.buf), len(self.buf) + len(data))
        self.buf += data
        return self

    def u32(self, label, v):
        return self.add(label, struct.pack("<I", v))

    def u64(self, label, v):
        return self.add(label, struct.pack("<Q", v))

    def string(self, label, raw: bytes):
        return self.u64(f"{label} length", len(raw)).add(label, raw)

    def pad(self, label, alignment=32):
        return self.add(label, bytes(-len(self.buf) % alignment))


BASE_KVS = [  # (key, type, encoded value)
    (b"general.architecture", STRING, struct.pack("<Q", 5) + b"llama"),
    (b"general.alignment", UINT32, struct.pack("<I", 32)),
    (b"tokens", ARRAY, struct.pack("<IQ", STRING, 2) + struct.pack("<Q", 1) + b"a" + struct.pack("<Q", 2) + b"bc"),
    (b"flag", BOOL, b"\x01"),
]
BASE_TENSORS = [  # (name, ggml dims, type, offset, payload bytes)
    (b"a.weight", (32, 2), F32, 0, 256),
    (b"b.weight", (64,), Q8_0, 256, 68),
]


def build(kvs=BASE_KVS, tensors=BASE_TENSORS, *, version=3, n_kv=None, n_tensors=None) -> Gguf:
    g = Gguf().add("magic", b"GGUF").u32("version", version)
    g.u64("tensor count", len(tensors) if n_tensors is None else n_tensors)
    g.u64("metadata key/value count", len(kvs) if n_kv is None else n_kv)
    for i, (key, vtype, value) in enumerate(kvs):
        g.string(f"key {i}", key).u32(f"key {i} value type", vtype).add(f"key {i} value", value)
    for i, (name, dims, qtype, offset, _) in enumerate(tensors):
        g.string(f"tensor info {i} name", name).u32(f"tensor info {i} n_dims", len(dims))
        g.add(f"tensor info {i} dims", struct.pack(f"<{len(dims)}Q", *dims))
        g.u32(f"tensor info {i} type", qtype).u64(f"tensor info {i} data offset", offset)
    g.pad("padding")
    # Payloads laid out one after another whatever offsets the infos declare (the base declares exactly these).
    for i, (name, _, _, _, nbytes) in enumerate(tensors):
        g.add(f"payload {i}", bytes(i + 1 for i in range(nbytes)) if nbytes < 256 else bytes(nbytes))
        g.pad(f"payload {i} padding")
    return g


def patched(g: Gguf, label: str, data: bytes) -> bytes:
    """The file with field ``label`` replaced by ``data`` (which may differ in length)."""
    start, end = g.fields[label]
    return bytes(g.buf[:start] + data + g.buf[end:])


def kv(key: bytes, vtype: int, value: bytes):
    return [*BASE_KVS[:3], (key, vtype, value)]


def with_tensor(i: int, **changes) -> bytes:
    """The base file with fields of tensor info ``i`` changed."""
    fields = dict(zip(["name", "dims", "type", "offset", "nbytes"], BASE_TENSORS[i]))
    fields.update(changes)
    return bytes(build(tensors=[*BASE_TENSORS[:i], tuple(fields.values()), *BASE_TENSORS[i + 1:]]).buf)


BASE = build()
U64 = struct.Struct("<Q")
nested_too_deep = struct.pack("<I", ARRAY) + b"".join(struct.pack("<IQ", ARRAY, 1) for _ in range(5)) \
    + struct.pack("<IQ", UINT32, 0)

# (id, file bytes, fragment the one-line message must contain)
CORPUS = [
    ("empty file", b"", "EOF reading magic: expected 4 bytes, got 0"),
    ("bad magic", patched(BASE, "magic", b"GGML"), "not a GGUF file: magic is b'GGML'"),
    ("version 1", build(version=1).buf, "GGUF version 1 is not supported"),
    ("version 4", build(version=4).buf, "GGUF version 4 is not supported"),
    ("big-endian", build(version=3 << 24).buf, "(a big-endian file?)"),
    ("huge tensor count", build(n_tensors=2**63).buf, "tensor count 9223372036854775808 exceeds the limit"),
    ("huge kv count", build(n_kv=2**40).buf, "key/value count 1099511627776 exceeds the limit"),
    ("counts past the end", build(n_kv=1000).buf, "EOF reading 1000 key/value pairs and 2 tensor infos"),
    ("key length past the end", patched(BASE, "key 0 length", U64.pack(10**6)),
     "EOF reading key 0: expected 1000000 bytes"),
    ("key length over the cap", patched(BASE, "key 0 length", U64.pack(2**62)), "more than the limit of"),
    ("string value past the end", build(kv(b"s", STRING, U64.pack(10**6) + b"x")).buf,
     "EOF reading key 's' value: expected 1000000 bytes"),
    ("array count past the end", build(kv(b"t", ARRAY, struct.pack("<IQ", STRING, 10**6))).buf,
     "EOF reading key 't' value: 1000000 items of type STRING need at least 8000000 bytes"),
    ("array count over the cap", build(kv(b"t", ARRAY, struct.pack("<IQ", UINT32, 2**40))).buf,
     "has 1099511627776 items, more than the limit"),
    ("array string past the end",
     build(kv(b"t", ARRAY, struct.pack("<IQ", STRING, 2) + U64.pack(1) + b"a" + U64.pack(10**6))).buf,
     "EOF reading key 't' value item 1: expected 1000000 bytes"),
    ("unknown value type", build(kv(b"x", 13, b"\0" * 8)).buf, "key 'x' value type is 13, not a GGUF value type"),
    ("unknown array item type", build(kv(b"x", ARRAY, struct.pack("<IQ", 99, 1))).buf,
     "key 'x' value item type is 99, not a GGUF value type"),
    ("arrays nested too deep", build(kv(b"x", ARRAY, nested_too_deep[4:])).buf, "nests arrays 5 deep"),
    ("bool not 0 or 1", build(kv(b"flag", BOOL, b"\x02")).buf, "key 'flag' value is a BOOL stored as 2"),
    ("bool array not 0 or 1", build(kv(b"f", ARRAY, struct.pack("<IQ", BOOL, 2) + b"\x01\x07")).buf,
     "item 1 is a BOOL stored as 7"),
    ("duplicate key", build(kv(b"general.architecture", STRING, U64.pack(1) + b"x")).buf,
     "duplicate key 'general.architecture' (key 3; first seen at key 0)"),
    ("empty key", build(kv(b"", UINT32, b"\0" * 4)).buf, "key 3 is empty"),
    ("non-UTF-8 key", build(kv(b"k\xff", UINT32, b"\0" * 4)).buf, "key 3 b'k\\xff' is not valid UTF-8"),
    ("alignment not a power of two", patched(BASE, "key 1 value", struct.pack("<I", 48)),
     "general.alignment must be a power of two, found 48"),
    ("alignment zero", patched(BASE, "key 1 value", struct.pack("<I", 0)), "must be a power of two, found 0"),
    ("alignment of the wrong type",
     build([BASE_KVS[0], (b"general.alignment", UINT64, U64.pack(32)), *BASE_KVS[2:]]).buf,
     "general.alignment must have type UINT32, found UINT64"),
    ("n_dims 5", with_tensor(0, dims=(32, 1, 1, 1, 2)), "has n_dims 5, expected 1 to 4"),
    ("n_dims 0", with_tensor(0, dims=()), "has n_dims 0, expected 1 to 4"),
    ("dim over int64", with_tensor(0, dims=(32, 2**63)), "dimension 0 of shape (9223372036854775808, 32)"),
    ("dims product overflows", with_tensor(0, dims=(32, 2**31, 2**31, 2**31)), "more than int64 can count"),
    ("dims exceed the file", with_tensor(0, dims=(32, 10**6)),
     "EOF reading the payload of F32[1000000, 32]: expected 128000000 bytes"),
    ("unknown type id", with_tensor(0, type=99), "unknown GGML type 99"),
    ("retired type id", with_tensor(0, type=4), "unknown GGML type 4"),
    ("row not a multiple of the block", with_tensor(1, dims=(48,), nbytes=51),
     "row length 48 is not a multiple of Q8_0's block size 32"),
    ("duplicate tensor name", with_tensor(1, name=b"a.weight"),
     "duplicate tensor name 'a.weight' (tensor info 1; first seen at tensor info 0)"),
    ("non-UTF-8 tensor name", with_tensor(1, name=b"b\xc3("), "tensor name b'b\\xc3(' is not valid UTF-8"),
    ("tensor name too long", with_tensor(1, name=b"n" * 64), "64 bytes, longer than ggml's limit of 63"),
    ("misaligned offset", with_tensor(1, offset=260), "data offset 260 is not a multiple of the alignment 32"),
    ("overlapping tensors", with_tensor(1, offset=224),
     "payload at data offset 224 overlaps tensor 'a.weight' (data bytes 0..256)"),
    ("offset past the end", with_tensor(1, offset=2**40), "EOF reading the payload of Q8_0[64]"),
]


def run_inspect(path: Path):
    return CliRunner().invoke(main, ["inspect", str(path)])


def assert_one_line_error(result, fragment: str):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    assert fragment in lines[0], lines[0]
    assert result.stdout == ""


def test_the_base_file_is_valid_for_gguf_py_and_quantkit(tmp_path):
    path = tmp_path / "base.gguf"
    path.write_bytes(BASE.buf)
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == ["a.weight", "b.weight"]
    assert reader.fields["tokens"].contents() == ["a", "bc"]
    result = run_inspect(path)
    assert result.exit_code == 0, result.output
    assert "a.weight" in result.stdout and "Q8_0" in result.stdout


@pytest.mark.parametrize("name, data, fragment", CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_file_is_one_line_exit_2(tmp_path, name, data, fragment):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    assert_one_line_error(run_inspect(path), fragment)


# What the one line names when the file ends inside each field of the base file.  While the declared counts
# cannot fit in what is left, the early size check fires before any key is read.
EARLY = "EOF reading 4 key/value pairs and 2 tensor infos: expected at least 120 bytes"
TRUNCATION_MESSAGES = {
    "magic": "EOF reading magic", "version": "EOF reading version", "tensor count": "EOF reading tensor count",
    "metadata key/value count": "EOF reading metadata key/value count",
    **{f"key {i}{part}": EARLY for i in range(3) for part in ("", " length", " value type", " value")},
    "key 3 length": "EOF reading key 3 length", "key 3": "EOF reading key 3:",
    "key 3 value type": "EOF reading key 'flag' value type", "key 3 value": "EOF reading key 'flag' value:",
    **{f"tensor info {i} name length": f"EOF reading tensor info {i} name length" for i in range(2)},
    **{f"tensor info {i} name": f"EOF reading tensor info {i} name:" for i in range(2)},
    **{f"tensor info {i} {part}": f"EOF reading tensor info {i} ('{'ab'[i]}.weight') {part}:"
       for i in range(2) for part in ("n_dims", "dims", "type", "data offset")},
    "padding": "EOF reading the payload of F32[2, 32]", "payload 0": "EOF reading the payload of F32[2, 32]",
    "payload 0 padding": "EOF reading the payload of Q8_0[64]", "payload 1": "EOF reading the payload of Q8_0[64]",
}


def test_every_field_of_the_base_file_is_covered():
    assert set(BASE.fields) - set(TRUNCATION_MESSAGES) == {"payload 1 padding"}  # the end: nothing to cut


@pytest.mark.parametrize("label, fragment", TRUNCATION_MESSAGES.items())
def test_truncated_inside_every_field(tmp_path, label, fragment):
    start, end = BASE.fields[label]
    path = tmp_path / "cut.gguf"
    path.write_bytes(BASE.buf[:start + (end - start) // 2])
    assert_one_line_error(run_inspect(path), fragment)


def test_a_real_process_prints_one_line(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(with_tensor(1, offset=224))
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "inspect", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "overlaps tensor 'a.weight'" in proc.stderr
    assert "Traceback" not in proc.stderr


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, len(BASE.buf) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, len(BASE.buf))))
def test_mutated_files_never_crash_and_stay_small(edits, cut):
    data = bytearray(BASE.buf)
    for at, byte in edits:
        data[at] = byte
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        path.write_bytes(bytes(data[:cut]))
        tracemalloc.start()
        try:
            result = run_inspect(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert result.exit_code in (0, 2), (result.exit_code, result.output, result.exception)
    if result.exit_code == 2:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output
    # Whatever the header claims, nothing proportional to a claimed count or length is allocated.
    assert peak < 2 << 20, peak
