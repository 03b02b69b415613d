"""``quantkit transport``: parts and manifests, llama.cpp split shards, and assembly under faults.

Hashes are checked with ``hashlib`` on the files themselves; shards are judged by llama.cpp (it loads them and
computes the logits it computes for the unsplit file) and by gguf-py (keys, types, tensor order and bytes).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.errors import CorruptDataError, FormatError, OutOfSpaceError
from quantkit.examples import PRE_TOKENIZER, example_model_dir, example_recipe
from quantkit.transport import assemble as assemble_mod
from quantkit.transport import stream
from quantkit.transport.assemble import JOURNAL_SUFFIX, PARTIAL_SUFFIX, assemble
from quantkit.transport.manifest import load_manifest
from quantkit.transport.sizes import parse_size
from quantkit.transport.split import split_file

ROOT = Path(__file__).resolve().parents[1]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


# -- sizes ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("3MB", 3_000_000), ("49GB", 49 * 10**9), ("1.5GiB", 3 * 2**29), ("512M", 512 * 10**6), ("4G", 4 * 10**9),
    ("100", 100), ("100B", 100), ("2kb", 2000), ("1KiB", 1024), ("2TiB", 2 * 2**40), ("0.5MB", 500_000),
    ("7 MiB", 7 * 2**20),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "3XB", "-1MB", "0", "0.1B", "1e9", "3 M B", "1.5.2GB"])
def test_parse_size_refuses(text):
    with pytest.raises(FormatError):
        parse_size(text)


# -- byte parts -----------------------------------------------------------------------------------------------

@pytest.fixture
def blob(tmp_path) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 1_000_003, dtype=np.uint8).tobytes())
    return path


@pytest.fixture
def byte_parts(blob, tmp_path):
    return split_file(blob, tmp_path / "parts", parse_size("250kB"))


def test_byte_split_manifest_matches_the_files(blob, byte_parts):
    m = load_manifest(byte_parts.path)
    assert m.kind == "bytes" and m.file.sha256 == sha256(blob) and m.file.size == blob.stat().st_size
    assert [p.size for p in m.parts] == [250_000] * 4 + [3]
    joined = b"".join(m.part_path(i).read_bytes() for i in range(len(m.parts)))
    assert joined == blob.read_bytes()
    assert all(sha256(m.part_path(i)) == p.sha256 for i, p in enumerate(m.parts))
    assert not list(m.directory.glob("*.partial"))


def test_byte_assembly_equals_the_original(blob, byte_parts, tmp_path):
    out = tmp_path / "out.bin"
    result = cli("transport", "assemble", byte_parts.path, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == blob.read_bytes()
    assert not out.with_name(out.name + PARTIAL_SUFFIX).exists()
    assert not out.with_name(out.name + JOURNAL_SUFFIX).exists()


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap.tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


# (name, damage to part 2 (index 1) or the set, exit code, words the message must hold)
FAULTS = [
    ("bit flip", lambda m: _flip(m.part_path(1), 77_777), 1, "part 2 of 5 is corrupt"),
    ("truncated", lambda m: _truncate(m.part_path(1)), 1, "part 2 of 5 is truncated"),
    ("reordered", lambda m: _swap(m.part_path(1), m.part_path(2)), 1, "holds the bytes of part 3"),
    ("missing", lambda m: m.part_path(1).unlink(), 2, "part 2 of 5 is missing"),
]


@pytest.mark.parametrize("name, damage, code, words", FAULTS, ids=[f[0] for f in FAULTS])
def test_byte_assembly_refuses_a_bad_part_by_name_and_resumes_once_it_is_fixed(blob, byte_parts, tmp_path, name,
                                                                              damage, code, words):
    m = byte_parts
    keep = tmp_path / "keep"
    shutil.copytree(m.directory, keep)
    damage(m)
    out = tmp_path / "out.bin"
    result = cli("transport", "assemble", m.path, "-o", out, "--no-progress")
    assert result.exit_code == code, result.output
    assert words in result.output and m.parts[1].name in result.output and "Traceback" not in result.output
    assert not out.exists()
    for i in range(len(m.parts)):   # the fix: the parts as they were
        shutil.copyfile(keep / m.parts[i].name, m.part_path(i))
    done = assemble(m.path, out)
    assert out.read_bytes() == blob.read_bytes()
    if name in ("bit flip", "reordered"):   # found while copying: part 1 was verified and journaled before
        assert done.resumed_parts == 1


def test_a_partial_output_that_went_bad_is_copied_again(blob, byte_parts, tmp_path):
    m = byte_parts
    _flip(m.part_path(2), 5)
    out = tmp_path / "out.bin"
    with pytest.raises(CorruptDataError):
        assemble(m.path, out)
    _flip(m.part_path(2), 5)
    _flip(out.with_name(out.name + PARTIAL_SUFFIX), 3)   # part 1's bytes in the partial, already journaled
    done = assemble(m.path, out)
    assert out.read_bytes() == blob.read_bytes()
    assert done.resumed_parts == 1 and len(done.problems_repaired) == 1 and "part 1 of 5" in done.problems_repaired[0]


def _edited_manifest(m, name: str, change) -> Path:
    """A copy of ``m``'s manifest beside its parts, named ``name``, with ``change`` applied to its JSON."""
    raw = json.loads(m.path.read_text())
    change(raw)
    path = m.directory / name
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("change, words", [({"version": True}, "version True"), ({"version": 1.0}, "version 1.0"),
                                           ({"parts": "NESTED"}, "nested too deeply")],
                         ids=["version true", "version 1.0", "deep nesting"])
