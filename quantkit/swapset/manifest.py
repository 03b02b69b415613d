"""The sidecar manifest ``<name>.json``: format, strict reader, writer, and checkpoint identity.

A sidecar is two files beside a checkpoint: ``<name>.safetensors`` (the tensors) and ``<name>.json`` (this
manifest).  The manifest is written last, so its presence marks a complete sidecar.  Format version
:data:`SCHEMA_VERSION` (independent of the quantkit version); a reader MUST refuse another ``schema`` or a
version it does not know, unknown keys and wrong types, negative sizes and counts included (each error names the
field).

Top level (all keys required; ``null`` where noted):

- ``schema`` = ``"quantkit.swapset"``, ``schema_version`` = 1, ``name`` (the file stem),
  ``kind``: ``"replace"`` (tensors replace checkpoint tensors) or ``"draft-lm-head"`` (an extra head for the
  MTP drafter, replacing nothing);
- ``model_type``, ``families`` (list), ``format`` (``nvfp4``, ``fp8-tensor`` ...), ``convention``
  (``modelopt`` / ``compressed-tensors``, ``null`` for FP8), ``encoding`` (format + convention);
- ``optional`` (bool: opt-in sidecar), ``tensor_parallel`` = ``{"layout": "none"}`` (sidecars are
  TP-agnostic: full tensors, sharded by the engine), ``supersedes`` (names of sidecars this one replaces);
- ``checkpoint``: identity of the checkpoint beside which the sidecar lives, ``source``: identity of the
  checkpoint the tensors were read from plus ``path`` (``"."`` when it is the same checkpoint).  An identity is
  ``{"config_sha256", "quant_config_sha256", "revision", "quantization", "shards"}``: SHA-256 of
  ``config.json`` and ``hf_quant_config.json`` (``null`` when absent), the Hugging Face revision when known
  (``null`` otherwise), the checkpoint's quantization, and per shard file ``{"bytes", "header_sha256"}``
  (SHA-256 of the safetensors header: names, dtypes, shapes and offsets; tensor bytes are covered per tensor
  below, so checking an identity never reads a whole checkpoint);
- ``sidecar``: ``{"file", "bytes", "sha256"}`` of ``<name>.safetensors``;
- ``modules``: per replaced (or added) module ``{"module", "output_module", "family", "group", "origin",
  "source_encoding", "source_tensor", "source_sha256", "replaces"}``; ``origin`` is ``native`` (bytes copied
  from an identically encoded source, never re-quantized) or ``self-quantized``; ``replaces`` maps each
  checkpoint tensor the module's sidecar tensors replace (weight and companions) to its SHA-256;
- ``tensors``: per sidecar tensor ``{"name", "shape", "dtype", "encoding", "role", "module", "origin",
  "source", "source_sha256"}`` (``source_sha256``: SHA-256 of the source tensor's stored bytes; for a
  self-quantized weight, of the source weight followed by the companions it was decoded with, in name order);
- ``calibration``: ``null`` or ``{"text_sha256", "tokens", "calibrated", "uncalibrated"}``;
- ``draft_lm_head``: ``null`` or ``{"source_rows", "kept_rows", "selection", "token_ids", "agreement"}``
  (``agreement``: ``null`` or ``{"positions", "top1", "top5", "coverage"}``);
- ``shared_as_expert``: ``null`` or ``{"expert_index"}``;
- ``generator``: ``{"name": "quantkit", "version", "arguments"}``;
- ``quality``: ``null`` or an object (results of ``quantkit compare``, recorded with :func:`record_quality`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import FormatError
from ..io import jsontext
from ..io.atomic import atomic_output, sha256_file
from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, MAX_JSON_BYTES, SINGLE_NAME
from ..io.safetensors import DEFAULT_MAX_HEADER_BYTES, HEADER_LENGTH_BYTES

SCHEMA = "quantkit.swapset"
SCHEMA_VERSION = 1
KINDS = ("replace", "draft-lm-head")
ORIGINS = ("native", "self-quantized")
TP_LAYOUT_NONE = {"layout": "none"}
#: Sidecar names: a plain file stem that cannot be mistaken for a checkpoint file.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RESERVED_NAMES = frozenset({"model", "config", "generation_config", "hf_quant_config", "tokenizer",
                            "tokenizer_config", "special_tokens_map", "preprocessor_config", "chat_template",
                            "model.safetensors.index", "quantkit_example", "quantkit_training"})
#: Where huggingface_hub's ``local_dir`` downloads keep per-file metadata (first line: the commit hash).
HF_LOCAL_METADATA = Path(".cache") / "huggingface" / "download"
_COMMIT = re.compile(r"[0-9a-f]{40}")


# ----------------------------------------------------------------------------------------------------------------
# schema

def _str(v) -> bool:
    return isinstance(v, str)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v) -> bool:
    return _int(v) and v >= 0


def _opt_fraction(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1)


def _bool(v) -> bool:
    return isinstance(v, bool)


def _opt_str(v) -> bool:
    return v is None or isinstance(v, str)


def _sha(v) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None


def _opt_sha(v) -> bool:
    return v is None or _sha(v)


def _shape(v) -> bool:
    return isinstance(v, list) and all(_int(d) and d >= 0 for d in v)


def _strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def _opt_obj(v) -> bool:
    return v is None or isinstance(v, dict)


def _dict(v) -> bool:
    return isinstance(v, dict)


def _list(v) -> bool:
    return isinstance(v, list)


def _origin(v) -> bool:
    return v in ORIGINS


_SHARD = {"bytes": _count, "header_sha256": _sha}
_IDENTITY = {"config_sha256": _opt_sha, "quant_config_sha256": _opt_sha, "revision": _opt_str,
             "quantization": _str, "shards": _dict}
_MODULE = {"module": _str, "output_module": _str, "family": _str, "group": _str, "origin": _origin,
           "source_encoding": _str, "source_tensor": _str, "source_sha256": _sha, "replaces": _dict}
_TENSOR = {"name": _str, "shape": _shape, "dtype": _str, "encoding": _str, "role": _str, "module": _str,
           "origin": _origin, "source": _str, "source_sha256": _sha}
_TOP = {"schema": lambda v: v == SCHEMA, "schema_version": lambda v: v == SCHEMA_VERSION, "name": _str,
        "kind": lambda v: v in KINDS, "model_type": _str, "families": _strs, "format": _str,
        "convention": _opt_str, "encoding": _str, "optional": _bool,
        "tensor_parallel": lambda v: v == TP_LAYOUT_NONE, "supersedes": _strs, "checkpoint": _dict, "source": _dict,
        "sidecar": _dict, "modules": _list, "tensors": _list, "calibration": _opt_obj, "draft_lm_head": _opt_obj,
        "shared_as_expert": _opt_obj, "generator": _dict, "quality": _opt_obj}
_SIDECAR = {"file": _str, "bytes": _count, "sha256": _sha}
_CALIBRATION = {"text_sha256": _sha, "tokens": _count, "calibrated": _strs, "uncalibrated": _strs}
_DRAFT = {"source_rows": _count, "kept_rows": _count, "selection": _str, "token_ids": _opt_str,
          "agreement": _opt_obj}
_AGREEMENT = {"positions": _count, "top1": _opt_fraction, "top5": _opt_fraction, "coverage": _opt_fraction}
_SHARED = {"expert_index": _count}
_GENERATOR = {"name": _str, "version": _str, "arguments": _dict}


def _check(obj: Any, spec: Mapping[str, Any], where: str, path: Path, extra: tuple[str, ...] = ()) -> None:
    if not isinstance(obj, dict):
        raise FormatError(f"{where} must be a JSON object, found {type(obj).__name__}", path=path, field=where)
    keys = set(obj)
    missing = sorted(set(spec) - keys)
    unknown = sorted(keys - set(spec) - set(extra))
    if missing or unknown:
        raise FormatError(f"{where}: missing keys {missing}, unknown keys {unknown}", path=path, field=where)
    for key, ok in spec.items():
        if not ok(obj[key]):
            raise FormatError(f"{where}.{key} has an invalid value {obj[key]!r}", path=path, field=f"{where}.{key}")


def validate_manifest(manifest: Any, path: Path) -> dict:
    """Check a parsed manifest against the schema (FormatError naming the field); returns it."""
    if isinstance(manifest, dict) and manifest.get("schema") == SCHEMA and manifest.get("schema_version") != \
            SCHEMA_VERSION:
        raise FormatError(f"schema_version {manifest.get('schema_version')!r} is not one this quantkit reads "
                          f"({SCHEMA_VERSION})", path=path, field="schema_version")
    _check(manifest, _TOP, "manifest", path)
    if not NAME_PATTERN.fullmatch(manifest["name"]) or f"{manifest['name']}.json" != path.name:
        raise FormatError(f"name {manifest['name']!r} does not match the file name {path.name!r}", path=path,
                          field="name")
    for key in ("checkpoint", "source"):
        _check(manifest[key], _IDENTITY, key, path, extra=("path",) if key == "source" else ())
        for shard, info in manifest[key]["shards"].items():
            _check(info, _SHARD, f"{key}.shards.{shard}", path)
    if not isinstance(manifest["source"].get("path"), str):
        raise FormatError("source.path must be a string", path=path, field="source.path")
    _check(manifest["sidecar"], _SIDECAR, "sidecar", path)
    _check(manifest["generator"], _GENERATOR, "generator", path)
    for key, spec in (("calibration", _CALIBRATION), ("draft_lm_head", _DRAFT), ("shared_as_expert", _SHARED)):
        if manifest[key] is not None:
            _check(manifest[key], spec, key, path)
    if manifest["draft_lm_head"] is not None and manifest["draft_lm_head"]["agreement"] is not None:
        _check(manifest["draft_lm_head"]["agreement"], _AGREEMENT, "draft_lm_head.agreement", path)
    for i, module in enumerate(manifest["modules"]):
        _check(module, _MODULE, f"modules[{i}]", path)
        if not all(_str(k) and _sha(v) for k, v in module["replaces"].items()):
            raise FormatError("replaces must map tensor names to SHA-256 hex digests", path=path,
                              field=f"modules[{i}].replaces")
    for i, tensor in enumerate(manifest["tensors"]):
        _check(tensor, _TENSOR, f"tensors[{i}]", path)
    return manifest


def read_json(path: Path, what: str) -> Any:
    """The parsed JSON file ``path`` (at most MAX_JSON_BYTES); FormatError naming it and ``what`` it is."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise FormatError(f"{what} is {size} bytes, over the {MAX_JSON_BYTES}-byte cap", path=path)
    try:
        return jsontext.loads(path.read_bytes().decode("utf-8"))
    except ValueError as e:   # UnicodeDecodeError included
        raise FormatError(f"{what} is not valid JSON: {e}", path=path) from None


