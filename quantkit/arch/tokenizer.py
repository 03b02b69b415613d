"""GGUF tokenizer metadata from Hugging Face tokenizer files (byte-level BPE ``tokenizer.json``).

Produces the keys llama.cpp's converter writes for a GPT-2-style BPE vocabulary (``get_vocab_base`` and gguf-py's
``SpecialVocab``):

``tokenizer.ggml.model``  ``"gpt2"``.
``tokenizer.ggml.pre``    the pre-tokenizer name.  llama.cpp identifies it by hashing the token ids of a fixed check
                          text; :func:`detect_pre_tokenizer` does the same with the ``tokenizers`` library and
                          :data:`KNOWN_PRE_HASHES`.  Tiny or retrained vocabularies hash to nothing known, so the
                          caller must name it (``--pre-tokenizer``; checked against :mod:`.pre_tokenizers`).
``tokenizer.ggml.tokens`` ``vocab_size`` entries (the config's, which may exceed the tokenizer's): the token text for
                          each id, ``[PAD<id>]`` for ids no token has.
``tokenizer.ggml.token_type``  NORMAL (1), CONTROL (3) for special or special-looking added tokens, USER_DEFINED (4)
                          for other added tokens, UNUSED (5) for padding ids.
``tokenizer.ggml.merges`` ``"left right"`` strings; a space inside a part is written as U+0120 + 256 ("Ġ" + 256).
``tokenizer.ggml.{bos,eos,unknown,seperator,padding,cls,mask,eot,eom}_token_id``  from the post-processor,
                          ``tokenizer_config.json`` (``<type>_token`` content looked up among the added tokens),
                          then ``config.json`` (``<type>_token_id``), then the architecture's fallbacks; the first
                          source to set a type wins.
``tokenizer.ggml.add_{bos,eos,sep}_token``, ``tokenizer.chat_template`` (and named templates),
``tokenizer.ggml.normalizer.{lowercase,strip_accents}``.

One converter step is not reproduced: for added tokens with ``normalized: false`` it re-encodes and decodes the text
through transformers, which leaves the text of special tokens unchanged.
"""
from __future__ import annotations

from hashlib import sha256
from pathlib import Path
from string import ascii_letters, digits
from typing import Any, Iterable, Mapping

from gguf.constants import GGUFValueType

from ..errors import MissingSourceError, SourceError, UnsupportedError
from ..io.gguf import KV, ArrayOf
from .pre_tokenizers import check_pre_tokenizer
from ..io import jsontext

# llama.cpp's token types (gguf TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: The text whose token ids llama.cpp hashes to recognise a pre-tokenizer (convert_hf_to_gguf.py, ``chktxt``).
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll "
    "make it, 'D you like some tea? We'Ve a'lL"
)

#: sha256 of ``str(token_ids)`` of :data:`CHECK_TEXT` for the released tokenizers of the supported architectures,
#: as recorded in llama.cpp's converter (``get_vocab_base_pre``).
KNOWN_PRE_HASHES: Mapping[str, str] = {
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",    # DeepSeek-V3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",          # Qwen3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",          # Qwen1.5
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",         # Qwen3.5
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",         # Qwen3.5 (MiniCPM-V 4.6)
    "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",           # GLM-4
    "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902": "glm4",           # GLM-4.5
    "cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267": "glm4",           # GLM-4.7
}

SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
#: special token type -> GGUF key
SPECIAL_ID_KEYS: Mapping[str, str] = {
    "bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id", "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id", "mask": "tokenizer.ggml.mask_token_id",
    "eot": "tokenizer.ggml.eot_token_id", "eom": "tokenizer.ggml.eom_token_id",
}
ADD_TOKEN_KEYS: Mapping[str, str] = {
    "bos": "tokenizer.ggml.add_bos_token", "eos": "tokenizer.ggml.add_eos_token", "sep": "tokenizer.ggml.add_sep_token",
}
# a space inside a merge part is shifted by this much so merges stay space-separated (gguf-py)
MERGE_SPACE_SHIFT = 256