def test_manifest_json_that_only_looks_right_is_refused_in_one_line(byte_parts, tmp_path, change, words):
    raw = json.loads(byte_parts.path.read_text())
    bad = byte_parts.directory / "bad.transport.json"
    bad.write_text(json.dumps({**raw, **change}).replace('"NESTED"', "[" * 100_000 + "]" * 100_000))
    for args in (["validate", bad], ["transport", "assemble", bad, "-o", tmp_path / "o.bin", "--no-progress"]):
        result = cli(*args)
        assert result.exit_code == 2 and words in result.output and str(bad) in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


def test_manifest_errors_name_the_manifest(byte_parts, tmp_path):
    raw = json.loads(byte_parts.path.read_text())
    for change, words in [({"version": 9}, "version 9"), ({"extra": 1}, "unknown ['extra']"),
                          ({"parts": [{**raw["parts"][0], "name": "../x"}] + raw["parts"][1:]}, "plain file name"),
                          ({"file": {**raw["file"], "size": 5}}, "sum to")]:
        bad = tmp_path / "bad.transport.json"
        bad.write_text(json.dumps({**raw, **change}))
        result = cli("transport", "assemble", bad, "-o", tmp_path / "o.bin")
        assert result.exit_code == 2 and words in result.output and str(bad) in result.output, result.output


# -- full disk ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def small_filesystem(path: Path, size: int):
    """A tmpfs of ``size`` bytes at ``path`` (root only); skips when it cannot be mounted."""
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_preflight_refuses_a_filesystem_too_small(blob, byte_parts, tmp_path, monkeypatch):
    with small_filesystem(tmp_path / "small", 512 * 1024) as mounted:
        if not mounted:   # no tmpfs here: the filesystem reports too little space
            monkeypatch.setattr(assemble_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 4096))
        out = tmp_path / "small" / "out.bin"
        result = cli("transport", "assemble", byte_parts.path, "-o", out)
        assert result.exit_code == 2 and f"needs {blob.stat().st_size:,} bytes free" in result.output, result.output
        assert str(out.parent) in result.output and not out.exists()


