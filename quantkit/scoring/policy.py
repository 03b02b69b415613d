"""The release gate's thresholds (a TOML policy) and recorded baselines (reference bands of released figures).

Policy (``quantkit/scoring/policy.toml`` ships the defaults; ``compare --policy FILE`` replaces them): ``version``
(:data:`POLICY_VERSION`), one ``[rules.<name>]`` table per rule of :data:`RULE_NAMES` with ``blocker`` (bool) and
``tolerance`` (a finite number >= 0, in the rule's unit), and ``[baseline]`` with ``blocker`` (bool).  Every key
is required and unknown keys are errors: a gate never runs on a misspelled or half-read policy.

Baseline (a shipped name from ``quantkit/scoring/baselines/``, or a ``.toml``/``.json`` file of the same shape):
``name``, ``source`` (where the figures were quoted), ``cases``, optional ``tokens`` (the fixture's target
token count), and one ``[[release]]`` table per recorded release with ``name`` and any of :data:`FIGURES`.  A
metric's band is the range of the releases' figures for it.

Errors name the file and the key (:class:`~quantkit.errors.FormatError`, exit 2).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from ..errors import FormatError
from ..io import jsontext

POLICY_VERSION = 1
#: The gate's rules, in report order (their statistics are defined in :mod:`.compare`).
RULE_NAMES = ("nll", "first_token", "greedy_prefix", "api_top1", "api_pair_order", "api_topn")
SHIPPED_POLICY = Path(__file__).with_name("policy.toml")
BASELINE_DIR = Path(__file__).with_name("baselines")
#: Figures a baseline release may record -> (what it is, whether a higher value is worse).
FIGURES = {"avg_nll": ("average NLL per target token", True),
           "first_token_matches": ("first-token matches (of the cases)", False),
           "avg_greedy_prefix": ("average greedy prefix (tokens)", False),
           "top_token_matches": ("top-token agreement (positions of the tokens)", False)}
#: Largest policy or baseline file read (a few hundred bytes in practice).
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class RulePolicy:
    blocker: bool
    tolerance: float


@dataclass(frozen=True)
class Policy:
    rules: Mapping[str, RulePolicy]
    baseline_blocker: bool
    path: str
    """Where it was read from (the shipped file, or the user's)."""


@dataclass(frozen=True)
class Release:
    name: str
    figures: Mapping[str, float]


@dataclass(frozen=True)
class Baseline:
    name: str
    source: str
    cases: int
    tokens: int | None
    releases: tuple[Release, ...]
    path: str


def _read(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise FormatError(f"no such {what} file", path=path)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise FormatError(f"{what} is {size} bytes, more than the limit of {MAX_FILE_BYTES}", path=path)
    data = path.read_bytes()
    try:
        if path.suffix == ".json":
            value = jsontext.loads(data)
            if not isinstance(value, dict):
                raise ValueError("the top level must be an object")
            return value
        return tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:   # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise FormatError(f"not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}", path=path) from None


def _keys(table: Any, expected: set[str], path: Path, where: str, optional: set[str] = frozenset()) -> None:
    if not isinstance(table, dict):
        raise FormatError(f"expected a table, found {table!r}", path=path, field=where or "(top level)")
    missing, unknown = expected - set(table), set(table) - expected - optional
    if missing:
        key = f"{where}.{sorted(missing)[0]}" if where else sorted(missing)[0]
        raise FormatError("missing (every key is required)", path=path, field=key)
    if unknown:
        key = f"{where}.{sorted(unknown)[0]}" if where else sorted(unknown)[0]
        raise FormatError(f"unknown key; expected one of {sorted(expected | optional)}", path=path, field=key)


def _bool(value: Any, path: Path, key: str) -> bool:
    if not isinstance(value, bool):
        raise FormatError(f"expected true or false, found {value!r}", path=path, field=key)
    return value


def _number(value: Any, path: Path, key: str, *, whole: bool = False) -> float:
    ok = isinstance(value, int) if whole else isinstance(value, (int, float))
    if not ok or jsontext.finite(value) is None or value < 0:
        raise FormatError(f"expected a {'whole ' if whole else ''}number >= 0, found {value!r}", path=path, field=key)
    return value


def load_policy(path: str | Path | None = None) -> Policy:
    """The policy in ``path`` (default: the shipped one), checked key by key (module doc)."""
    path = Path(path) if path is not None else SHIPPED_POLICY
    data = _read(path, "policy")
    _keys(data, {"version", "rules", "baseline"}, path, "")
    if data["version"] != POLICY_VERSION:
        raise FormatError(f"expected {POLICY_VERSION}, found {data['version']!r}", path=path, field="version")
    _keys(data["rules"], set(RULE_NAMES), path, "rules")
    rules = {}
    for name in RULE_NAMES:
        where = f"rules.{name}"
        _keys(data["rules"][name], {"blocker", "tolerance"}, path, where)
        table = data["rules"][name]
        rules[name] = RulePolicy(_bool(table["blocker"], path, f"{where}.blocker"),
                                 float(_number(table["tolerance"], path, f"{where}.tolerance")))
    _keys(data["baseline"], {"blocker"}, path, "baseline")
    return Policy(rules, _bool(data["baseline"]["blocker"], path, "baseline.blocker"), str(path))


def shipped_baselines() -> list[str]:
    return sorted(p.stem for p in BASELINE_DIR.glob("*.toml"))


def _string(value: Any, path: Path, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise FormatError(f"expected a non-empty string, found {value!r}", path=path, field=key)
    return value


def load_baseline(name_or_path: str | Path) -> Baseline:
    """A shipped baseline by name, or a baseline file (module doc)."""
    given = str(name_or_path)
    path = Path(given)
    if not path.exists():
        if given not in shipped_baselines():
            raise FormatError(f"no shipped baseline of this name and no such file; shipped: {shipped_baselines()}",
                              path=given)
        path = BASELINE_DIR / f"{given}.toml"
    data = _read(path, "baseline")
    _keys(data, {"name", "source", "cases", "release"}, path, "", optional={"tokens"})
    cases = int(_number(data["cases"], path, "cases", whole=True))
    tokens = int(_number(data["tokens"], path, "tokens", whole=True)) if "tokens" in data else None
    if not isinstance(data["release"], list) or not data["release"]:
        raise FormatError("expected one or more [[release]] tables", path=path, field="release")
    releases = []
    for i, entry in enumerate(data["release"]):
        where = f"release[{i}]"
        _keys(entry, {"name"}, path, where, optional=set(FIGURES))
        figures = {key: float(_number(entry[key], path, f"{where}.{key}", whole=key.endswith("_matches")))
                   for key in FIGURES if key in entry}
        if not figures:
            raise FormatError(f"records no figure; expected some of {list(FIGURES)}", path=path, field=where)
        if "top_token_matches" in figures and tokens is None:
            raise FormatError("top_token_matches needs the baseline's tokens (the positions counted)", path=path,
                              field=f"{where}.top_token_matches")
        releases.append(Release(_string(entry["name"], path, f"{where}.name"), figures))
    return Baseline(_string(data["name"], path, "name"), _string(data["source"], path, "source"), cases, tokens,
                    tuple(releases), str(path))
