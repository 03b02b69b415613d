"""``quantkit inspect``: the report against what the reference readers (gguf-py, safetensors) see in the file."""
from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from quantkit.cli import main
from quantkit.inspect import MAX_TABLE_ROWS, TABLE_HEAD_ROWS, describe, render
from quantkit.io.gguf_writer import GGUFWriter, plan_layout

RNG = np.random.default_rng(7)
N_LAYERS = 30  # two tensors per layer: more rows than the table shows by default


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """A small model-like GGUF written by gguf-py."""
    path = tmp_path_factory.mktemp("inspect") / "model.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("qwen3moe.block_count", N_LAYERS)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    for i in range(N_LAYERS):
        w.add_tensor(f"blk.{i}.ffn_down.weight", quantize(RNG.standard_normal((4, 64)).astype(np.float32), T.Q8_0),
                     raw_dtype=T.Q8_0)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, np.float32))
    w.add_tensor("output.weight", RNG.integers(0, 256, (2, 144), dtype=np.uint8), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_report_matches_gguf_py(gguf_path):
    report = describe(gguf_path)
    reference = gguf.GGUFReader(gguf_path)
    assert report["format"] == "gguf" and report["version"] == 3 and report["alignment"] == 32
    assert report["data_offset"] == reference.data_offset
    assert report["file_size"] == gguf_path.stat().st_size
    assert report["ggml_layout"] == "contiguous"

    fields = list(reference.fields.items())[3:]
    assert [m["key"] for m in report["metadata"]] == [k for k, _ in fields]
    for m, (key, field) in zip(report["metadata"], fields):
        names = [t.name for t in field.types]
        assert m["type"] == (f"ARRAY[{names[1]}]" if names[0] == "ARRAY" else names[0]), key
        assert m["value"] == field.contents(), key

    assert [t["name"] for t in report["tensors"]] == [t.name for t in reference.tensors]
    for row, t in zip(report["tensors"], reference.tensors):
        assert row["type"] == t.tensor_type.name
        assert row["shape"] == [int(d) for d in reversed(t.shape)]
        assert (row["nbytes"], row["n_elements"], row["offset"]) == (t.n_bytes, t.n_elements, t.data_offset)

    by_type: dict[str, list[int]] = {}
    for t in reference.tensors:
        counts = by_type.setdefault(t.tensor_type.name, [0, 0, 0])
        counts[0] += 1
        counts[1] += t.n_bytes
        counts[2] += t.n_elements
    totals = report["totals"]
    assert {r["type"]: [r["tensors"], r["bytes"], r["weights"]] for r in totals["by_type"]} == by_type
    for row in totals["by_type"]:
        block, size = GGML_QUANT_SIZES[T[row["type"]]]
        assert row["bits_per_weight"] == 8 * size / block
    all_bytes = sum(t.n_bytes for t in reference.tensors)
    all_weights = sum(t.n_elements for t in reference.tensors)
    assert (totals["tensors"], totals["bytes"], totals["weights"]) == (len(reference.tensors), all_bytes, all_weights)
    assert totals["bits_per_weight"] == 8 * all_bytes / all_weights


def test_text_summarizes_long_arrays_and_tables(gguf_path):
    result = CliRunner().invoke(main, ["inspect", str(gguf_path)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "[300 × str] 'tok0', 'tok1', 'tok2', …" in out
    assert "[3 × i32] 1, 2, 3" in out
    assert "  1e-06\n" in out and "  1000000.0\n" in out  # float32 values as float32 print them
    n = 2 * N_LAYERS + 1
    assert n > MAX_TABLE_ROWS
    hidden = n - TABLE_HEAD_ROWS - 5
    assert f"… {hidden} more (--all lists every one)" in out
    assert "blk.20.ffn_down.weight" not in out and "output.weight" in out
    assert "Q8_0" in out and "8.5000" in out and "total" in out

    everything = CliRunner().invoke(main, ["inspect", "--all", str(gguf_path)]).stdout
    assert "more (--all" not in everything
    assert all(f"blk.{i}.ffn_down.weight" in everything for i in range(N_LAYERS))


def test_json_output_is_the_report_and_renders_the_same(gguf_path):
    result = CliRunner().invoke(main, ["inspect", "--json", str(gguf_path)])
    assert result.exit_code == 0, result.output
    report = describe(gguf_path)
    assert json.loads(result.stdout) == json.loads(json.dumps(report))
    assert render(json.loads(result.stdout), show_all=True) == render(report, show_all=True)


def test_layout_ggml_would_refuse_is_reported(gguf_path, tmp_path):
    """A gap before the last payload is readable, but ggml's loader insists on contiguous payloads."""
    reference = gguf.GGUFReader(gguf_path)
    last = reference.tensors[-1]
    offset_field_at = last.field.offset + sum(int(p.nbytes) for p in last.field.parts[:5])
    data = bytearray(gguf_path.read_bytes())
    relative = last.data_offset - reference.data_offset
    data[offset_field_at:offset_field_at + 8] = struct.pack("<Q", relative + 32)
    data[last.data_offset:last.data_offset] = bytes(32)
    path = tmp_path / "gap.gguf"
    path.write_bytes(bytes(data))

    report = describe(path)
    assert report["ggml_layout"] == f"tensor 'output.weight' is at data offset {relative + 32}; ggml expects {relative}"
    assert render(report).splitlines()[0].endswith(f"not loadable by ggml: {report['ggml_layout']}")


def test_names_with_control_characters_stay_on_one_row(tmp_path):
    path = tmp_path / "odd.gguf"
    layout = plan_layout({"general.architecture": "llama", "odd\nkey": "x"}, [("a\nb", (32,), T.F32)])
    with GGUFWriter(path, layout) as w:
        w.write_header()
        w.write_tensor("a\nb", np.zeros(32, np.float32))
        w.finish()
    text = render(describe(path))
    assert "'a\\nb'" in text and "'odd\\nkey'" in text
    assert not any(line in ("b", "key") or line.startswith(("b ", "key ")) for line in text.splitlines())


# -- safetensors checkpoints ---------------------------------------------------------------------------------

def save_checkpoint(directory, shards: dict[str, dict[str, np.ndarray]], config: dict | None = None):
    """A checkpoint written with the safetensors library itself (plus an index when sharded)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for shard, tensors in shards.items():
        save_file(tensors, directory / shard, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config or {"model_type": "qwen3_moe"}))
    return directory


SHARDS = {
    "model-00001-of-00002.safetensors": {"model.embed_tokens.weight": RNG.standard_normal((8, 16)).astype(np.float16),
                                         "model.norm.weight": np.ones(16, np.float32)},
    "model-00002-of-00002.safetensors": {"lm_head.weight": RNG.standard_normal((8, 16)).astype(np.float16),
                                         "model.layers.0.mlp.gate.weight": np.zeros((4, 16), np.float32)},
}


def test_checkpoint_report_matches_safetensors(tmp_path):
    from safetensors import safe_open

    path = save_checkpoint(tmp_path / "ck", SHARDS)
    report = describe(path)
    assert report["format"] == "safetensors" and report["quantization"] == "none"
    assert report["files"] == sorted(SHARDS)
    assert report["config"] == {"model_type": "qwen3_moe"}
    assert report["metadata"] == [{"key": "format", "type": "STRING", "value": "pt"}]

    expected = {}
    for shard in SHARDS:
        with safe_open(path / shard, "np") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                expected[name] = (sl.get_dtype(), sl.get_shape(), f.get_tensor(name).nbytes, shard)
    rows = {t["name"]: (t["type"], t["shape"], t["nbytes"], t["file"]) for t in report["tensors"]}
    assert rows == expected
    totals = report["totals"]
    assert totals["bytes"] == sum(e[2] for e in expected.values())
    assert totals["elements"] == sum(int(np.prod(e[1])) for e in expected.values())
    assert {r["type"]: r["bits_per_element"] for r in totals["by_type"]} == {"F16": 16.0, "F32": 32.0}

    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "safetensors checkpoint (qwen3_moe), 2 files, quantization none" in result.stdout
    assert "model.layers.0.mlp.gate.weight" in result.stdout and "bits/element" in result.stdout


def _safetensors_bytes(header: dict, data: bytes, header_length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_length is None else header_length) + raw + data


GOOD_HEADER = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}

SAFETENSORS_CORPUS = [  # (id, file bytes, fragment of the one-line message)
    ("header length past the end", _safetensors_bytes(GOOD_HEADER, bytes(12), header_length=10**6),
     "header length 1000000 runs past the end of the file"),
    ("header not JSON", struct.pack("<Q", 5) + b"{oops" + bytes(12), "header is not valid UTF-8 JSON"),
    ("offsets not contiguous", _safetensors_bytes({**GOOD_HEADER, "b": {**GOOD_HEADER["b"],
                                                                        "data_offsets": [9, 13]}}, bytes(13)),
     "tensor 'b': data_offsets [9, 13] leaves a gap"),
    ("unknown dtype", _safetensors_bytes({"a": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
     "unknown dtype 'F7'"),
    ("data truncated", _safetensors_bytes(GOOD_HEADER, bytes(6)), "run past the end of the data buffer (6 bytes)"),
    ("empty file", b"", "EOF reading the header length: expected 8 bytes, got 0"),
]


@pytest.mark.parametrize("name, data, fragment", SAFETENSORS_CORPUS, ids=[c[0] for c in SAFETENSORS_CORPUS])
def test_malformed_safetensors_is_one_line_exit_2(tmp_path, name, data, fragment):
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    (tmp_path / "config.json").write_text("{}")
    for target in (path, tmp_path):  # the file itself and the checkpoint directory
        result = CliRunner().invoke(main, ["inspect", str(target)])
        assert result.exit_code == 2, (result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
        assert result.stdout == ""


@pytest.mark.parametrize("breakage, fragment", [
    ("missing shard", "shard named by the index is missing"),
    ("config not JSON", "config is not valid JSON"),
])
def test_broken_checkpoint_directory_is_one_line_exit_2(tmp_path, breakage, fragment):
    path = save_checkpoint(tmp_path / "ck", SHARDS)
    if breakage == "missing shard":
        (path / "model-00002-of-00002.safetensors").unlink()
    else:
        (path / "config.json").write_text("{not json")
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
