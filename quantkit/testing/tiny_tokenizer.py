"""Small real tokenizers for the tiny test models: a byte-level BPE trained deterministically on Python's stdlib.

The base vocabulary is :data:`BPE_VOCAB_SIZE` tokens: the 256 GPT-2 byte symbols plus the merges the
``tokenizers`` BPE trainer learns from :data:`CORPUS_FILES` (PSF-licensed source files of the running Python's
standard library, read in that order).  The trainer's result does not depend on thread count or hash seeds
(checked across processes and with ``RAYON_NUM_THREADS=1``; the tests retrain and compare), so one Python version
always yields the same merges; another stdlib version yields another, equally valid tokenizer.

The pipeline is Qwen3.5's (NFC, the split regex of transformers' ``Qwen3_5Tokenizer``, byte-level without its own
regex, byte-level decoding): transformers forces that class on ``qwen4_exp`` checkpoints and rebuilds the
pipeline from code, so a tokenizer.json with any other pre-tokenizer would tokenize differently after a reload.
Each architecture then places its special tokens the way its real release does (:class:`TokenizerSpec`): DeepSeek
puts begin/end-of-sentence at ids 0 and 1 and shifts the BPE ids up; Qwen and GLM append their specials after the
BPE vocabulary.  The model's embedding has :data:`MODEL_VOCAB_SIZE` rows, more than the tokenizer has tokens,
as real checkpoints pad their vocabulary; the unused rows are what converters fill with ``[PAD<i>]``.
"""
from __future__ import annotations

import functools
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

BPE_VOCAB_SIZE = 480     # byte alphabet (256) + learned merges; specials come on top
MODEL_VOCAB_SIZE = 512   # embedding rows of every tiny model (>= BPE_VOCAB_SIZE + specials)
BPE_MIN_FREQUENCY = 2
CORPUS_FILES = (
    "textwrap.py", "string.py", "glob.py", "fnmatch.py", "colorsys.py", "bisect.py",
    "heapq.py", "keyword.py", "shlex.py", "copy.py", "operator.py", "functools.py",
)


@dataclass(frozen=True)
class TokenizerSpec:
    """Special tokens of one architecture's tokenizer and the roles the model config refers to."""

    leading: tuple[str, ...] = ()    # specials at ids 0.. (BPE ids shift up by their count)
    trailing: tuple[str, ...] = ()   # specials appended after the BPE vocabulary
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None

    @property
    def specials(self) -> tuple[str, ...]:
        return self.leading + self.trailing


def corpus_texts() -> list[str]:
    """The training corpus: the stdlib files of :data:`CORPUS_FILES`, in order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_FILES]


@functools.lru_cache(maxsize=1)
def base_bpe_json() -> str:
    """The trained byte-level BPE (no specials) as ``tokenizer.json`` text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=BPE_MIN_FREQUENCY,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    return tokenizer.to_str()


def _special_entry(token_id: int, content: str) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def tokenizer_json(spec: TokenizerSpec) -> str:
    """``tokenizer.json`` text of the base BPE with ``spec``'s specials placed as described in the module doc."""
    data = json.loads(base_bpe_json())
    shift = len(spec.leading)
    vocab = {token: index + shift for token, index in data["model"]["vocab"].items()}
    n_base = len(vocab)
    specials = [_special_entry(i, token) for i, token in enumerate(spec.leading)]
    specials += [_special_entry(shift + n_base + i, token) for i, token in enumerate(spec.trailing)]
    for entry in specials:
        vocab[entry["content"]] = entry["id"]
    data["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda item: item[1]))
    data["added_tokens"] = specials
    return json.dumps(data, ensure_ascii=False)


def build_tokenizer(spec: TokenizerSpec):
    """A ``transformers`` fast tokenizer (``TokenizersBackend``) for ``spec``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json(spec)),
                                        bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad,
                                        clean_up_tokenization_spaces=False)
    tokenizer.model_max_length = 1 << 20
    return tokenizer


def special_ids(spec: TokenizerSpec) -> dict[str, int]:
    """Id of every special token of ``spec`` (without building the tokenizer)."""
    n_base = len(json.loads(base_bpe_json())["model"]["vocab"])
    ids = {token: i for i, token in enumerate(spec.leading)}
    ids.update({token: len(spec.leading) + n_base + i for i, token in enumerate(spec.trailing)})
    return ids
