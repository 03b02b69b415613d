"""``quantkit validate`` for a sidecar: structure, scales, numeric error against the source, provenance.

:func:`validate_sidecar` takes ``<name>.json`` or ``<name>.safetensors`` (the checkpoint is the directory holding
it) and returns a :class:`ValidationReport`: a list of named checks, each passed or failed with a one-line detail.
It raises when the manifest cannot be found or read, the checkpoint beside it does not open, or the payload header
cannot be parsed (unreadable input, exit 2); every other problem (a size, hash, tensor or identity that differs) is a
failed check (exit 1).

Checks:

- ``manifest``: the manifest parses and matches the schema (:mod:`.manifest`);
- ``payload``: ``<name>.safetensors`` exists, its size and SHA-256 are the manifest's, its tensors (names, dtypes,
  shapes) are exactly the manifest's;
- ``layout``: every module holds exactly its encoding's tensors (all scales present; no tensor of another
  convention) with the shapes the encoding gives for the module's weight shape;
- ``scales``: every scale (block, global, per-tensor, activation) is finite and > 0, and the members of a fused
  group (:data:`~quantkit.swapset.families.FUSED_GROUPS`: q/k/v, gate/up, ...) share one NVFP4 global scale;
- ``token_ids`` (draft heads): int32, strictly increasing, inside the source head, one per row, and a multiple of
  128 rows unless the whole head is kept;
- ``error``: native tensors are byte-identical to the source tensors; self-quantized weights decode within
  :data:`NVFP4_REL_BOUND` (NVFP4) or :data:`FP8_REL_BOUND` (FP8) of each scale block's max |w| of the float32
  source, plus :data:`NVFP4_ABS_BOUND` of the global amax (NVFP4: blocks too small for any E4M3 scale) and
  :data:`ABS_ERROR_FLOOR`.  The bounds are the encodings' worst cases: a normal E4M3 block scale is within 1/16,
  a subnormal one within 1/3, of amax/6, and E2M1's widest half-gap is one scale step; E4M3 values are within
  1/16 relative;
- ``provenance``: the checkpoint's (and a reachable source's) identity and every replaced / source tensor's
  SHA-256 match the manifest.

When the manifest names a source checkpoint at another path that no longer opens, ``error`` passes with a detail
saying it was not measured (the sidecar holds the copied tensors; nothing is wrong with it).
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import FormatError, MissingSourceError, QuantkitError
from ..formats.minifloat import E8M0_NAN, e4m3_decode, e8m0_decode
from ..io.atomic import sha256_file
from ..io.checkpoint import Checkpoint, open_checkpoint
from . import draft
from .encodings import FP8_BLOCK, Encoding
from .inventory import sidecar_paths, verify
from .manifest import read_manifest
from .payload import check_layout, module_tensors, open_payload
from .tensors import ROW_ROLES, tensor_sha256

#: Roles of an NVFP4 module's global scale (ModelOpt's, compressed-tensors' divisor): one per fused group.
GLOBAL_SCALE_ROLES = ("global_scale", "global_scale_divisor")

NVFP4_REL_BOUND = 0.34
NVFP4_ABS_BOUND = 2.0 ** -17
FP8_REL_BOUND = 0.0625 * (1 + 2.0 ** -10)
ABS_ERROR_FLOOR = 1e-9
_NVFP4_RANGE = 6.0 * 448.0


@dataclass
class ValidationReport:
    path: str
    checks: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    @property
    def problems(self) -> list[str]:
        return [f"{c['check']}: {c['detail']}" for c in self.checks if not c["ok"]]

    def add(self, check: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": check, "ok": bool(ok), "detail": detail})
        return ok

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "checks": self.checks}


def validate_sidecar(path: str | os.PathLike, *, full: bool = True) -> ValidationReport:
    """Validate the sidecar at ``path`` (``<name>.json`` or ``<name>.safetensors``); see the module docstring."""
    path = Path(path)
    if path.suffix not in (".json", ".safetensors"):
        raise FormatError("a sidecar is given by its .json manifest or .safetensors payload", path=path)
    model_dir, name = path.parent, path.stem
    st, js = sidecar_paths(model_dir, name)
    if not js.is_file():
        raise MissingSourceError("no manifest beside the sidecar (not a quantkit swapset?)", path=js)
    report = ValidationReport(str(js))
    manifest = read_manifest(js)   # a manifest that cannot be read is unreadable input (FormatError), not a check
    report.add("manifest", True)
    with open_checkpoint(model_dir) as ckpt:
        if not _payload(report, model_dir, manifest, st, full):
            return report
        payload = open_payload(model_dir, manifest)
        src = _source(report, manifest, ckpt)
        try:
            _tensors(report, manifest, payload, src, js)
        finally:
            if src is not None and src is not ckpt:
                src.close()
        v = verify(model_dir, manifest, ckpt, full=full)
        report.add("provenance", not (v.stale or v.damaged), "; ".join(v.stale + v.damaged + v.notes))
    return report


def _payload(report: ValidationReport, model_dir: Path, manifest: dict, st: Path, full: bool) -> bool:
    if not st.is_file():
        return report.add("payload", False, f"{st.name} is missing")
    size = st.stat().st_size
    if size != manifest["sidecar"]["bytes"]:
        return report.add("payload", False, f"{size} bytes, the manifest says {manifest['sidecar']['bytes']}")
    # always: the error check below reads every tensor anyway, and a scale changed within its bounds only shows here
    if sha256_file(st) != manifest["sidecar"]["sha256"]:
        return report.add("payload", False, "SHA-256 differs from the manifest")
    open_payload(model_dir, manifest).close()   # a header that cannot be parsed is unreadable input: it raises
    return report.add("payload", True)


def _source(report: ValidationReport, manifest: dict, ckpt: Checkpoint) -> Checkpoint | None:
    path = manifest["source"]["path"]
    if path == ".":
        return ckpt
    try:
        return open_checkpoint(path)
    except QuantkitError as e:
        report.add("error", True, f"source checkpoint {path} unavailable, numeric error not measured: {e}")
        return None


def _tensors(report: ValidationReport, manifest: dict, payload, src: Checkpoint | None, js: Path) -> None:
    try:
        groups = module_tensors(manifest)
    except FormatError as e:
        report.add("layout", False, e.detail)
        return
    layout_problems, scale_problems, error_problems, token_problems = [], [], [], []
    worst = 0.0
    global_scales: dict[str, dict[str, float]] = defaultdict(dict)   # fused group -> tensor -> its global scale
    for module in manifest["modules"]:
        entries = groups.get(module["output_module"], {})
        try:
            enc = check_layout(manifest, module["output_module"], set(entries), js)
        except FormatError as e:
            layout_problems.append(e.detail)
            continue
        arrays = {suffix: payload.array(t["name"]) for suffix, t in entries.items()}
        rows = arrays.get(draft.TOKEN_IDS_SUFFIX)
        weight_shape = _weight_shape(arrays, enc)
        expected = enc.output_specs(weight_shape) if module["origin"] == "self-quantized" else {}
        for suffix, (shape, dtype) in expected.items():
            if (entries[suffix]["dtype"], tuple(entries[suffix]["shape"])) != (dtype, tuple(shape)):
                layout_problems.append(f"{entries[suffix]['name']}: {entries[suffix]['dtype']} "
                                       f"{entries[suffix]['shape']}, expected {dtype} {list(shape)}")
        scale_problems += _scale_problems(entries, arrays)
        for suffix, t in entries.items():
            if t["role"] in GLOBAL_SCALE_ROLES and module["origin"] == "self-quantized":
                global_scales[module["group"]][t["name"]] = float(np.asarray(arrays[suffix]).flat[0])
        if rows is not None:
            token_problems += _token_problems(module, manifest, rows, arrays[enc.weight_suffix])
        if src is None or layout_problems or scale_problems or token_problems:
            continue
        try:
            error = _error(module, manifest, enc, arrays, src, rows)
        except QuantkitError as e:
            error_problems.append(f"{module['module']}: {e}")
            continue
        if isinstance(error, str):
            error_problems.append(f"{module['module']}: {error}")
        else:
            worst = max(worst, error)
    for group, scales in global_scales.items():
        if len(set(scales.values())) > 1:     # engines run a fused group as one matmul with one global scale
            scale_problems.append(f"{group}: its members' global scales differ ("
                                  + ", ".join(f"{n} {v!r}" for n, v in scales.items()) + ")")
    report.add("layout", not layout_problems, "; ".join(layout_problems[:4]))
    report.add("scales", not scale_problems, "; ".join(scale_problems[:4]))
    if manifest["kind"] == "draft-lm-head":
        report.add("token_ids", not token_problems, "; ".join(token_problems[:4]))
    if src is not None:
        report.add("error", not error_problems,
                   "; ".join(error_problems[:4]) or f"worst error {worst:.4f} of its bound")


def _weight_shape(arrays: dict, enc: Encoding) -> tuple[int, ...]:
    """The float32 weight shape a module's stored weight encodes (packed NVFP4 holds two values per byte)."""
    w = arrays[enc.weight_suffix]
    if enc.name.startswith("nvfp4"):
        return w.shape[:-1] + (2 * w.shape[-1],)
    return w.shape


