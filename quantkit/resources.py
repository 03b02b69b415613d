"""What this machine lends a run: CPUs and memory.  Standard library only, so that the command line can size its
defaults without importing the pipelines (and numba with them)."""
from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not every platform has affinity
        return max(1, os.cpu_count() or 1)


def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> int | None:
    """Bytes of memory this process can still use: the kernel's MemAvailable (else the free pages), lowered to
    what the cgroup (v2) limit leaves; None where none of them can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            pass
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        found.append(max(0, limit - used))
    return min(found) if found else None


def memory_for(what: str) -> int:
    """:func:`available_memory`, or an error saying that ``what`` must be given where it cannot be read."""
    from .errors import UnsupportedError

    found = available_memory()
    if found is None:
        raise UnsupportedError(f"cannot tell the available memory on this system; pass {what}")
    return found


#: Share of the available memory that a runtime model run many times (a calibration, a fixture's cases) keeps its
#: decoded weights in, so each weight is decoded once per run instead of once per forward pass.
KEEP_FRACTION = 0.25


def keep_budget() -> int:
    """Bytes of decoded weights a model run many times may keep: :data:`KEEP_FRACTION` of :func:`available_memory`
    (none where that cannot be read)."""
    found = available_memory()
    return int(KEEP_FRACTION * found) if found else 0
