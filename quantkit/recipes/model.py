"""The recipe model: TOML text -> validated, immutable :class:`Recipe` (the format is the package docstring).

Validation runs in layers, each error naming the file, the key and (when the table header is found in the text)
the line: TOML syntax -> exact key sets per table -> value types -> known classes, types, architectures, regexes,
layer ranges -> cross-field checks (fallbacks that can never be used, rules on skipped classes, repeated
selectors).
"""
from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from ..arch import ARCHITECTURES, CLASS_GROUPS, SUPPORT_KINDS, TENSOR_CLASSES
from ..arch.dialects import DIALECTS
from ..errors import RecipeError, UnsupportedError
from ..formats.registry import GGMLType, all_formats, get_format

#: ``type = "source"``: keep the source encoding where GGUF holds it losslessly.
SOURCE = "source"
TOP_KEYS = ("name", "architectures", "description", "dialect", "support", "skip", "defaults", "rule")
REQUIRED_TOP_KEYS = ("name", "architectures")
DEFAULTS_KEYS = ("type", "fallback")
RULE_KEYS = ("class", "layers", "name", "type", "fallback", "tag")
REQUIRED_RULE_KEYS = ("class", "type")
#: Classes whose tensors are integer tables: always I32, so no rule may name them.
INTEGER_CLASSES = frozenset({"hash_routing"})
#: Characters allowed in recipe names and tags (they end up in file names).
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.+-]+")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")

Layers = tuple[tuple[int, int], ...]


# -- locating keys in the text (tomllib keeps no positions) --------------------------------------------------------

_HEADER = re.compile(r"^\s*(\[\[|\[)\s*([^\]]+?)\s*\]\]?")


class _Locator:
    """Line numbers of table headers and keys, found by scanning the lines of the recipe text."""

    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.headers: list[tuple[int, str, bool]] = []   # (0-based line, table name, is array of tables)
        for i, line in enumerate(self.lines):
            m = _HEADER.match(line)
            if m:
                self.headers.append((i, m.group(2).strip().strip("\"'"), m.group(1) == "[["))

    def _span(self, table: str | None, index: int | None) -> tuple[int, int] | None:
        if table is None:
            return 0, self.headers[0][0] if self.headers else len(self.lines)
        found = [k for k, (_, name, is_array) in enumerate(self.headers)
                 if name == table and is_array == (index is not None)]
        position = 0 if index is None else index - 1
        if position >= len(found):
            return None
        k = found[position]
        end = self.headers[k + 1][0] if k + 1 < len(self.headers) else len(self.lines)
        return self.headers[k][0], end

    def line(self, table: str | None = None, index: int | None = None, key: str | None = None) -> int | None:
        """1-based line of ``key`` in the table (or of the table header when the key is not found)."""
        span = self._span(table, index)
        if span is None:  # not written as a table header: maybe a top-level key of that name
            return self.line(None, None, table) if table is not None else None
        start, end = span
        if key is not None:
            pattern = re.compile(rf"^\s*(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')\s*=")
            for i in range(start, end):
                if pattern.match(self.lines[i]):
                    return i + 1
        return start + 1 if table is not None else None


@dataclass
class _Context:
    path: Path | None
    locator: _Locator

    def fail(self, message: str, *, field: str, table: str | None = None, index: int | None = None,
             key: str | None = None) -> RecipeError:
        line = self.locator.line(table, index, key)
        return RecipeError(f"line {line}: {message}" if line else message,
                           path=self.path if self.path is not None else "<recipe>", field=field)


