"""ds4 score tables (issue #12 item 4) and the checkpoint label of foreign artifacts (item 5).

The format facts come from ds4's own source, recorded with their lines in ``tests/data/ds4/score_official_format.json``;
the checks below read quantkit's ds4 tables with a parser written here from those ``printf`` formats (not with
quantkit's reader), format the same values with C's ``printf`` where a compiler exists, and load them the way
ds4's ``compare_scores.py`` does.
"""
from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.errors import FixtureError
from quantkit.scoring.compare import compare_tables
from quantkit.scoring.metrics import ApiCounts, CaseScore, Totals
from quantkit.scoring.source import (GGUF_LABEL_KEY, LABEL_FROM_METADATA, LABEL_FROM_NAME, LABEL_FROM_OPTION,
                                     ModelIdentity, file_name_label, gguf_identity, identity_problems, with_label)
from quantkit.scoring.table import LAYOUTS, read_table, sidecar_path, table_text, write_table

FACTS = json.loads((Path(__file__).parent / "data" / "ds4" / "score_official_format.json").read_text())
DS4 = ("ds4", "ds4-nll")
FIXTURE = {"content_sha256": "ab" * 32, "label": "0731", "cases": 0, "path": "fx"}


# -- an independent reader, from the printf formats ------------------------------------------------------------

_CONVERSIONS = {"%s": r"([^\t\n]+)", "%d": r"(-?[0-9]+)", "%.9f": r"(-?[0-9]+\.[0-9]{9})"}


def printf_regex(fmt: str) -> re.Pattern:
    """A regex matching exactly what C's printf prints for ``fmt`` (only the conversions ds4 uses)."""
    parts = re.split(r"(%s|%d|%\.9f)", fmt)
    return re.compile("".join(_CONVERSIONS.get(p, re.escape(p)) for p in parts), re.S)


def parse_ds4(data: bytes, layout: str) -> list[tuple[str, ...]]:
    facts = FACTS["layouts"][layout]
    text = data.decode("utf-8")
    assert text.startswith(facts["column_line"])
    row = printf_regex(facts["row_format"])
    body = text[len(facts["column_line"]):]
    rows, at = [], 0
    while at < len(body):
        match = row.match(body, at)
        assert match is not None, f"not a {layout} row: {body[at:at + 80]!r}"
        rows.append(match.groups())
        at = match.end()
    return rows


def load_like_compare_scores(path: Path) -> dict[str, dict[str, float]]:
    """compare_scores.py's ``load`` as the facts file describes it (DictReader by column name, int/float)."""
    kinds = {"int": int, "float": float, "str": str}
    fields = FACTS["compare_scores_py"]["fields_read"]
    with path.open(newline="", encoding="utf-8") as fp:
        return {row["id"]: {k: kinds[t](row[k]) for k, t in fields.items() if k != "id"}
                for row in csv.DictReader(fp, delimiter="\t")}


def _scores(n=5, seed=0):
    rng = np.random.default_rng(seed)
    scores = []
    for i in range(n):
        t = int(rng.integers(1, 40))
        api = ApiCounts(t, float(rng.uniform(0, 2)) * t, float(rng.normal()) * t, 20 * t, 19 * t, 19 * t,
                        float(rng.uniform(0, 1)), -float(rng.uniform(0, 1)), t, int(rng.integers(0, t + 1)),
                        19 * t, int(rng.integers(0, 19 * t)), 100, 37)
        # NLLs at printf rounding edges: halfway in decimal, tiny, large
        nll = [0.1234567895, 1e-12, 12345.678901234567, float(rng.uniform(0, 100)), 2.5e-10][i % 5]
        scores.append(CaseScore(f"case_{i:04d}", int(rng.integers(1, 500)), t, nll, i % 2, min(i, t), t, api))
    return scores


def _header(n, fixture=FIXTURE):
    return {"version": 1, "fixture": dict(fixture, cases=n), "model": ModelIdentity(label="0731").to_json(),
            "ctx": 4096, "cross_checkpoint": []}


