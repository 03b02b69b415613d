"""quantkit compare as a CI gate: exit codes 0/1/2, each rule's paired interval, the policy file, the no-API state,
baseline bands."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.errors import FixtureError, FormatError
from quantkit.scoring.compare import GATE_RULES, NO_REFERENCE, compare_tables, paired_intervals, PairedRatio
from quantkit.scoring.metrics import ApiCounts, CaseScore, Totals
from quantkit.scoring.policy import (RULE_NAMES, SHIPPED_POLICY, load_baseline, load_policy, shipped_baselines)
from quantkit.scoring.source import ModelIdentity
from quantkit.scoring.table import read_table, write_table

FIXTURE = {"content_sha256": "ab" * 32, "label": "0731", "cases": 0, "path": "fx"}


def _scores(n=100, seed=0, api=True):
    """A plausible table's cases: NLL, greedy agreement and API counts drawn at random."""
    rng = np.random.default_rng(seed)
    scores = []
    for i in range(n):
        tokens = int(rng.integers(20, 40))
        first = int(rng.random() < 0.9)
        lcp = int(rng.integers(1, tokens + 1)) if first else 0
        counts = ApiCounts()
        if api:
            top1 = int(rng.integers(tokens - 5, tokens + 1))
            pairs = int(rng.integers(100, 200))
            counts = ApiCounts(target_count=tokens, top_items=tokens * 5, top_mapped=tokens * 5,
                               top1_count=tokens, top1_match=top1, topn_ref=tokens * 5,
                               topn_hit=int(rng.integers(tokens * 4, tokens * 5 + 1)), pair_total=pairs,
                               pair_agree=int(rng.integers(pairs - 20, pairs + 1)))
        scores.append(CaseScore(f"case_{i:03d}", 12, tokens, round(float(rng.uniform(0.3, 0.6) * tokens), 9), first,
                                lcp, tokens if api else 0, counts))
    return scores


def _write(path, scores, fixture=FIXTURE):
    header = {"version": 1, "fixture": dict(fixture, cases=len(scores)), "model": ModelIdentity().to_json(),
              "ctx": 4096, "cross_checkpoint": []}
    totals = Totals.of(scores)
    write_table(path, header, scores, [totals.summary_line(), totals.api_summary_line()])
    return path


def _planted_first_token_regression(table_path, out_path, k=15):
    """The table at ``table_path`` with ``k`` first-token matches turned into misses (greedy prefix 0), every NLL
    and API count left as it was."""
    table = read_table(table_path)
    scores = [dataclasses.replace(s) for s in table.scores]
    flipped = [i for i, s in enumerate(scores) if s.first_match][:k]
    for i in flipped:
        scores[i].first_match, scores[i].greedy_lcp = 0, 0
    header = dict(table.header)
    write_table(out_path, header, scores, [Totals.of(scores).summary_line(), Totals.of(scores).api_summary_line()])
    return out_path, flipped


def _run(*args):
    return CliRunner().invoke(main, ["compare", *map(str, args)])


def test_rules_and_policy_name_the_same_rules():
    assert tuple(r.name for r in GATE_RULES) == RULE_NAMES
    assert set(load_policy().rules) == set(RULE_NAMES)


def test_planted_first_token_regression_exits_1_with_nll_unchanged(tmp_path):
    base = _write(tmp_path / "base.tsv", _scores())
    planted, flipped = _planted_first_token_regression(base, tmp_path / "planted.tsv")
    old, new = read_table(base), read_table(planted)
    assert [s.nll for s in old.scores] == [s.nll for s in new.scores]
    result = compare_tables(old, new)
    rules = {r.name: r for r in result.rules}
    assert rules["nll"].status == "pass" and rules["nll"].regression == 0 and rules["nll"].interval == (0.0, 0.0)
    first = rules["first_token"]
    assert first.status == "fail" and first.old == (old.totals.first_matches, 100)
    assert first.new == (old.totals.first_matches - len(flipped), 100)
    assert first.regression == pytest.approx(len(flipped) / 100)
    assert first.tolerance < first.interval[0] <= first.regression <= first.interval[1]
    assert rules["api_top1"].status == "pass" and rules["api_top1"].regression == 0   # API counts untouched
    assert result.exit_code == 1 and "first_token" in result.failed and result.gate_verdict == "regression"
    out = _run(base, planted)
    assert out.exit_code == 1, out.output
    assert "gate=regression exit=1 (failed: first_token" in out.output
    assert "case_wins_new_old_ties=0/0/100" in out.output              # case wins always reported
    data = json.loads(_run(base, planted, "--json").output)
    assert data["gate"]["verdict"] == "regression" and data["gate"]["exit_code"] == 1
    by_rule = {r["rule"]: r for r in data["rules"]}
    assert by_rule["first_token"]["passed"] is False and by_rule["nll"]["passed"] is True
    assert set(by_rule["first_token"]) >= {"regression", "ci95", "tolerance", "blocker", "old", "new", "status"}


