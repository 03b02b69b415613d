"""Where a batch of ``convert --device cuda``'s stream spends its time, each step alone on one GPU host.

    python bench/gpu_stream_probe.py [--workdir /tmp] [--gib 4]

Measures, one JSON object each: torch's import (and whether its bytecode is cached: a fresh process without it
compiles torch's modules); copying a memory-mapped file (page cache warm) into pinned 64 MiB buffers with 1, 2
and 4 threads (``np.copyto`` of the map, as the stream's reader does, and ``os.preadv``); host-to-device copies
from pinned memory; and, on resident BF16 rows of each GPU type's pass size (``chunk_weights_for``), the widening
with the finiteness check, the encode with a row of importance per row, and the download of the bytes.
Results: bench/results/convert-gpu-2026-12-02c.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

BUFFER_BYTES = 64 << 20


def time_import_torch() -> dict:
    start = time.perf_counter()
    import torch

    seconds = time.perf_counter() - start
    cached = (Path(torch.__file__).parent / "__pycache__").is_dir() or bool(os.environ.get("PYTHONPYCACHEPREFIX"))
    return {"name": "import torch", "seconds": seconds, "bytecode_cached": cached,
            "dont_write_bytecode": bool(sys.flags.dont_write_bytecode)}


def probe_file(path: Path, size: int) -> None:
    """A file of ``size`` random bytes at ``path`` (kept between runs), read once into the page cache."""
    if not path.exists() or path.stat().st_size != size:
        block = np.random.default_rng(0).integers(0, 255, BUFFER_BYTES, dtype=np.uint8)
        with open(path, "wb") as f:
            for _ in range(size // BUFFER_BYTES):
                f.write(block)
    with open(path, "rb") as f:
        while f.read(BUFFER_BYTES):
            pass


def fill_rate(path: Path, size: int, buffers: list, threads: int, how: str) -> float:
    """GB/s of copying the whole file into the pinned buffers, ``threads`` threads taking buffer-sized pieces."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")          # a fresh map: its pages fault in, as convert's do
    fd = os.open(path, os.O_RDONLY)
    pieces = iter(range(0, size, BUFFER_BYTES))
    lock = threading.Lock()

    def work(buffer) -> None:
        dst = buffer.numpy()
        while True:
            with lock:
                at = next(pieces, None)
            if at is None:
                return
            if how == "mmap":
                np.copyto(dst, mapped[at:at + BUFFER_BYTES])
            else:
                os.preadv(fd, [dst], at)

    workers = [threading.Thread(target=work, args=(buffers[i],)) for i in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - start
    os.close(fd)
    return size / seconds / 1e9


def batch_steps(device, qtype_name: str, n: int = 2048) -> dict:
    """ms of each device step of one pass of ``qtype_name``'s size (best of 3)."""
    import torch

    from quantkit.formats.registry import GGMLType
    from quantkit.kernels import gpu_encode

    qtype = GGMLType[qtype_name]
    weights = gpu_encode.chunk_weights_for(qtype)
    g = torch.Generator(device=device).manual_seed(0)
    stored = (torch.randn(weights // n, n, generator=g, device=device) * 0.02).to(torch.bfloat16)
    importance = torch.rand(weights // n, n, generator=g, device=device) + 0.01
    best: dict[str, float] = {}
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = stored.to(torch.float32)
        assert bool(torch.isfinite(x).all())
        t1 = time.perf_counter()
        out = gpu_encode.encode_tensor(x, qtype, importance)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        torch.empty(out.shape, dtype=torch.uint8, pin_memory=True).copy_(out)
        t3 = time.perf_counter()
        for key, seconds in (("widen_finite_ms", t1 - t0), ("encode_ms", t2 - t1), ("download_ms", t3 - t2)):
            best[key] = min(best.get(key, float("inf")), seconds * 1e3)
    return {"name": f"pass of {qtype_name}", "weights": weights, **best,
            "encode_weights_per_s": weights / best["encode_ms"] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--gib", type=int, default=4, help="size of the file the copies read")
    args = parser.parse_args()
    emit(time_import_torch())
    import torch

    size = args.gib << 30
    path = Path(args.workdir) / "quantkit-gpu-stream-probe.bin"
    probe_file(path, size)
    buffers = [torch.empty(BUFFER_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    for how in ("mmap", "preadv"):
        for threads in (1, 2, 4):
            emit({"name": f"fill pinned buffers ({how})", "threads": threads,
                  "gb_per_s": fill_rate(path, size, buffers, threads, how)})
    device = torch.device("cuda")
    on_device = torch.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(32):
        on_device.copy_(buffers[i % len(buffers)], non_blocking=True)
    torch.cuda.synchronize()
    emit({"name": "host to device, pinned", "gb_per_s": 32 * BUFFER_BYTES / (time.perf_counter() - start) / 1e9})
    for name in ("IQ2_XXS", "Q2_K", "Q4_K", "Q8_0"):
        emit(batch_steps(device, name))


if __name__ == "__main__":
    main()
