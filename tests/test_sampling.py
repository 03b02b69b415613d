"""The reference samplers (quantkit.sampling) against receipts and an independent derivation.

Expected kept sets and probabilities come from :func:`expected_law`, written here from the law's statement in plain
Python (``math.exp``, ``sorted`` over ``(-p, id)`` pairs, a running sum), not from the module's numpy code.
Probabilities are compared to 1e-12 (float64 against float64, different summation order); the receipt's published
figures are float32 results and are compared to 2^-23 (two float32 ulps at 0.5).
"""
from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from quantkit.errors import ValidationError
from quantkit.sampling import (Sampler, SamplingParams, classic_distribution, draw, first_divergence,
                               request_stream, top_k_renormalized_distribution)

RECEIPT_LOGITS = np.log(np.array([.4, .3] + [.3 / 62] * 62, dtype=np.float32))
RECEIPT = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
RECEIPT_PROBS = {0: .5714285675, 1: .4285714325}
F32_TOLERANCE = 2.0 ** -23
F64_TOLERANCE = 1e-12
#: Chi-square tests reject at this p-value: the false-alarm rate of one test on a correct sampler.
FALSE_ALARM = 1e-3


def expected_law(logits, temperature, top_k, top_p, counts=None, presence=0.0, frequency=0.0):
    """{token: probability} of the classic law, derived from its statement one token at a time."""
    values = [float(v) for v in logits]
    for token, n in (counts or {}).items():
        values[token] -= max(-2.0, min(2.0, frequency)) * n + (max(-2.0, min(2.0, presence)) if n else 0.0)
    if temperature <= 0:
        best = max(values)
        return {values.index(best): 1.0}
    top = max(values)
    weights = [math.exp((v - top) / temperature) for v in values]
    total = math.fsum(weights)
    ranked = sorted(((-w / total, i) for i, w in enumerate(weights)))
    if 0 < top_k < len(values):
        ranked = ranked[:top_k]
    kept, mass = [], 0.0
    for neg_p, token in ranked:
        if 0 < top_p < 1 and mass >= top_p:
            break
        kept.append(token)
        mass += -neg_p
    kept_total = math.fsum(weights[t] for t in kept)
    return {t: weights[t] / kept_total for t in kept}


def as_dict(probs: np.ndarray) -> dict[int, float]:
    return {int(t): float(probs[t]) for t in np.flatnonzero(probs)}


def assert_law(probs: np.ndarray, expected: dict[int, float]):
    found = as_dict(probs)
    assert sorted(found) == sorted(expected)
    for token, p in expected.items():
        assert abs(found[token] - p) <= F64_TOLERANCE, (token, found[token], p)


# -- the receipt ------------------------------------------------------------------------------------------------------

def test_receipt_classic_keeps_both_tokens():
    probs = classic_distribution(RECEIPT_LOGITS, RECEIPT)
    assert sorted(as_dict(probs)) == [0, 1]
    for token, p in RECEIPT_PROBS.items():
        assert abs(probs[token] - p) <= F32_TOLERANCE
    assert_law(probs, expected_law(RECEIPT_LOGITS, 1.0, 2, 0.5))
    stream = request_stream(0)
    drawn = Counter(draw(probs, stream) for _ in range(128))
    assert set(drawn) == {0, 1}


def test_receipt_faulty_law_keeps_token_0_only():
    probs = top_k_renormalized_distribution(RECEIPT_LOGITS, RECEIPT)
    assert as_dict(probs) == {0: 1.0}
    sampler = Sampler(RECEIPT, seed=0, law="top-k-renormalized")
    assert [sampler.next(RECEIPT_LOGITS) for _ in range(128)] == [0] * 128


# -- the matrix -------------------------------------------------------------------------------------------------------

MATRIX_LOGITS = np.random.default_rng(11).normal(0, 2.5, 300).astype(np.float32)
MATRIX = {
    "qwen-official .6/.95/k20": (0.6, 20, 0.95),
    "T1 p.95 k20": (1.0, 20, 0.95),
    "T.5 k2": (0.5, 2, 1.0),
    "p0 is off": (1.0, 0, 0.0),
    "p1 is off": (1.0, 0, 1.0),
    "p0 with k5": (0.8, 5, 0.0),
    "p.3 alone": (1.3, 0, 0.3),
    "k beyond vocab": (1.0, 1000, 0.9),
}


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_matrix(case):
    temperature, top_k, top_p = MATRIX[case]
    probs = classic_distribution(MATRIX_LOGITS, SamplingParams(temperature, top_k, top_p))
    expected = expected_law(MATRIX_LOGITS, temperature, top_k, top_p)
    assert_law(probs, expected)
    if top_p in (0.0, 1.0):
        assert len(expected) == (top_k or len(MATRIX_LOGITS))


