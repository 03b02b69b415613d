"""Calibration text, tokenization and the CPU reference forward pass (transformers; torch imported lazily).

:class:`ReferenceModel` runs a checkpoint through its transformers model in float32 on the CPU: every stored
tensor is decoded with :meth:`quantkit.io.checkpoint.Checkpoint.tensor_f32` (quantization companions dropped,
compressed-tensors' ``weight_packed`` renamed ``weight``) into a temporary directory and loaded with
``from_pretrained``, so transformers' own name conversions apply.  This path holds the whole model in float32 and
is refused above :data:`MAX_REFERENCE_BYTES`; full-size models are calibrated by the quantkit runtime.

What it measures, over the text cut into windows of :data:`WINDOW_TOKENS` tokens (at most
:data:`MAX_TEXT_TOKENS` tokens in all):

- max |x| of the input of each named linear layer (a forward pre-hook on the ``nn.Linear`` that transformers
  loads the stored weight into; a stored weight that transformers fuses into another parameter, as routed
  experts, has no such layer and is refused);
- the inputs of the output head at every position (the hidden states the drafter's head sees).

Both come from one pass (:meth:`ReferenceModel.measure`).

Tokenization uses the checkpoint's ``tokenizer.json`` (the ``tokenizers`` library), without special tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..errors import MissingSourceError, SourceError, UnsupportedError
from ..io.checkpoint import CONFIG_NAME, Checkpoint
from ..io.safetensors import write_safetensors

#: Largest float32 model the CPU reference path loads.
MAX_REFERENCE_BYTES = 8 << 30
#: Tokens per forward pass, and in all.
WINDOW_TOKENS = 512
MAX_TEXT_TOKENS = 16384
#: Largest calibration / sample text read.
MAX_TEXT_BYTES = 64 << 20
TOKENIZER_FILE = "tokenizer.json"
_WEIGHT_SUFFIXES = (".weight", ".weight_packed")


def read_text(path: str | os.PathLike) -> tuple[str, str]:
    """(text, SHA-256 of its bytes) of a UTF-8 text file."""
    path = Path(path)
    if path.stat().st_size > MAX_TEXT_BYTES:
        raise SourceError(f"text file is over {MAX_TEXT_BYTES} bytes", path=path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"text is not UTF-8: {e}", path=path) from None
    if not text.strip():
        raise SourceError("text file is empty", path=path)
    return text, hashlib.sha256(raw).hexdigest()


def tokenize(model_dir: Path, text: str) -> list[int]:
    """Token ids of ``text`` by the checkpoint's tokenizer (no special tokens), at most MAX_TEXT_TOKENS."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise MissingSourceError("the checkpoint has no tokenizer.json to tokenize calibration text", path=path)
    ids = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids
    if not ids:
        raise SourceError("the text tokenizes to no tokens", path=path)
    return ids[:MAX_TEXT_TOKENS]


def _companion_names(ckpt: Checkpoint) -> set[str]:
    found = set()
    for name in ckpt.tensor_names():
        if name.endswith(_WEIGHT_SUFFIXES):
            found.update(ckpt.companions(name).values())
    return found


class ReferenceModel:
    """A checkpoint loaded into its transformers model in float32 (see the module docstring); a context manager."""

    def __init__(self, ckpt: Checkpoint):
        import torch
        import transformers

        architectures = ckpt.config.get("architectures") or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        if model_class is None:
            raise UnsupportedError(f"config.json names no transformers model class this version has "
                                   f"(architectures={architectures!r})", path=ckpt.path, field="architectures")
        companions = _companion_names(ckpt)
        names = [n for n in ckpt.tensor_names() if n not in companions]
        total = 4 * sum(int(np.prod(ckpt.tensor_info(n).shape, dtype=np.int64)) for n in names)
        if total > MAX_REFERENCE_BYTES:
            raise UnsupportedError(f"the CPU reference forward pass would hold {total} bytes of float32 weights, over "
                                   f"its {MAX_REFERENCE_BYTES}-byte limit; calibrate with the quantkit runtime",
                                   path=ckpt.path)
        self._tmp = Path(tempfile.mkdtemp(prefix="quantkit-swapset-ref-"))
        try:
            tensors = {}
            for name in names:
                info = ckpt.tensor_info(name)
                out = name.removesuffix(".weight_packed") + ".weight" if name.endswith(".weight_packed") else name
                if info.dtype in ("I64", "I32", "I16", "U8", "BOOL") and not ckpt.companions(name):
                    tensors[out] = np.array(ckpt.raw(name))
                else:
                    tensors[out] = ckpt.tensor_f32(name)
            write_safetensors(self._tmp / "model.safetensors", tensors, metadata={"format": "pt"})
            del tensors
            config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
            (self._tmp / CONFIG_NAME).write_text(json.dumps(config))
            self.model = model_class.from_pretrained(self._tmp, dtype=torch.float32).eval()
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(self.model)
        state = dict(self.model.state_dict())
        modules = dict(self.model.named_modules())

        def linear(stored: str):
            key = stored.removesuffix(".weight_packed") + ".weight" if stored.endswith(".weight_packed") else stored
            renamed, converter = rename_source_key(
                key, [t for t in transforms if isinstance(t, WeightRenaming)],
                [t for t in transforms if isinstance(t, WeightConverter)], self.model.base_model_prefix, state)
            module = modules.get(renamed.removesuffix(".weight"))
            return module if converter is None and isinstance(module, torch.nn.Linear) else None

        self._linear = linear

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "ReferenceModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def measure(self, token_ids: list[int], stored_weights: list[str] = (), *, head: bool = False
                ) -> tuple[dict[str, float], np.ndarray | None]:
        """One pass over ``token_ids``: (max |input| of the linear layer of each stored weight name, the output
        head's input vectors float32 [positions, hidden] when ``head``)."""
        import torch

        amax: dict[str, float] = {}
        rows: list[np.ndarray] = []
        handles = []

        def record(name):
            def hook(_module, args):
                amax[name] = max(amax[name], float(args[0].detach().abs().max()))
            return hook

        def record_head(_module, args):
            rows.append(args[0].detach().reshape(-1, args[0].shape[-1]).float().numpy())

        try:
            for name in stored_weights:
                module = self._linear(name)
                if module is None:
                    raise SourceError("no nn.Linear of the transformers model holds this weight, so its input "
                                      "cannot be calibrated", tensor=name)
                amax[name] = 0.0
                handles.append(module.register_forward_pre_hook(record(name)))
            if head:
                handles.append(self.model.get_output_embeddings().register_forward_pre_hook(record_head))
            with torch.no_grad():
                for start in range(0, len(token_ids), WINDOW_TOKENS):
                    window = torch.tensor([token_ids[start:start + WINDOW_TOKENS]], dtype=torch.long)
                    self.model(input_ids=window, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return amax, (np.concatenate(rows, axis=0) if head else None)
