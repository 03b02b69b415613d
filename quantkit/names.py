"""Artifact names: one grammar for the file names releases are published under, rendered from a recipe and parsed
back into what they claim.

A name is ``<model>-<recipe fragments>-<suffix><extension>`` in one of these styles (every quoted seed name is in
``tests/data/artifact_names.tsv``):

``ds4``      ``DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf``: fragments joined
             by ``-``, each ``[Layers<L>][OtherExpertLayers]<label><type>`` or ``...<type><label>`` (both orders
             occur: ``AProjQ8`` and ``Q8Attn``), or a bare ``<type>``.  This is the style of
             :func:`quantkit.recipes.name_tag`.
``ggml``     ``DeepSeek-V4.1-Flash-IQ2_XXS-Q2_K-imatrix``: one or two bare GGML type names (``Q8_0``, not
             ``Q8``): one type is every routed expert tensor, two are routed gate/up then routed down.
``ud``       ``GLM-5.2-UD-IQ2_XXS_RoutedIQ2XXS_blk78Q2K.gguf``: ``UD-<mix>`` then ``_``-joined fragments;
             ``blk<L><type>`` narrows the fragment before it to blocks ``L``.
``swapset``  ``nvfp4-swapset-inproj``: a sidecar's encoding and family (claims no GGUF tensor types).

Pieces:

- **types**: a GGML type name (``Q8_0``) or quantkit's abbreviation (:func:`quantkit.recipes.type_abbreviation`:
  ``Q8``, ``Q4K``, ``IQ2XXS``, ``Native`` for the source encoding).  A bare ``Q<n>`` also means ``Q<n>_K``
  where that exists (ds4's ``AProjQ4`` files hold Q4_K attention), so ``Q4`` claims Q4_0 or Q4_K.
- **labels** say which tensor classes (:data:`quantkit.arch.TENSOR_CLASSES`) a type is claimed for: quantkit's
  :data:`~quantkit.recipes.CLASS_LABELS` (``AProj``, ``SExp``, ``Out``, ``Experts``, ``Gate``, ``Down``, ...)
  and the seeds' spellings (``w2`` routed down, ``GateUp``, ``Attn``, ``Shared``, ``HC``, ``Compressor``,
  ``Indexer``, ``Routed``).  A bare type directly before a ``w2`` fragment is the routed gate/up type; any other
  bare type (``-MTP-Q4K-Q8_0-F32``, or a recipe's default type), and a type under a recipe rule's own ``tag``
  (``MLAQ8``, ``FFNDownQ6K``: a capitalized word that is no type), only claims that the file holds tensors of it.
- **suffix**: lowercase ``-`` words: the variant before ``imatrix`` (``chat-v2``), the calibration ``imatrix``,
  qualifiers after it (``fixed``), and a final checkpoint label of 4 digits (``0731``, as
  :data:`quantkit.scoring.source.DS4_NAME_LABEL` reads it); ``...`` marks a name quoted with its end elided.  A
  split part ends ``-00001-of-00002`` (llama.cpp's shard names) after all of that.
- the **model** is everything before the first fragment; a name without fragments is a model name with at most a
  label (``model-0731.gguf``).  A support (drafter) file's model ends in its kind's word (:data:`SUPPORT_WORDS`),
  as ds4 publishes its MTP drafter (``DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf``): a drafter and its target made
  with one recipe never get one name.

Claims are checked most-specific first: a ranged claim (``Layers37-42Q4KExperts``, ``blk78Q2K``) beats an
unranged one for the tensors in its range, then a claim for fewer classes beats one for more (``Q2KDown`` beats
``RoutedIQ2XXS`` for the down projections).  :func:`contradictions` lists what a file's tensors and provenance
contradict (``quantkit validate``'s ``name.claims`` check, exit 1); a name that parses to no claims contradicts
nothing.  Tensors are classed from their GGUF names as quantkit's architecture maps class them
(:func:`tensor_classes`); a claim on a class it cannot find is not checked.  :func:`suggest` renders the ``ds4``
name of a conversion, :func:`restyle` the same claims in the ``ggml`` and ``ud`` styles.

``quantkit convert`` prints the suggested name, hashes its output (:func:`quantkit.evidence.artifact_sha256`, one pass after writing) and
writes :func:`release_manifest` to ``<output stem>.release.json`` (or ``--release-manifest PATH``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from .arch import CLASS_GROUPS
from .errors import FormatError
from .formats.registry import GGMLType
from .imatrix.bootstrap import CALIBRATION_KEY
from .recipes.model import Layers, layers_text
from .recipes.tags import CLASS_LABELS, type_abbreviation
from .scoring.source import GGUF_LABEL_KEY, source_digest
from .io import jsontext

STYLES = ("ds4", "ggml", "ud", "swapset")
EXTENSIONS = (".gguf", ".safetensors", ".json")
ROUTED = frozenset({"routed_gate", "routed_up", "routed_down"})
CALIBRATION = "imatrix"
ELIDED = "..."
#: ``convert --support`` kind -> the word after the model name (ds4's ``DeepSeek-V4-Flash-MTP-...``; DSpark as
#: DeepSeek spells its drafter).  Neither parses as a fragment: the name reads back with the word in its model.
SUPPORT_WORDS = {"mtp": "MTP", "dspark": "DSpark"}


def _classes(name: str) -> frozenset[str]:
    return frozenset(CLASS_GROUPS.get(name, {name}))


#: label -> the tensor classes it claims a type for.
LABEL_CLASSES: Mapping[str, frozenset[str]] = {
    **{label: _classes(cls) for cls, label in CLASS_LABELS.items()},
    "GateUp": frozenset({"routed_gate", "routed_up"}), "w2": frozenset({"routed_down"}), "Routed": ROUTED,
    "Attn": _classes("attn_proj"), "Shared": _classes("shared_expert"), "Compressor": _classes("compressor"),
    "Indexer": _classes("indexer"),
}
#: The labels :func:`restyle` writes for a class set (quantkit's own labels first).
_LABEL_OF = {classes: label for label, classes in reversed(list(LABEL_CLASSES.items()))}


def _type_spellings() -> dict[str, tuple[str, ...]]:
    """Spelling -> the GGML type names it can mean."""
    from .recipes.resolve import LOSSLESS

    # type = "source": whichever type holds the source without loss (BF16 as BF16, packed FP4 as MXFP4, ...)
    out: dict[str, tuple[str, ...]] = {"Native": tuple(sorted({t.name for t, _ in LOSSLESS.values()}))}
    for t in GGMLType:
        out.setdefault(t.name, (t.name,))
        abbreviation = type_abbreviation(t.name)
        if abbreviation != t.name:
            out[abbreviation] = out.get(abbreviation, ()) + (t.name,)
    for bits in range(2, 7):   # ds4's bare Q<n> is also the K-quant (AProjQ4: Q4_K attention)
        out[f"Q{bits}"] = out.get(f"Q{bits}", ()) + (f"Q{bits}_K",)
    return out


TYPE_SPELLINGS = _type_spellings()


def _alternation(words: Iterable[str]) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=lambda w: (-len(w), w)))


_TYPE = f"(?:{_alternation(TYPE_SPELLINGS)})"
#: A recipe rule's own ``tag`` (``MLA``, ``FFNDown``): a capitalized word that does not start with a type spelling.
_OWN_LABEL = rf"(?!{_TYPE})[A-Z][A-Za-z]*"
_LABEL = f"(?:{_alternation(LABEL_CLASSES)}|{_OWN_LABEL})"
_LAYERS = r"\d+(?:-\d+)?(?:\+\d+(?:-\d+)?)*"
_BODY = (rf"(?:(?P<label>{_LABEL})(?P<type>{_TYPE})|(?P<type2>{_TYPE})(?P<label2>{_LABEL})?)")
_DS4_FRAGMENT = re.compile(rf"(?:Layers(?P<layers>{_LAYERS}))?(?P<other>OtherExpertLayers)?{_BODY}(?=-|$)")
_UD_FRAGMENT = re.compile(rf"(?:blk(?P<layers>{_LAYERS}))?{_BODY}")
_UD = re.compile(r"(?P<model>.+?)-UD-(?P<mix>[A-Z0-9]+(?:_[A-Z0-9]+)*?)(?P<fragments>(?:_(?:[A-Z][a-z]|blk\d|w2).*?)?)"
                 r"(?P<suffix>(?:-[a-z0-9.]+)*)")
_SWAPSET = re.compile(r"(?P<encoding>[a-z0-9]+)-swapset(?P<family>(?:-[a-z0-9]+)*)")
_LABEL_TOKEN = re.compile(r"\d{4}")
_SHARD = re.compile(r"(?P<stem>.+)-(?P<shard>\d{5}-of-\d{5})")


def tag_problem(tag: str, class_name: str) -> str | None:
    """Why a recipe rule's ``tag`` cannot stand in a file name for a rule of ``class_name``: it is the label of other
    classes (the name would claim the rule's type for them), or a word the grammar does not read as a label (the
    conversion would suggest no name).  None when it can."""
    claimed = LABEL_CLASSES.get(tag)
    if claimed is not None and claimed != _classes(class_name):
        return (f"tag {tag!r} is the file-name label of {'/'.join(sorted(claimed))}: a name would claim this rule's "
                f"type for those tensors; choose another tag")
    if claimed is None and not re.fullmatch(_OWN_LABEL, tag):
        return (f"tag {tag!r} is not a word file names read as a label (a capital letter, then letters, not "
                f"starting with a type spelling such as Q4K; e.g. 'FFNDown'); the conversion could suggest no name")
    return None


def _parse_layers(text: str | None) -> Layers | None:
    if text is None:
        return None
    ranges = []
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        ranges.append((int(lo), int(hi or lo)))
    return tuple(ranges)


@dataclass(frozen=True)
class Claim:
    """What one fragment says: tensors of ``classes`` (in ``layers``; None: all) are stored as one of ``types``.
    No classes: the file holds at least one tensor of one of ``types``."""

    classes: frozenset[str]
    types: tuple[str, ...]
    layers: Layers | None = None

    @property
    def specificity(self) -> tuple[bool, int]:
        return self.layers is not None, -len(self.classes)

    def covers(self, tensor_class: str, layer: int | None) -> bool:
        if tensor_class not in self.classes:
            return False
        return self.layers is None or (layer is not None and any(lo <= layer <= hi for lo, hi in self.layers))

    def describe(self) -> str:
        types = " or ".join(self.types)
        where = f" in layers {layers_text(self.layers)}" if self.layers else ""
        return f"{'/'.join(sorted(self.classes)) or 'some tensor'}{where} {types}"


@dataclass(frozen=True)
class Fragment:
    """One recipe fragment as written: its layers, label and type spelling, and their order."""

    type_text: str
    label: str | None = None
    type_first: bool = False
    layers: Layers | None = None
    other_layers: bool = False
    classes: frozenset[str] = frozenset()
    """The classes it claims for (its label's, inherited, or none for a bare type)."""

    def render(self, style: str) -> str:
        prefix = ""
        if self.layers is not None:
            prefix = ("blk" if style == "ud" else "Layers") + layers_text(self.layers)
        if self.other_layers:
            prefix += "OtherExpertLayers"
        label = self.label or ""
        return prefix + (self.type_text + label if self.type_first else label + self.type_text)

    def claim(self) -> Claim:
        return Claim(self.classes, TYPE_SPELLINGS[self.type_text], self.layers)


@dataclass(frozen=True)
class ArtifactName:
    """A parsed (or suggested) artifact name; :meth:`render` writes it back."""

    style: str
    model: str = ""
    fragments: tuple[Fragment, ...] = ()
    mix: str | None = None
    """``ud``: the mix after ``UD-``; ``swapset``: the encoding."""
    variant: tuple[str, ...] = ()
    calibration: str | None = None
    qualifiers: tuple[str, ...] = ()
    label: str | None = None
    elided: bool = False
    shard: str | None = None
    """A split part's ``00001-of-00002``."""
    extension: str = ""

    @property
    def claims(self) -> tuple[Claim, ...]:
        mix = (Claim(frozenset(), (self.mix_type,)),) if self.mix_type else ()
        return mix + tuple(f.claim() for f in self.fragments)

    @property
    def mix_type(self) -> str | None:
        """``ud``: the GGML type a mix is named after (``IQ2_XXS``, ``Q2_K`` of ``Q2_K_XL``): the file holds
        tensors of it."""
        if self.style != "ud" or not self.mix:
            return None
        words = self.mix.split("_")
        return next(("_".join(words[:n]) for n in range(len(words), 0, -1)
                     if "_".join(words[:n]) in GGMLType.__members__), None)

    @property
    def claims_anything(self) -> bool:
        return bool(self.fragments or self.mix_type or self.calibration or self.label)

    def suffix_words(self) -> list[str]:
        words = list(self.variant)
        if self.calibration:
            words.append(self.calibration)
        words += [*self.qualifiers, *([self.label] if self.label else []), *([ELIDED] if self.elided else [])]
        return words

    def render(self) -> str:
        end = (f"-{self.shard}" if self.shard else "") + self.extension
        if self.style == "swapset":
            return "-".join([f"{self.mix}-swapset", *self.variant]) + end
        suffix = self.suffix_words()
        if self.style == "ud":
            head = f"{self.model}-UD-{self.mix}" + "".join(f"_{f.render('ud')}" for f in self.fragments)
            return "-".join([head, *suffix]) + end
        parts = [self.model] if self.model else []
        return "-".join(parts + [f.render(self.style) for f in self.fragments] + suffix) + end


# -- parsing -------------------------------------------------------------------------------------------------------

def _fragment(m: re.Match, inherited: frozenset[str] = frozenset()) -> Fragment:
    label = m.group("label") or m.group("label2")
    type_first = m.group("type2") is not None
    classes = LABEL_CLASSES.get(label, frozenset()) if label else inherited   # a rule's own tag: no known class
    return Fragment(m.group("type") or m.group("type2"), label, type_first and label is not None,
                    _parse_layers(m.group("layers")), bool(m.groupdict().get("other")), classes)


def _suffix(words: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"elided": bool(words) and words[-1] == ELIDED}
    if out["elided"]:
        words = words[:-1]
    if words and _LABEL_TOKEN.fullmatch(words[-1]):
        out["label"], words = words[-1], words[:-1]
    if CALIBRATION in words:
        i = words.index(CALIBRATION)
        out.update(calibration=CALIBRATION, variant=tuple(words[:i]), qualifiers=tuple(words[i + 1:]))
    else:
        out["variant"] = tuple(words)
    return out


def _scan(text: str) -> tuple[int, list[re.Match]]:
    """(start of the fragments, the fragment matches), the fragments starting at the first word that is one."""
    starts = [0] + [m.end() for m in re.finditer("-", text)]
    for start in starts:
        if start == 1 or not _DS4_FRAGMENT.match(text, start):   # a model name is never empty
            continue
        matches, pos = [], start
        while (m := _DS4_FRAGMENT.match(text, pos)) is not None:
            matches.append(m)
            if m.end() == len(text) or text[m.end()] != "-":
                break
            pos = m.end() + 1
        return start, matches
    return len(text), []


def _ds4(stem: str, extension: str) -> ArtifactName:
    start, matches = _scan(stem)
    if not matches:
        model, dash, label = stem.rpartition("-")
        if dash and model and _LABEL_TOKEN.fullmatch(label):
            return ArtifactName("ds4", model, label=label, extension=extension)
        return ArtifactName("ds4", stem, extension=extension)
    model = stem[:start - 1] if start else ""
    end = matches[-1].end()
    words = stem[end + 1:].split("-") if end < len(stem) else []   # after the "-" that ends the fragments
    fragments = [_fragment(m) for m in matches]
    ggml = 0 < len(fragments) <= 2 and all(f.label is None and f.type_text in GGMLType.__members__ for f in fragments)
    if ggml:
        if len(fragments) == 1:
            fragments = [replace(fragments[0], classes=ROUTED)]
        else:
            fragments = [replace(fragments[0], classes=ROUTED - {"routed_down"}),
                         replace(fragments[1], classes=frozenset({"routed_down"}))]
    else:
        for i, f in enumerate(fragments[:-1]):
            if f.label is None and fragments[i + 1].label == "w2":
                fragments[i] = replace(f, classes=ROUTED - {"routed_down"})
    return ArtifactName("ggml" if ggml else "ds4", model, tuple(fragments),
                        extension=extension, **_suffix(words))


def parse(name: str) -> ArtifactName:
    """The :class:`ArtifactName` of a file name (a path's directories are ignored).  Never fails: a name in no
    known style is a model name that claims nothing."""
    base = Path(name).name
    extension = next((e for e in EXTENSIONS if base.endswith(e) and len(base) > len(e)), "")
    stem = base[:len(base) - len(extension)]
    if m := _SHARD.fullmatch(stem):
        return replace(_parse_stem(m.group("stem"), extension), shard=m.group("shard"))
    return _parse_stem(stem, extension)


def _parse_stem(stem: str, extension: str) -> ArtifactName:
    if m := _SWAPSET.fullmatch(stem):
        family = tuple(w for w in m.group("family").split("-") if w)
        return ArtifactName("swapset", mix=m.group("encoding"), variant=family, extension=extension)
    if (m := _UD.fullmatch(stem)) and (fragments := _ud_fragments(m.group("fragments"))) is not None:
        words = [w for w in m.group("suffix").split("-") if w]
        return ArtifactName("ud", m.group("model"), fragments, mix=m.group("mix"), extension=extension,
                            **_suffix(words))
    return _ds4(stem, extension)


def _ud_fragments(text: str) -> tuple[Fragment, ...] | None:
    fragments: list[Fragment] = []
    for part in text.split("_")[1:]:
        m = _UD_FRAGMENT.fullmatch(part)
        if m is None:
            return None
        fragments.append(_fragment(m, fragments[-1].classes if fragments else frozenset()))
    return tuple(fragments)


# -- rendering from a recipe ---------------------------------------------------------------------------------------

def suggest(model: str, tag: str, *, calibration: str | None = None, label: str | None = None,
            support: str | None = None, extension: str = ".gguf") -> ArtifactName:
    """The ``ds4``-style name of a file of ``model`` made with a recipe whose name tag
    (:func:`quantkit.recipes.name_tag`) is ``tag``; ``calibration`` ``"imatrix"`` when an imatrix was used;
    ``support`` the kind of a support (drafter) file (its word joins the model's: :data:`SUPPORT_WORDS`);
    ``label`` the checkpoint label, named only where the grammar reads it back (4 digits: ``0731``; any other
    label stays in the file's metadata alone)."""
    start, matches = _scan(tag)
    if start != 0 or not matches or matches[-1].end() != len(tag):
        raise FormatError(f"name tag {tag!r} is not in the artifact-name grammar")
    parsed = _ds4(tag, "")
    model = _file_safe(model) + (f"-{SUPPORT_WORDS[support]}" if support is not None else "")
    return replace(parsed, model=model, calibration=calibration,
                   label=label if label and _LABEL_TOKEN.fullmatch(label) else None, extension=extension)


def _file_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+]+", "-", text).strip("-.")


