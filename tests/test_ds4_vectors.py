"""ds4's logprob test vectors (``official.vec``) imported as fixtures: a vector file written here in the layout
ds4's C test reads, its malformed variants, and ds4's own file where its mirror is present."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.errors import FixtureError
from quantkit.fixtures.directory import read_fixture
from quantkit.fixtures.ds4_vectors import read_vectors

DS4_MIRROR = Path("/work/.mirror/antirez+ds4/repo")

VEC = """# ds4-official-logprob-vectors-v1
# case <id> <ctx> <steps> <prompt-file>

case italian 16384 2 tests/test-vectors/prompts/italian.txt
step 0 416461 2
top 416461 0
top 4175677573 -17.25
step 1 204c6f76 1
top 204c6f76 -0.125
end

case accent 4096 1 tests/test-vectors/prompts/accent.txt
step 0 c3a8 2
top 63 -0.5
top c3a8 -1.5
end
"""


def make_tree(root: Path, vec: str = VEC) -> Path:
    prompts = root / "tests" / "test-vectors" / "prompts"
    prompts.mkdir(parents=True)
    (prompts / "italian.txt").write_text("Chi era Ada Lovelace?")
    (prompts / "accent.txt").write_text("perch")
    path = root / "tests" / "test-vectors" / "official.vec"
    path.write_text(vec)
    return path


def test_vectors_read_as_cases(tmp_path):
    cases = read_vectors(make_tree(tmp_path))
    assert [c.id for c in cases] == ["italian", "accent"]
    italian, accent = cases
    assert italian.prompt == "Chi era Ada Lovelace?" and italian.continuation == "Ada Lov"
    assert [p.logprob for p in italian.response] == [0.0, -0.125]
    assert [a.bytes for a in italian.response[0].top] == [b"Ada", b"Augus"]
    assert italian.response[0].top[1].logprob == -17.25
    assert accent.continuation == "è" and accent.response[0].logprob == -1.5


def test_cli_import_vectors_writes_a_fixture(tmp_path):
    vec = make_tree(tmp_path / "ds4")
    out = CliRunner().invoke(main, ["fixture", "import-vectors", str(vec), "-o", str(tmp_path / "fx"), "--label",
                                    "0731", "--chat-template-kwargs", '{"thinking": false}'])
    assert out.exit_code == 0, out.output
    assert "2 cases imported from official.vec, 3 reference tokens" in out.output
    fx = read_fixture(tmp_path / "fx")
    assert [c.continuation for c in fx.cases] == ["Ada Lov", "è"] and fx.info.capture is None
    assert fx.rendering.template_kwargs == {"thinking": False}


@pytest.mark.parametrize("edit, message", [
    (lambda v: v.replace("step 1 204c6f76 1", "step 1 204c6f7 1"), "line 8: selected token"),
    (lambda v: v.replace("case italian 16384 2", "case italian 16384 17"), "line 4: steps"),
    (lambda v: v.replace("top 204c6f76 -0.125", "top 204c6f76 0.5"), "line 9: log-probability"),
    (lambda v: v.replace("top 204c6f76 -0.125", "top 204c6f76 -inf"), "line 9: log-probability"),
    (lambda v: v.replace("top 204c6f76 -0.125", "top 204c6f76 -1e999"), "line 9: log-probability"),
    (lambda v: v.replace("top 204c6f76 -0.125", "top 20 -0.125"), "step 1's selected token is not among"),
    (lambda v: v.replace("step 0 416461 2", "step 0 416461 3"), "step 0 declares 3 top entries and lists 2"),
    (lambda v: v.replace("italian.txt", "missing.txt", 1), "prompt file 'tests/test-vectors/prompts/missing.txt'"),
    (lambda v: v.replace("italian.txt", "../../x.txt", 1), "must be relative, inside"),
    (lambda v: v.rsplit("end", 1)[0], "case accent (line 12) has no 'end'"),
    (lambda v: v.replace("case accent", "case italian"), "must be unique"),
    (lambda v: v.replace("step 0 c3a8 2\ntop 63 -0.5\ntop c3a8 -1.5", "step 0 c3 1\ntop c3 -1.5"), "not UTF-8"),
    (lambda v: "# nothing\n", "no vector cases"),
])
def test_malformed_vectors_name_the_line(tmp_path, edit, message):
    with pytest.raises(FixtureError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_vectors(make_tree(tmp_path, edit(VEC)))
    out = CliRunner().invoke(main, ["fixture", "import-vectors", str(tmp_path / "tests" / "test-vectors" /
                                    "official.vec"), "-o", str(tmp_path / "fx"), "--label", "l"])
    assert out.exit_code == 2 and out.output.count("\n") == 1 and not (tmp_path / "fx").exists()


@pytest.mark.skipif(not DS4_MIRROR.is_dir(), reason="ds4's repository is not mirrored here")
def test_ds4_official_vectors(tmp_path):
    """ds4's own official.vec and prompts, checked against the official API JSON beside them."""
    import json

    def show(path):
        return subprocess.run(["git", "-C", str(DS4_MIRROR), "show", f"HEAD:{path}"], check=True,
                              capture_output=True).stdout

    listing = subprocess.run(["git", "-C", str(DS4_MIRROR), "ls-tree", "-r", "--name-only", "HEAD",
                              "tests/test-vectors"], check=True, capture_output=True, text=True).stdout.split()
    for name in listing:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(show(name))
    cases = read_vectors(tmp_path / "tests" / "test-vectors" / "official.vec")
    assert len(cases) == 5
    for case in cases:
        official = json.loads((tmp_path / "tests" / "test-vectors" / "official" / f"{case.id}.official.json")
                              .read_text())
        assert case.prompt == official["prompt"]
        steps = official["steps"][:len(case.response)]
        assert [bytes(s["token"]["bytes"]) for s in steps] == [p.bytes for p in case.response]
        assert case.continuation == b"".join(bytes(s["token"]["bytes"]) for s in steps).decode()
