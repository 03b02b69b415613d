"""Fixtures: directory layout and strict reading, ds4 directories as they are, import, atomic writing, token bytes,
capture rules, the runtime's cached greedy generation against its uncached path on every architecture, and the
capture -> score round trip on a tiny transformers model, through the runtime and through the CLI."""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.errors import FixtureError, OutputExistsError
from quantkit.fixtures import directory
from quantkit.fixtures.capture import capture_fixture, read_prompts, round_trip_prefix
from quantkit.fixtures.directory import (Alternative, Case, Position, import_fixture, read_fixture,
                                         write_fixture)
from quantkit.fixtures.tokens import Rendering, TextCodec
from quantkit.scoring.score import score_fixture
from quantkit.scoring.source import GeneratingSource, ModelIdentity, TransformersSource
from quantkit.scoring.table import read_table

SOURCE = ModelIdentity(source="a" * 64, tokenizer="b" * 64)


@pytest.fixture(scope="module")
def codec():
    from quantkit.testing.tiny_models import build_tiny_tokenizer

    return TextCodec(build_tiny_tokenizer("qwen3_moe"))


def _position(logprob, alts):
    return Position("x", logprob, b"x", tuple(Alternative(t, lp, t.encode()) for t, lp in alts))


def _cases(n=3):
    return [Case(f"case_{i:04d}", f"prompt {i}\nsecond line", f" continuation {i}",
                 (_position(-0.25, [("x", -0.25), ("y", -2.5)]), _position(-1.5, [("z", -0.5)])))
            for i in range(n)]


def _write(tmp_path, name="fx", cases=None):
    return write_fixture(tmp_path / name, cases or _cases(), label="0731", source=SOURCE, rendering=Rendering("raw"),
                         capture={"tokens": 2, "top_logprobs": 2, "quantkit_version": "t"})


def test_round_trip_and_layout(tmp_path):
    fx = _write(tmp_path)
    root = tmp_path / "fx"
    assert sorted(p.name for p in root.iterdir()) == ["continuations", "fixture.json", "manifest.tsv", "prompts",
                                                      "responses"]
    assert (root / "manifest.tsv").read_text().splitlines()[0] == (
        "case_0000\tprompts/case_0000.txt\tcontinuations/case_0000.txt\tresponses/case_0000.json")
    response = json.loads((root / "responses/case_0001.json").read_text())
    content = response["choices"][0]["logprobs"]["content"]
    assert content[0]["top_logprobs"][1] == {"token": "y", "logprob": -2.5, "bytes": [121]}
    assert list(fx.cases) == _cases()
    info = json.loads((root / "fixture.json").read_text())
    assert info["label"] == "0731" and info["cases"] == 3 and info["content_sha256"] == fx.content_sha256
    assert fx.identity == ModelIdentity(label="0731", source="a" * 64, tokenizer="b" * 64)
    assert not [p for p in tmp_path.iterdir() if p.name != "fx"]       # no temporary left behind
    with pytest.raises(OutputExistsError):
        _write(tmp_path)