def _unranged(claims: Iterable[Claim], cls: str) -> Claim | None:
    found = [c for c in claims if c.layers is None and cls in c.classes]
    return max(found, key=lambda c: c.specificity) if found else None


def restyle(name: ArtifactName, style: str) -> ArtifactName:
    """``name`` in another style (``ds4``, ``ggml`` or ``ud``) with the same unranged routed-expert types; the
    ``ggml`` style keeps only those, the others also ranged expert claims and the other classes' claims."""
    if style == name.style:
        return name
    if style not in ("ds4", "ggml", "ud"):
        raise FormatError(f"cannot render a name in style {style!r}")
    claims = name.claims
    gate, down = _unranged(claims, "routed_gate"), _unranged(claims, "routed_down")
    bare = next((c for c in claims if not c.classes), None)
    gate_type = (gate or bare).types[0] if (gate or bare) else None
    down_type = (down or gate or bare).types[0] if (down or gate or bare) else None
    if gate_type is None:
        raise FormatError(f"{name.render()} claims no routed-expert type to render in style {style!r}")
    ranged = [c for c in claims if c.layers is not None and c.classes >= ROUTED]
    others = [c for c in claims if c.classes and not c.classes <= ROUTED and c.classes in _LABEL_OF]
    g, d = type_abbreviation(gate_type), type_abbreviation(down_type)
    if style == "ggml":
        types = [gate_type] if gate_type == down_type else [gate_type, down_type]
        fragments = tuple(Fragment(t, classes=c) for t, c in
                          zip(types, [ROUTED] if len(types) == 1 else [ROUTED - {"routed_down"},
                                                                      frozenset({"routed_down"})]))
        return replace(name, style="ggml", fragments=fragments, mix=None)
    if style == "ds4":   # the layout of quantkit.recipes.name_tag
        fragments = [Fragment(type_abbreviation(c.types[0]), "Experts", True, c.layers, classes=ROUTED)
                     for c in ranged]
        if g == d:
            fragments.append(Fragment(g, "Experts", True, other_layers=bool(ranged), classes=ROUTED))
        elif ranged:
            fragments += [Fragment(g, "GateUp", True, other_layers=True, classes=ROUTED - {"routed_down"}),
                          Fragment(d, "Down", True, classes=frozenset({"routed_down"}))]
        else:
            fragments += [Fragment(g, classes=ROUTED - {"routed_down"}),
                          Fragment(d, "w2", classes=frozenset({"routed_down"}))]
        fragments += [Fragment(type_abbreviation(c.types[0]), _LABEL_OF[c.classes], layers=c.layers,
                               classes=c.classes) for c in others]
        return replace(name, style="ds4", fragments=tuple(fragments), mix=None)
    fragments = [Fragment(g, "Routed", classes=ROUTED)]
    fragments += [Fragment(type_abbreviation(c.types[0]), layers=c.layers, classes=ROUTED) for c in ranged]
    if d != g:
        fragments.append(Fragment(d, "Down", classes=frozenset({"routed_down"})))
    fragments += [Fragment(type_abbreviation(c.types[0]), _LABEL_OF[c.classes], layers=c.layers, classes=c.classes)
                  for c in others]
    return replace(name, style="ud", fragments=tuple(fragments), mix=gate_type)


