"""The per-case score table (``quantkit score``'s OUT.tsv): write and read back with checks, in quantkit's
layout or in ds4's.

quantkit layout (``--format quantkit``; UTF-8, ``\\n`` line ends)::

    # quantkit-score {"version": 1, "fixture": {...}, "model": {...}, "ctx": 4096, "cross_checkpoint": [...],
                      "evidence": {...}}      (one line)
    id<TAB>prompt_tokens<TAB>...            the columns of :data:`.metrics.COLUMNS`
    case_0001<TAB>...                       one row per fixture case, in manifest order
    # summary cases=... tokens=...          the lines of :class:`.metrics.Totals`
    # api_summary ...
    # kld_summary ...                       only with --kld-base (:func:`.kld.KldStats.summary_line`)

The header's ``fixture`` object is ``{"content_sha256", "label", "cases", "path"}`` (the fixture's identity:
two tables are comparable only when their ``content_sha256`` is equal), ``model`` is the scored model's
:class:`.source.ModelIdentity`, ``cross_checkpoint`` lists the identity problems that
``--allow-cross-checkpoint`` let through (empty normally), and ``evidence`` (optional: tables written before
it existed lack it) what produced the table: tool versions, device, dtype, threads, the scored file's SHA-256 and
size, the fixture and the command line (:mod:`quantkit.evidence`).  Readers skip nothing silently: the header
line, the column line and one row per recorded case must all be there, and the ``summary`` line's counts must agree with
the rows.

ds4 layouts (what ds4's ``gguf-tools/quality-testing/score_official`` writes; facts and their source lines in
``tests/data/ds4/score_official_format.json``): the column line, then one row per case, nothing else (ds4
prints its summary to stderr).  Rows are ``printf``-formatted: ``%s`` id, ``%d`` counts, ``%.9f`` reals.

``ds4``      the 26 columns of :data:`.metrics.COLUMNS` (the ``score_official`` tables with API metrics that
             releases are audited with);
``ds4-nll``  the first 7 (:data:`.metrics.NLL_COLUMNS`), exactly the public ``score_official.c``'s table.

Written by quantkit (``--format ds4|ds4-nll``), a ds4 table gets a sidecar ``OUT.tsv.json`` with the identity
record a quantkit table keeps in its header (:data:`SIDECAR_KEYS`; ``table_sha256`` binds it to the table's
bytes, so a sidecar left beside a re-scored or edited table is refused).  A ds4 table without a sidecar reads
with an unknown fixture (``header`` ``None``): nothing in it says which fixture it scored or whether it is
complete (ds4 writes rows as it goes), so comparisons pair it by case ids and target token counts only.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import FixtureError
from ..io.atomic import atomic_output
from .metrics import COLUMNS, NLL_COLUMNS, CaseScore, Totals, case_row, parse_row
from ..io import jsontext

HEADER_PREFIX = "# quantkit-score "
TABLE_VERSION = 1
HEADER_KEYS = ("version", "fixture", "model", "ctx", "cross_checkpoint")
#: Header keys a table may lack (tables written before quantkit recorded them stay readable).
OPTIONAL_HEADER_KEYS = ("evidence", "arithmetic", "batch_tokens")
FIXTURE_KEYS = ("content_sha256", "label", "cases", "path")
#: Table layouts by ``--format`` name -> columns.
LAYOUTS = {"quantkit": COLUMNS, "ds4": COLUMNS, "ds4-nll": NLL_COLUMNS}
DS4_LAYOUTS = ("ds4", "ds4-nll")
SIDECAR_FORMAT = "quantkit-score-sidecar"
SIDECAR_VERSION = 1
SIDECAR_KEYS = ("format", "version", "layout", "table_sha256", "header", "trailer")
#: Largest table read (100 cases are ~30 kB; a million-case table is ~300 MB).
MAX_TABLE_BYTES = 1 << 30
#: Largest sidecar read (a few kB in practice).
MAX_SIDECAR_BYTES = 16 << 20
_SUMMARY = re.compile(r"^summary cases=(\d+) tokens=(\d+) avg_nll=\S+ first_match=(\d+) avg_lcp=\S+$")


@dataclass(frozen=True)
class ScoreTable:
    path: Path | None
    header: Mapping[str, Any] | None
    """The identity record (module doc); ``None`` for a ds4 table without a sidecar."""
    scores: tuple[CaseScore, ...]
    trailer: tuple[str, ...]
    layout: str = "quantkit"

    @property
    def fixture(self) -> Mapping[str, Any] | None:
        return self.header["fixture"] if self.header is not None else None

    @property
    def fixture_sha256(self) -> str | None:
        return self.fixture["content_sha256"] if self.fixture is not None else None

    @property
    def has_api(self) -> bool:
        """Whether the table carries the API metric columns."""
        return len(LAYOUTS[self.layout]) == len(COLUMNS)

    @property
    def totals(self) -> Totals:
        return Totals.of(self.scores)


def sidecar_path(path: str | os.PathLike) -> Path:
    """Where a ds4-layout table's identity record lives: ``OUT.tsv`` -> ``OUT.tsv.json``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _layout_columns(layout: str) -> tuple[str, ...]:
    try:
        return LAYOUTS[layout]
    except KeyError:
        raise FixtureError(f"unknown table format {layout!r}; known: {list(LAYOUTS)}") from None