def _scale_problems(entries: dict, arrays: dict) -> list[str]:
    problems = []
    for suffix, t in entries.items():
        if t["role"] in ("weight", "token_ids"):
            continue
        a = arrays[suffix]
        if t["dtype"] == "F8_E4M3":
            values = e4m3_decode(a)
        elif t["dtype"] == "F8_E8M0":
            if (a.view(np.uint8) == E8M0_NAN).any():
                problems.append(f"{t['name']}: E8M0 NaN code")
                continue
            values = e8m0_decode(a)
        else:
            values = np.asarray(a, dtype=np.float32)
        if not (np.isfinite(values).all() and (values > 0).all()):
            problems.append(f"{t['name']}: {int((~np.isfinite(values) | (values <= 0)).sum())} scales not finite "
                            f"and > 0")
    return problems


def _token_problems(module: dict, manifest: dict, ids: np.ndarray, weight: np.ndarray) -> list[str]:
    info = manifest["draft_lm_head"] or {}
    source_rows = info.get("source_rows")
    problems = []
    if ids.dtype != np.int32 or ids.ndim != 1:
        return [f"token_ids must be int32 [K], found {ids.dtype} {list(ids.shape)}"]
    if len(ids) != weight.shape[0]:
        problems.append(f"{len(ids)} token ids for {weight.shape[0]} head rows")
    if len(ids) and ((np.diff(ids) <= 0).any() or ids[0] < 0 or (source_rows is not None and ids[-1] >= source_rows)):
        problems.append("token ids must be strictly increasing inside the source head")
    if source_rows is not None and len(ids) % draft.ROW_BLOCK and len(ids) != source_rows:
        problems.append(f"{len(ids)} kept rows is not a multiple of {draft.ROW_BLOCK}")
    return problems


