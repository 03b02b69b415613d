"""Compare two score tables of one fixture: metric deltas, case wins, paired bootstrap interval, verdict.

Refused (:class:`FixtureError`): tables of different fixtures (their headers' ``content_sha256`` differ), or with
different case ids or order, or with a different target token count for a case (the fixture was tokenized
differently, so per-case NLLs are not paired).  Tables of any layout mix (:mod:`.table`); a ds4 table without
a sidecar does not say which fixture it scored, so the pair is checked by case ids and token counts only, and a
note says so.  API metrics are compared only when both tables carry them.

Statistic: the token-weighted average NLL difference ``Δ = Σ_c (nll_new[c] - nll_old[c]) / Σ_c T[c]`` (new minus
old; negative = new is better), the same average the ``summary`` line prints.  Its 95% interval comes from the
paired whole-prompt bootstrap: each resample draws ``n`` cases with replacement from the ``n`` cases (both
tables keep their pairing) and recomputes Δ over the drawn cases; the interval is the 2.5th and 97.5th
percentile (linear interpolation, ``numpy.quantile``) of :data:`MIN_RESAMPLES` or more resamples from
``numpy.random.default_rng(seed)``, drawn ``integers(0, n, size=(rows, n))`` in row blocks (the same stream as one
``integers(0, n, size=n)`` call per resample).

Verdict, on NLL only: ``better`` when the whole interval is below zero (and Δ < 0), ``worse`` when it is above
zero (and Δ > 0), else ``no established difference``.  Greedy agreement never changes the verdict: a higher NLL
with better first-token or prefix agreement is said in a note, never reported as an improvement.

Case wins: a case is a win for new when its NLL is lower than old's, a loss when higher, a tie when equal as
printed (9 decimals).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import FixtureError, QuantkitError
from .metrics import Totals
from .table import ScoreTable

#: Fewest bootstrap resamples accepted (the comparisons we publish use at least this many).
MIN_RESAMPLES = 10_000
DEFAULT_SEED = 0
CONFIDENCE = 0.95
#: Index matrix elements drawn per block (bounds memory to ~8 bytes x this).
BLOCK_ELEMENTS = 1 << 22
VERDICTS = ("better", "worse", "no established difference")


def bootstrap_interval(nll_old: np.ndarray, nll_new: np.ndarray, tokens: np.ndarray, *,
                       resamples: int = MIN_RESAMPLES, seed: int = DEFAULT_SEED,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The paired whole-prompt bootstrap interval of the token-weighted NLL difference (module doc)."""
    if resamples < MIN_RESAMPLES:
        raise QuantkitError(f"resamples must be at least {MIN_RESAMPLES}, found {resamples}")
    if not 0 < confidence < 1:
        raise QuantkitError(f"confidence must be between 0 and 1, found {confidence}")
    n = len(nll_old)
    if n < 1 or len(nll_new) != n or len(tokens) != n:
        raise QuantkitError(f"need equal, non-empty per-case arrays; found {len(nll_old)}, {len(nll_new)}, "
                            f"{len(tokens)}")
    diff = np.asarray(nll_new, np.float64) - np.asarray(nll_old, np.float64)
    tokens = np.asarray(tokens, np.float64)
    rng = np.random.default_rng(seed)
    rows = max(1, BLOCK_ELEMENTS // n)
    stats = np.empty(resamples, np.float64)
    for start in range(0, resamples, rows):
        idx = rng.integers(0, n, size=(min(rows, resamples - start), n))
        stats[start:start + len(idx)] = diff[idx].sum(axis=1) / tokens[idx].sum(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(low), float(high)


def verdict(delta: float, low: float, high: float) -> str:
    if high < 0 and delta < 0:
        return "better"
    if low > 0 and delta > 0:
        return "worse"
    return "no established difference"


@dataclass
class Comparison:
    fixture: dict[str, Any] | None
    """The fixture record both tables share (``None``: neither table says which fixture it scored)."""
    old: Totals
    new: Totals
    wins: int
    losses: int
    ties: int
    interval: tuple[float, float]
    resamples: int
    seed: int
    verdict: str
    notes: list[str] = field(default_factory=list)
    api: bool = True
    """Whether both tables carry the API metric columns (a ds4-nll table does not)."""

    @property
    def delta(self) -> float:
        return self.new.avg_nll - self.old.avg_nll

    def metrics(self) -> list[tuple[str, float, float]]:
        """``(name, old, new)`` of every compared rate or mean (lower is better only for ``api_target_mae``)."""
        def api(t: Totals) -> dict[str, float]:
            a = t.api
            ratio = lambda x, y: x / y if y else 0.0  # noqa: E731
            return {"api_top1_rate": ratio(a.top1_match, a.top1_count),
                    "api_topn_recall": ratio(a.topn_hit, a.topn_ref),
                    "api_pair_rate": ratio(a.pair_agree, a.pair_total),
                    "api_target_mae": ratio(a.target_abs_delta, a.target_count)}

        old, new = api(self.old), api(self.new)
        rates = [(k, old[k], new[k]) for k in old] if self.api else []
        return [("avg_greedy_lcp", self.old.avg_lcp, self.new.avg_lcp)] + rates

    def to_json(self) -> dict[str, Any]:
        return {"fixture": self.fixture, "avg_nll": {"old": self.old.avg_nll, "new": self.new.avg_nll},
                "delta_new_minus_old": self.delta,
                "relative": self.delta / self.old.avg_nll if self.old.avg_nll else None,
                "nll_delta_ci95": list(self.interval), "resamples": self.resamples, "seed": self.seed,
                "case_wins_new_old_ties": [self.wins, self.losses, self.ties],
                "first_token_matches": {"old": self.old.first_matches, "new": self.new.first_matches,
                                        "cases": self.old.cases},
                **{name: {"old": o, "new": n} for name, o, n in self.metrics()},
                "verdict": self.verdict, "notes": self.notes}

    def report_lines(self) -> list[str]:
        f = self.fixture
        named = f"fixture={f['content_sha256'][:16]} label={f['label']}" if f is not None else "fixture=unknown"
        rel = f" relative={100 * self.delta / self.old.avg_nll:+.3f}%" if self.old.avg_nll else ""
        lines = [f"{named} cases={self.old.cases} tokens={self.old.tokens}",
                 f"avg_nll old={self.old.avg_nll:.9f} new={self.new.avg_nll:.9f}",
                 f"delta_new_minus_old={self.delta:+.9f}{rel}",
                 f"nll_delta_ci95=[{self.interval[0]:+.9f},{self.interval[1]:+.9f}] resamples={self.resamples} "
                 f"seed={self.seed} (paired whole-prompt bootstrap)",
                 f"case_wins_new_old_ties={self.wins}/{self.losses}/{self.ties}",
                 f"first_token_matches old={self.old.first_matches}/{self.old.cases} "
                 f"new={self.new.first_matches}/{self.new.cases} "
                 f"delta={self.new.first_matches - self.old.first_matches:+d}"]
        lines += [f"{name} old={o:.9f} new={n:.9f} delta={n - o:+.9f}" for name, o, n in self.metrics()]
        lines.append(f"verdict={self.verdict}")
        lines += [f"note: {note}" for note in self.notes]
        return lines


def _check_pairing(old: ScoreTable, new: ScoreTable) -> list[str]:
    """Refuse an unpaired pair (module doc); return notes on what could not be checked."""
    notes = []
    if old.fixture is not None and new.fixture is not None:
        if old.fixture_sha256 != new.fixture_sha256:
            raise FixtureError(f"the tables scored different fixtures: {old.path} has {old.fixture_sha256[:16]}… "
                               f"(label {old.fixture['label']!r}), {new.path} has {new.fixture_sha256[:16]}… "
                               f"(label {new.fixture['label']!r})")
    else:
        unknown = [str(t.path) for t in (old, new) if t.fixture is None]
        notes.append(f"{' and '.join(unknown)} {'does' if len(unknown) == 1 else 'do'} not record which fixture "
                     "was scored (ds4 table without a sidecar): paired by case ids and target token counts only")
    old_ids, new_ids = [s.id for s in old.scores], [s.id for s in new.scores]
    if old_ids != new_ids:
        raise FixtureError(f"the tables list different cases or orders ({old.path}: {len(old_ids)} cases "
                           f"{old_ids[:3]}…, {new.path}: {len(new_ids)} cases {new_ids[:3]}…)")
    for a, b in zip(old.scores, new.scores):
        if a.target_tokens != b.target_tokens:
            raise FixtureError(f"case {a.id}: {a.target_tokens} target tokens in {old.path} but {b.target_tokens} "
                               f"in {new.path}: the fixture was tokenized differently, so NLLs are not paired")
    return notes


def _notes(old: Totals, new: Totals, delta: float, wins: int, losses: int) -> list[str]:
    notes = []
    greedy_better = [name for name, o, n in (("first-token match", old.first_matches, new.first_matches),
                                              ("greedy prefix", old.avg_lcp, new.avg_lcp)) if n > o]
    if delta > 0 and greedy_better:
        notes.append(f"new has the higher NLL ({delta:+.9f}) although its {' and '.join(greedy_better)} "
                     "improved; NLL decides the verdict")
    if delta > 0 and wins > losses:
        notes.append(f"new won {wins}/{wins + losses} decided cases despite a higher NLL overall")
    if delta < 0 and losses > wins:
        notes.append(f"new lost {losses}/{wins + losses} decided cases despite a lower NLL overall")
    return notes


def compare_tables(old: ScoreTable, new: ScoreTable, *, resamples: int = MIN_RESAMPLES,
                   seed: int = DEFAULT_SEED) -> Comparison:
    """Compare ``new`` against ``old`` (module doc)."""
    pairing_notes = _check_pairing(old, new)
    nll_old = np.array([round(s.nll, 9) for s in old.scores])
    nll_new = np.array([round(s.nll, 9) for s in new.scores])
    tokens = np.array([s.target_tokens for s in old.scores])
    wins, losses = int((nll_new < nll_old).sum()), int((nll_new > nll_old).sum())
    low, high = bootstrap_interval(nll_old, nll_new, tokens, resamples=resamples, seed=seed)
    old_totals, new_totals = old.totals, new.totals
    delta = new_totals.avg_nll - old_totals.avg_nll
    fixture = old.fixture if old.fixture is not None else new.fixture
    return Comparison(dict(fixture) if fixture is not None else None, old_totals, new_totals, wins, losses,
                      len(tokens) - wins - losses, (low, high), resamples, seed, verdict(delta, low, high),
                      _notes(old_totals, new_totals, delta, wins, losses) + pairing_notes,
                      old.has_api and new.has_api)