def test_p_off_and_k_off_keep_the_whole_vocabulary():
    full = classic_distribution(MATRIX_LOGITS, SamplingParams(1.0, 0, 1.0))
    assert np.count_nonzero(full) == len(MATRIX_LOGITS)
    assert np.array_equal(full, classic_distribution(MATRIX_LOGITS, SamplingParams(1.0, 0, 0.0)))


def test_ties_break_by_lower_token_id():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 3.0, 0.5], np.float32)
    # three-way tie at the top: k=2 keeps ids 1 and 3; greedy picks 1
    assert sorted(as_dict(classic_distribution(logits, SamplingParams(1.0, 2, 1.0)))) == [1, 3]
    assert as_dict(classic_distribution(logits, SamplingParams(0.0, 2, 1.0))) == {1: 1.0}
    # top-p crossing inside the tie: the mass before id 4 is 2/3 of the tied mass
    probs = classic_distribution(logits, SamplingParams(1.0, 0, 0.5))
    assert_law(probs, expected_law(logits, 1.0, 0, 0.5))
    assert sorted(as_dict(probs)) == [1, 3]


def test_greedy_is_the_first_maximum_and_draws_nothing():
    logits = np.array([0.0, 5.0, 5.0, 1.0], np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, top_k=3, top_p=0.5), seed=3)
    before = sampler.rng.bit_generator.state
    assert [sampler.next(logits) for _ in range(4)] == [1, 1, 1, 1]
    assert sampler.rng.bit_generator.state == before


@pytest.mark.parametrize("temperature", [1e-320, 1e-306, 1e-30])
def test_a_tiny_temperature_is_the_greedy_limit(temperature):
    """As T -> 0+ the softmax of logits / T puts its mass on the maxima, split evenly among ties: no NaN from
    logits / T overflowing, for either law."""
    logits = np.array([0.0, 5.0, 5.0, 1.0, -3e4], np.float32)
    for law in (classic_distribution, top_k_renormalized_distribution):
        for k in (0, 3):
            assert as_dict(law(logits, SamplingParams(temperature, k, 1.0))) == {1: 0.5, 2: 0.5}
    assert Sampler(SamplingParams(temperature, 0, 1.0), seed=3).next(logits) in (1, 2)


@pytest.mark.parametrize("presence, frequency", [(0.7, 0.0), (0.0, 0.4), (1.5, 0.9), (-0.5, 0.3), (5.0, -9.0)])
def test_presence_and_frequency_penalties(presence, frequency):
    counts = Counter({int(i): n for i, n in zip(np.argsort(-MATRIX_LOGITS)[:6], [3, 1, 2, 1, 5, 1])})
    params = SamplingParams(0.7, 20, 0.9, presence_penalty=presence, frequency_penalty=frequency)
    probs = classic_distribution(MATRIX_LOGITS, params, counts)
    assert_law(probs, expected_law(MATRIX_LOGITS, 0.7, 20, 0.9, counts, presence, frequency))
    assert not np.array_equal(probs, classic_distribution(MATRIX_LOGITS, SamplingParams(0.7, 20, 0.9), counts))


def test_sampler_counts_its_own_tokens_for_penalties():
    logits = np.array([2.0, 1.9, 0.0], np.float32)
    params = SamplingParams(1.0, 0, 1.0, presence_penalty=2.0, frequency_penalty=2.0)
    sampler = Sampler(params, seed=5)
    tokens = [sampler.next(logits) for _ in range(6)]
    assert sampler.counts == Counter(tokens)
    # replaying the same stream with the same law reproduces it; another seed generally does not
    assert first_divergence([logits] * 6, tokens, params, seed=5) is None


# -- the draw and the stream ------------------------------------------------------------------------------------------