def table_text(header: Mapping[str, Any], scores: Sequence[CaseScore], trailer: Sequence[str], *,
               layout: str = "quantkit") -> str:
    """The table's text; for a ds4 layout only the column line and the rows (the rest goes to the sidecar)."""
    columns = _layout_columns(layout)
    lines = ["\t".join(columns)] + [case_row(s, columns) for s in scores]
    if layout == "quantkit":
        lines = [HEADER_PREFIX + json.dumps(dict(header), sort_keys=False)] + lines + [f"# {t}" for t in trailer]
    return "\n".join(lines) + "\n"


def write_table(path: str | os.PathLike, header: Mapping[str, Any], scores: Sequence[CaseScore],
                trailer: Sequence[str], *, layout: str = "quantkit", overwrite: bool = True) -> None:
    """Write the table atomically (a reader never sees half a table); a ds4 layout's sidecar after it."""
    text = table_text(header, scores, trailer, layout=layout).encode("utf-8")
    with atomic_output(path, overwrite=overwrite) as tmp:
        tmp.write_bytes(text)
    if layout in DS4_LAYOUTS:
        record = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "layout": layout,
                  "table_sha256": hashlib.sha256(text).hexdigest(), "header": dict(header), "trailer": list(trailer)}
        with atomic_output(sidecar_path(path), overwrite=overwrite) as tmp:
            tmp.write_text(jsontext.dumps(record, indent=1) + "\n", encoding="utf-8")


def _check_header(header: Any, where: str) -> dict[str, Any]:
    if not isinstance(header, dict) or header.get("version") != TABLE_VERSION:
        found = header.get("version") if isinstance(header, dict) else header
        raise FixtureError(f"{where}: header version is {found!r}, expected {TABLE_VERSION}")
    if not set(HEADER_KEYS) <= set(header) <= set(HEADER_KEYS + OPTIONAL_HEADER_KEYS):
        raise FixtureError(f"{where}: header keys {sorted(header)}, expected {sorted(HEADER_KEYS)} and optionally "
                           f"{list(OPTIONAL_HEADER_KEYS)}")
    if "evidence" in header and not isinstance(header["evidence"], dict):
        raise FixtureError(f"{where}: header evidence must be an object, found {header['evidence']!r}")
    fixture = header["fixture"]
    if not isinstance(fixture, dict) or set(fixture) != set(FIXTURE_KEYS) \
            or not isinstance(fixture["content_sha256"], str) or not isinstance(fixture["cases"], int):
        raise FixtureError(f"{where}: header fixture must have keys {list(FIXTURE_KEYS)}, found {fixture!r}")
    return header


def _header(line: str, where: str) -> dict[str, Any]:
    try:
        header = jsontext.loads(line[len(HEADER_PREFIX):])
    except ValueError as exc:
        raise FixtureError(f"{where}: header is not valid JSON ({exc})") from None
    return _check_header(header, where)


def _ds4_layout(line: str) -> str | None:
    columns = tuple(line.split("\t"))
    return next((name for name in DS4_LAYOUTS if LAYOUTS[name] == columns), None)


def _rows(lines: Sequence[str], first_line_no: int, columns: Sequence[str], path: Path, *,
          trailer_allowed: bool) -> tuple[list[CaseScore], list[str]]:
    scores, trailer, seen = [], [], {}
    for line_no, line in enumerate(lines, first_line_no):
        if line.startswith("#"):
            if not trailer_allowed:
                raise FixtureError(f"line {line_no}: a '#' line in a ds4 table (score_official writes rows only; "
                                   "its summary goes to stderr)", path=path)
            trailer.append(line[1:].strip())
            continue
        if trailer:
            raise FixtureError(f"line {line_no}: a case row after the summary lines", path=path)
        score = parse_row(line.split("\t"), f"{path}: line {line_no}", columns)
        if score.id in seen:
            raise FixtureError(f"line {line_no}: case {score.id!r} appears twice (first on line {seen[score.id]})",
                               path=path)
        seen[score.id] = line_no
        scores.append(score)
    if not scores:
        raise FixtureError("the table has no case rows", path=path)
    return scores, trailer


