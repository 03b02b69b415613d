"""Reference samplers: the law a serving engine must sample by, and the faulty law the receipts must tell apart.

Numpy only (no torch), so ``quantkit parity`` replays a stream without the runtime.

**The classic law** (:func:`classic_distribution`), per step, in this order:

1. penalties on the raw logits, in float64: ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``, where
   ``count`` counts the tokens generated so far in this request (the prompt excluded); both penalties clamped to
   ``[-2, 2]`` (OpenAI's formula and range);
2. temperature: ``T <= 0`` is greedy, the first maximum of the penalized logits (the lowest id among ties), and
   draws nothing from the stream; otherwise the softmax of ``logits / T`` over the *whole* vocabulary, float64;
3. rank: probability descending, ties by ascending token id (the deterministic tie order);
4. top-k (``0 < k < vocab``; 0 or ``>= vocab`` is off): the first ``k`` of the ranking;
5. top-p (``0 < p < 1``; ``p <= 0`` and ``p >= 1`` are off): keep a ranked token while the *full-softmax* mass of
   the tokens ranked before it is below ``p`` -- so the token that crosses ``p`` is kept -- intersected with 4;
6. renormalize the kept probabilities (dense over the vocabulary, zeros elsewhere), and draw.

**The draw** (:func:`draw`): one ``Generator.random()`` double per sampled token from one request stream
``numpy.random.Generator(numpy.random.PCG64(seed))`` (= ``numpy.random.default_rng(seed)``), mapped to a token by
``searchsorted(cdf, u, side="right")`` over the cumulative sum of the renormalized probabilities *in vocabulary
id order*, divided by its last element -- exactly what ``rng.choice(vocab, p=probs)`` does, which is how the
reference draws (``tests/test_sampling.py`` proves the two equal over many seeds).

Source and what was confirmed: MTPLX's NumPy reference sampler ``mtplx/sampling.py`` (the public repository
youssofal/MTPLX; the stored version read was commit 49a1948c, *not* the 2.12.2 release rev 9882703, which could
not be fetched here).  Confirmed there: penalties on raw logits before temperature, clamped to [-2, 2], counts over
completion tokens only; float64 softmax over the full vocabulary (``T <= 0``: one-hot argmax); ties broken by
vocabulary id (``lexsort((ids, -probs))``); top-p mass from the full softmax with ``cumulative_before < top_p``
(the crossing token kept), active only for ``0 < top_p < 1``; top-k active only for ``0 < k < vocab``, top-p and
top-k masks intersected (equal to top-k-then-top-p, since the top-k ids are a prefix of the ranking); renormalize;
``rng.choice(np.arange(vocab), p=probs / probs.sum())``.  Not confirmed: where the request's generator is created
and seeded (we assume ``default_rng(seed)`` once per request, as the issue states), and whether a ``T = 0`` step
consumes a draw there (MTPLX's ``sample_from_distribution`` on a one-hot row would; greedy here draws nothing,
which differs only for a request that mixes temperatures).

**The faulty "top-k-renormalized" law** (:func:`top_k_renormalized_distribution`): as the classic one, but the
top-p mass is taken over the top-k slice renormalized to 1, so a token the full softmax needs can be cut.  This is
what a Qwen3.8 serving lane did (``CONTEXT.md``, "Sampling parity"); it is also ds4's own law for DeepSeek and
GLM (``ds4.c`` ``sample_top_p_min_p``: the top-k candidates' ``expf((v - max)/T)`` summed, ``filtered_sum / sum >=
top_p`` over that slice; ds4 draws with its own xorshift64* generator, a 24-bit float ``((x >> 40) & 0xffffff) /
2^24`` times the kept mass, subtracting probabilities in rank order; top-k capped at 1024, ``top_p <= 0`` or ``> 1``
means 1, ``T <= 0`` argmax).  The receipt: logits ``ln([.4, .3, .3/62 x 62])``, ``T = 1, k = 2, p = .5``: the
classic law keeps tokens 0 and 1 with ``.4/.7`` and ``.3/.7``; the faulty law keeps token 0 alone (``.4/.7 >= .5``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .errors import ValidationError

#: OpenAI's (and MTPLX's) range of presence and frequency penalties.
PENALTY_RANGE = (-2.0, 2.0)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (module doc); the defaults are Qwen's official setting."""

    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise ValidationError(f"sampling {name} must be finite, got {getattr(self, name)}")
        if self.top_k < 0:
            raise ValidationError(f"sampling top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty}


def request_stream(seed: int) -> np.random.Generator:
    """The request's one random stream: numpy's PCG64 seeded with ``seed``."""
    return np.random.Generator(np.random.PCG64(seed))


def penalized(logits: np.ndarray, counts: Counter | None, presence: float, frequency: float) -> np.ndarray:
    """float64 logits minus the presence/frequency penalties of the generated ``counts`` (module doc, step 1)."""
    out = np.array(logits, dtype=np.float64)
    presence, frequency = (float(np.clip(v, *PENALTY_RANGE)) for v in (presence, frequency))
    if counts and (presence or frequency):
        ids = np.fromiter(counts.keys(), np.int64, len(counts))
        n = np.fromiter(counts.values(), np.float64, len(counts))
        out[ids] -= frequency * n + presence * (n > 0)
    return out


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    scaled = logits / float(temperature)
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def _ranking(probs: np.ndarray) -> np.ndarray:
    """Token ids by probability descending, ties by ascending id."""
    return np.lexsort((np.arange(len(probs)), -probs))


def _one_hot(size: int, token: int) -> np.ndarray:
    out = np.zeros(size)
    out[token] = 1.0
    return out


def _check_row(logits: np.ndarray) -> np.ndarray:
    row = np.asarray(logits)
    if row.ndim != 1 or row.size == 0:
        raise ValidationError(f"sampling needs one logits row, got shape {list(row.shape)}")
    if not np.isfinite(row).all():
        raise ValidationError(f"non-finite logit at token {int(np.flatnonzero(~np.isfinite(row))[0])}")
    return row


def classic_distribution(logits: np.ndarray, params: SamplingParams, counts: Counter | None = None) -> np.ndarray:
    """The classic law's float64 distribution over the vocabulary for one logits row (module doc, steps 1-6)."""
    row = penalized(_check_row(logits), counts, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return _one_hot(len(row), int(np.argmax(row)))
    probs = _softmax(row, params.temperature)
    order = _ranking(probs)
    keep = np.ones(len(probs), bool)
    if 0 < params.top_k < len(probs):
        keep[order[params.top_k:]] = False
    if 0 < params.top_p < 1:
        mass_before = np.concatenate(([0.0], np.cumsum(probs[order])[:-1]))
        keep[order[mass_before >= params.top_p]] = False
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def top_k_renormalized_distribution(logits: np.ndarray, params: SamplingParams,
                                    counts: Counter | None = None) -> np.ndarray:
    """The faulty law (module doc): top-p mass measured on the top-k slice renormalized to 1."""
    row = penalized(_check_row(logits), counts, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return _one_hot(len(row), int(np.argmax(row)))
    probs = _softmax(row, params.temperature)
    order = _ranking(probs)
    if 0 < params.top_k < len(probs):
        order = order[:params.top_k]
    slice_probs = probs[order] / probs[order].sum()
    if 0 < params.top_p < 1:
        mass_before = np.concatenate(([0.0], np.cumsum(slice_probs)[:-1]))
        order, slice_probs = order[mass_before < params.top_p], slice_probs[mass_before < params.top_p]
    out = np.zeros(len(probs))
    out[order] = slice_probs
    return out / out.sum()


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``probs`` with one uniform of ``rng`` (module doc: ``rng.choice(vocab, p=probs)``)."""
    probs = probs / probs.sum()
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))


Law = Callable[[np.ndarray, SamplingParams, Counter], np.ndarray]
LAWS: dict[str, Law] = {"classic": classic_distribution, "top-k-renormalized": top_k_renormalized_distribution}


class Sampler:
    """One request: the law, its settings, the request stream and the generated-token counts.

    ``next(row)`` chooses the token for a logits row and records it; greedy settings never touch the stream."""

    def __init__(self, params: SamplingParams, seed: int, law: str = "classic"):
        if law not in LAWS:
            raise ValidationError(f"unknown sampling law {law!r}; known: {', '.join(LAWS)}")
        self.params, self.seed, self.law = params, seed, LAWS[law]
        self.rng = request_stream(seed)
        self.counts: Counter = Counter()

    def distribution(self, row: np.ndarray) -> np.ndarray:
        return self.law(row, self.params, self.counts)

    def next(self, row: np.ndarray) -> int:
        probs = self.distribution(row)
        token = int(np.argmax(probs)) if self.params.greedy else draw(probs, self.rng)
        self.counts[token] += 1
        return token


@dataclass(frozen=True)
class Divergence:
    """Where a token stream first leaves the law's replay: ``position`` (index into the stream), the token the
    replay draws, the stream's token and the probability the law gives it (0: the law cannot produce it)."""

    position: int
    expected: int
    found: int
    found_probability: float

    def to_json(self) -> dict:
        return {"position": self.position, "expected": self.expected, "found": self.found,
                "found_probability": self.found_probability}


def first_divergence(rows: Iterable[np.ndarray], tokens: Sequence[int], params: SamplingParams, seed: int,
                     law: str = "classic") -> Divergence | None:
    """Replay the law with ``seed`` on the reference logits ``rows`` (row ``i`` chose ``tokens[i]``): the first
    position whose drawn token differs from the stream's, or None when every token agrees."""
    sampler = Sampler(params, seed, law)
    for i, (row, token) in enumerate(zip(rows, tokens)):
        probs = sampler.distribution(row)
        expected = int(np.argmax(probs)) if params.greedy else draw(probs, sampler.rng)
        if expected != int(token):
            return Divergence(i, expected, int(token), float(probs[int(token)]) if 0 <= token < len(probs) else 0.0)
        sampler.counts[expected] += 1
    return None