# -- checking a file against its name ------------------------------------------------------------------------------

#: GGUF weight name -> class, for both dialects (the classes of quantkit.arch's maps; first match wins).
_TENSOR_CLASS_PATTERNS = tuple((re.compile(p), cls) for p, cls in (
    (r"blk\.\d+\.ffn_gate_exps\.weight", "routed_gate"),
    (r"blk\.\d+\.ffn_up_exps\.weight", "routed_up"),
    (r"blk\.\d+\.ffn_down_exps\.weight", "routed_down"),
    (r"blk\.\d+\.ffn_(gate|up|down)_shexp\.weight", "shared_expert"),
    (r"blk\.\d+\.ffn_(gate|up|down)\.weight", "dense_ffn"),
    (r"blk\.\d+\.attn_(q|q_a|q_b)\.weight", "attn_q"),
    (r"blk\.\d+\.attn_(k|v|kv|kv_a_mqa|k_b|v_b)\.weight", "attn_kv"),
    (r"blk\.\d+\.attn_(output|output_a|output_b)\.weight", "attn_output"),
    (r"blk\.\d+\.attn_compressor_(kv|gate)\.weight", "compressor"),
    (r"blk\.\d+\.(indexer\.\w+|indexer_compressor_(kv|gate))\.weight", "indexer"),
    (r"blk\.\d+\.kda_(q|k)\.weight", "kda_qk"),
    (r"blk\.\d+\.kda_v\.weight", "kda_v"),
    (r"blk\.\d+\.kda_output\.weight", "kda_output"),
    (r"blk\.\d+\.kda_(f_a|f_b|g_a|g_b|beta)\.weight", "kda_gate"),
    (r"blk\.\d+\.attn_qkv\.weight", "gdn_qkv"),
    (r"blk\.\d+\.ssm_(alpha|beta)\.weight", "gdn_ab"),
    (r"blk\.\d+\.ssm_out\.weight", "gdn_output"),
    (r"(blk\.\d+\.)?(output_)?hc_\w+\.weight", "hc"),
    (r"blk\.\d+\.nextn\.\w+\.weight", "mtp"),
    (r"output\.weight", "output"),
    (r"token_embd\.weight", "token_embd"),
))
#: llama.cpp names a KDA block's projections like attention's (attn_q ... attn_output) and its gates ssm_*: a block
#: holding ssm_f_a is a KDA block.
_KDA_BLOCK = re.compile(r"blk\.(\d+)\.ssm_f_a\.weight")
_KDA_NAMES = {"attn_q": "kda_qk", "attn_k": "kda_qk", "attn_v": "kda_v", "attn_output": "kda_output",
              "ssm_f_a": "kda_gate", "ssm_f_b": "kda_gate", "ssm_g_a": "kda_gate", "ssm_g_b": "kda_gate",
              "ssm_beta": "kda_gate"}