# -- the model ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """One ``[[rule]]``: which tensors it selects and the type it gives them."""

    index: int
    """1-based position among the recipe's rules."""
    class_name: str
    """The class or class group as written."""
    classes: frozenset[str]
    qtype: GGMLType | None
    """The type; None for ``type = "source"``."""
    fallback: GGMLType | None = None
    layers: Layers | None = None
    name: str | None = None
    tag: str | None = None
    line: int | None = None
    pattern: re.Pattern | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"rule {self.index}" + (f" (line {self.line})" if self.line else "")

    @property
    def is_group(self) -> bool:
        return self.class_name in CLASS_GROUPS

    @property
    def specificity(self) -> tuple[bool, bool, bool]:
        """Compared lexicographically: has a name regex, has a layer range, names a single class."""
        return self.name is not None, self.layers is not None, not self.is_group

    @property
    def type_name(self) -> str:
        return SOURCE if self.qtype is None else self.qtype.name

    @property
    def selector(self) -> tuple[str, Layers | None, str | None]:
        return self.class_name, self.layers, self.name

    def selects(self, tensor_class: str, layer: int | None, gguf_name: str) -> bool:
        if tensor_class not in self.classes:
            return False
        if self.layers is not None and (layer is None or not any(lo <= layer <= hi for lo, hi in self.layers)):
            return False
        return self.pattern is None or self.pattern.fullmatch(gguf_name) is not None

    def describe(self) -> str:
        parts = [f"class={self.class_name!r}"]
        if self.layers is not None:
            parts.append(f"layers={layers_text(self.layers)!r}")
        if self.name is not None:
            parts.append(f"name={self.name!r}")
        parts.append(f"type={self.type_name!r}")
        if self.fallback is not None:
            parts.append(f"fallback={self.fallback.name!r}")
        return f"{self.label} [{', '.join(parts)}]"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "line": self.line, "class": self.class_name,
                               "type": self.type_name}
        for key, value in (("layers", self.layers and layers_text(self.layers)), ("name", self.name),
                           ("fallback", self.fallback and self.fallback.name), ("tag", self.tag)):
            if value is not None:
                out[key] = value
        return out


