"""GGUF dialects: the same model under llama.cpp's names and keys, or under ds4's.

A dialect changes tensor names, tensor order, metadata keys and value types; payload bytes stay as they are,
except where ds4 genuinely stores something else (``LAYOUT_A_LOG``: GLM's ``kda_a_log`` holds ``A_log`` where
llama.cpp's ``ssm_a`` holds ``-exp(A_log)``; ``LAYOUT_CONV``: the same bytes under another shape).  The tables
are data, one module per dialect (:mod:`.ds4`); this module applies them.

Library API (used by ``quantkit convert --dialect``, ``quantkit redialect`` and readers of foreign files)::

    DIALECTS                                   # ("llama.cpp", "ds4")
    dialect_of(metadata)                       # which dialect a file's metadata ({key: KV}) is in
    to_llamacpp_name("blk.0.kda_q.weight", "glm5-next")         # -> "blk.0.attn_q.weight"
    to_dialect_name("blk.0.attn_q.weight", "glm5-next", "ds4", linear_layers={0})
    translate(metadata, tensors, to="ds4")     # -> Translation(metadata, moves): the whole re-dialect plan
    convert_payload(move, raw_bytes, to)       # a tensor's payload in dialect `to` (bytes unchanged unless
                                               # move.layout is LAYOUT_A_LOG: ds4's A_log -> llama.cpp's only)

``dialect_of`` recognizes ds4 by the keys only ds4 writes (``glm5-next.layer_types`` ...).  For ``deepseek4`` the
dialects share every tensor name and key ds4.c reads but ``deepseek4.vocab_size``, which ds4.c requires and
llama.cpp's converter does not write (llama.cpp ignores it): that key marks the ds4 dialect.

Lossless round trips.  What one dialect holds and the other cannot say (llama.cpp keys ds4 drops, such as
``glm5-next.rope.freq_base``; a tensor order; a value the inverse mapping would not reproduce) is kept in the
output under ``quantkit.dialect.<source dialect>.`` (``.kv.<key>`` values, ``.keys`` and ``.tensors`` orders),
found by translating back and comparing; translating back consumes it.  So llama.cpp -> ds4 -> llama.cpp
reproduces the file byte for byte.  One payload is not the input's bytes: GLM's A_log, whose llama.cpp form
``-exp(A_log)`` several float32 ``A_log`` share, so ds4's comes from the checkpoint (``redialect --source``).
ds4 engines read keys by name and ignore the ``quantkit.`` namespace, as they ignore quantkit's provenance keys.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
from gguf.constants import GGUFValueType

from ...errors import FormatError, QuantkitError, UnsupportedError
from ...io.gguf import KV, ArrayOf

LLAMA_CPP = "llama.cpp"
DS4 = "ds4"
DIALECTS = (LLAMA_CPP, DS4)
#: ds4 and llama.cpp store the payload of the tensor as it is
LAYOUT_SAME = "same"
#: short convolution: llama.cpp [1, C, 1, K], ds4 [C, 1, K] (numpy order); the same bytes
LAYOUT_CONV = "conv"
#: llama.cpp ssm_a = -exp(A_log) (float64 exp rounded once to float32), ds4 kda_a_log = A_log
LAYOUT_A_LOG = "a_log"
STASH_PREFIX = "quantkit.dialect."
_SLUG = {LLAMA_CPP: "llama_cpp", DS4: "ds4"}


@dataclass(frozen=True)
class TensorRow:
    """One tensor under both dialects: name templates (``{L}`` = block index) and the payload relation."""

    llama_cpp: str
    ds4: str
    layout: str = LAYOUT_SAME
    linear_only: bool = False
    """Applies only to linear-attention blocks (GLM's ``attn_output`` is ``kda_output`` there)."""
    attention_only: bool = False


@dataclass(frozen=True)
class KeyRow:
    """One ds4 key, its type, and the llama.cpp key (and type) it comes from; ``derive`` names the rule."""

    ds4: str
    ds4_type: Any
    llama_cpp: str | None
    llama_cpp_type: Any
    derive: str = "copy"
    value: Any = None
    """The value of a ``constant`` key (one the llama.cpp dialect hard-codes in its loader)."""


@dataclass(frozen=True)
class RelaidRow:
    """One ds4 tensor built from the source rows of a llama.cpp tensor, not from its payload.

    ``steps``: the transform steps (:mod:`quantkit.arch.transforms`) from the checkpoint tensor, replacing the
    llama.cpp rule's (None: the same steps).  ``section``: 0 before the blocks, 1 in a block (``{L}`` names),
    2 after them.  ``columns_permuted``: llama.cpp permutes this tensor's input columns (so an imatrix collected
    under llama.cpp's name does not apply to it column for column)."""

    ds4: str
    llama_cpp: str
    steps: tuple[str, ...] | None = None
    columns_permuted: bool = False
    note: str = ""


@dataclass(frozen=True)
class ArchDialect:
    gguf_arch: str
    tensors: tuple[TensorRow, ...]
    keys: tuple[KeyRow, ...]
    llamacpp_derived: tuple[str, ...] = ()
    llamacpp_constants: tuple[tuple[str, Any, Any], ...] = ()
    llamacpp_refused: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    keep_order: bool = False
    passthrough_arch_keys: bool = False
    ds4_arch: str | None = None
    """ds4's ``general.architecture`` where it is not llama.cpp's (Qwen3.8: ``qwen38-next``)."""
    native: tuple[str, ...] = ()
    """ds4 tensor names (``{L}``: an index) ``convert`` builds from the checkpoint with no llama.cpp counterpart
    (DeepSeek V4's ``mtp.K.*``: llama.cpp names the MTP block otherwise and lacks some of its tensors): a plan
    carries them as they are, a re-dialect refuses them (and the llama.cpp tensors they replace) with
    ``native_note``."""
    native_note: str = ""
    relaid: tuple["RelaidRow", ...] = ()
    """Tensors ds4 lays out differently (a :class:`RelaidRow` per ds4 tensor, in ds4's order within a block):
    such an architecture converts from the checkpoint only (:func:`relaid_tensors`), never by re-dialecting."""
    _patterns: dict = field(default_factory=dict, compare=False, repr=False)

    def k(self, template: str) -> str:
        return template.format(arch=self.gguf_arch)

    def kd(self, template: str) -> str:
        """A key template under ds4's architecture name."""
        return template.format(arch=self.ds4_arch or self.gguf_arch)

    def pattern(self, template: str) -> re.Pattern:
        if template not in self._patterns:
            self._patterns[template] = re.compile(re.escape(template).replace(re.escape("{L}"), r"(?P<L>\d+)"))
        return self._patterns[template]


class TensorMove(NamedTuple):
    """One tensor of a translation: its name in the input, in the output, the output shape and the layout."""

    source: str
    name: str
    shape: tuple[int, ...]
    type: Any
    layout: str


class Translation(NamedTuple):
    metadata: list[tuple[str, KV]]
    moves: list[TensorMove]
    """In output order."""


def _tables():
    from . import ds4
    return ds4


def arch_dialect(arch: str, dialect: str = DS4) -> ArchDialect | None:
    """The ds4 table of a GGUF architecture; None for llama.cpp, UnsupportedError where ds4 has none."""
    if dialect not in DIALECTS:
        raise UnsupportedError(f"unknown GGUF dialect {dialect!r}; known: {', '.join(DIALECTS)}", field="dialect")
    if dialect == LLAMA_CPP:
        return None
    ds4 = _tables()
    if arch in ds4.UNSUPPORTED:
        raise UnsupportedError(f"no ds4 dialect for {arch}: {ds4.UNSUPPORTED[arch]}", field="dialect")
    if arch not in ds4.ARCHS:
        raise UnsupportedError(f"no ds4 dialect for architecture {arch!r}; ds4 tables exist for "
                               f"{', '.join(sorted({*ds4.ARCHS, *ds4.RELAID}))}", field="dialect")
    return ds4.ARCHS[arch]


def _arch_of(metadata: Mapping[str, KV]) -> str:
    kv = metadata.get("general.architecture")
    if kv is None or not isinstance(kv.value, str):
        raise FormatError("no general.architecture key: cannot tell the model's architecture",
                          field="general.architecture")
    return kv.value


def dialect_of(metadata: Mapping[str, KV]) -> str:
    """``ds4`` when the metadata carries keys only ds4's dialect writes, else ``llama.cpp``."""
    arch = _arch_of(metadata)
    ds4 = _tables()
    if any(t.ds4_arch == arch for t in ds4.RELAID.values()):
        return DS4
    table = ds4.ARCHS.get(arch)
    if table is not None and any(table.k(m) in metadata for m in table.markers):
        return DS4
    return LLAMA_CPP


def ds4_key_types(metadata: Mapping[str, KV]) -> dict[str, Any]:
    """The types ds4's dialect gives its model keys (under the file's architecture name), for a file in that
    dialect; empty otherwise.  (ds4 writes some with other widths than llama.cpp: ``context_length`` as U64.)"""
    if dialect_of(metadata) != DS4:
        return {}
    arch = _arch_of(metadata)
    ds4 = _tables()
    table = next((t for t in (*ds4.ARCHS.values(), *ds4.RELAID.values()) if (t.ds4_arch or t.gguf_arch) == arch),
                 None)
    return {} if table is None else {table.kd(row.ds4): row.ds4_type for row in table.keys}


def relaid_dialect(arch: str, dialect: str) -> ArchDialect | None:
    """The table of an architecture ``dialect`` lays out differently (built from the checkpoint's rows), else None."""
    return _tables().RELAID.get(arch) if dialect == DS4 else None


# -- names --------------------------------------------------------------------------------------------------------

def _match(table: ArchDialect, name: str, side: str, linear_layers: Iterable[int] | None):
    linear = None if linear_layers is None else set(linear_layers)
    for index, row in enumerate(table.tensors):
        m = table.pattern(getattr(row, side)).fullmatch(name)
        if m is None:
            continue
        layer = int(m.group("L")) if "L" in m.groupdict() else None
        if (row.linear_only or row.attention_only) and side == "llama_cpp":
            if linear is None:
                raise FormatError("names a different ds4 tensor in linear-attention and attention blocks: the "
                                  "layer types are needed", tensor=name)
            if (layer in linear) != row.linear_only:
                continue
        return index, row, layer
    return None


def _rename(template: str, layer: int | None) -> str:
    return template.replace("{L}", str(layer)) if layer is not None else template


def to_llamacpp_name(name: str, arch: str) -> str:
    """The llama.cpp name of a ds4-dialect tensor name (names of other architectures come back unchanged)."""
    table = _tables().ARCHS.get(arch)
    if table is None:
        return name
    found = _match(table, name, "ds4", None)
    if found is None:
        raise FormatError(f"no llama.cpp name for this ds4 tensor of {arch}", tensor=name)
    return _rename(found[1].llama_cpp, found[2])


def to_dialect_name(name: str, arch: str, dialect: str, linear_layers: Iterable[int] | None = None) -> str:
    """A llama.cpp tensor name in ``dialect`` (``linear_layers``: the linear-attention blocks, for GLM)."""
    table = arch_dialect(arch, dialect)
    if table is None:
        return name
    found = _match(table, name, "llama_cpp", linear_layers)
    if found is None:
        raise FormatError(f"no {dialect} name for this tensor of {arch}", tensor=name)
    return _rename(found[1].ds4, found[2])


# -- metadata -----------------------------------------------------------------------------------------------------

def _scalar(kv: KV) -> Any:
    return kv.value.item() if isinstance(kv.value, np.generic) else kv.value


def _values(kv: KV) -> list:
    return [v.item() if isinstance(v, np.generic) else v for v in np.asarray(kv.value).tolist()] \
        if isinstance(kv.value, np.ndarray) else list(kv.value)


def _linear_layers(metadata: Mapping[str, KV], table: ArchDialect, frm: str) -> set[int] | None:
    key = table.k("{arch}.attention.head_count_kv" if frm == LLAMA_CPP else "{arch}.layer_types")
    kv = metadata.get(key)
    if kv is None or not isinstance(kv.type, ArrayOf):
        return None
    return {i for i, v in enumerate(_values(kv)) if v == 0}


def _need(metadata: Mapping[str, KV], key: str, wanted_for: str) -> KV:
    kv = metadata.get(key)
    if kv is None:
        raise FormatError(f"metadata key {key!r} is missing: it gives {wanted_for}", field=key)
    return kv


def _cast(value: Any, vtype: Any) -> KV:
    if isinstance(vtype, ArrayOf):
        kind = float if vtype.item in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else int
        return KV([kind(v) for v in value], vtype)
    if vtype is GGUFValueType.BOOL:
        return KV(bool(value), vtype)
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return KV(float(value), vtype)
    if vtype is GGUFValueType.STRING:
        return KV(value, vtype)
    return KV(int(value), vtype)


def _to_ds4_keys(md: Mapping[str, KV], table: ArchDialect) -> dict[str, KV]:
    out: dict[str, KV] = {}
    for key in table.llamacpp_refused:
        kv = md.get(table.k(key))
        if kv is not None and not all(_values(kv)):
            raise FormatError(f"{table.k(key)} marks layers that share another layer's indexer; ds4's "
                              f"{table.gguf_arch} dialect has no such key (every sparse-attention layer owns its "
                              f"indexer)", field=table.k(key))
    if table.passthrough_arch_keys:
        out.update((k, v) for k, v in md.items() if k.startswith(table.gguf_arch + "."))
    for row in table.keys:
        key, src = table.kd(row.ds4), table.k(row.llama_cpp) if row.llama_cpp else None
        if row.derive == "constant":
            out[key] = _cast(row.value, row.ds4_type)
        elif row.derive == "recurrent_to_layer_types":   # llama.cpp: true = recurrent; ds4: 0 linear, 1 attention
            out[key] = _cast([0 if v else 1 for v in _values(_need(md, src, key))], row.ds4_type)
        elif row.derive == "nonzero_constant":   # a per-block array, 0 on the blocks it does not apply to
            values = {v for v in _values(_need(md, src, key)) if v}
            if len(values) != 1:
                raise FormatError(f"{src} holds {sorted(values) or 'no'} non-zero values; ds4's {key} is one value",
                                  field=src)
            out[key] = _cast(values.pop(), row.ds4_type)
        elif row.derive == "only_element":
            values = _values(_need(md, src, key))
            if len(values) != 1:
                raise FormatError(f"{src} lists {len(values)} values; ds4's {key} is one", field=src)
            out[key] = _cast(values[0], row.ds4_type)
        elif row.derive == "present":   # 1 where the llama.cpp key is there and non-zero
            out[key] = _cast(1 if src in md and _scalar(md[src]) else 0, row.ds4_type)
        elif row.derive == "copy":
            out[key] = _cast(_scalar(_need(md, src, key)), row.ds4_type) if not isinstance(row.ds4_type, ArrayOf) \
                else _cast(_values(_need(md, src, key)), row.ds4_type)
        elif row.derive == "zero_if_absent":
            out[key] = _cast(_scalar(md[src]) if src in md else 0, row.ds4_type)
        elif row.derive == "trunk_blocks":
            nextn = md.get(table.k("{arch}.nextn_predict_layers"))
            blocks = _scalar(_need(md, table.k("{arch}.block_count"), key))
            out[key] = _cast(blocks - (_scalar(nextn) if nextn is not None else 0), row.ds4_type)
        elif row.derive == "linear_heads":
            out[key] = _cast(_scalar(_need(md, table.k("{arch}.attention.head_count"), key)), row.ds4_type)
        elif row.derive == "per_block_constant":
            values = _values(_need(md, src, key))
            if not values or any(v != values[0] for v in values):
                raise FormatError(f"{src} differs between blocks; ds4's {key} is one value for all",
                                  field=src)
            out[key] = _cast(values[0], row.ds4_type)
        elif row.derive == "vocab_from_tokens":
            if key in md:
                out[key] = _cast(_scalar(md[key]), row.ds4_type)
            else:
                tokens = _need(md, "tokenizer.ggml.tokens", key)
                out[key] = _cast(len(tokens.value), row.ds4_type)
        else:
            raise QuantkitError(f"ds4 table row {row.ds4!r}: unknown derive rule {row.derive!r}")
    return out


def _to_llamacpp_keys(md: Mapping[str, KV], table: ArchDialect) -> dict[str, KV]:
    out: dict[str, KV] = {}
    if table.passthrough_arch_keys:
        derived = {table.k(r.ds4) for r in table.keys if r.llama_cpp is None}
        out.update((k, v) for k, v in md.items() if k.startswith(table.gguf_arch + ".") and k not in derived)
    blocks = md.get(table.k("{arch}.block_count"))
    for row in table.keys:
        key = table.k(row.ds4)
        if row.llama_cpp is None or key not in md:
            continue
        dst = table.k(row.llama_cpp)
        kv = md[key]
        if row.derive == "per_block_constant":
            n = _scalar(_need(md, table.k("{arch}.block_count"), dst))
            out[dst] = _cast([_scalar(kv)] * n, row.llama_cpp_type)
        elif row.derive == "zero_if_absent":
            if _scalar(kv):
                out[dst] = _cast(_scalar(kv), row.llama_cpp_type)
        elif isinstance(row.llama_cpp_type, ArrayOf):
            out[dst] = _cast(_values(kv), row.llama_cpp_type)
        else:
            out[dst] = _cast(_scalar(kv), row.llama_cpp_type)
    for key in table.llamacpp_derived:   # llama.cpp's pairs that ds4 folds into one key (swiglu shexp = exp)
        base = table.k(key).replace("_shexp", "_exp")
        if base in out:
            out[table.k(key)] = out[base]
    for key, vtype, value in table.llamacpp_constants:
        out.setdefault(table.k(key), _cast(value, vtype))
    del blocks
    return out


def _assemble(md: Mapping[str, KV], mapped: Mapping[str, KV], table: ArchDialect, to: str) -> dict[str, KV]:
    """Non-model keys keep their places; the model's keys, translated, go where the first of them was."""
    prefix = table.gguf_arch + "."
    stash = STASH_PREFIX + _SLUG[to] + "."
    out: dict[str, KV] = {}
    placed = False
    for key, kv in md.items():
        if key.startswith(STASH_PREFIX):
            continue
        if key.startswith(prefix):
            if not placed:
                out.update(mapped)
                placed = True
            continue
        out[key] = kv
    if not placed:
        out.update(mapped)
    for key, kv in md.items():   # a stash for the target dialect: what the tables alone would lose
        if key.startswith(stash + "kv."):
            out[key[len(stash) + 3:]] = kv
    order = md.get(stash + "keys")
    if order is not None:
        missing = [k for k in order.value if k not in out]
        if missing:
            raise FormatError(f"the stored {to} key order names keys that cannot be rebuilt: {missing[:4]}",
                              field=stash + "keys")
        # a key the tables derived that the order does not list was not in the original: dropped; a key carried
        # over unchanged that it does not list was added after the translation (convert's provenance): kept last
        listed = set(order.value)
        out = {**{k: out[k] for k in order.value},
               **{k: v for k, v in out.items() if k not in listed and k not in mapped}}
    return out


def _same_kv(a: KV, b: KV) -> bool:
    if a.type != b.type:
        return False
    if isinstance(a.type, ArrayOf):
        return _values(a) == _values(b)
    return _scalar(a) == _scalar(b)


def _base(md: Mapping[str, KV]) -> dict[str, KV]:
    return {k: v for k, v in md.items() if not k.startswith(STASH_PREFIX)}


# -- tensors ------------------------------------------------------------------------------------------------------

def _conv_shape(shape: tuple[int, ...], to: str, name: str) -> tuple[int, ...]:
    if to == DS4 and len(shape) == 4 and shape[0] == 1 and shape[2] == 1:
        return (shape[1], 1, shape[3])
    if to == LLAMA_CPP and len(shape) == 3 and shape[1] == 1:
        return (1, shape[0], 1, shape[2])
    raise FormatError(f"short convolution of shape {list(shape)} does not have the {_other(to)} layout", tensor=name)


def _other(dialect: str) -> str:
    return DS4 if dialect == LLAMA_CPP else LLAMA_CPP


def _translate_tensors(tensors: Sequence[tuple[str, tuple[int, ...], Any]], md: Mapping[str, KV],
                       table: ArchDialect, to: str) -> list[TensorMove]:
    frm = _other(to)
    side_in, side_out = ("llama_cpp", "ds4") if to == DS4 else ("ds4", "llama_cpp")
    linear = _linear_layers(md, table, frm)
    moves, keys = [], []
    first_block = next(i for i, r in enumerate(table.tensors) if "{L}" in r.ds4)
    for position, (name, shape, qtype) in enumerate(tensors):
        found = None if is_native(table, name) else _match(table, name, side_in, linear)
        if found is None:
            raise FormatError(f"no {to} name in the {table.gguf_arch} table (a tensor the {to} dialect does not "
                              f"know): nothing written" + (f"; {table.native_note}" if table.native_note else ""),
                              tensor=name)
        index, row, layer = found
        shape = tuple(shape)
        if row.layout == LAYOUT_CONV:
            shape = _conv_shape(shape, to, name)
        moves.append(TensorMove(name, _rename(getattr(row, side_out), layer), shape, qtype, row.layout))
        section = 1 if layer is not None else (0 if index < first_block else 2)
        keys.append((section, layer if layer is not None else -1, index) if to == DS4 and not table.keep_order
                    else position)
    order = md.get(STASH_PREFIX + _SLUG[to] + ".tensors")
    if order is not None:
        by_name = {m.name: m for m in moves}
        if sorted(by_name) != sorted(order.value):
            raise FormatError(f"the stored {to} tensor order does not list this file's tensors",
                              field=STASH_PREFIX + _SLUG[to] + ".tensors")
        return [by_name[n] for n in order.value]
    return [m for _, m in sorted(zip(keys, moves), key=lambda p: p[0])]


def is_native(table: ArchDialect | None, name: str) -> bool:
    """Whether ``name`` is one of ``table``'s :attr:`~ArchDialect.native` tensors."""
    return table is not None and any(table.pattern(t).fullmatch(name) for t in table.native)


# -- relaid architectures (converted from the checkpoint only) ------------------------------------------------------

def relaid_tensors(table: ArchDialect, names: Sequence[str]) -> list[tuple[str, str, RelaidRow]]:
    """The ds4 tensors of a relaid architecture built from llama.cpp-dialect tensors ``names``: ``(ds4 name,
    llama.cpp name, row)`` in ds4's order (head, then block by block in row order, then tail).  A llama.cpp
    tensor the table does not name is refused, naming it."""
    by_llama: dict[str, list[tuple[int, RelaidRow]]] = {}
    for index, row in enumerate(table.relaid):
        by_llama.setdefault(row.llama_cpp, []).append((index, row))
    first_block = next(i for i, r in enumerate(table.relaid) if "{L}" in r.ds4)
    out = []
    for name in names:
        found = [(i, r, m) for template, rows in by_llama.items()
                 if (m := table.pattern(template).fullmatch(name)) for i, r in rows]
        if not found:
            raise FormatError(f"no ds4 tensor of {table.ds4_arch or table.gguf_arch} is built from this "
                              f"{table.gguf_arch} tensor: nothing written", tensor=name)
        for index, row, m in found:
            layer = int(m.group("L")) if "L" in m.groupdict() else None
            section = 1 if layer is not None else (0 if index < first_block else 2)
            out.append(((section, -1 if layer is None else layer, index), _rename(row.ds4, layer), name, row))
    return [(ds4, llama, row) for _, ds4, llama, row in sorted(out, key=lambda e: e[0])]


def relaid_mappings(mappings: Sequence[Any], table: ArchDialect) -> list[Any]:
    """Architecture-map mappings (:class:`~quantkit.arch.base.TensorMapping`, llama.cpp's GGUF names) redirected to
    the ds4 tensors of a relaid architecture that hold their values: each ds4 tensor the table builds from the
    mapping's llama.cpp tensor, through the row's own transform steps (the reader's inverse runs on those).  A
    mapping no ds4 tensor holds is refused, naming it."""
    from dataclasses import replace

    out = []
    for m in mappings:
        rows = [(row, found) for row in table.relaid if (found := table.pattern(row.llama_cpp).fullmatch(m.gguf_name))]
        if not rows:
            raise FormatError(f"no {table.ds4_arch} tensor holds the values of {m.gguf_name}", tensor=m.hf_name)
        for row, found in rows:
            layer = int(found.group("L")) if "L" in found.groupdict() else None
            out.append(replace(m, gguf_name=_rename(row.ds4, layer),
                               transform=m.transform if row.steps is None else row.steps))
    return out


def relaid_metadata(metadata: Mapping[str, KV] | Iterable[tuple[str, KV]], table: ArchDialect) -> list[tuple[str, KV]]:
    """ds4's keys for a relaid architecture from llama.cpp-dialect ``metadata``: the model's keys replaced, in place,
    by the table's (under ds4's architecture name); every other key kept where it is."""
    md = dict(metadata)
    mapped = _to_ds4_keys(md, table)
    out = {}
    placed = False
    for key, kv in md.items():
        if key.startswith(table.gguf_arch + "."):
            if not placed:
                out.update(mapped)
                placed = True
            continue
        out[key] = KV(table.ds4_arch, GGUFValueType.STRING) if key == "general.architecture" else kv
    if not placed:
        out.update(mapped)
    return list(out.items())


# -- translation --------------------------------------------------------------------------------------------------

def _translate_once(md: Mapping[str, KV], tensors, table: ArchDialect, to: str) -> Translation:
    mapped = _to_ds4_keys(md, table) if to == DS4 else _to_llamacpp_keys(md, table)
    out = _assemble(md, mapped, table, to)
    moves = _translate_tensors(tensors, md, table, to)
    return Translation(list(out.items()), moves)


def translate(metadata: Mapping[str, KV] | Iterable[tuple[str, KV]],
              tensors: Sequence[tuple[str, tuple[int, ...], Any]], *, to: str) -> Translation:
    """Names, keys and order of a GGUF (``metadata``, ``tensors`` as ``(name, numpy shape, type)`` in file order)
    in dialect ``to``.  Refuses (FormatError naming it) a tensor or key with no mapping, and input already in
    ``to``.  What the tables alone would not bring back is stashed (see the module docstring)."""
    md = dict(metadata)
    arch = _arch_of(md)
    if to not in DIALECTS:
        raise UnsupportedError(f"unknown GGUF dialect {to!r}; known: {', '.join(DIALECTS)}", field="dialect")
    frm = dialect_of(md)
    table = arch_dialect(arch, DS4)
    if frm == to:
        raise FormatError(f"the file is already in the {to} dialect", field="general.architecture")
    result = _translate_once(md, tensors, table, to)
    # translate back; whatever does not come back is stashed in the output under the source dialect's prefix
    out = dict(result.metadata)
    back = _translate_once(out, [(m.name, m.shape, m.type) for m in result.moves], table, frm)
    want, got = _base(md), dict(back.metadata)
    stash = STASH_PREFIX + _SLUG[frm] + "."
    for key, kv in want.items():
        if key not in got or not _same_kv(got[key], kv):
            out[stash + "kv." + key] = kv
    if list(got) != list(want):
        out[stash + "keys"] = KV(list(want), ArrayOf(GGUFValueType.STRING))
    if [m.name for m in back.moves] != [t[0] for t in tensors]:
        out[stash + "tensors"] = KV([t[0] for t in tensors], ArrayOf(GGUFValueType.STRING))
    final = Translation(list(out.items()), result.moves)
    check = _translate_once(out, [(m.name, m.shape, m.type) for m in final.moves], table, frm)
    checked = dict(check.metadata)
    if list(checked) != list(want) or any(not _same_kv(checked[k], want[k]) for k in want) \
            or [m.name for m in check.moves] != [t[0] for t in tensors]:
        raise QuantkitError(f"the {to} translation of this {arch} file does not translate back to it (a bug in "
                            f"the dialect tables)")
    return final


# -- payloads -----------------------------------------------------------------------------------------------------

def _neg_exp(a: np.ndarray) -> np.ndarray:
    from ..transforms import get_step
    return get_step("neg_exp").apply(a, {})


def convert_payload(move: TensorMove, raw: bytes | memoryview | np.ndarray, to: str) -> bytes:
    """The payload of ``move`` in dialect ``to``: the input bytes, except ``LAYOUT_A_LOG``: ds4's F32 ``A_log`` to
    llama.cpp's ``-exp(A_log)``, as ``convert`` computes it (the ``neg_exp`` step).  The other way is refused: below
    1 in magnitude several float32 ``A_log`` share one ``-exp(A_log)``, so ds4's ``A_log`` comes from the source
    checkpoint (:func:`quantkit.convert.redialect.source_payloads`)."""
    data = bytes(raw if not isinstance(raw, np.ndarray) else raw.tobytes())
    if move.layout != LAYOUT_A_LOG:
        return data
    from ...formats.registry import GGMLType
    if GGMLType(move.type) is not GGMLType.F32:
        raise FormatError(f"A_log tensors are F32 in both dialects, found {GGMLType(move.type).name}",
                          tensor=move.source)
    if to != LLAMA_CPP:
        raise FormatError("-exp(A_log) does not determine A_log (several float32 A_log share each value): ds4's "
                          "A_log comes from the source checkpoint", tensor=move.source)
    return _neg_exp(np.frombuffer(data, "<f4")).astype("<f4").tobytes()


__all__ = ["DIALECTS", "DS4", "LAYOUT_A_LOG", "LAYOUT_CONV", "LAYOUT_SAME", "LLAMA_CPP", "ArchDialect", "KeyRow",
           "RelaidRow", "TensorMove", "TensorRow", "Translation", "arch_dialect", "convert_payload", "dialect_of",
           "is_native",
           "relaid_dialect", "relaid_metadata", "relaid_tensors", "to_dialect_name", "to_llamacpp_name", "translate"]
