"""Transport throughput: ``quantkit transport split`` and ``assemble`` against ``cp`` of the same bytes, same run.

    cd bench && PYTHONPATH=.. python transport.py [--size 1GiB] [--part-size 256MB] [--repeats 5] [--gguf] [--cold]

Writes a seeded random file of ``--size`` (with ``--gguf``: a GGUF of F32 tensors of 64 MiB each, split into llama.cpp
shards) into a temporary directory under $TMPDIR, then times, interleaved A/B after a warm-up round, medians of
``--repeats``:

* ``cp+sync``: ``cp SRC DST && sync DST`` (``sync FILE`` fsyncs that file): **the reference of the bar** (issue 14:
  throughput >= 80% of a same-run ``cp`` of the same bytes).  quantkit's outputs are durable before they get their
  names (every part and the assembled file is fsynced before its rename), so the like-for-like ``cp`` is one whose
  copy is durable too; ``cp``: ``cp SRC DST`` alone, for context only: on a warm cache it measures a copy into the
  page cache, which the disk has not seen when it returns;
* ``sha256``: hashing the source once in this process (``hashlib``, OpenSSL; no copy): the floor of any copy that
  hashes every byte it copies (coreutils ``sha256sum`` is far slower here: it does not use the CPU's SHA extensions);
* ``split``: the library's :func:`quantkit.transport.split.split_file` (parts, per-part and whole SHA-256, manifest);
* ``assemble``: :func:`quantkit.transport.assemble.assemble` of those parts (size checks, per-part SHA-256 while
  copying, journal, rename).

MB/s are 10^6 bytes per second of file bytes; ``CPU s`` is the median user + system CPU time of a run (all
threads, and ``cp``/``sync`` as children; not the kernel's writeback threads): on a shared machine the wall time of a
run that needs more CPU than it gets is its CPU time over its share.  The load average is recorded before and after
(on a shared machine the figures are only comparable within one run).  ``--cold`` evicts the files from the page
cache (``posix_fadvise DONTNEED``) before each run; without it every run reads from the cache.  One JSON object per
measurement, then a table.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import emit, evict

SEED = 20261202


def make_file(path: Path, size: int, gguf: bool) -> None:
    rng = np.random.default_rng(SEED)
    if not gguf:
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, 64 << 20)
                f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
                left -= n
        return
    from quantkit.io.gguf_writer import GGUFWriter, TensorSpec, plan_layout

    count = max(1, size // (64 << 20))
    layout = plan_layout({"general.architecture": "llama", "general.name": "transport-bench"},
                         [TensorSpec(f"blk.{i}.ffn_down.weight", (4096, 4096), "F32") for i in range(count)])
    with GGUFWriter(path, layout) as w:
        w.write_header()
        for name in layout.tensors:
            w.write_tensor(name, rng.integers(0, 256, 64 << 20, dtype=np.uint8))
        w.finish()


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) and its waited-for children (``cp``, ``sync``).
    The kernel's writeback threads are not counted, for any run."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    from quantkit.io.atomic import sha256_file
    from quantkit.transport.assemble import assemble
    from quantkit.transport.sizes import parse_size
    from quantkit.transport.split import split_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--part-size", default="256MB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gguf", action="store_true")
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="quantkit-transport-bench-"))
    try:
        src = work / ("model.gguf" if args.gguf else "model.bin")
        make_file(src, parse_size(args.size), args.gguf)
        size = src.stat().st_size
        part_size = parse_size(args.part_size)
        parts_dir, copy, out = work / "parts", work / "copy.bin", work / "assembled.bin"
        manifest = split_file(src, parts_dir, part_size, gguf=args.gguf).path

        def inputs(name):
            return [src] if name != "assemble" else [manifest.parent / p for p in os.listdir(manifest.parent)]

        runs = {
            "cp": lambda: subprocess.run(["cp", str(src), str(copy)], check=True),
            "cp+sync": lambda: subprocess.run(f"cp {src} {copy} && sync {copy}", shell=True, check=True),
            "sha256": lambda: sha256_file(src),
            "split": lambda: split_file(src, parts_dir, part_size, gguf=args.gguf, force=True),
            "assemble": lambda: assemble(manifest, out, force=True),
        }
        cleanup = {"cp": lambda: copy.unlink(missing_ok=True), "cp+sync": lambda: copy.unlink(missing_ok=True),
                   "sha256": lambda: None,
                   # every writer starts on fresh space: replacing last round's parts would add freeing 1 GiB of
                   # old blocks to split's time, which cp's unlinked copy does not pay
                   "split": lambda: shutil.rmtree(parts_dir), "assemble": lambda: out.unlink(missing_ok=True)}
        times = {k: [] for k in runs}
        cpu = {k: [] for k in runs}
        load_before = os.getloadavg()
        for round_no in range(args.repeats + 1):   # round 0 is the warm-up
            for name, fn in runs.items():
                cleanup[name]()
                if args.cold:
                    evict(inputs(name))
                c0, t0 = cpu_seconds(), time.perf_counter()
                fn()
                if round_no:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(cpu_seconds() - c0)
        cleanup["cp"]()
        load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
        medians = {k: statistics.median(v) for k, v in times.items()}
        rate = {k: size / v / 1e6 for k, v in medians.items()}
        for name in ("split", "assemble"):
            for ref in ("cp", "cp+sync"):
                emit({"name": f"transport {name} vs {ref}", "kind": "gguf-split" if args.gguf else "bytes",
                      "bytes": size, "part_size": part_size, "cold": args.cold, "quantkit_MBps": round(rate[name], 1),
                      "reference_MBps": round(rate[ref], 1), "ratio": round(rate[name] / rate[ref], 3),
                      "repeats": args.repeats, "load_average": load,
                      "all_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
                      "cpu_s": {k: [round(t, 3) for t in v] for k, v in cpu.items()}})
        print(f"\n{size:,} bytes, parts of {part_size:,}, {'cold' if args.cold else 'warm'} cache, medians of "
              f"{args.repeats}; load average (1, 5, 15 min) {load['before']} before, {load['after']} after")
        print(f"{'run':<10} {'median s':>9} {'MB/s':>8} {'vs cp':>7} {'vs cp+sync':>11} {'CPU s':>6}")
        for name in runs:
            print(f"{name:<10} {medians[name]:>9.3f} {rate[name]:>8.1f} {rate[name] / rate['cp']:>7.2f} "
                  f"{rate[name] / rate['cp+sync']:>11.2f} {statistics.median(cpu[name]):>6.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
