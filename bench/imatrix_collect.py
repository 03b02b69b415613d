"""``quantkit imatrix collect`` on a synthetic MoE checkpoint several times larger than its memory budget.

    python bench/imatrix_collect.py [--gib 6] [--budget 1G] [--ctx 128] [--chunks 4] [--workdir /tmp]

Generates the seeded BF16 qwen3_moe checkpoint of ``bench/convert.py`` (at least ``--gib`` GiB, one shard per
layer), then collects an imatrix from it over the bundled example's calibration text, in a child process, twice:
with ``--max-memory`` = ``--budget`` (the model streams from the checkpoint: every chunk assembles every layer
again, routed experts one expert at a time, so a budget smaller than one stacked expert tensor works) and with the
budget unlimited (every tensor is assembled once and kept; skipped when the memory available
is under twice the checkpoint).  Both imatrices must be identical (checked here).

Measured per run: the peak of the child's resident set (sampled every 0.1 s; the summed tree, and its anonymous
part: file pages of the memory-mapped checkpoint count in the resident set but the kernel reclaims them at will),
the cache's own peak, the load time, and seconds per chunk (the first chunk apart: with an unlimited budget it
assembles every tensor, later chunks reuse them).  Prints one JSON object per run (``_common.emit``), a table, and
deletes everything.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import emit
from convert import EXPERT_WIDTH, EXPERTS, GIB, HIDDEN, SAMPLE_SECONDS, layer_bytes, synthetic_checkpoint

from quantkit.cli.imatrix import ByteSize
from quantkit.examples import example_model_dir
from quantkit.runtime.weights import available_memory

#: Memory available must be at least this many checkpoints for the unlimited run (the cache, plus the page cache).
UNLIMITED_HEADROOM = 2
TEXT = example_model_dir().parent / "tiny-moe-text" / "calibration.txt"
#: One stacked routed-expert tensor of the synthetic checkpoint as BF16 (``[EXPERTS, EXPERT_WIDTH, HIDDEN]``).
STACKED_BYTES = 2 * EXPERTS * EXPERT_WIDTH * HIDDEN

# Runs in the child: collect_imatrix with each chunk and the load timed, the cache's figures kept at close.
DRIVER = r"""
import json, sys, time
from quantkit.imatrix.collect import CollectOptions, Collector, collect_imatrix
from quantkit.runtime.weights import CheckpointWeights

ckpt, text, out, budget, ctx, chunks = sys.argv[1:7]
marks, cache = [time.perf_counter()], {}
run_chunk, close = Collector.run_chunk, CheckpointWeights.close

def timed(self, input_ids):
    if len(marks) == 1:
        marks.append(time.perf_counter())       # the model is loaded
    run_chunk(self, input_ids)
    marks.append(time.perf_counter())

def closing(self):
    c = self.cache
    cache.update(budget=c.budget, peak_bytes=c.peak_bytes, hits=c.hits, misses=c.misses)
    close(self)

Collector.run_chunk, CheckpointWeights.close = timed, closing
opts = CollectOptions(ctx=int(ctx), chunks=int(chunks), max_memory=None if budget == "none" else int(budget),
                      save_every=0, progress=False)
collect_imatrix(ckpt, text, out, opts)
print(json.dumps({"load_s": marks[1] - marks[0], "chunk_s": [b - a for a, b in zip(marks[1:], marks[2:])],
                  "cache": cache}))
"""


class Sampler:
    """Peaks of the summed resident set of a process tree, and of its anonymous part, sampled in a thread."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _status(pid: int) -> tuple[int, int]:
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
        return fields.get("VmRSS", 0), fields.get("RssAnon", 0)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            rss = anon = 0
            try:
                for p in [self.root, *self.root.children(recursive=True)]:
                    try:
                        r, a = self._status(p.pid)
                    except (OSError, psutil.NoSuchProcess):
                        continue
                    rss, anon = rss + r, anon + a
            except psutil.NoSuchProcess:
                break
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
            time.sleep(SAMPLE_SECONDS)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak_rss, self.peak_anon


