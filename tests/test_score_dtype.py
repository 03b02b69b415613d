"""``score --dtype bfloat16``: a faster compute mode, recorded in the table's evidence, close to float32 but not equal."""
from __future__ import annotations

from click.testing import CliRunner

from quantkit.cli import main
from quantkit.scoring.table import read_table
from test_ds4_tables import _score, example_ggufs  # noqa: F401  (the module fixture: the demo's two conversions)


def test_bfloat16_scores_close_to_float32_and_says_so(tmp_path, example_ggufs):  # noqa: F811
    totals, dtypes = {}, {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.tsv"
        result = _score(example_ggufs, example_ggufs["q2"], out, "--dtype", dtype)
        assert result.exit_code == 0, result.output
        table = read_table(out)
        totals[dtype], dtypes[dtype] = table.totals.avg_nll, table.header["evidence"]["dtype"]
    assert dtypes == {"float32": "float32", "bfloat16": "bfloat16"}
    # bf16 keeps 8 significant bits: the average NLL moves, by far less than the F16-vs-Q2 gap the demo measures
    assert totals["bfloat16"] != totals["float32"]
    assert abs(totals["bfloat16"] - totals["float32"]) < 0.02


def test_bfloat16_with_ggml_arithmetic_is_refused(tmp_path, example_ggufs):  # noqa: F811
    result = _score(example_ggufs, example_ggufs["q2"], tmp_path / "x.tsv", "--dtype", "bfloat16",
                    "--arithmetic", "ggml-cpu")
    assert result.exit_code == 2 and "computes in float32" in result.output
    assert not (tmp_path / "x.tsv").exists()


def test_unknown_dtype_is_a_usage_error(tmp_path, example_ggufs):  # noqa: F811
    result = CliRunner().invoke(main, ["score", str(example_ggufs["q2"]), str(example_ggufs["fixture"]),
                                       "-o", str(tmp_path / "x.tsv"), "--ctx", "512", "--dtype", "float16"])
    assert result.exit_code == 2
