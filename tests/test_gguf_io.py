"""GGUF reader and writer, judged by gguf-py (the reference implementation of the container).

Files quantkit writes are read back with ``gguf.GGUFReader``; files ``gguf.GGUFWriter`` writes are read with
quantkit's reader and rewritten byte-identically by quantkit's writer.
"""
from __future__ import annotations

import concurrent.futures
import random

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from quantkit.errors import FormatError, MissingSourceError, OutputExistsError, StateError, UnsupportedError, ValidationError
from quantkit.io.gguf import KV, ArrayOf
from quantkit.io.gguf_reader import GGUFFile
from quantkit.io.gguf_writer import GGUFWriter, TensorSpec, WriterState, plan_layout

RNG = np.random.default_rng(1234)

# Every value type, with its extremes.  (key, value as given to quantkit, expected gguf-py types, contents)
SCALARS = [
    ("u8", KV(255, V.UINT8)), ("i8", KV(-128, V.INT8)), ("u16", KV(65535, V.UINT16)),
    ("i16", KV(-32768, V.INT16)), ("u32", KV(2**32 - 1, V.UINT32)), ("i32", KV(-(2**31), V.INT32)),
    ("u64", KV(2**64 - 1, V.UINT64)), ("i64", KV(-(2**63), V.INT64)), ("f32", KV(0.1, V.FLOAT32)),
    ("f64", KV(0.1, V.FLOAT64)), ("bool_t", True), ("bool_f", KV(False, V.BOOL)),
    ("str", "héllo ✓"), ("np_u16", np.uint16(7)), ("np_f32", np.float32(-2.5)),
]
ARRAYS = [
    ("a_u8", KV([0, 255], ArrayOf(V.UINT8))), ("a_i8", KV([-128, 127], ArrayOf(V.INT8))),
    ("a_u16", np.array([1, 65535], np.uint16)), ("a_i16", KV((-5, 5), ArrayOf(V.INT16))),
    ("a_u32", KV(np.arange(5), ArrayOf(V.UINT32))), ("a_i32", np.array([-1, 2**31 - 1], np.int32)),
    ("a_u64", KV([2**64 - 1, 0], ArrayOf(V.UINT64))), ("a_i64", np.array([-(2**63)], np.int64)),
    ("a_f32", KV([0.1, -1e30], ArrayOf(V.FLOAT32))), ("a_f64", np.array([np.pi, -0.0])),
    ("a_bool", [True, False, True]), ("a_str", ["a", "", "ü", "tok with space"]),
]


def numpy_of(kv: KV):
    """The value the file holds, computed with numpy alone (independent of quantkit's encoder)."""
    from quantkit.io.gguf import SCALAR_DTYPES
    if isinstance(kv.type, ArrayOf) and kv.type.item in SCALAR_DTYPES:
        dtype = bool if kv.type.item is V.BOOL else SCALAR_DTYPES[kv.type.item]
        return np.array(list(kv.value), dtype=object).astype(dtype).tolist()
    if kv.type in SCALAR_DTYPES:
        return bool(kv.value) if kv.type is V.BOOL else np.asarray(kv.value, SCALAR_DTYPES[kv.type]).item()
    return list(kv.value) if isinstance(kv.type, ArrayOf) else kv.value


def typed_kv(value) -> KV:
    from quantkit.io.gguf_writer import typed
    return typed(value, "test")


