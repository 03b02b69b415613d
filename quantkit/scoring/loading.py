"""Open a model for capture or scoring: its logits (through :mod:`quantkit.runtime`), tokenizer and identity.

``path`` is a GGUF file or a safetensors checkpoint (directory, single file, or Hugging Face repo id).  Both run
through :func:`quantkit.runtime.load_model`, so a source and its quantized artifacts are evaluated by the same
code.  The tokenizer is, in order: ``tokenizer=`` (a Hugging Face tokenizer directory, e.g. the source
checkpoint of a GGUF), the checkpoint's own tokenizer files, or the GGUF's ``tokenizer.*`` metadata rebuilt by
transformers' GGUF tokenizer builder (which knows the pre-tokenizers of :data:`GGUF_PRE_TOKENIZER_SPLITS
<transformers.integrations.gguf.gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS>` only; for others the
fingerprint will differ from the fixture's and scoring says so: pass the source's tokenizer).

Sidecars (:mod:`quantkit.swapset`): :func:`open_sidecars` checks the named sidecars beside a checkpoint directory
and gives their replacement values, which :func:`load_source` hands to the runtime (``replace=``); the model's
identity stays the checkpoint's, so a fixture captured from the plain checkpoint scores it with sidecars applied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import FormatError, MissingSourceError, SourceError, UnsupportedError
from ..fixtures.tokens import TextCodec
from ..io.gguf_reader import is_gguf
from .logprobs import NormalizedRows, device_log_normalizers
from .source import ModelIdentity, checkpoint_identity, gguf_identity


class RuntimeSource:
    """A :class:`quantkit.runtime.RuntimeModel` as a :class:`.source.LogitSource` and a
    :class:`.source.GeneratingSource`."""

    def __init__(self, model, identity: ModelIdentity):
        self.model = model
        self._identity = identity

    def identity(self) -> ModelIdentity:
        return self._identity

    @property
    def arithmetic(self) -> str:
        return self.model.arithmetic

    @property
    def device(self) -> str:
        """Where the model runs, for evidence records (``cuda:0 (NVIDIA H200)``, ``cpu``)."""
        device = self.model.device
        if device.type == "cuda":
            import torch

            return f"{device} ({torch.cuda.get_device_name(device)})"
        return str(device)

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def output_width(self) -> int | None:
        return self.model.output_width

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        from ..runtime import logits

        return logits(self.model, np.asarray(token_ids, np.int64))

    def start_logits_many(self, sequences: Sequence[Sequence[int]], first: int = 0
                          ) -> Callable[[], list[np.ndarray]]:
        """Several sequences in one forward pass, queued now (:func:`quantkit.runtime.loader.start_logits_batch`),
        the logits of positions ``first``.. of each (the output head multiplies only those) given by the returned
        function; one at a time with the ggml-cpu arithmetic, which follows llama.cpp's graph of one sequence."""
        from ..runtime.loader import start_logits_batch

        if self.arithmetic == "ggml-cpu":      # run when collected, where an error is named by its sequence
            return lambda: [self.logits(s)[first:] for s in sequences]
        return start_logits_batch(self.model, [np.asarray(s, np.int64) for s in sequences], first=first).result

    def start_normalized_many(self, sequences: Sequence[Sequence[int]], first: int = 0
                              ) -> Callable[[], list[np.ndarray] | list[NormalizedRows]]:
        """:meth:`start_logits_many` whose rows come with their log-normalizers where the model runs on CUDA
        (:func:`.logprobs.device_log_normalizers`, computed beside the pass); arrays elsewhere, normalized on the
        host as before."""
        from ..runtime.loader import start_logits_batch

        if self.arithmetic == "ggml-cpu" or self.model.device.type != "cuda":
            return self.start_logits_many(sequences, first)
        pending = start_logits_batch(self.model, [np.asarray(s, np.int64) for s in sequences], first=first,
                                     row_stats=device_log_normalizers)

        def collect() -> list[NormalizedRows]:
            rows = pending.result()
            return [NormalizedRows(r, logsum, greedy) for r, (logsum, greedy) in zip(rows, pending.result_stats())]

        return collect

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Callable[[int], bool],
                 choose: Callable[[np.ndarray], int] | None = None) -> list[int]:
        """Continuation with the runtime's KV cache (:func:`quantkit.runtime.generate.continuation`), greedy unless
        ``choose`` is given."""
        from ..runtime import greedy
        from ..runtime.generate import continuation

        if choose is None:
            return greedy(self.model, prompt_ids, max_new_tokens, stop=stop, keep_logits=False).tokens
        return continuation(self.model, prompt_ids, max_new_tokens, choose, stop=stop, keep_logits=False).tokens

    def close(self) -> None:
        self.model.close()