def _expected_values(s: CaseScore) -> list:
    """The 26 column values of a case, computed here from the counts (means = sum / count, 0 when empty)."""
    a = s.api
    mean = lambda total, n: total / n if n else 0.0  # noqa: E731
    return [s.id, s.prompt_tokens, s.target_tokens, s.nll, mean(s.nll, s.target_tokens), s.first_match,
            s.greedy_lcp, s.api_ref_tokens, a.target_count, mean(a.target_abs_delta, a.target_count),
            mean(a.target_signed_delta, a.target_count), a.top_items, a.top_mapped, mean(a.top_mapped, a.top_items),
            a.top1_count, a.top1_match, mean(a.top1_match, a.top1_count), a.topn_ref, a.topn_hit,
            mean(a.topn_hit, a.topn_ref), a.top_logprob_count, mean(a.top_abs_delta, a.top_logprob_count),
            mean(a.top_signed_delta, a.top_logprob_count), a.pair_total, a.pair_agree, mean(a.pair_agree, a.pair_total)]


def test_facts_name_quantkit_layouts():
    for layout in DS4:
        assert "\t".join(LAYOUTS[layout]) + "\n" == FACTS["layouts"][layout]["column_line"]
        conversions = re.findall(r"%s|%d|%\.9f", FACTS["layouts"][layout]["row_format"])
        assert len(conversions) == len(LAYOUTS[layout])
    assert set(FACTS["compare_scores_py"]["fields_read"]) <= set(LAYOUTS["ds4-nll"])


@pytest.mark.parametrize("layout", DS4)
def test_written_ds4_table_parses_with_the_printf_formats(tmp_path, layout):
    scores = _scores()
    path = tmp_path / "out.tsv"
    write_table(path, _header(len(scores)), scores, [Totals.of(scores).summary_line()], layout=layout)
    rows = parse_ds4(path.read_bytes(), layout)
    assert len(rows) == len(scores)
    for row, s in zip(rows, scores):
        expected = _expected_values(s)[:len(row)]
        for raw, value in zip(row, expected):
            assert (raw == value) if isinstance(value, str) else float(raw) == pytest.approx(value, abs=5e-10)
    loaded = load_like_compare_scores(path)
    assert list(loaded) == [s.id for s in scores]
    assert [v["target_tokens"] for v in loaded.values()] == [s.target_tokens for s in scores]
    sidecar = json.loads(sidecar_path(path).read_text())
    assert sidecar["header"] == _header(len(scores)) and sidecar["layout"] == layout


