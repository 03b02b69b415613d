"""Byte sizes as people write them: ``3MB``, ``49GB``, ``1.5GiB``, ``512M``, ``1000000``.

Units follow their SI/IEC meaning, the way llama.cpp's ``gguf-split --split-max-size``, Hugging Face and disk
vendors count: ``k``/``kB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` are powers of **1000**; ``KiB``, ``MiB``,
``GiB``, ``TiB`` are powers of **1024**; a bare number (or ``B``) is bytes.  Units are case-insensitive except
that the ``i`` marks the binary ones.  A fraction is allowed and rounded down to whole bytes; the result must be
at least one byte.
"""
from __future__ import annotations

import re

from ..errors import FormatError

_DECIMAL = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
            "t": 10**12, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
UNITS = {**_DECIMAL, **_BINARY}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``text`` (see the module docstring for the units)."""
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise FormatError(f"size {text!r} is not a number with an optional unit (B, kB, MB, GB, TB = powers of 1000; "
                        f"KiB, MiB, GiB, TiB = powers of 1024), e.g. 49GB or 1.5GiB")
    number = match.group(1)
    whole, _, fraction = number.partition(".")
    scale = UNITS[unit]
    size = int(whole) * scale + (int(fraction) * scale) // 10 ** len(fraction) if fraction else int(whole) * scale
    if size < 1:
        raise FormatError(f"size {text!r} is less than one byte")
    return size


def format_size(n: int) -> str:
    """``n`` bytes for people: exact bytes plus a binary-unit figure."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.2f} {unit})"
    return f"{n:,} bytes"
