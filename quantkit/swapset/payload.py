"""A sidecar's payload checked against its manifest: same tensors, and per module the encoding's exact tensor set.

:func:`open_payload` opens ``<name>.safetensors`` and requires its tensors (names, dtypes, shapes) to be exactly
the manifest's.  :func:`module_tensors` groups them by output module; :func:`check_layout` requires each module
to hold exactly its encoding's tensors (weight and scales, optionally the activation scale and, for a draft
head, ``token_ids``): a compressed-tensors ``weight_global_scale`` under a manifest that says ModelOpt is a
convention mismatch between the manifest and the bytes, reported as such.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import FormatError, MissingSourceError
from ..io.safetensors import SafetensorsFile
from .draft import TOKEN_IDS_SUFFIX
from .encodings import Encoding, encoding_by_name
from .inventory import sidecar_paths


def open_payload(model_dir: Path, manifest: dict) -> SafetensorsFile:
    st, _ = sidecar_paths(model_dir, manifest["name"])
    if not st.is_file():
        raise MissingSourceError("the sidecar's safetensors file is missing", path=st)
    f = SafetensorsFile(st)
    on_disk = {n: (e.dtype, list(e.shape)) for n, e in f.entries.items()}
    listed = {t["name"]: (t["dtype"], t["shape"]) for t in manifest["tensors"]}
    if on_disk != listed:
        differ = {n for n in set(on_disk) & set(listed) if on_disk[n] != listed[n]}
        diff = sorted((set(on_disk) ^ set(listed)) | differ)
        f.close()
        raise FormatError(f"the payload's tensors differ from the manifest's ({len(diff)} names or shapes, first "
                          f"{diff[0]!r})", path=st)
    return f


def module_tensors(manifest: dict) -> dict[str, dict[str, dict]]:
    """output module -> suffix -> manifest tensor entry."""
    out: dict[str, dict[str, dict]] = {}
    for t in manifest["tensors"]:
        module = t["module"]
        if not t["name"].startswith(module + "."):
            raise FormatError(f"tensor {t['name']!r} is not under its module {module!r}", field="tensors")
        out.setdefault(module, {})[t["name"][len(module) + 1:]] = t
    return out


def encoding_of(manifest: dict, suffixes: set[str]) -> Encoding:
    return encoding_by_name(manifest["encoding"], suffixes)


def check_layout(manifest: dict, module: str, suffixes: set[str], path: Path) -> Encoding:
    """The module's encoding, after checking that it holds exactly that encoding's tensors."""
    enc = encoding_of(manifest, suffixes)
    required = set(enc.weight_suffixes)
    allowed = required | ({enc.input_suffix} if enc.input_suffix else set())
    if manifest["kind"] == "draft-lm-head":
        allowed |= {TOKEN_IDS_SUFFIX}
    if not required <= suffixes or not suffixes <= allowed:
        raise FormatError(f"module {module!r} holds {sorted(suffixes)} but {enc.name} stores {sorted(required)} "
                          f"(plus optionally {sorted(allowed - required)}): convention mismatch between the manifest "
                          f"and the tensors", path=path, field="encoding")
    return enc