def read_manifest(path: str | os.PathLike) -> dict:
    """Read and validate ``<name>.json``."""
    path = Path(path)
    return validate_manifest(read_json(path, "manifest"), path)


def is_manifest(path: Path) -> bool:
    """Whether ``path`` is a JSON file that claims to be a swapset manifest (valid or not)."""
    try:
        value = read_json(path, "manifest")
    except (OSError, FormatError):
        return False
    return isinstance(value, dict) and value.get("schema") == SCHEMA


def manifest_text(manifest: dict) -> str:
    """The manifest as written: JSON with sorted keys and a 1-space indent, no NaN/Infinity."""
    return json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False) + "\n"


def write_manifest(path: Path, manifest: dict, *, overwrite: bool = False) -> None:
    """Validate and write a manifest atomically."""
    validate_manifest(manifest, path)
    with atomic_output(path, overwrite=overwrite) as tmp:
        tmp.write_text(manifest_text(manifest), encoding="utf-8")


def check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name) or name in RESERVED_NAMES or name.endswith((".json", ".safetensors")):
        raise FormatError(f"sidecar name {name!r} must match {NAME_PATTERN.pattern}, not end in .json/.safetensors "
                          f"and not be a checkpoint file stem ({', '.join(sorted(RESERVED_NAMES))})", field="name")


