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
what a Qwen3.8 serving lane did (``CONTEXT.md``, "Sampling parity").  The receipt: logits ``ln([.4, .3, .3/62 x
62])``, ``T = 1, k = 2, p = .5``: the classic law keeps tokens 0 and 1 with ``.4/.7`` and ``.3/.7``; the faulty
law keeps token 0 alone (``.4/.7 >= .5``).

**The ds4 law** (:class:`Ds4Sampler`, law ``"ds4"``), DeepSeek's and GLM's reference (``CONTEXT.md``), read from
ds4's public ``ds4.c`` (``sample_top_p_min_p``, ``sample_full_vocab``, ``sample_rng_next``) and proven token for
token against those functions compiled from that source (``tests/test_sampling.py``):

* float32 throughout: ``p = expf((v - max) / T)``, sums accumulated in order; ``T <= 0``: the first maximum;
  ``top_p <= 0`` or ``> 1`` means 1; ``min_p`` (< 0 means 0) cuts a ranked token with ``p / sum < (p_0 / sum) *
  min_p``; no penalties;
* ``top_k > 0`` (capped at 1024 and the vocabulary): the ``k`` largest logits, ties by ascending id; **the top-p
  mass is measured over that slice** (``filtered_sum / sum >= top_p`` with ``sum`` over the slice, the crossing
  token kept) -- the top-k-renormalized law, in float32;
* ``top_k <= 0``: the whole vocabulary; ``top_p >= 1``: every token (with ``p >= min_p``, unnormalized), drawn in
  vocabulary order; else ranked by logit (ds4's ``qsort``; ties here by ascending id, which glibc's merge sort
  gives) with the full sum, the crossing token kept;
* the draw: ds4's own xorshift64* generator (state = the request's seed, 0 replaced by ``0x9e3779b97f4a7c15``;
  ``x ^= x >> 12; x ^= x << 25; x ^= x >> 27``, output ``x * 0x2545f4914f6cdd1d``), ``u = ((out >> 40) & 0xffffff)
  / 2^24``; ``r = u * kept_sum``, then ``r -= p`` over the kept tokens in order until ``r <= 0`` (the last kept
  token if rounding leaves ``r > 0``); a greedy step and an empty or non-finite sum draw nothing.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .errors import ValidationError
from .io import jsontext
from .scoring.kld import expf

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
    min_p: float = 0.0
    """ds4 law only (module doc)."""

    def __post_init__(self):
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"):
            if jsontext.finite(getattr(self, name)) is None:
                raise ValidationError(f"sampling {name} must be finite, got {getattr(self, name)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValidationError(f"sampling top_k must be a whole number >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                **({"min_p": self.min_p} if self.min_p else {})}


def request_stream(seed: int) -> np.random.Generator:
    """The request's one random stream: numpy's PCG64 seeded with ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
        raise ValidationError(f"sampling seed must be a whole number in 0..2^64-1, got {seed!r}")
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
    # shifted before the division: a tiny temperature sends the other logits to -inf (weight 0), never inf - inf
    with np.errstate(over="ignore"):
        weights = np.exp((logits - logits.max()) / float(temperature))
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
#: Every law a :class:`Sampler` can follow.
LAW_NAMES = (*LAWS, "ds4")


class Sampler:
    """One request: the law, its settings, the request stream and the generated-token counts.

    ``next(row)`` chooses the token for a logits row and records it; greedy settings never touch the stream.
    ``law="ds4"`` builds a :class:`Ds4Sampler`."""

    def __new__(cls, params: SamplingParams, seed: int, law: str = "classic"):
        if law == "ds4":
            return Ds4Sampler(params, seed)
        return super().__new__(cls)

    def __init__(self, params: SamplingParams, seed: int, law: str = "classic"):
        if law not in LAWS:
            raise ValidationError(f"unknown sampling law {law!r}; known: {', '.join(LAW_NAMES)}")
        if params.min_p:
            raise ValidationError(f"min_p belongs to the ds4 law; the {law} law has none")
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
        expected = sampler.next(row)
        if expected != int(token):
            return Divergence(i, expected, int(token), float(probs[int(token)]) if 0 <= token < len(probs) else 0.0)
    return None


_MASK64 = (1 << 64) - 1
F32 = np.float32


class Ds4Sampler:
    """The ds4 law and generator (module doc) for one request; ``seed`` is the generator's initial state."""

    def __init__(self, params: SamplingParams, seed: int):
        if params.presence_penalty or params.frequency_penalty:
            raise ValidationError("the ds4 law has no presence or frequency penalties")
        self.params, self.seed, self.state = params, seed, seed & _MASK64

    def uniform(self) -> np.float32:
        x = self.state or 0x9E3779B97F4A7C15
        x ^= x >> 12
        x ^= (x << 25) & _MASK64
        x ^= x >> 27
        self.state = x
        return F32((((x * 0x2545F4914F6CDD1D) & _MASK64) >> 40) & 0xFFFFFF) / F32(16777216.0)

    def _kept(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32] | int:
        """``(ids, weights, kept_sum)`` in draw order, or the token itself where ds4 draws nothing."""
        # a temperature below float32's range divides by zero as ds4's C does; the sums' checks take it from there
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return self._kept_weights(np.asarray(_check_row(row), F32))

    def _kept_weights(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32] | int:
        params = self.params
        if params.temperature <= 0:
            return int(np.argmax(row))
        temperature = F32(params.temperature)
        top_p = F32(params.top_p if 0 < params.top_p <= 1 else 1.0)
        min_p = F32(max(params.min_p, 0.0))
        if params.top_k <= 0 and top_p >= 1:
            weights = expf((row - row.max()) / temperature)
            ids = np.flatnonzero(weights >= min_p)      # min_p against unnormalized weights, as ds4
            total = np.add.accumulate(weights[ids], dtype=F32)[-1]
            return (ids, weights[ids], total) if 0 < total < np.inf else int(np.argmax(row))
        order = np.lexsort((np.arange(len(row)), -row))
        if params.top_k > 0:
            order = order[:min(params.top_k, 1024)]
        weights = expf((row[order] - row[order[0]]) / temperature)
        # the slice's sum in rank order; the whole vocabulary's in vocabulary order, before ds4 sorts it
        total = np.add.accumulate(weights if params.top_k > 0 else expf((row - row[order[0]]) / temperature),
                                  dtype=F32)[-1]
        if not 0 < total < np.inf:
            return int(order[0])
        min_prob = (weights[0] / total) * min_p
        below = np.flatnonzero(weights[1:] / total < min_prob)
        crossed = np.flatnonzero(np.add.accumulate(weights, dtype=F32) / total >= top_p)
        kept = min(int(below[0]) + 1 if len(below) else len(order), int(crossed[0]) + 1 if len(crossed) else len(order))
        return order[:kept], weights[:kept], np.add.accumulate(weights[:kept], dtype=F32)[-1]

    def distribution(self, row: np.ndarray) -> np.ndarray:
        kept = self._kept(row)
        out = np.zeros(len(row))
        if isinstance(kept, int):
            out[kept] = 1.0
        else:
            out[kept[0]] = kept[1].astype(np.float64) / float(kept[2])
        return out

    def next(self, row: np.ndarray) -> int:
        kept = self._kept(row)
        if isinstance(kept, int):
            return kept
        ids, weights, total = kept
        remaining = np.subtract.accumulate(np.concatenate(([self.uniform() * total], weights)), dtype=F32)[1:]
        hit = np.flatnonzero(remaining <= 0)
        return int(ids[hit[0]] if len(hit) else ids[-1])