def test_two_runs_of_one_model_exit_0(tmp_path):
    scores = _scores(seed=3)
    a, b = _write(tmp_path / "run1.tsv", scores), _write(tmp_path / "run2.tsv", scores)
    out = _run(a, b)
    assert out.exit_code == 0, out.output
    assert "gate=no regression exit=0" in out.output
    result = compare_tables(read_table(a), read_table(b))
    assert all(r.status == "pass" and r.regression == 0 and r.interval == (0.0, 0.0) for r in result.rules)


def test_worse_nll_exits_1_and_a_better_model_0(tmp_path):
    scores = _scores(seed=4)
    worse = [dataclasses.replace(s, nll=round(s.nll + 0.05 * s.target_tokens, 9)) for s in scores]
    a, b = _write(tmp_path / "a.tsv", scores), _write(tmp_path / "b.tsv", worse)
    out = _run(a, b)
    assert out.exit_code == 1 and "verdict=worse" in out.output and "(failed: nll)" in out.output
    assert _run(b, a).exit_code == 0


def test_unusable_input_exits_2(tmp_path):
    a = _write(tmp_path / "a.tsv", _scores(n=10))
    bad = tmp_path / "bad.tsv"
    bad.write_text("id\tnll\nx\t1\n")
    other = _write(tmp_path / "other.tsv", _scores(n=10), fixture=dict(FIXTURE, content_sha256="ef" * 32))
    for args in ((a, bad), (a, other), (a, a, "--baseline", "no-such-baseline")):
        out = _run(*args)
        assert out.exit_code == 2 and out.output.count("\n") == 1 and out.output.startswith("error: "), out.output
    assert _run(a, tmp_path / "missing.tsv").exit_code == 2            # click's usage error


@pytest.mark.parametrize("edit, key, message", [
    (lambda t: t.replace("tolerance = 0.02", "tolerance = -1"), "rules.first_token.tolerance", "number >= 0"),
    (lambda t: t.replace("tolerance = 0.02", "tolerance = \"x\""), "rules.first_token.tolerance", "number >= 0"),
    # an integer past float64 (an internal error through math.isfinite)
    (lambda t: t.replace("tolerance = 0.02", "tolerance = 1" + "0" * 400), "rules.first_token.tolerance",
     "number >= 0"),
    (lambda t: t.replace("[rules.api_topn]\n", "[rules.api_topn]\ncolour = 1\n"), "rules.api_topn.colour",
     "unknown key"),
    (lambda t: t.replace("tolerance = 0.005\n", ""), "rules.nll.tolerance", "missing"),
    (lambda t: t.replace("version = 1", "version = 2"), "version", "expected 1"),
    (lambda t: t.replace("blocker = false", "blocker = \"no\""), "baseline.blocker", "true or false"),
    (lambda t: t + "\n[[", None, "not valid TOML"),
])
def test_bad_policy_is_one_line_naming_file_and_key(tmp_path, edit, key, message):
    policy = tmp_path / "policy.toml"
    policy.write_text(edit(SHIPPED_POLICY.read_text()))
    with pytest.raises(FormatError) as info:
        load_policy(policy)
    assert str(policy) in str(info.value) and (key is None or f"field {key!r}" in str(info.value))
    assert message is None or message in str(info.value)
    a = _write(tmp_path / "a.tsv", _scores(n=10))
    out = _run(a, a, "--policy", policy)
    assert out.exit_code == 2 and out.output.count("\n") == 1 and str(policy) in out.output


def test_policy_thresholds_decide(tmp_path):
    base = _write(tmp_path / "base.tsv", _scores())
    planted, _ = _planted_first_token_regression(base, tmp_path / "planted.tsv")
    text = SHIPPED_POLICY.read_text()
    lenient = tmp_path / "lenient.toml"
    lenient.write_text(text.replace("tolerance = 0.02", "tolerance = 0.5").replace("tolerance = 0.5\n\n[rules.api",
                                                                                   "tolerance = 20\n\n[rules.api"))
    out = _run(base, planted, "--policy", lenient)
    assert out.exit_code == 0, out.output
    advisory = tmp_path / "advisory.toml"
    advisory.write_text(text.replace("blocker = true", "blocker = false"))
    out = _run(base, planted, "--policy", advisory)
    assert out.exit_code == 0 and "rule first_token    warn" in out.output, out.output


