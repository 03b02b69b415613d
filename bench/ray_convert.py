"""``quantkit convert --executor ray`` against the process pool on a large synthetic checkpoint: wall ratio.

    python bench/ray_convert.py [--gib 8] [--jobs 2] [--recipe q4_k_m-control] [--workdir /tmp]

Generates the seeded BF16 qwen3_moe checkpoint of ``bench/convert.py`` (at least ``--gib`` GiB), then converts it
three times with the same recipe and ``--jobs``, one after the other: the process pool (the reference), Ray on a
local cluster of ``--jobs`` CPUs started and stopped by quantkit with tasks writing into the partial output
(``--ray-transfer write``), and the same returning each payload's bytes to the driver (``--ray-transfer return``).
Before them the encoders the plan needs are compiled into numba's disk cache (so no run pays compiling).  Every
output's SHA-256 must equal the pool's.  The wall time is the whole command (interpreter start, planning,
the cluster's start and stop, hashing the source, encoding, finishing).  Everything is deleted afterwards.

Prints one JSON object per measurement (``_common.emit``), then a short table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import QUANTKIT, emit
from convert import GIB, layers_for, synthetic_checkpoint

RUNS = {"process pool": ["--executor", "process"],
        "ray, tasks write": ["--executor", "ray", "--ray-transfer", "write"],
        "ray, tasks return bytes": ["--executor", "ray", "--ray-transfer", "return"]}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def run(ckpt: Path, out: Path, report: Path, recipe: str, jobs: int, extra: list[str]) -> float:
    command = [*QUANTKIT, "convert", str(ckpt), "-o", str(out),
               "--recipe", recipe, "--pre-tokenizer", "qwen2", "-j", str(jobs), "--no-progress", "--report",
               str(report), "--force", *extra]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"convert {' '.join(extra)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return wall


def warm(ckpt: Path, recipe: str) -> None:
    """Compile (or load) every encoder the plan needs into numba's disk cache, in this process."""
    from quantkit.convert.execute import ConvertRequest, prepare
    from quantkit.formats.warm import encoder_kinds, warm_encoders

    prepared = prepare(ConvertRequest(source=str(ckpt), out=ckpt.parent / "unused.gguf", recipe=recipe,
                                      pre_tokenizer="qwen2", progress=False))
    warm_encoders(encoder_kinds(prepared.jobs.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="checkpoint size at least this many GiB")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--recipe", default="q4_k_m-control")
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()

    layers = layers_for(args.gib, args.workdir, 1.5, 2 * GIB)

    root = Path(tempfile.mkdtemp(prefix="quantkit-bench-ray-", dir=args.workdir))
    records = []
    try:
        ckpt, source_bytes = synthetic_checkpoint(root, layers, "ray convert")
        warm(ckpt, args.recipe)
        reference = None
        for name, extra in RUNS.items():
            out, report_path = root / "out.gguf", root / "report.json"
            wall = run(ckpt, out, report_path, args.recipe, args.jobs, extra)
            report = json.loads(report_path.read_text())
            digest = sha256(out)
            reference = reference or {"wall": wall, "sha256": digest}
            records.append({"name": f"convert wall, {name}", "quantkit_s": wall, "reference_s": reference["wall"],
                            "ratio": wall / reference["wall"], "reference": "process pool, same jobs",
                            "identical_to_pool": digest == reference["sha256"], "sha256": digest,
                            "executor_wall_s": report["wall_seconds"], "phases_s": report["phases"],
                            "tensor_seconds": report["tensor_seconds"], "tensors": report["tensors"],
                            "jobs": args.jobs, "recipe": args.recipe, "output_bytes": report["file_size"],
                            "source_bytes": source_bytes})
            emit(records[-1])
            out.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'run':<36}{'wall':>10}{'vs pool':>9}  identical")
    for r in records:
        print(f"{r['name']:<36}{r['quantkit_s']:>9.1f}s{r['ratio']:>9.3f}  {r['identical_to_pool']}")
    if not all(r["identical_to_pool"] for r in records):
        raise SystemExit("a Ray output differs from the process pool's")


if __name__ == "__main__":
    main()