def _group_amax(w: np.ndarray, enc: Encoding) -> np.ndarray:
    """Per element, the max |w| of the scale block it belongs to."""
    a = np.abs(w)
    if enc.name.startswith("nvfp4"):
        g = a.reshape(*a.shape[:-1], -1, 16).max(axis=-1, keepdims=True)
        return np.broadcast_to(g, a.shape[:-1] + (a.shape[-1] // 16, 16)).reshape(a.shape)
    if enc.name == "fp8-tensor":
        return np.broadcast_to(a.max(axis=(-2, -1), keepdims=True), a.shape)
    if enc.name == "fp8-channel":
        return np.broadcast_to(a.max(axis=-1, keepdims=True), a.shape)
    out = np.empty_like(a)
    for r in range(0, a.shape[-2], FP8_BLOCK[0]):
        for c in range(0, a.shape[-1], FP8_BLOCK[1]):
            block = a[..., r:r + FP8_BLOCK[0], c:c + FP8_BLOCK[1]]
            out[..., r:r + FP8_BLOCK[0], c:c + FP8_BLOCK[1]] = block.max(axis=(-2, -1), keepdims=True)
    return out


def _error(module: dict, manifest: dict, enc: Encoding, arrays: dict, src: Checkpoint, rows) -> float | str:
    """Worst error / bound ratio of a self-quantized module; for a native one, 0.0 or what differs."""
    if module["origin"] == "native":
        for t in manifest["tensors"]:
            if t["module"] != module["output_module"] or t["role"] == "token_ids":
                continue
            stored = arrays[t["name"][len(module["output_module"]) + 1:]]
            original = src.raw(t["source"])
            if rows is not None and t["role"] in ROW_ROLES:
                original = original[rows]
            if tensor_sha256(stored) != tensor_sha256(original):
                return f"native tensor {t['name']} differs from source {t['source']}"
        return 0.0
    w = src.tensor_f32(module["source_tensor"])
    if rows is not None:
        w = w[rows]
    decoded = enc.decode({s: a for s, a in arrays.items() if s != draft.TOKEN_IDS_SUFFIX})
    bound = (NVFP4_REL_BOUND if enc.name.startswith("nvfp4") else FP8_REL_BOUND) * _group_amax(w, enc)
    if enc.name.startswith("nvfp4"):
        g = np.asarray(arrays[enc.weight_suffixes[2]], dtype=np.float32)
        global_amax = g * _NVFP4_RANGE if enc.name == "nvfp4-modelopt" else _NVFP4_RANGE / g
        bound = bound + NVFP4_ABS_BOUND * (global_amax.reshape(-1, *([1] * (w.ndim - 1)))
                                           if global_amax.size > 1 else global_amax.reshape(()))
    bound = bound + ABS_ERROR_FLOOR
    ratio = np.abs(decoded - w) / bound
    worst = float(ratio.max(initial=0.0))
    if worst > 1.0:
        where = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        return f"error {float(np.abs(decoded - w)[where]):.3g} at {list(map(int, where))} exceeds the bound " \
               f"{float(bound[where]):.3g}"
    return worst
