"""What is inside a GGUF file or a safetensors checkpoint: a JSON-serializable report, and its text rendering.

:func:`describe` builds the report (everything, nothing summarized: ``quantkit inspect --json`` prints it);
:func:`render` turns it into text for people, summarizing long metadata arrays and long tensor tables.

Report keys: ``path``, ``format`` (``"gguf"`` or ``"safetensors"``), ``metadata`` (list of ``{key, type,
value}``), ``tensors`` (list of ``{name, type, shape, n_elements, nbytes}`` plus ``offset`` — the absolute file
offset of the payload — for GGUF and ``file`` for safetensors) and ``totals`` (``tensors``, ``bytes``, a count
and bits per count, overall and ``by_type``).  For GGUF the count is ``weights`` (ggml shapes are logical);
for safetensors it is ``elements`` (stored elements: packed formats hold several weights per element).
GGUF reports add ``version``, ``alignment``, ``data_offset``, ``file_size`` and ``ggml_layout`` ("contiguous"
or where payload placement departs from what ggml's loader accepts); safetensors reports add ``quantization``,
``files`` and ``config``.  A file or checkpoint holding row tables (DeepSeek V4.1 Engram tables, n-gram PLE
tables) adds ``row_tables``: each table (name, kind, layer, type, rows, bytes), their bytes apart from the
resident weights' bytes (engines keep them on disk and read rows), and for a GGUF the Engram hash spec summary.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from .io.checkpoint import open_checkpoint
from .io.gguf import KV, ArrayOf, type_name
from .io.gguf_reader import GGUFFile

#: Tables longer than this are summarized (head and tail) unless ``show_all``.
MAX_TABLE_ROWS = 40
TABLE_HEAD_ROWS = 30
TABLE_TAIL_ROWS = 5
#: Metadata arrays show this many items; strings are cut at this many characters.
ARRAY_ITEMS_SHOWN = 3
SHORT_ARRAY_ITEMS = 8
STRING_CHARS_SHOWN = 60
ITEM_CHARS_SHOWN = 24

_SHORT_TYPE = {"UINT8": "u8", "INT8": "i8", "UINT16": "u16", "INT16": "i16", "UINT32": "u32", "INT32": "i32",
               "UINT64": "u64", "INT64": "i64", "FLOAT32": "f32", "FLOAT64": "f64", "BOOL": "bool",
               "STRING": "str", "ARRAY": "array"}


def describe(path: str | os.PathLike) -> dict:
    """Report on a GGUF file, a ``.safetensors`` file or a checkpoint directory (see the module docstring)."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".safetensors":
        return _describe_checkpoint(path)
    return _describe_gguf(path)


def _json_value(kv: KV) -> Any:
    if isinstance(kv.type, ArrayOf) and kv.type.item is GGUFValueType.ARRAY:
        return [{"type": type_name(inner.type), "value": _json_value(inner)} for inner in kv.value]
    return kv.value.tolist() if isinstance(kv.value, np.ndarray) else kv.value


def _row_tables(tensors: list[dict], names: dict[str, tuple[str, int | None]], spec) -> dict | None:
    """The ``row_tables`` section: disk-only tables (name -> (kind, layer)) apart from the resident weights."""
    found = [dict(t, kind=names[t["name"]][0], layer=names[t["name"]][1], rows=t["shape"][0] if len(t["shape"]) > 1
                  else 1) for t in tensors if t["name"] in names]
    if not found:
        return None
    tables = [{k: t[k] for k in ("name", "kind", "layer", "type", "rows", "nbytes")} for t in found]
    table_bytes = sum(t["nbytes"] for t in tables)
    hash_spec = None if spec is None else {
        "layer_ids": list(spec.layer_ids), "rows": list(spec.rows), "max_ngram_size": spec.max_ngram_size,
        "heads": spec.n_heads, "key_length": spec.head_dim, "buckets": int(spec.primes.size),
        "compressed_vocab_size": spec.compressed_vocab_size, "pad_id": spec.pad_id,
        "token_map_size": int(spec.token_map.size)}
    return {"tables": tables, "bytes": table_bytes, "resident_bytes": sum(t["nbytes"] for t in tensors) - table_bytes,
            "hash_spec": hash_spec}


