"""A sidecar's measured quality: which sidecars a score table was made with, and a comparison kept in its manifest.

``quantkit score MODEL_DIR FIXTURE OUT.tsv --sidecar NAME ...`` scores the checkpoint with sidecars applied and
adds one trailer line to the table (a ``#`` comment, after the summary lines, so ds4-style readers see the same
columns)::

    # sidecars NAME=<sha256> [NAME=<sha256> ...]

``<sha256>`` is the sidecar payload's SHA-256 from its manifest (``sidecar.sha256``), in the order the sidecars
were given.  A table without the line was scored on the plain checkpoint.

:func:`record_comparison` (``quantkit swapset record``) compares a baseline table with a table scored with one
more sidecar (``quantkit compare``'s statistics: :func:`quantkit.scoring.compare.compare_tables`) and stores the
result as the sidecar's ``quality`` block.  It refuses tables that do not measure that sidecar: the new table
must list exactly the baseline's sidecars plus ``name``, with ``name``'s current payload hash, and both tables
must have scored the same checkpoint (equal model source digests).  The block is::

    {"method": "quantkit compare", "verdict": "no regression" | "regression", "failed": [blocker rules],
     "sidecar_sha256", "baseline_sidecars": {name: sha256},
     "tables": {"baseline", "with_sidecar"}, "model": {...the tables' model identity...},
     "comparison": {...Comparison.to_json()...}}

``verdict`` is the release gate's (``quantkit compare``'s exit code), not ``comparison.verdict``, which reads the
NLL interval alone: a sidecar that lowers NLL but fails a blocker rule is recorded as a regression.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import FixtureError, SourceError
from .inventory import record_quality, sidecar_paths
from .manifest import NAME_PATTERN, read_manifest

SIDECARS_PREFIX = "sidecars "
QUALITY_METHOD = "quantkit compare"
_ENTRY = re.compile(rf"({NAME_PATTERN.pattern})=([0-9a-f]{{64}})")


def sidecars_line(model_dir: str | Path, names: Sequence[str]) -> str:
    """The trailer line of a table scored with sidecars ``names`` beside ``model_dir`` (module docstring)."""
    entries = []
    for name in names:
        manifest = read_manifest(sidecar_paths(model_dir, name)[1])
        entries.append(f"{name}={manifest['sidecar']['sha256']}")
    return SIDECARS_PREFIX + " ".join(entries)


def table_sidecars(table) -> dict[str, str]:
    """name -> payload SHA-256 of the sidecars a :class:`quantkit.scoring.table.ScoreTable` was scored with
    (empty for the plain checkpoint)."""
    lines = [line for line in table.trailer if line.startswith(SIDECARS_PREFIX)]
    if len(lines) > 1:
        raise FixtureError(f"{len(lines)} '# {SIDECARS_PREFIX.strip()}' lines; a table has at most one",
                           path=table.path)
    if not lines:
        return {}
    out: dict[str, str] = {}
    for entry in lines[0][len(SIDECARS_PREFIX):].split():
        match = _ENTRY.fullmatch(entry)
        if match is None or match.group(1) in out:
            raise FixtureError(f"malformed '# {SIDECARS_PREFIX.strip()}' entry {entry!r}: expected NAME=<sha256>, "
                               f"each name once", path=table.path)
        out[match.group(1)] = match.group(2)
    return out


def record_comparison(model_dir: str | Path, name: str, baseline_path: str | Path, sidecar_path: str | Path, *,
                      resamples: int, seed: int):
    """Compare the two tables and store the result as sidecar ``name``'s quality block (module docstring).

    Returns the :class:`quantkit.scoring.compare.Comparison`."""
    from ..scoring.compare import compare_tables
    from ..scoring.table import read_table

    baseline, with_sidecar = read_table(baseline_path), read_table(sidecar_path)
    manifest = read_manifest(sidecar_paths(model_dir, name)[1])
    before, after = table_sidecars(baseline), table_sidecars(with_sidecar)
    if name in before:
        raise FixtureError(f"the baseline table was already scored with sidecar {name!r}", path=baseline.path)
    expected = {**before, name: manifest["sidecar"]["sha256"]}
    if after != expected:
        raise FixtureError(f"the table was scored with sidecars {_listed(after)}, expected the baseline's plus "
                           f"{name!r} at its current payload: {_listed(expected)}", path=with_sidecar.path)
    for table in (baseline, with_sidecar):
        if table.header is None:   # a ds4 table without its .json sidecar
            raise FixtureError("the table does not identify the model it scored (a ds4 table without its .json "
                               "sidecar): score with quantkit's table format or keep the sidecar", path=table.path)
    models = baseline.header["model"].get("source"), with_sidecar.header["model"].get("source")
    if models[0] is None or models[0] != models[1]:
        raise SourceError(f"the tables scored different or unidentified checkpoints (model source "
                          f"{models[0]!r} and {models[1]!r})", path=with_sidecar.path)
    comparison = compare_tables(baseline, with_sidecar, resamples=resamples, seed=seed)
    record_quality(model_dir, name, {
        "method": QUALITY_METHOD, "verdict": comparison.gate_verdict, "failed": comparison.failed,
        "sidecar_sha256": expected[name], "baseline_sidecars": before,
        "tables": {"baseline": str(baseline_path), "with_sidecar": str(sidecar_path)},
        "model": dict(with_sidecar.header["model"]), "comparison": comparison.to_json()})
    return comparison


def _listed(sidecars: dict[str, str]) -> str:
    return "[" + ", ".join(f"{n} ({sha[:12]}…)" for n, sha in sidecars.items()) + "]" if sidecars else "none"