#: Block tensor names whose class depends on the architecture (``general.architecture``): ds4's dialect writes
#: Qwen3.8's gated-delta-net tensors under KDA names, and the two dialects give ``attn_gate`` different roles.
_ARCH_NAMES: Mapping[str, Mapping[str, str]] = {
    "qwen38-next": {"kda_q": "gdn_qkv", "kda_k": "gdn_qkv", "kda_v": "gdn_qkv", "kda_alpha": "gdn_ab",
                    "kda_beta": "gdn_ab", "kda_output": "gdn_output", "kda_gate": "gdn_gate", "attn_gate": "attn_q"},
    "qwen4exp": {"attn_gate": "gdn_gate"},
}
#: The classes :func:`tensor_classes` can find: a claim on any other class is not checked.
CLASSIFIED = frozenset([cls for _, cls in _TENSOR_CLASS_PATTERNS] + list(_KDA_NAMES.values())
                       + [cls for names in _ARCH_NAMES.values() for cls in names.values()])
_LAYER = re.compile(r"blk\.(\d+)\.")
#: ds4's name of an MTP block (``mtp.0.ffn_gate_exps.weight``): its tensors' classes are a block's, its number
#: is no layer of the model (a layer-ranged claim does not cover it).
_MTP_BLOCK = re.compile(r"mtp\.(\d+)\.")