def test_draw_is_numpy_choice_over_the_vocabulary():
    """The reference draws with ``rng.choice(np.arange(vocab), p=probs)``: one double per token, same mapping."""
    probs = classic_distribution(MATRIX_LOGITS, SamplingParams(0.6, 20, 0.95))
    for seed in range(50):
        ours, theirs = request_stream(seed), request_stream(seed)
        for _ in range(20):
            assert draw(probs, ours) == int(theirs.choice(np.arange(len(probs)), p=probs))
        assert ours.bit_generator.state == theirs.bit_generator.state


def test_one_stream_per_request():
    """Every token comes from the one request stream: the i-th token uses the i-th uniform."""
    params = SamplingParams(1.0, 0, 1.0)
    rows = [np.roll(MATRIX_LOGITS, i) for i in range(16)]
    sampler = Sampler(params, seed=42)
    tokens = [sampler.next(r) for r in rows]
    uniforms = request_stream(42).random(16)
    for row, u, token in zip(rows, uniforms, tokens):
        cdf = np.cumsum(classic_distribution(row, params))
        assert token == int(np.searchsorted(cdf / cdf[-1], u, side="right"))


def test_first_divergence_names_the_position():
    params = SamplingParams(1.0, 0, 1.0)
    rows = [np.roll(MATRIX_LOGITS, i) for i in range(10)]
    sampler = Sampler(params, seed=1)
    tokens = [sampler.next(r) for r in rows]
    assert first_divergence(rows, tokens, params, seed=1) is None
    switched = tokens[:1] + [Sampler(params, seed=99).next(r) for r in rows[1:]]   # a lane that switched streams
    found = first_divergence(rows, switched, params, seed=1)
    assert found is not None and found.position == next(i for i, (a, b) in enumerate(zip(tokens, switched)) if a != b)
    assert found.expected == tokens[found.position] and found.found == switched[found.position]


# -- frequencies ------------------------------------------------------------------------------------------------------

def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit; categories with an expected count under 5 pooled into one.  The
    p-value is scipy's chi-square survival function, or without scipy the Wilson-Hilferty normal approximation
    (within 1e-3 of it at these degrees of freedom)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    try:
        from scipy.stats import chi2
    except ImportError:
        z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
        return 0.5 * math.erfc(z / math.sqrt(2))
    return float(chi2.sf(statistic, df))


DRAWS = 20_000


@pytest.mark.parametrize("case", ["qwen-official .6/.95/k20", "T1 p.95 k20", "p.3 alone"])
def test_empirical_frequencies_match_the_law(case):
    """At a fixed seed the test is deterministic; on a correct sampler it would fail with probability FALSE_ALARM
    over seeds."""
    temperature, top_k, top_p = MATRIX[case]
    params = SamplingParams(temperature, top_k, top_p)
    probs = classic_distribution(MATRIX_LOGITS, params)
    sampler = Sampler(params, seed=2024)
    counts = np.bincount([sampler.next(MATRIX_LOGITS) for _ in range(DRAWS)], minlength=len(probs))
    assert not counts[probs == 0].any()
    expected = expected_law(MATRIX_LOGITS, temperature, top_k, top_p)
    law = np.zeros(len(probs))
    law[list(expected)] = list(expected.values())
    assert chi_square_p_value(counts, law) > FALSE_ALARM


def test_chi_square_catches_the_faulty_law():
    """The frequency test has power: the faulty law's draws fail it against the classic law's probabilities."""
    logits = np.log(np.array([.4, .3, .2] + [.1 / 61] * 61))
    params = SamplingParams(1.0, 3, 0.75)
    faulty = Sampler(params, seed=2024, law="top-k-renormalized")
    counts = np.bincount([faulty.next(logits) for _ in range(2000)], minlength=64)
    assert chi_square_p_value(counts, classic_distribution(logits, params)) < FALSE_ALARM


def test_bad_settings_and_rows_are_refused():
    with pytest.raises(ValidationError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValidationError, match="token 2"):
        classic_distribution(np.array([0.0, 1.0, np.inf]), SamplingParams())
    with pytest.raises(ValidationError, match="law"):
        Sampler(SamplingParams(), 0, law="nucleus")
    with pytest.raises(ValidationError, match="min_p belongs to the ds4 law"):
        Sampler(SamplingParams(min_p=0.1), 0)


