"""Where the runtime's weights come from: a GGUF file, or a safetensors checkpoint seen through the architecture map.

Both sources give the same view, so a source checkpoint and its quantized GGUF run through the same code:

* ``tensors``: GGUF tensor name -> :class:`StoredTensor` (GGML type, numpy-order shape);
* ``data(name)``: the payload as ``uint8[*shape[:-1], row_bytes]`` (a view of the memory-mapped file for GGUF);
* ``config``: the source's ``config.json`` as a dict; ``metadata``: the GGUF key/value pairs (None for a
  checkpoint).

The config of a GGUF comes, in order, from the ``config=`` argument, from the ``quantkit.source.config`` key
(the source ``config.json`` text, written by ``quantkit convert``), or is rebuilt from the GGUF hyperparameters
for the architectures where that is exact (:data:`CONFIG_BUILDERS`: ``qwen3moe``).

A checkpoint is planned with :meth:`quantkit.arch.ArchMap.outputs` and every GGUF tensor assembled once at open
(decoded to float32 by :mod:`quantkit.io.checkpoint`, transformed by the map); each is kept as BF16 when that is
lossless (a BF16 release) and as F32 otherwise, integer tensors as I32.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from ..arch import get_arch
from ..convert.provenance import SOURCE_CONFIG_KEY
from ..errors import FormatError, SourceError, UnsupportedError
from ..formats.registry import GGMLType
from ..io.checkpoint import open_checkpoint
from ..io.gguf import KV
from ..io.gguf_reader import GGUFFile

#: GGUF key holding the source ``config.json`` text.
GGUF_MAGIC = b"GGUF"
_INTEGER_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"})


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
            self.metadata: dict[str, KV] = dict(self.file.metadata)
            self.tensors = {t.name: StoredTensor(t.name, t.type, tuple(t.shape)) for t in self.file.tensors.values()}
            self.config = dict(config) if config is not None else config_from_gguf(self.metadata, self.tensors,
                                                                                  self.path)
        except BaseException:
            self.file.close()
            raise

    def data(self, name: str) -> np.ndarray:
        return self.file.data(name)

    def close(self) -> None:
        self.file.close()


class CheckpointWeights:
    """A safetensors checkpoint's tensors as the GGUF tensors its architecture map makes of them."""

    metadata = None

    def __init__(self, path: str | os.PathLike, config: Mapping[str, Any] | None = None):
        from ..convert.plan import inspect_sources  # the one definition of decoded source shapes

        self.path = Path(path)
        with open_checkpoint(self.path) as ckpt:
            self.config = dict(config) if config is not None else dict(ckpt.config)
            if "model_type" not in self.config:
                raise SourceError("config.json has no model_type", path=self.path, field="model_type")
            amap = get_arch(self.config["model_type"]).bind(self.config)
            shapes, _ = inspect_sources(ckpt)

            def load(name: str) -> np.ndarray:
                if ckpt.tensor_info(name).dtype in _INTEGER_DTYPES:
                    return np.asarray(ckpt.raw(name))
                return ckpt.tensor_f32(name)

            self.tensors: dict[str, StoredTensor] = {}
            self._data: dict[str, np.ndarray] = {}
            for output in amap.outputs(shapes):
                qtype, payload = _payload(amap.assemble(output, load))
                self.tensors[output.gguf_name] = StoredTensor(output.gguf_name, qtype, tuple(output.shape))
                self._data[output.gguf_name] = payload

    def data(self, name: str) -> np.ndarray:
        return self._data[name]

    def close(self) -> None:
        self._data.clear()


def _payload(array: np.ndarray) -> tuple[GGMLType, np.ndarray]:
    """GGUF bytes of an assembled tensor: I32 for integers, BF16 when lossless, else F32."""
    array = np.ascontiguousarray(array)
    if array.dtype.kind in "iu":
        return GGMLType.I32, array.astype(np.int32).view(np.uint8).reshape(*array.shape[:-1], -1)
    halves = array.astype(ml_dtypes.bfloat16)
    if np.array_equal(halves.astype(np.float32).view(np.uint32), array.view(np.uint32)):
        return GGMLType.BF16, halves.view(np.uint8).reshape(*array.shape[:-1], -1)
    return GGMLType.F32, array.view(np.uint8).reshape(*array.shape[:-1], -1)


def open_weights(path: str | os.PathLike, config: Mapping[str, Any] | None = None):
    """A GGUF file (recognized by its magic) or a safetensors checkpoint (file or directory)."""
    path = Path(path)
    if not path.exists():
        raise SourceError("no such file or directory", path=path)
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(len(GGUF_MAGIC)) == GGUF_MAGIC:
                return GGUFWeights(path, config)
    return CheckpointWeights(path, config)


# -- the config of a GGUF -----------------------------------------------------------------------------------------

def _value(metadata: Mapping[str, KV], key: str, path: Path, default: Any = None) -> Any:
    kv = metadata.get(key)
    if kv is None:
        if default is None:
            raise FormatError(f"needs metadata key {key!r} to rebuild the model config", path=path, field=key)
        return default
    return kv.value.tolist() if isinstance(kv.value, np.ndarray) else kv.value


def _qwen3moe_config(metadata: Mapping[str, KV], tensors: Mapping[str, StoredTensor], path: Path) -> dict:
    """transformers' Qwen3-MoE config from llama.cpp's qwen3moe keys (every field the forward pass reads)."""
    def get(key: str, default: Any = None) -> Any:
        return _value(metadata, f"qwen3moe.{key}", path, default)

    if "token_embd.weight" not in tensors:
        raise FormatError("has no token_embd.weight", path=path, tensor="token_embd.weight")
    heads = get("attention.head_count")
    config = {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": tensors["token_embd.weight"].shape[0], "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length", 0), "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": get("attention.key_length", get("embedding_length") // heads),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"), "num_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"), "moe_intermediate_size": get("expert_feed_forward_length"),
        # llama.cpp's qwen3moe always renormalizes the top-k weights and has no dense layers
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": get("rope.freq_base")},
        "tie_word_embeddings": "output.weight" not in tensors, "hidden_act": "silu", "attention_bias": False,
    }
    for field, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                       ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if key in metadata:
            config[field] = metadata[key].value
    return config


#: GGUF architecture -> the function rebuilding the transformers config from the GGUF hyperparameters.
CONFIG_BUILDERS: Mapping[str, Callable[[Mapping[str, KV], Mapping[str, StoredTensor], Path], dict]] = {
    "qwen3moe": _qwen3moe_config,
}


def config_from_gguf(metadata: Mapping[str, KV], tensors: Mapping[str, StoredTensor], path: Path) -> dict:
    """The source config of a GGUF: the ``quantkit.source.config`` text, else rebuilt from the hyperparameters."""
    if SOURCE_CONFIG_KEY in metadata:
        try:
            config = json.loads(metadata[SOURCE_CONFIG_KEY].value)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"is not JSON: {exc}", path=path, field=SOURCE_CONFIG_KEY) from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise FormatError("must hold a config.json object with a model_type", path=path, field=SOURCE_CONFIG_KEY)
        return config
    arch = _value(metadata, "general.architecture", path)
    if arch not in CONFIG_BUILDERS:
        raise UnsupportedError(f"the file has no {SOURCE_CONFIG_KEY!r} and the config of a {arch!r} model cannot be "
                               f"rebuilt from its hyperparameters (possible for {sorted(CONFIG_BUILDERS)}); pass "
                               f"config= (the source config.json) or convert with quantkit", path=path)
    return CONFIG_BUILDERS[arch](metadata, tensors, path)