def tensor_classes(gguf_names: Iterable[str], architecture: str | None = None) -> dict[str, str]:
    """GGUF weight name -> tensor class, for the names of one file (either dialect; ``architecture`` its
    ``general.architecture``) whose class :data:`CLASSIFIED` holds; other names are left out."""
    names = list(gguf_names)
    kda_blocks = {m.group(1) for n in names if (m := _KDA_BLOCK.fullmatch(n))}
    by_arch = _ARCH_NAMES.get(architecture or "", {})
    out = {}
    for n in names:
        as_block = _MTP_BLOCK.sub(r"blk.\1.", n, count=1) if _MTP_BLOCK.match(n) else n
        m = _LAYER.match(as_block)
        short = as_block[m.end():-len(".weight")] if m and as_block.endswith(".weight") else None
        if short in by_arch:
            out[n] = by_arch[short]
            continue
        if short in _KDA_NAMES and m.group(1) in kda_blocks:
            out[n] = _KDA_NAMES[short]
            continue
        cls = next((cls for pattern, cls in _TENSOR_CLASS_PATTERNS if pattern.fullmatch(as_block)), None)
        if cls is not None:
            out[n] = cls
    return out


def _allowed_fallbacks(recipe_text: str | None) -> set[str]:
    """Types a recorded recipe names as fallbacks: a tensor whose rows the claimed type cannot take uses one."""
    return set(re.findall(r'^\s*fallback\s*=\s*"([A-Z0-9_]+)"', recipe_text or "", re.M))