def test_a_full_disk_during_assembly_stops_by_name_and_resumes(blob, byte_parts, tmp_path, monkeypatch):
    small = tmp_path / "small"
    with small_filesystem(small, 600 * 1024) as mounted:
        # the preflight is told there is room, so the filesystem itself fills up while copying
        monkeypatch.setattr(assemble_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))
        if not mounted:   # no tmpfs: a write hook fails the way a full filesystem does, from the third part on
            real = stream.pwrite_all

            def full(fd, buf, offset):
                if offset >= 500_000:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                real(fd, buf, offset)
            monkeypatch.setattr(stream, "pwrite_all", full)
        out = small / "out.bin"
        with pytest.raises(OutOfSpaceError) as caught:
            assemble(byte_parts.path, out)
        assert "filesystem full" in str(caught.value) and str(out) in str(caught.value)
        assert not out.exists() and out.with_name(out.name + JOURNAL_SUFFIX).exists()
        monkeypatch.undo()
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)
        done = assemble(byte_parts.path, out)
        assert out.read_bytes() == blob.read_bytes() and done.resumed_parts >= 1


# -- interrupted assembly -------------------------------------------------------------------------------------

#: A child's preamble: chunks of 64 KiB, killed -9 halfway through write number ``argv[3]``.
KILL_AT_WRITE = """
import os, signal, sys
from pathlib import Path
from quantkit.transport import stream
stream.CHUNK_BYTES = 64 * 1024
real, seen, kill_at = stream.pwrite_all, [0], int(sys.argv[3])
def write(fd, buf, offset):
    seen[0] += 1
    if seen[0] == kill_at:
        real(fd, bytes(len(buf) // 2), offset)   # half a chunk written, then gone
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd, buf, offset)
stream.pwrite_all = write
"""
KILLER = KILL_AT_WRITE + """
from quantkit.transport.assemble import assemble
assemble(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assembly_killed_at_a_seeded_point_leaves_no_output_and_resumes(blob, byte_parts, tmp_path, seed):
    writes = -(-blob.stat().st_size // (64 * 1024)) + len(byte_parts.parts)   # chunks, at most one short per part
    kill_at = random.Random(seed).randrange(1, writes - len(byte_parts.parts))
    out = tmp_path / "out.bin"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-c", KILLER, str(byte_parts.path), str(out), str(kill_at)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    assert not out.exists() and out.with_name(out.name + PARTIAL_SUFFIX).exists()
    assemble(byte_parts.path, out)
    assert out.read_bytes() == blob.read_bytes()


# -- llama.cpp split shards -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The bundled example model converted to F16 (a real GGUF llama.cpp runs)."""
    out = tmp_path_factory.mktemp("model") / "tiny-f16.gguf"
    result = CliRunner().invoke(main, ["convert", str(example_model_dir()), "-o", str(out), "--recipe",
                                       str(example_recipe("tiny-moe-f16")), "--pre-tokenizer", PRE_TOKENIZER,
                                       "--no-progress", "-j", "1"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def shards(model, tmp_path):
    result = cli("transport", "split", model, "--part-size", "3MB", "-o", tmp_path / "shards", "--no-progress")
    assert result.exit_code == 0, result.output
    return load_manifest(tmp_path / "shards" / "tiny-f16.gguf.transport.json")


LLAMA_LOGITS = """
import sys, numpy as np, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, flash_attn=False,
                      type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, n_threads=1, verbose=False)
tokens = [5, 17, 99, 120, 33, 7, 64, 200]
llm.eval(tokens)
np.save(sys.argv[2], np.array(llm.scores[:len(tokens)], dtype=np.float32))
"""


def llama_logits(path: Path, out: Path) -> np.ndarray:
    run = subprocess.run([sys.executable, "-c", LLAMA_LOGITS, str(path), str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return np.load(out)


@pytest.mark.interop
def test_llama_cpp_loads_the_shards_and_computes_the_same_logits(model, shards, tmp_path):
    assert [p.name for p in shards.parts] == [f"tiny-f16-{i:05d}-of-00006.gguf" for i in range(1, 7)]
    whole = llama_logits(model, tmp_path / "whole.npy")
    split = llama_logits(shards.part_path(0), tmp_path / "split.npy")
    assert np.isfinite(whole).all() and np.array_equal(whole, split)


def _llama_gguf_split() -> str | None:
    return os.environ.get("LLAMA_GGUF_SPLIT") or shutil.which("llama-gguf-split")


@pytest.mark.interop
@pytest.mark.skipif(_llama_gguf_split() is None, reason="llama.cpp's llama-gguf-split not built: cmake --build "
                    "<llama.cpp build> --target llama-gguf-split, then LLAMA_GGUF_SPLIT=<build>/bin/llama-gguf-split")
@pytest.mark.parametrize("size", ["1M", "3M", "5M"])
def test_shards_are_byte_identical_to_llama_gguf_split(model, tmp_path, size):
    tool = Path(_llama_gguf_split())
    reference = tmp_path / "reference"
    reference.mkdir()
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tool.parent}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}"}
    run = subprocess.run([str(tool), "--split", "--split-max-size", size, str(model), str(reference / "tiny-f16")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = split_file(model, tmp_path / "ours", parse_size(size))
    assert sorted(p.name for p in reference.iterdir()) == [p.name for p in ours.parts]
    for i, part in enumerate(ours.parts):
        assert (reference / part.name).read_bytes() == ours.part_path(i).read_bytes(), part.name


def test_shards_read_by_gguf_py_carry_llama_cpps_split_keys_and_the_tensors_in_order(model, shards):
    original = gguf.GGUFReader(model)
    keys = [f.name for f in original.fields.values() if not f.name.startswith("GGUF.")]
    names, payloads = [], {}
    for i in range(len(shards.parts)):
        shard = gguf.GGUFReader(shards.part_path(i))
        fields = {f.name: f for f in shard.fields.values() if not f.name.startswith("GGUF.")}
        split_keys = ["split.no", "split.tensors.count", "split.count"]   # llama-gguf-split's order
        assert list(fields) == (keys + split_keys if i == 0 else split_keys)
        for key, vtype, value in [("split.no", gguf.GGUFValueType.UINT16, i),
                                  ("split.count", gguf.GGUFValueType.UINT16, 6),
                                  ("split.tensors.count", gguf.GGUFValueType.INT32, len(original.tensors))]:
            assert fields[key].types == [vtype] and fields[key].contents() == value
        assert sum(t.n_bytes for t in shard.tensors) <= 3_000_000 or len(shard.tensors) == 1
        for t in shard.tensors:
            names.append(t.name)
            payloads[t.name] = bytes(t.data.view(np.uint8).reshape(-1))
    assert names == [t.name for t in original.tensors]
    assert all(payloads[t.name] == bytes(t.data.view(np.uint8).reshape(-1)) for t in original.tensors)


@pytest.mark.parametrize("seed", [3, 4])
def test_shard_assembly_killed_at_a_seeded_point_resumes_to_the_original(model, shards, tmp_path, seed):
    chunks = -(-model.stat().st_size // (64 * 1024))
    kill_at = random.Random(seed).randrange(2, chunks)
    out = tmp_path / "merged.gguf"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-c", KILLER, str(shards.path), str(out), str(kill_at)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    assert not out.exists()
    assemble(shards.path, out)
    assert sha256(out) == sha256(model)


def test_merged_shards_equal_the_original_byte_for_byte(model, shards, tmp_path):
    out = tmp_path / "merged.gguf"
    result = cli("transport", "assemble", shards.path, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert sha256(out) == sha256(model) == shards.file.sha256


@pytest.mark.parametrize("fault", ["reordered", "bit flip", "truncated", "missing"])
def test_shard_assembly_refuses_a_bad_shard_by_name(shards, tmp_path, fault):
    second, third = shards.part_path(1), shards.part_path(2)
    assert second.stat().st_size == third.stat().st_size
    {"reordered": lambda: _swap(second, third), "bit flip": lambda: _flip(second, second.stat().st_size - 100),
     "truncated": lambda: _truncate(second), "missing": second.unlink}[fault]()
    out = tmp_path / "merged.gguf"
    result = cli("transport", "assemble", shards.path, "-o", out, "--no-progress")
    assert result.exit_code == (2 if fault == "missing" else 1), result.output
    assert "part 2 of 6" in result.output and second.name in result.output and not out.exists()
    if fault == "reordered":
        assert "reordered" in result.output


# -- validate -------------------------------------------------------------------------------------------------

def test_validate_proves_a_manifest_without_assembling(byte_parts, shards, tmp_path):
    for m in (byte_parts, shards):
        result = cli("validate", m.path)
        assert result.exit_code == 0 and "transport.file_hash" in result.output and m.file.sha256 in result.output, \
            result.output
        # the report carries its evidence record as every other validation does (it was null)
        evidence = json.loads(cli("validate", m.path, "--json").output)["evidence"]
        assert evidence["artifact"]["path"] == str(m.path) and evidence["command"]
    evidence = json.loads(cli("validate", shards.part_path(0), "--json").output)["evidence"]
    assert evidence["artifact"]["path"] == str(shards.part_path(0))
    _flip(shards.part_path(1), 1000)
    shards.part_path(3).unlink()
    result = cli("validate", shards.path)
    assert result.exit_code == 1, result.output
    assert "part 2 of 6 is corrupt" in result.output and "part 4 of 6 is missing" in result.output
    assert not (shards.directory / shards.file.name).exists()


# (name, the fixture whose manifest is edited, the edit): every part keeps its own entry, the file is misdescribed
MISDESCRIBED = [
    ("shards reordered", "shards", lambda raw: raw["parts"].insert(1, raw["parts"].pop(2))),
    ("wrong file size", "shards", lambda raw: raw["file"].update(size=raw["file"]["size"] + 32)),
    ("bytes called shards", "byte_parts", lambda raw: raw.update(kind="gguf-split")),
]


@pytest.mark.parametrize("name, fixture, change", MISDESCRIBED, ids=[c[0] for c in MISDESCRIBED])
def test_validate_fails_parts_that_assemble_refuses(request, tmp_path, name, fixture, change):
    m = request.getfixturevalue(fixture)
    edited = _edited_manifest(m, "edited.transport.json", change)
    assembled = cli("transport", "assemble", edited, "-o", tmp_path / "out", "--no-progress")
    assert assembled.exit_code == 1, assembled.output
    result = cli("validate", edited, "--report", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    checks = {c["check"]: c for c in json.loads((tmp_path / "r.json").read_text())["checks"]}
    assert checks["transport.file_hash"]["status"] == "failed"
    assert assembled.output.strip().removeprefix("error: ") in checks["transport.file_hash"]["detail"]


def test_a_wrong_whole_file_hash_of_byte_parts_is_found_by_validate(blob, byte_parts, tmp_path):
    """Byte parts that each match their hash make the file they describe; assemble does not hash it a second time
    (module doc of quantkit.transport.assemble): a manifest whose file.sha256 was edited is refused by validate."""
    wrong = hashlib.sha256(blob.read_bytes() + b"\0").hexdigest()
    edited = _edited_manifest(byte_parts, "wrong.transport.json", lambda raw: raw["file"].update(sha256=wrong))
    result = cli("validate", edited)
    assert result.exit_code == 1 and wrong in result.output and sha256(blob) in result.output, result.output
    assert cli("transport", "assemble", edited, "-o", tmp_path / "out.bin", "--no-progress").exit_code == 0
    assert sha256(tmp_path / "out.bin") == sha256(blob)


def test_validate_says_how_many_parts_it_hashed(byte_parts, tmp_path):
    byte_parts.part_path(1).unlink()
    result = cli("validate", byte_parts.path, "--report", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    checks = {c["check"]: c for c in json.loads((tmp_path / "r.json").read_text())["checks"]}
    present = len(byte_parts.parts) - 1
    assert checks["transport.part_hashes"]["status"] == "passed"
    assert checks["transport.part_hashes"]["detail"].startswith(f"{present} parts match their SHA-256 (1 of "
                                                                f"{len(byte_parts.parts)} not hashed")
    for i in range(len(byte_parts.parts)):
        byte_parts.part_path(i).unlink(missing_ok=True)
    cli("validate", byte_parts.path, "--report", tmp_path / "r.json", "--force")
    checks = {c["check"]: c for c in json.loads((tmp_path / "r.json").read_text())["checks"]}
    assert checks["transport.part_hashes"]["status"] == "skipped"


def test_validate_checks_a_shard_set_from_any_shard(model, shards):
    result = cli("validate", shards.part_path(2))
    tensors = len(gguf.GGUFReader(model).tensors)
    assert result.exit_code == 0 and f"{tensors} tensors = split.tensors.count" in result.output, result.output
    _swap(shards.part_path(1), shards.part_path(2))
    shards.part_path(5).unlink()
    result = cli("validate", shards.part_path(0))
    assert result.exit_code == 1, result.output
    assert "shard 6 of 6 is missing" in result.output and "split.no = 2" in result.output


def test_a_shard_set_is_structure_only_and_says_so(model, shards, tmp_path):
    """A shard set's verdict never reads as a payload check: it says what it covers, refuses the options that ask
    for a comparison with the source (exit 2, naming them) instead of ignoring them, and a shard name that is
    not there is an input that cannot be used (exit 2), not a failed check."""
    result = cli("validate", shards.part_path(0))
    assert result.exit_code == 0 and "valid (structure only: no shard's bytes compared" in result.output, \
        result.output
    for options in (["--source", str(tmp_path)], ["--payload", "full"]):
        result = cli("validate", shards.part_path(0), *options)
        assert result.exit_code == 2 and f"{options[0]}" in result.output and "merge it" in result.output, \
            result.output
    typo = shards.part_path(0).with_name("typo-00001-of-00002.gguf")
    result = cli("validate", typo)
    assert result.exit_code == 2 and "no such file" in result.output and str(typo) in result.output, result.output


def test_a_second_split_into_the_same_directory_is_refused(blob, tmp_path):
    """Two splits of one name into one directory would share the parts' partial files (each recording its own
    hashes over whatever bytes won): the second is refused while the first holds the manifest's lock."""
    from quantkit.errors import ConcurrentWriteError
    from quantkit.io.atomic import output_lock
    from quantkit.transport.manifest import manifest_name

    out = tmp_path / "parts"
    out.mkdir()
    with output_lock(out / manifest_name(blob.name)):
        with pytest.raises(ConcurrentWriteError):
            split_file(blob, out, parse_size("250kB"))
    assert not [p for p in out.iterdir() if not p.name.endswith(".lock")]
    assert split_file(blob, out, parse_size("250kB")).file.size == blob.stat().st_size


def test_split_force_removes_only_the_parts_the_replaced_manifest_recorded(blob, byte_parts):
    """A --force split with another part count would leave the old set's extra parts beside the new ones."""
    out = byte_parts.directory
    unrecorded = [out / "notes.txt", out / f"{blob.name}.part-00009-of-00009"]
    for path in unrecorded:
        path.write_bytes(b"not a part of the split")
    m = split_file(blob, out, parse_size("400kB"), force=True)
    assert len(m.parts) != len(byte_parts.parts)
    left = {p.name for p in out.iterdir() if not p.name.endswith(".lock")}
    assert left == {p.name for p in m.parts} | {m.path.name} | {p.name for p in unrecorded}


def test_split_force_never_removes_its_source(blob, tmp_path):
    """A replaced manifest that lists the source itself as a part (edited by hand) does not get it deleted."""
    old = split_file(blob, tmp_path, parse_size("250kB"))
    _edited_manifest(old, old.path.name, lambda raw: (raw["file"].update(name="other.bin"),
                                                      raw["parts"][0].update(name=blob.name)))
    before = sha256(blob)
    split_file(blob, tmp_path, parse_size("400kB"), force=True)
    assert blob.is_file() and sha256(blob) == before


# -- background sync ------------------------------------------------------------------------------------------

def _failing_sync(monkeypatch, fail_calls: set[int]):
    """Make the syncer's ``fdatasync`` fail with EIO on the calls numbered in ``fail_calls`` (from 1)."""
    real, calls = stream.sync_data, [0]

    def sync(fd):
        calls[0] += 1
        if calls[0] in fail_calls:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)
    monkeypatch.setattr(stream, "sync_data", sync)
    return calls


def test_a_failed_background_sync_of_a_split_part_names_it_and_writes_no_manifest(blob, tmp_path, monkeypatch):
    calls = _failing_sync(monkeypatch, {2})   # parts of 250 kB are never synced early: call 2 commits part 2
    out = tmp_path / "parts"
    result = cli("transport", "split", blob, "--part-size", "250kB", "-o", out, "--no-progress")
    assert result.exit_code == 2 and calls[0] >= 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "part 2 of 5" in lines[0] and "model.bin.part-00002-of-00005" in lines[0], lines
    assert "Input/output error" in lines[0] and "Traceback" not in result.output
    left = sorted(p.name for p in out.iterdir())
    assert not [n for n in left if n.endswith((".partial", ".transport.json", ".lock"))], left
    assert "model.bin.part-00002-of-00005" not in left   # the part whose sync failed never gets its name


def test_a_failed_background_sync_during_assembly_names_the_part_and_resumes(blob, byte_parts, tmp_path,
                                                                          monkeypatch):
    _failing_sync(monkeypatch, {2})   # call 2 makes part 2 durable before it is journaled
    out = tmp_path / "out.bin"
    result = cli("transport", "assemble", byte_parts.path, "-o", out, "--no-progress")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "part 2 of 5" in lines[0] and "Input/output error" in lines[0], lines
    partial, journal = out.with_name(out.name + PARTIAL_SUFFIX), out.with_name(out.name + JOURNAL_SUFFIX)
    assert not out.exists() and partial.exists() and str(partial) in lines[0]
    assert json.loads(journal.read_text())["done"] == [0]   # nothing behind the part whose sync failed
    monkeypatch.undo()
    done = assemble(byte_parts.path, out)
    assert out.read_bytes() == blob.read_bytes() and done.resumed_parts == 1


@pytest.mark.parametrize("command", ["split", "assemble"])
def test_a_failed_early_writeback_is_not_lost(blob, byte_parts, tmp_path, monkeypatch, command):
    """Linux reports a writeback error to one fsync only: the early sync's failure must fail the part, even though
    the sync that commits it would succeed."""
    monkeypatch.setattr(stream, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(stream, "WRITEBACK_BYTES", 64 * 1024)
    calls = _failing_sync(monkeypatch, {1})   # the first early sync, of part 1; every later call succeeds
    out = tmp_path / "again"
    if command == "split":
        result = cli("transport", "split", blob, "--part-size", "250kB", "-o", out, "--no-progress")
    else:
        result = cli("transport", "assemble", byte_parts.path, "-o", out, "--no-progress")
    assert result.exit_code == 2 and calls[0] >= 1, result.output
    assert "part 1 of 5" in result.output and "Input/output error" in result.output, result.output
    assert not out.exists() or not any(out.glob("*.transport.json"))


def test_outputs_are_written_back_while_the_copy_goes_on(blob, byte_parts, tmp_path, monkeypatch):
    """With early writeback every 64 KiB, the syncer syncs an output before the commit's own sync (the first
    write queues one; how many more depends on how fast the disk is)."""
    monkeypatch.setattr(stream, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(stream, "WRITEBACK_BYTES", 64 * 1024)
    calls = _failing_sync(monkeypatch, set())
    split_file(blob, tmp_path / "again", parse_size("250kB"))
    assert calls[0] > len(byte_parts.parts)   # a commit per part, and early syncs besides
    calls[0] = 0
    out = tmp_path / "out.bin"
    assemble(byte_parts.path, out)
    assert out.read_bytes() == blob.read_bytes() and calls[0] > len(byte_parts.parts)   # a journal entry per part


def test_a_source_that_shrinks_while_it_is_split_is_refused_by_name(blob, tmp_path, monkeypatch):
    real, seen = stream.pwrite_all, [0]

    def write_then_truncate(fd, buf, offset):   # another process cuts the source after the first chunk
        real(fd, buf, offset)
        seen[0] += 1
        if seen[0] == 1:
            os.truncate(blob, 100_000)
    monkeypatch.setattr(stream, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(stream, "pwrite_all", write_then_truncate)
    out = tmp_path / "parts"
    result = cli("transport", "split", blob, "--part-size", "250kB", "-o", out, "--no-progress")
    assert result.exit_code == 2 and str(blob) in result.output and "shrank to 100000" in result.output, \
        result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not [p for p in out.iterdir() if not p.name.endswith(".lock")]


SPLIT_KILLER = KILL_AT_WRITE + """
from quantkit.transport.split import split_file
stream.WRITEBACK_BYTES = 64 * 1024
split_file(Path(sys.argv[1]), Path(sys.argv[2]), 250_000)
"""


@pytest.mark.parametrize("seed", [5, 6])
def test_split_killed_at_a_seeded_point_leaves_only_complete_parts_and_no_manifest(blob, byte_parts, tmp_path, seed):
    """Parts are committed in the background while the next is copied: whatever carries a part's name when the
    process dies is that part, complete."""
    writes = -(-blob.stat().st_size // (64 * 1024)) + len(byte_parts.parts)
    kill_at = random.Random(seed).randrange(1, writes - len(byte_parts.parts))
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-c", SPLIT_KILLER, str(blob), str(out), str(kill_at)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    assert not list(out.glob("*.transport.json"))
    named = {p.name for p in byte_parts.parts} & {p.name for p in out.iterdir()}
    for i, part in enumerate(byte_parts.parts):
        if part.name in named:
            assert sha256(out / part.name) == part.sha256, part.name
    assert split_file(blob, out, parse_size("250kB"), force=True).file.sha256 == byte_parts.file.sha256


def test_a_split_its_readers_would_refuse_is_refused_before_any_part(blob, tmp_path, monkeypatch):
    """More byte parts than a transport manifest may list (assemble and validate refuse such a manifest): exit 2
    naming the part size, with nothing written."""
    from quantkit.transport import manifest, split

    monkeypatch.setattr(split, "MAX_PARTS", 4)
    out = tmp_path / "parts"
    result = cli("transport", "split", blob, "--bytes", "--part-size", "100kB", "-o", out, "--no-progress")
    assert result.exit_code == 2 and "--part-size gives" in result.output and "(4)" in result.output, result.output
    assert not out.exists() or not list(out.iterdir())
    assert manifest.MAX_PARTS == 1 << 20


def test_a_shard_is_not_run_as_a_whole_model(shards, tmp_path):
    """generate and score on one shard of a split file said the config did not match the tensors (the first
    shard) or that there was no architecture (the others): they name the shard and say to merge first (exit 3)."""
    from quantkit.examples import example_fixture_dir

    for i in (0, 1):
        shard = shards.part_path(i)
        for args in (["generate", shard, "--prompt", "x", "-n", "1", "--rendering", "raw"],
                     ["score", shard, example_fixture_dir(), "-o", tmp_path / "s.tsv", "--ctx", "64"]):
            result = cli(*args)
            assert result.exit_code == 3 and f"shard {i + 1} of 6" in result.output and "merge them first" in \
                result.output, result.output


def test_parts_waiting_for_their_sync_are_bounded(blob, tmp_path, monkeypatch):
    """Tiny parts outran their syncs and each kept its descriptor open: ~35,000 parts ran out of them ("Too many
    open files"), leaving parts behind.  The copying waits once MAX_UNCOMMITTED_PARTS are pending."""
    import time as time_module

    from quantkit.transport import split

    monkeypatch.setattr(split, "MAX_UNCOMMITTED_PARTS", 3)
    slow, create, most = split._Parts._commit, split._Parts.create, []

    def slow_commit(self, *args):
        time_module.sleep(0.02)      # a slow disk: the syncs fall behind the copying
        slow(self, *args)

    def counting_create(self, name):
        most.append(len(self._fds))
        return create(self, name)
    monkeypatch.setattr(split._Parts, "_commit", slow_commit)
    monkeypatch.setattr(split._Parts, "create", counting_create)
    out = tmp_path / "parts"
    result = cli("transport", "split", blob, "--bytes", "--part-size", "50kB", "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert len(most) == 21 and max(most) <= 4
