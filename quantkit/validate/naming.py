"""``name.claims``: what the artifact's file name claims (:mod:`quantkit.names`) against what the file holds.

A contradiction fails the check, so ``validate`` exits 1: a routed-expert, attention, shared-expert or output type
the tensors do not have, an ``imatrix`` the provenance says was not used, a checkpoint label other than the
recorded one.  A name that claims nothing (``model.gguf``) skips the check.  A file without quantkit's provenance
keys is checked for tensor types only.
"""
from __future__ import annotations

from ..io.gguf_reader import GGUFFile
from ..names import contradictions, parse
from .report import Check, check

NAME_CHECK = "name.claims"


def name_checks(f: GGUFFile) -> list[Check]:
    """The ``name.claims`` check, or none when the file name claims nothing."""
    name = parse(f.path.name)
    if not name.claims_anything:
        return []
    metadata = {key: kv.value for key, kv in f.metadata.items()}
    tensors = ((t.name, t.type.name, len(t.shape)) for t in f.tensors.values())
    problems = contradictions(name, tensors, metadata)
    claims = len(name.claims) + bool(name.calibration) + bool(name.label)
    return [check(NAME_CHECK, problems, passed=f"{claims} claim{'s' if claims != 1 else ''} of the "
                  f"{name.style}-style name hold")]
