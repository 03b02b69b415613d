"""Stored weights of a checkpoint as swapsets see them: module names, decoding schemes, shapes and hashes.

A module's weight is stored as ``<module>.weight`` or, in compressed-tensors NVFP4, ``<module>.weight_packed``;
a fused 3-D ``[experts, out, in]`` stack may also be stored under its module's own name, without a suffix
(transformers' internal layout, ``save_pretrained(save_original_format=False)``: ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``); its sidecar tensors are ``<module>.<suffix>`` like every other module's.
A weight's companions (block/global/activation scales) are found by :meth:`Checkpoint.companions`.  Hashes are SHA-256 of
the stored bytes exactly as on disk (C order), read in :data:`HASH_CHUNK_BYTES` pieces from the memory map.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..errors import MissingSourceError
from ..io.checkpoint import Checkpoint

WEIGHT_SUFFIXES = (".weight", ".weight_packed")
#: Decoding schemes whose stored weight packs two FP4 values per byte.
PACKED_SCHEMES = ("nvfp4-modelopt", "nvfp4-compressed-tensors", "fp4-e8m0")
HASH_CHUNK_BYTES = 8 << 20
#: Roles of a draft head's tensors that have one row per vocabulary row (sliced to the kept ids).
ROW_ROLES = ("weight", "block_scale")


FUSED_NDIM = 3


def module_of(name: str, ndim: int) -> str | None:
    """The module of a stored weight name (``ndim``: its dimensions), or None for a tensor that is not a module's
    weight: ``<module>.weight`` / ``.weight_packed``, or a fused 3-D stack stored under the module's own name."""
    for suffix in WEIGHT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name if ndim == FUSED_NDIM else None


def stored_weight(ckpt: Checkpoint, module: str) -> str | None:
    """The stored weight name of ``module`` in ``ckpt`` (module docstring), or None."""
    for name in (*(module + suffix for suffix in WEIGHT_SUFFIXES), module):
        try:
            info = ckpt.tensor_info(name)
        except MissingSourceError:
            continue
        if name != module or len(info.shape) == FUSED_NDIM:
            return name
    return None


def decoded_shape(ckpt: Checkpoint, name: str) -> tuple[int, ...]:
    """The float32 shape :meth:`Checkpoint.tensor_f32` gives (packed FP4 holds two values per byte)."""
    info = ckpt.tensor_info(name)
    if info.dtype in ("U8", "I8") and ckpt.scheme(name)[0] in PACKED_SCHEMES:
        return info.shape[:-1] + (2 * info.shape[-1],)
    return info.shape


def tensor_sha256(*arrays: np.ndarray) -> str:
    """SHA-256 of the stored bytes of ``arrays``, one after the other."""
    digest = hashlib.sha256()
    for a in arrays:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for start in range(0, flat.size, HASH_CHUNK_BYTES):
            digest.update(memoryview(flat[start:start + HASH_CHUNK_BYTES]))
    return digest.hexdigest()


def source_hash(ckpt: Checkpoint, weight: str) -> str:
    """SHA-256 of a stored weight followed by the companions that decode it, in name order."""
    _, roles = ckpt.scheme(weight)
    comps = ckpt.companions(weight)
    return tensor_sha256(ckpt.raw(weight), *(ckpt.raw(n) for n in sorted(comps[r] for r in roles)))