def _edits():
    """(name, edit(root), message): each edit breaks a valid fixture in one way."""
    def replace(rel, old, new):
        def edit(root):
            path = root / rel
            path.write_text(path.read_text().replace(old, new))
        return edit

    def remove(rel):
        return lambda root: (root / rel).unlink()

    yield "missing prompt file", remove("prompts/case_0001.txt"), "case case_0001 prompt: file .* does not exist"
    yield "missing manifest row", replace("manifest.tsv", "case_0002\t", "#case_0002\t"), \
        "prompts/case_0002.txt is not listed"
    yield "nan logprob", replace("responses/case_0001.json", "-1.5", "NaN"), \
        r"case case_0001 response case_0001.json: logprobs.content\[1\]: logprob is nan"
    yield "positive logprob", replace("responses/case_0001.json", "-1.5", "0.5"), \
        r"case case_0001 response case_0001.json: logprobs.content\[1\]: logprob is 0.5, expected a finite number in "
    # finite, but the case's sums overflow float64: the table held inf (score exited 0, compare refused it)
    yield "huge logprob", replace("responses/case_0001.json", "-1.5", "-1.5e308"), \
        r"logprobs.content\[1\]: logprob is -1.5e\+308, expected a finite number in \[-1e\+06, 0\]"
    yield "huge integer logprob", replace("responses/case_0001.json", "-1.5", "-1" + "0" * 400), \
        r"logprobs.content\[1\]: logprob is -10000000000... \(402 digits\)"
    yield "empty response", lambda root: (root / "responses/case_0001.json").write_text(""), \
        "case case_0001 response case_0001.json: not valid JSON"
    yield "string logprob", replace("responses/case_0002.json", "-0.5", '"low"'), \
        r"case case_0002 .*top_logprobs\[0\]: logprob must be a number"
    yield "bad json", replace("responses/case_0000.json", "{", "[", ), "case case_0000 response .*not valid JSON"
    yield "no logprobs", replace("responses/case_0000.json", '"logprobs"', '"logprobz"'), "case case_0000 .*no logprobs"
    yield "bad bytes", replace("responses/case_0000.json", "[121]", "[300]"), "case case_0000 .*bytes must be"
    yield "edited continuation", replace("continuations/case_0001.txt", "1", "7"), "differ from what fixture.json"
    yield "empty continuation", replace("continuations/case_0001.txt", " continuation 1", ""), \
        "case case_0001 continuation: the file is empty"
    yield "duplicate id", replace("manifest.tsv", "case_0002\tprompts", "case_0001\tprompts"), "appears twice"
    yield "short row", replace("manifest.tsv", "\tcontinuations/case_0000.txt\tresponses/case_0000.json", ""), \
        "line 1: expected 3 or 4"
    yield "case count", replace("fixture.json", '"cases": 3', '"cases": 4'), "records 4 cases but"
    yield "template kwargs not an object", replace("fixture.json", '"template_kwargs": {}', '"template_kwargs": [1, 2]'), \
        "rendering.template_kwargs must be an object"
    yield "unknown key", replace("fixture.json", '"cases"', '"extra": 1, "cases"'), "expected exactly"
    yield "bad version", replace("fixture.json", '"version": 1', '"version": 9'), "version 9 is not one of"
    yield "not a fixture", remove("manifest.tsv"), "manifest.tsv is missing"


@pytest.mark.parametrize("name, edit, message", list(_edits()), ids=[e[0] for e in _edits()])
def test_malformed_fixtures_name_the_problem(tmp_path, name, edit, message):
    _write(tmp_path)
    edit(tmp_path / "fx")
    with pytest.raises(FixtureError, match=message):
        read_fixture(tmp_path / "fx")


def test_ds4_directory_reads_as_is(tmp_path):
    """A ds4 fixture: manifest paths relative to the repository it was made in, comments, a top-level logprobs
    object, a case without a response column, no fixture.json."""
    root = tmp_path / "general-100"
    for sub in ("prompts", "continuations", "responses"):
        (root / sub).mkdir(parents=True)
    (root / "prompts/case_001.txt").write_text("Explain BPE.")
    (root / "continuations/case_001.txt").write_text(" Byte pair encoding merges")
    (root / "responses/case_001.json").write_text(json.dumps({"id": "x", "logprobs": {"content": [
        {"token": " Byte", "logprob": -0.1, "bytes": list(b" Byte"),
         "top_logprobs": [{"token": " Byte", "logprob": -0.1, "bytes": list(b" Byte")},
                          {"token": " It", "logprob": -2.9, "bytes": None}]}]}}))
    (root / "prompts/case_002.txt").write_text("Say hi.")
    (root / "continuations/case_002.txt").write_text(" hi")
    (root / "manifest.tsv").write_text(
        "# id\tprompt\tcontinuation\tresponse\n\n"
        "case_001\tfixtures/general-100/prompts/case_001.txt\tfixtures/general-100/continuations/case_001.txt"
        "\tfixtures/general-100/responses/case_001.json\n"
        "case_002\tprompts/case_002.txt\tcontinuations/case_002.txt\n")
    fx = read_fixture(root)
    assert [c.id for c in fx.cases] == ["case_001", "case_002"] and fx.info is None
    assert fx.rendering == Rendering("chat") and fx.identity == ModelIdentity()
    assert fx.cases[0].response[0].top[1] == Alternative(" It", -2.9, None) and fx.cases[1].response is None

    out = import_fixture(root, tmp_path / "imported", label="0731", source=SOURCE)
    assert out.info.label == "0731" and out.identity.source == SOURCE.source and out.info.capture is None
    assert [c.response for c in out.cases] == [c.response for c in fx.cases]
    assert (tmp_path / "imported/manifest.tsv").read_text().splitlines()[1] == (
        "case_002\tprompts/case_002.txt\tcontinuations/case_002.txt")


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def failing(positions, continuation, model):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return b"{}"

    monkeypatch.setattr(directory, "response_json", failing)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FixtureError, match="case ids must be unique"):
        write_fixture(tmp_path / "x", _cases(2) * 2, label="l", source=SOURCE, rendering=Rendering("raw"),
                      capture=None)