def _c_printf(tmp_path: Path, fmt: str, rows: list[list]) -> bytes:
    """The rows printed by C's printf with ``fmt`` (values passed as exact decimal strings)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    kinds = re.findall(r"%s|%d|%\.9f", fmt)
    read = {"%s": "argv[i + {}]", "%d": "atoi(argv[i + {}])", "%.9f": "strtod(argv[i + {}], 0)"}
    args = ", ".join(read[c].format(k) for k, c in enumerate(kinds))
    src = tmp_path / "rows.c"
    src.write_text("#include <stdio.h>\n#include <stdlib.h>\nint main(int argc, char **argv) {\n"
                   f"    for (int i = 1; i + {len(kinds)} <= argc; i += {len(kinds)})\n"
                   f"        printf({json.dumps(fmt)}, {args});\n    return 0;\n}}\n")
    exe = tmp_path / "rows"
    subprocess.run([cc, "-O0", "-o", str(exe), str(src)], check=True)
    argv = [repr(v) if isinstance(v, float) else str(v) for row in rows for v in row]
    return subprocess.run([str(exe), *argv], check=True, capture_output=True).stdout


@pytest.mark.parametrize("layout", DS4)
def test_rows_are_byte_identical_to_c_printf(tmp_path, layout):
    scores = _scores(40, seed=3)
    facts = FACTS["layouts"][layout]
    expected = facts["column_line"].encode() + _c_printf(
        tmp_path, facts["row_format"], [_expected_values(s)[:len(LAYOUTS[layout])] for s in scores])
    assert table_text(_header(len(scores)), scores, [], layout=layout).encode() == expected


# -- reading and comparing ----------------------------------------------------------------------------------------

def _pair_tables(tmp_path, layout_old, layout_new, *, sidecars=True, shift=-0.03, n=60):
    rng = np.random.default_rng(5)
    tokens = rng.integers(10, 40, size=n)
    old = np.round(rng.uniform(0.3, 0.6, size=n) * tokens, 9)
    new = np.round(old + (shift + rng.normal(0, 0.02, size=n)) * tokens, 9)
    paths = []
    for name, nll, layout in (("old", old, layout_old), ("new", new, layout_new)):
        scores = [CaseScore(f"case_{i:03d}", 10, int(tokens[i]), float(nll[i]), 1, 1, int(tokens[i]),
                            ApiCounts(top1_count=int(tokens[i]), top1_match=int(tokens[i]) - i % 2)) for i in range(n)]
        path = tmp_path / f"{name}-{layout}.tsv"
        write_table(path, _header(n), scores, [Totals.of(scores).summary_line()], layout=layout)
        if not sidecars and layout != "quantkit":
            sidecar_path(path).unlink()
        paths.append(path)
    return paths


@pytest.mark.parametrize("layout", DS4)
def test_ds4_pair_compares_like_the_quantkit_pair(tmp_path, layout):
    reference = compare_tables(*map(read_table, _pair_tables(tmp_path, "quantkit", "quantkit"))).to_json()
    with_sidecars = compare_tables(*map(read_table, _pair_tables(tmp_path, layout, layout))).to_json()
    bare = compare_tables(*map(read_table, _pair_tables(tmp_path, layout, layout, sidecars=False))).to_json()
    mixed = compare_tables(*map(read_table, _pair_tables(tmp_path, "quantkit", layout, sidecars=False))).to_json()
    api_rates = {"api_top1_rate", "api_topn_recall", "api_pair_rate", "api_target_mae"}
    drop = api_rates | {"api_reference", "rules"} if layout == "ds4-nll" else set()
    assert {k: v for k, v in with_sidecars.items() if k not in drop} == \
        {k: v for k, v in reference.items() if k not in drop}
    if layout == "ds4-nll":     # the NLL and greedy rules as with API columns; the API rules have no reference
        rules = {r["rule"]: r for r in with_sidecars["rules"]}
        assert [r for r in reference["rules"] if not r["rule"].startswith("api_")] == \
            [r for name, r in rules.items() if not name.startswith("api_")]
        assert all(r["status"] == "no API reference" for name, r in rules.items() if name.startswith("api_"))
    for result in (bare, mixed):
        assert {k: v for k, v in result.items() if k not in drop | {"fixture", "notes"}} == \
            {k: v for k, v in reference.items() if k not in drop | {"fixture", "notes"}}
        assert any("paired by case ids and target token counts only" in n for n in result["notes"])
    assert bare["fixture"] is None and mixed["fixture"] == reference["fixture"]
    assert reference["verdict"] == "better"


def test_ds4_table_of_another_fixture_or_cases_is_refused(tmp_path):
    old, new = _pair_tables(tmp_path, "quantkit", "ds4")
    other = dict(FIXTURE, content_sha256="cd" * 32)
    scores = list(read_table(new).scores)
    write_table(new, _header(len(scores), other), scores, [Totals.of(scores).summary_line()], layout="ds4")
    with pytest.raises(FixtureError, match="scored different fixtures"):
        compare_tables(read_table(old), read_table(new))
    sidecar_path(new).unlink()
    new.write_text("".join(new.read_text().splitlines(keepends=True)[:-1]))     # ds4 stopped one case early
    with pytest.raises(FixtureError, match="different cases"):
        compare_tables(read_table(old), read_table(new))


def _malformed_ds4(columns_line: str, good_row: str):
    fields = good_row.split("\t")
    yield "row with a missing column", columns_line + "\t".join(fields[:-1]), "line 2: 25 fields, expected 26"
    yield "non-numeric count", columns_line + "\t".join(fields[:2] + ["x12"] + fields[3:]), \
        "line 2: column target_tokens is 'x12', expected a whole number"
    yield "non-numeric real", columns_line + "\t".join(fields[:3] + ["nan"] + fields[4:]), \
        "line 2: column nll is 'nan', expected a decimal number"
    yield "duplicate case id", columns_line + good_row + "\n" + good_row, \
        "line 3: case 'case_0000' appears twice \\(first on line 2\\)"
    yield "comment line", columns_line + good_row + "\n# summary cases=1", "line 3: a '#' line in a ds4 table"
    yield "blank line", columns_line + "\n" + good_row, "line 2: 1 fields, expected 26"
    yield "unknown columns", columns_line.replace("nll\t", "loss\t", 1) + good_row, \
        "line 1: not a quantkit or ds4 score table"
    yield "no rows", columns_line.rstrip("\n"), "the table has no case rows"


def test_malformed_ds4_tables_are_one_line_errors_naming_file_and_line(tmp_path):
    scores = _scores(1)
    good = table_text(_header(1), scores, [], layout="ds4")
    columns_line, row = good.split("\n")[0] + "\n", good.split("\n")[1]
    ok = tmp_path / "ok.tsv"
    ok.write_text(good)
    runner = CliRunner()
    for name, text, message in _malformed_ds4(columns_line, row):
        bad = tmp_path / "bad.tsv"
        bad.write_text(text + "\n")
        out = runner.invoke(main, ["compare", str(ok), str(bad)])
        assert out.exit_code == 2, (name, out.output)
        assert out.output.count("\n") == 1 and str(bad) in out.output, (name, out.output)
        assert re.search(message, out.output), (name, out.output)


def test_stale_or_foreign_sidecar_is_refused(tmp_path):
    scores = _scores(3)
    path = tmp_path / "t.tsv"
    write_table(path, _header(3), scores, [Totals.of(scores).summary_line()], layout="ds4")
    assert read_table(path).header == _header(3)
    path.write_text(path.read_text().replace("case_0002", "case_0009"))
    with pytest.raises(FixtureError, match="sidecar was written for other table bytes"):
        read_table(path)
    write_table(path, _header(4), scores, [Totals.of(scores).summary_line()], layout="ds4")
    with pytest.raises(FixtureError, match="3 case rows but its fixture has 4 cases"):
        read_table(path)
    write_table(path, _header(3), scores, ["summary cases=3 tokens=1 avg_nll=0 first_match=0 avg_lcp=0"],
                layout="ds4")
    with pytest.raises(FixtureError, match="the summary line says"):
        read_table(path)


# -- the checkpoint label of foreign artifacts --------------------------------------------------------------------

@pytest.mark.parametrize("name, label", [
    ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf", "0731"),
    ("GLM-5.3-Flash-Q2-0802-00001-of-00002.gguf", "0802"),
    ("/models/x-0731/DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf", None),   # ds4's README names
    ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-fixed.gguf", None),
    ("DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp.gguf", None),
    ("model-07310.gguf", None), ("model-0731.gguf.partial", None), ("0731.gguf", None),
])
def test_label_from_a_ds4_file_name(name, label):
    assert file_name_label(name) == label


def test_label_sources_in_order():
    named = "/m/GLM-5.3-Flash-Q2-0731.gguf"
    assert gguf_identity({GGUF_LABEL_KEY: "0800"}, path=named).label == "0800"              # metadata first
    assert gguf_identity({GGUF_LABEL_KEY: "0800"}, path=named).label_from == LABEL_FROM_METADATA
    by_name = gguf_identity({}, path=named)
    assert (by_name.label, by_name.label_from) == ("0731", LABEL_FROM_NAME)
    unlabelled = gguf_identity({}, path="/m/GLM-5.3-Flash-Q2.gguf")
    assert unlabelled.label is None and unlabelled.label_from is None
    given = with_label(unlabelled, "0731")
    assert (given.label, given.label_from) == ("0731", LABEL_FROM_OPTION)
    assert with_label(by_name, "0731") == by_name and with_label(by_name, None) == by_name
    with pytest.raises(FixtureError, match="--label '0800' differs from the model's own checkpoint label '0731' "
                                           "\\(from the file name\\)"):
        with_label(by_name, "0800")
    fixture = ModelIdentity(label="0800")
    assert identity_problems(fixture, by_name) == ["checkpoint label differs: fixture '0800', model '0731' "
                                                   "(from the file name)"]
    assert "pass --label" in identity_problems(fixture, unlabelled)[0]
    assert identity_problems(fixture, with_label(unlabelled, "0800")) == []


# -- end to end on the bundled example model ----------------------------------------------------------------------

#: Cases of the bundled fixture scored here (all 100 take minutes per model on a loaded CPU).
EXAMPLE_CASES = 12


@pytest.fixture(scope="module")
def example_ggufs(tmp_path_factory):
    """The demo's two conversions of the bundled model (F16 control, Q2 candidate; quantkit GGUFs) and the first
    :data:`EXAMPLE_CASES` cases of its fixture, with the fixture's identity."""
    from quantkit import examples
    from quantkit.fixtures.directory import read_fixture, write_fixture

    out = tmp_path_factory.mktemp("example")
    runner = CliRunner()
    paths = {}
    for name, recipe, imatrix in (("f16", "tiny-moe-f16", None),
                                  ("q2", "tiny-moe-iq2xxs-w2q2k", examples.example_imatrix())):
        paths[name] = out / f"tiny-moe-{name}.gguf"
        args = ["convert", str(examples.example_model_dir()), "-o", str(paths[name]), "--recipe",
                str(examples.example_recipe(recipe)), "--label", examples.FIXTURE_LABEL, "--pre-tokenizer",
                examples.PRE_TOKENIZER, "--no-progress", "-j", "1"]
        result = runner.invoke(main, args + (["--imatrix", str(imatrix)] if imatrix else []))
        assert result.exit_code == 0, result.output
    full = read_fixture(examples.example_fixture_dir())
    paths["fixture"] = write_fixture(out / "fixture", full.cases[:EXAMPLE_CASES], label=full.label,
                                     source=full.info.source, rendering=full.rendering, capture=None).path
    return paths


