"""``quantkit validate`` on converted tiny checkpoints: valid conversions pass, and a flipped byte, swapped experts,
a wrong recipe, a truncated file, bad scales, padding or size are each found and named.

Every artifact here is written by ``quantkit convert`` (whose bytes ``tests/test_convert.py`` proves equal to ggml's
own encoding); corruptions are made by editing the file's bytes at offsets read back with quantkit's GGUF reader.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.convert.execute import ConvertRequest, make_job, prepare
from quantkit.convert.tensors import SourceContext, tensor_bytes
from quantkit.formats.registry import GGMLType, layout
from quantkit.imatrix import Entry, make_imatrix, save_imatrix
from quantkit.io.atomic import sha256_file
from quantkit.io.gguf_reader import GGUFFile
from quantkit.testing.foreign_files import without_quantkit_keys
from quantkit.validate.payload import RANDOM_ROWS, sample_experts, sample_rng, sample_rows
from quantkit.convert.tensors import pieces, tensor_rows
from quantkit.testing.recipe_texts import PRE_TOKENIZER as PRE, Q2_RECIPE, SOURCE_RECIPE
from quantkit.validate.structure import header_length

ARCHS = ("qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp")
RECIPE = "q4_k_m-control"


def convert(src: Path, out: Path, recipe: str = RECIPE, *extra: str) -> Path:
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--recipe", recipe, "--no-progress",
                                       "-j", "1", "--pre-tokenizer", PRE, *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory):
    """(source, GGUF) of a tiny checkpoint converted once per module."""
    root = tmp_path_factory.mktemp("validate")
    made: dict[tuple, tuple[Path, Path]] = {}

    def get(arch: str, recipe: str = RECIPE, layout: str = "per-expert", encoding: str = "bf16", *extra: str):
        key = (arch, recipe, layout, encoding, extra)
        if key not in made:
            src = tiny_checkpoints.get(arch, layout, encoding)
            out = root / f"{len(made)}-{arch}.gguf"
            made[key] = src, convert(src, out, recipe, *extra)
        return made[key]
    return get


def validate(*args, json_path: Path | None = None):
    """(CliRunner result, JSON report or None)."""
    extra = ["--report", str(json_path)] if json_path is not None else []
    result = CliRunner().invoke(main, ["validate", *map(str, args), *extra])
    report = strict_json(json_path.read_text()) if json_path is not None and json_path.exists() else None
    return result, report


def strict_json(text: str):
    """JSON as strict parsers read it: a bare NaN or Infinity (Python's extension) is refused."""
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def checks(report: dict) -> dict[str, dict]:
    return {c["check"]: c for c in report["checks"]}


def failed(report: dict) -> set[str]:
    return {c["check"] for c in report["checks"] if c["status"] == "failed"}


def copy(path: Path, tmp_path: Path, name: str = "copy.gguf") -> Path:
    out = tmp_path / name
    shutil.copyfile(path, out)
    return out


def poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def payload_offset(path: Path, name: str, row: int = 0, expert: int | None = None) -> tuple[int, int]:
    """(absolute file offset of the row, row bytes) of tensor ``name``."""
    with GGUFFile(path) as f:
        t = f.tensor(name)
        rows = row if expert is None else expert * t.shape[1] + row
        return f.data_offset + t.offset + rows * t.row_bytes, t.row_bytes


def one_line_error(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    assert result.stdout == ""
    return lines[0]


# -- valid artifacts ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_a_valid_conversion_passes_full_and_sample(artifact, arch, tmp_path):
    src, gguf = artifact(arch)
    result, report = validate(gguf, "--source", src, "--payload", "full", json_path=tmp_path / "full.json")
    assert result.exit_code == 0, result.output
    assert report["ok"] and not failed(report) and result.stdout.strip().endswith("valid")
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert set(statuses.values()) == {"passed"}, statuses
    with GGUFFile(gguf) as f:
        assert [t["name"] for t in report["tensors"]] == list(f.tensors)
        assert all(t["compared"] == "full" and t["match"] for t in report["tensors"])
        # full: every byte of the artifact read once (header, padding, payloads)
        assert report["io"]["artifact_bytes_read"] == f.file_size
        assert report["io"]["source_files_hashed_bytes"] == sum(p.stat().st_size for p in src.iterdir()
                                                                if p.suffix in (".json", ".safetensors"))
        data_offset = f.data_offset

    result, report = validate(gguf, "--source", src, "--payload", "sample", json_path=tmp_path / "sample.json")
    assert result.exit_code == 0, result.output
    sampled = [t for t in report["tensors"] if t["compared"] == "sample"]
    assert sampled and all(t["match"] for t in report["tensors"])
    # sample: the header (with its padding) and the compared regions, nothing else
    assert report["io"]["artifact_bytes_read"] == data_offset + sum(t["bytes_compared"] for t in report["tensors"])
    assert report["io"]["artifact_bytes_read"] < report["io"]["artifact_bytes"]


def test_sampling_choices():
    rng = np.random.default_rng(0)
    assert sample_experts(8, np.random.default_rng(5)) == sample_experts(8, np.random.default_rng(5))
    experts = sample_experts(256, rng)
    assert len(experts) == 3 and experts[0] == 0 and experts[-1] == 255 and 0 < experts[1] < 255
    assert sample_experts(2, rng) == [0, 1] and sample_experts(1, rng) == [0]
    rows = sample_rows(5000, np.random.default_rng(1))
    fixed = {0, 1, 4999} | {(1 << k) - 1 for k in range(1, 13)} | {1 << k for k in range(1, 13)}
    assert fixed <= set(rows.tolist()) and len(rows) <= len(fixed) + RANDOM_ROWS
    assert len(set(rows.tolist()) - fixed) >= RANDOM_ROWS - len(fixed)
    assert np.array_equal(rows, np.unique(rows)) and rows.max() < 5000
    assert np.array_equal(rows, sample_rows(5000, np.random.default_rng(1)))
    assert np.array_equal(sample_rows(3, rng), [0, 1, 2])


# -- the converter's bytes, piece by piece ----------------------------------------------------------------------------

def _imatrix(path: Path, src: Path, unobserved: dict[str, list[int]], seed: int) -> Path:
    request = ConvertRequest(source=str(src), out=path, recipe=RECIPE, pre_tokenizer=PRE)
    rng = np.random.default_rng(seed)
    entries = {}
    for t in prepare(request).plan.tensors:
        shape = t.output.shape
        if len(shape) < 2 or not t.name.startswith("blk.") or "ffn_gate_inp" in t.name:
            continue
        mats = shape[0] if len(shape) == 3 else 1
        counts = rng.integers(5, 50, mats).astype(np.float32)
        sums = (rng.random((mats, shape[-1])) * counts[:, None]).astype(np.float32)
        for e in unobserved.get(t.name, []):
            counts[e], sums[e] = 0, 0
        entries[t.name] = Entry(sums, counts)
    save_imatrix(make_imatrix(entries, datasets=["synthetic:unit-test"], chunk_count=3, chunk_size=64,
                              synthetic=True), path)
    return path


PIECE_CASES = [  # (arch, layout, encoding, recipe, options)
    ("qwen3_moe", "fused", "bf16", RECIPE, ()),
    ("qwen3_moe", "per-expert", "bf16", Q2_RECIPE, ("bootstrap",)),
    ("qwen3_moe", "per-expert", "bf16", Q2_RECIPE, ("imatrix",)),
    ("qwen3_moe", "per-expert", "nvfp4-modelopt", SOURCE_RECIPE, ()),
    ("deepseek_v4", "official", "fp4-experts", SOURCE_RECIPE, ()),
    ("deepseek_v3", "per-expert", "fp8-block", RECIPE, ()),
    ("qwen4_exp", "per-expert", "bf16", "qwen3.8-flash-next-q4", ()),
    ("glm5_next", "fused", "bf16", RECIPE, ()),
]


@pytest.mark.parametrize("arch, layout_, encoding, recipe, options", PIECE_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{'-'.join(c[4]) or 'plain'}" for c in PIECE_CASES])
def test_pieces_are_the_converters_bytes(tiny_checkpoints, tmp_path, arch, layout_, encoding, recipe, options):
    """Every piece, and every sampled subset of rows, equals the matching bytes of ``tensor_bytes``."""
    src = tiny_checkpoints.get(arch, layout_, encoding)
    if recipe.startswith("name ="):
        (tmp_path / "r.toml").write_text(recipe)
        recipe = str(tmp_path / "r.toml")
    imatrix = None
    if "imatrix" in options:
        imatrix = str(_imatrix(tmp_path / "imatrix.gguf", src, {"blk.0.ffn_gate_exps.weight": [1, 6]}, 0))
    request = ConvertRequest(source=str(src), out=tmp_path / "x.gguf", recipe=recipe, imatrix=imatrix,
                             bootstrap="bootstrap" in options, allow_synthetic_imatrix=True, pre_tokenizer=PRE)
    prepared = prepare(request)
    ctx = SourceContext(str(prepared.source.path), prepared.plan.model_type, imatrix, prepared.imatrix_shapes,
                        allow_synthetic_imatrix=True)
    rng = np.random.default_rng(0)
    kinds = set()
    for t in prepared.plan.tensors:
        job = make_job(t, prepared.imatrix)
        kinds.add((job.kind, job.importance))
        want = np.concatenate([np.asarray(b).reshape(-1) for b in tensor_bytes(ctx, job)])
        row_bytes = layout(t.qtype).row_bytes(t.output.shape[-1])
        want = want.reshape(tensor_rows(t.output.shape), row_bytes)
        parts = pieces(ctx, job)
        got = np.concatenate([p.produce(None)[1].reshape(-1, row_bytes) for p in parts])
        assert np.array_equal(got, want), t.name
        for p in parts:
            if p.row is None or p.rows < 2:
                continue
            rows = np.unique(rng.integers(0, p.rows, 3))
            assert np.array_equal(p.produce(rows)[1], want[p.row + rows]), (t.name, p.row)
            if p.matrix is not None:
                assert p.row == p.matrix * tensor_rows(t.output.shape[1:])
    expected_kinds = {"nvfp4-modelopt": "nvfp4-repack", "fp4-experts": "mxfp4-repack"}
    if encoding in expected_kinds:
        assert any(kind == expected_kinds[encoding] for kind, _ in kinds)
    for option in options:
        assert any(importance == option for _, importance in kinds)


# -- what validation finds --------------------------------------------------------------------------------------------

def test_a_flipped_byte_is_found_and_named(artifact, tmp_path):
    src, gguf = artifact("qwen3_moe")
    bad = copy(gguf, tmp_path)
    name = "blk.1.ffn_down_exps.weight"   # Q6_K, 8 experts of [256, 256]
    start, row_bytes = payload_offset(bad, name, row=9, expert=5)
    byte = 17                              # a quant byte of the row's one block (not its scale)
    poke(bad, start + byte, bytes([bad.read_bytes()[start + byte] ^ 0x40]))
    result, report = validate(bad, "--source", src, "--payload", "full", json_path=tmp_path / "r.json")
    assert result.exit_code == 1
    assert failed(report) == {"payload.bytes"}
    where = f"expert 5, row 9, block 0 (file offset {start:,})"
    item = f"{name}: 1 of 2048 rows differ, in expert 5; first at {where}"
    assert checks(report)["payload.bytes"]["items"] == [item]
    assert item in result.stdout
    assert "INVALID" in result.stdout
    (entry,) = [t for t in report["tensors"] if t["name"] == name]
    assert entry["differences"] == [where] and not entry["match"] and entry["error_ok"]

    # sample mode compares experts 0, a middle one and the last: a flip in expert 0 is found, in expert 5 only
    # when the seeded middle expert is 5
    first, _ = payload_offset(bad, name, row=0, expert=0)
    again = copy(gguf, tmp_path, "again.gguf")
    poke(again, first + 100, bytes([again.read_bytes()[first + 100] ^ 1]))
    result, report = validate(again, "--source", src, json_path=tmp_path / "s.json")
    assert result.exit_code == 1 and failed(report) == {"payload.bytes"}
    assert "expert 0, row 0, block 0" in checks(report)["payload.bytes"]["detail"]


def test_swapped_experts_are_found(artifact, tmp_path):
    src, gguf = artifact("qwen3_moe")
    bad = copy(gguf, tmp_path)
    name = "blk.0.ffn_gate_exps.weight"   # Q4_K [8, 256, 256]
    with GGUFFile(bad) as f:
        t = f.tensor(name)
        size = t.nbytes // t.shape[0]
        base = f.data_offset + t.offset
    data = bytearray(bad.read_bytes())
    data[base + 2 * size:base + 3 * size], data[base + 6 * size:base + 7 * size] = \
        data[base + 6 * size:base + 7 * size], data[base + 2 * size:base + 3 * size]
    bad.write_bytes(bytes(data))
    result, report = validate(bad, "--source", src, "--payload", "full", json_path=tmp_path / "r.json")
    assert result.exit_code == 1
    assert failed(report) == {"payload.bytes", "payload.error"}
    (entry,) = [t for t in report["tensors"] if t["name"] == name]
    assert entry["differing_rows"] == 2 * 256 and entry["differing_experts"] == [2, 6]
    assert entry["differences"][0].startswith("expert 2, row 0, block 0")
    assert checks(report)["payload.bytes"]["items"][0].startswith(f"{name}: 512 of 2048 rows differ, in experts 2, 6")
    assert not entry["error_ok"] and entry["rel_rmse"] > 0.6   # two of eight experts wrong: ~sqrt(2 * 2/8)
    assert any(item.startswith(f"{name}: relative RMSE") for item in checks(report)["payload.error"]["items"])


def test_a_wrong_recipe_gives_an_inventory_diff(artifact, tmp_path):
    src, gguf = artifact("qwen3_moe")
    result, report = validate(gguf, "--source", src, "--recipe", "q8_0", json_path=tmp_path / "r.json")
    assert result.exit_code == 1
    assert {"inventory.tensors", "inventory.metadata", "inventory.header"} <= failed(report)
    items = checks(report)["inventory.tensors"]["items"]
    assert any(i.startswith("blk.0.ffn_gate_exps.weight: type Q4_K (expected Q8_0)") for i in items)
    meta = checks(report)["inventory.metadata"]["items"]
    assert any(i.startswith("quantkit.recipe.name: STRING 'q4_k_m-control', expected STRING 'q8_0'") for i in meta)
    assert report["recipe"]["name"] == "q8_0"
    assert "not compared (inventory differs)" in checks(report)["payload.bytes"]["detail"]


def test_an_edited_recorded_recipe_fails_provenance_and_is_not_replanned(artifact, tmp_path):
    """A recorded recipe text that no longer hashes to its recorded SHA-256 (here: no longer TOML) is the artifact's
    defect (exit 1, structure.provenance), not an unusable input: the re-plan and payload checks say why they were
    skipped, and --recipe re-plans."""
    src, gguf = artifact("qwen3_moe")
    bad = copy(gguf, tmp_path)
    data = bad.read_bytes()
    at = data.index(b'name = "q4_k_m-control"')
    poke(bad, at, b"!")
    result, report = validate(bad, "--source", src, json_path=tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert "structure.provenance" in failed(report)
    for name in ("inventory.tensors", "payload.bytes"):
        assert checks(report)[name]["status"] == "skipped" and "pass --recipe" in checks(report)[name]["detail"]
    result, report = validate(bad, "--source", src, "--recipe", RECIPE, json_path=tmp_path / "r2.json")
    assert result.exit_code == 1 and checks(report)["payload.bytes"]["status"] == "passed", result.output


def test_a_token_changed_deep_in_the_vocabulary_is_named_by_its_index(artifact, tmp_path):
    """Two vocabularies of one length whose first items agree: the metadata check names the first item that
    differs, not two identical-looking previews."""
    import struct

    src, gguf = artifact("qwen3_moe")
    bad = copy(gguf, tmp_path)
    with GGUFFile(bad) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"].value)
    i = next(i for i in range(100, len(tokens)) if tokens[i].isascii() and tokens[i].isalpha() and len(tokens[i]) > 2)
    stored = struct.pack("<Q", len(tokens[i].encode())) + tokens[i].encode()
    data = bad.read_bytes()
    at = data.index(stored) + 8
    changed = ("Q" if tokens[i][0] != "Q" else "Z") + tokens[i][1:]
    poke(bad, at, changed.encode()[:1])
    result, report = validate(bad, "--source", src, "--payload", "none", json_path=tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    items = checks(report)["inventory.metadata"]["items"]
    assert f"tokenizer.ggml.tokens: ARRAY[STRING] item {i} of {len(tokens)}: {changed!r}, expected {tokens[i]!r}" in items


def test_a_truncated_file_exits_2_with_one_line(artifact, tmp_path):
    src, gguf = artifact("qwen3_moe")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[:gguf.stat().st_size - 5000])
    result, report = validate(cut, "--source", src, json_path=tmp_path / "r.json")
    assert "EOF reading the payload of" in one_line_error(result)
    assert report["exit_code"] == 2 and "EOF reading the payload" in report["error"]


def test_the_source_must_be_known(artifact, tmp_path):
    _, gguf = artifact("qwen3_moe")
    line = one_line_error(validate(gguf)[0])
    assert "records no source repository" in line and "--source" in line


def test_another_models_source_is_one_line_not_a_list_of_differences(artifact, tiny_checkpoints):
    """A source of another architecture does not belong to the artifact (exit 2, one line naming both), where
    validate listed every tensor and key as a difference (exit 1)."""
    _, gguf = artifact("qwen3_moe", "q8_0")
    line = one_line_error(validate(gguf, "--source", tiny_checkpoints.get("deepseek_v3", "per-expert", "bf16"))[0])
    assert "the artifact is a 'qwen3moe' model, the source a 'deepseek_v3' one" in line, line


def test_scales_padding_and_size(artifact, tmp_path):
    src, gguf = artifact("qwen3_moe", "q8_0")
    with GGUFFile(gguf) as f:
        t = next(t for t in f.tensors.values() if t.type == GGMLType.Q8_0 and len(t.shape) == 2)
        start = f.data_offset + t.offset
        header_pad = f.data_offset - 1          # the header's padding ends just before the data section
        assert f.data_offset > header_length(f)
    nan = copy(gguf, tmp_path)
    poke(nan, start + 5 * 34, b"\x00\x7e")      # block 5's f16 d = NaN
    result, report = validate(nan, "--structure-only", json_path=tmp_path / "a.json")
    assert result.exit_code == 1 and failed(report) == {"structure.scales"}
    (item,) = checks(report)["structure.scales"]["items"]
    assert item == f"{t.name}: 1 block (f16 scale is Inf or NaN); first at row 0, block 5"
    # the payload's error is NaN there: the report says so in standard JSON, printed (--json) or written
    result, report = validate(nan, "--source", src, "--payload", "full", json_path=tmp_path / "a2.json")
    assert result.exit_code == 1 and "structure.scales" in failed(report)
    (row,) = [r for r in report["tensors"] if r["name"] == t.name]
    assert row["rel_rmse"] == "nan"
    printed = CliRunner().invoke(main, ["validate", str(nan), "--source", str(src), "--payload", "full", "--json"])
    assert strict_json(printed.stdout)["tensors"] == report["tensors"]

    for path, at, what in [(gguf, header_pad, "header"), _tensor_padding(artifact("deepseek_v4")[1])]:
        padded = copy(path, tmp_path, "padded.gguf")
        poke(padded, at, b"\x01")
        result, report = validate(padded, "--structure-only", json_path=tmp_path / f"b-{what}.json")
        assert failed(report) == {"structure.padding"}
        assert checks(report)["structure.padding"]["items"] == [
            f"padding after {what} holds non-zero bytes at file offset {at:,}"]

    longer = copy(gguf, tmp_path, "longer.gguf")
    with open(longer, "ab") as fh:
        fh.write(bytes(32))
    result, report = validate(longer, "--source", src, "--payload", "none", json_path=tmp_path / "c.json")
    assert result.exit_code == 1 and failed(report) == {"structure.file_size", "inventory.file_size"}
    assert "trailing bytes" in checks(report)["structure.file_size"]["detail"]


def _tensor_padding(path: Path) -> tuple[Path, int, str]:
    """(path, file offset of the last padding byte after the first padded payload, its tensor name)."""
    with GGUFFile(path) as f:
        t = next(t for t in f.tensors.values() if t.nbytes % f.alignment)
        return path, f.data_offset + t.offset + -(-t.nbytes // f.alignment) * f.alignment - 1, t.name


def test_a_file_without_provenance(tmp_path):
    from test_gguf_malformed import BASE   # the field-by-field GGUF builder of the reader's malformed-input tests

    path = tmp_path / "base.gguf"
    path.write_bytes(BASE.buf)
    result, report = validate(path, "--structure-only", json_path=tmp_path / "r.json")
    assert result.exit_code == 1
    assert failed(report) == {"structure.metadata"}
    assert "llama.block_count is missing" in checks(report)["structure.metadata"]["items"]
    # no recorded recipe: a file quantkit did not write (tests/test_foreign.py), checked for structure only
    assert checks(report)["structure.provenance"]["status"] == "skipped"
    result, report = validate(path, json_path=tmp_path / "r2.json")
    assert result.exit_code == 1 and "structure checks only" in result.output
    assert checks(report)["payload.proof"]["status"] == "skipped"


@pytest.mark.parametrize("arch, dialect", [("qwen3_moe", "llama.cpp"), ("deepseek_v4", "ds4"),
                                           ("glm5_next", "llama.cpp"), ("qwen4_exp", "ds4")])
def test_an_expert_count_the_tensors_contradict_fails_structure_shapes(artifact, tmp_path, arch, dialect):
    """llama.cpp sizes each tensor from the keys and refuses a file they contradict; without a source, validate said
    nothing of it (a hand-edited or mis-merged header)."""
    import gguf as gguf_py

    _, made = artifact(arch, RECIPE, "per-expert", "bf16", "--dialect", dialect)
    result, report = validate(made, "--structure-only", json_path=tmp_path / "ok.json")
    assert result.exit_code == 0, result.output
    assert checks(report)["structure.shapes"]["status"] == "passed"
    edited = copy(made, tmp_path)
    reader = gguf_py.GGUFReader(edited, "r+")
    (key,) = [k for k in reader.fields if k.endswith(".expert_count")]
    field = reader.fields[key]
    experts = int(field.parts[field.data[0]][0])
    field.parts[field.data[0]][0] = experts + 1
    del reader
    result, report = validate(edited, "--structure-only", json_path=tmp_path / "r.json")
    assert result.exit_code == 1 and failed(report) == {"structure.shapes"}, result.output
    items = checks(report)["structure.shapes"]["items"]
    assert items and all(f"gives {experts + 1} (" in item and "_exps.weight" in item for item in items)
    assert "llama.cpp refuses to load it" in result.output


@pytest.mark.parametrize("count, message", [(1, "qwen3moe.block_count is 1 but block 1 has tensors"),
                                            (5, "qwen3moe.block_count is 5 but block 2 (and 2 more) has no tensors")])
def test_a_block_count_the_tensors_contradict_fails_structure_shapes(artifact, tmp_path, count, message):
    """llama.cpp creates each block's tensors from block_count: an edited count passed --structure-only."""
    import gguf as gguf_py

    _, made = artifact("qwen3_moe")
    edited = copy(made, tmp_path)
    reader = gguf_py.GGUFReader(edited, "r+")
    field = reader.fields["qwen3moe.block_count"]
    assert int(field.parts[field.data[0]][0]) == 2
    field.parts[field.data[0]][0] = count
    del reader
    result, report = validate(edited, "--structure-only", json_path=tmp_path / "r.json")
    assert result.exit_code == 1 and failed(report) == {"structure.shapes"}, result.output
    assert any(message in item for item in checks(report)["structure.shapes"]["items"])


def test_a_vocabulary_only_file_as_gguf_py_writes_it_is_well_formed(tmp_path):
    """gguf-py (llama.cpp's converter with --vocab-only, its models/ggml-vocab-*.gguf) ends a file without tensors at
    the header, unpadded, and llama.cpp loads it: not a missing padding."""
    import gguf as gguf_py

    path = tmp_path / "vocab.gguf"
    writer = gguf_py.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", "abc"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()     # and no tensor section, as llama.cpp's converter does with --vocab-only
    writer.close()
    with GGUFFile(path) as f:
        assert not f.tensors and f.file_size < f.data_offset     # unpadded, as the case needs
    result, report = validate(path, "--structure-only", json_path=tmp_path / "r.json")
    assert checks(report)["structure.file_size"]["status"] == "passed", result.output
    with open(path, "ab") as fh:
        fh.write(b"\x01")
    result, report = validate(path, "--structure-only", json_path=tmp_path / "r2.json")
    assert checks(report)["structure.file_size"]["status"] == "failed"


def test_a_foreign_ds4_file_is_compared_under_llama_cpps_keys_and_ds4s_own(tmp_path, monkeypatch):
    """ds4's keys have their own types and meanings (GLM's context_length UINT64, its key_length): compared as
    they were, a faithful ds4 file failed; ds4's own keys (deepseek4.vocab_size) were never compared."""
    import dataclasses

    from quantkit.io.gguf import KV
    from quantkit.testing import tiny_models

    spec = tiny_models.ARCHS["glm5_next"]

    def own_indexers(ids):          # ds4's GLM dialect has no shared indexers
        config = spec.make_config(ids)
        config.text_config.indexer_types = ["full"] * len(config.text_config.indexer_types)
        return config

    monkeypatch.setitem(tiny_models.ARCHS, "glm5_next", dataclasses.replace(spec, make_config=own_indexers))
    tiny_models._cached_model.cache_clear()     # models are cached by name: neither take nor leave this variant
    try:
        tiny_models.save_tiny_checkpoint("glm5_next", tmp_path / "glm5_next")
    finally:
        tiny_models._cached_model.cache_clear()
    tiny_models.save_tiny_checkpoint("deepseek_v4", tmp_path / "deepseek_v4")
    for arch in ("glm5_next", "deepseek_v4"):
        src = tmp_path / arch
        made = convert(src, tmp_path / f"{arch}.gguf", "q8_0", "--dialect", "ds4")
        bare = without_quantkit_keys(made, tmp_path / f"{arch}-bare.gguf")
        result, report = validate(bare, "--source", src, json_path=tmp_path / f"{arch}.json")
        # GLM's convolutions and A_log are stored in ds4's own layout: named unproven, not compared
        assert failed(report) == ({"payload.proof"} if arch == "glm5_next" else set()), result.output
        assert checks(report)["inventory.metadata"]["status"] == "passed"

    def fewer_tokens(meta):
        meta["deepseek4.vocab_size"] = KV(meta["deepseek4.vocab_size"].value - 1, meta["deepseek4.vocab_size"].type)

    edited = without_quantkit_keys(made, tmp_path / "edited.gguf", fewer_tokens)
    result, report = validate(edited, "--source", src, json_path=tmp_path / "edited.json")
    assert result.exit_code == 1 and failed(report) == {"inventory.metadata"}, result.output
    (item,) = checks(report)["inventory.metadata"]["items"]
    assert item.startswith("deepseek4.vocab_size: UINT32 ")


def test_a_whole_file_named_like_a_shard_is_validated_as_a_file(artifact, tmp_path):
    """The name alone made a shard: a whole GGUF called X-00001-of-00001.gguf (no split keys) was INVALID (split.no
    None) and could not be compared with its source."""
    src, gguf = artifact("qwen3_moe")
    named = copy(gguf, tmp_path, "model-00001-of-00001.gguf")
    result, report = validate(named, "--source", src, json_path=tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert report["kind"] == "gguf" and checks(report)["payload.bytes"]["status"] == "passed"


def test_a_hyperparameter_key_the_source_does_not_imply_fails_a_foreign_file(artifact, tmp_path):
    """RoPE scaling added to a llama.cpp-dialect file changes every logit llama.cpp computes; only keys the source
    implies were compared, so the file was proven valid."""
    from gguf.constants import GGUFValueType

    from quantkit.io.gguf import KV

    src, made = artifact("qwen3_moe", "q8_0")

    def scaled(meta):
        meta["qwen3moe.rope.scaling.type"] = KV("linear", GGUFValueType.STRING)
        meta["qwen3moe.rope.scaling.factor"] = KV(8.0, GGUFValueType.FLOAT32)

    bare = without_quantkit_keys(made, tmp_path / "bare.gguf")
    result, report = validate(bare, "--source", src, json_path=tmp_path / "bare.json")
    assert result.exit_code == 0, result.output
    edited = without_quantkit_keys(made, tmp_path / "scaled.gguf", scaled)
    result, report = validate(edited, "--source", src, json_path=tmp_path / "scaled.json")
    assert result.exit_code == 1 and failed(report) == {"inventory.metadata"}, result.output
    assert checks(report)["inventory.metadata"]["items"] == [
        "qwen3moe.rope.scaling.type: STRING 'linear', which the source config does not imply",
        "qwen3moe.rope.scaling.factor: FLOAT32 8.0, which the source config does not imply"]


def test_a_flipped_bit_in_a_table_of_few_values_is_not_called_a_move(artifact, tmp_path):
    """V4's token -> expert table holds small integers: one flipped bit can spell another row, and the difference
    was reported as rows reordered or duplicated."""
    src, made = artifact("deepseek_v4", "q8_0")
    with GGUFFile(made) as f:
        t = f.tensors["blk.0.ffn_gate_tid2eid.weight"]
        at = f.data_offset + t.offset + 100
    edited = copy(made, tmp_path)
    with open(edited, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 1]))
    result, report = validate(edited, "--source", src, "--payload", "full", json_path=tmp_path / "r.json")
    assert result.exit_code == 1 and "payload.bytes" in failed(report), result.output
    items = checks(report)["payload.bytes"]["items"]
    assert any("blk.0.ffn_gate_tid2eid.weight" in item for item in items)
    assert not any("reordered" in item for item in items), items


def test_invalid_utf8_in_a_recorded_string_is_reported_not_a_crash(tmp_path):
    """Found by bench/fuzz.py: a string value holding invalid UTF-8 reached the printed report unescaped."""
    import struct

    from test_gguf_malformed import BASE, patched

    path = tmp_path / "arch.gguf"
    path.write_bytes(patched(BASE, "key 0 value", struct.pack("<Q", 5) + b"l\x80ama"))
    result, report = validate(path, "--structure-only", json_path=tmp_path / "r.json")
    assert result.exit_code == 1 and "Traceback" not in result.output
    items = checks(report)["structure.metadata"]["items"]
    assert "general.architecture: string value is not valid UTF-8" in items
    assert "l\\udc80ama.block_count is missing" in result.stdout


def test_imatrix_and_bootstrap_artifacts_replan_from_their_provenance(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints.get("qwen3_moe")
    recipe = tmp_path / "q2.toml"
    recipe.write_text(Q2_RECIPE)
    imatrix = _imatrix(tmp_path / "imatrix.gguf", src, {"blk.1.ffn_down_exps.weight": [3]}, 1)
    made = convert(src, tmp_path / "a.gguf", str(recipe), "--imatrix", str(imatrix), "--allow-synthetic-imatrix",
                   "--label", "0731")
    result, report = validate(made, "--source", src, "--payload", "full", json_path=tmp_path / "a.json")
    assert result.exit_code == 0, result.output
    assert report["imatrix"] == {"path": str(imatrix), "sha256": sha256_file(imatrix)}
    assert report["recipe"]["from"] == "artifact"

    other = _imatrix(tmp_path / "other.gguf", src, {}, 2)
    result, report = validate(made, "--source", src, "--imatrix", other, json_path=tmp_path / "b.json")
    assert result.exit_code == 1
    assert {"inventory.metadata", "payload.bytes"} <= failed(report)
    assert any(i.startswith("quantkit.imatrix.sha256") for i in checks(report)["inventory.metadata"]["items"])

    os.rename(imatrix, tmp_path / "moved.gguf")
    assert "pass --imatrix" in one_line_error(validate(made, "--source", src)[0])

    boot = convert(src, tmp_path / "b.gguf", str(recipe), "--bootstrap-importance")
    result, report = validate(boot, "--source", src, "--payload", "full", json_path=tmp_path / "c.json")
    assert result.exit_code == 0, result.output


def test_source_from_the_recorded_repository(tiny_checkpoints, tmp_path, monkeypatch):
    """An artifact converted from a Hugging Face repo id re-plans from the local cache with no --source, and a
    changed shard is caught by its recorded SHA-256 under --payload full."""
    src = tiny_checkpoints.get("qwen3_moe")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--quantkit--tiny-qwen"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in src.iterdir():
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    import huggingface_hub.constants as hub_constants
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    made = convert("quantkit/tiny-qwen", tmp_path / "q.gguf", "q8_0")
    result, report = validate(made, "--payload", "full", json_path=tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert report["source"] == {"path": str(snapshot), "repo": "quantkit/tiny-qwen", "revision": commit}
    assert checks(report)["provenance.source"]["detail"].startswith(f"quantkit/tiny-qwen@{commit}: 5 of 5")

    shard = snapshot / "model.safetensors"
    changed = shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1])
    shard.unlink()
    shard.write_bytes(changed)
    result, report = validate(made, "--payload", "full", json_path=tmp_path / "s.json")
    assert result.exit_code == 1 and "provenance.source" in failed(report)
    assert any(i.startswith("model.safetensors: SHA-256") for i in checks(report)["provenance.source"]["items"])


def test_the_json_report_lists_every_check(artifact, tmp_path):
    src, gguf = artifact("qwen4_exp", "qwen3.8-flash-next-q4")
    result, report = validate(gguf, "--source", src, "--seed", "7", json_path=tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert [c["check"] for c in report["checks"]] == [
        "structure.header", "structure.layout", "structure.file_size", "structure.padding", "structure.scales",
        "structure.metadata", "structure.shapes", "structure.provenance", "inventory.tensors", "inventory.metadata",
        "inventory.file_size", "inventory.header", "provenance.source", "payload.bytes", "payload.error"]
    assert report["format"] == "quantkit-validation" and report["seed"] == 7 and report["payload"] == "sample"
    (table,) = [t for t in report["tensors"] if t["name"] == "per_layer_token_embd.weight"]
    assert table["type"] == "BF16" and table["compared"] == "sample"
    assert table["rows"] == sample_rows(table["shape"][0], sample_rng(7, table["name"])).size
    assert table["rel_rmse"] == 0.0 and table["max_abs"] == 0.0     # a byte-exact copy of the BF16 source
    experts = [t for t in report["tensors"] if t["name"].endswith("_exps.weight")]
    assert experts and all(len(t["experts"]) == 3 and t["experts"][0] == 0 for t in experts)


def test_a_sidecar_is_handed_to_the_swapset_validator(tiny_checkpoints, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoints.get("qwen3_moe"), model)
    made = CliRunner().invoke(main, ["swapset", str(model), "--family", "attn", "--format", "fp8-block128"])
    assert made.exit_code == 0, made.output
    (sidecar,) = model.glob("fp8-swapset-*.json")
    result, report = validate(sidecar.with_suffix(".safetensors"), "--payload", "full", json_path=tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert report["kind"] == "sidecar" and {c["check"] for c in report["checks"]} >= {"sidecar.payload",
                                                                                      "sidecar.scales"}
    payload = sidecar.with_suffix(".safetensors")
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    result, report = validate(payload, "--payload", "full", json_path=tmp_path / "s.json")
    assert result.exit_code == 1 and "sidecar.payload" in failed(report)


def test_a_real_process_imports_no_torch(artifact):
    """The validate path (re-plan, re-encode, compare) runs without torch or transformers, in a fresh process."""
    src, gguf = artifact("qwen3_moe")
    code = ("import sys\nfrom quantkit.cli import main\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code, "validate", str(gguf), "--source", str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("valid (sampled: ")