def _gguf_row_tables(f: GGUFFile, tensors: list[dict]) -> dict | None:
    from .engram import EngramSpec
    from .errors import ValidationError

    arch = f.metadata.get("general.architecture")
    spec = None
    if arch is not None and isinstance(arch.value, str):
        try:
            spec = EngramSpec.from_gguf({k: kv.value for k, kv in f.metadata.items()}, arch.value)
        except ValidationError:
            spec = None
    names = {t["name"]: ("engram", int(t["name"].split(".")[1])) for t in tensors
             if t["name"].startswith("blk.") and t["name"].endswith(".engram_embd.weight")}
    names.update({n: ("ngram", None) for n in (t["name"] for t in tensors) if n == "per_layer_token_embd.weight"})
    return _row_tables(tensors, names, spec)


def _checkpoint_row_tables(ck, tensors: list[dict]) -> dict | None:
    layers = (ck.config.get("text_config") or ck.config).get("engram_layer_ids") or []
    names = {}
    for layer in layers if isinstance(layers, list) else []:
        for suffix in ("weight", "scale"):
            names[f"layers.{layer}.engram.embed.{suffix}"] = ("engram", layer)
    names.update({t["name"]: ("ngram", None) for t in tensors if ".ngram_embedding." in t["name"]})
    return _row_tables(tensors, names, None)


def _describe_gguf(path: Path) -> dict:
    with GGUFFile(path) as f:
        tensors = [{"name": t.name, "type": t.type.name, "shape": list(t.shape), "n_elements": t.n_elements,
                    "nbytes": t.nbytes, "offset": f.data_offset + t.offset} for t in f.tensors.values()]
        report = {
            "path": str(path), "format": "gguf", "version": f.version, "file_size": f.file_size,
            "alignment": f.alignment, "data_offset": f.data_offset,
            "ggml_layout": f.ggml_layout_problem() or "contiguous",
            "metadata": [{"key": k, "type": type_name(kv.type), "value": _json_value(kv)}
                         for k, kv in f.metadata.items()],
            "tensors": tensors,
            "totals": _totals(tensors, "weights"),
        }
        tables = _gguf_row_tables(f, tensors)
        return report if tables is None else {**report, "row_tables": tables}


def _describe_checkpoint(path: Path) -> dict:
    with open_checkpoint(path) as ck:
        tensors = [{"name": t.name, "type": t.dtype, "shape": list(t.shape), "n_elements": math.prod(t.shape),
                    "nbytes": t.nbytes, "file": t.file.name} for t in ck.tensor_infos()]
        report = {
            "path": str(path), "format": "safetensors", "quantization": ck.quantization,
            "files": sorted({t["file"] for t in tensors}),
            "config": ck.config,
            "metadata": [{"key": k, "type": "STRING", "value": v} for k, v in ck.metadata.items()],
            "tensors": tensors,
            "totals": _totals(tensors, "elements"),
        }
        tables = _checkpoint_row_tables(ck, tensors)
        return report if tables is None else {**report, "row_tables": tables}


def _totals(tensors: list[dict], count: str) -> dict:
    by_type: dict[str, dict] = {}
    for t in tensors:
        row = by_type.setdefault(t["type"], {"type": t["type"], "tensors": 0, "bytes": 0, count: 0})
        row["tensors"] += 1
        row["bytes"] += t["nbytes"]
        row[count] += t["n_elements"]
    rows = sorted(by_type.values(), key=lambda r: (-r["bytes"], r["type"]))
    overall = {"tensors": len(tensors), "bytes": sum(r["bytes"] for r in rows), count: sum(r[count] for r in rows)}
    for row in (*rows, overall):
        row[f"bits_per_{count[:-1]}"] = 8 * row["bytes"] / row[count] if row[count] else None
    return {**overall, "by_type": rows}


# -- text ---------------------------------------------------------------------------------------------------

