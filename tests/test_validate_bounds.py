"""The per-type error bounds of ``quantkit validate`` hold for correct encodings of varied data and catch gross
corruption: a sign flip for every type, swapped rows above 2.5 bits per weight, zeros above 3."""
from __future__ import annotations

import numpy as np
import pytest

from quantkit.formats.api import decode, encode
from quantkit.formats.registry import ImatrixUse, all_formats
from quantkit.validate.payload import TensorResult, _accumulate, error_bound

ENCODABLE = [f for f in all_formats().values() if f.can_encode]
SCALE = 0.02   # typical weight magnitude


def distributions() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (32, 512)
    g = rng.standard_normal(shape)
    return {
        "gaussian": g,
        "student-t3": rng.standard_t(3, shape),
        "student-t1.5": rng.standard_t(1.5, shape),
        "outlier-columns": g * np.where(rng.random(shape[1]) < 0.01, 50.0, 1.0),
        "uniform": rng.uniform(-1, 1, shape),
        "sparse": g * (rng.random(shape) < 0.05),
        "row-scaled": g * np.exp(3 * rng.standard_normal((shape[0], 1))),
        "tiny": g * 1e-4,
    }


def measured(x: np.ndarray, d: np.ndarray, qtype) -> str | None:
    result = TensorResult("t", qtype.name, list(x.shape), "full")
    _accumulate(result, x, d)
    return result.error_problem(error_bound(qtype))


@pytest.mark.parametrize("fmt", ENCODABLE, ids=[f.name for f in ENCODABLE])
def test_correct_encodings_stay_within_the_bound(fmt):
    for name, x in distributions().items():
        x = (x * SCALE).astype(np.float32)
        importances = [None] if fmt.imatrix is ImatrixUse.IGNORED else [(x * x).sum(axis=0),
                                                                        np.random.default_rng(1).random(x.shape[1])]
        if fmt.imatrix is ImatrixUse.OPTIONAL:
            importances.append(None)
        for importance in importances:
            d = decode(encode(x, fmt.qtype, importance), fmt.qtype, x.shape)
            assert measured(x, d, fmt.qtype) is None, (name, measured(x, d, fmt.qtype))


@pytest.mark.parametrize("fmt", ENCODABLE, ids=[f.name for f in ENCODABLE])
def test_gross_corruption_exceeds_the_bound(fmt):
    x = (distributions()["gaussian"] * SCALE).astype(np.float32)
    importance = None if fmt.imatrix is ImatrixUse.IGNORED else (x * x).sum(axis=0)
    d = decode(encode(x, fmt.qtype, importance), fmt.qtype, x.shape)
    bits = fmt.bits_per_weight
    assert measured(x, -d, fmt.qtype) is not None
    swapped = np.roll(d, 1, axis=0)      # another row's (expert's) values in place of these
    if bits > 2.5:
        assert measured(x, swapped, fmt.qtype) is not None
    if bits > 3:
        assert measured(x, np.zeros_like(d), fmt.qtype) is not None