def field_of(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    assert field is not None, key
    return field


def assert_same_kv(ours: KV, given: KV):
    assert ours.type == given.type
    if isinstance(ours.value, np.ndarray):
        assert ours.value.tolist() == numpy_of(given)
    elif isinstance(ours.type, ArrayOf) and ours.type.item is V.ARRAY:
        for a, b in zip(ours.value, given.value, strict=True):
            assert_same_kv(a, typed_kv(b))
    else:
        assert ours.value == numpy_of(given)


def random_payload(qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    return RNG.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)


TENSORS = [  # (name, numpy shape, type, payload)
    ("f32.weight", (3, 8), T.F32, RNG.standard_normal((3, 8)).astype(np.float32)),
    ("f16.weight", (2, 2, 4), T.F16, RNG.standard_normal((2, 2, 4)).astype(np.float16)),
    ("bf16.weight", (4, 16), T.BF16, random_payload(T.BF16, (4, 16))),
    ("q8.weight", (4, 64), T.Q8_0, quantize(RNG.standard_normal((4, 64)).astype(np.float32), T.Q8_0)),
    ("q4k.weight", (2, 3, 256), T.Q4_K, random_payload(T.Q4_K, (2, 3, 256))),
    ("iq2.weight", (1, 1, 2, 256), T.IQ2_XXS, random_payload(T.IQ2_XXS, (1, 1, 2, 256))),
    ("mxfp4.weight", (3, 32), T.MXFP4, random_payload(T.MXFP4, (3, 32))),
    ("nvfp4.weight", (2, 128), T.NVFP4, random_payload(T.NVFP4, (2, 128))),
    ("i8.bias", (5,), T.I8, RNG.integers(-128, 128, 5, dtype=np.int8)),
    ("empty", (0, 32), T.F32, np.zeros((0, 32), np.float32)),
]


def write_ours(path, metadata, tensors, order=None, **kw):
    layout = plan_layout(metadata, [TensorSpec(n, s, t) for n, s, t, _ in tensors])
    payloads = {n: p for n, _, _, p in tensors}
    with GGUFWriter(path, layout, **kw) as w:
        w.write_header()
        for name in order if order is not None else payloads:
            w.write_tensor(name, payloads[name])
        w.finish()
    return layout


def write_gguf_py(path, metadata_calls, tensors, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for method, *args in metadata_calls:
        getattr(w, method)(*args)
    for name, shape, qtype, payload in tensors:
        w.add_tensor(name, payload, raw_dtype=qtype if payload.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_reads_back_in_gguf_py(tmp_path):
    nested = KV([KV([1, 2], ArrayOf(V.INT32)), KV([3], ArrayOf(V.INT32))], ArrayOf(V.ARRAY))
    empty = KV([], ArrayOf(V.UINT64))
    metadata = [("general.architecture", "llama"), *SCALARS, *ARRAYS, ("nested", nested), ("empty", empty)]
    path = tmp_path / "kv.gguf"
    write_ours(path, metadata, [])

    reader = gguf.GGUFReader(path)
    assert list(reader.fields)[3:] == [k for k, _ in metadata]  # after GGUF.version, tensor_count, kv_count
    for key, value in [*SCALARS, *ARRAYS]:
        kv = typed_kv(value)
        field = field_of(reader, key)
        expected_types = [V.ARRAY, kv.type.item] if isinstance(kv.type, ArrayOf) else [kv.type]
        assert field.types == expected_types, key
        assert field.contents() == numpy_of(kv), key
    assert field_of(reader, "nested").types == [V.ARRAY, V.ARRAY, V.INT32]
    assert field_of(reader, "nested").contents() == [1, 2, 3]
    empty_field = field_of(reader, "empty")  # parts: key length, key, type, item type, count
    assert (empty_field.parts[3][0], empty_field.parts[4][0]) == (V.UINT64, 0)

    with GGUFFile(path) as ours:
        assert list(ours.metadata) == [k for k, _ in metadata]
        for key, value in metadata:
            assert_same_kv(ours.metadata[key], typed_kv(value))


def test_invalid_utf8_string_values_survive_a_round_trip(tmp_path):
    raw = b"\xff\xfe tok"
    token = raw.decode("utf-8", "surrogateescape")
    path = tmp_path / "bytes.gguf"
    write_ours(path, [("tok", token), ("toks", KV([token, "ok"], ArrayOf(V.STRING)))], [])
    field = field_of(gguf.GGUFReader(path), "tok")
    assert field.parts[field.data[0]].tobytes() == raw
    with GGUFFile(path) as f:
        assert f.metadata["tok"].value == token
        assert f.metadata["toks"].value == [token, "ok"]


@pytest.mark.parametrize("seed", [0, 1])
def test_tensors_written_in_any_order_read_back_in_gguf_py(tmp_path, seed):
    order = [t[0] for t in TENSORS]
    random.Random(seed).shuffle(order)
    path = tmp_path / "t.gguf"
    layout = write_ours(path, [("general.architecture", "llama")], TENSORS, order=order)

    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == [t[0] for t in TENSORS]
    for rt, (name, shape, qtype, payload) in zip(reader.tensors, TENSORS):
        assert tuple(int(d) for d in reversed(rt.shape)) == shape, name
        assert rt.tensor_type == qtype, name
        assert rt.n_bytes == payload.nbytes, name
        assert rt.data.tobytes() == payload.tobytes(), name
        assert rt.data_offset == layout.data_offset + layout.tensors[name].offset, name
    assert reader.data_offset == layout.data_offset
    assert path.stat().st_size == layout.file_size

    with GGUFFile(path) as ours:
        for name, shape, qtype, payload in TENSORS:
            t = ours.tensors[name]
            assert (t.shape, t.type, t.nbytes) == (shape, qtype, payload.nbytes)
            view = ours.data(name)
            assert view.dtype == np.uint8 and not view.flags.writeable
            assert view.tobytes() == payload.tobytes()
        assert ours.ggml_layout_problem() is None


GGUF_PY_CALLS = [
    ("add_uint8", "k.u8", 200), ("add_int8", "k.i8", -3), ("add_uint16", "k.u16", 60000),
    ("add_int16", "k.i16", -300), ("add_uint32", "k.u32", 4000000000), ("add_int32", "k.i32", -7),
    ("add_float32", "k.f32", 1.25), ("add_uint64", "k.u64", 2**63 + 5), ("add_int64", "k.i64", -(2**40)),
    ("add_float64", "k.f64", 1 / 3), ("add_bool", "k.bool", True), ("add_string", "k.str", "qwen3moe ✓"),
    ("add_array", "k.ints", [1, -2, 3]), ("add_array", "k.floats", [0.5, 1.5]),
    ("add_array", "k.strs", [f"tok{i}" for i in range(300)]), ("add_array", "k.bools", [True, False]),
    ("add_key_value", "k.nested", [[1, 2], ["a", "b"]], V.ARRAY),
]


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_py_files_read_identically_and_rewrite_byte_identically(tmp_path, alignment):
    src = tmp_path / "gguf_py.gguf"
    write_gguf_py(src, GGUF_PY_CALLS, TENSORS[:-1], alignment=alignment)
    reference = gguf.GGUFReader(src)

    with GGUFFile(src) as ours:
        assert ours.alignment == (alignment or 32)
        assert ours.data_offset == reference.data_offset
        assert list(ours.metadata) == list(reference.fields)[3:]
        for key, field in list(reference.fields.items())[3:]:
            kv = ours.metadata[key]
            if key == "k.nested":  # gguf-py records the first inner array's types only
                assert kv.type == ArrayOf(V.ARRAY)
                assert [inner.type for inner in kv.value] == [ArrayOf(V.INT32), ArrayOf(V.STRING)]
                assert [list(inner.value) for inner in kv.value] == [[1, 2], ["a", "b"]]
                continue
            types = [V.ARRAY, kv.type.item] if isinstance(kv.type, ArrayOf) else [kv.type]
            assert types == field.types, key
            value = kv.value.tolist() if isinstance(kv.value, np.ndarray) else kv.value
            assert value == field.contents(), key
        for rt in reference.tensors:
            t = ours.tensors[rt.name]
            assert t.dims == tuple(int(d) for d in rt.shape)
            assert t.type == rt.tensor_type and t.nbytes == rt.n_bytes
            assert ours.data_offset + t.offset == rt.data_offset
            assert ours.data(rt.name).tobytes() == rt.data.tobytes()

        layout = plan_layout(ours.metadata, ours.tensors.values())
        assert layout.file_size == src.stat().st_size
        out = tmp_path / "ours.gguf"
        with GGUFWriter(out, layout) as w:
            w.write_header()
            for name in reversed(list(ours.tensors)):
                w.write_tensor(name, ours.data(name))
            w.finish()
    assert out.read_bytes() == src.read_bytes()


def test_version_2_files_read_like_version_3(tmp_path):
    path = tmp_path / "v.gguf"
    write_ours(path, [("general.architecture", "llama")], TENSORS[:3])
    data = bytearray(path.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(data))
    with GGUFFile(path) as a, GGUFFile(v2) as b:
        assert b.version == 2 and a.version == 3
        assert a.tensors == b.tensors and list(a.metadata) == list(b.metadata)


def test_several_threads_write_one_file(tmp_path):
    tensors = [(f"blk.{i}.w", (4, 32), T.Q8_0, quantize(RNG.standard_normal((4, 32)).astype(np.float32), T.Q8_0))
               for i in range(16)]
    layout = plan_layout({"general.architecture": "llama"}, [(n, s, t) for n, s, t, _ in tensors])
    path = tmp_path / "mt.gguf"
    with GGUFWriter(path, layout) as w:
        w.write_header()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda t: w.write_tensor(t[0], t[3]), tensors))
        w.finish()
    reader = gguf.GGUFReader(path)
    assert [rt.data.tobytes() for rt in reader.tensors] == [t[3].tobytes() for t in tensors]


# -- resume, overwrite, failure ------------------------------------------------------------------------------

def planned():
    return plan_layout([("general.architecture", "llama")], [TensorSpec(n, s, t) for n, s, t, _ in TENSORS])


PAYLOADS = {n: p for n, _, _, p in TENSORS}


def test_resume_after_an_interrupted_run_gives_the_same_file(tmp_path):
    reference = tmp_path / "reference.gguf"
    write_gguf_py(reference, [], TENSORS)
    path = tmp_path / "out.gguf"
    names = list(PAYLOADS)

    with pytest.raises(KeyboardInterrupt):
        with GGUFWriter(path, planned()) as w:
            w.write_header()
            for name in names[:4]:
                w.write_tensor(name, PAYLOADS[name])
            journal = w.written
            raise KeyboardInterrupt
    assert not path.exists() and w.partial.exists() and w.state is WriterState.CLOSED

    # Another process adds two payloads without knowing the journal (verify=False, nothing claimed).
    with GGUFWriter(path, planned()) as worker:
        worker.resume()
        for name in names[4:6]:
            journal[name] = worker.write_tensor(name, PAYLOADS[name])

    w = GGUFWriter(path, planned())
    w.resume(journal)
    assert w.state is WriterState.PAYLOADS
    for name in names[6:]:
        w.write_tensor(name, PAYLOADS[name])
    hashes = w.finish()
    assert set(hashes) == set(names)
    assert path.read_bytes() == reference.read_bytes()
    assert not w.partial.exists()


def test_resume_refuses_another_layout_or_a_wrong_journal(tmp_path):
    path = tmp_path / "out.gguf"
    w = GGUFWriter(path, planned())
    w.write_header()
    digest = w.write_tensor("q8.weight", PAYLOADS["q8.weight"])
    w.close()

    other = plan_layout([("general.architecture", "qwen3")], [TensorSpec(n, s, t) for n, s, t, _ in TENSORS])
    with pytest.raises(FormatError, match="header differs"):
        GGUFWriter(path, other).resume()
    smaller = plan_layout([("general.architecture", "llama")], [TensorSpec(n, s, t) for n, s, t, _ in TENSORS[:2]])
    with pytest.raises(FormatError, match="another layout"):
        GGUFWriter(path, smaller).resume()
    with pytest.raises(ValidationError, match="journal hash"):
        GGUFWriter(path, planned()).resume({"f32.weight": digest})
    with pytest.raises(FormatError, match="not in the planned layout"):
        GGUFWriter(path, planned()).resume({"nope": digest})
    ok = GGUFWriter(path, planned())
    ok.resume({"q8.weight": digest})
    ok.abort()
    assert not ok.partial.exists()
    with pytest.raises(MissingSourceError, match="no partial"):
        GGUFWriter(path, planned()).resume()


def test_abort_deletes_only_a_partial_the_writer_made(tmp_path):
    """A partial ``write_header`` refuses (another run's) survives ``abort``; after ``finish`` nothing is removed."""
    path = tmp_path / "out.gguf"
    other = GGUFWriter(path, planned())
    other.write_header()
    w = GGUFWriter(path, planned())
    with pytest.raises(OutputExistsError, match="unfinished partial"):
        w.write_header()
    w.abort()
    assert other.partial.exists()
    other.abort()
    assert not other.partial.exists()
    done = GGUFWriter(path, planned())
    done.write_header()
    for name, payload in PAYLOADS.items():
        done.write_tensor(name, payload)
    done.finish()
    done.partial.write_bytes(b"a later writer's")
    done.abort()
    assert done.partial.read_bytes() == b"a later writer's" and path.exists()


def test_existing_output_is_not_replaced_unless_asked(tmp_path):
    path = tmp_path / "out.gguf"
    path.write_bytes(b"precious")
    with pytest.raises(OutputExistsError):
        GGUFWriter(path, planned()).write_header()
    assert path.read_bytes() == b"precious"

    write_ours(path, [("general.architecture", "llama")], TENSORS, overwrite=True)
    assert gguf.GGUFReader(path).tensors[0].name == "f32.weight"

    # The output appears while payloads are written: finish refuses and keeps the partial for a rerun.
    other = tmp_path / "late.gguf"
    w = GGUFWriter(other, planned())
    w.write_header()
    for name, payload in PAYLOADS.items():
        w.write_tensor(name, payload)
    other.write_bytes(b"someone else")
    with pytest.raises(OutputExistsError):
        w.finish()
    assert other.read_bytes() == b"someone else" and w.partial.exists()

    # A leftover partial is not clobbered by a fresh run either.
    other.unlink()
    with pytest.raises(OutputExistsError, match="resume"):
        GGUFWriter(other, planned()).write_header()


def test_a_failure_mid_write_leaves_no_final_file(tmp_path):
    path = tmp_path / "out.gguf"
    w = GGUFWriter(path, planned())
    w.write_header()
    w.write_tensor("f32.weight", PAYLOADS["f32.weight"])
    with pytest.raises(FormatError, match=r"9 of 10 tensors were never written: 'f16.weight'"):
        w.finish()
    with pytest.raises(FormatError, match="payload is 16 bytes, the layout planned 32 for F16"):
        w.write_tensor("f16.weight", PAYLOADS["f16.weight"][:1])
    assert not path.exists()
    w.abort()
    assert not w.partial.exists() and not path.exists()


def test_writer_states_are_enforced_and_named(tmp_path):
    w = GGUFWriter(tmp_path / "s.gguf", planned())
    with pytest.raises(StateError, match=r"write_tensor\(\) needs the writer in state 'header written' or "
                                          r"'writing payloads', but it is 'layout \(nothing written\)'"):
        w.write_tensor("f32.weight", PAYLOADS["f32.weight"])
    with pytest.raises(StateError, match=r"finish\(\) needs"):
        w.finish()
    w.write_header()
    with pytest.raises(StateError, match=r"write_header\(\) needs the writer in state 'layout"):
        w.write_header()
    with pytest.raises(StateError, match=r"resume\(\) needs"):
        w.resume()
    for name, payload in PAYLOADS.items():
        w.write_tensor(name, payload)
    with pytest.raises(FormatError, match="written twice"):
        w.write_tensor("f32.weight", PAYLOADS["f32.weight"])
    w.finish()
    assert w.state is WriterState.FINISHED
    with pytest.raises(StateError, match="but it is 'finished'"):
        w.write_tensor("f32.weight", PAYLOADS["f32.weight"])


@pytest.mark.parametrize("metadata, tensors, error, match", [
    ([("a", "x"), ("a", "y")], [], FormatError, "duplicate metadata key 'a'"),
    ([("n", 5)], [], FormatError, "ambiguous; pass KV"),
    ([("n", [1, 2])], [], FormatError, "ambiguous"),
    ([("n", KV(256, V.UINT8))], [], FormatError, r"256..256 do not fit type UINT8"),
    ([("n", KV([-1], ArrayOf(V.UINT64)))], [], FormatError, "do not fit type UINT64"),
    ([("n", KV(1.5, V.INT32))], [], FormatError, "item 0 is float 1.5, type INT32 needs an integer"),
    ([("n", KV(1e300, V.FLOAT32))], [], FormatError, "overflows type FLOAT32"),
    ([("n", KV(5, V.STRING))], [], FormatError, "expected a str"),
    ([("n", KV([1], V.ARRAY))], [], FormatError, "arrays are ArrayOf"),
    ([("n", KV([[1]], ArrayOf(V.ARRAY)))], [], FormatError, "ambiguous"),
    ([("", "x")], [], FormatError, "non-empty str"),
    ([("general.alignment", KV(48, V.UINT32))], [], FormatError, "power of two, found 48"),
    ([("general.alignment", KV(64, V.UINT64))], [], FormatError, "must have type UINT32, found UINT64"),
    ([], [("x" * 64, (32,), T.F32)], FormatError, "64 bytes, longer than ggml's limit of 63"),
    ([], [("a", (32,), T.F32), ("a", (32,), T.F32)], FormatError, "duplicate tensor name"),
    ([], [("a", (2, 3, 4, 5, 32), T.F32)], FormatError, "5 dimensions, expected 1 to 4"),
    ([], [("a", (4, 100), T.Q4_K)], FormatError, "row length 100 is not a multiple of Q4_K's block size 256"),
    ([], [("a", (-1, 32), T.F32)], FormatError, "dimension 0"),
    ([], [("a", (2.0, 32), T.F32)], FormatError, "sequence of integers"),
    ([], [("a", (32,), "Q9_Z")], UnsupportedError, "unknown GGML type 'Q9_Z'"),
])
def test_plan_refuses_bad_input(metadata, tensors, error, match):
    with pytest.raises(error, match=match):
        plan_layout(metadata, tensors)


def test_write_tensor_refuses_bad_payloads(tmp_path):
    w = GGUFWriter(tmp_path / "p.gguf", planned())
    w.write_header()
    f32 = PAYLOADS["f32.weight"]
    with pytest.raises(FormatError, match="not C-contiguous; pass np.ascontiguousarray"):
        w.write_tensor("f32.weight", np.asfortranarray(f32))
    with pytest.raises(FormatError, match="big-endian"):
        w.write_tensor("f32.weight", f32.astype(">f4"))
    with pytest.raises(FormatError, match="bytes-like"):
        w.write_tensor("f32.weight", [1.0, 2.0])
    with pytest.raises(FormatError, match="not in the planned layout"):
        w.write_tensor("missing", f32)
    w.write_tensor("f32.weight", f32.tobytes())  # a failed attempt does not count as written
    w.abort()
