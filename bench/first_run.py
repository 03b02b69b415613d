"""First-run time: ``quantkit demo`` with an empty numba cache (a fresh machine), then again with the cache warm.

    python bench/first_run.py [--tree DIR] [-- demo options]

Each run is a child process (``python -m quantkit.cli demo``) with ``NUMBA_CACHE_DIR`` set to a new empty
directory for the cold run and kept for the warm run; ``--tree`` puts another checkout first on ``PYTHONPATH``
(to measure a baseline side by side).  Reported per run: wall seconds and the child's CPU seconds (user + sys:
on a shared machine the wall time depends on the load, the CPU time much less).  Prints one JSON object per run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from _common import emit, run_timed

ROOT = Path(__file__).resolve().parent.parent


def run_demo(tree: Path, cache_dir: str, extra: list[str]) -> tuple[float, float]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=str(tree))
    # run inside the tree: ``-m`` puts the working directory first on the path, ahead of PYTHONPATH
    proc, measured = run_timed([sys.executable, "-m", "quantkit.cli", "demo", *extra], env, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"quantkit demo failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return measured["wall_s"], measured["cpu_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=ROOT, help="checkout to run (default: this one)")
    ap.add_argument("demo_args", nargs="*", help="options passed to `quantkit demo` (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="quantkit-numba-cache-") as cache:
        for label in ("cold (empty numba cache)", "warm (cache from the cold run)"):
            wall, cpu = run_demo(args.tree.resolve(), cache, args.demo_args)
            emit({"name": f"quantkit demo, {label}", "tree": str(args.tree), "wall_s": round(wall, 1),
                  "cpu_s": round(cpu, 1), "load_avg_1m": round(os.getloadavg()[0], 1)})


if __name__ == "__main__":
    main()
