"""``convert``'s planning at a large model's tensor count: the fixed cost before its first tensor (opening every
shard's header, the architecture's rules on every name, the recipe, the imatrix check, the jobs).

    python bench/plan.py [--layers 61] [--experts 256] [--rounds 4] [--workdir /tmp] [--compare TREE ...]

Writes the qwen3_moe checkpoint of bench/convert.py with ``--experts`` routed experts a layer (61 x 256: ~47k
tensors, as many as a 284B-class checkpoint's BF16 weights) as headers only: each shard's data region is a hole
(``ftruncate``), so the checkpoint takes no disk and planning, which reads headers alone, sees a full-size model.
Then times ``prepare`` (quantkit.convert.execute: what ``convert --dry-run`` does after its imports) with the iq2
recipe and a synthetic imatrix: each round, a process per tree (this one, then each ``--compare`` checkout, a
directory holding quantkit/) plans once to warm up and once timed.  Best and median seconds, and each tree's median
as a ratio to this tree's.  Planning is single-threaded Python: the ratio is what carries over to other machines.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402
from convert import shard_name, shard_tensors, write_config  # noqa: E402

from quantkit.io.safetensors import safetensors_header  # noqa: E402
from quantkit.testing.recipe_texts import Q2_FALLBACK_RECIPE  # noqa: E402
from quantkit.testing.synthetic_imatrix import write_synthetic_imatrix  # noqa: E402

CHECKOUT = Path(__file__).resolve().parent.parent
TIMER = """
import json, sys, time
from pathlib import Path
from quantkit.convert.execute import ConvertRequest, prepare
ckpt, recipe, imatrix, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
request = ConvertRequest(source=ckpt, out=Path(ckpt).parent / "out.gguf", recipe=recipe, imatrix=imatrix,
                         allow_synthetic_imatrix=True, pre_tokenizer="qwen2", jobs=1)
seconds = []
for _ in range(rounds + 1):
    start = time.perf_counter()
    prepared = prepare(request)
    seconds.append(time.perf_counter() - start)
print(json.dumps({"seconds": seconds[1:], "jobs": len(prepared.jobs)}))
"""


def header_only_checkpoint(root: Path, layers: int, experts: int) -> int:
    """The checkpoint's shards as headers and holes; its tensor count."""
    write_config(root, layers, experts)
    weight_map = {}
    for shard in range(layers + 1):
        empty = np.zeros(1, ml_dtypes.bfloat16)
        tensors = {name: np.lib.stride_tricks.as_strided(empty, shape, (0,) * len(shape))
                   for name, shape, _ in shard_tensors(shard, layers, experts)}
        header, _ = safetensors_header(tensors, {"format": "pt"})
        data = sum(2 * int(np.prod(t.shape)) for t in tensors.values())
        filename = shard_name(shard, layers + 1)
        with open(root / filename, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.truncate(8 + len(header) + data)
        weight_map.update(dict.fromkeys(tensors, filename))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return len(weight_map)


def time_tree(tree: Path, ckpt: Path, recipe: Path, imatrix: Path, rounds: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", TIMER, str(ckpt), str(recipe), str(imatrix), str(rounds)],
                          capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"planning in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="another checkout (a directory holding quantkit/), timed in turn with this one")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="quantkit-bench-plan-", dir=args.workdir))
    try:
        ckpt = root / "ckpt"
        ckpt.mkdir()
        tensors = header_only_checkpoint(ckpt, args.layers, args.experts)
        imatrix = root / "im.gguf"
        write_synthetic_imatrix(ckpt, imatrix, seed=0, dataset="synthetic:bench")
        recipe = root / "iq2.toml"
        recipe.write_text(Q2_FALLBACK_RECIPE)
        trees = [CHECKOUT, *(t.resolve() for t in args.compare)]
        seconds: dict[Path, list[float]] = {t: [] for t in trees}
        for _ in range(args.rounds):   # one timing process per tree per round, in turn: these machines drift
            for tree in trees:
                found = time_tree(tree, ckpt, recipe, imatrix, 1)
                seconds[tree] += found["seconds"]
        mine = statistics.median(seconds[CHECKOUT])
        for tree in trees:
            emit({"name": "convert planning (prepare)", "tree": str(tree), "layers": args.layers,
                  "experts": args.experts, "tensors": tensors, "jobs": found["jobs"],
                  "best_s": min(seconds[tree]), "median_s": statistics.median(seconds[tree]),
                  "all_s": [round(s, 3) for s in seconds[tree]],
                  "median_vs_this_tree": statistics.median(seconds[tree]) / mine})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