def _read_json(path: Path, required: bool) -> Any:
    if not path.is_file():
        if required:
            raise MissingSourceError("tokenizer file not found", path=path)
        return None
    try:
        return jsontext.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:   # UnicodeDecodeError and JSONDecodeError included
        raise SourceError(f"not valid JSON: {e}", path=path) from None


def looks_special(token: str) -> bool:
    """The converter's ``does_token_look_special``: added tokens shaped like control tokens."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def detect_pre_tokenizer(tokenizer_dir: str | Path) -> str:
    """The pre-tokenizer name llama.cpp would detect, by hashing the check text's token ids."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UnsupportedError("detecting the pre-tokenizer needs the 'tokenizers' package; install it or name the "
                               "pre-tokenizer (--pre-tokenizer NAME)") from None
    path = Path(tokenizer_dir) / "tokenizer.json"
    ids = Tokenizer.from_file(str(path)).encode(CHECK_TEXT).ids
    digest = sha256(str(ids).encode()).hexdigest()
    if digest not in KNOWN_PRE_HASHES:
        raise SourceError(f"pre-tokenizer not recognised (check-text hash {digest}); name it explicitly "
                          f"(--pre-tokenizer NAME, e.g. one of {sorted(set(KNOWN_PRE_HASHES.values()))})", path=path)
    return KNOWN_PRE_HASHES[digest]


class _Specials:
    """gguf-py's SpecialVocab state: ids (first setter wins) and add-token flags."""

    def __init__(self, n_vocab: int | None = None):
        self.ids: dict[str, int] = {}
        self.add: dict[str, bool] = {}
        self.types: tuple[str, ...] = SPECIAL_TYPES
        self.n_vocab = n_vocab

    def set(self, typ: str, tid: Any) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool):
            return
        if tid < 0:
            raise SourceError(f"invalid id {tid} for special token type {typ!r}")
        if typ not in self.ids:
            self.ids[typ] = tid


def _merges(data: Mapping[str, Any], tokenizer_dir: Path) -> list[str]:
    merges = (data.get("model") or {}).get("merges")
    if isinstance(merges, list) and merges:
        if isinstance(merges[0], str):
            return list(merges)
        if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
            shift = chr(ord(" ") + MERGE_SPACE_SHIFT)
            return [" ".join(part.replace(" ", shift) for part in pair) for pair in merges]
        raise SourceError("unknown merges format in tokenizer.json", path=tokenizer_dir / "tokenizer.json")
    text_file = tokenizer_dir / "merges.txt"
    if not text_file.is_file():
        return []
    out = []
    for line in text_file.read_text(encoding="utf-8").splitlines():
        parts = line.strip().split()
        if line.startswith("#") and not out:
            continue
        if len(parts) == 2:
            out.append(f"{parts[0]} {parts[1]}")
    return out


def _post_processor(specials: _Specials, data: Mapping[str, Any], config: dict | None) -> None:
    """gguf-py's reading of ``post_processor``: which specials the tokenizer adds, and which tokens they are."""
    tc = config if config is not None else {}
    bos, cls, eos, sep = tc.get("bos_token"), tc.get("cls_token"), tc.get("eos_token"), tc.get("sep_token")
    if not bos and cls and config:
        tc["bos_token"] = bos = cls
    if not eos and sep and config:
        tc["eos_token"] = eos = sep
    processor = data.get("post_processor")
    if not processor:
        return
    for proc in processor.get("processors", [processor]):
        kind = proc.get("type")
        if kind == "ByteLevel":
            specials.add.setdefault("bos", False)
            specials.add.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            specials.add.update(bos=True, eos=True, sep=True)
            if not cls and config:
                cls = tc["cls_token"] = proc.get("cls", [bos])[0]
            if not sep and config:
                sep = tc["sep_token"] = proc.get("sep", [eos])[0]
        elif kind == "TemplateProcessing":
            bos, cls, eos, sep = _template_processing(specials, proc, tc, bool(config), bos, cls, eos, sep)


