"""Issue #18's outside-probe defects, each run the way the probe ran it: the CLI on a hostile input.

Every refusal must be one line (``error: ...``) naming the file or field, with no Python exception class name and
the exit code of ``quantkit.cli``'s documented table.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit import examples
from quantkit.cli import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_CHECK_FAILED, EXIT_UNAVAILABLE, main
from quantkit.io.gguf_reader import GGUFFile
from quantkit.testing.corpus import MALFORMED_CONFIGS

ROOT = Path(__file__).resolve().parent.parent
#: Any Python exception class name, as the CLI must never print it.
EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_refused(result, code: int, *named: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not EXCEPTION_NAME.search(lines[0]), lines[0]
    for text in named:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def subprocess_cli(args: list[str], *, prelude: str = "", **kwargs) -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}\nfrom quantkit.cli import main; main({args!r}, prog_name='quantkit')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, **kwargs)


# -- defect 8: config.json numbers -------------------------------------------------------------------------------

@pytest.fixture
def example_copy(tmp_path) -> Path:
    return Path(shutil.copytree(examples.example_model_dir(), tmp_path / "model"))


def with_config(model: Path, edit: dict) -> Path:
    config = json.loads((model / "config.json").read_text())
    config.update(edit)
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("field, value", MALFORMED_CONFIGS, ids=[f"{f}={v!r}" for f, v in MALFORMED_CONFIGS])
def test_config_numbers_are_checked_before_anything_is_sized(example_copy, tmp_path, field, value):
    import tracemalloc

    model = with_config(example_copy, {field: value})
    tracemalloc.start()
    try:
        result = run("convert", model, "-o", tmp_path / "o.gguf", "--recipe", "q8_0", "--dry-run",
                     "--pre-tokenizer", examples.PRE_TOKENIZER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_refused(result, EXIT_BAD_INPUT, "config.json", repr(field))
    assert peak < 64 << 20, peak


def test_a_config_without_its_layer_count_is_named_as_such(example_copy, tmp_path):
    """Without num_hidden_layers the architecture's default applies: the error says so, not "the config declares"."""
    config = json.loads((example_copy / "config.json").read_text())
    del config["num_hidden_layers"]
    (example_copy / "config.json").write_text(json.dumps(config))
    result = run("convert", example_copy, "-o", tmp_path / "o.gguf", "--recipe", "q8_0", "--dry-run",
                 "--pre-tokenizer", examples.PRE_TOKENIZER)
    assert_refused(result, EXIT_BAD_INPUT, "gives no num_hidden_layers (the architecture's default:")


def test_validate_source_with_a_huge_config_is_refused(example_copy, tmp_path):
    gguf = tmp_path / "q.gguf"
    made = run("convert", examples.example_model_dir(), "-o", gguf, "--recipe", "tiny-moe-f16", "-j", "1",
               "--no-progress", "--pre-tokenizer", examples.PRE_TOKENIZER)
    assert made.exit_code == 0, made.output
    model = with_config(example_copy, {"num_hidden_layers": 10 ** 9})
    assert_refused(run("validate", gguf, "--source", model), EXIT_BAD_INPUT, "config.json", "'num_hidden_layers'")


# -- defect 11: the payload sample catches a corrupted expert whatever the seed ----------------------------------

