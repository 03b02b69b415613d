"""How fast ``convert --device cuda``'s reader gets a checkpoint's bytes into memory, warm and cold, against plain
reads of the same files measured in the same run.

    python bench/source_read.py DIR [--rounds 4] [--threads 4] [--cold]

For each round and each ``*.safetensors`` file of DIR (largest first, a different file per method and round so
that cold reads stay cold), one method copies the whole file into one reused buffer:

* ``stream fill``: the GPU stream's own :func:`quantkit.convert.gpu_stream._fill` (the file memory-mapped, copied in
  ``FILL_SLICE_BYTES`` slices by ``--threads`` threads: page faults and copies outside the GIL);
* ``pread fill``: the same slices and threads, each slice read with ``os.preadv`` into its place;
* ``pread 1 thread``: one sequential stream of ``preadv`` calls, the baseline a disk's sequential speed gives.

Warm: the file read once just before.  ``--cold``: the page cache dropped before each copy (``echo 1 >
/proc/sys/vm/drop_caches``: needs root; refused otherwise).  Prints one JSON object per copy and per method's
median (GB/s), and the ratios to ``stream fill``.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from quantkit.convert import gpu_stream  # noqa: E402


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def stream_fill(path: Path, dst: np.ndarray, pool) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        src = np.frombuffer(m, np.uint8)
        gpu_stream._fill(dst, [SimpleNamespace(rows=src)])
        del src
    return path.stat().st_size


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise EOFError(f"short read at {offset + done}")
        done += got


def pread_fill(path: Path, dst: np.ndarray, pool) -> int:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        step = gpu_stream.FILL_SLICE_BYTES
        slices = [pool.submit(pread_into, fd, memoryview(dst[s:min(size, s + step)]), s) for s in range(0, size, step)]
        for done in slices:
            done.result()
    finally:
        os.close(fd)
    return size


def pread_sequential(path: Path, dst: np.ndarray, pool) -> int:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        step = gpu_stream.FILL_SLICE_BYTES
        for s in range(0, size, step):
            pread_into(fd, memoryview(dst[s:min(size, s + step)]), s)
    finally:
        os.close(fd)
    return size


METHODS = {"stream fill": stream_fill, "pread fill": pread_fill, "pread 1 thread": pread_sequential}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a checkpoint directory (its *.safetensors files are read)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=gpu_stream.FILL_THREADS)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each copy (root)")
    args = parser.parse_args()
    files = sorted(args.source.glob("*.safetensors"), key=lambda p: -p.stat().st_size)
    if not files:
        raise SystemExit(f"{args.source}: no *.safetensors files")
    if args.cold and len(files) < args.rounds * len(METHODS):
        print(f"note: {len(files)} files for {args.rounds * len(METHODS)} cold copies: some files are read twice "
              f"(each after its cache was dropped)", file=sys.stderr)
    gpu_stream.FILL_THREADS = args.threads
    dst = np.empty(files[0].stat().st_size, np.uint8)
    speeds: dict[str, list[float]] = {m: [] for m in METHODS}
    at = 0
    with ThreadPoolExecutor(args.threads) as pool:
        for r in range(args.rounds):
            order = list(METHODS) if r % 2 == 0 else list(METHODS)[::-1]
            for name in order:
                path = files[at % len(files)] if args.cold else files[0]
                at += 1
                if args.cold:
                    drop_page_cache()
                else:
                    METHODS[name](path, dst, pool)   # warm: this very copy, just before
                start = time.perf_counter()
                size = METHODS[name](path, dst, pool)
                speed = size / (time.perf_counter() - start) / 1e9
                speeds[name].append(speed)
                emit({"name": f"source read {name}", "cache": "cold" if args.cold else "warm", "file": path.name,
                      "bytes": size, "threads": args.threads, "gb_per_s": round(speed, 3)})
    base = statistics.median(speeds["stream fill"])
    for name, values in speeds.items():
        median = statistics.median(values)
        emit({"name": f"source read {name} median", "cache": "cold" if args.cold else "warm",
              "gb_per_s": round(median, 3), "vs_stream_fill": round(median / base, 3), "rounds": args.rounds})


if __name__ == "__main__":
    main()