def test_token_bytes_cover_the_vocabulary(codec):
    partial = 0
    for token_id in range(codec.size):
        data = codec.token_bytes(token_id)
        assert data is not None and codec.token_for_bytes(data) == token_id
        partial += codec.token_text(data).startswith("bytes:")
    assert partial > 0                                   # tokens holding part of a UTF-8 character have bytes too
    assert codec.token_bytes(codec.size) is None         # padding rows of the head have no text
    assert codec.token_bytes(codec.encode_text("st")[0]) == b"st"


def test_fingerprint_tells_tokenizers_apart(codec):
    from quantkit.testing.tiny_models import build_tiny_tokenizer

    assert TextCodec(build_tiny_tokenizer("qwen3_moe")).fingerprint == codec.fingerprint
    assert TextCodec(build_tiny_tokenizer("deepseek_v3")).fingerprint != codec.fingerprint


def test_read_prompts(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    assert read_prompts(tmp_path / "p.txt") == [("case_0001", "first prompt"), ("case_0002", "second prompt")]
    (tmp_path / "p.jsonl").write_text('"a\\nb"\n{"prompt": "c", "id": "q7"}\n')
    assert read_prompts(tmp_path / "p.jsonl") == [("case_0001", "a\nb"), ("q7", "c")]
    (tmp_path / "bad.jsonl").write_text('{"text": "c"}\n')
    with pytest.raises(FixtureError, match="line 1: expected a JSON string"):
        read_prompts(tmp_path / "bad.jsonl")
    # the line number is the file's: blank lines before it count (they were numbered away)
    (tmp_path / "blank.jsonl").write_text('"a"\n\n\n"b"\n\n{bad}\n')
    with pytest.raises(FixtureError, match="line 6: not JSON"):
        read_prompts(tmp_path / "blank.jsonl")
    # a byte-order mark (and CRLF) as a Windows editor writes them: not part of the first prompt, in either format
    (tmp_path / "bom.txt").write_bytes("\ufefffirst prompt\r\nsecond prompt\r\n".encode())
    assert read_prompts(tmp_path / "bom.txt") == [("case_0001", "first prompt"), ("case_0002", "second prompt")]
    (tmp_path / "bom.jsonl").write_bytes('\ufeff"a"\r\n'.encode())
    assert read_prompts(tmp_path / "bom.jsonl") == [("case_0001", "a")]


# -- capture rules with a scripted model --------------------------------------------------------------------

class ChainSource:
    """Greedy follows ``follow[last token]``; optionally a row that is not the last of the call prefers
    ``late_token`` from continuation index 1 on (so the final teacher-forced pass disagrees with generation)."""

    def __init__(self, follow, width=512, prompt_len=None, late_token=None):
        self.follow, self.width = follow, width
        self.prompt_len, self.late_token = prompt_len, late_token

    def identity(self):
        return ModelIdentity(source="c" * 64)

    def logits(self, token_ids):
        out = np.zeros((len(token_ids), self.width), np.float32)
        for i, t in enumerate(token_ids):
            out[i, self.follow.get(t, 10)] = 5.0
            out[i, 11] = 1.0
            if self.late_token is not None and i >= self.prompt_len and i < len(token_ids) - 1:
                out[i, self.late_token] = 9.0
        return out


def test_capture_cuts_where_text_does_not_round_trip(tmp_path, codec):
    s, t = codec.encode_text("s")[0], codec.encode_text("t")[0]
    prompt = codec.encode_text("hello")
    source = ChainSource({prompt[-1]: s, s: t, t: t})       # "s" "t" re-encodes as the single token "st"
    assert round_trip_prefix(codec, [s, t, t]) == 1
    fx = capture_fixture(source, codec, [("case_a", "hello")], tmp_path / "fx", label="0731", tokens=4,
                         top_logprobs=3, rendering=Rendering("raw"))
    case = fx.cases[0]
    assert case.continuation == "s" and len(case.response) == 1
    position = case.response[0]
    assert position.bytes == b"s" and [a.bytes for a in position.top][:2] == [b"s", codec.token_bytes(11)]
    expected = 5.0 - np.log(np.exp(5.0) + np.exp(1.0) + 510)
    assert position.logprob == pytest.approx(expected, abs=1e-6) and position.top[0].logprob == position.logprob
    assert fx.identity.label == "0731" and fx.info.capture["tokens"] == 4


def test_capture_recuts_where_the_final_pass_disagrees(tmp_path, codec):
    a, b, z = (codec.encode_text(c)[0] for c in "xyz")
    prompt = codec.encode_text("hello")
    source = ChainSource({prompt[-1]: a, a: b, b: a}, prompt_len=len(prompt), late_token=z)
    fx = capture_fixture(source, codec, [("case_a", "hello")], tmp_path / "fx", label="l", tokens=4, top_logprobs=2,
                         rendering=Rendering("raw"))
    assert fx.cases[0].continuation == "x"          # index 1 disagreed in the full pass: cut there


def test_capture_refuses_a_case_without_text(tmp_path, codec):
    prompt = codec.encode_text("hello")
    for first in (codec.tokenizer.eos_token_id, 500):           # a special token, a padding row of the head
        with pytest.raises(FixtureError, match="case case_b: the source's greedy continuation keeps no token"):
            capture_fixture(ChainSource({prompt[-1]: first}), codec, [("case_b", "hello")], tmp_path / "fx",
                            label="l", tokens=3, top_logprobs=2, rendering=Rendering("raw"))
    assert not (tmp_path / "fx").exists()
    with pytest.raises(FixtureError, match="differs from the source's own checkpoint label"):
        class Labelled(ChainSource):
            def identity(self):
                return ModelIdentity(label="0800")
        capture_fixture(Labelled({}), codec, [("c", "hello")], tmp_path / "fx", label="0731",
                        rendering=Rendering("raw"))
    with pytest.raises(FixtureError, match="no chat template"):
        capture_fixture(ChainSource({}), codec, [("c", "hello")], tmp_path / "fx", label="l")


# -- capture -> score on a tiny transformers model ----------------------------------------------------------

@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """The tiny qwen3_moe model (float32) with the output rows of tokens that cannot end a continuation zeroed:
    a random model would otherwise often start with a special token, a padding id or half a UTF-8 character
    (which capture cuts away), leaving some prompts without a continuation."""
    import torch

    from quantkit.testing.tiny_models import build_tiny_model

    model, tokenizer = build_tiny_model("qwen3_moe", dtype="f32")
    model = copy.deepcopy(model)
    codec = TextCodec(tokenizer)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for token_id in range(head.shape[0]):
            if not codec.is_text_token(token_id) or round_trip_prefix(codec, [token_id]) != 1:
                head[token_id] = 0
    folder = tmp_path_factory.mktemp("text_model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, codec, folder


PROMPTS = ["def foo(x):", "import os\n", "class A:\n    pass"]


def test_source_scores_perfectly_on_its_own_fixture(tmp_path, text_model):
    model, codec, _ = text_model
    source = TransformersSource(model, ModelIdentity(source="d" * 64, tokenizer=codec.fingerprint))
    fx = capture_fixture(source, codec, [(f"case_{i}", p) for i, p in enumerate(PROMPTS)], tmp_path / "fx",
                         label="0731", tokens=5, top_logprobs=8, rendering=Rendering("raw"))
    assert all(len(c.response) >= 1 for c in fx.cases)
    result = score_fixture(source, codec, fx, ctx=64)
    totals = result.totals
    assert totals.first_matches == totals.cases == 3 and totals.lcp == totals.tokens
    api = totals.api
    assert api.top1_match == api.top1_count == totals.tokens and api.pair_agree == api.pair_total > 0
    assert api.topn_hit == api.topn_ref == api.top_mapped == 8 * totals.tokens
    assert api.target_abs_delta < 1e-9 and api.top_abs_delta < 1e-9


def test_a_fixture_directory_never_replaces_an_input(tmp_path, text_model):
    """`fixture capture SRC -o SRC --force` replaced the checkpoint with the fixture (and an output above an input
    deleted it the same way): refused before any work, exit 2, the inputs untouched; so for import."""
    import shutil

    _, _, folder = text_model
    src = shutil.copytree(folder, tmp_path / "models" / "src")
    before = sorted(p.name for p in src.iterdir())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS[0].replace("\n", " ") + "\n")
    runner = CliRunner()
    for out in (src, src.parent, tmp_path):
        result = runner.invoke(main, ["fixture", "capture", str(src), "--prompts", str(prompts), "--tokens", "2",
                                      "--label", "0731", "-o", str(out), "--rendering", "raw", "--force"])
        assert result.exit_code == 2 and "would replace an input" in result.output, result.output
    assert sorted(p.name for p in src.iterdir()) == before and prompts.is_file()
    fx = tmp_path / "fx"
    assert runner.invoke(main, ["fixture", "capture", str(src), "--prompts", str(prompts), "--tokens", "2",
                                "--label", "0731", "-o", str(fx), "--rendering", "raw"]).exit_code == 0
    result = runner.invoke(main, ["fixture", "import", str(fx), "-o", str(fx), "--label", "0731", "--rendering", "raw",
                                  "--force"])
    assert result.exit_code == 2 and "would replace an input" in result.output and (fx / "fixture.json").is_file()


def test_cli_capture_score_kld_compare(tmp_path, text_model):
    _, codec, folder = text_model
    runner = CliRunner()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS[:2]) + "\n")
    fx = tmp_path / "fx"
    out = runner.invoke(main, ["fixture", "capture", str(folder), "--prompts", str(prompts), "--tokens", "3",
                               "--top-logprobs", "5", "--label", "0731", "-o", str(fx), "--rendering", "raw"])
    assert out.exit_code == 0, out.output
    assert "fixture" in out.output and (fx / "fixture.json").is_file()
    a, b, base = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "base.kld"
    out = runner.invoke(main, ["score", str(folder), str(fx), str(a), "--ctx", "16", "--save-logits", str(base)])
    assert out.exit_code == 0, out.output
    assert "summary cases=2 " in out.output and "top1_rate=1.000000000" in out.output and base.is_file()
    out = runner.invoke(main, ["score", str(folder), str(fx), str(b), "--ctx", "16", "--kld-base", str(base)])
    assert out.exit_code == 0, out.output
    assert "Same top p: 100.000 ±" in out.output and "Mean    KLD:" in out.output
    # existing outputs are replaced only with --force, and a capture refuses its existing directory before it runs
    table = b.read_bytes()
    for existing in (["-o", str(b)], ["-o", str(tmp_path / "new.tsv"), "--save-logits", str(base)]):
        out = runner.invoke(main, ["score", str(folder), str(fx), "--ctx", "16", *existing])
        assert out.exit_code == 2 and "exists" in out.output and "--force" in out.output, out.output
    assert b.read_bytes() == table and not (tmp_path / "new.tsv").exists()
    out = runner.invoke(main, ["score", str(folder), str(fx), str(b), "--ctx", "16", "--kld-base", str(base),
                               "--force"])
    assert out.exit_code == 0, out.output
    # a base file that cannot be read, or one the fixture cannot fill, stops the run before any case is scored
    (tmp_path / "not.kld").write_bytes(b"not a logits file, 32 bytes long")
    for args, message in [(["--kld-base", str(tmp_path / "not.kld")], "not a llama-perplexity logits file"),
                          (["--save-logits", str(tmp_path / "big.kld")], "do not fill one chunk of --ctx 4096")]:
        out = runner.invoke(main, ["score", str(folder), str(fx), str(tmp_path / "c.tsv"), "--ctx", "4096", *args])
        assert out.exit_code == 2 and message in out.output and " avg_nll=" not in out.output, out.output
    out = runner.invoke(main, ["fixture", "capture", str(tmp_path / "no-model"), "--prompts", str(prompts),
                               "--tokens", "3", "--label", "0731", "-o", str(fx), "--rendering", "raw"])
    assert out.exit_code == 2 and "exists; refusing to replace it" in out.output, out.output
    assert read_table(b).trailer[-1].startswith("kld_summary ")
    out = runner.invoke(main, ["compare", str(a), str(b)])
    assert out.exit_code == 0 and "verdict=no established difference" in out.output
    assert "case_wins_new_old_ties=0/0/2" in out.output

    # the same fixture without a source identity: the checkpoint cannot be verified
    anon = tmp_path / "anon"
    assert runner.invoke(main, ["fixture", "import", str(fx), "-o", str(anon), "--label", "0731",
                                "--rendering", "raw"]).exit_code == 0
    out = runner.invoke(main, ["score", str(folder), str(anon), str(tmp_path / "c.tsv"), "--ctx", "16"])
    assert out.exit_code == 2 and out.output.count("\n") == 1 and "--allow-cross-checkpoint" in out.output
    out = runner.invoke(main, ["score", str(folder), str(anon), str(tmp_path / "c.tsv"), "--ctx", "16",
                               "--allow-cross-checkpoint"])
    assert out.exit_code == 0 and "cross-checkpoint" in read_table(tmp_path / "c.tsv").header["cross_checkpoint"][0]
    out = runner.invoke(main, ["compare", str(a), str(tmp_path / "c.tsv")])     # same content: same fixture
    assert out.exit_code == 0 and "verdict=no established difference" in out.output

    # a damaged fixture is refused before the model is loaded, naming the case
    broken = tmp_path / "broken"
    shutil.copytree(fx, broken)
    response = broken / "responses" / "case_0002.json"
    response.write_text(response.read_text().replace('"logprob": -', '"logprob": NaN, "x": -', 1))
    out = runner.invoke(main, ["score", str(folder), str(broken), str(tmp_path / "d.tsv"), "--ctx", "16"])
    assert out.exit_code == 2 and out.output.count("\n") == 1 and "case case_0002" in out.output
    out = runner.invoke(main, ["fixture", "check", str(fx)])
    assert out.exit_code == 0 and "2 cases (2 with responses" in out.output