def run_collect(ckpt: Path, out: Path, budget: int | None, ctx: int, chunks: int) -> dict:
    command = [sys.executable, "-c", DRIVER, str(ckpt), str(TEXT), str(out), "none" if budget is None else str(budget),
               str(ctx), str(chunks)]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    try:
        stdout, stderr = proc.communicate()
    finally:
        proc.kill()         # no orphan when this script is interrupted
    wall = time.perf_counter() - start
    peak_rss, peak_anon = sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"collect failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": wall, "peak_rss": peak_rss,
            "peak_rss_anon": peak_anon}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=6.0, help="checkpoint size at least this many GiB")
    parser.add_argument("--budget", default="1G", help="--max-memory of the streaming run (e.g. 1G)")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()
    budget = ByteSize().convert(args.budget, None, None)

    layers = max(1, -(-int(args.gib * GIB) // layer_bytes()))
    need = layers * layer_bytes() + GIB
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        raise SystemExit(f"{args.workdir} has {free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed")
    root = Path(tempfile.mkdtemp(prefix="quantkit-bench-imatrix-", dir=args.workdir))
    records = []
    try:
        ckpt, source_bytes = synthetic_checkpoint(root, layers, "imatrix collect")
        runs = [("streaming", budget)]
        if available_memory() >= UNLIMITED_HEADROOM * source_bytes:
            runs.append(("unlimited", None))
        outputs = {}
        for label, limit in runs:
            outputs[label] = root / f"{label}.imatrix.gguf"
            measured = run_collect(ckpt, outputs[label], limit, args.ctx, args.chunks)
            chunk_s = measured["chunk_s"]
            record = {"name": f"imatrix collect {label}", "budget_bytes": measured["cache"]["budget"],
                      "source_bytes": source_bytes, "stacked_tensor_bytes": STACKED_BYTES,
                      "peak_rss": measured["peak_rss"],
                      "peak_rss_anon": measured["peak_rss_anon"], "cache_peak_bytes": measured["cache"]["peak_bytes"],
                      "cache_hits": measured["cache"]["hits"], "cache_misses": measured["cache"]["misses"],
                      "load_s": measured["load_s"], "first_chunk_s": chunk_s[0],
                      "later_chunk_s": sum(chunk_s[1:]) / max(1, len(chunk_s) - 1), "chunk_s": chunk_s,
                      "ctx": args.ctx, "chunks": args.chunks, "wall_s": measured["wall_s"]}
            emit(record)
            records.append(record)
        if len(outputs) == 2:
            from quantkit.imatrix import load_imatrix

            a, b = (load_imatrix(p) for p in outputs.values())
            same = sorted(a.entries) == sorted(b.entries) and all(
                (a.entries[n].in_sum2 == b.entries[n].in_sum2).all() and (a.entries[n].counts == b.entries[n].counts
                                                                           ).all() for n in a.entries)
            emit({"name": "imatrix collect streaming == unlimited (bit for bit)", "identical": bool(same)})
            if not same:
                raise SystemExit("the streaming and unlimited imatrices differ")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\none stacked expert tensor: {STACKED_BYTES / GIB:.2f}G")
    print(f"\n{'run':<30}{'budget':>10}{'ckpt':>10}{'peak RSS':>10}{'anon':>10}{'cache':>10}{'load':>8}"
          f"{'chunk 1':>9}{'later':>8}")
    for r in records:
        size = (lambda v: f"{v / GIB:.2f}G")
        print(f"{r['name']:<30}{size(r['budget_bytes']):>10}{size(r['source_bytes']):>10}{size(r['peak_rss']):>10}"
              f"{size(r['peak_rss_anon']):>10}{size(r['cache_peak_bytes']):>10}{r['load_s']:>7.1f}s"
              f"{r['first_chunk_s']:>8.1f}s{r['later_chunk_s']:>7.1f}s")


if __name__ == "__main__":
    main()
