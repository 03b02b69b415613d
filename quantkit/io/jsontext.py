"""JSON read from files a user hands quantkit, and the reports quantkit prints or writes.

``json.loads`` raises ``RecursionError`` on input nested a few thousand levels deep (``[[[[…``); through
:func:`loads` it is a ``ValueError`` as any other malformed JSON, so each reader's one-line error names its file.

``json.dumps`` writes a NaN or infinite float as the bare ``NaN`` / ``Infinity``, which is not JSON (strict
parsers, ``jq`` and JavaScript among them, refuse the whole report), and reports hold such values exactly when
something is wrong (a NaN scale's error).  :func:`dumps` writes them as the strings ``"nan"``, ``"inf"`` and
``"-inf"``.
"""
from __future__ import annotations

import json
import math
import numbers
from typing import Any


def loads(data: str | bytes, **kwargs: Any) -> Any:
    """``json.loads(data, **kwargs)``; JSON nested too deeply for the parser raises ``ValueError``."""
    try:
        return json.loads(data, **kwargs)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj, **kwargs)`` whose output is standard JSON: non-finite floats as strings (module doc)."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        default = kwargs.pop("default", None)
        plain = json.loads(json.dumps(obj, default=default))   # numpy scalars and other defaults resolved first
        return json.dumps(_finite(plain), allow_nan=False, **kwargs)


def finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, a string, NaN, an integer past float64,
    which ``math.isfinite`` and numpy would raise on)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):   # numpy's scalars are Real too
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