def _check_complete(header: Mapping[str, Any], scores: Sequence[CaseScore], trailer: Sequence[str],
                    path: Path) -> None:
    expected = header["fixture"]["cases"]
    if len(scores) != expected:
        raise FixtureError(f"table has {len(scores)} case rows but its fixture has {expected} cases "
                           "(an incomplete table)", path=path)
    totals = Totals.of(scores)
    summary = next((line for line in trailer if line.startswith("summary ")), None)
    match = _SUMMARY.match(summary) if summary else None
    if match is None:
        raise FixtureError("the 'summary' line is missing or malformed", path=path)
    recorded = tuple(int(g) for g in match.groups())
    if recorded != (totals.cases, totals.tokens, totals.first_matches):
        raise FixtureError(f"the summary line says cases/tokens/first_match {recorded} but the rows add up to "
                           f"{(totals.cases, totals.tokens, totals.first_matches)}", path=path)


def _read_sidecar(table: Path, data: bytes, layout: str, max_bytes: int) -> tuple[dict[str, Any], list[str]] | None:
    path = sidecar_path(table)
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > max_bytes:
        raise FixtureError(f"sidecar is {size} bytes, more than the limit of {max_bytes} (max_sidecar_bytes)",
                           path=path)
    try:
        record = jsontext.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise FixtureError(f"not valid JSON ({exc})", path=path) from None
    if not isinstance(record, dict) or record.get("format") != SIDECAR_FORMAT:
        raise FixtureError(f"not a quantkit score sidecar (format must be {SIDECAR_FORMAT!r})", path=path)
    if record.get("version") != SIDECAR_VERSION or set(record) != set(SIDECAR_KEYS):
        raise FixtureError(f"version {record.get('version')!r} with keys {sorted(record)}; expected version "
                           f"{SIDECAR_VERSION} with keys {sorted(SIDECAR_KEYS)}", path=path)
    if record["table_sha256"] != hashlib.sha256(data).hexdigest():
        raise FixtureError(f"the sidecar was written for other table bytes than {table.name}'s (the table was "
                           "edited or re-scored): remove the stale sidecar or re-score", path=path)
    if record["layout"] != layout:
        raise FixtureError(f"the sidecar records layout {record['layout']!r} but the table is {layout!r}", path=path)
    trailer = record["trailer"]
    if not isinstance(trailer, list) or not all(isinstance(line, str) for line in trailer):
        raise FixtureError("trailer must be a list of strings", path=path)
    return _check_header(record["header"], f"{path}: header"), trailer


def read_table(path: str | os.PathLike, *, max_bytes: int = MAX_TABLE_BYTES,
               max_sidecar_bytes: int = MAX_SIDECAR_BYTES) -> ScoreTable:
    """Read a score table of any layout (module doc) and check it is complete and consistent."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise FixtureError(f"table is {size} bytes, more than the limit of {max_bytes} (max_bytes)", path=path)
    data = path.read_bytes()
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise FixtureError(f"not UTF-8 ({exc})", path=path) from None
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise FixtureError("the table is empty", path=path)
    if lines[0].startswith(HEADER_PREFIX):
        header = _header(lines[0], str(path))
        if len(lines) < 2 or lines[1].split("\t") != list(COLUMNS):
            found = lines[1].split("\t") if len(lines) > 1 else "nothing"
            raise FixtureError(f"line 2: columns {found}, expected {list(COLUMNS)}", path=path)
        scores, trailer = _rows(lines[2:], 3, COLUMNS, path, trailer_allowed=True)
        _check_complete(header, scores, trailer, path)
        return ScoreTable(path, header, tuple(scores), tuple(trailer))
    layout = _ds4_layout(lines[0])
    if layout is None:
        raise FixtureError(f"line 1: not a quantkit or ds4 score table: expected {HEADER_PREFIX.strip()!r} or ds4 "
                           f"score_official's column line ({len(COLUMNS)} or {len(NLL_COLUMNS)} columns "
                           f"{'/'.join(NLL_COLUMNS[:3])}/…), found {lines[0][:80]!r}", path=path)
    scores, _ = _rows(lines[1:], 2, LAYOUTS[layout], path, trailer_allowed=False)
    sidecar = _read_sidecar(path, data, layout, max_sidecar_bytes)
    if sidecar is None:
        return ScoreTable(path, None, tuple(scores), (), layout)
    header, trailer = sidecar
    _check_complete(header, scores, trailer, path)
    return ScoreTable(path, header, tuple(scores), tuple(trailer), layout)
