"""A quantkit artifact as another writer would leave it, for tests of files quantkit did not write."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ..io.gguf import KV
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import GGUFWriter, plan_layout


def without_quantkit_keys(src: Path, out: Path, edit: Callable[[dict[str, KV]], None] | None = None) -> Path:
    """``src`` rewritten to ``out`` without any ``quantkit.*`` key (and the reader's ``GGUF.*`` entries);
    ``edit(metadata)`` may change the keys in place first."""
    with GGUFFile(src) as f:
        meta = {k: v for k, v in f.metadata.items() if not k.startswith(("quantkit.", "GGUF."))}
        if edit is not None:
            edit(meta)
        with GGUFWriter(out, plan_layout(list(meta.items()), list(f.tensors.values()))) as writer:
            writer.write_header()
            for name in f.tensors:
                writer.write_tensor(name, np.ascontiguousarray(f.data(name)))
            writer.finish()
    return out
