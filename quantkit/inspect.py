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
``files`` and ``config``.
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


def _describe_gguf(path: Path) -> dict:
    with GGUFFile(path) as f:
        tensors = [{"name": t.name, "type": t.type.name, "shape": list(t.shape), "n_elements": t.n_elements,
                    "nbytes": t.nbytes, "offset": f.data_offset + t.offset} for t in f.tensors.values()]
        return {
            "path": str(path), "format": "gguf", "version": f.version, "file_size": f.file_size,
            "alignment": f.alignment, "data_offset": f.data_offset,
            "ggml_layout": f.ggml_layout_problem() or "contiguous",
            "metadata": [{"key": k, "type": type_name(kv.type), "value": _json_value(kv)}
                         for k, kv in f.metadata.items()],
            "tensors": tensors,
            "totals": _totals(tensors, "weights"),
        }


def _describe_checkpoint(path: Path) -> dict:
    with open_checkpoint(path) as ck:
        tensors = [{"name": t.name, "type": t.dtype, "shape": list(t.shape), "n_elements": math.prod(t.shape),
                    "nbytes": t.nbytes, "file": t.file.name} for t in ck.tensor_infos()]
        return {
            "path": str(path), "format": "safetensors", "quantization": ck.quantization,
            "files": sorted({t["file"] for t in tensors}),
            "config": ck.config,
            "metadata": [{"key": k, "type": "STRING", "value": v} for k, v in ck.metadata.items()],
            "tensors": tensors,
            "totals": _totals(tensors, "elements"),
        }


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
