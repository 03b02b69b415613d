"""DeepSeek V4.1 Engram tables: the hash spec, the native row store, and the Engram audit of ``validate``.

References: the bucket rule is checked against the row counts the V4.1 release config publishes
(``engram_num_embeddings`` [384006168, 384016682] for ``engram_vocab_size`` 16000000, 3 orders x 8 heads); the row
store's bytes against the source safetensors bytes read here with a header parser of the test's own; the file's
readability against gguf-py's reader.  Corruptions are byte edits of a converted file at offsets read back with
gguf-py.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.engram import EngramSpec, bucket_primes, compressed_token_map, hash_multipliers, is_prime
from quantkit.errors import UnsupportedError
from quantkit.testing.recipe_texts import PRE_TOKENIZER as PRE
from quantkit.testing.tiny_v41 import write_v41_checkpoint
from quantkit.validate.payload import sample_rng, sample_rows

RECIPE = "deepseek-v4.1-flash-q2"
TABLE = "blk.1.engram_embd.weight"
ROW = 264


def convert(src: Path, out: Path, recipe: str = RECIPE) -> Path:
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--recipe", recipe, "--no-progress",
                                       "-j", "1", "--pre-tokenizer", PRE, "--bootstrap-importance"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(source, GGUF): a tiny V4.1 release converted once with the release recipe."""
    root = tmp_path_factory.mktemp("engram")
    src = write_v41_checkpoint(root / "v41", rows_per_layer=3000)
    return src, convert(src, root / "v41.gguf")


def validate(gguf: Path, src: Path, payload: str, json_path: Path):
    result = CliRunner().invoke(main, ["validate", str(gguf), "--source", str(src), "--payload", payload,
                                       "--report", str(json_path), "--force"])
    return result, json.loads(json_path.read_text()) if json_path.exists() else None


def failed(report: dict) -> dict[str, dict]:
    return {c["check"]: c for c in report["checks"] if c["status"] == "failed"}


def source_bytes(src: Path, name: str) -> np.ndarray:
    """A tensor's stored bytes, located by parsing the safetensors header here (8-byte length, JSON)."""
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    path = src / index[name]
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + n + begin)
        return np.frombuffer(f.read(end - begin), np.uint8).reshape(entry["shape"][0], -1)


def table_offset(gguf: Path, name: str = TABLE) -> tuple[int, int]:
    """(absolute file offset, rows) of a row store, read with gguf-py."""
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(gguf).tensors if t.name == name)
    return int(t.data_offset), int(t.shape[1])