def test_sample_mode_catches_a_flipped_byte_in_any_expert_for_every_seed(tmp_path):
    gguf = tmp_path / "q.gguf"
    made = run("convert", examples.example_model_dir(), "-o", gguf, "--recipe", "tiny-moe-q4_k", "-j", "1",
               "--no-progress", "--pre-tokenizer", examples.PRE_TOKENIZER)
    assert made.exit_code == 0, made.output
    clean = run("validate", gguf, "--source", examples.example_model_dir())
    assert clean.exit_code == 0, clean.output
    match = re.search(r"^valid \(sampled: ([\d,]+) of ([\d,]+) payload bytes compared\)$", clean.stdout, re.M)
    assert match, clean.stdout
    compared, total = (int(g.replace(",", "")) for g in match.groups())
    assert 0 < compared < total
    with GGUFFile(gguf) as f:
        t = f.tensors["blk.1.ffn_down_exps.weight"]
        base, experts, rows, row_bytes = f.data_offset + t.offset, t.shape[0], t.shape[1], t.row_bytes
    original = gguf.read_bytes()
    for expert in range(experts):
        row = expert * rows + (0 if expert % 2 else rows - 1)     # the first or the last row of the expert
        data = bytearray(original)
        data[base + row * row_bytes + row_bytes // 2] ^= 0x10
        gguf.write_bytes(bytes(data))
        for seed in range(3):
            result = run("validate", gguf, "--source", examples.example_model_dir(), "--seed", seed,
                         "--report", tmp_path / "r.json", "--force")
            assert result.exit_code == EXIT_CHECK_FAILED, (expert, seed, result.output)
            report = json.loads((tmp_path / "r.json").read_text())
            (entry,) = [e for e in report["tensors"] if e["name"] == t.name]
            assert entry["differing_experts"] == [expert], (expert, seed, entry)
            # the row count is of the rows sampled (every expert's), the expert is where the difference is
            assert f"{t.name}: 1 of {entry['rows']} sampled rows differ, in expert {expert};" in result.stdout
    gguf.write_bytes(original)


# -- defect 13: score on a non-GGUF model or without a tokenizer --------------------------------------------------

@pytest.mark.parametrize("content", [b"", b"not a gguf file at all"], ids=["empty", "not-gguf"])
def test_score_names_a_model_that_is_not_gguf(tmp_path, content):
    model = tmp_path / "model.gguf"
    model.write_bytes(content)
    result = run("score", model, examples.example_fixture_dir(), tmp_path / "out.tsv", "--ctx", 64)
    assert_refused(result, EXIT_BAD_INPUT, str(model), "not a GGUF file")


def test_score_names_a_missing_tokenizer(example_copy, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (example_copy / name).unlink()
    result = run("score", example_copy, examples.example_fixture_dir(), tmp_path / "out.tsv", "--ctx", 64)
    line = assert_refused(result, EXIT_BAD_INPUT, str(example_copy), "--tokenizer")
    assert "sentencepiece" not in line
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("score", examples.example_model_dir(), examples.example_fixture_dir(), tmp_path / "out.tsv",
                 "--ctx", 64, "--tokenizer", empty)
    assert_refused(result, EXIT_BAD_INPUT, str(empty), "no tokenizer files")


# -- defect 15: --pre-tokenizer is one of llama.cpp's names ------------------------------------------------------

def test_unknown_pre_tokenizer_is_refused_before_any_work(tmp_path):
    result = run("convert", examples.example_model_dir(), "-o", tmp_path / "o.gguf", "--recipe", "q8_0",
                 "--pre-tokenizer", "qwen3.5")
    assert_refused(result, EXIT_BAD_INPUT, "--pre-tokenizer 'qwen3.5'", "did you mean", "qwen35")
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.interop
def test_pre_tokenizer_table_is_llama_cpp_s_own(llama_cpp_src):
    """The names ``llama_vocab::impl::load`` accepts, read from the vendored source, equal quantkit's table."""
    from quantkit.arch.pre_tokenizers import LLAMA_CPP_PRE_TOKENIZERS

    text = (llama_cpp_src / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    start = text.index("if (type == LLAMA_VOCAB_TYPE_BPE) {", text.index("only BPE models have pre-tokenizers"))
    end = text.index("unknown pre-tokenizer type", start)
    names = set(re.findall(r'tokenizer_pre\s*==\s*"([^"]+)"', text[start:end]))
    assert len(names) > 50
    assert LLAMA_CPP_PRE_TOKENIZERS == names, (sorted(names - LLAMA_CPP_PRE_TOKENIZERS),
                                                sorted(LLAMA_CPP_PRE_TOKENIZERS - names))


# -- defect 17: no exception class names; one exit code per problem -----------------------------------------------

def test_a_closed_pipe_is_a_quiet_exit():
    shell = subprocess.run(f"{sys.executable} -m quantkit.cli recipes | head -n 1", shell=True, capture_output=True,
                           text=True, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
                           executable="/bin/bash")
    # `| true` closes the pipe long before Python has started (with `| head` a fast writer can fill the pipe
    # buffer before head exits, and then it never sees the closed pipe)
    piped = subprocess.run(f"set -o pipefail; {sys.executable} -m quantkit.cli recipes | true; echo $?",
                           shell=True, capture_output=True, text=True, cwd=ROOT, executable="/bin/bash",
                           env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert shell.stderr == "" and piped.stderr == "", (shell.stderr, piped.stderr)
    assert piped.stdout.splitlines()[-1] == str(EXIT_BROKEN_PIPE)


def test_undecodable_and_directory_inputs_name_the_file(tmp_path):
    binary = tmp_path / "a.tsv"
    binary.write_bytes(b"\xff\xfe\x00binary")
    assert_refused(run("compare", binary, binary), EXIT_BAD_INPUT, str(binary), "not UTF-8")
    recipe = tmp_path / "r.toml"
    recipe.write_bytes(b"name = \"\xff\"")
    assert_refused(run("recipes", recipe), EXIT_BAD_INPUT, str(recipe))
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"\xff\xfe")
    from quantkit.errors import FixtureError
    from quantkit.fixtures.capture import read_prompts
    with pytest.raises(FixtureError, match="not UTF-8"):
        read_prompts(prompts)


@pytest.mark.parametrize("where", ["config.json", "tokenizer.json", "fixture.json", "prompts", "imatrix config"])
def test_json_nested_too_deeply_to_parse_names_the_file(example_copy, tmp_path, where):
    """Python's JSON parser gives up on input nested thousands of levels deep with a RecursionError, not the
    ValueError of other malformed JSON: each reader still gives its one line naming the file."""
    deep = "[" * 100_000 + "]" * 100_000
    if where in ("config.json", "tokenizer.json"):
        (example_copy / where).write_text(deep)
        result = run("convert", example_copy, "-o", tmp_path / "o.gguf", "--recipe", "q8_0", "--dry-run")
        named = example_copy / where
    elif where == "fixture.json":
        fixture = Path(shutil.copytree(examples.example_fixture_dir(), tmp_path / "fixture"))
        (fixture / where).write_text(deep)
        result, named = run("fixture", "check", fixture), f"{fixture}: {where}"
    else:
        named = tmp_path / ("deep.json" if where != "prompts" else "deep.jsonl")
        named.write_text(deep)
        result = {"prompts": lambda: run("fixture", "capture", example_copy, "--prompts", named, "--label", "x",
                                         "-o", tmp_path / "fx"),
                  "imatrix config": lambda: run("imatrix", "convert", examples.example_imatrix(), "-o",
                                                tmp_path / "x.dat", "--config", named)}[where]()
    assert_refused(result, EXIT_BAD_INPUT, str(named), "nested too deeply")


def test_os_errors_print_the_path_not_the_class():
    from quantkit.cli import error_line

    assert error_line(IsADirectoryError(21, "Is a directory", "/some/dir")) == "/some/dir: Is a directory"
    assert error_line(TypeError("unsupported operand")).startswith("internal error: ")
    assert not EXCEPTION_NAME.search(error_line(TypeError("x")))


def test_a_mismatched_imatrix_is_exit_2_everywhere(tmp_path):
    out = tmp_path / "o.gguf"
    made = run("convert", examples.example_model_dir(), "-o", out, "--recipe", "tiny-moe-f16", "-j", "1",
               "--no-progress", "--pre-tokenizer", examples.PRE_TOKENIZER)
    assert made.exit_code == 0, made.output
    # an imatrix whose entries name no tensor of the model: refused by convert, validate and imatrix info alike
    from quantkit.imatrix import Entry, make_imatrix, save_imatrix
    import numpy as np

    alien = tmp_path / "alien.imatrix.gguf"
    save_imatrix(make_imatrix({"blk.99.ffn_up_exps.weight": Entry(np.ones((1, 256), np.float32),
                                                                  np.ones(1, np.float32))}), alien)
    shorter = tmp_path / "shorter.imatrix.gguf"   # the same entry with another row length: not one model's
    save_imatrix(make_imatrix({"blk.99.ffn_up_exps.weight": Entry(np.ones((1, 128), np.float32),
                                                                  np.ones(1, np.float32))}), shorter)
    codes = {
        "convert": run("convert", examples.example_model_dir(), "-o", tmp_path / "q.gguf", "--recipe",
                       "tiny-moe-q4_k", "--imatrix", alien, "--pre-tokenizer", examples.PRE_TOKENIZER).exit_code,
        "info": run("imatrix", "info", alien, "--model", out).exit_code,
        "merge": run("imatrix", "merge", alien, shorter, "-o", tmp_path / "m.gguf").exit_code,
    }
    assert set(codes.values()) == {EXIT_BAD_INPUT}, codes


# -- defect 16 is in tests/test_swapset.py (test_gc_deletes_only_files_a_quantkit_manifest_records) ---------------

# -- defect 20: example recipes by name; distinct fp8 sidecar names ----------------------------------------------

def test_example_recipes_are_nameable():
    for name in ("tiny-moe-q4_k", "tiny-moe-f16", "tiny-moe-iq2xxs-w2q2k"):
        shown = run("recipes", name)
        assert shown.exit_code == 0 and f'name = "{name}"' in shown.output, shown.output
    assert "example recipes" in run("recipes").output


# -- defect 22: a sidecar that cannot be parsed is unreadable input ----------------------------------------------

def test_an_unparseable_sidecar_is_exit_2(tmp_path):
    model = Path(shutil.copytree(examples.example_model_dir(), tmp_path / "model"))
    made = run("swapset", model, "--family", "attn", "--format", "fp8-block128")
    assert made.exit_code == 0, made.output
    (manifest,) = model.glob("fp8-swapset-*.json")
    manifest.write_text("{ not json")
    assert_refused(run("validate", manifest.with_suffix(".safetensors")), EXIT_BAD_INPUT, manifest.name)


# -- deliverable 4: without the runtime extra, one line saying what to install ------------------------------------

@pytest.mark.parametrize("args, what", [
    (["score", "m.gguf", str(examples.example_fixture_dir()), "out.tsv", "--ctx", "64"], "quantkit score"),
    (["fixture", "capture", str(examples.example_model_dir()), "--prompts", str(examples.example_prompts()),
      "--label", "x", "-o", "fx"], "quantkit fixture capture"),
    (["imatrix", "collect", str(examples.example_model_dir()), "--text", str(examples.example_calibration_text()),
      "-o", "i.gguf"], "quantkit imatrix collect"),
    (["demo"], "quantkit demo"),
], ids=["score", "fixture-capture", "imatrix-collect", "demo"])
def test_commands_without_the_runtime_say_what_to_install(tmp_path, args, what):
    for missing in ("torch", "transformers"):
        done = subprocess_cli(args, prelude=f"sys.modules[{missing!r}] = None", timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == EXIT_UNAVAILABLE, (done.returncode, done.stderr)
        assert lines == [f"error: {what} needs the runtime extra: pip install torch==2.13.0 'quantkit[runtime]'"], \
            done.stderr
        assert "ModuleNotFoundError" not in done.stderr + done.stdout
