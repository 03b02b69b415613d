"""What the scorer needs from a model: logits for token ids, and who the model is.

:class:`LogitSource` is the protocol every scored model implements (the transformers adapter below, the packed
runtime of :mod:`quantkit.runtime`, test fakes):

``logits(token_ids)``  float32 ``[len(token_ids), vocab]``; row ``i`` is the distribution of the token after
                       ``token_ids[:i + 1]`` (causal, teacher forced).  ``vocab`` is the width of the output head,
                       which may exceed the tokenizer's size (padded vocabularies).
``identity()``         a :class:`ModelIdentity`.

A source may also be a :class:`GeneratingSource`: ``generate(prompt_ids, max_new_tokens, stop)`` returns the greedy
continuation (the first maximum of each next-token row, as ``logits`` would give it), ending before the first
token ``stop`` refuses; the runtime implements it with a KV cache.  Callers fall back to one ``logits`` call over
the whole sequence per token for a source without it.

Identity (the fixture/artifact match, see :func:`check_match`):

``label``     the checkpoint label (``0731``), in this order: a GGUF's ``quantkit.checkpoint_label`` metadata; the
              label a ds4 release name ends with (:data:`DS4_NAME_LABEL`: ``…-imatrix-0731.gguf``, also split
              parts ``…-0731-00001-of-00002.gguf``); the user's ``--label`` (:func:`with_label`, which must
              agree with a label the model carries).  ``None`` otherwise (a source checkpoint carries none).
``label_from`` where the label came from (for messages and the record).
``source``    :func:`source_digest` of the checkpoint's weight files: SHA-256 over the sorted lines
              ``"<file name>\\t<file sha256>\\n"`` of its ``*.safetensors`` files.  A source checkpoint hashes its
              own shards; a quantkit GGUF carries the same pairs in ``quantkit.source.files`` /
              ``quantkit.source.sha256``, so a GGUF and the checkpoint it was converted from have equal digests.
``tokenizer`` :meth:`quantkit.fixtures.tokens.TextCodec.fingerprint` of the tokenizer the model is scored with.
``revision``  the Hugging Face commit, when known (informational; the digest decides).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import FixtureError, FormatError

#: GGUF provenance keys written by :mod:`quantkit.convert.provenance`.
GGUF_LABEL_KEY = "quantkit.checkpoint_label"
GGUF_SOURCE_FILES_KEY = "quantkit.source.files"
GGUF_SOURCE_SHA256_KEY = "quantkit.source.sha256"
GGUF_SOURCE_REVISION_KEY = "quantkit.source.revision"
WEIGHT_SUFFIX = ".safetensors"
#: A ds4 release name's checkpoint label: four digits as the last dash-separated word before ``.gguf`` (after
#: dropping a split suffix), as in ``DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf``.
#: Names without one (``…-chat-v2.gguf``, ``…-imatrix-fixed.gguf``, ``…-ds4-1p5m.dat``) give no label.
DS4_NAME_LABEL = re.compile(r"-([0-9]{4})(?:-[0-9]{5}-of-[0-9]{5})?\.gguf$")
LABEL_FROM_METADATA = f"GGUF metadata {GGUF_LABEL_KEY}"
LABEL_FROM_NAME = "the file name"
LABEL_FROM_OPTION = "--label"


@dataclass(frozen=True)
class ModelIdentity:
    """Who a model (or the model a fixture was captured from) is; ``None`` fields are unknown."""

    label: str | None = None
    source: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    path: str | None = None
    label_from: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str) -> "ModelIdentity":
        if not isinstance(data, Mapping):
            raise FixtureError(f"{where}: expected an object, found {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise FixtureError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        for key, value in data.items():
            if value is not None and not isinstance(value, str):
                raise FixtureError(f"{where}.{key}: expected a string or null, found {value!r}")
        return cls(**dict(data))


@runtime_checkable
class LogitSource(Protocol):
    def logits(self, token_ids: Sequence[int]) -> np.ndarray: ...

    def identity(self) -> ModelIdentity: ...


@runtime_checkable
class GeneratingSource(LogitSource, Protocol):
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Callable[[int], bool],
                 choose: Callable[[np.ndarray], int] | None = None) -> list[int]:
        """Continue the prompt choosing each token with ``choose(logits row)`` (greedy when None)."""


def source_digest(files: Iterable[tuple[str, str]]) -> str | None:
    """The ``source`` digest of ``(file name, sha256)`` pairs: only ``*.safetensors`` names count (module doc);
    ``None`` when there are none."""
    weights = sorted((name, sha) for name, sha in files if name.endswith(WEIGHT_SUFFIX))
    if not weights:
        return None
    return hashlib.sha256("".join(f"{name}\t{sha}\n" for name, sha in weights).encode()).hexdigest()


def checkpoint_identity(path: str | Path, *, tokenizer: str | None = None, label: str | None = None) -> ModelIdentity:
    """Identity of a safetensors checkpoint (hashes the shards the checkpoint reader reads, as a conversion
    records them, so sidecars beside it do not change it; Hugging Face cache blobs are not re-read, their names
    are their SHA-256)."""
    from ..convert.source import hash_files, resolve_source
    from ..io.checkpoint import open_checkpoint

    resolved = resolve_source(path)
    with open_checkpoint(resolved.path) as ckpt:
        shards = ckpt.shard_paths()
    hashes = hash_files(shards)
    return ModelIdentity(label=label, source=source_digest((h.name, h.sha256) for h in hashes),
                         tokenizer=tokenizer, revision=resolved.revision, path=str(resolved.path))


def file_name_label(path: str | Path) -> str | None:
    """The checkpoint label a ds4 release name carries (:data:`DS4_NAME_LABEL`), else ``None``."""
    match = DS4_NAME_LABEL.search(Path(path).name)
    return match.group(1) if match else None


def gguf_identity(metadata: Mapping[str, Any], *, path: str | Path, tokenizer: str | None = None) -> ModelIdentity:
    """Identity of a GGUF from its metadata (``key -> KV`` as :class:`quantkit.io.gguf_reader.GGUFFile` reads it,
    or ``key -> value``): the quantkit provenance keys of the module doc, the label else from the file name."""
    def value(key: str):
        entry = metadata.get(key)
        return getattr(entry, "value", entry)

    names, shas = value(GGUF_SOURCE_FILES_KEY), value(GGUF_SOURCE_SHA256_KEY)
    digest = None
    if names is not None and shas is not None:
        if len(names) != len(shas):
            raise FormatError(f"{GGUF_SOURCE_FILES_KEY} has {len(names)} entries but {GGUF_SOURCE_SHA256_KEY} has "
                              f"{len(shas)}", path=path, field=GGUF_SOURCE_FILES_KEY)
        digest = source_digest(zip(names, shas))
    label, label_from = value(GGUF_LABEL_KEY), LABEL_FROM_METADATA
    if label is None:
        label, label_from = file_name_label(path), LABEL_FROM_NAME
    return ModelIdentity(label=label, source=digest, tokenizer=tokenizer, revision=value(GGUF_SOURCE_REVISION_KEY),
                         path=str(path), label_from=label_from if label is not None else None)


def with_label(identity: ModelIdentity, label: str | None) -> ModelIdentity:
    """``identity`` with the user's ``--label`` (module doc): it names a model that carries no label, and must
    agree with one it carries (:class:`FixtureError` otherwise)."""
    if label is None:
        return identity
    if not label:
        raise FixtureError("--label must not be empty")
    if identity.label is None:
        return replace(identity, label=label, label_from=LABEL_FROM_OPTION)
    if identity.label != label:
        raise FixtureError(f"--label {label!r} differs from the model's own checkpoint label {identity.label!r} "
                           f"(from {identity.label_from})", path=identity.path)
    return identity


def identity_problems(fixture: ModelIdentity, model: ModelIdentity) -> list[str]:
    """Why ``model`` cannot be scored on a fixture captured from ``fixture`` (empty: it can).

    Every field known on both sides (label, source digest, tokenizer fingerprint) must be equal, and at least one
    of label and source digest must be known on both sides: a match that cannot be established is refused too.
    """
    problems = []
    compared = False
    for field, what in (("label", "checkpoint label"), ("source", "source checkpoint digest")):
        ours, theirs = getattr(fixture, field), getattr(model, field)
        if ours is not None and theirs is not None:
            compared = True
            if ours != theirs:
                origin = f" (from {model.label_from})" if field == "label" and model.label_from else ""
                problems.append(f"{what} differs: fixture {ours!r}, model {theirs!r}{origin}")
    if fixture.tokenizer is not None and model.tokenizer is not None and fixture.tokenizer != model.tokenizer:
        problems.append(f"tokenizer differs: fixture {fixture.tokenizer[:16]}…, model {model.tokenizer[:16]}…")
    if not compared and not problems:
        hint = ""
        if model.label is None and fixture.label is not None:
            hint = (f"; the model carries no checkpoint label (no {GGUF_LABEL_KEY} metadata, no -NNNN label ending "
                    "its file name): pass --label with its checkpoint label")
        problems.append("neither the checkpoint label nor the source digest is known on both sides "
                        f"(fixture label={fixture.label!r} source={_short(fixture.source)}; "
                        f"model label={model.label!r} source={_short(model.source)}){hint}")
    return problems


def _short(digest: str | None) -> str:
    return "None" if digest is None else digest[:16] + "…"


def check_match(fixture: ModelIdentity, model: ModelIdentity, *, allow_cross_checkpoint: bool,
                fixture_path: str | Path) -> list[str]:
    """Raise :class:`FixtureError` when the model is not the fixture's checkpoint (:func:`identity_problems`),
    unless ``allow_cross_checkpoint``; then return the problems (to be reported as warnings)."""
    problems = identity_problems(fixture, model)
    if problems and not allow_cross_checkpoint:
        raise FixtureError("fixture belongs to another checkpoint than the model: " + "; ".join(problems)
                           + " (pass --allow-cross-checkpoint to score it anyway)", path=fixture_path)
    return problems


class TransformersSource:
    """A transformers model as a :class:`LogitSource` (one forward pass per call, no cache)."""

    def __init__(self, model, identity: ModelIdentity):
        self.model = model
        self._identity = identity

    def identity(self) -> ModelIdentity:
        return self._identity

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        import torch

        device = next(self.model.parameters()).device
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        return out.logits[0].float().cpu().numpy()
