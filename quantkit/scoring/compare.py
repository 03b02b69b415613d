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
printed (9 decimals).  They are always reported; they never decide anything.

The release gate (``quantkit compare``'s exit code: 0 no regression, 1 a blocker rule fired).  Each rule of
:data:`GATE_RULES` is a rate ``r = sum_c num[c] / sum_c den[c]`` over cases:

==============  =========================================  ==========================  ==============
rule            num / den per case                         unit                        worse when
==============  =========================================  ==========================  ==============
nll             nll / target tokens                        nats per token              higher
first_token     first_match / 1                            fraction of cases           lower
greedy_prefix   greedy_lcp / 1                             tokens per case             lower
api_top1        api top1_match / top1_count                fraction of positions       lower
api_pair_order  api pair_agree / pair_total                fraction of pairs           lower
api_topn        api topn_hit / topn_ref (top-token agr.)   fraction of tokens          lower
==============  =========================================  ==========================  ==============

Its statistic is the *regression* ``R = r_new - r_old`` (NLL) or ``r_old - r_new`` (the others): how much worse
new is.  The interval of every rule comes from the same paired whole-prompt bootstrap as the NLL difference (one
index matrix per block from ``default_rng(seed)``, shared by all rules; a resample's ratio whose denominator sums
to 0 counts as 0).  A rule *fails* when its whole interval lies above its tolerance (``low > tolerance``); a
failing rule is a blocker (exit 1) or advisory (``warn``) as the policy says (:mod:`.policy`).  Equal tables give
``R = 0`` with the interval ``[0, 0]`` for every rule.

API rules need an API reference in both tables: a ds4-nll table has no API columns, and a fixture captured without
API logprobs gives tables whose API counts are all 0.  Then each API rule reports *no API reference* (neither
passed nor failed) and the API rates are not printed (zeros are not parity).

With a baseline (:mod:`.policy`), new's figures (average NLL, first-token matches, average greedy prefix, API
top-1 rate for "top-token" counts) are placed in the band of the releases' recorded figures: within it, better
than every release, or worse than every release.  A baseline recorded on another case or token count is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import FixtureError, QuantkitError
from .metrics import CaseScore, Totals
from .policy import FIGURES, RULE_NAMES, Baseline, Policy, load_policy
from .table import ScoreTable

#: Fewest bootstrap resamples accepted (the comparisons we publish use at least this many).
MIN_RESAMPLES = 10_000
DEFAULT_SEED = 0
CONFIDENCE = 0.95
#: Index matrix elements drawn per block (bounds memory to ~8 bytes x this).
BLOCK_ELEMENTS = 1 << 22
PASS, FAIL, WARN, NO_REFERENCE = "pass", "fail", "warn", "no API reference"
GATE_VERDICTS = ("no regression", "regression")


@dataclass(frozen=True)
class GateRule:
    """One rule of the gate: a rate ``sum(numerator) / sum(denominator)`` over cases (module doc)."""

    name: str
    what: str
    unit: str
    higher_is_worse: bool
    api: bool
    numerator: Callable[[CaseScore], float]
    denominator: Callable[[CaseScore], float]


_RULES = {rule.name: rule for rule in (
    GateRule("nll", "average NLL", "nats/token", True, False, lambda s: round(s.nll, 9), lambda s: s.target_tokens),
    GateRule("first_token", "first-token match rate", "of cases", False, False, lambda s: s.first_match,
             lambda s: 1),
    GateRule("greedy_prefix", "average greedy prefix", "tokens/case", False, False, lambda s: s.greedy_lcp,
             lambda s: 1),
    GateRule("api_top1", "API top-1 agreement", "of positions", False, True, lambda s: s.api.top1_match,
             lambda s: s.api.top1_count),
    GateRule("api_pair_order", "API pair-order agreement", "of pairs", False, True, lambda s: s.api.pair_agree,
             lambda s: s.api.pair_total),
    GateRule("api_topn", "top-token agreement (API top-n recall)", "of tokens", False, True,
             lambda s: s.api.topn_hit, lambda s: s.api.topn_ref),
)}
#: The gate's rules in report order (the policy file names the same ones).
GATE_RULES = tuple(_RULES[name] for name in RULE_NAMES)


