"""Per-case fixture metrics, the per-case TSV row and the ``summary`` / ``api_summary`` lines (ds4 semantics).

For a case with prompt ids ``p`` (length P) and continuation ids ``t`` (length T), the model is run once on
``p + t`` and rows ``P-1 .. P+T-2`` of its logits are the teacher-forced distributions of ``t`` (see
:mod:`.logprobs` for log-probabilities, greedy and top-k).  Per case:

``nll``          ``-sum(log p(t_i))``; ``avg_nll`` = nll / T.
``first_match``  1 if the greedy token at the first target position is ``t_0``.
``greedy_lcp``   how many leading target tokens equal the greedy token (longest common prefix).

API metrics use the reference response when it has exactly T positions (else the case is *misaligned*: it is
reported with zero API counts, as ds4 does).  For each position, with the reference's log-probability ``r`` of
the target and its alternatives ``a_0..a_{n-1}`` (best first) mapped to ids:

``api_target_*``   ``|lp - r|`` mean (mae) and signed mean, lp = our log-probability of the target.
``api_top_items``  alternatives listed; ``api_top_mapped``: those mapped to a vocabulary id with a finite
                   local log-probability; ``api_top_coverage`` = mapped / items.
``api_top1_*``     when ``a_0`` maps: count it, and a match when it is our greedy token.
``api_topn_*``     every mapped alternative is a reference item; a hit when it is among our top-n ids, n = the
                   number of alternatives listed at that position (at most 64).
``api_top_mae`` / ``api_top_mean_delta``  over mapped alternatives, our log-probability minus the reference's.
``api_pair_*``     every pair of distinct mapped alternatives whose reference and local log-probability
                   differences both exceed 1e-12 in magnitude; agreement when both order the pair the same way.

Rates are ratios of the summed counts (0 when the denominator is 0), never means of per-case rates.

Line formats (exactly ds4's, ``%.9f`` unless noted)::

    summary cases=<n> tokens=<T total> avg_nll=<total nll / T total> first_match=<cases> avg_lcp=<%.3f per case>
    api_summary ref_tokens=<n> target_tokens=<n> target_mae=<f> target_mean_delta=<f> top_items=<n>
      top_mapped=<n> top_coverage=<f> top1_match=<m>/<c> top1_rate=<f> topn_hit=<h>/<r> topn_recall=<f>
      top_logprob_count=<n> top_mae=<f> top_mean_delta=<f> pair_agree=<a>/<t> pair_rate=<f>

(``api_summary`` is one line.)
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np

from ..errors import FixtureError
from .logprobs import NormalizedRows, top_ids

#: Most alternatives compared per position (ds4's local top-k buffer).
MAX_ALTERNATIVES = 64
#: Log-probability differences at or below this are ties and do not count as a pair.
PAIR_EPSILON = 1e-12


@dataclass
class ApiCounts:
    """The summable API statistics of one case or of a whole fixture (ds4's ``api_metrics``)."""

    target_count: int = 0
    target_abs_delta: float = 0.0
    target_signed_delta: float = 0.0
    top_items: int = 0
    top_mapped: int = 0
    top_logprob_count: int = 0
    top_abs_delta: float = 0.0
    top_signed_delta: float = 0.0
    top1_count: int = 0
    top1_match: int = 0
    topn_ref: int = 0
    topn_hit: int = 0
    pair_total: int = 0
    pair_agree: int = 0

    def __iadd__(self, other: "ApiCounts") -> "ApiCounts":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


def _avg(total: float, n: int) -> float:
    return total / n if n else 0.0


@dataclass
class CaseScore:
    id: str
    prompt_tokens: int
    target_tokens: int
    nll: float
    first_match: int
    greedy_lcp: int
    api_ref_tokens: int
    api: ApiCounts

    @property
    def avg_nll(self) -> float:
        return _avg(self.nll, self.target_tokens)


@dataclass(frozen=True)
class Reference:
    """A case's reference response, mapped to this model's vocabulary: per position the reference target
    log-probability and its alternatives as ``(ids, logprobs)`` (id -1: unmapped)."""

    target_logprobs: np.ndarray            # float64 [positions]
    alternatives: tuple[tuple[np.ndarray, np.ndarray], ...]

    @property
    def positions(self) -> int:
        return len(self.target_logprobs)


def _position_api(row: np.ndarray, logsum: float, greedy: int, ids: np.ndarray, ref_lps: np.ndarray,
                  out: ApiCounts) -> None:
    n_alts = len(ids)
    if n_alts == 0:
        return
    out.top_items += n_alts
    local_top = top_ids(row, min(n_alts, MAX_ALTERNATIVES))
    usable = ids >= 0
    local = np.full(n_alts, -np.inf)
    local[usable] = row[ids[usable]].astype(np.float64) - logsum
    mapped = usable & np.isfinite(local)
    if mapped[0]:
        out.top1_count += 1
        out.top1_match += int(ids[0] == greedy)
    m_ids, m_local, m_ref = ids[mapped], local[mapped], ref_lps[mapped]
    delta = m_local - m_ref
    out.top_mapped += len(m_ids)
    out.top_logprob_count += len(m_ids)
    out.top_abs_delta += float(np.abs(delta).sum())
    out.top_signed_delta += float(delta.sum())
    out.topn_ref += len(m_ids)
    out.topn_hit += int(np.isin(m_ids, local_top).sum())
    m_ids, m_local, m_ref = m_ids[:MAX_ALTERNATIVES], m_local[:MAX_ALTERNATIVES], m_ref[:MAX_ALTERNATIVES]
    a, b = np.triu_indices(len(m_ids), k=1)
    ref_diff, local_diff = m_ref[a] - m_ref[b], m_local[a] - m_local[b]
    counted = (m_ids[a] != m_ids[b]) & (np.abs(ref_diff) >= PAIR_EPSILON) & (np.abs(local_diff) >= PAIR_EPSILON)
    out.pair_total += int(counted.sum())
    out.pair_agree += int((counted & ((ref_diff > 0) == (local_diff > 0))).sum())


def score_case(case_id: str, prompt_tokens: int, targets: Sequence[int], rows: np.ndarray | NormalizedRows,
               reference: Reference | None) -> CaseScore:
    """Metrics of one case from the ``T`` logits rows that predict ``targets`` (module doc), normalized on the
    host unless they come normalized.

    Raises :class:`FixtureError` naming the case when a target has no finite log-probability.
    """
    targets = np.asarray(targets, np.int64)
    normalized = rows if isinstance(rows, NormalizedRows) else NormalizedRows.of(rows)
    rows, logsum, greedy = normalized.rows, normalized.logsum, normalized.greedy
    target_lp = rows[np.arange(len(targets)), targets].astype(np.float64) - logsum
    if not np.isfinite(target_lp).all():
        i = int(np.argmin(np.isfinite(target_lp)))
        raise FixtureError(f"case {case_id}: target token {i} (id {int(targets[i])}) has log-probability "
                           f"{target_lp[i]} under the model")
    matches = greedy == targets
    lcp = len(targets) if matches.all() else int(np.argmin(matches))
    api = ApiCounts()
    if reference is not None and reference.positions == len(targets):
        delta = target_lp - reference.target_logprobs
        api.target_count = len(targets)
        api.target_abs_delta = float(np.abs(delta).sum())
        api.target_signed_delta = float(delta.sum())
        for i, (ids, ref_lps) in enumerate(reference.alternatives):
            _position_api(rows[i], float(logsum[i]), int(greedy[i]), ids, ref_lps, api)
    return CaseScore(case_id, prompt_tokens, len(targets), float(-target_lp.sum()), int(matches[0]), lcp,
                     reference.positions if reference is not None else 0, api)


# -- rows and lines -------------------------------------------------------------------------------------------

COLUMNS = ("id", "prompt_tokens", "target_tokens", "nll", "avg_nll", "first_match", "greedy_lcp",
           "api_ref_tokens", "api_target_tokens", "api_target_mae", "api_target_mean_delta",
           "api_top_items", "api_top_mapped", "api_top_coverage",
           "api_top1_count", "api_top1_match", "api_top1_rate",
           "api_topn_ref", "api_topn_hit", "api_topn_recall",
           "api_top_logprob_count", "api_top_mae", "api_top_mean_delta",
           "api_pair_total", "api_pair_agree", "api_pair_rate")
#: The columns the public ds4 ``score_official.c`` writes (NLL and greedy agreement only; no API metrics).
NLL_COLUMNS = COLUMNS[:7]
_WHOLE = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
FLOAT_COLUMNS = frozenset({"nll", "avg_nll", "api_target_mae", "api_target_mean_delta", "api_top_coverage",
                           "api_top1_rate", "api_topn_recall", "api_top_mae", "api_top_mean_delta",
                           "api_pair_rate"})
#: Float columns that cannot be negative (a negative log-likelihood, mean absolute errors, rates).
NON_NEGATIVE_COLUMNS = FLOAT_COLUMNS - {"api_target_mean_delta", "api_top_mean_delta"}
#: Largest mean NLL per target token a row may hold (nats): far above any model's (a float32 log-softmax spans
#: ~100 nats), far below sums that overflow the comparison's float64 arithmetic.
MAX_NLL_PER_TOKEN = 1e6


def case_row(s: CaseScore, columns: Sequence[str] = COLUMNS) -> str:
    """One TSV row of ``columns`` (a prefix of :data:`COLUMNS`): ``%d`` integers, ``%.9f`` floats."""
    a = s.api
    values = (s.id, s.prompt_tokens, s.target_tokens, s.nll, s.avg_nll, s.first_match, s.greedy_lcp,
              s.api_ref_tokens, a.target_count, _avg(a.target_abs_delta, a.target_count),
              _avg(a.target_signed_delta, a.target_count),
              a.top_items, a.top_mapped, _avg(a.top_mapped, a.top_items),
              a.top1_count, a.top1_match, _avg(a.top1_match, a.top1_count),
              a.topn_ref, a.topn_hit, _avg(a.topn_hit, a.topn_ref),
              a.top_logprob_count, _avg(a.top_abs_delta, a.top_logprob_count),
              _avg(a.top_signed_delta, a.top_logprob_count),
              a.pair_total, a.pair_agree, _avg(a.pair_agree, a.pair_total))
    return "\t".join(f"{v:.9f}" if name in FLOAT_COLUMNS else str(v) for name, v in zip(columns, values))


def parse_row(fields_: Sequence[str], where: str, columns: Sequence[str] = COLUMNS) -> CaseScore:
    """A :class:`CaseScore` from one TSV row of ``columns`` (a prefix of :data:`COLUMNS`); sums are rebuilt
    from the printed means, API counts absent from ``columns`` are zero."""
    if len(fields_) != len(columns):
        raise FixtureError(f"{where}: {len(fields_)} fields, expected {len(columns)}")
    if not fields_[0]:
        raise FixtureError(f"{where}: the case id is empty")
    v: dict[str, float | int | str] = dict.fromkeys(COLUMNS, 0) | {"id": fields_[0]}
    for name, raw in zip(columns[1:], fields_[1:]):
        is_float = name in FLOAT_COLUMNS
        if not (_DECIMAL if is_float else _WHOLE).fullmatch(raw):    # int()/float() also take "1_0", " 1", "nan"
            raise FixtureError(f"{where}: column {name} is {raw!r}, expected a "
                               f"{'decimal number' if is_float else 'whole number'}")
        v[name] = float(raw) if is_float else int(raw)
        if name in FLOAT_COLUMNS and not math.isfinite(v[name]):
            raise FixtureError(f"{where}: column {name} is {raw!r}, expected a finite number")
        if name not in FLOAT_COLUMNS and v[name] < 0:
            raise FixtureError(f"{where}: column {name} is {raw!r}, expected a count >= 0")
        if name in NON_NEGATIVE_COLUMNS and v[name] < 0:
            raise FixtureError(f"{where}: column {name} is {raw!r}, expected a number >= 0")
    api = ApiCounts(v["api_target_tokens"], v["api_target_mae"] * v["api_target_tokens"],
                    v["api_target_mean_delta"] * v["api_target_tokens"], v["api_top_items"], v["api_top_mapped"],
                    v["api_top_logprob_count"], v["api_top_mae"] * v["api_top_logprob_count"],
                    v["api_top_mean_delta"] * v["api_top_logprob_count"], v["api_top1_count"],
                    v["api_top1_match"], v["api_topn_ref"], v["api_topn_hit"], v["api_pair_total"],
                    v["api_pair_agree"])
    if v["nll"] > MAX_NLL_PER_TOKEN * max(1, int(v["target_tokens"])):
        raise FixtureError(f"{where}: column nll is {v['nll']!r}, more than {MAX_NLL_PER_TOKEN:g} nats per target "
                           "token")
    score = CaseScore(str(v["id"]), v["prompt_tokens"], v["target_tokens"], v["nll"], v["first_match"],
                      v["greedy_lcp"], v["api_ref_tokens"], api)
    if score.target_tokens < 1 or score.greedy_lcp > score.target_tokens or score.first_match not in (0, 1) \
            or api.top1_match > api.top1_count or api.topn_hit > api.topn_ref or api.pair_agree > api.pair_total:
        raise FixtureError(f"{where}: inconsistent counts (target_tokens {score.target_tokens}, greedy_lcp "
                           f"{score.greedy_lcp}, first_match {score.first_match}, top1 {api.top1_match}/"
                           f"{api.top1_count}, topn {api.topn_hit}/{api.topn_ref}, pairs {api.pair_agree}/"
                           f"{api.pair_total})")
    return score


@dataclass
class Totals:
    cases: int = 0
    tokens: int = 0
    nll: float = 0.0
    first_matches: int = 0
    lcp: int = 0
    api_ref_tokens: int = 0
    api: ApiCounts = field(default_factory=ApiCounts)

    @classmethod
    def of(cls, scores: Sequence[CaseScore]) -> "Totals":
        api = ApiCounts()
        for s in scores:
            api += s.api
        return cls(len(scores), sum(s.target_tokens for s in scores), sum(s.nll for s in scores),
                   sum(s.first_match for s in scores), sum(s.greedy_lcp for s in scores),
                   sum(s.api_ref_tokens for s in scores), api)

    @property
    def avg_nll(self) -> float:
        return _avg(self.nll, self.tokens)

    @property
    def avg_lcp(self) -> float:
        return _avg(self.lcp, self.cases)

    def summary_line(self) -> str:
        return (f"summary cases={self.cases} tokens={self.tokens} avg_nll={self.avg_nll:.9f} "
                f"first_match={self.first_matches} avg_lcp={self.avg_lcp:.3f}")

    def api_summary_line(self) -> str:
        a = self.api
        return (f"api_summary ref_tokens={self.api_ref_tokens} target_tokens={a.target_count} "
                f"target_mae={_avg(a.target_abs_delta, a.target_count):.9f} "
                f"target_mean_delta={_avg(a.target_signed_delta, a.target_count):.9f} "
                f"top_items={a.top_items} top_mapped={a.top_mapped} "
                f"top_coverage={_avg(a.top_mapped, a.top_items):.9f} "
                f"top1_match={a.top1_match}/{a.top1_count} top1_rate={_avg(a.top1_match, a.top1_count):.9f} "
                f"topn_hit={a.topn_hit}/{a.topn_ref} topn_recall={_avg(a.topn_hit, a.topn_ref):.9f} "
                f"top_logprob_count={a.top_logprob_count} "
                f"top_mae={_avg(a.top_abs_delta, a.top_logprob_count):.9f} "
                f"top_mean_delta={_avg(a.top_signed_delta, a.top_logprob_count):.9f} "
                f"pair_agree={a.pair_agree}/{a.pair_total} pair_rate={_avg(a.pair_agree, a.pair_total):.9f}")