def contradictions(name: ArtifactName, tensors: Iterable[tuple[str, str, int]],
                   metadata: Mapping[str, Any]) -> list[str]:
    """What the file contradicts of what ``name`` claims: ``tensors`` are (GGUF name, type name, dimensions),
    ``metadata`` the file's key -> value.  Type claims are checked on matrices (2 or more dimensions) against
    the most specific claim covering each (a recorded recipe's fallback types are accepted); the calibration against
    quantkit's recorded calibration and the label against a recorded label (a file without them: tensor types
    only; the scorer takes an unrecorded label from the name)."""
    claims = name.claims
    fallbacks = _allowed_fallbacks(metadata.get("quantkit.recipe.text"))
    covered = [0] * len(claims)          # tensors of the claim's classes and layers
    wrong: list[list[str]] = [[] for _ in claims]
    tensors = list(tensors)
    present = {ttype for _, ttype, _ in tensors}
    classes = tensor_classes((tname for tname, _, ndim in tensors if ndim >= 2),
                             metadata.get("general.architecture"))
    for tname, ttype, ndim in tensors:
        cls = classes.get(tname)
        if cls is None:
            continue
        m = _LAYER.match(tname)
        layer = int(m.group(1)) if m else None
        covering = [i for i, c in enumerate(claims) if c.covers(cls, layer)]
        for i in covering:
            covered[i] += 1
        if covering:
            i = max(covering, key=lambda k: claims[k].specificity)
            if ttype not in claims[i].types and ttype not in fallbacks:
                wrong[i].append(f"{tname} {ttype}")
    problems: list[str] = []
    for claim, bad, count in zip(claims, wrong, covered):
        if bad:
            problems.append(f"name claims {claim.describe()} but {len(bad)} of those tensors "
                            f"{'are' if len(bad) > 1 else 'is'} not: {', '.join(bad[:3])}"
                            + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
        elif name.shard:   # a split part holds some of the tensors: only those it has are checked
            continue
        elif not claim.classes and not set(claim.types) & present:
            problems.append(f"name claims {claim.describe()} but no tensor is {' or '.join(claim.types)}")
        elif claim.classes and not count and claim.classes <= CLASSIFIED:
            problems.append(f"name claims {claim.describe()} but the file has no such tensor")
    recorded = metadata.get(CALIBRATION_KEY)
    if name.calibration == CALIBRATION and recorded is not None and "imatrix" not in str(recorded):
        problems.append(f"name claims an imatrix calibration but the file records calibration {recorded!r}")
    label = metadata.get(GGUF_LABEL_KEY)
    if name.label is not None and label is not None and label != name.label:
        problems.append(f"name claims checkpoint label {name.label} but the file records label {label!r}")
    return problems


# -- what convert records about its output -------------------------------------------------------------------------

MANIFEST_FORMAT = "quantkit-release"
MANIFEST_VERSION = 1
MANIFEST_SUFFIX = ".release.json"
#: A release manifest is a few KB plus one line per source file.
MAX_MANIFEST_BYTES = 16 << 20


def manifest_path(output: Path) -> Path:
    """Where the release manifest of ``output`` goes by default: ``<stem>.release.json`` beside it."""
    return output.with_name(output.stem + MANIFEST_SUFFIX)


def is_release_manifest(path: Path) -> bool:
    """Whether ``path`` holds a release manifest (convert replaces its own stale record; never another file)."""
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            return False
        record = jsontext.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("format") == MANIFEST_FORMAT


def model_name(repo_id: str | None, path: Path) -> str:
    """The model part of a suggested name: the repo's name, else the source directory's (a Hugging Face snapshot
    directory, ``models--org--name/snapshots/<commit>``, gives ``name``)."""
    if repo_id:
        return repo_id.rsplit("/", 1)[-1]
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name


def release_manifest(path: Path, sha256: str, suggested: str | None) -> dict[str, Any]:
    """The release manifest of a file quantkit converted, from its provenance keys
    (:mod:`quantkit.convert.provenance`): its name (and the one the grammar suggests), size, SHA-256, the recipe
    (name, SHA-256, tag), the calibration (imatrix SHA-256, coverage, datasets, chunks; or none), the checkpoint
    label and the source identity (repo, revision, every file read with its SHA-256, and the weight-file digest
    fixtures are matched by: :func:`quantkit.scoring.source.source_digest`)."""
    from .io.gguf_reader import GGUFFile

    with GGUFFile(path) as f:
        meta = {key: kv.value for key, kv in f.metadata.items()}
    imatrix = None
    if "quantkit.imatrix.sha256" in meta:
        imatrix = {"sha256": meta["quantkit.imatrix.sha256"], "coverage": meta.get("quantkit.imatrix.coverage"),
                   "datasets": list(meta.get("quantkit.imatrix.datasets", [])),
                   "chunks": meta.get("quantkit.imatrix.chunks"), "synthetic": meta.get("quantkit.imatrix.synthetic"),
                   "file": meta.get("quantize.imatrix.file")}
    files = [{"name": n, "sha256": h} for n, h in zip(meta.get("quantkit.source.files", []),
                                                     meta.get("quantkit.source.sha256", []))]
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "name": path.name, "suggested_name": suggested,
            "size": path.stat().st_size, "sha256": sha256,
            "recipe": {"name": meta.get("quantkit.recipe.name"), "sha256": meta.get("quantkit.recipe.sha256"),
                       "tag": meta.get("quantkit.recipe.tag")},
            "calibration": {"kind": meta.get(CALIBRATION_KEY, "none"), "imatrix": imatrix},
            "label": meta.get(GGUF_LABEL_KEY),
            "source": {"repo": meta.get("quantkit.source.repo"), "revision": meta.get("quantkit.source.revision"),
                       "digest": source_digest((f["name"], f["sha256"]) for f in files), "files": files},
            "quantkit_version": meta.get("quantkit.version")}


__all__ = ["ArtifactName", "CLASSIFIED", "Claim", "Fragment", "LABEL_CLASSES", "MANIFEST_SUFFIX", "STYLES",
           "SUPPORT_WORDS", "TYPE_SPELLINGS", "contradictions", "is_release_manifest", "manifest_path", "model_name",
           "parse", "release_manifest", "restyle", "suggest", "tensor_classes"]