def _template_processing(specials: _Specials, proc: Mapping[str, Any], tc: dict, have_config: bool,
                         bos: Any, cls: Any, eos: Any, sep: Any) -> tuple[Any, Any, Any, Any]:
    single, pair = proc.get("single", []), proc.get("pair", [])
    first = last = None
    if len(single) > 1:
        if first := single[0].get("SpecialToken", {}).get("id"):
            if not have_config:
                bos = first
            elif first not in (bos, cls):
                if not bos:
                    tc["bos_token"] = bos = first
                if not cls:
                    tc["cls_token"] = cls = first
            specials.add["bos"] = first in (bos, cls)
        if last := single[-1].get("SpecialToken", {}).get("id"):
            if not have_config:
                eos = last
            elif last != eos:
                if "eot" not in specials.types:
                    specials.types += ("eot",)
                    tc["eot_token"] = eos
                elif "eom" not in specials.types:
                    specials.types += ("eom",)
                    tc["eom_token"] = eos
                tc["eos_token"] = eos = last
            specials.add["eos"] = last == eos
    if pair:
        start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
        stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
        inner = pair[slice(start, stop)]
        if inner and inner[0].get("Sequence", {}).get("id") == "A" and inner[-1].get("Sequence", {}).get("id") == "B":
            middle = inner[1:-1]
            if middle:
                add_sep = False
                entry = middle[0].get("SpecialToken", {}).get("id")
                if entry and entry in (sep, eos) and not last:
                    add_sep = True
                if len(middle) == 2:
                    entry = middle[1].get("SpecialToken", {}).get("id")
                    if entry and entry in (sep, eos):
                        add_sep = True
                specials.add["sep"] = add_sep
                if add_sep and not sep and have_config:
                    tc["sep_token"] = eos
    return bos, cls, eos, sep


