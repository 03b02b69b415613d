"""The checkpoint source: a Hugging Face safetensors checkpoint, opened lazily, decoded per tensor.

Layouts accepted by :func:`open_checkpoint`:

- a directory with ``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file name}}``) and its
  shards; the index is the authority (tensors a shard holds but the index does not list are not exposed);
- a directory with ``model.safetensors``;
- a single ``.safetensors`` file (no config: ``config == {}``).

A directory may hold ``config.json`` (its ``quantization_config``) and ``hf_quant_config.json`` (ModelOpt).
DeepSeek V4's upstream release names its E8M0 block scales ``<prefix>.scale`` and may store them as F8_E8M0 or
as U8 (the same bytes); such a checkpoint describes itself (FP8 weights with per-128x128 scales, packed FP4
experts with per-32 scales, told apart by the weight's dtype), so it is read without a ``quantization_config``,
as llama.cpp's converter reads it.

Opening reads every shard's header and nothing else; :meth:`Checkpoint.raw` maps one tensor, and
:meth:`Checkpoint.tensor_f32` decodes one tensor (or one expert of a fused ``[E, rows, n]`` tensor) with its
companions.  How a tensor decodes is decided by its dtype and companions (see :meth:`Checkpoint.tensor_f32`);
the checkpoint-wide :attr:`Checkpoint.quantization` is what the config declares, checked against the tensors on
disk: a mismatch is a :class:`SourceError`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError, MissingSourceError, SourceError, UnsupportedError
from ..formats import blockscaled
from .safetensors import DEFAULT_MAX_HEADER_BYTES, SafetensorsFile
from .config import check_config_sizes
from . import jsontext

CONFIG_NAME = "config.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Largest config / index JSON we read: real ones are a few MB (an index lists every tensor name).
MAX_JSON_BYTES = 64 << 20

QUANTIZATIONS = ("none", "fp8-block", "fp8-block-e8m0", "fp4-e8m0", "nvfp4-modelopt", "nvfp4-compressed-tensors")
#: What ``quant_method: fp8`` covers: block FP8 (V3 F32 scales, V4 E8M0) and V4's packed FP4 experts beside it.
_FP8_KINDS = ("fp8-block", "fp8-block-e8m0", "fp4-e8m0")
#: Storage of E8M0 scale bytes: DeepSeek V4 releases use either.
_E8M0_DTYPES = ("F8_E8M0", "U8")
_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
_PLAIN_DTYPES = ("F64", "F32", "F16", "BF16")
_PACKED_FP4_DTYPES = ("U8", "I8", "F4")
_LOW_PRECISION_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4")
#: Weight names whose module prefix carries the companions (``<prefix>.weight_scale`` ...).
_WEIGHT_SUFFIXES = (".weight", ".weight_packed")
#: Companion roles found as ``<prefix>.<role>``; ``scale_inv`` is ``<weight name>_scale_inv`` instead.
_PREFIX_ROLES = ("scale", "weight_scale", "weight_scale_2", "weight_global_scale", "input_scale",
                 "input_global_scale")
#: The dtypes of each scheme's companions on disk, in the order :meth:`Checkpoint._decode` takes them.
_SCHEME_COMPANION_DTYPES = {"fp8-block": (("F32",),), "fp8-block-e8m0": (_E8M0_DTYPES,),
                            "fp4-e8m0": (_E8M0_DTYPES,), "nvfp4-modelopt": (("F8_E4M3",), ("F32",)),
                            "nvfp4-compressed-tensors": (("F8_E4M3",), ("F32",))}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: Path


def _read_json(path: Path, what: str) -> dict:
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise SourceError(f"{what} is {size} bytes, over the {MAX_JSON_BYTES}-byte cap", path=path)
    try:
        value = jsontext.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SourceError(f"{what} is not valid JSON: {e}", path=path) from None
    if not isinstance(value, dict):
        raise SourceError(f"{what} must be a JSON object, found {type(value).__name__}", path=path)
    return value


def _declared_quantization(config: dict, hf_quant: dict | None, path: Path) -> str | None:
    """What the config declares: a QUANTIZATIONS value, ``"fp8"`` (block FP8; V3 or V4 is told by the scale
    dtype on disk: V3.1 declares ``scale_fmt: ue8m0`` yet stores F32 ``scale_inv``), or None (nothing declared)."""
    qc = config.get("quantization_config")
    if qc is None and hf_quant is not None:
        qc = {"quant_method": "modelopt", **(hf_quant.get("quantization") or {})}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise SourceError("quantization_config must be an object", path=path, field="quantization_config")
    method = qc.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method == "modelopt" and qc.get("quant_algo") in _NVFP4_ALGOS:
        return "nvfp4-modelopt"
    groups = qc.get("config_groups") or {}
    if method == "compressed-tensors" and (qc.get("format") == "nvfp4-pack-quantized" or (
            qc.get("format") == "mixed-precision" and groups
            and all(isinstance(g, dict) and g.get("format") == "nvfp4-pack-quantized" for g in groups.values()))):
        return "nvfp4-compressed-tensors"
    raise UnsupportedError(f"quantization_config {{quant_method: {method!r}, quant_algo: {qc.get('quant_algo')!r}, "
                           f"format: {qc.get('format')!r}}} is not a supported source; supported: "
                           f"{', '.join(QUANTIZATIONS[1:])}", path=path, field="quantization_config")


def _e8m0_scale_kind(weight_dtype: str | None) -> str | None:
    """The scheme of an E8M0 block scale, told by its weight's dtype: FP8 weights are block FP8, packed FP4
    weights (two values per byte) are FP4 with one scale per 32; None when the weight is neither."""
    if weight_dtype == "F8_E4M3":
        return "fp8-block-e8m0"
    if weight_dtype in _PACKED_FP4_DTYPES:
        return "fp4-e8m0"
    return None


def _quantization_on_disk(dtypes: dict[str, str], path: Path) -> str:
    """The quantization the tensor names and dtypes show (one scheme per checkpoint; DeepSeek V4's FP4 experts
    beside FP8 weights count as its block FP8 release, ``fp8-block-e8m0``)."""
    found = set()
    for name, dtype in dtypes.items():
        if name.endswith("_scale_inv"):
            if dtype == "F8_E8M0":
                found.add(_e8m0_scale_kind(dtypes.get(name.removesuffix("_scale_inv"))) or "fp8-block-e8m0")
            else:
                found.add("fp8-block")
        elif name.endswith(".weight_scale_2"):
            found.add("nvfp4-modelopt")
        elif name.endswith(".weight_global_scale"):
            found.add("nvfp4-compressed-tensors")
        elif name.endswith(".scale") and dtype in _E8M0_DTYPES:
            kind = _e8m0_scale_kind(dtypes.get(name.removesuffix(".scale") + ".weight"))
            if kind is not None:
                found.add(kind)
    if "fp4-e8m0" in found and "fp8-block-e8m0" in found:
        found.discard("fp4-e8m0")
    if len(found) > 1:
        raise SourceError(f"tensors on disk mix quantization schemes: {sorted(found)}", path=path)
    if found:
        return found.pop()
    low = sorted(n for n, d in dtypes.items() if d in _LOW_PRECISION_DTYPES)
    if low:
        raise SourceError(f"{len(low)} FP8/FP4 tensors (first {low[0]!r}) but no scale tensors of a known "
                          f"scheme", path=path)
    return "none"


def _block_shape(config: dict, path: Path) -> tuple[int, int]:
    block = (config.get("quantization_config") or {}).get("weight_block_size", blockscaled.DEFAULT_BLOCK)
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise SourceError(f"weight_block_size must be two positive ints, found {block!r}", path=path,
                          field="weight_block_size")
    return block[0], block[1]


class Checkpoint:
    """A lazily opened checkpoint; build it with :func:`open_checkpoint`."""

    def __init__(self, path: Path, config: dict, hf_quant_config: dict | None, config_found: bool,
                 files: list[SafetensorsFile], where: dict[str, SafetensorsFile]):
        self.path = path
        self.config = config
        self.has_config = config_found
        self._files = files
        self._where = where
        self.metadata: dict = dict(files[0].metadata) if files else {}
        if config_found:   # before anything is sized from the config's counts
            check_config_sizes(config, {n: f.entries[n].shape for n, f in where.items()}, path=path / CONFIG_NAME)
        self.block = _block_shape(config, path)
        dtypes = {n: f.entries[n].dtype for n, f in where.items()}
        on_disk = _quantization_on_disk(dtypes, path)
        declared = _declared_quantization(config, hf_quant_config, path)
        if declared is None:
            # DeepSeek V4's upstream layout (E8M0 ``<prefix>.scale``) describes itself; a transformers layout
            # whose config lost its quantization_config may be another model's config
            self_describing = on_disk in ("fp8-block-e8m0", "fp4-e8m0") and not any(
                n.endswith("_scale_inv") for n in dtypes)
            if config_found and on_disk != "none" and not self_describing:
                raise SourceError(f"config declares no quantization_config but the tensors on disk are {on_disk}",
                                  path=path, field="quantization_config")
            self.quantization = on_disk
        elif declared == on_disk or (declared == "fp8" and on_disk in _FP8_KINDS):
            self.quantization = on_disk
        else:
            raise SourceError(f"config declares {declared} quantization but the tensors on disk are {on_disk}",
                              path=path, field="quantization_config")

    # -- names and headers --------------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return sorted(self._where)

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise MissingSourceError("no such tensor in the checkpoint", path=self.path, tensor=name) from None

    def tensor_info(self, name: str) -> TensorInfo:
        f = self._file(name)
        e = f.entries[name]
        return TensorInfo(name, e.dtype, e.shape, e.nbytes, f.path)

    def shard_paths(self) -> list[Path]:
        """The files that hold the checkpoint's tensors (what a reader of every tensor reads), in name order."""
        return [f.path for f in self._files if f.entries]

    def tensor_infos(self) -> list[TensorInfo]:
        return [self.tensor_info(n) for n in self.tensor_names()]

    def data_offset(self, name: str) -> int:
        """Absolute offset of tensor ``name``'s bytes in its file (``tensor_info(name).file``), for readers that
        ``pread`` row ranges instead of mapping the file."""
        return self._file(name).entry(name).begin

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only memory-mapped view (dtypes as :mod:`quantkit.io.safetensors`)."""
        return self._file(name).array(name)

    def companions(self, name: str) -> dict[str, str]:
        """role -> tensor name of the scale tensors that belong to weight ``name`` (any shard)."""
        self._file(name)
        found = {}
        if name + "_scale_inv" in self._where:
            found["scale_inv"] = name + "_scale_inv"
        for suffix in _WEIGHT_SUFFIXES:
            if name.endswith(suffix):
                prefix = name[:-len(suffix)]
                for role in _PREFIX_ROLES:
                    if f"{prefix}.{role}" in self._where and f"{prefix}.{role}" != name:
                        found[role] = f"{prefix}.{role}"
        return found

    # -- decoding -----------------------------------------------------------------------------------------------

    def scheme(self, name: str) -> tuple[str, tuple[str, ...]]:
        """How tensor ``name`` decodes: (scheme, companion roles it reads), e.g. ``("plain", ())``."""
        return self._scheme(self.tensor_info(name), self.companions(name))

    def _scheme(self, info: TensorInfo, comps: dict[str, str]) -> tuple[str, tuple[str, ...]]:
        """(decoding scheme, companion roles it reads) for one tensor."""
        if info.dtype in _PLAIN_DTYPES:
            return "plain", ()
        # Block scales: ``<name>_scale_inv`` (transformers and DeepSeek V3; F32, or F8_E8M0 under
        # ``scale_fmt: ue8m0``) or ``<prefix>.scale`` (DeepSeek V4 upstream, F8_E8M0 or U8).
        block_role = next((r for r in ("scale_inv", "scale") if r in comps), None)
        if info.dtype == "F8_E4M3":
            if block_role is None:
                raise MissingSourceError(f"FP8 weight without its block scale: expected "
                                         f"{info.name + '_scale_inv'!r} or a '<prefix>.scale' tensor",
                                         path=info.file, tensor=info.name)
            e8m0 = self.tensor_info(comps[block_role]).dtype in _E8M0_DTYPES
            return ("fp8-block-e8m0" if e8m0 else "fp8-block"), (block_role,)
        if info.dtype in _PACKED_FP4_DTYPES:
            for global_role, scheme in (("weight_scale_2", "modelopt"), ("weight_global_scale", "compressed-tensors")):
                if global_role in comps:
                    if "weight_scale" not in comps:
                        raise MissingSourceError(f"NVFP4 weight has {global_role} but no weight_scale",
                                                 path=info.file, tensor=info.name)
                    return f"nvfp4-{scheme}", ("weight_scale", global_role)
            if block_role is not None:
                return "fp4-e8m0", (block_role,)
        raise UnsupportedError(f"no float32 decoding for dtype {info.dtype} with companions {sorted(comps)}",
                               path=info.file, tensor=info.name)

    def _decode(self, scheme: str, w: np.ndarray, c: list[np.ndarray]) -> np.ndarray:
        if scheme == "fp8-block":
            return blockscaled.fp8_block_dequantize(w, c[0], self.block)
        if scheme == "fp8-block-e8m0":
            return blockscaled.fp8_block_dequantize_e8m0(w, c[0], self.block)
        if scheme == "fp4-e8m0":
            return blockscaled.fp4_e8m0_dequantize(w, c[0])
        return blockscaled.nvfp4_dequantize(w, c[0], c[1], scheme.removeprefix("nvfp4-"))

    def tensor_f32(self, name: str, expert: int | None = None) -> np.ndarray:
        """Tensor ``name`` decoded to float32; ``expert`` selects one slice of a fused ``[E, rows, n]`` tensor.

        By dtype and companions: F32/F16/BF16 are cast exactly (F64 rounded to float32); F8_E4M3 + a block
        scale (``<name>_scale_inv`` or ``<prefix>.scale``) is block FP8: DeepSeek V3 when the scale is F32,
        E8M0 (V4, transformers' ue8m0) when it is F8_E8M0 or U8 (block shape from ``weight_block_size``, default
        128x128); U8/I8/F4 packed FP4 + ``weight_scale`` F8_E4M3 + ``weight_scale_2`` / ``weight_global_scale``
        F32 is NVFP4 (ModelOpt / compressed-tensors), + an F8_E8M0 or U8 block scale is FP4 with E8M0 per 32.
        Companions of a fused tensor are sliced with it when they have the expert axis (3-D, or 1-D of length E
        for per-expert global scales) and shared when they hold one value.
        """
        info = self.tensor_info(name)
        comps = self.companions(name)
        scheme, roles = self._scheme(info, comps)
        w = self.raw(name)
        if expert is not None:
            if w.ndim != 3:
                raise SourceError(f"expert={expert} needs a fused 3-D [E, rows, n] tensor, shape is {w.shape}",
                                  path=info.file, tensor=name)
            if not 0 <= expert < w.shape[0]:
                raise SourceError(f"expert {expert} out of range: the tensor has {w.shape[0]} experts",
                                  path=info.file, tensor=name)
        if scheme == "plain":
            return (w if expert is None else w[expert]).astype(np.float32)
        companions = [self._companion(comps[role], role, dtype, w)
                      for role, dtype in zip(roles, _SCHEME_COMPANION_DTYPES[scheme])]
        try:
            if expert is not None:
                return self._decode(scheme, w[expert], [self._expert_slice(c, expert) for c in companions])
            if w.ndim != 3:
                return self._decode(scheme, w, companions)
            first = self._decode(scheme, w[0], [self._expert_slice(c, 0) for c in companions])
            out = np.empty((w.shape[0],) + first.shape, dtype=np.float32)
            out[0] = first
            for e in range(1, w.shape[0]):
                out[e] = self._decode(scheme, w[e], [self._expert_slice(c, e) for c in companions])
            return out
        except FormatError as e:
            raise FormatError(f"{scheme} decode with companions {[comps[r] for r in roles]}: {e.detail}",
                              path=info.file, tensor=name, field=e.field) from e

    def _companion(self, cname: str, role: str, dtypes: tuple[str, ...], w: np.ndarray) -> np.ndarray:
        info = self.tensor_info(cname)
        if info.dtype not in dtypes:
            raise FormatError(f"{role} companion must be {' or '.join(dtypes)}, found {info.dtype}", path=info.file,
                              tensor=cname)
        arr = self.raw(cname)
        if w.ndim == 3 and arr.size != 1 and (arr.ndim not in (1, 3) or arr.shape[0] != w.shape[0]):
            raise FormatError(f"{role} companion shape {arr.shape} has neither the fused weight's expert axis "
                              f"({w.shape[0]}) nor a single shared value", path=info.file, tensor=cname)
        return arr

    @staticmethod
    def _expert_slice(arr: np.ndarray, expert: int) -> np.ndarray:
        return arr if arr.size == 1 else arr[expert]

    # -- lifetime -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_index(directory: Path, max_header_bytes: int) -> tuple[list[SafetensorsFile], dict[str, SafetensorsFile]]:
    index_path = directory / INDEX_NAME
    weight_map = _read_json(index_path, "index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise SourceError("weight_map must be an object of tensor name to shard file name", path=index_path,
                          field="weight_map")
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in sorted(weight_map.items()):
        by_shard.setdefault(shard, []).append(tensor)
    for shard, tensors in by_shard.items():
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise SourceError(f"shard {shard!r} is not a plain file name in the checkpoint directory",
                              path=index_path, tensor=tensors[0])
    files, where = [], {}
    for shard in sorted(by_shard):
        shard_path = directory / shard
        if not shard_path.is_file():
            raise MissingSourceError(f"shard named by the index is missing ({len(by_shard[shard])} tensors)",
                                     path=shard_path, tensor=by_shard[shard][0])
        f = SafetensorsFile(shard_path, max_header_bytes=max_header_bytes)
        files.append(f)
        for tensor in by_shard[shard]:
            if tensor not in f.entries:
                raise SourceError("the index places this tensor in the shard but its header has no such tensor",
                                  path=shard_path, tensor=tensor)
            where[tensor] = f
    return files, where


def open_checkpoint(path: str | os.PathLike, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> Checkpoint:
    """Open a checkpoint directory (sharded or single-file) or one ``.safetensors`` file; reads headers only."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise SourceError("expected a checkpoint directory or a .safetensors file", path=path)
        f = SafetensorsFile(path, max_header_bytes=max_header_bytes)
        return Checkpoint(path, {}, None, False, [f], {n: f for n in f.entries})
    if not path.is_dir():
        raise MissingSourceError("no such checkpoint file or directory", path=path)
    config_path, hf_quant_path = path / CONFIG_NAME, path / HF_QUANT_CONFIG_NAME
    config = _read_json(config_path, "config") if config_path.is_file() else {}
    hf_quant = _read_json(hf_quant_path, "hf_quant_config") if hf_quant_path.is_file() else None
    if (path / INDEX_NAME).is_file():
        files, where = _open_index(path, max_header_bytes)
    elif (path / SINGLE_NAME).is_file():
        f = SafetensorsFile(path / SINGLE_NAME, max_header_bytes=max_header_bytes)
        files, where = [f], {n: f for n in f.entries}
    else:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        raise MissingSourceError(f"neither {INDEX_NAME} nor {SINGLE_NAME} in the directory (safetensors files "
                                 f"present: {found or 'none'})", path=path)
    try:
        return Checkpoint(path, config, hf_quant, config_path.is_file(), files, where)
    except BaseException:
        for f in files:  # a rejected checkpoint must not keep its shards mapped
            f.close()
        raise
