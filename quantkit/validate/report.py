"""The validation report: every check with its status and detail, per-tensor payload results, and what was read.

JSON layout (:meth:`Report.to_json`, format version :data:`REPORT_VERSION`)::

    {"format": "quantkit-validation", "version": 1,
     "artifact": path, "kind": "gguf" | "sidecar", "payload": "none" | "sample" | "full", "seed": int,
     "ok": bool, "exit_code": 0 | 1,
     "source": {"path", "repo", "revision"} | null, "recipe": {"name", "sha256", "from"} | null,
     "imatrix": {"path", "sha256"} | null,
     "checks": [{"check": name, "status": "passed" | "failed" | "skipped", "detail": str, "items": [...]}],
     "notes": [str], "scope": str (what the verdict covers: "N of M tensors proven, K unproven (reasons)" for a
     file quantkit did not write, "structure only" without a source; empty otherwise),
     "tensors": [{"name", "type", "shape", "compared": "full" | "sample", "experts" (sampled ones), "rows",
                  "bytes_compared", "match", "differing_rows", "differing_experts", "differences" (the first few:
                  expert, row, block and file offset), "rel_rmse", "max_abs", "bound", "error_ok", "note"}],
     "io": {"artifact_bytes", "header_bytes", "artifact_bytes_read", "source_files_hashed_bytes"},
     "sampled_bytes": [payload bytes compared, payload bytes in the file] (``sample``) | null,
     "evidence": what produced the report: tool versions, threads, the artifact's SHA-256 and size, the command
                 line (:mod:`quantkit.evidence`) | null}

A report is valid (exit code 0) when no check failed; skipped checks say why they did not run.  When the input
cannot be read at all, ``quantkit validate --json`` writes ``{"format", "artifact", "ok": false, "exit_code": 2,
"error", "evidence"}`` instead (the evidence without the artifact's hash).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPORT_VERSION = 1
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
#: Items kept per check in the JSON report (the count of all of them is always given).
MAX_ITEMS = 1000
#: Items shown per failed check in the text rendering.
ITEMS_SHOWN = 5


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (the reader's escapes of invalid bytes in recorded strings) shown as
    backslash escapes, so it can be printed and written anywhere."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""
    items: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"check": self.name, "status": self.status, "detail": self.detail}
        if self.items:
            out["items"] = self.items[:MAX_ITEMS]
            out["item_count"] = len(self.items)
        return out


def check(name: str, problems: list[str], passed: str = "", failed: str = "") -> Check:
    """A check that failed when ``problems`` is non-empty (each problem one item)."""
    if problems:
        return Check(name, FAILED, failed or f"{len(problems)} problem{'s' if len(problems) > 1 else ''}: "
                     f"{problems[0]}", list(problems))
    return Check(name, PASSED, passed)


def skipped(name: str, why: str) -> Check:
    return Check(name, SKIPPED, why)


@dataclass
class Report:
    artifact: str
    kind: str
    payload: str
    seed: int
    checks: list[Check] = field(default_factory=list)
    tensors: list[dict] = field(default_factory=list)
    source: dict | None = None
    recipe: dict | None = None
    imatrix: dict | None = None
    io: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sampled_bytes: tuple[int, int] | None = None
    """(payload bytes compared, payload bytes in the file) of a ``sample`` audit."""
    scope: str = ""
    """What the verdict covers, when not everything was proven (a foreign file: tensors proven of all)."""
    evidence: dict | None = None
    """:func:`quantkit.evidence.evidence` of the run."""

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        return {"format": "quantkit-validation", "version": REPORT_VERSION, "artifact": self.artifact,
                "kind": self.kind, "payload": self.payload, "seed": self.seed, "ok": self.ok,
                "exit_code": self.exit_code, "source": self.source, "recipe": self.recipe, "imatrix": self.imatrix,
                "checks": [c.to_json() for c in self.checks], "notes": self.notes, "scope": self.scope,
                "tensors": self.tensors, "io": self.io, "sampled_bytes": self.sampled_bytes, "evidence": self.evidence}

    def render(self) -> str:
        """One line per check, the first few items of failed checks, and a verdict."""
        width = max((len(c.name) for c in self.checks), default=0)
        lines = [f"{self.artifact}: {self.kind}, payload {self.payload}"
                 + (f" (seed {self.seed})" if self.payload == "sample" and self.kind == "gguf" else "")]
        for c in self.checks:
            lines.append(f"  {c.status:7} {c.name:<{width}}  {c.detail}".rstrip())
            if c.failed and len(c.items) > 1:
                lines += [f"          - {item}" for item in c.items[:ITEMS_SHOWN]]
                if len(c.items) > ITEMS_SHOWN:
                    lines.append(f"          … {len(c.items) - ITEMS_SHOWN} more (--report FILE lists them)")
        lines += [f"  note: {note}" for note in self.notes]
        failed = sum(c.failed for c in self.checks)
        scope = [self.scope] if self.scope else []
        if self.sampled_bytes is not None:
            scope.append(f"sampled: {self.sampled_bytes[0]:,} of {self.sampled_bytes[1]:,} payload bytes compared")
        verdict = "valid" if not failed else f"INVALID: {failed} of {len(self.checks)} checks failed"
        lines.append(f"{verdict} ({'; '.join(scope)})" if scope else verdict)
        return printable("\n".join(lines))