def _with_added_tokens_in_place(backend, tokens: Sequence[str], token_types: Sequence[int]):
    """``backend`` with every control and user-defined token of the GGUF an added token at its own id.

    transformers' byte-level builder respells a vocabulary entry outside GPT-2's byte alphabet (DeepSeek's
    ``<｜begin▁of▁sentence｜>``) into byte symbols and does not register it, so naming it as BOS would append it
    as a new id past the model's vocabulary.  The GGUF's text is the token's content (what the converter wrote):
    the entry takes that text back at its id and becomes an added token there, the vocabulary keeping the GGUF's
    size."""
    from tokenizers import Tokenizer

    from ..arch.tokenizer import CONTROL, USER_DEFINED

    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    by_id = {i: token for token, i in vocab.items()}
    added = {entry["id"]: entry for entry in data.get("added_tokens") or []}
    for token_id, (text, kind) in enumerate(zip(tokens, token_types)):
        if kind not in (CONTROL, USER_DEFINED):
            continue
        stored = by_id.get(token_id)
        if stored is not None and stored != text:
            del vocab[stored]
        vocab[text] = token_id
        added[token_id] = {"id": token_id, "content": text, "single_word": False, "lstrip": False,
                           "rstrip": False, "normalized": False, "special": kind == CONTROL}
    # the builder's own defaults (GPT-2's ``<|endoftext|>``) are not the GGUF's: ids past its vocabulary go
    for token_id in [i for i in added if i >= len(tokens)]:
        vocab.pop(added.pop(token_id)["content"], None)
    data["added_tokens"] = [added[i] for i in sorted(added)]
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def _gguf_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (KeyError, ValueError) as exc:
        raise SourceError(f"cannot rebuild the tokenizer from the GGUF metadata ({exc}); pass --tokenizer with "
                          "the source checkpoint's tokenizer", path=path) from None
    if tokenizer_dict.get("tokenizer_type") == "gpt2":
        backend = _with_added_tokens_in_place(backend, tokenizer_dict["tokens"],
                                              tokenizer_dict.get("token_type") or ())
    specials = {k: v for k, v in tokenizer_config.items() if k.endswith("_token") and v is not None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **specials)
    if tokenizer_config.get("chat_template"):
        tokenizer.chat_template = tokenizer_config["chat_template"]
    return tokenizer


#: Files one of which a Hugging Face tokenizer directory holds (the fast tokenizer, or what builds it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_dir(directory: Path, option: str):
    """transformers' tokenizer of ``directory``, or one line naming the directory (transformers' own error for a
    directory without tokenizer files asks to install sentencepiece)."""
    from transformers import AutoTokenizer

    if not directory.is_dir():
        raise MissingSourceError(f"no tokenizer directory here{option}", path=directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise MissingSourceError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in the directory{option}",
                                 path=directory)
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise SourceError(f"cannot load the tokenizer: {first}", path=directory) from None