def render(report: dict, show_all: bool = False) -> str:
    """The report as text; long tables are cut to their head and tail unless ``show_all``."""
    lines = [_title(report), ""]
    lines.append(f"metadata ({_count(len(report['metadata']), 'key')}):")
    lines += _table([[_printable(m["key"]), m["type"], _summary(m["value"], m["type"])]
                     for m in report["metadata"]], None, "lll", show_all=True)
    located = "offset" if report["format"] == "gguf" else "file"
    lines += ["", f"tensors ({_count(len(report['tensors']), 'tensor')}):"]
    lines += _table([[_printable(t["name"]), t["type"], _shape(t["shape"]), f"{t['nbytes']:,}",
                      _located(t[located])] for t in report["tensors"]], ["name", "type", "shape", "bytes", located],
                    "lllr" + ("r" if located == "offset" else "l"), show_all=show_all)
    count = "weights" if "weights" in report["totals"] else "elements"
    bits = f"bits_per_{count[:-1]}"
    totals = [*report["totals"]["by_type"], {"type": "total", **report["totals"]}]
    lines += ["", "totals:"]
    lines += _table([[r["type"], f"{r['tensors']:,}", f"{r['bytes']:,}", f"{r[count]:,}",
                      "-" if r[bits] is None else f"{r[bits]:.4f}"] for r in totals],
                    ["type", "tensors", "bytes", count, f"bits/{count[:-1]}"], "lrrrr", show_all=True)
    if "row_tables" in report:
        rt = report["row_tables"]
        lines += ["", f"disk-only row tables ({_count(len(rt['tables']), 'tensor')}, {rt['bytes']:,} bytes, read by "
                      f"row; resident weights {rt['resident_bytes']:,} bytes):"]
        lines += _table([[_printable(t["name"]), t["kind"], t["type"], f"{t['rows']:,}", f"{t['nbytes']:,}"]
                         for t in rt["tables"]], ["name", "kind", "type", "rows", "bytes"], "lllrr", show_all=True)
        spec = rt["hash_spec"]
        if spec is not None:
            lines.append(f"hash spec: layers {spec['layer_ids']}, rows {[f'{r:,}' for r in spec['rows']]}, n-grams "
                         f"2..{spec['max_ngram_size']} x {spec['heads']} heads ({spec['buckets']} prime buckets), key "
                         f"length {spec['key_length']}, compressed vocabulary {spec['compressed_vocab_size']:,} "
                         f"(token map of {spec['token_map_size']:,}), pad id {spec['pad_id']}")
    return "\n".join(lines)


def _title(report: dict) -> str:
    if report["format"] == "gguf":
        layout = "" if report["ggml_layout"] == "contiguous" else f"; not loadable by ggml: {report['ggml_layout']}"
        return (f"{report['path']}: GGUF v{report['version']}, {report['file_size']:,} bytes, alignment "
                f"{report['alignment']}, data at {report['data_offset']:,}{layout}")
    config = report["config"]
    arch = config.get("model_type") or ", ".join(config.get("architectures") or []) or "no model_type"
    return (f"{report['path']}: safetensors checkpoint ({arch}), {_count(len(report['files']), 'file')}, "
            f"quantization {report['quantization']}")


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _located(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else _printable(value)


def _printable(text: str) -> str:
    """Names as they are, or quoted with escapes when they hold control characters (one row stays one line)."""
    return text if text.isprintable() else repr(text)


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _summary(value: Any, vtype: str, limit: int = STRING_CHARS_SHOWN) -> str:
    """One metadata value on one line: ``[151,936 × str] 'a', 'b', …`` for long arrays."""
    if vtype == "FLOAT32":
        # The shortest digits that read back as the stored float32, printed the way Python prints floats.
        return repr(float(str(np.float32(value))))
    if not vtype.startswith("ARRAY["):
        return _cut(repr(value), limit)
    item = vtype[len("ARRAY["):-1]
    if item == "ARRAY":
        shown = [_summary(v["value"], v["type"], ITEM_CHARS_SHOWN) for v in value[:ARRAY_ITEMS_SHOWN]]
    else:
        n = len(value) if len(value) <= SHORT_ARRAY_ITEMS else ARRAY_ITEMS_SHOWN
        shown = [_summary(v, item, ITEM_CHARS_SHOWN) for v in value[:n]]
    more = ", …" if len(value) > len(shown) else ""
    return f"[{len(value):,} × {_SHORT_TYPE.get(item, item)}] " + ", ".join(shown) + more


def _table(rows: list[list[str]], header: list[str] | None, align: str, *, show_all: bool) -> list[str]:
    """Rows as aligned columns (``align``: one ``l`` or ``r`` per column); long tables keep head and tail."""
    hidden = 0
    if not show_all and len(rows) > MAX_TABLE_ROWS:
        hidden = len(rows) - TABLE_HEAD_ROWS - TABLE_TAIL_ROWS
        rows = rows[:TABLE_HEAD_ROWS] + [None] + rows[-TABLE_TAIL_ROWS:]
    shown = [r for r in ([header] if header else []) + rows if r is not None]
    if not shown:
        return ["  (none)"]
    widths = [max(len(r[i]) for r in shown) for i in range(len(align))]

    def line(r: list[str]) -> str:
        cells = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align)]
        return ("  " + "  ".join(cells)).rstrip()

    out = [line(header)] if header else []
    for r in rows:
        out.append(f"  … {hidden:,} more (--all lists every one)" if r is None else line(r))
    return out
