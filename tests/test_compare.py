"""quantkit compare: paired bootstrap (vs a slow reference loop), verdict rules, pairing checks, the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.errors import FixtureError, QuantkitError
from quantkit.scoring.compare import MIN_RESAMPLES, bootstrap_interval, compare_tables, verdict
from quantkit.scoring.metrics import ApiCounts, CaseScore, Totals
from quantkit.scoring.source import ModelIdentity
from quantkit.scoring.table import read_table, write_table


def _slow_interval(nll_old, nll_new, tokens, resamples, seed):
    """The textbook loop: draw n case indices with replacement per resample, recompute the token-weighted mean
    NLL difference, take the 2.5th and 97.5th percentiles."""
    rng = np.random.default_rng(seed)
    n = len(nll_old)
    stats = []
    for _ in range(resamples):
        idx = rng.integers(0, n, size=n)
        stats.append((sum(nll_new[i] for i in idx) - sum(nll_old[i] for i in idx)) / sum(tokens[i] for i in idx))
    stats.sort()

    def percentile(q):      # linear interpolation between closest ranks (numpy's default method)
        pos = q * (len(stats) - 1)
        lo = int(pos)
        return stats[lo] + (pos - lo) * (stats[min(lo + 1, len(stats) - 1)] - stats[lo])

    return percentile(0.025), percentile(0.975)


@pytest.mark.parametrize("n, seed", [(7, 0), (12, 5)])
def test_bootstrap_matches_slow_reference(n, seed):
    rng = np.random.default_rng(100 + seed)
    tokens = rng.integers(5, 30, size=n)
    nll_old = rng.uniform(0.2, 1.0, size=n) * tokens
    nll_new = nll_old + rng.normal(0.0, 0.05, size=n) * tokens
    fast = bootstrap_interval(nll_old, nll_new, tokens, resamples=MIN_RESAMPLES, seed=seed)
    slow = _slow_interval(nll_old.tolist(), nll_new.tolist(), tokens.tolist(), MIN_RESAMPLES, seed)
    assert fast == pytest.approx(slow, rel=1e-12, abs=1e-15)


def test_bootstrap_blocks_give_the_same_stream(monkeypatch):
    from quantkit.scoring import compare

    rng = np.random.default_rng(9)
    tokens = rng.integers(5, 30, size=40)
    old, new = rng.uniform(size=40) * tokens, rng.uniform(size=40) * tokens
    whole = bootstrap_interval(old, new, tokens, resamples=12_345, seed=3)
    monkeypatch.setattr(compare, "BLOCK_ELEMENTS", 40 * 7)     # 7 resamples per block, last block partial
    assert bootstrap_interval(old, new, tokens, resamples=12_345, seed=3) == whole


def test_bootstrap_rejects_bad_parameters():
    with pytest.raises(QuantkitError, match="at least 10000"):
        bootstrap_interval([1.0], [1.0], [1], resamples=999)
    with pytest.raises(QuantkitError, match="equal, non-empty"):
        bootstrap_interval([1.0, 2.0], [1.0], [1, 1])


@pytest.mark.parametrize("delta, low, high, expected", [
    (-0.03, -0.04, -0.02, "better"),
    (0.03, 0.02, 0.04, "worse"),
    (-0.01, -0.02, 0.005, "no established difference"),
    (0.01, -0.002, 0.02, "no established difference"),
    (0.0, 0.0, 0.0, "no established difference"),
    (0.001, -0.004, -0.001, "no established difference"),   # point estimate outside its interval: no claim
])
def test_verdict_rules(delta, low, high, expected):
    assert verdict(delta, low, high) == expected


FIXTURE = {"content_sha256": "cd" * 32, "label": "0731", "cases": 0, "path": "fx"}


def _table(tmp_path, name, nll, tokens, first=None, lcp=None, fixture=FIXTURE, top1=None, prompt_tokens=10,
           cross_checkpoint=()):
    n = len(nll)
    first = first if first is not None else [1] * n
    lcp = lcp if lcp is not None else [1] * n
    scores = [CaseScore(f"case_{i:03d}", prompt_tokens, int(tokens[i]), float(nll[i]), first[i], lcp[i], int(tokens[i]),
                        ApiCounts(top1_count=int(tokens[i]), top1_match=int(top1[i] if top1 else tokens[i])))
              for i in range(n)]
    header = {"version": 1, "fixture": dict(fixture, cases=n), "model": ModelIdentity().to_json(), "ctx": 4096,
              "cross_checkpoint": list(cross_checkpoint)}
    path = tmp_path / f"{name}.tsv"
    write_table(path, header, scores, [Totals.of(scores).summary_line()])
    return path


def _pair(n=100, shift=0.0, noise=0.02, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(20, 40, size=n)
    old = rng.uniform(0.3, 0.6, size=n) * tokens
    new = old + (shift + rng.normal(0.0, noise, size=n)) * tokens
    return np.round(old, 9), np.round(new, 9), tokens


def test_compare_better_worse_and_unestablished(tmp_path):
    old, new, tokens = _pair(shift=-0.03)
    result = compare_tables(read_table(_table(tmp_path, "old", old, tokens)),
                            read_table(_table(tmp_path, "new", new, tokens)))
    assert result.verdict == "better" and result.interval[1] < 0 and result.delta < 0
    assert result.wins > 90 and result.wins + result.losses + result.ties == 100
    lines = result.report_lines()
    assert lines[0] == f"fixture={'cd' * 8} label=0731 cases=100 tokens={tokens.sum()}"
    assert "verdict=better" in lines and any(line.startswith("case_wins_new_old_ties=") for line in lines)

    old, new, tokens = _pair(shift=0.0, noise=0.05, seed=1)
    result = compare_tables(read_table(_table(tmp_path, "o2", old, tokens)),
                            read_table(_table(tmp_path, "n2", new, tokens)))
    assert result.verdict == "no established difference" and result.interval[0] < 0 < result.interval[1]


def test_higher_nll_is_never_hidden_behind_greedy_agreement(tmp_path):
    old, new, tokens = _pair(shift=0.02, seed=2)
    n = len(old)
    worse = _table(tmp_path, "new", new, tokens, first=[1] * n, lcp=[9] * n)
    base = _table(tmp_path, "old", old, tokens, first=[0] * n, lcp=[1] * n)
    result = compare_tables(read_table(base), read_table(worse))
    assert result.verdict == "worse"
    assert result.new.first_matches > result.old.first_matches
    assert any("higher NLL" in note and "NLL decides" in note for note in result.notes)


def test_case_wins_with_higher_total_nll_is_noted(tmp_path):
    tokens = np.full(10, 20)
    old = np.full(10, 10.0)
    new = old - 0.1
    new[0] = 20.0                                   # one large loss outweighs nine small wins
    result = compare_tables(read_table(_table(tmp_path, "o", old, tokens)),
                            read_table(_table(tmp_path, "n", new, tokens)))
    assert (result.wins, result.losses, result.ties) == (9, 1, 0) and result.delta > 0
    assert result.verdict != "better" and any("won 9/10" in note for note in result.notes)


@pytest.mark.parametrize("nll, message", [(-5.0, "expected a number >= 0"), (1e308, "nats per target token")])
def test_refuses_a_row_whose_nll_no_model_gives(tmp_path, nll, message):
    """A negative log-likelihood is impossible, and one past float64's sums would give the gate a NaN bound
    (a rule whose interval is NaN never fails): both are refused where they are read."""
    old, new, tokens = _pair(n=5)
    new[2] = nll
    with pytest.raises(FixtureError, match=f"line .*: column nll is .*{message}"):
        read_table(_table(tmp_path, "new", new, tokens))


def test_refuses_tables_that_are_not_paired(tmp_path):
    old, new, tokens = _pair(n=5)
    a = read_table(_table(tmp_path, "a", old, tokens))
    other_fixture = read_table(_table(tmp_path, "b", new, tokens, fixture=dict(FIXTURE, content_sha256="ef" * 32)))
    with pytest.raises(FixtureError, match="scored different fixtures"):
        compare_tables(a, other_fixture)
    fewer = read_table(_table(tmp_path, "c", new[:4], tokens[:4]))
    with pytest.raises(FixtureError, match="different cases"):
        compare_tables(a, fewer)
    retokenized = tokens.copy()
    retokenized[2] += 1
    with pytest.raises(FixtureError, match="case case_002: .* tokenized differently"):
        compare_tables(a, read_table(_table(tmp_path, "d", new, retokenized)))
    # the same fixture rendered otherwise (chat template against raw): the targets follow another prompt
    with pytest.raises(FixtureError, match="case case_000: a prompt of 10 tokens .* but 13 .* rendered"):
        compare_tables(a, read_table(_table(tmp_path, "e", new, tokens, prompt_tokens=13)))


def test_a_table_scored_against_another_checkpoints_fixture_is_noted(tmp_path):
    old, new, tokens = _pair(n=5)
    crossed = ["fixture label '0731', model label '0802'"]
    result = compare_tables(read_table(_table(tmp_path, "a", old, tokens)),
                            read_table(_table(tmp_path, "b", new, tokens, cross_checkpoint=crossed)))
    assert any("another checkpoint" in note and "0802" in note for note in result.notes)


def test_compare_cli(tmp_path):
    old, new, tokens = _pair(shift=-0.03)
    a, b = _table(tmp_path, "old", old, tokens), _table(tmp_path, "new", new, tokens)
    runner = CliRunner()
    out = runner.invoke(main, ["compare", str(a), str(b)])
    assert out.exit_code == 0, out.output
    assert "verdict=better" in out.output and "nll_delta_ci95=[" in out.output
    data = json.loads(runner.invoke(main, ["compare", str(a), str(b), "--json", "--seed", "4"]).output)
    assert data["verdict"] == "better" and data["resamples"] == 10_000 and data["seed"] == 4
    assert sum(data["case_wins_new_old_ties"]) == 100
    bad = tmp_path / "bad.tsv"
    bad.write_text("id\tnll\nx\t1\n")
    out = runner.invoke(main, ["compare", str(a), str(bad)])
    assert out.exit_code == 2 and out.output.count("\n") == 1 and "not a quantkit or ds4 score table" in out.output
    out = runner.invoke(main, ["compare", str(a), str(b), "--resamples", "100"])
    assert out.exit_code == 2
    out = runner.invoke(main, ["compare", str(b), str(a)])         # swapped: new is worse, the NLL blocker fires
    assert out.exit_code == 1 and "verdict=worse" in out.output and "gate=regression exit=1 (failed: nll" in out.output