# ----------------------------------------------------------------------------------------------------------------
# identity of a checkpoint

def header_sha256(path: Path, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> str:
    """SHA-256 of a safetensors file's length prefix and header (bounded read)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_LENGTH_BYTES)
        if len(head) != HEADER_LENGTH_BYTES:
            raise FormatError("EOF reading the header length", path=path, offset=0)
        (n,) = struct.unpack("<Q", head)
        if n > max_header_bytes:
            raise FormatError(f"header length {n} exceeds the cap of {max_header_bytes} bytes", path=path, offset=0)
        raw = f.read(n)
    if len(raw) != n:
        raise FormatError(f"EOF reading the header: expected {n} bytes, got {len(raw)}", path=path)
    return hashlib.sha256(head + raw).hexdigest()


def shard_files(directory: Path) -> list[str]:
    """The checkpoint's safetensors files: the index's shards, or ``model.safetensors``."""
    index = directory / INDEX_NAME
    if index.is_file():
        value = read_json(index, "index")
        if not isinstance(value, dict):
            raise FormatError(f"index must be a JSON object, found {type(value).__name__}", path=index)
        weight_map = value.get("weight_map") or {}
        return sorted(set(weight_map.values()))
    return [SINGLE_NAME] if (directory / SINGLE_NAME).is_file() else []


def revision(directory: Path) -> str | None:
    """The Hugging Face commit of a checkpoint directory when it can be told: a hub cache snapshot directory
    (``snapshots/<commit>``) or a ``local_dir`` download's ``.cache/huggingface/download/config.json.metadata``."""
    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" and _COMMIT.fullmatch(resolved.name):
        return resolved.name
    meta = directory / HF_LOCAL_METADATA / f"{CONFIG_NAME}.metadata"
    if meta.is_file():
        first = meta.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0].strip()
        if _COMMIT.fullmatch(first):
            return first
    return None


def checkpoint_identity(directory: Path, quantization: str) -> dict:
    """The identity record of a checkpoint directory (see the module docstring)."""
    def file_sha(name: str) -> str | None:
        p = directory / name
        return sha256_file(p) if p.is_file() else None

    return {"config_sha256": file_sha(CONFIG_NAME), "quant_config_sha256": file_sha(HF_QUANT_CONFIG_NAME),
            "revision": revision(directory), "quantization": quantization,
            "shards": {name: {"bytes": (directory / name).stat().st_size,
                              "header_sha256": header_sha256(directory / name)}
                       for name in shard_files(directory)}}


def identity_differences(recorded: Mapping, current: Mapping) -> list[str]:
    """What differs between two identities (empty when they match); ``path`` is not compared."""
    diffs = []
    for key in ("config_sha256", "quant_config_sha256", "revision", "quantization"):
        if recorded.get(key) != current.get(key):
            diffs.append(f"{key} {recorded.get(key)!r} -> {current.get(key)!r}")
    old, new = recorded.get("shards", {}), current.get("shards", {})
    for shard in sorted(set(old) | set(new)):
        if old.get(shard) != new.get(shard):
            what = "missing" if shard not in new else "new" if shard not in old else "changed"
            diffs.append(f"shard {shard} {what}")
    return diffs
