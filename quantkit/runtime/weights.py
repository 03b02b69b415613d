"""Where the runtime's weights come from: a GGUF file, or a safetensors checkpoint seen through the architecture map.

Both sources give the same view, so a source checkpoint and its quantized GGUF run through the same code:

* ``tensors``: GGUF tensor name -> :class:`StoredTensor` (GGML type, numpy-order shape);
* ``data(name, index=None)``: the payload as ``uint8[*shape[:-1], row_bytes]`` (a view of the memory-mapped file
  for GGUF), or its slice ``index`` of the leading axis (one routed expert of a stacked tensor);
* ``config``: the source's ``config.json`` as a dict; ``metadata``: the GGUF key/value pairs (None for a
  checkpoint).

The config of a GGUF comes, in order, from the ``config=`` argument, from the ``quantkit.source.config`` key
(the source ``config.json`` text, written by ``quantkit convert``), or is rebuilt from the GGUF hyperparameter keys
(:mod:`quantkit.arch.gguf_config`, every architecture: files made by llama.cpp's converter and llama-quantize).

A checkpoint is planned at open from its headers alone (:meth:`quantkit.arch.ArchMap.outputs`: names, shapes) and
stays open; ``data(name)`` assembles one GGUF tensor on demand (its sources decoded to float32 by
:mod:`quantkit.io.checkpoint`, transformed by the map, written source by source into the payload: no float32 copy
of the whole tensor) and keeps it in a least-recently-used cache of at most ``cache_bytes`` (None:
:data:`DEFAULT_CACHE_FRACTION` of the memory available at open; 0: no cache).  ``data(name, index)`` of a tensor
the map stacks from one source per expert assembles that expert's source only and caches it as its own entry
(``(name, index)``) under the same budget, so a budget smaller than one stacked tensor still holds the experts in
use; other tensors give the slice of the whole (cached whole if it fits).  A payload larger than the budget is
assembled again on every use.  Memory is therefore bounded by the budget plus the payload being used, and a model
larger than memory streams from its checkpoint.

Each GGUF tensor's type is decided from the headers, exactly: I32 for integer tensors; BF16 when every source is
stored BF16 and the map only moves its values (BF16 -> float32 -> BF16 is exact); F32 otherwise (FP8 and FP4
sources decode to values BF16 cannot always hold, ``plus_one`` and ``neg_exp`` compute new values).  Decoded to
float32, ``data(name)`` gives the assembled values bit for bit whatever the type.

``replace`` maps checkpoint tensor names to zero-argument callables returning that tensor's float32 values in
its decoded shape (what :meth:`quantkit.io.checkpoint.Checkpoint.tensor_f32` gives); they are used instead of
decoding it (called again on every cache miss) and the GGUF tensors they feed are F32.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping

import ml_dtypes
import numpy as np

from ..arch import OutputTensor, get_arch
from ..arch.gguf_config import config_from_keys, llama_cpp_view
from ..convert.provenance import SOURCE_CONFIG_KEY
from ..errors import FormatError, MissingSourceError, SourceError, StateError, UnsupportedError
from ..formats.registry import GGMLType
from ..io.checkpoint import open_checkpoint
from ..io.config import check_config_sizes
from ..io.gguf import KV
from ..io.gguf_reader import GGUFFile, is_gguf
from ..resources import memory_for
from .inverse import VALUE_INVERSES

#: The numpy type of each payload type a checkpoint's tensors are given (see the module doc).
PAYLOAD_DTYPES: Mapping[GGMLType, np.dtype] = {GGMLType.I32: np.dtype(np.int32),
                                               GGMLType.BF16: np.dtype(ml_dtypes.bfloat16),
                                               GGMLType.F32: np.dtype(np.float32)}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    qtype: GGMLType
    shape: tuple[int, ...]


class GGUFWeights:
    """A GGUF file's tensors and metadata (memory-mapped; payloads are never copied here)."""

    def __init__(self, path: str | os.PathLike, config: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        try:
            self.file.require_whole_model()
            # llama.cpp's names whatever the file's dialect; payloads are read under the stored names
            view = llama_cpp_view(self.file.metadata, self.file.tensors)
            self._stored, self._relaid = view.stored, view.relaid
            self.relaid_table = view.relaid_table
            self.metadata: dict[str, KV] = dict(view.metadata)
            self.tensors = {name: StoredTensor(name, self.file.tensors[stored].type,
                                               tuple(self._relaid[name].shape) if name in self._relaid
                                               else tuple(self.file.tensors[stored].shape))
                            for name, stored in self._stored.items()}
            self.config = dict(config) if config is not None else config_from_gguf(self.metadata, self.tensors,
                                                                                  self.path)
        except BaseException:
            self.file.close()
            raise

    def data(self, name: str, index: int | None = None) -> np.ndarray:
        payload = self.file.data(self._stored[name])
        move = self._relaid.get(name)
        if move is not None:   # stored in another dialect's layout: small F32 tensors, converted on read
            from ..arch.dialects import LLAMA_CPP, convert_payload

            raw = convert_payload(move, np.ascontiguousarray(payload), LLAMA_CPP)
            payload = np.frombuffer(raw, np.uint8).reshape(*move.shape[:-1], -1)   # rows of bytes, as stored
        return payload if index is None else payload[index]

    def close(self) -> None:
        self.file.close()


#: Share of the memory available at open (``MemAvailable`` of ``/proc/meminfo``) that a checkpoint's cache of
#: assembled payloads may hold when ``cache_bytes`` is None: the other half is left to activations, the decoded
#: tensor being used, and the page cache the checkpoint is read through.
DEFAULT_CACHE_FRACTION = 0.5


class PayloadCache:
    """Least-recently-used payloads by key (``(name, index)``), at most ``budget`` bytes in all (an entry larger
    than the budget is not kept).  Entries are arrays or tensors (anything with ``nbytes``).

    ``peak_bytes`` is the most the cache ever held; ``hits`` and ``misses`` count :meth:`get` answers.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = self.peak_bytes = self.hits = self.misses = 0
        self._entries: OrderedDict[Hashable, np.ndarray] = OrderedDict()

    def get(self, key: Hashable) -> np.ndarray | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def peek(self, key: Hashable) -> np.ndarray | None:
        """The entry if held, without counting or reordering."""
        return self._entries.get(key)

    def put(self, key: Hashable, payload: np.ndarray) -> None:
        if payload.nbytes > self.budget or key in self._entries:
            return
        while self._entries and self.bytes + payload.nbytes > self.budget:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes
        self._entries[key] = payload
        self.bytes += payload.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


class CheckpointWeights:
    """A safetensors checkpoint's tensors as the GGUF tensors its architecture map makes of them, assembled on
    demand (see the module docstring)."""

    metadata = None

    def __init__(self, path: str | os.PathLike, config: Mapping[str, Any] | None = None, *,
                 cache_bytes: int | None = None, replace: Mapping[str, Callable[[], np.ndarray]] | None = None):
        from ..convert.plan import inspect_sources  # the one definition of decoded source shapes and encodings

        if cache_bytes is not None and cache_bytes < 0:
            raise SourceError(f"cache_bytes must be >= 0 or None, got {cache_bytes}", field="cache_bytes")
        budget = int(DEFAULT_CACHE_FRACTION * memory_for("cache_bytes")) if cache_bytes is None else int(cache_bytes)
        self.path = Path(path)
        self._ckpt = open_checkpoint(self.path)
        try:
            self.config = dict(config) if config is not None else dict(self._ckpt.config)
            if "model_type" not in self.config:
                raise SourceError("config.json has no model_type", path=self.path, field="model_type")
            self._amap = get_arch(self.config["model_type"]).bind(self.config)
            self._shapes, self._encodings = inspect_sources(self._ckpt)
            outputs = self._amap.outputs(self._shapes)
            self._replace = self._check_replace(dict(replace or {}), outputs)
            self._outputs = {o.gguf_name: o for o in outputs}
            self.tensors: dict[str, StoredTensor] = {
                o.gguf_name: StoredTensor(o.gguf_name, self._qtype(o), tuple(o.shape)) for o in outputs}
        except BaseException:
            self._ckpt.close()
            raise
        self.cache = PayloadCache(budget)
        self._closed = False

    def _check_replace(self, replace: dict[str, Callable[[], np.ndarray]], outputs) -> dict:
        """Every replaced name is a floating weight of the checkpoint that feeds a GGUF tensor."""
        fed = {m.hf_name for o in outputs for m in o.sources}
        for name in replace:
            if name not in self._shapes:
                raise MissingSourceError("replacement for a tensor the checkpoint does not hold", path=self.path,
                                         tensor=name)
            if name not in fed:
                raise SourceError("replacement for a tensor that feeds no GGUF tensor (a scale companion or a "
                                  "dropped tensor): it would change nothing", path=self.path, tensor=name)
            if self._encodings[name] == "int":
                raise SourceError("replacement for an integer tensor: replacements are float32 values",
                                  path=self.path, tensor=name)
        return replace

    def _qtype(self, output: OutputTensor) -> GGMLType:
        """I32 for integers; BF16 when every source is stored BF16, unreplaced, and only moved (exactly BF16 after
        decoding); F32 otherwise (never lossy, decided from the headers without reading a payload)."""
        if output.dtype == "int32":
            return GGMLType.I32
        moved_only = not any(step in VALUE_INVERSES for m in output.sources for step in m.transform)
        bf16 = all(self._encodings[m.hf_name] == "BF16" and m.hf_name not in self._replace for m in output.sources)
        return GGMLType.BF16 if moved_only and bf16 else GGMLType.F32

    def _load(self, name: str) -> np.ndarray:
        """A source tensor decoded: integers as stored, floats as float32 (or its replacement)."""
        if name in self._replace:
            values = self._replace[name]()
            if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != self._shapes[name]:
                found = f"{values.dtype}{list(values.shape)}" if isinstance(values, np.ndarray) else type(values).__name__
                raise SourceError(f"replacement gave {found}, expected float32{list(self._shapes[name])}",
                                  path=self.path, tensor=name)
            return values
        if self._encodings[name] == "int":
            return np.asarray(self._ckpt.raw(name))
        return self._ckpt.tensor_f32(name)

    def data(self, name: str, index: int | None = None) -> np.ndarray:
        if self._closed:
            raise StateError("the checkpoint weights were closed", path=self.path, tensor=name)
        output = self._outputs[name]
        if index is not None and output.assembly != "stack_experts":
            return self.data(name)[index]
        if index is not None:
            whole = self.cache.peek((name, None))
            if whole is not None:
                return whole[index]
            index = range(output.shape[0])[index]      # a negative index is cached as its expert
        key = (name, index)
        payload = self.cache.get(key)
        if payload is None:
            if index is not None:
                output = dataclasses.replace(output, shape=output.shape[1:], sources=(output.sources[index],),
                                             assembly="single")
            payload = self._assemble(output, self.tensors[name].qtype)
            payload.flags.writeable = False     # shared through the cache
            self.cache.put(key, payload)
        return payload

    def _assemble(self, output: OutputTensor, qtype: GGMLType) -> np.ndarray:
        """The GGUF bytes ``uint8[*shape[:-1], row_bytes]`` of ``output`` in ``qtype`` (I32, BF16 or F32), its
        sources written straight into the payload's type (exact: see the module doc)."""
        out = np.empty(output.shape, PAYLOAD_DTYPES[qtype])
        self._amap.assemble(output, self._load, out=out)
        return out.view(np.uint8).reshape(*out.shape[:-1], -1)

    def close(self) -> None:
        self._closed = True
        self.cache.clear()
        self._ckpt.close()


def open_weights(path: str | os.PathLike, config: Mapping[str, Any] | None = None, *,
                 cache_bytes: int | None = None, replace: Mapping[str, Callable[[], np.ndarray]] | None = None):
    """A GGUF file (recognized by its magic) or a safetensors checkpoint (file or directory).

    ``cache_bytes`` and ``replace`` apply to a checkpoint only (:class:`CheckpointWeights`); a GGUF ignores
    ``cache_bytes`` (its payloads are the mapped file) and refuses ``replace``.
    """
    path = Path(path)
    if not path.exists():
        raise SourceError("no such file or directory", path=path)
    if is_gguf(path):
        if replace:
            raise UnsupportedError(f"replacing source tensors ({sorted(replace)[0]!r}, ...) needs a safetensors "
                                   f"checkpoint, not a GGUF", path=path)
        return GGUFWeights(path, config)
    return CheckpointWeights(path, config, cache_bytes=cache_bytes, replace=replace)


# -- the config of a GGUF -----------------------------------------------------------------------------------------

def config_from_gguf(metadata: Mapping[str, KV], tensors: Mapping[str, StoredTensor], path: Path) -> dict:
    """The source config of a GGUF: the ``quantkit.source.config`` text, else rebuilt from the hyperparameter keys
    (:func:`quantkit.arch.gguf_config.config_from_keys`: files made by llama.cpp or any other writer)."""
    if SOURCE_CONFIG_KEY in metadata:
        try:
            config = json.loads(metadata[SOURCE_CONFIG_KEY].value)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"is not JSON: {exc}", path=path, field=SOURCE_CONFIG_KEY) from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise FormatError("must hold a config.json object with a model_type", path=path, field=SOURCE_CONFIG_KEY)
        check_config_sizes(config, {n: tuple(t.shape) for n, t in tensors.items()},
                           path=f"{path} [{SOURCE_CONFIG_KEY}]")
        return config
    return config_from_keys(metadata, {name: t.shape for name, t in tensors.items()}, path)