def edited(gguf: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "edited.gguf"
    shutil.copyfile(gguf, out)
    data = np.memmap(out, dtype=np.uint8, mode="r+")
    edit(data)
    data.flush()
    del data
    return out


# -- the hash spec -------------------------------------------------------------------------------------------------

def test_bucket_primes_give_the_published_v41_row_counts():
    primes = bucket_primes(2, 4, 8, 16_000_000)
    assert [int(s) for s in primes.sum(axis=1)] == [384_006_168, 384_016_682]
    assert all(is_prime(int(p)) for p in primes.reshape(-1)) and len(set(primes.reshape(-1).tolist())) == 48
    assert list(primes.reshape(-1)) == sorted(primes.reshape(-1))


def test_is_prime_agrees_with_a_sieve():
    n = 20_000
    sieve = np.ones(n, bool)
    sieve[:2] = False
    for p in range(2, int(n ** 0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = False
    assert [is_prime(i) for i in range(n)] == sieve.tolist()


def test_multipliers_are_odd_and_seeded_by_layer():
    m = hash_multipliers([1, 14], 4, 99_092)
    assert m.shape == (2, 4) and (m % 2 == 1).all() and (m > 0).all()
    assert (m == hash_multipliers([1, 14], 4, 99_092)).all()
    assert (m[0] == hash_multipliers([1], 4, 99_092)[0]).all()


def test_token_map_merges_case_and_spacing(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {"a": 0, "A": 1, "Ä": 2, " ": 3, "  ": 4, "b": 5}
    Tokenizer(models.WordLevel(vocab, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    assert compressed_token_map(tmp_path / "tokenizer.json").tolist() == [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("field, value, message", [
    ("engram_num_embeddings", "+1", "hash buckets sum to"),
    ("engram_compressed_vocab_size", "+1", "distinct compressed ids"),
    ("engram_head_dim", 100, "multiple of 32"),
    ("engram_layer_ids", [7], "Engram layers must be block indices"),
])
def test_an_inconsistent_engram_config_is_refused_before_writing(release, tmp_path, field, value, message):
    src = tmp_path / "src"
    shutil.copytree(release[0], src)
    config = json.loads((src / "config.json").read_text())
    text = config["text_config"]
    text[field] = ([v + 1 for v in text[field]] if isinstance(text[field], list) else text[field] + 1) \
        if value == "+1" else value
    (src / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "x.gguf"), "--recipe", RECIPE,
                                       "--pre-tokenizer", PRE, "--bootstrap-importance", "--no-progress"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x.gguf").exists()


# -- the row store ---------------------------------------------------------------------------------------------------

def test_word_and_byte_packers_agree_and_find_the_first_invalid_row():
    from quantkit.engram.rows import _interleave_checked, _interleave_checked_words

    rng = np.random.default_rng(7)
    for case in range(300):
        n = int(rng.integers(1, 40))
        codes = rng.integers(0, 256, (n, 256), dtype=np.uint8)
        scales = rng.integers(0, 256, (n, 8), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1
        scales[scales == 0xFF] = 0
        bad = sorted(set(rng.integers(0, n, int(rng.integers(0, 3))).tolist()))
        for r in bad:
            if rng.integers(0, 2):
                codes[r, rng.integers(0, 256)] = rng.choice([0x7F, 0xFF])
            else:
                scales[r, rng.integers(0, 8)] = 0xFF
        by_bytes, by_words = np.empty((n, ROW), np.uint8), np.empty((n, ROW), np.uint8)
        first = _interleave_checked(codes, scales, by_bytes)
        assert first == _interleave_checked_words(codes.view(np.uint64), scales.view(np.uint64),
                                                  by_words.view(np.uint64)), case
        assert first == (bad[0] if bad else -1), case
        assert np.array_equal(by_bytes, np.concatenate([codes, scales], axis=1))
        assert np.array_equal(by_words, by_bytes)


def test_release_recipe_writes_native_rows_byte_exact(release):
    from gguf import GGUFReader

    src, gguf = release
    reader = GGUFReader(gguf)
    tensors = {t.name: t for t in reader.tensors}
    config = json.loads((src / "config.json").read_text())["text_config"]
    for layer, rows in zip(config["engram_layer_ids"], config["engram_num_embeddings"]):
        t = tensors[f"blk.{layer}.engram_embd.weight"]
        assert t.tensor_type.name == "I8" and [int(d) for d in t.shape] == [ROW, rows]
        codes = source_bytes(src, f"layers.{layer}.engram.embed.weight")
        scales = source_bytes(src, f"layers.{layer}.engram.embed.scale")
        stored = np.asarray(t.data).view(np.uint8).reshape(rows, ROW)
        assert np.array_equal(stored, np.concatenate([codes, scales], axis=1))
    # the rest of the release recipe
    types = {n: t.tensor_type.name for n, t in tensors.items()}
    assert types["blk.1.ffn_gate_exps.weight"] == "IQ2_XXS" and types["blk.1.ffn_down_exps.weight"] == "Q2_K"
    assert types["blk.1.attn_q_a.weight"] == "Q8_0" and types["output.weight"] == "Q8_0"
    assert types["blk.1.ffn_gate_shexp.weight"] == "Q8_0"


def test_hash_spec_in_metadata_matches_the_config_and_tokenizer(release):
    from gguf import GGUFReader

    src, gguf = release
    reader = GGUFReader(gguf)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    spec = EngramSpec.from_gguf(fields, "deepseek41")
    config = json.loads((src / "config.json").read_text())["text_config"]
    assert list(spec.layer_ids) == config["engram_layer_ids"] and list(spec.rows) == config["engram_num_embeddings"]
    assert spec.pad_id == config["engram_pad_token_id"]
    assert spec.compressed_vocab_size == config["engram_compressed_vocab_size"]
    assert np.array_equal(spec.token_map, compressed_token_map(src / "tokenizer.json"))
    assert [int(s) for s in spec.primes.sum(axis=1)] == config["engram_num_embeddings"]
    assert spec.problems() == []


def test_a_nan_row_in_the_source_is_refused_naming_it(release, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(release[0], src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    path = src / index["layers.2.engram.embed.scale"]
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin = json.loads(f.read(n))["layers.2.engram.embed.scale"]["data_offsets"][0]
        f.seek(8 + n + begin + 77 * 8 + 3)
        f.write(b"\xff")
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "x.gguf"), "--recipe", RECIPE,
                                       "--pre-tokenizer", PRE, "--bootstrap-importance", "--no-progress", "-j", "1"])
    assert result.exit_code == 2, result.output
    assert "layers.2.engram.embed.weight" in result.output and "row 77: E8M0 NaN scale" in result.output
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("qtype, worst", [("Q8_0", 2 ** -5), ("MXFP4", 0.25)])
def test_lossy_row_re_encodes_are_an_explicit_choice_with_error_statistics(release, tmp_path, qtype, worst):
    src, _ = release
    recipe = tmp_path / "lossy-engram.toml"
    recipe.write_text(f'name = "lossy-engram"\narchitectures = ["deepseek_v41"]\n[defaults]\ntype = "Q8_0"\n'
                      f'[[rule]]\nclass = "engram"\ntype = "{qtype}"\n')
    gguf = convert(src, tmp_path / "lossy.gguf", str(recipe))
    result, report = validate(gguf, src, "full", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    table = next(t for t in report["tensors"] if t["name"] == TABLE)
    assert table["type"] == qtype and table["error_ok"] and 0 < table["rel_rmse"] < worst


# -- the audit -------------------------------------------------------------------------------------------------------

def test_validate_full_and_sample_pass_and_sample_reads_only_sampled_rows(release, tmp_path):
    src, gguf = release
    result, full = validate(gguf, src, "full", tmp_path / "full.json")
    assert result.exit_code == 0, result.output
    assert "engram.spec" in {c["check"] for c in full["checks"]}
    result, sample = validate(gguf, src, "sample", tmp_path / "sample.json")
    assert result.exit_code == 0, result.output
    _, rows = table_offset(gguf)
    table = next(t for t in sample["tensors"] if t["name"] == TABLE)
    expected = sample_rows(rows, sample_rng(0, TABLE))
    assert table["compared"] == "sample" and table["rows"] == expected.size
    assert {0, 1, rows - 1, 1023, 1024, 2047, 2048} <= set(expected.tolist())
    assert sample["io"]["artifact_bytes_read"] < full["io"]["artifact_bytes_read"]


def swap_rows(a: int, b: int):
    def edit(data, gguf_offset):
        ra, rb = data[gguf_offset + a * ROW:gguf_offset + (a + 1) * ROW].copy(), \
            data[gguf_offset + b * ROW:gguf_offset + (b + 1) * ROW].copy()
        data[gguf_offset + a * ROW:gguf_offset + (a + 1) * ROW] = rb
        data[gguf_offset + b * ROW:gguf_offset + (b + 1) * ROW] = ra
    return edit


def copy_row(frm: int, to: int):
    def edit(data, gguf_offset):
        data[gguf_offset + to * ROW:gguf_offset + (to + 1) * ROW] = \
            data[gguf_offset + frm * ROW:gguf_offset + (frm + 1) * ROW].copy()
    return edit


def set_byte(row: int, col: int, value: int):
    def edit(data, gguf_offset):
        data[gguf_offset + row * ROW + col] = value
    return edit


# rows 7/8, 15/16, 511/512 are power-of-two boundaries: sample mode reads them whatever the seed
CORRUPTIONS = {
    "reordered": (swap_rows(7, 8), "payload.bytes", "row 7, block 0", "holds source row 8"),
    "duplicated": (copy_row(15, 16), "payload.bytes", "row 16, block 0", "holds source row 15"),
    "nan-code": (set_byte(511, 5, 0x7F), "structure.scales", "row 511: E4M3 NaN code 0x7F at value 5", None),
    "nan-code-negative": (set_byte(512, 200, 0xFF), "structure.scales", "row 512: E4M3 NaN code 0xFF", None),
    "nan-scale": (set_byte(1, 256 + 7, 0xFF), "structure.scales", "row 1: E8M0 NaN scale 0xFF at scale 7", None),
}


@pytest.mark.parametrize("mode", ["full", "sample"])
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_each_corruption_is_exit_1_naming_table_and_row(release, tmp_path, case, mode):
    src, gguf = release
    edit, check, where, note = CORRUPTIONS[case]
    offset, _ = table_offset(gguf)
    bad = edited(gguf, tmp_path, lambda data: edit(data, offset))
    result, report = validate(bad, src, mode, tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    problems = failed(report)
    assert check in problems, report["checks"]
    text = " ".join(problems[check]["items"])
    assert TABLE in text and where in text, text
    if note:
        assert note in text, text


def find_key_data(gguf: Path, key: str) -> int:
    """Offset of the first element of array ``key`` (after the key string, value type, item type and count)."""
    raw = gguf.read_bytes()
    at = raw.index(key.encode()) + len(key)
    return at + 4 + 4 + 8


@pytest.mark.parametrize("key, fmt, delta, message", [
    ("deepseek41.engram.row_counts", "<Q", 5, "truncated"),                # the table lacks the last 5 rows
    ("deepseek41.engram.primes", "<I", 2, "hash buckets address"),           # buckets no longer sum to the table
    ("deepseek41.engram.multipliers", "<q", 2, "hash multipliers are not"),
])
def test_a_hash_spec_inconsistent_with_the_table_is_exit_1_naming_it(release, tmp_path, key, fmt, delta, message):
    src, gguf = release
    at = find_key_data(gguf, key)
    size = struct.calcsize(fmt)

    def edit(data):
        (value,) = struct.unpack(fmt, bytes(data[at:at + size]))
        data[at:at + size] = np.frombuffer(struct.pack(fmt, value + delta), np.uint8)
    bad = edited(gguf, tmp_path, edit)
    result = CliRunner().invoke(main, ["validate", str(bad), "--structure-only", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 1, result.output
    spec = failed(json.loads((tmp_path / "r.json").read_text()))["engram.spec"]
    text = " ".join(spec["items"])
    assert message in text, text
    if key != "deepseek41.engram.multipliers":
        assert TABLE in text


def test_a_truncated_table_file_is_refused_naming_the_table(release, tmp_path):
    src, gguf = release
    offset, rows = table_offset(gguf, "blk.2.engram_embd.weight")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(gguf.read_bytes()[:offset + (rows // 2) * ROW])
    result = CliRunner().invoke(main, ["validate", str(bad), "--source", str(src)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert "blk.2.engram_embd.weight" in result.output


# -- runtime -----------------------------------------------------------------------------------------------------

def test_scoring_v41_is_refused_with_what_it_needs(release):
    from quantkit.runtime.loader import load_model

    with pytest.raises(UnsupportedError, match="scoring deepseek_v41 needs a DeepSeek V4.1 forward pass"):
        load_model(release[1])


# -- fuzz: the Engram reader ------------------------------------------------------------------------------------

def engram_regions(gguf: Path) -> tuple[tuple[int, int], tuple[int, int]]:
    """(spec metadata byte range, table payload byte range) of the converted file."""
    raw = gguf.read_bytes()
    spec_start = raw.index(b"deepseek41.engram.")
    token_map = raw.index(b"deepseek41.engram.token_map") + len("deepseek41.engram.token_map") + 4 + 4
    (count,) = struct.unpack("<Q", raw[token_map:token_map + 8])
    offset, rows = table_offset(gguf)
    return (spec_start, token_map + 8 + 4 * count), (offset, offset + rows * ROW)


def engram_mutations(regions, rows: int):
    """(kind, edits, cut): byte edits inside the spec keys (ids, counts, primes, token map) or the table, two rows
    swapped (reordered), or the file cut inside the table (truncated)."""
    from hypothesis import strategies as st

    (s0, s1), (t0, t1) = regions
    edits = lambda lo, hi: st.lists(st.tuples(st.integers(lo, hi - 1), st.integers(0, 255)), min_size=1, max_size=4)
    return st.one_of(
        st.tuples(st.just("spec"), edits(s0, s1), st.just(None)),
        st.tuples(st.just("table"), edits(t0, t1), st.just(None)),
        st.tuples(st.just("reorder"), st.tuples(st.integers(0, rows - 1), st.integers(0, rows - 1)), st.just(None)),
        st.tuples(st.just("truncate"), st.just([]), st.integers(t0, t1 - 1)),
    )


def test_fuzzed_engram_files_are_refused_cleanly_with_bounded_memory(release, tmp_path):
    from hypothesis import given, settings
    from test_validate_fuzz import FUZZ, assert_clean, invoke

    src, gguf = release
    original = gguf.read_bytes()
    regions = engram_regions(gguf)
    offset, rows = table_offset(gguf)

    @settings(max_examples=10, **FUZZ)
    @given(case=engram_mutations(regions, rows))
    def run(case):
        kind, change, cut = case
        data = bytearray(original)
        if kind == "reorder":
            a, b = (offset + r * ROW for r in change)
            data[a:a + ROW], data[b:b + ROW] = original[b:b + ROW], original[a:a + ROW]
        else:
            for at, byte in change:
                data[at] = byte
        data = bytes(data[:cut])
        path = tmp_path / "fuzzed.gguf"
        path.write_bytes(data)
        for mode in ("full", "sample"):
            result, peak = invoke("validate", str(path), "--source", str(src), "--payload", mode)
            assert_clean(result, peak, (0, 1, 2))
            if mode == "full":   # every byte compared: any change is found, an unchanged file passes
                assert (result.exit_code == 0) == (data == original), (kind, result.output)
    run()


# -- inspect and the dry-run plan -----------------------------------------------------------------------------------

def test_inspect_and_dry_run_show_the_tables_as_disk_only(release):
    from gguf import GGUFReader

    src, gguf = release
    result = CliRunner().invoke(main, ["inspect", str(gguf), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    tables = report["row_tables"]
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    assert [t["name"] for t in tables["tables"]] == ["blk.1.engram_embd.weight", "blk.2.engram_embd.weight"]
    assert tables["bytes"] == sizes["blk.1.engram_embd.weight"] + sizes["blk.2.engram_embd.weight"]
    assert tables["resident_bytes"] == sum(sizes.values()) - tables["bytes"]
    config = json.loads((src / "config.json").read_text())["text_config"]
    assert tables["hash_spec"]["rows"] == config["engram_num_embeddings"]
    text = CliRunner().invoke(main, ["inspect", str(gguf)]).output
    assert "disk-only row tables (2 tensors" in text and "hash spec: layers [1, 2]" in text

    dry = CliRunner().invoke(main, ["convert", str(src), "-o", "unused.gguf", "--recipe", RECIPE, "--dry-run",
                                    "--pre-tokenizer", PRE, "--bootstrap-importance"])
    assert dry.exit_code == 0, dry.output
    line = next(x for x in dry.output.splitlines() if x.startswith("disk-only"))
    assert "2 row tables (engram)" in line and "resident weights" in line


def test_an_engram_re_encode_needing_importance_is_refused_at_plan_time(release, tmp_path):
    recipe = tmp_path / "q4k-engram.toml"
    recipe.write_text('name = "q4k-engram"\narchitectures = ["deepseek_v41"]\n[defaults]\ntype = "Q8_0"\n'
                      '[[rule]]\nclass = "engram"\ntype = "Q4_K"\n')
    result = CliRunner().invoke(main, ["convert", str(release[0]), "-o", str(tmp_path / "x.gguf"), "--recipe",
                                       str(recipe), "--pre-tokenizer", PRE, "--bootstrap-importance", "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "blk.1.engram_embd.weight" in result.output and "ignores importance" in result.output