@dataclass(frozen=True)
class Defaults:
    """``[defaults]``: the type of tensors no rule claims (None: such tensors are errors)."""

    qtype: GGMLType | None = None
    fallback: GGMLType | None = None
    keep_source: bool = False
    """``type = "source"``."""
    line: int | None = None

    @property
    def given(self) -> bool:
        return self.qtype is not None or self.keep_source

    @property
    def label(self) -> str:
        return "[defaults] type" + (f" (line {self.line})" if self.line else "")

    @property
    def type_name(self) -> str | None:
        return SOURCE if self.keep_source else (self.qtype.name if self.qtype is not None else None)


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe; build it with :func:`parse_recipe` or :func:`quantkit.recipes.load_recipe`."""

    name: str
    architectures: tuple[str, ...]
    rules: tuple[Rule, ...]
    defaults: Defaults
    skip: tuple[str, ...] = ()
    """Classes and groups as written."""
    description: str = ""
    path: Path | None = None
    text: str = field(default="", repr=False)
    dialect: str | None = None
    """The GGUF dialect convert writes when none is asked for (:mod:`quantkit.arch.dialects`); None: llama.cpp."""
    support: str | None = None
    """The support (drafter) file the recipe is for (``convert --support``, implied by it); None: a model."""

    @property
    def skipped_classes(self) -> frozenset[str]:
        return frozenset().union(*(expand_class(c) for c in self.skip)) if self.skip else frozenset()

    @property
    def sha256(self) -> str:
        return text_sha256(self.text)

    @property
    def name_tag(self) -> str:
        from .tags import name_tag

        return name_tag(self)

    def where(self) -> str:
        return str(self.path) if self.path is not None else f"recipe {self.name!r}"

    def check_architecture(self, model_type: str) -> None:
        if model_type not in self.architectures:
            raise RecipeError(f"recipe {self.name!r} is for {', '.join(self.architectures)}; the source is "
                              f"model_type {model_type!r}", path=self.where(), field="architectures")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path) if self.path else None, "sha256": self.sha256,
                "architectures": list(self.architectures), "description": self.description,
                "dialect": self.dialect, "support": self.support, "skip": list(self.skip),
                "defaults": {"type": self.defaults.type_name,
                             "fallback": self.defaults.fallback and self.defaults.fallback.name},
                "rules": [r.to_dict() for r in self.rules], "name_tag": self.name_tag, "text": self.text}


def text_sha256(text: str) -> str:
    """A recipe's SHA-256: of its text's UTF-8 bytes (a text read back from a file with invalid UTF-8 holds them as
    lone surrogates, which hash as those bytes)."""
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def expand_class(name: str) -> frozenset[str]:
    """A class or group name -> the classes it covers."""
    return CLASS_GROUPS[name] if name in CLASS_GROUPS else frozenset({name})


def layers_text(layers: Layers) -> str:
    """``((37, 42),)`` -> ``"37-42"``; several ranges are joined by ``+``."""
    return "+".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in layers)


# -- parsing -----------------------------------------------------------------------------------------------------

def parse_recipe(text: str, path: str | Path | None = None) -> Recipe:
    """Parse and validate recipe ``text`` (``path`` is only used in messages and recorded)."""
    path = Path(path) if path is not None else None
    ctx = _Context(path, _Locator(text))
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"not valid TOML: {exc}", path=path if path is not None else "<recipe>") from None
    _check_keys(ctx, data, TOP_KEYS, REQUIRED_TOP_KEYS, where="the recipe", field_prefix="")

    name = _string(ctx, data["name"], field="name", key="name")
    if not _NAME_CHARS.fullmatch(name):
        raise ctx.fail(f"name {name!r} may only hold letters, digits and _ . + -", field="name", key="name")
    architectures = _architectures(ctx, data["architectures"])
    description = _string(ctx, data.get("description", ""), field="description", key="description",
                          allow_empty=True)
    dialect = _choice(ctx, data["dialect"], DIALECTS, "dialect", "GGUF dialect") if "dialect" in data else None
    support = _choice(ctx, data["support"], SUPPORT_KINDS, "support", "support file kind") \
        if "support" in data else None
    skip = _skip(ctx, data.get("skip", []))
    defaults = _defaults(ctx, data.get("defaults", {}))
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise ctx.fail(f"expected [[rule]] tables, found {type(raw_rules).__name__}", field="rule", key="rule")
    rules = tuple(_rule(ctx, raw, i) for i, raw in enumerate(raw_rules, start=1))
    _cross_checks(ctx, rules, skip)
    return Recipe(name, architectures, rules, defaults, skip, description, path, text, dialect, support)


def _check_keys(ctx: _Context, table: Any, allowed: tuple[str, ...], required: tuple[str, ...], *, where: str,
                field_prefix: str, table_name: str | None = None, index: int | None = None) -> None:
    if not isinstance(table, Mapping):
        raise ctx.fail(f"{where} must be a table, found {type(table).__name__}",
                       field=field_prefix.rstrip(".") or "recipe",
                       table=table_name, index=index)
    for key in table:
        if key not in allowed:
            raise ctx.fail(f"unknown key {key!r} in {where}; allowed: {', '.join(allowed)}",
                           field=f"{field_prefix}{key}", table=table_name, index=index, key=key)
    for key in required:
        if key not in table:
            raise ctx.fail(f"{where} is missing the required key {key!r}", field=f"{field_prefix}{key}",
                           table=table_name, index=index)


def _string(ctx: _Context, value: Any, *, field: str, key: str, table: str | None = None, index: int | None = None,
            allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ctx.fail(f"expected a string, found {value!r}", field=field, table=table, index=index, key=key)
    if not value and not allow_empty:
        raise ctx.fail("expected a non-empty string", field=field, table=table, index=index, key=key)
    return value


def _string_list(ctx: _Context, value: Any, *, field: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ctx.fail(f"expected a list of strings, found {value!r}", field=field, key=key)
    if len(set(value)) != len(value):
        raise ctx.fail(f"a name is listed twice in {value!r}", field=field, key=key)
    return value


def _architectures(ctx: _Context, value: Any) -> tuple[str, ...]:
    names = _string_list(ctx, value, field="architectures", key="architectures")
    if not names:
        raise ctx.fail("expected at least one model_type", field="architectures", key="architectures")
    for name in names:
        if name not in ARCHITECTURES:
            raise ctx.fail(f"unknown architecture {name!r}; known: {', '.join(sorted(ARCHITECTURES))}",
                           field="architectures", key="architectures")
    return tuple(names)


def _choice(ctx: _Context, value: Any, known, key: str, what: str) -> str:
    name = _string(ctx, value, field=key, key=key)
    if name not in known:
        raise ctx.fail(f"unknown {what} {name!r}; known: {', '.join(known)}", field=key, key=key)
    return name


def _class_name(ctx: _Context, value: Any, *, field: str, key: str, table: str | None = None,
                index: int | None = None) -> str:
    name = _string(ctx, value, field=field, key=key, table=table, index=index)
    if name not in TENSOR_CLASSES and name not in CLASS_GROUPS:
        raise ctx.fail(f"unknown tensor class {name!r}; classes: {', '.join(TENSOR_CLASSES)}; groups: "
                       f"{', '.join(CLASS_GROUPS)}", field=field, table=table, index=index, key=key)
    return name


def _skip(ctx: _Context, value: Any) -> tuple[str, ...]:
    names = _string_list(ctx, value, field="skip", key="skip")
    return tuple(_class_name(ctx, n, field="skip", key="skip") for n in names)


def _encodable() -> str:
    return ", ".join(t.name for t, f in all_formats().items() if f.can_encode)


def _qtype(ctx: _Context, value: Any, *, field: str, key: str, table: str, index: int | None,
           allow_source: bool) -> GGMLType | None:
    name = _string(ctx, value, field=field, key=key, table=table, index=index)
    if name == SOURCE:
        if allow_source:
            return None
        raise ctx.fail(f"{SOURCE!r} is not allowed here", field=field, table=table, index=index, key=key)
    try:
        fmt = get_format(name)
    except UnsupportedError:
        raise ctx.fail(f"unknown GGML type {name!r}; types quantkit writes: {_encodable()}"
                       + (f", or {SOURCE!r}" if allow_source else ""),
                       field=field, table=table, index=index, key=key) from None
    if not fmt.can_encode:
        raise ctx.fail(f"quantkit cannot write GGML type {fmt.name}; types it writes: {_encodable()}",
                       field=field, table=table, index=index, key=key)
    return fmt.qtype


def _fallback(ctx: _Context, table_data: Mapping, qtype: GGMLType | None, *, field_prefix: str, table: str,
              index: int | None) -> GGMLType | None:
    if "fallback" not in table_data:
        return None
    field_name = f"{field_prefix}fallback"
    fb = _qtype(ctx, table_data["fallback"], field=field_name, key="fallback", table=table, index=index,
                allow_source=False)
    if qtype is None:
        return fb
    block, fb_block = get_format(qtype).block_size, get_format(fb).block_size
    if fb == qtype:
        raise ctx.fail(f"the fallback is the type itself ({fb.name})", field=field_name, table=table, index=index,
                       key="fallback")
    if block == 1 or fb_block % block == 0:
        raise ctx.fail(f"fallback {fb.name} (block {fb_block}) is never used: every row it takes, {qtype.name} "
                       f"(block {block}) takes too", field=field_name, table=table, index=index, key="fallback")
    return fb


def _defaults(ctx: _Context, value: Any) -> Defaults:
    _check_keys(ctx, value, DEFAULTS_KEYS, (), where="[defaults]", field_prefix="defaults.", table_name="defaults")
    line = ctx.locator.line("defaults", None, "type")
    if "type" not in value:
        if "fallback" in value:
            raise ctx.fail("a fallback without a default type", field="defaults.fallback", table="defaults",
                           key="fallback")
        return Defaults()
    qtype = _qtype(ctx, value["type"], field="defaults.type", key="type", table="defaults", index=None,
                   allow_source=True)
    fb = _fallback(ctx, value, qtype, field_prefix="defaults.", table="defaults", index=None)
    return Defaults(qtype, fb, keep_source=qtype is None, line=line)


def _layers(ctx: _Context, value: Any, *, field: str, index: int) -> Layers:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ctx.fail("an empty layer list selects nothing", field=field, table="rule", index=index, key="layers")
    ranges = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            lo = hi = item
        elif isinstance(item, str) and (m := _RANGE.fullmatch(item.strip())):
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
        else:
            raise ctx.fail(f"expected a layer index, \"A-B\" or a list of those, found {item!r}", field=field,
                           table="rule", index=index, key="layers")
        if lo < 0 or hi < lo:
            raise ctx.fail(f"layer range {item!r} is empty or negative", field=field, table="rule", index=index,
                           key="layers")
        ranges.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _rule(ctx: _Context, raw: Any, index: int) -> Rule:
    prefix = f"rule[{index}]."
    where = f"[[rule]] {index}"
    _check_keys(ctx, raw, RULE_KEYS, REQUIRED_RULE_KEYS, where=where, field_prefix=prefix, table_name="rule",
                index=index)
    class_name = _class_name(ctx, raw["class"], field=prefix + "class", key="class", table="rule", index=index)
    if class_name in INTEGER_CLASSES:
        raise ctx.fail(f"{class_name} tensors are integer tables, always written as I32; no rule may change them",
                       field=prefix + "class", table="rule", index=index, key="class")
    qtype = _qtype(ctx, raw["type"], field=prefix + "type", key="type", table="rule", index=index, allow_source=True)
    fallback = _fallback(ctx, raw, qtype, field_prefix=prefix, table="rule", index=index)
    layers = _layers(ctx, raw["layers"], field=prefix + "layers", index=index) if "layers" in raw else None
    name = pattern = None
    if "name" in raw:
        name = _string(ctx, raw["name"], field=prefix + "name", key="name", table="rule", index=index)
        try:
            pattern = re.compile(name)
        except re.error as exc:
            raise ctx.fail(f"name regex {name!r} does not compile: {exc}", field=prefix + "name", table="rule",
                           index=index, key="name") from None
    tag = None
    if "tag" in raw:
        tag = _string(ctx, raw["tag"], field=prefix + "tag", key="tag", table="rule", index=index, allow_empty=True)
        if tag and not _NAME_CHARS.fullmatch(tag):
            raise ctx.fail(f"tag {tag!r} may only hold letters, digits and _ . + -", field=prefix + "tag",
                           table="rule", index=index, key="tag")
        from ..names import tag_problem   # here: quantkit.names reads the recipes' labels

        if tag and (problem := tag_problem(tag, class_name)):
            raise ctx.fail(problem, field=prefix + "tag", table="rule", index=index, key="tag")
    return Rule(index, class_name, expand_class(class_name), qtype, fallback, layers, name, tag,
                ctx.locator.line("rule", index), pattern)


def _cross_checks(ctx: _Context, rules: tuple[Rule, ...], skip: tuple[str, ...]) -> None:
    skipped = frozenset().union(*(expand_class(c) for c in skip)) if skip else frozenset()
    seen: dict[tuple, Rule] = {}
    for r in rules:
        if r.classes <= skipped:
            raise ctx.fail(f"{r.label} targets class {r.class_name!r}, which the recipe skips",
                           field=f"rule[{r.index}].class", table="rule", index=r.index, key="class")
        if r.selector in seen:
            raise ctx.fail(f"{r.label} selects exactly what {seen[r.selector].label} selects (class, layers and "
                           f"name); merge them", field=f"rule[{r.index}]", table="rule", index=r.index)
        seen[r.selector] = r
