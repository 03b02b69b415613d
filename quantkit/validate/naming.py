"""``name.claims``: what the artifact's file name claims (:mod:`quantkit.names`) against what the file holds.

A contradiction fails the check, so ``validate`` exits 1: a routed-expert, attention, shared-expert or output type
the tensors do not have, an ``imatrix`` the recorded calibration says was not used, a checkpoint label other than
the recorded one (a file recording no label takes the name's, as the scorer reads it).  A name that claims nothing
(``model.gguf``) adds no check.  A file without quantkit's provenance keys is checked for tensor types only.
"""
from __future__ import annotations

from ..imatrix.bootstrap import CALIBRATION_KEY
from ..io.gguf_reader import GGUFFile
from ..names import contradictions, parse
from ..scoring.source import GGUF_LABEL_KEY
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
    types = len(name.claims)
    passed = f"{types} type claim{'s' if types != 1 else ''} of the {name.style}-style name hold"
    if name.calibration:
        passed += ("; the imatrix calibration is recorded" if CALIBRATION_KEY in metadata else
                   "; its imatrix claim cannot be checked (no recorded calibration)")
    if name.label:
        passed += (f"; label {name.label} is recorded" if GGUF_LABEL_KEY in metadata else
                   f"; no recorded label (the name's {name.label} is the file's label)")
    return [check(NAME_CHECK, problems, passed=passed)]
