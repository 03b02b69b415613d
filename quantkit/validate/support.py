"""``support.target``: a support (drafter) file and the target it is to be paired with come from one checkpoint.

A support file (``convert --support``) records ``quantkit.support.checkpoint``, the identity of the checkpoint
it was made from (:func:`quantkit.convert.provenance.checkpoint_identity`); the target's identity is computed from
its recorded source hashes the same way.  The pair is refused (the check fails, exit 1) when they differ, when the
target is itself a support file, or when the target records no source hashes (its checkpoint cannot be told).
The rule engines ship with it: "use the 0731 DSpark support GGUF only with a Flash 0731 target".
"""
from __future__ import annotations

from pathlib import Path

from ..convert.provenance import checkpoint_identity
from ..errors import FormatError, ValidationError
from ..io.gguf_reader import GGUFFile
from .report import Check, check

KIND_KEY = "quantkit.support.kind"
IDENTITY_KEY = "quantkit.support.checkpoint"


def _value(f: GGUFFile, key: str):
    kv = f.metadata.get(key)
    return None if kv is None else kv.value


def file_identity(f: GGUFFile) -> str | None:
    """The checkpoint identity a (target) file's recorded source hashes give; None when it records none."""
    files, hashes = _value(f, "quantkit.source.files"), _value(f, "quantkit.source.sha256")
    if not isinstance(files, list) or not isinstance(hashes, list) or len(files) != len(hashes) or not files:
        return None
    return checkpoint_identity((str(n), str(h)) for n, h in zip(files, hashes))


def target_check(support: GGUFFile, target: str | Path) -> Check:
    """``support.target`` for ``support`` paired with the GGUF file ``target``."""
    kind, recorded = _value(support, KIND_KEY), _value(support, IDENTITY_KEY)
    if not isinstance(kind, str) or not isinstance(recorded, str):
        return check("support.target", [f"{support.path} is not a support file (no {KIND_KEY} / {IDENTITY_KEY}): "
                                        f"--target pairs a support (drafter) file with its target"])
    with GGUFFile(target) as t:
        problems = []
        if _value(t, KIND_KEY) is not None:
            problems.append(f"the target {target} is itself a {_value(t, KIND_KEY)} support file")
        identity = file_identity(t)
        if identity is None:
            problems.append(f"the target {target} records no source hashes (not converted by quantkit): the "
                            f"checkpoint it was made from cannot be told")
        elif identity != recorded:
            problems.append(f"the {kind} support file was made from checkpoint {recorded[:16]}…, the target {target} "
                            f"from another one ({identity[:16]}…): pair it only with a target of its own checkpoint")
        labels = _value(support, "quantkit.checkpoint_label"), _value(t, "quantkit.checkpoint_label")
        if None not in labels and labels[0] != labels[1]:
            problems.append(f"checkpoint labels differ: support {labels[0]!r}, target {labels[1]!r}")
    return check("support.target", problems,
                 passed=f"{kind} support file and target {Path(target).name} come from checkpoint {recorded[:16]}…")


def require_pair(model: str | Path, support: str | Path | None) -> str | None:
    """For ``score``: refuse a support file given as the model, and a ``support`` file whose checkpoint is not
    the model's (ValidationError naming both); returns the line to record, or None without ``support``."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        try:
            with GGUFFile(path) as f:
                kind = _value(f, KIND_KEY)
        except FormatError:   # not a readable GGUF: the model loader refuses it, in its own words
            kind = None
        if kind is not None:
            raise ValidationError(f"MODEL is a {kind} support (drafter) file, not a model: score its target",
                                  path=path)
    if support is None:
        return None
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValidationError("--support pairs a support GGUF with a GGUF target; MODEL is not a GGUF file",
                              path=path)
    with GGUFFile(support) as s:
        found = target_check(s, path)
    if found.failed:
        raise ValidationError(f"support file refused: {found.detail}", path=support)
    return f"support file {Path(support).name}: {found.detail}"