def _chat_template(tokenizer_dir: Path, tc: Mapping[str, Any]) -> Any:
    alt: Any = None
    jinja, as_json = tokenizer_dir / "chat_template.jinja", tokenizer_dir / "chat_template.json"
    if jinja.is_file():
        alt = jinja.read_text(encoding="utf-8")
        extra = sorted((tokenizer_dir / "additional_chat_templates").glob("*.jinja"))
        if extra:
            alt = [{"name": "default", "template": alt}]
            alt += [{"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    elif as_json.is_file():
        alt = (_read_json(as_json, True) or {}).get("chat_template")
    template = tc.get("chat_template", alt)
    return template if template is None or isinstance(template, (str, list)) else None


def _template_entries(template: Any) -> list[tuple[str, KV]]:
    if isinstance(template, str):
        return [("tokenizer.chat_template", KV(template, GGUFValueType.STRING))]
    entries, names, default = [], [], None
    for choice in template:
        name = "".join(c if c in ascii_letters + digits else "_" for c in choice.get("name", ""))
        text = choice.get("template")
        if name and text is not None:
            if name == "default":
                default = text
            else:
                names.append(name)
                entries.append((f"tokenizer.chat_template.{name}", KV(text, GGUFValueType.STRING)))
    if names:
        entries.append(("tokenizer.chat_templates", KV(sorted(set(names)), ArrayOf(GGUFValueType.STRING))))
    if default is not None:
        entries.append(("tokenizer.chat_template", KV(default, GGUFValueType.STRING)))
    return entries


def _normalizer_flags(normalizer: Mapping[str, Any] | None, flags: dict[str, bool]) -> None:
    if not normalizer:
        return
    kind = normalizer.get("type")
    if kind == "Lowercase":
        flags["lowercase"] = True
    elif kind == "StripAccents":
        flags["strip_accents"] = True
    elif kind == "BertNormalizer":
        for key in ("lowercase", "strip_accents"):
            if key in normalizer:
                flags[key] = normalizer[key]
    elif kind == "Sequence":
        for inner in normalizer.get("normalizers", []):
            _normalizer_flags(inner, flags)


def tokenizer_metadata(tokenizer_dir: str | Path, hp: Mapping[str, Any], *, config: Mapping[str, Any] | None = None,
                       pre_tokenizer: str | None = None, chat_template: str | None = None,
                       fallbacks: Iterable[tuple[str, str]] = ()) -> list[tuple[str, KV]]:
    """The tokenizer keys for ``tokenizer_dir``.

    ``hp`` supplies ``vocab_size``; ``config`` is the raw ``config.json`` (its ``<type>_token_id`` entries);
    ``chat_template`` is used when the tokenizer files carry none; ``fallbacks`` are the architecture's
    ``(type, token text)`` pairs applied last.
    """
    directory = Path(tokenizer_dir)
    data = _read_json(directory / "tokenizer.json", required=True)
    model = data.get("model") or {}
    if model.get("type", "BPE") != "BPE":
        raise UnsupportedError(f"only BPE tokenizers are supported, found {model.get('type')!r}",
                               path=directory / "tokenizer.json")
    added = list(data.get("added_tokens") or [])
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    vocab.update({a["content"]: a["id"] for a in added})
    added_vocab = {a["content"]: a["id"] for a in added}
    added_by_id = {a["id"]: a for a in added}
    vocab_size = hp.get("vocab_size", len(vocab))
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise SourceError(f"expected a positive integer, found {vocab_size!r}", field="vocab_size")
    if vocab and max(vocab.values()) >= vocab_size:
        raise SourceError(f"the tokenizer has token id {max(vocab.values())}, the model only {vocab_size} rows",
                          field="vocab_size")

    by_id = {i: token for token, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif token in added_vocab and i in added_by_id:
            if added_by_id[i].get("special") or looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces, as the converter does
                types.append(USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(token)
            types.append(NORMAL)

    pre = check_pre_tokenizer(pre_tokenizer) if pre_tokenizer is not None else detect_pre_tokenizer(directory)
    entries: list[tuple[str, KV]] = [
        ("tokenizer.ggml.model", KV("gpt2", GGUFValueType.STRING)),
        ("tokenizer.ggml.pre", KV(pre, GGUFValueType.STRING)),
        ("tokenizer.ggml.tokens", KV(tokens, ArrayOf(GGUFValueType.STRING))),
        ("tokenizer.ggml.token_type", KV(types, ArrayOf(GGUFValueType.INT32))),
    ]
    merges = _merges(data, directory)
    if merges:
        entries.append(("tokenizer.ggml.merges", KV(merges, ArrayOf(GGUFValueType.STRING))))

    specials = _Specials()
    flags: dict[str, bool] = {}
    _normalizer_flags(data.get("normalizer"), flags)
    tc = _read_json(directory / "tokenizer_config.json", required=False)
    _post_processor(specials, data, tc)
    template = None
    if tc:
        template = _chat_template(directory, tc)
        for typ in specials.types:
            if isinstance(entry := tc.get(f"add_{typ}_token"), bool) and typ not in specials.add:
                specials.add[typ] = entry
            content = tc.get(f"{typ}_token")
            if isinstance(content, dict):
                content = content.get("content")
            if isinstance(content, str):
                specials.set(typ, next((a.get("id") for a in added if a.get("content") == content), None))
    for typ in specials.types:
        raw = (config or {}).get(f"{typ}_token_id")
        if raw is None and isinstance((config or {}).get("text_config"), Mapping):
            raw = config["text_config"].get(f"{typ}_token_id")
        specials.set(typ, raw)
    for typ, content in fallbacks:
        if content not in added_vocab:
            raise SourceError(f"the tokenizer has no added token {content!r}, which this architecture uses as its "
                              f"{typ} token", path=directory / "tokenizer.json")
        specials.set(typ, added_vocab[content])

    for typ, tid in specials.ids.items():
        if typ in SPECIAL_ID_KEYS:
            entries.append((SPECIAL_ID_KEYS[typ], KV(tid, GGUFValueType.UINT32)))
    for typ, value in specials.add.items():
        if typ in ADD_TOKEN_KEYS:
            entries.append((ADD_TOKEN_KEYS[typ], KV(bool(value), GGUFValueType.BOOL)))
    if template is None:
        template = chat_template
    if template is not None:
        entries.extend(_template_entries(template))
    for name, value in flags.items():
        entries.append((f"tokenizer.ggml.normalizer.{name}", KV(bool(value), GGUFValueType.BOOL)))
    return entries