def test_gguf_of_the_source_matches_the_source_fixture(tmp_path, text_model):
    """A GGUF converted from the checkpoint carries its label and source digest, and its rebuilt tokenizer
    tokenizes like the checkpoint's: it is scored on the checkpoint's fixture; a fixture of another label is
    refused before the model is loaded."""
    from quantkit.scoring.loading import describe_model

    _, _, folder = text_model
    gguf = tmp_path / "q8.gguf"
    runner = CliRunner()
    out = runner.invoke(main, ["convert", str(folder), "-o", str(gguf), "--recipe", "q8_0", "--label", "0731",
                               "--no-progress", "-j", "1", "--pre-tokenizer", "qwen35"])
    assert out.exit_code == 0, out.output
    codec, source_identity = describe_model(folder)
    _, gguf_identity = describe_model(gguf)
    assert gguf_identity.label == "0731" and source_identity.label is None
    assert gguf_identity.source == source_identity.source is not None
    assert gguf_identity.tokenizer == source_identity.tokenizer == codec.fingerprint

    from quantkit.scoring.loading import load_source

    source = load_source(source_identity)
    try:
        for label in ("0731", "0800"):
            capture_fixture(source, codec, [("case_0", PROMPTS[0])], tmp_path / label, label=label, tokens=3,
                            top_logprobs=4, rendering=Rendering("raw"))
    finally:
        source.close()
    out = runner.invoke(main, ["score", str(gguf), str(tmp_path / "0731"), str(tmp_path / "a.tsv"), "--ctx", "16"])
    assert out.exit_code == 0, out.output
    assert read_table(tmp_path / "a.tsv").header["model"]["label"] == "0731"
    out = runner.invoke(main, ["score", str(gguf), str(tmp_path / "0800"), str(tmp_path / "b.tsv"), "--ctx", "16"])
    assert out.exit_code == 2 and "checkpoint label differs: fixture '0800', model '0731'" in out.output


