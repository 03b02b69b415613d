"""The per-case score table (``quantkit score``'s OUT.tsv): write and read back with checks.

Layout (UTF-8, ``\\n`` line ends)::

    # quantkit-score {"version": 1, "fixture": {...}, "model": {...}, "ctx": 4096, "cross_checkpoint": [...]}
    id<TAB>prompt_tokens<TAB>...            the columns of :data:`.metrics.COLUMNS` (ds4's score_official order)
    case_0001<TAB>...                       one row per fixture case, in manifest order
    # summary cases=... tokens=...          the lines of :class:`.metrics.Totals`
    # api_summary ...
    # kld_summary ...                       only with --kld-base (:func:`.kld.KldStats.summary_line`)

The header's ``fixture`` object is ``{"content_sha256", "label", "cases", "path"}`` (the fixture's identity:
two tables are comparable only when their ``content_sha256`` is equal), ``model`` is the scored model's
:class:`.source.ModelIdentity`, ``cross_checkpoint`` lists the identity problems that
``--allow-cross-checkpoint`` let through (empty normally).  Readers skip nothing silently: the header line, the
column line and one row per recorded case must all be there, and the ``summary`` line's counts must agree with
the rows.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import FixtureError
from ..io.atomic import atomic_output
from .metrics import COLUMNS, CaseScore, Totals, case_row, parse_row

HEADER_PREFIX = "# quantkit-score "
TABLE_VERSION = 1
HEADER_KEYS = ("version", "fixture", "model", "ctx", "cross_checkpoint")
FIXTURE_KEYS = ("content_sha256", "label", "cases", "path")
#: Largest table read (100 cases are ~30 kB; a million-case table is ~300 MB).
MAX_TABLE_BYTES = 1 << 30
_SUMMARY = re.compile(r"^summary cases=(\d+) tokens=(\d+) avg_nll=\S+ first_match=(\d+) avg_lcp=\S+$")


@dataclass(frozen=True)
class ScoreTable:
    path: Path | None
    header: Mapping[str, Any]
    scores: tuple[CaseScore, ...]
    trailer: tuple[str, ...]

    @property
    def fixture_sha256(self) -> str:
        return self.header["fixture"]["content_sha256"]

    @property
    def totals(self) -> Totals:
        return Totals.of(self.scores)


def table_text(header: Mapping[str, Any], scores: Sequence[CaseScore], trailer: Sequence[str]) -> str:
    lines = [HEADER_PREFIX + json.dumps(dict(header), sort_keys=False), "\t".join(COLUMNS)]
    lines += [case_row(s) for s in scores]
    lines += [f"# {line}" for line in trailer]
    return "\n".join(lines) + "\n"


def write_table(path: str | os.PathLike, header: Mapping[str, Any], scores: Sequence[CaseScore],
                trailer: Sequence[str], *, overwrite: bool = True) -> None:
    """Write the table atomically (a reader never sees half a table)."""
    with atomic_output(path, overwrite=overwrite) as tmp:
        tmp.write_text(table_text(header, scores, trailer), encoding="utf-8")


def _header(line: str, where: str) -> dict[str, Any]:
    if not line.startswith(HEADER_PREFIX):
        raise FixtureError(f"{where}: not a quantkit score table: the first line must start with "
                           f"{HEADER_PREFIX.strip()!r} (tables without it do not say which fixture they scored)")
    try:
        header = json.loads(line[len(HEADER_PREFIX):])
    except ValueError as exc:
        raise FixtureError(f"{where}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("version") != TABLE_VERSION:
        found = header.get("version") if isinstance(header, dict) else header
        raise FixtureError(f"{where}: header version is {found!r}, expected {TABLE_VERSION}")
    if set(header) != set(HEADER_KEYS):
        raise FixtureError(f"{where}: header keys {sorted(header)}, expected {sorted(HEADER_KEYS)}")
    fixture = header["fixture"]
    if not isinstance(fixture, dict) or set(fixture) != set(FIXTURE_KEYS) \
            or not isinstance(fixture["content_sha256"], str) or not isinstance(fixture["cases"], int):
        raise FixtureError(f"{where}: header fixture must have keys {list(FIXTURE_KEYS)}, found {fixture!r}")
    return header


def read_table(path: str | os.PathLike, *, max_bytes: int = MAX_TABLE_BYTES) -> ScoreTable:
    """Read a score table and check it is complete and consistent (module doc)."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise FixtureError(f"table is {size} bytes, more than the limit of {max_bytes} (max_bytes)", path=path)
    try:
        lines = path.read_bytes().decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise FixtureError(f"not a score table: not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) < 2:
        raise FixtureError("table ends before its column line", path=path)
    header = _header(lines[0], str(path))
    if lines[1].split("\t") != list(COLUMNS):
        raise FixtureError(f"line 2: columns {lines[1].split(chr(9))}, expected {list(COLUMNS)}", path=path)
    scores, trailer, seen = [], [], set()
    for line_no, line in enumerate(lines[2:], 3):
        if line.startswith("#"):
            trailer.append(line[1:].strip())
            continue
        if trailer:
            raise FixtureError(f"line {line_no}: a case row after the summary lines", path=path)
        score = parse_row(line.split("\t"), f"{path}: line {line_no}")
        if score.id in seen:
            raise FixtureError(f"line {line_no}: case {score.id!r} appears twice", path=path)
        seen.add(score.id)
        scores.append(score)
    expected = header["fixture"]["cases"]
    if len(scores) != expected:
        raise FixtureError(f"table has {len(scores)} case rows but its fixture has {expected} cases "
                           "(an incomplete table)", path=path)
    totals = Totals.of(scores)
    summary = next((line for line in trailer if line.startswith("summary ")), None)
    match = _SUMMARY.match(summary) if summary else None
    if match is None:
        raise FixtureError("the '# summary' line is missing or malformed", path=path)
    recorded = tuple(int(g) for g in match.groups())
    if recorded != (totals.cases, totals.tokens, totals.first_matches):
        raise FixtureError(f"the summary line says cases/tokens/first_match {recorded} but the rows add up to "
                           f"{(totals.cases, totals.tokens, totals.first_matches)}", path=path)
    return ScoreTable(path, header, tuple(scores), tuple(trailer))