@dataclass
class RuleResult:
    name: str
    what: str
    unit: str
    blocker: bool
    tolerance: float
    status: str
    """:data:`PASS`, :data:`FAIL` (a blocker fired), :data:`WARN` (a non-blocker fired) or :data:`NO_REFERENCE`."""
    old: tuple[float, float] | None = None
    """(numerator, denominator) summed over the old table's cases; ``None`` without a reference."""
    new: tuple[float, float] | None = None
    regression: float | None = None
    """How much worse new is (positive: worse), in :attr:`unit`."""
    interval: tuple[float, float] | None = None
    reason: str = ""

    @staticmethod
    def _rate(pair: tuple[float, float]) -> float:
        return pair[0] / pair[1] if pair[1] else 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.name, "what": self.what, "unit": self.unit, "blocker": self.blocker,
                               "tolerance": self.tolerance, "status": self.status,
                               "passed": None if self.status == NO_REFERENCE else self.status == PASS}
        if self.status == NO_REFERENCE:
            return out | {"reason": self.reason}
        return out | {"old": {"value": self._rate(self.old), "numerator": self.old[0], "denominator": self.old[1]},
                      "new": {"value": self._rate(self.new), "numerator": self.new[0], "denominator": self.new[1]},
                      "regression": self.regression, "ci95": list(self.interval)}

    def line(self) -> str:
        head = f"rule {self.name:<14} {self.status.upper() if self.status == FAIL else self.status:<4}"
        if self.status == NO_REFERENCE:
            return f"rule {self.name:<14} {NO_REFERENCE}: {self.reason}"

        def figure(pair):
            if self.name == "nll":
                return f"{self._rate(pair):.9f}"
            if self.name == "greedy_prefix":
                return f"{self._rate(pair):.3f}"
            return f"{int(pair[0])}/{int(pair[1])}={self._rate(pair):.6f}"

        low, high = self.interval
        return (f"{head} regression={self.regression:+.6f} ci95=[{low:.6f}, {high:.6f}] tolerance={self.tolerance:g} "
                f"{self.unit}{'' if self.blocker else ' (advisory)'}; old={figure(self.old)} new={figure(self.new)}")


@dataclass
class BandResult:
    figure: str
    what: str
    status: str
    """``within``, ``better than every release``, ``worse than every release`` or :data:`NO_REFERENCE`."""
    new: float | None
    low: tuple[float, str]
    high: tuple[float, str]
    """The band's ends: (value, release name)."""

    def line(self) -> str:
        if self.new is None:
            return f"band {self.figure}: {NO_REFERENCE} in the new table"
        where = "within the band" if self.status == "within" else f"{self.status}: band"
        return (f"band {self.figure}: new={self.new:.9g} is {where} "
                f"[{self.low[0]:.9g} ({self.low[1]}), {self.high[0]:.9g} ({self.high[1]})]")


@dataclass(frozen=True)
class PairedRatio:
    """A paired statistic over cases: ``sum(new_num)/sum(new_den) - sum(old_num)/sum(old_den)`` over the cases
    drawn (a ratio whose denominator sums to 0 counts as 0, as the tables' rates do).  With equal denominators
    it is computed as ``sum(new_num - old_num) / sum(den)``, the form of the NLL difference."""

    old_num: np.ndarray
    old_den: np.ndarray
    new_num: np.ndarray
    new_den: np.ndarray

    def at(self, idx: np.ndarray) -> np.ndarray:
        """The statistic of each row of case indices ``idx`` (shape ``[rows, n]``)."""
        def ratio(num, den):
            num, den = num[idx].sum(axis=1), den[idx].sum(axis=1)
            return np.divide(num, den, out=np.zeros_like(num), where=den != 0)

        if np.array_equal(self.old_den, self.new_den):
            return ratio(self.new_num - self.old_num, self.old_den)
        return ratio(self.new_num, self.new_den) - ratio(self.old_num, self.old_den)

    def point(self) -> float:
        return float(self.at(np.arange(len(self.old_num))[None])[0])