@pytest.mark.parametrize("arch, layout", [("deepseek_v3", "per-expert"), ("deepseek_v4", "official")])
def test_deepseek_gguf_tokenizer_keeps_its_vocabulary_and_scores_without_the_source(tmp_path, arch, layout):
    """Issue 18 #1: DeepSeek's BOS ``<｜begin▁of▁sentence｜>`` is outside GPT-2's byte alphabet; rebuilt from the
    GGUF it stays id 0 (not a new id 512 past the 512-row vocabulary), the rebuilt tokenizer encodes like the
    source's (the tiny tokenizers split text as Qwen3.5 does, so the GGUF names that pre-tokenizer), and ``score``
    runs on the GGUF with the source's fixture and no --tokenizer."""
    from transformers import AutoTokenizer

    from quantkit.scoring.loading import load_tokenizer
    from quantkit.testing.tiny_models import TinyCheckpointCache

    folder = TinyCheckpointCache(tmp_path / "tiny").get(arch, layout)
    gguf = tmp_path / f"{arch}.gguf"
    runner = CliRunner()
    out = runner.invoke(main, ["convert", str(folder), "-o", str(gguf), "--recipe", "q8_0", "--no-progress",
                               "-j", "1", "--pre-tokenizer", "qwen35", "--label", "0731"])
    assert out.exit_code == 0, out.output
    source, rebuilt = AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(gguf)
    assert rebuilt.bos_token == source.bos_token == "<｜begin▁of▁sentence｜>"
    assert rebuilt.bos_token_id == source.bos_token_id == 0
    assert len(rebuilt) == 512 and rebuilt.convert_ids_to_tokens(511) == "[PAD511]"
    for text in PROMPTS:
        assert rebuilt(text)["input_ids"] == source(text)["input_ids"], text
    assert TextCodec(rebuilt).fingerprint == TextCodec(source).fingerprint

    # a random model's greedy token may be half a UTF-8 character, which capture refuses: take a prompt it keeps
    for i, prompt in enumerate(PROMPTS):
        prompts, fx = tmp_path / f"prompts{i}.txt", tmp_path / f"fx{i}"
        prompts.write_text(prompt.replace("\n", " ") + "\n")
        out = runner.invoke(main, ["fixture", "capture", str(folder), "--prompts", str(prompts), "--tokens", "3",
                                   "--top-logprobs", "5", "--label", "0731", "-o", str(fx), "--rendering", "raw"])
        if out.exit_code == 0:
            break
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["score", str(gguf), str(fx), str(tmp_path / "a.tsv"), "--ctx", "16"])
    assert out.exit_code == 0, out.output
    assert "summary cases=" in out.output