def _score(ggufs, model, out, *extra):
    return CliRunner().invoke(main, ["score", str(model), str(ggufs["fixture"]), str(out), "--ctx", "512", *extra])


def test_example_model_ds4_tables_give_the_same_comparison(tmp_path, example_ggufs):
    tables = {}
    for fmt in ("quantkit", "ds4"):
        for name in ("f16", "q2"):
            tables[fmt, name] = tmp_path / f"{name}-{fmt}.tsv"
            result = _score(example_ggufs, example_ggufs[name], tables[fmt, name], "--format", fmt)
            assert result.exit_code == 0, result.output
    assert sidecar_path(tables["ds4", "q2"]).is_file() and not sidecar_path(tables["quantkit", "q2"]).exists()
    assert len(parse_ds4(tables["ds4", "q2"].read_bytes(), "ds4")) == EXAMPLE_CASES
    runner = CliRunner()

    def compare(old, new):
        result = runner.invoke(main, ["compare", str(old), str(new), "--json"])
        data = json.loads(result.output)
        assert result.exit_code == data["gate"]["exit_code"], result.output      # 1: a blocker rule fired
        return data

    reference = compare(tables["quantkit", "f16"], tables["quantkit", "q2"])
    assert reference["delta_new_minus_old"] > 0       # Q2 fits the fixture worse than F16
    for name in ("f16", "q2"):      # two runs of one model (one table per layout): no regression, exit 0
        again = runner.invoke(main, ["compare", str(tables["quantkit", name]), str(tables["ds4", name])])
        assert again.exit_code == 0 and "gate=no regression exit=0" in again.output, again.output
    record = read_table(tables["quantkit", "q2"]).header["evidence"]     # what produced the table
    gguf = example_ggufs["q2"]
    assert record["artifact"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert record["artifact"]["size"] == gguf.stat().st_size and record["device"] == "cpu"
    assert record["dtype"] == "float32" and record["threads_from"] == "torch" and "torch" in record["tools"]
    assert record["fixture"]["content_sha256"] == read_table(tables["quantkit", "q2"]).fixture_sha256
    assert compare(tables["ds4", "f16"], tables["ds4", "q2"]) == reference
    assert compare(tables["ds4", "f16"], tables["quantkit", "q2"]) == reference
    for key in ("f16", "q2"):
        sidecar_path(tables["ds4", key]).unlink()
    bare = compare(tables["ds4", "f16"], tables["quantkit", "q2"])
    for key in ("verdict", "delta_new_minus_old", "nll_delta_ci95", "case_wins_new_old_ties", "avg_nll", "rules",
                "gate"):
        assert bare[key] == reference[key]


def _without_quantkit_keys(src: Path, dst: Path) -> Path:
    """A copy of a quantkit GGUF as a foreign tool would have written it: no ``quantkit.*`` metadata."""
    from quantkit.io.gguf_reader import GGUFFile
    from quantkit.io.gguf_writer import GGUFWriter, plan_layout

    with GGUFFile(src) as f:
        metadata = [(k, v) for k, v in f.metadata.items() if not k.startswith("quantkit.")]
        layout = plan_layout(metadata, f.tensors.values())
        writer = GGUFWriter(dst, layout)
        writer.write_header()
        for name in f.tensors:
            writer.write_tensor(name, f.data(name))
        writer.finish()
    return dst


def test_foreign_gguf_needs_a_label_that_matches_the_fixture(tmp_path, example_ggufs):
    from quantkit import examples

    tokenizer = ["--tokenizer", str(examples.example_model_dir())]
    plain = _without_quantkit_keys(example_ggufs["f16"], tmp_path / "tiny-moe-f16.gguf")
    out = tmp_path / "a.tsv"
    result = _score(example_ggufs, plain, out, *tokenizer)
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "pass --label" in result.output
    named = plain.rename(tmp_path / "tiny-moe-f16-0731.gguf")
    result = _score(example_ggufs, named, out, *tokenizer)
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert f"checkpoint label differs: fixture '{examples.FIXTURE_LABEL}', model '0731' (from the file name)" \
        in result.output
    result = _score(example_ggufs, named, out, *tokenizer, "--label", examples.FIXTURE_LABEL)
    assert result.exit_code == 2 and "differs from the model's own checkpoint label '0731'" in result.output
    assert not out.exists()
    plain = named.rename(tmp_path / "tiny-moe-f16.gguf")
    result = _score(example_ggufs, plain, out, *tokenizer, "--label", examples.FIXTURE_LABEL, "--format", "ds4")
    assert result.exit_code == 0, result.output
    assert read_table(out).header["model"]["label_from"] == LABEL_FROM_OPTION
    # a quantkit GGUF's metadata label wins over a -NNNN name
    labelled = shutil.copy(example_ggufs["f16"], tmp_path / "tiny-moe-f16-0731.gguf")
    result = _score(example_ggufs, labelled, tmp_path / "b.tsv", "--format", "ds4-nll")
    assert result.exit_code == 0, result.output
    assert read_table(tmp_path / "b.tsv").header["model"]["label_from"] == LABEL_FROM_METADATA
    compared = CliRunner().invoke(main, ["compare", str(out), str(tmp_path / "b.tsv")])
    assert compared.exit_code == 0 and "verdict=no established difference" in compared.output
