"""A wall-clock stack sampler of every thread of this process (a small py-spy): where each thread is, busy or
waiting, every ``interval`` seconds.  cProfile sees one thread and slows Python calls; this sees all of them at a
cost of one stack walk per thread and sample.

    python bench/_sampler.py OUT.txt -- quantkit convert ...     # runs quantkit.cli.main() under the sampler
"""
from __future__ import annotations

import collections
import re
import sys
import threading
import time
from pathlib import Path


class Sampler:
    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.samples: collections.Counter = collections.Counter()          # thread group -> samples
        self.inclusive: dict = collections.defaultdict(collections.Counter)  # group -> function -> samples
        self.leaf: dict = collections.defaultdict(collections.Counter)       # group -> function:line -> samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sampler")

    def __enter__(self):
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self.start

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = re.sub(r"[-_]?\d+(_\d+)?$", "", names.get(ident, "?"))   # pool threads as one group
                self.samples[group] += 1
                code = frame.f_code
                self.leaf[group][f"{code.co_name} {Path(code.co_filename).name}:{frame.f_lineno}"] += 1
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    seen.add(f"{code.co_name} {Path(code.co_filename).name}:{code.co_firstlineno}")
                    frame = frame.f_back
                for name in seen:
                    self.inclusive[group][name] += 1

    def report(self, top: int = 40) -> str:
        """Per thread group: seconds sampled, then the functions by inclusive and by own (leaf) samples."""
        lines = [f"wall {self.wall:.2f} s, one sample every {self.interval * 1e3:.0f} ms per thread"]
        for group, n in self.samples.most_common():
            lines.append(f"\n== {group}: {n * self.interval:.2f} thread-s sampled")
            for title, table in (("inclusive", self.inclusive[group]), ("leaf", self.leaf[group])):
                lines.append(f"  -- {title}")
                lines += [f"  {c * self.interval:8.3f} s {100 * c / n:5.1f}%  {name}"
                          for name, c in table.most_common(top)]
        return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: _sampler.py OUT.txt -- quantkit ARGS..."
    sys.argv = argv
    from quantkit.cli import main

    sampler = Sampler()
    try:
        with sampler:
            main()     # main(), not run(): run() leaves by os._exit once torch is loaded
    except SystemExit:
        pass
    Path(out).write_text(sampler.report())