def test_chat_rendering_uses_the_template_and_its_kwargs():
    from quantkit.testing.tiny_models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer("qwen3_moe")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                               "{% if not enable_thinking|default(true) %}<think></think>{% endif %}{% endif %}")
    codec = TextCodec(tokenizer)
    plain = codec.render("hi there", Rendering("chat"))
    assert plain == tokenizer("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)["input_ids"]
    quiet = codec.render("hi there", Rendering("chat", {"enable_thinking": False}))
    assert quiet == plain + codec.encode_text("<think></think>")
    assert codec.render("hi there", Rendering("raw")) == codec.encode_text("hi there")
    with pytest.raises(FixtureError, match="takes no template_kwargs"):
        Rendering("raw", {"enable_thinking": False})
    with pytest.raises(FixtureError, match="rendering mode 'plain'"):
        Rendering("plain")


def test_import_refuses_a_label_the_source_contradicts(tmp_path):
    _write(tmp_path)
    with pytest.raises(FixtureError, match="--label '0731' differs from the source's own checkpoint label '0800'"):
        import_fixture(tmp_path / "fx", tmp_path / "out", label="0731", source=ModelIdentity(label="0800"))
    assert not (tmp_path / "out").exists()


# -- greedy generation: the runtime's KV cache against its uncached path --------------------------------------------

#: Prompt length and new tokens: the decode steps cross 128 tokens (DeepSeek V4's heavily compressed layer emits
#: its first entry) after passing the sliding window (32) and every indexer's budget (qwen4_exp 16, glm5_next 32,
#: deepseek_v4 8 x 4), so every cached state of every architecture is used.
GREEDY_PROMPT, GREEDY_NEW = 122, 10


def _greedy_prompt(n=GREEDY_PROMPT):
    return [int(t) for t in np.random.default_rng(7).integers(0, 480, n)]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4", "glm5_next", "qwen3_moe", "qwen4_exp"])
def test_cached_greedy_matches_uncached(tiny_checkpoints, arch):
    from quantkit.runtime import greedy, load_model

    model = load_model(tiny_checkpoints.get(arch, "per-expert", "f32"))
    try:
        prompt = _greedy_prompt()
        cached = greedy(model, prompt, GREEDY_NEW)
        uncached = greedy(model, prompt, GREEDY_NEW, use_cache=False)
    finally:
        model.close()
    assert cached.tokens == uncached.tokens and len(cached.tokens) == GREEDY_NEW
    assert cached.logits.shape == uncached.logits.shape == (GREEDY_NEW, model.vocab_size)
    diff = float(np.abs(cached.logits - uncached.logits).max())
    assert diff <= 1e-4 * float(np.abs(uncached.logits).max()), diff


def test_generation_without_kept_logits_chooses_the_same_tokens(tiny_checkpoints):
    # generate keeps no rows: a vocabulary's float32 row a token grew its memory over a long generation
    from quantkit.runtime import greedy, load_model

    model = load_model(tiny_checkpoints.get("qwen3_moe", "per-expert", "f32"))
    try:
        kept = greedy(model, _greedy_prompt(), GREEDY_NEW)
        unkept = greedy(model, _greedy_prompt(), GREEDY_NEW, keep_logits=False)
    finally:
        model.close()
    assert unkept.tokens == kept.tokens and unkept.logits is None


@pytest.fixture(scope="module")
def qwen_runtime(tiny_checkpoints):
    from quantkit.runtime import load_model

    model = load_model(tiny_checkpoints.get("qwen3_moe", "per-expert", "f32"))
    yield model
    model.close()


def test_greedy_stops_before_a_refused_token(qwen_runtime):
    from quantkit.runtime import greedy

    prompt = _greedy_prompt(12)
    free = greedy(qwen_runtime, prompt, 4)
    for use_cache in (True, False):
        stopped = greedy(qwen_runtime, prompt, 4, stop=lambda t: t == free.tokens[2], use_cache=use_cache)
        assert stopped.tokens == free.tokens[:2] and len(stopped.logits) == 3     # the refusing row is kept
        assert int(np.argmax(stopped.logits[2])) == free.tokens[2]


def test_greedy_refuses_bad_input(qwen_runtime):
    from quantkit.runtime import greedy

    for use_cache in (True, False):
        with pytest.raises(FixtureError, match="token id 512 at position 1 is outside the vocabulary"):
            greedy(qwen_runtime, [3, qwen_runtime.vocab_size], 2, use_cache=use_cache)
    with pytest.raises(FixtureError, match="max_new_tokens must be >= 1"):
        greedy(qwen_runtime, [3], 0)


def test_greedy_raises_on_non_finite_logits(qwen_runtime):
    """NaN from the final norm: on every pass the error names the module (the uncached re-run finds it); on the
    one-token passes only, the error says the cached pass alone was not finite."""
    from quantkit.errors import ValidationError
    from quantkit.runtime import greedy

    prompt = _greedy_prompt(6)
    for when, message in ((lambda n: True, "non-finite logits at position 0; first non-finite output: module "
                                           "'model.norm'"),
                          (lambda n: n == 1, "non-finite logits at position 6 of the cached pass, where the "
                                             "uncached pass over the same tokens is finite")):
        def poison(module, args, output, when=when):
            return output * float("nan") if when(output.shape[1]) else output

        handle = qwen_runtime.module.model.norm.register_forward_hook(poison)
        try:
            with pytest.raises(ValidationError, match=message):
                greedy(qwen_runtime, prompt, 3)
        finally:
            handle.remove()


class GeneratingChain(ChainSource):
    """A :class:`ChainSource` with its own ``generate`` (recording its calls)."""

    def __init__(self, follow, **kw):
        super().__init__(follow, **kw)
        self.calls = []

    def generate(self, prompt_ids, max_new_tokens, stop):
        self.calls.append((list(prompt_ids), max_new_tokens))
        ids = list(prompt_ids)
        while len(ids) - len(prompt_ids) < max_new_tokens and not stop(self.follow.get(ids[-1], 10)):
            ids.append(self.follow.get(ids[-1], 10))
        return ids[len(prompt_ids):]


def test_capture_generates_through_the_source_when_it_can(tmp_path, codec):
    a, b, z = (codec.encode_text(c)[0] for c in "xyz")
    prompt = codec.encode_text("hello")
    kw = dict(prompt_len=len(prompt), late_token=z)
    plain, generating = ChainSource({prompt[-1]: a, a: b, b: a}, **kw), GeneratingChain({prompt[-1]: a, a: b, b: a},
                                                                                           **kw)
    assert isinstance(generating, GeneratingSource) and not isinstance(plain, GeneratingSource)
    fixtures = [capture_fixture(s, codec, [("case_a", "hello")], tmp_path / name, label="l", tokens=4,
                                top_logprobs=2, rendering=Rendering("raw"))
                for name, s in (("plain", plain), ("generating", generating))]
    assert generating.calls == [(prompt, 4)]
    assert fixtures[0].cases == fixtures[1].cases and fixtures[1].cases[0].continuation == "x"   # still re-cut


class LogitsOnly:
    """A source's ``logits`` and ``identity`` without its ``generate``: capture's uncached path."""

    def __init__(self, source):
        self.logits, self.identity = source.logits, source.identity


def test_runtime_capture_generates_with_the_cache(tmp_path, text_model, monkeypatch):
    """Capture through the runtime (as ``quantkit fixture capture`` runs it) generates with the KV cache and gives
    the fixture its uncached path gives."""
    from quantkit.runtime import generate
    from quantkit.scoring.loading import describe_model, load_source

    _, _, folder = text_model
    codec, identity = describe_model(folder)
    source = load_source(identity)
    cached_calls = []
    original = generate._cached_steps
    monkeypatch.setattr(generate, "_cached_steps", lambda *a: cached_calls.append(a) or original(*a))
    prompts = [(f"case_{i}", p) for i, p in enumerate(PROMPTS)]
    try:
        assert isinstance(source, GeneratingSource)
        fixtures = [capture_fixture(s, codec, prompts, tmp_path / name, label="0731", tokens=6, top_logprobs=4,
                                    rendering=Rendering("raw"))
                    for name, s in (("cached", source), ("uncached", LogitsOnly(source)))]
    finally:
        source.close()
    assert len(cached_calls) == len(PROMPTS)
    assert fixtures[0].cases == fixtures[1].cases and fixtures[0].content_sha256 == fixtures[1].content_sha256
    assert all(len(c.response) >= 1 for c in fixtures[0].cases)
