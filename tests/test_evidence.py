"""Evidence records: tool versions, device, dtype, threads, the artifact's SHA-256 (checked against hashlib) and
size, the fixture and the command line, in score tables and validation reports; hash reuse and its limits."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit import __version__, evidence as ev
from quantkit.cli import main
from quantkit.io.atomic import sha256_file
from quantkit.scoring.table import read_table, sidecar_path


@pytest.fixture(autouse=True)
def hash_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hash-cache"
    monkeypatch.setenv(ev.CACHE_ENV, str(cache))
    return cache


def _file(path, data):
    path.write_bytes(data)
    return path


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_record_fields(tmp_path):
    art = _file(tmp_path / "model.gguf", os.urandom(100_003))
    fixture = {"content_sha256": "ab" * 32, "label": "0731", "cases": 2, "path": "fx"}
    record = ev.evidence(artifact=art, fixture=fixture, device="cpu", dtype="float32", command=["quantkit", "x"])
    assert record["format"] == ev.EVIDENCE_FORMAT and record["version"] == ev.EVIDENCE_VERSION
    tools = record["tools"]
    assert tools["quantkit"] == __version__ and tools["numpy"] == np.__version__
    for name in ev.LOADED_ONLY:          # recorded exactly when the process has the module
        assert (name in tools) == (name in sys.modules)
        if name in tools:
            assert tools[name] == sys.modules[name].__version__
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    assert isinstance(record["threads"], int) and record["threads"] >= 1
    assert record["artifact"] == {"path": str(art), "kind": "file", "size": 100_003, "sha256": _sha(art),
                                  "sha256_from": "computed"}
    assert record["fixture"] == fixture and record["command"] == ["quantkit", "x"]
    assert ev.evidence(threads=3)["threads"] == 3 and ev.evidence()["command"] == sys.argv
    json.dumps(record)      # JSON-ready


def test_streaming_hash_in_chunks_with_progress(tmp_path, monkeypatch, capsys):
    art = _file(tmp_path / "big.bin", os.urandom(70_001))
    seen = []
    assert sha256_file(art, chunk=4096, progress=seen.append) == _sha(art)
    assert sum(seen) == 70_001 and max(seen) == 4096
    monkeypatch.setattr(ev, "PROGRESS_MIN_BYTES", 1)
    assert ev.artifact_sha256(art, reuse=False) == (_sha(art), "computed")
    assert "sha256 big.bin" in capsys.readouterr().err


def test_recorded_sidecar_hash_is_reused_only_when_it_applies(tmp_path):
    art = _file(tmp_path / "model.gguf", b"payload" * 1000)
    recorded = "0f" * 32          # deliberately not the file's hash: proves the file was not read
    sidecar = tmp_path / "model.gguf.sha256"
    sidecar.write_text(f"{recorded}  model.gguf\n")
    assert ev.artifact_sha256(art) == (recorded, "model.gguf.sha256")
    assert ev.artifact_sha256(art, reuse=False) == (_sha(art), "computed")
    st = art.stat()
    os.utime(sidecar, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))      # older than the file: may be stale
    assert ev.artifact_sha256(art)[0] == _sha(art)
    sidecar.write_text(f"{recorded}  other.gguf\n")                      # names another file
    assert ev.artifact_sha256(art)[0] == _sha(art)


def test_hash_cache_is_keyed_by_file_state(tmp_path, hash_cache):
    art = _file(tmp_path / "a.bin", b"x" * 5000)
    assert ev.artifact_sha256(art) == (_sha(art), "computed")
    assert ev.artifact_sha256(art) == (_sha(art), "cache") and len(list(hash_cache.iterdir())) == 1
    art.write_bytes(b"y" * 5000)                                         # same size, new content and mtime
    st = art.stat()
    os.utime(art, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert ev.artifact_sha256(art) == (_sha(art), "computed")
    (entry,) = hash_cache.iterdir()
    entry.write_text("{not json")                                        # a damaged entry is ignored
    assert ev.artifact_sha256(art) == (_sha(art), "computed")


def test_directory_artifact_records_its_digest(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    _file(d / "model.safetensors", b"z" * 300)
    _file(d / "config.json", b"{}")
    record = ev.evidence(artifact=d, source_digest="cd" * 32)
    assert record["artifact"] == {"path": str(d), "kind": "directory", "size": 302, "sha256": None,
                                  "source_digest": "cd" * 32}


# -- score tables ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def codec():
    from quantkit.fixtures.tokens import TextCodec
    from quantkit.testing.tiny_models import build_tiny_tokenizer

    return TextCodec(build_tiny_tokenizer("qwen3_moe"))


class _Source:
    """Logits depending on the last token only, from a model 'file' whose hash the table must record."""

    device, dtype = "cpu", "float32"

    def __init__(self, path):
        from quantkit.scoring.source import ModelIdentity

        self._identity = ModelIdentity(label="0731", source="s" * 64, path=str(path))
        self.table = np.random.default_rng(0).normal(size=(512, 512)).astype(np.float32)

    def identity(self):
        return self._identity

    def logits(self, token_ids):
        return self.table[np.asarray(token_ids) % 512]


@pytest.mark.parametrize("layout", ["quantkit", "ds4"])
def test_score_table_records_evidence(tmp_path, codec, layout):
    from quantkit.fixtures.directory import Case
    from quantkit.fixtures.tokens import Rendering
    from quantkit.fixtures.directory import write_fixture
    from quantkit.scoring.score import plan_scoring, run_scoring
    from quantkit.scoring.source import ModelIdentity

    fx = write_fixture(tmp_path / "fx", [Case("case_0", "def f(x):", " return x", None)], label="0731",
                       source=ModelIdentity(source="s" * 64), rendering=Rendering("raw"), capture=None)
    art = _file(tmp_path / "m-0731.gguf", os.urandom(12_345))
    source = _Source(art)
    plan = plan_scoring(fx, codec, source.identity(), ctx=64)
    result = run_scoring(source, codec, plan, command=["quantkit", "score", str(art)])
    out = tmp_path / "out.tsv"
    result.write(out, layout=layout)
    header = read_table(out).header
    record = header["evidence"]
    assert record["artifact"]["sha256"] == _sha(art) and record["artifact"]["size"] == 12_345
    assert record["fixture"]["content_sha256"] == fx.content_sha256 == header["fixture"]["content_sha256"]
    assert record["device"] == "cpu" and record["dtype"] == "float32" and record["threads"] >= 1
    assert record["command"] == ["quantkit", "score", str(art)] and record["tools"]["quantkit"] == __version__
    if layout == "ds4":
        assert json.loads(sidecar_path(out).read_text())["header"]["evidence"] == record


def test_table_without_evidence_still_reads_and_bad_evidence_is_refused(tmp_path):
    from quantkit.errors import FixtureError
    from quantkit.scoring.metrics import ApiCounts, CaseScore, Totals
    from quantkit.scoring.table import write_table

    scores = [CaseScore("a", 3, 4, 2.0, 1, 2, 0, ApiCounts())]
    header = {"version": 1, "fixture": {"content_sha256": "ab" * 32, "label": "0731", "cases": 1, "path": "f"},
              "model": {}, "ctx": 64, "cross_checkpoint": []}
    write_table(tmp_path / "old.tsv", header, scores, [Totals.of(scores).summary_line()])
    assert "evidence" not in read_table(tmp_path / "old.tsv").header
    write_table(tmp_path / "bad.tsv", header | {"evidence": 5}, scores, [Totals.of(scores).summary_line()])
    with pytest.raises(FixtureError, match="evidence must be an object"):
        read_table(tmp_path / "bad.tsv")


# -- validation reports ------------------------------------------------------------------------------------------

def _tiny_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_validate_report_records_evidence(tmp_path):
    art = _tiny_gguf(tmp_path / "tiny.gguf")
    report_path = tmp_path / "r.json"
    out = CliRunner().invoke(main, ["validate", str(art), "--structure-only", "--report", str(report_path)])
    assert out.exit_code in (0, 1), out.output
    record = json.loads(report_path.read_text())["evidence"]
    assert record["artifact"] == {"path": str(art), "kind": "file", "size": art.stat().st_size,
                                  "sha256": _sha(art), "sha256_from": "computed"}
    assert record["command"] == sys.argv          # the process's command line (here pytest's)
    assert record["tools"]["quantkit"] == __version__ and record["device"] == "cpu" and record["threads"] >= 1
    # unreadable input: the error record carries evidence too (no hash)
    bad = _file(tmp_path / "bad.gguf", b"GGUF\x03\x00")
    out = CliRunner().invoke(main, ["validate", str(bad), "--structure-only", "--report", str(tmp_path / "e.json")])
    error = json.loads((tmp_path / "e.json").read_text())
    assert out.exit_code == 2 and error["exit_code"] == 2 and error["evidence"]["artifact"] is None