# -- the ds4 law against ds4's own sampler ----------------------------------------------------------------------------

DS4_MIRROR = Path("/work/.mirror/antirez+ds4/repo")


@pytest.fixture(scope="module")
def ds4_sampler(tmp_path_factory):
    """ds4's sampler functions (sample_argmax .. sample_top_p_min_p) cut from ds4.c as published and compiled
    with a call wrapper; skipped where ds4's repository is not mirrored or no C compiler is installed."""
    if not DS4_MIRROR.is_dir() or shutil.which("gcc") is None:
        pytest.skip("needs ds4's repository mirror and gcc")
    source = subprocess.run(["git", "-C", str(DS4_MIRROR), "show", "HEAD:ds4.c"], check=True,
                            capture_output=True, text=True).stdout
    start = source.index("static int sample_argmax(const float *logits, uint32_t n_vocab) {")
    end = source.index("static void print_top_logits(")
    body = re.sub(r"static DS4_MAYBE_UNUSED void logits_top2\(.*?\n}\n", "", source[start:end], flags=re.S)
    program = ("#include <math.h>\n#include <stdint.h>\n#include <stdlib.h>\n#define DS4_NEG_INF (-1.0e30f)\n"
               "#define xmalloc malloc\n" + body +
               "\nint call_sample(const float *l, uint32_t n, float t, int k, float p, float m, uint64_t *rng) {"
               " return sample_top_p_min_p(l, n, t, k, p, m, rng); }\n")
    folder = tmp_path_factory.mktemp("ds4-sampler")
    (folder / "sampler.c").write_text(program)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-ffp-contract=off", "-o", str(folder / "sampler.so"),
                    str(folder / "sampler.c"), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(folder / "sampler.so"))
    lib.call_sample.restype = ctypes.c_int
    lib.call_sample.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_uint32, ctypes.c_float, ctypes.c_int,
                                ctypes.c_float, ctypes.c_float, ctypes.POINTER(ctypes.c_uint64)]

    def sample(row, temperature, top_k, top_p, min_p, state):
        row = np.ascontiguousarray(row, np.float32)
        rng = ctypes.c_uint64(state)
        token = lib.call_sample(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(row), temperature, top_k,
                                top_p, min_p, ctypes.byref(rng))
        return token, rng.value

    return sample


DS4_SETTINGS = [(0.6, 20, 0.95, 0.0), (1.0, 20, 0.95, 0.0), (0.5, 2, 1.0, 0.0), (1.0, 0, 1.0, 0.0),
                (0.8, 0, 0.9, 0.0), (1.0, 0, 0.0, 0.05), (1.0, 5, 0.5, 0.2), (0.0, 20, 0.9, 0.0),
                (1.3, 2000, 0.7, 0.0), (1.0, 2, 0.5, 0.0)]


@pytest.mark.parametrize("settings", DS4_SETTINGS, ids=[str(s) for s in DS4_SETTINGS])
def test_ds4_law_is_ds4s_sampler(ds4_sampler, settings):
    """Token for token and generator state for state, over many rows (ties included) and seeds."""
    temperature, top_k, top_p, min_p = settings
    params = SamplingParams(temperature, top_k, top_p, min_p=min_p)
    generator = np.random.default_rng(5)
    for trial in range(40):
        row = generator.normal(0, 3, 1500).astype(np.float32)
        row[generator.integers(0, 1500, 30)] = row.max()            # ties at the top
        seed = int(generator.integers(0, 2 ** 63)) if trial % 5 else 0
        sampler = Sampler(params, seed, law="ds4")
        state = seed
        for _ in range(5):
            token, state = ds4_sampler(row, temperature, top_k, top_p, min_p, state)
            assert sampler.next(row) == token and sampler.state == state


def test_ds4_law_on_the_receipt_is_the_faulty_one():
    """ds4 with top-k measures top-p over the slice: on the receipt it keeps token 0 alone, as the faulty law."""
    sampler = Sampler(RECEIPT, seed=1, law="ds4")
    assert as_dict(sampler.distribution(RECEIPT_LOGITS)) == {0: 1.0}
    assert {sampler.next(RECEIPT_LOGITS) for _ in range(128)} == {0}
    with pytest.raises(ValidationError, match="penalties"):
        Sampler(SamplingParams(presence_penalty=0.5), 0, law="ds4")