def paired_intervals(statistics: Sequence[PairedRatio], *, resamples: int = MIN_RESAMPLES, seed: int = DEFAULT_SEED,
                     confidence: float = CONFIDENCE) -> list[tuple[float, float]]:
    """The paired whole-prompt bootstrap interval of each statistic, all from the same resamples (module doc)."""
    if resamples < MIN_RESAMPLES:
        raise QuantkitError(f"resamples must be at least {MIN_RESAMPLES}, found {resamples}")
    if not 0 < confidence < 1:
        raise QuantkitError(f"confidence must be between 0 and 1, found {confidence}")
    lengths = [len(a) for s in statistics for a in (s.old_num, s.old_den, s.new_num, s.new_den)]
    n = lengths[0] if lengths else 0
    if n < 1 or any(length != n for length in lengths):
        raise QuantkitError(f"need equal, non-empty per-case arrays; found lengths {lengths}")
    rng = np.random.default_rng(seed)
    rows = max(1, BLOCK_ELEMENTS // n)
    stats = np.empty((len(statistics), resamples), np.float64)
    for start in range(0, resamples, rows):
        idx = rng.integers(0, n, size=(min(rows, resamples - start), n))
        for i, statistic in enumerate(statistics):
            stats[i, start:start + len(idx)] = statistic.at(idx)
    alpha = (1.0 - confidence) / 2
    return [(float(low), float(high)) for low, high in np.quantile(stats, [alpha, 1.0 - alpha], axis=1).T]


def bootstrap_interval(nll_old: np.ndarray, nll_new: np.ndarray, tokens: np.ndarray, *,
                       resamples: int = MIN_RESAMPLES, seed: int = DEFAULT_SEED,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The paired whole-prompt bootstrap interval of the token-weighted NLL difference (module doc)."""
    tokens = np.asarray(tokens, np.float64)
    statistic = PairedRatio(np.asarray(nll_old, np.float64), tokens, np.asarray(nll_new, np.float64), tokens)
    return paired_intervals([statistic], resamples=resamples, seed=seed, confidence=confidence)[0]


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
    """Whether API metrics are compared: both tables carry the API columns and an API reference."""
    api_state: str = "compared"
    """``compared``, or why not (:func:`_api_state`)."""
    rules: list[RuleResult] = field(default_factory=list)
    policy: str = ""
    baseline: Baseline | None = None
    band: list[BandResult] = field(default_factory=list)
    baseline_blocker: bool = False

    @property
    def failed(self) -> list[str]:
        """The blocker rules that fired (and ``baseline`` when the policy makes its band a blocker)."""
        failed = [r.name for r in self.rules if r.status == FAIL]
        if self.baseline_blocker and any(b.status == "worse than every release" for b in self.band):
            failed.append("baseline")
        return failed

    @property
    def gate_verdict(self) -> str:
        return GATE_VERDICTS[bool(self.failed)]

    @property
    def exit_code(self) -> int:
        """0: no regression; 1: a blocker rule fired (the CLI's exit code)."""
        return 1 if self.failed else 0

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
        rates = [(k, old[k], new[k]) for k in old] if self.api else []     # no zero columns posing as parity
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
                "verdict": self.verdict, "api_reference": self.api_state,
                "rules": [r.to_json() for r in self.rules],
                "baseline": None if self.baseline is None else {
                    "name": self.baseline.name, "source": self.baseline.source, "path": self.baseline.path,
                    "blocker": self.baseline_blocker,
                    "figures": [{"figure": b.figure, "status": b.status, "new": b.new, "band": [list(b.low),
                                 list(b.high)]} for b in self.band]},
                "gate": {"verdict": self.gate_verdict, "exit_code": self.exit_code, "failed": self.failed,
                         "policy": self.policy},
                "notes": self.notes}

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
        if self.api_state != "compared":
            lines.append(f"api_reference=none: {self.api_state}")
        lines.append(f"gate policy={self.policy}: regression = how much worse new is; a rule fails when its whole "
                     f"95% interval lies above its tolerance")
        lines += [r.line() for r in self.rules]
        if self.baseline is not None:
            lines.append(f"baseline {self.baseline.name} ({self.baseline.source}; {self.baseline.path})"
                         + (" blocks when new is worse than every release" if self.baseline_blocker else ""))
            lines += [b.line() for b in self.band]
        failed = self.failed
        lines.append(f"gate={self.gate_verdict} exit={self.exit_code}"
                     + (f" (failed: {', '.join(failed)})" if failed else ""))
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
        if a.prompt_tokens != b.prompt_tokens:   # the same targets after another prompt: another conditional
            raise FixtureError(f"case {a.id}: a prompt of {a.prompt_tokens} tokens in {old.path} but "
                               f"{b.prompt_tokens} in {new.path}: the prompts were rendered (raw or chat template) "
                               f"or tokenized differently, so NLLs are not paired")
    for t in (old, new):
        crossed = (t.header or {}).get("cross_checkpoint")
        if crossed:
            notes.append(f"{t.path} was scored against a fixture of another checkpoint (--allow-cross-checkpoint): "
                         + "; ".join(map(str, crossed)))
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


def _api_state(old: ScoreTable, new: ScoreTable) -> str:
    """``compared`` when both tables carry API columns and an API reference, else why not (never zeros)."""
    lacking = [str(t.path) for t in (old, new) if not t.has_api]
    if lacking:
        return f"{' and '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} no API columns (ds4-nll layout)"
    empty = [str(t.path) for t in (old, new) if t.totals.api_ref_tokens == 0]
    if len(empty) == 2:
        return "the fixture has no API logprobs (no reference responses): API agreement is not measured"
    if empty:
        return f"{empty[0]} was scored without API reference responses"
    return "compared"


def _arrays(table: ScoreTable, rule: GateRule) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([rule.numerator(s) for s in table.scores], np.float64),
            np.array([rule.denominator(s) for s in table.scores], np.float64))


def gate_rules(old: ScoreTable, new: ScoreTable, policy: Policy, api_state: str, *, resamples: int,
               seed: int) -> list[RuleResult]:
    """Every rule of :data:`GATE_RULES` judged under ``policy`` (module doc)."""
    measured, statistics, results = [], [], []
    for rule in GATE_RULES:
        setting = policy.rules[rule.name]
        result = RuleResult(rule.name, rule.what, rule.unit, setting.blocker, setting.tolerance, PASS)
        results.append(result)
        if rule.api and api_state != "compared":
            result.status, result.reason = NO_REFERENCE, api_state
            continue
        (old_num, old_den), (new_num, new_den) = _arrays(old, rule), _arrays(new, rule)
        if rule.api and (old_den.sum() == 0 or new_den.sum() == 0):
            result.status, result.reason = NO_REFERENCE, f"no {rule.what} counts in the reference responses"
            continue
        result.old, result.new = (float(old_num.sum()), float(old_den.sum())), (float(new_num.sum()),
                                                                                 float(new_den.sum()))
        measured.append((rule, result))
        statistics.append(PairedRatio(old_num, old_den, new_num, new_den))
    intervals = paired_intervals(statistics, resamples=resamples, seed=seed)
    for (rule, result), statistic, (low, high) in zip(measured, statistics, intervals):
        if not np.isfinite([low, high, statistic.point()]).all():   # a gate never passes on a NaN bound
            raise FixtureError(f"rule {rule.name}: the tables' values give a non-finite difference or interval "
                               f"({statistic.point()}, [{low}, {high}])")
        sign = 1.0 if rule.higher_is_worse else -1.0
        result.regression = sign * statistic.point() + 0.0          # + 0.0: no "-0.000000"
        result.interval = (low, high) if sign > 0 else (-high + 0.0, -low + 0.0)
        if result.interval[0] > result.tolerance:
            result.status = FAIL if result.blocker else WARN
    return results


def _figures(totals: Totals) -> dict[str, float | None]:
    a = totals.api
    return {"avg_nll": round(totals.avg_nll, 9), "first_token_matches": float(totals.first_matches),
            "avg_greedy_prefix": totals.avg_lcp,
            "top_token_matches": a.top1_match / a.top1_count if a.top1_count else None}


def baseline_band(baseline: Baseline, new: ScoreTable, api_state: str) -> list[BandResult]:
    """Where ``new``'s figures lie in the band of each figure the baseline's releases record (module doc)."""
    totals = new.totals
    if totals.cases != baseline.cases or (baseline.tokens is not None and totals.tokens != baseline.tokens):
        raise FixtureError(f"baseline {baseline.name!r} was recorded on {baseline.cases} cases"
                           + (f" / {baseline.tokens} tokens" if baseline.tokens is not None else "")
                           + f", the table has {totals.cases} cases / {totals.tokens} tokens: another fixture",
                           path=new.path)
    ours = _figures(totals)
    if api_state != "compared":
        ours["top_token_matches"] = None
    bands = []
    for figure, (what, higher_is_worse) in FIGURES.items():
        recorded = [(r.figures[figure], r.name) for r in baseline.releases if figure in r.figures]
        if not recorded:
            continue
        if figure == "top_token_matches":           # recorded as counts of the fixture's tokens: compare rates
            recorded = [(value / baseline.tokens, name) for value, name in recorded]
        low, high = min(recorded), max(recorded)
        value = ours[figure]
        if value is None:
            bands.append(BandResult(figure, what, NO_REFERENCE, None, low, high))
            continue
        worse, better = (value > high[0], value < low[0]) if higher_is_worse else (value < low[0], value > high[0])
        status = "worse than every release" if worse else "better than every release" if better else "within"
        bands.append(BandResult(figure, what, status, value, low, high))
    return bands


def compare_tables(old: ScoreTable, new: ScoreTable, *, resamples: int = MIN_RESAMPLES,
                   seed: int = DEFAULT_SEED, policy: Policy | None = None,
                   baseline: Baseline | None = None) -> Comparison:
    """Compare ``new`` against ``old`` and judge the gate's rules under ``policy`` (default: the shipped one);
    with ``baseline``, place ``new``'s figures in its band (module doc)."""
    policy = policy if policy is not None else load_policy()
    pairing_notes = _check_pairing(old, new)
    nll_old = np.array([round(s.nll, 9) for s in old.scores])
    nll_new = np.array([round(s.nll, 9) for s in new.scores])
    tokens = np.array([s.target_tokens for s in old.scores])
    wins, losses = int((nll_new < nll_old).sum()), int((nll_new > nll_old).sum())
    api_state = _api_state(old, new)
    rules = gate_rules(old, new, policy, api_state, resamples=resamples, seed=seed)
    low, high = rules[0].interval                   # the nll rule: the same paired bootstrap of the NLL difference
    old_totals, new_totals = old.totals, new.totals
    delta = new_totals.avg_nll - old_totals.avg_nll
    fixture = old.fixture if old.fixture is not None else new.fixture
    band = baseline_band(baseline, new, api_state) if baseline is not None else []
    return Comparison(dict(fixture) if fixture is not None else None, old_totals, new_totals, wins, losses,
                      len(tokens) - wins - losses, (low, high), resamples, seed, verdict(delta, low, high),
                      _notes(old_totals, new_totals, delta, wins, losses) + pairing_notes,
                      api_state == "compared", api_state, rules, policy.path, baseline, band,
                      policy.baseline_blocker)
