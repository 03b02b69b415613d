"""``quantkit imatrix info``: what an importance matrix holds, as a JSON-serializable report and as text.

Per tensor: matrices observed / total, counts (min..max over observed matrices) and statistics of the importance
``in_sum2/count`` over every observed matrix and column (sum, mean, min, max, standard deviation, and the share of
columns whose importance is above 1e-5, llama-imatrix's "active" threshold).  Coverage: routed experts never
observed, per block and in total, and tensors never observed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .model import Imatrix

#: llama-imatrix --show-statistics counts a column as active above this importance.
ACTIVE_THRESHOLD = 1e-5
#: Tensor tables longer than this are cut (head and tail) unless ``show_all``.
MAX_ROWS = 40
HEAD_ROWS = 30
TAIL_ROWS = 5


def tensor_statistics(imatrix: Imatrix, name: str) -> dict[str, Any]:
    e = imatrix.entries[name]
    seen = e.observed
    row = {"name": name, "matrices": e.n_mat, "n_per_row": e.n_per_row, "observed": int(seen.sum())}
    if not seen.any():
        return row
    imp = (e.in_sum2[seen].astype(np.float64) / e.counts[seen, None].astype(np.float64)).reshape(-1)
    row.update(count_min=float(e.counts[seen].min()), count_max=float(e.counts[seen].max()),
               sum=float(imp.sum()), mean=float(imp.mean()), min=float(imp.min()), max=float(imp.max()),
               std=float(imp.std()), active=float((imp > ACTIVE_THRESHOLD).mean()))
    return row


def describe(imatrix: Imatrix) -> dict[str, Any]:
    cov = imatrix.coverage()
    return {
        "path": str(imatrix.path) if imatrix.path else None, "sha256": imatrix.sha256,
        "entries": len(imatrix.entries), "chunk_count": imatrix.chunk_count, "chunk_size": imatrix.chunk_size,
        "counts_unit": imatrix.counts_unit, "datasets": list(imatrix.datasets), "synthetic": imatrix.synthetic,
        "provenance": dict(imatrix.provenance),
        "coverage": {"summary": str(cov), "observed": cov.observed, "total": cov.total,
                     "layers": {str(k): {"observed": o, "total": t} for k, (o, t) in cov.layers.items()},
                     "unobserved_tensors": cov.unobserved_tensors},
        "tensors": [tensor_statistics(imatrix, n) for n in sorted(imatrix.entries)],
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _provenance_value(key: str, value: str) -> str:
    if key == "source_files" and value:   # a SHA-256 per shard: hundreds on a large model
        return f"{value.count(',') + 1} files hashed (--json lists each SHA-256)"
    return value


def render(report: dict[str, Any], *, show_all: bool = False) -> str:
    cov = report["coverage"]
    lines = [
        f"imatrix: {report['path']}",
        f"sha256: {report['sha256']}",
        f"entries: {report['entries']}  chunks: {report['chunk_count']}  chunk size: {report['chunk_size']}"
        + ("" if report["counts_unit"] == "tokens" else f"  (counts in {report['counts_unit']})"),
        f"datasets: {', '.join(report['datasets']) or '(none)'}",
        f"synthetic: {'yes (not for releases)' if report['synthetic'] else 'no'}",
    ]
    lines += [f"{k}: {_provenance_value(k, v)}" for k, v in sorted(report["provenance"].items())]
    lines.append(f"coverage: {cov['summary']}")
    for layer, c in cov["layers"].items():
        if c["observed"] < c["total"]:
            lines.append(f"  blk.{layer}: {c['total'] - c['observed']} of {c['total']} experts never routed")
    if cov["unobserved_tensors"]:
        lines.append(f"  never observed: {', '.join(cov['unobserved_tensors'])}")
    header = ("tensor", "mats", "n", "observed", "count", "mean", "min", "max", "std", "active")
    rows = [header]
    for t in report["tensors"]:
        count = "-" if "count_min" not in t else (
            f"{t['count_min']:.0f}" if t["count_min"] == t["count_max"] else f"{t['count_min']:.0f}..{t['count_max']:.0f}")
        rows.append((t["name"], str(t["matrices"]), str(t["n_per_row"]), f"{t['observed']}/{t['matrices']}", count,
                     _fmt(t.get("mean")), _fmt(t.get("min")), _fmt(t.get("max")), _fmt(t.get("std")),
                     "-" if "active" not in t else f"{100 * t['active']:.1f}%"))
    if not show_all and len(rows) - 1 > MAX_ROWS:
        cut = len(rows) - 1 - HEAD_ROWS - TAIL_ROWS
        rows = rows[:1 + HEAD_ROWS] + [(f"... {cut} more (--all)",) + ("",) * (len(header) - 1)] + rows[-TAIL_ROWS:]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
              for r in rows]
    return "\n".join(lines)