def load_tokenizer(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None):
    """The Hugging Face tokenizer to score ``path`` with (module doc)."""
    if tokenizer is not None:
        return _tokenizer_dir(Path(tokenizer), "")
    if is_gguf(path):
        from ..io.gguf_reader import GGUFFile

        with GGUFFile(path) as f:   # before transformers reads it: a shard has no tokenizer to rebuild
            f.require_whole_model()
        return _gguf_tokenizer(Path(path))
    from ..convert.source import resolve_source

    resolved = resolve_source(path).path
    if resolved.is_file() and resolved.suffix != ".safetensors":
        size = resolved.stat().st_size
        raise FormatError("not a GGUF file (empty)" if size == 0 else
                          "not a GGUF file (no GGUF magic in its first bytes) nor a .safetensors checkpoint",
                          path=resolved)
    return _tokenizer_dir(resolved if resolved.is_dir() else resolved.parent,
                          "; pass --tokenizer DIR (the source checkpoint's tokenizer)")


def model_identity(path: str | os.PathLike, codec: TextCodec) -> ModelIdentity:
    """The identity of a GGUF (from its metadata) or checkpoint (from its shards' hashes), without loading it."""
    if is_gguf(path):
        from ..io.gguf_reader import GGUFFile

        with GGUFFile(path) as f:
            return gguf_identity(f.metadata, path=path, tokenizer=codec.fingerprint)
    return checkpoint_identity(path, tokenizer=codec.fingerprint)


def describe_model(path: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None
                   ) -> tuple[TextCodec, ModelIdentity]:
    """The codec and identity of a GGUF or checkpoint, without loading its weights (so a fixture mismatch is
    reported before a large model is loaded)."""
    codec = TextCodec(load_tokenizer(path, tokenizer))
    return codec, model_identity(path, codec)


def open_sidecars(path: str | os.PathLike, names: Sequence[str]) -> dict[str, Callable[[], np.ndarray]]:
    """The replacement values of sidecars ``names`` beside checkpoint directory ``path``
    (:func:`quantkit.swapset.sidecar_replacements`: unknown, damaged, stale and draft-head sidecars are refused)."""
    from ..swapset import sidecar_replacements

    if is_gguf(path):
        raise SourceError("sidecars apply to the safetensors checkpoint they were made beside; this is a GGUF",
                          path=path)
    if not Path(path).is_dir():
        raise SourceError("sidecars live beside a checkpoint directory; this is not a directory", path=path)
    return sidecar_replacements(path, names)


def load_source(identity: ModelIdentity, *, device: str = "cpu",
                replace: Mapping[str, Callable[[], np.ndarray]] | None = None,
                arithmetic: str = "float32", dtype: str = "float32") -> RuntimeSource:
    """The model :func:`describe_model` described, loaded through :func:`quantkit.runtime.load_model`;
    ``replace`` (from :func:`open_sidecars`) substitutes checkpoint tensors; ``arithmetic``: ``float32`` or
    ``ggml-cpu`` (llama.cpp's CPU activation rounding, :mod:`quantkit.runtime.ggml_arithmetic`); ``dtype``:
    ``float32`` or ``bfloat16`` (decoded weights rounded to bf16 and bf16 activations: a fast GPU mode outside
    the float32 tolerance, recorded in the evidence).  On the CPU the weights decoded for one forward pass are kept
    for the next (:func:`quantkit.resources.keep_budget`: a fixture's cases decode each weight once; 1.2x faster
    on the bundled example); on CUDA float32 products read the packed weights and nothing is decoded."""
    import torch

    from ..resources import keep_budget
    from ..runtime import load_model

    if dtype not in SCORE_DTYPES:
        raise UnsupportedError(f"unknown dtype {dtype!r} (one of {', '.join(SCORE_DTYPES)})", field="dtype")
    if dtype != "float32" and arithmetic != "float32":
        raise UnsupportedError(f"--arithmetic {arithmetic} computes in float32: not with --dtype {dtype}",
                               field="dtype")
    keep = keep_budget() if torch.device(device).type == "cpu" else 0
    return RuntimeSource(load_model(identity.path, device=device, replace=replace, arithmetic=arithmetic,
                                    dtype=getattr(torch, dtype), keep_bytes=keep), identity)


#: The compute dtypes ``score`` offers.
SCORE_DTYPES = ("float32", "bfloat16")
