"""Shared helpers for benchmarks: interleaved timing, one JSON object per measurement, a short table."""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


#: The ``quantkit`` command as installed (``quantkit.cli:run``: exits without torch's teardown once its work is
#: done).  ``-c`` puts the working directory first on the path: run from a checkout, that checkout's code.
QUANTKIT = [sys.executable, "-c", "from quantkit.cli import run; run()"]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cpus"


def commit() -> str:
    """HEAD's short hash, "-dirty" when tracked files differ from it (the figures are then not HEAD's)."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, cwd=here).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def interleaved_medians(fns: dict, repeats: int = 5, warmup: int = 1) -> dict:
    """Time each callable ``repeats`` times, interleaved A/B/A/B so drift hits all alike; return medians (s)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run_timed(command: list[str], env: dict | None = None,
              cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``command`` (in ``cwd``); its wall time, its CPU time (user + system, all threads: what it costs
    regardless of the machine's other load) and the load average before it."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return proc, {"wall_s": wall, "cpu_s": cpu, "load_average": load}


def emit(record: dict) -> None:
    record.setdefault("machine", machine())
    record.setdefault("commit", commit())
    print(json.dumps(record), flush=True)


def evict(paths) -> None:
    """Drop these files' pages from the page cache, so the next reads come from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
