"""JSON read from files a user hands quantkit: one parser whose every failure is a ``ValueError``.

``json.loads`` raises ``RecursionError`` on input nested a few thousand levels deep (``[[[[…``); through
:func:`loads` it is a ``ValueError`` as any other malformed JSON, so each reader's one-line error names its file.
"""
from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes, **kwargs: Any) -> Any:
    """``json.loads(data, **kwargs)``; JSON nested too deeply for the parser raises ``ValueError``."""
    try:
        return json.loads(data, **kwargs)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