def test_no_api_reference_is_said_never_zero_parity(tmp_path):
    plain = _scores(seed=5, api=False)
    a, b = _write(tmp_path / "a.tsv", plain), _write(tmp_path / "b.tsv", plain)
    result = compare_tables(read_table(a), read_table(b))
    api_rules = [r for r in result.rules if r.name.startswith("api_")]
    assert api_rules and all(r.status == NO_REFERENCE and r.regression is None for r in api_rules)
    assert not result.api and "no API logprobs" in result.api_state
    text = "\n".join(result.report_lines())
    assert "api_top1_rate" not in text and "api_reference=none" in text and "rule api_top1" in text
    data = result.to_json()
    assert "api_top1_rate" not in data and data["api_reference"] != "compared"
    assert all(r["passed"] is None and "ci95" not in r for r in data["rules"] if r["rule"].startswith("api_"))
    # a ds4-nll table has no API columns at all
    header = read_table(a).header
    write_table(tmp_path / "nll.tsv", header, plain, read_table(a).trailer, layout="ds4-nll")
    result = compare_tables(read_table(a), read_table(tmp_path / "nll.tsv"))
    assert "no API columns" in result.api_state and result.exit_code == 0


def test_proportion_intervals_match_a_slow_paired_bootstrap():
    rng = np.random.default_rng(7)
    n = 30
    old_num, new_num = rng.integers(0, 2, n).astype(float), rng.integers(0, 2, n).astype(float)
    den_old, den_new = rng.integers(1, 5, n).astype(float), rng.integers(1, 5, n).astype(float)
    fast = paired_intervals([PairedRatio(old_num, den_old, new_num, den_new)], resamples=10_000, seed=2)[0]
    draws = np.random.default_rng(2)
    stats = sorted(new_num[idx].sum() / den_new[idx].sum() - old_num[idx].sum() / den_old[idx].sum()
                   for idx in (draws.integers(0, n, size=n) for _ in range(10_000)))
    assert fast == pytest.approx(tuple(np.quantile(stats, [0.025, 0.975])), rel=1e-12)


def test_shipped_baselines_read_and_band(tmp_path):
    assert shipped_baselines() == ["deepseek-v4.1-flash-general-100", "glm-5.3-flash"]
    glm = load_baseline("glm-5.3-flash")
    figures = {r.name: r.figures for r in glm.releases}
    assert figures["GLM-5.3-Flash Q2"] == {"avg_nll": 0.458030488, "first_token_matches": 89,
                                           "avg_greedy_prefix": 7.37}
    scores = _scores()
    a = _write(tmp_path / "a.tsv", scores)
    totals = Totals.of(scores)
    result = compare_tables(read_table(a), read_table(a), baseline=glm)
    band = {b.figure: b for b in result.band}
    expected_nll = ("within" if 0.299917952 <= round(totals.avg_nll, 9) <= 0.458030488
                    else "worse than every release" if totals.avg_nll > 0.458030488 else "better than every release")
    assert band["avg_nll"].status == expected_nll and band["avg_nll"].low == (0.299917952, "GLM-5.3-Flash Q4_K")
    ft = totals.first_matches
    assert band["first_token_matches"].status == ("within" if 89 <= ft <= 90 else
                                                  "better than every release" if ft > 90 else
                                                  "worse than every release")
    out = _run(a, a, "--baseline", "glm-5.3-flash")
    assert out.exit_code == 0 and "baseline glm-5.3-flash" in out.output and "band avg_nll: new=" in out.output
    # a user file; the band blocks only when the policy says so
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"name": "own", "source": "test", "cases": 100, "release": [
        {"name": "r1", "avg_nll": 0.01}, {"name": "r2", "avg_nll": 0.02}]}))
    out = _run(a, a, "--baseline", own, "--json")
    data = json.loads(out.output)
    assert out.exit_code == 0 and data["baseline"]["figures"][0]["status"] == "worse than every release"
    strict = tmp_path / "strict.toml"
    strict.write_text(SHIPPED_POLICY.read_text().replace("[baseline]\n# with --baseline: whether a figure worse than "
                                                         "every recorded release of the baseline blocks (exit 1)\n"
                                                         "blocker = false", "[baseline]\nblocker = true"))
    out = _run(a, a, "--baseline", own, "--policy", strict)
    assert out.exit_code == 1 and "(failed: baseline)" in out.output


def test_baseline_of_another_fixture_or_malformed_is_refused(tmp_path):
    a = read_table(_write(tmp_path / "a.tsv", _scores(n=10)))
    with pytest.raises(FixtureError, match="recorded on 100 cases, .*: another fixture"):
        compare_tables(a, a, baseline=load_baseline("glm-5.3-flash"))
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nsource = "y"\ncases = 10\n[[release]]\nname = "r"\navg_nll = "low"\n')
    with pytest.raises(FormatError, match=r"field 'release\[0\].avg_nll'"):
        load_baseline(bad)
    bad.write_text('name = "x"\nsource = "y"\ncases = 10\n[[release]]\nname = "r"\ntop_token_matches = 5\n')
    with pytest.raises(FormatError, match="needs the baseline's tokens"):
        load_baseline(bad)
