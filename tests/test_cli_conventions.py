"""One spelling for one meaning across commands (issue #18 defect 20):

* ``-o`` is always ``--output`` (a file) or ``--output-dir`` (a directory), and every command that writes a main
  output takes it;
* ``--json`` is always a flag that prints JSON on stdout; a JSON report written to a file is ``--report FILE``;
* ``--force`` is the only way to replace an existing output.
"""
from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from quantkit.cli import main

#: Commands whose main product is a file or directory they write.
WRITERS = {"convert", "score", "redialect", "fixture capture", "fixture import", "fixture import-vectors",
           "imatrix collect", "imatrix convert", "imatrix merge", "transport split", "transport assemble", "fetch"}


def commands(group: click.Group = main, path: tuple[str, ...] = ()):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            yield from commands(cmd, path + (name,))
        else:
            yield " ".join(path + (name,)), cmd


def options(cmd: click.Command) -> list[click.Option]:
    return [p for p in cmd.params if isinstance(p, click.Option)]


ALL = dict(commands())


def test_every_writer_takes_dash_o():
    assert WRITERS <= set(ALL), sorted(WRITERS - set(ALL))
    for name in sorted(WRITERS):
        assert any("-o" in o.opts for o in options(ALL[name])), f"{name} has no -o"


@pytest.mark.parametrize("name", sorted(ALL))
def test_option_spellings(name):
    for o in options(ALL[name]):
        if "-o" in o.opts:
            assert set(o.opts) & {"--output", "--output-dir"}, f"{name}: -o is {o.opts}"
        if "--json" in o.opts:
            assert o.is_flag, f"{name}: --json takes a value; a report file is --report FILE"
        if "--report" in o.opts:
            assert not o.is_flag, f"{name}: --report names a file"


def test_score_takes_its_table_by_option_or_argument(tmp_path):
    runner = CliRunner()
    fixture = tmp_path / "fixture"
    fixture.mkdir()
    both = runner.invoke(main, ["score", "m.gguf", str(fixture), str(tmp_path / "a.tsv"), "-o", str(tmp_path / "b.tsv"),
                                "--ctx", "64"])
    assert both.exit_code == 2 and "two outputs given" in both.output
    neither = runner.invoke(main, ["score", "m.gguf", str(fixture), "--ctx", "64"])
    assert neither.exit_code == 2 and "-o/--output" in neither.output


def test_validate_writes_its_report_with_report_and_prints_it_with_json(tmp_path):
    """An artifact that cannot be read: the JSON error record goes to the --report file, and on stdout with
    --json, beside the one-line error (exit 2)."""
    runner = CliRunner()
    artifact = tmp_path / "missing.gguf"
    report = tmp_path / "r.json"
    result = runner.invoke(main, ["validate", str(artifact), "--structure-only", "--report", str(report)])
    assert result.exit_code == 2 and json.loads(report.read_text())["exit_code"] == 2, result.output
    result = runner.invoke(main, ["validate", str(artifact), "--structure-only", "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["exit_code"] == 2, result.output
    assert len(result.stderr.splitlines()) == 1 and "missing.gguf" in result.stderr, result.stderr


@pytest.mark.parametrize("args", [["convert", "x", "-o", "y.gguf", "--recipe", "q8_0", "-j", "0"], ["nosuch"],
                                  ["validate"], ["score", "m.gguf", ".", "--ctx", "5", "--bogus"]])
def test_a_bad_option_or_argument_is_one_line(args):
    """A bad option, a missing argument or an unknown command is one line naming it and the help to read, exit
    2, as every other error (click printed the usage, a hint and a blank line around it)."""
    result = CliRunner().invoke(main, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and lines[0].endswith("--help)"), lines[0]


def test_a_recipe_directory_and_a_checkpoint_without_config_are_named(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    for args, expected in [(["--recipe", str(tmp_path)], "is a directory"), (["--recipe", "q8_0"], "no config.json")]:
        result = CliRunner().invoke(main, ["convert", str(tmp_path), "-o", str(tmp_path / "o.gguf"), *args])
        assert result.exit_code == 2 and expected in result.stderr, result.stderr


@pytest.mark.parametrize("command", [["convert", "x", "-o", "y.gguf", "--recipe", "q8_0"],
                                     ["imatrix", "collect", "x", "-o", "y.gguf", "--text"]])
@pytest.mark.parametrize("device", ["gpu", "cuda:x", "", "meta"])
def test_a_device_is_checked_when_the_option_is_read(command, device, tmp_path):
    """--device took any text: imatrix collect handed it to torch ("internal error: Expected one of cpu, cuda,
    ..."), convert exited 3 (unavailable) for what is a bad option."""
    text = tmp_path / "calibration.txt"
    text.write_text("text")
    result = CliRunner().invoke(main, [*command, *([str(text)] if command[-1] == "--text" else []),
                                       "--device", device])
    assert result.exit_code == 2 and "unknown device" in result.stderr and "--device" in result.stderr, result.stderr
