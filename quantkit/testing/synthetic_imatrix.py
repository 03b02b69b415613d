"""A seeded synthetic imatrix for a checkpoint, for tests and benches that convert with importance."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_synthetic_imatrix(ckpt: Path, path: Path, *, seed: int, unobserved_first_expert: bool = False,
                            dataset: str = "synthetic:test") -> None:
    """An entry for every 2-D/3-D weight of the blocks but the routers (random sums scaled by random counts),
    marked synthetic; ``unobserved_first_expert``: expert 0 of each 3-D weight has count 0 (bootstrap importance)."""
    from ..arch import get_arch
    from ..convert.plan import source_outputs
    from ..convert.tensors import imatrix_shapes
    from ..imatrix import Entry, make_imatrix, save_imatrix
    from ..io.checkpoint import open_checkpoint

    with open_checkpoint(ckpt) as c:
        outputs = source_outputs(c, get_arch(c.config["model_type"]).bind(c.config))
    rng = np.random.default_rng(seed)
    entries = {}
    for name, (n, mats) in imatrix_shapes(outputs).items():
        if name.startswith("blk.") and "ffn_gate_inp" not in name:
            counts = rng.integers(5, 50, mats).astype(np.float32)
            if unobserved_first_expert and mats > 1:
                counts[0] = 0
            entries[name] = Entry((rng.random((mats, n)) * counts[:, None]).astype(np.float32), counts)
    save_imatrix(make_imatrix(entries, datasets=[dataset], chunk_count=8, chunk_size=512, synthetic=True), path)
