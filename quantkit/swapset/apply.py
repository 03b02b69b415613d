"""Load sidecars for a run: the tensors that replace (or, for a draft head, join) a checkpoint's.

:func:`apply_sidecars` is what the runtime calls with the sidecar names a run selects.  It refuses, with one error
naming the sidecar and the problem: a missing or malformed manifest, a damaged payload or a stale one (the
checkpoint's identity, or with ``full`` any replaced tensor's bytes, differ from the manifest: a
:class:`ValidationError`), a payload whose tensors or per-module layout differ from the manifest, a name given
twice, and two sidecars that cover the same checkpoint tensor or produce the same tensor name.

The result maps, per module, the checkpoint's stored weight name (for a draft head, the draft weight's name) to a
:class:`Replacement`: the sidecar's tensors for that module (read-only memory-mapped arrays, dtypes as in
:mod:`quantkit.io.safetensors`) and the checkpoint tensors the runtime must no longer load.

:func:`sidecar_replacements` is the runtime's view (``quantkit score --sidecar``): per replaced checkpoint weight,
a callable giving the float32 values a serving engine computes from the sidecar's tensors, decoded by
:meth:`.encodings.Encoding.decode` (the one decoder per format, :mod:`quantkit.formats.blockscaled`, shared with
the checkpoint reader): NVFP4 ``f32(e2m1 * f32(e4m3 * weight_scale_2))`` (ModelOpt) or ``f32(e2m1 * f32(e4m3 /
weight_global_scale))`` (compressed-tensors); FP8 ``f32(e4m3 * s)`` per tensor, row or 128x128 block (F32 or
E8M0 ``s``).  Activation scales do not change weights and are not applied: the runtime computes activations in
float32.  A draft head replaces nothing and is refused: its agreement report measures it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from ..errors import FormatError, MissingSourceError, SourceError, UnsupportedError, ValidationError
from ..io.checkpoint import open_checkpoint
from .encodings import encoding_by_name
from .inventory import sidecar_paths, verify
from .manifest import KINDS, read_manifest
from .payload import check_layout, module_tensors, open_payload
from .tensors import decoded_shape, stored_weight


@dataclass(frozen=True)
class Replacement:
    """One module's sidecar tensors and the checkpoint tensors they supersede."""

    sidecar: str
    kind: str
    module: str
    output_module: str
    encoding: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    removes: tuple[str, ...]


def apply_sidecars(checkpoint_dir: str | Path, names: Sequence[str], *, full: bool = True) -> dict[str, Replacement]:
    """The replacement tensors of sidecars ``names`` beside ``checkpoint_dir`` (module docstring)."""
    d = Path(checkpoint_dir)
    if len(set(names)) != len(names):
        raise SourceError(f"sidecar listed twice in {list(names)}", path=d)
    out: dict[str, Replacement] = {}
    owner: dict[str, str] = {}     # covered tensor name -> sidecar
    with open_checkpoint(d) as ckpt:
        for name in names:
            _, js = sidecar_paths(d, name)
            if not js.is_file():
                raise MissingSourceError(f"no sidecar {name!r} beside the checkpoint", path=js)
            manifest = read_manifest(js)
            v = verify(d, manifest, ckpt, full=full)
            if v.damaged or v.stale:
                raise ValidationError(f"sidecar {name!r} does not match: {'; '.join(v.damaged + v.stale)}", path=js)
            payload = open_payload(d, manifest)
            groups = module_tensors(manifest)
            for module in manifest["modules"]:
                tensors = groups.get(module["output_module"], {})
                enc = check_layout(manifest, module["output_module"], set(tensors), js)
                arrays = {t["name"]: payload.array(t["name"]) for t in tensors.values()}
                removes = tuple(module["replaces"])
                if manifest["kind"] == "replace":
                    key = stored_weight(ckpt, module["module"]) or module["module"]
                else:
                    key = f"{module['output_module']}.{enc.weight_suffix}"
                for covered in (key, *removes, *arrays):
                    if covered in owner and owner[covered] != name:
                        raise SourceError(f"sidecars {owner[covered]!r} and {name!r} both cover this tensor",
                                          path=d, tensor=covered)
                    owner[covered] = name
                out[key] = Replacement(name, manifest["kind"], module["module"], module["output_module"], enc.name,
                                       arrays, {t["name"]: t["dtype"] for t in tensors.values()}, removes)
    return out


def _decoded(rep: Replacement, tensor: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 weight an engine computes from one module's sidecar tensors (module docstring)."""
    enc = encoding_by_name(rep.encoding, {n[len(rep.output_module) + 1:] for n in rep.tensors})
    stored = {suffix: rep.tensors[f"{rep.output_module}.{suffix}"] for suffix in enc.weight_suffixes}
    w = enc.decode(stored)
    if w.shape != shape:
        raise FormatError(f"sidecar {rep.sidecar!r} decodes to shape {list(w.shape)}, the checkpoint tensor "
                          f"decodes to {list(shape)}", tensor=tensor)
    return w


def sidecar_replacements(checkpoint_dir: str | Path, names: Sequence[str], *, full: bool = True
                         ) -> dict[str, Callable[[], np.ndarray]]:
    """Checkpoint weight name -> a callable giving its float32 value with sidecars ``names`` applied (module
    docstring); the sidecars are checked first (:func:`apply_sidecars`, ``full`` hashes every replaced tensor)."""
    replacements = apply_sidecars(checkpoint_dir, names, full=full)
    drafts = sorted({r.sidecar for r in replacements.values() if r.kind != KINDS[0]})
    if drafts:
        raise UnsupportedError(f"sidecar {drafts[0]!r} is a draft head ({KINDS[1]}): it replaces no checkpoint "
                               f"tensor, so scoring cannot apply it; its agreement report (manifest "
                               f"draft_lm_head.agreement) measures it")
    with open_checkpoint(checkpoint_dir) as ckpt:
        shapes = {key: decoded_shape(ckpt, key) for key in replacements}
    return {key: partial(_decoded, rep, key, shapes[key]) for key, rep in replacements.items()}
