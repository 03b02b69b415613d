"""``quantkit imatrix collect`` on a synthetic MoE checkpoint several times larger than its memory budget, or its
speed side by side with ``llama-imatrix``.

    python bench/imatrix_collect.py [--gib 6] [--budget 1G] [--ctx 128] [--batch 2048] [--chunks 4] [--workdir /tmp]
    python bench/imatrix_collect.py --vs-llama LLAMA_IMATRIX_BINARY [--ctx 128] [--batch 2048] [--chunks 4] [--threads 2]
        [--repeats 3] [--synthetic-layers N] [--baseline CHECKOUT] [--no-cold] [--text-repeat N]

``--vs-llama``: the bundled example model and its calibration text, converted to an F32 GGUF for llama-imatrix
(``quantkit convert`` with the F32 interop recipe), both tools with the same chunk size and count, the same
tokens per forward pass (``--batch``: quantkit's ``--batch``, llama-imatrix's ``-b``/``-ub``) and
``--threads`` threads (``llama-imatrix -t``; quantkit's ``--threads``, and quantkit with its default thread
count), runs interleaved.  Cold: quantkit with an empty numba cache (it compiles its decoders), llama-imatrix's first run;
warm: a numba cache filled by an earlier run.  Measured per run: wall time of the whole command (tokens/s =
ctx x chunks / wall, what a user waits for), its CPU time (user + system of every thread: what the run costs
whatever else the machine does; with one thread, llama.cpp's thread pool does not spin, so the two compare)
and, inside quantkit's process, the imports, the load and the chunk loop alone; llama-imatrix's own ``prompt eval`` figure where it prints one; the 1-minute load average
before each run (the machine's other work: ratios are only comparable within one run).  Prints one JSON object per
configuration (medians) and a table.  ``--baseline CHECKOUT`` adds quantkit from another source tree (e.g. the
commit before a change, unpacked with ``git archive``), interleaved with the rest; ``--no-cold`` skips the cold
runs (each is the first run of its numba cache); the default thread count runs only when it differs from
``--threads``.

Otherwise:

Generates the seeded BF16 qwen3_moe checkpoint of ``bench/convert.py`` (at least ``--gib`` GiB, one shard per
layer), then collects an imatrix from it over the bundled example's calibration text, in a child process, twice:
with ``--max-memory`` = ``--budget`` (the model streams from the checkpoint: every forward pass assembles every layer
again, routed experts one expert at a time, so a budget smaller than one stacked expert tensor works) and with the
budget unlimited (every tensor is assembled once and kept; skipped when the memory available
is under twice the checkpoint).  Both imatrices must be identical (checked here).

Measured per run: the peak of the child's resident set (sampled every 0.1 s; the summed tree, and its anonymous
part: file pages of the memory-mapped checkpoint count in the resident set but the kernel reclaims them at will),
the cache's own peak, the load time, and seconds per forward pass (``--batch`` tokens; the first pass apart: with
an unlimited budget it assembles every tensor, later passes reuse them).  Prints one JSON object per run (``_common.emit``), a table, and
deletes everything.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import emit, run_timed
from convert import EXPERT_WIDTH, EXPERTS, GIB, HIDDEN, SAMPLE_SECONDS, layers_for, synthetic_checkpoint

from quantkit.cli.imatrix import ByteSize
from quantkit.examples import example_model_dir
from quantkit.resources import available_memory

#: Memory available must be at least this many checkpoints for the unlimited run (the cache, plus the page cache).
UNLIMITED_HEADROOM = 2
TEXT = example_model_dir().parent / "tiny-moe-text" / "calibration.txt"
#: One stacked routed-expert tensor of the synthetic checkpoint as BF16 (``[EXPERTS, EXPERT_WIDTH, HIDDEN]``).
STACKED_BYTES = 2 * EXPERTS * EXPERT_WIDTH * HIDDEN

# Runs in the child: collect_imatrix with each forward pass and the load timed, the cache's figures kept at close.
DRIVER = r"""
import json, sys, time
from quantkit.imatrix.collect import CollectOptions, Collector, collect_imatrix
from quantkit.runtime.weights import CheckpointWeights

ckpt, text, out, budget, ctx, batch, chunks = sys.argv[1:8]
marks, cache = [time.perf_counter()], {}
run_chunks, close = Collector.run_chunks, CheckpointWeights.close

def timed(self, input_ids):
    if len(marks) == 1:
        marks.append(time.perf_counter())       # the model is loaded
    run_chunks(self, input_ids)
    marks.append(time.perf_counter())

def closing(self):
    c = self.cache
    cache.update(budget=c.budget, peak_bytes=c.peak_bytes, hits=c.hits, misses=c.misses)
    close(self)

Collector.run_chunks, CheckpointWeights.close = timed, closing
opts = CollectOptions(ctx=int(ctx), batch=int(batch), chunks=int(chunks), max_memory=None if budget == "none" else int(budget),
                      save_every=0, progress=False)
collect_imatrix(ckpt, text, out, opts)
print(json.dumps({"load_s": marks[1] - marks[0], "pass_s": [b - a for a, b in zip(marks[1:], marks[2:])],
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


def run_collect(ckpt: Path, out: Path, budget: int | None, ctx: int, batch: int, chunks: int) -> dict:
    command = [sys.executable, "-c", DRIVER, str(ckpt), str(TEXT), str(out), "none" if budget is None else str(budget),
               str(ctx), str(batch), str(chunks)]
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


# Runs in the child for --vs-llama: the command's own path (collect_imatrix), its phases timed.
SPEED_DRIVER = r"""
import json, os, sys, time
start = time.perf_counter()
import torch, transformers
from quantkit.imatrix.collect import CollectOptions, Collector, collect_imatrix
imported = time.perf_counter()
src, text, out, ctx, batch, chunks, threads = sys.argv[1:8]
threads = int(threads) or None          # 0: the command's default
marks, cpu_marks = [], []
run_chunks = Collector.run_chunks

def timed(self, input_ids):
    marks.append(time.perf_counter())
    cpu_marks.append(time.process_time())
    run_chunks(self, input_ids)

Collector.run_chunks = timed
collect_imatrix(src, text, out, CollectOptions(ctx=int(ctx), batch=int(batch), chunks=int(chunks), threads=threads,
                                               save_every=0, progress=False, overwrite=True))
done, cpu_done = time.perf_counter(), time.process_time()
print(json.dumps({"import_s": imported - start, "load_s": marks[0] - imported, "chunks_s": done - marks[0],
                  "chunks_cpu_s": cpu_done - cpu_marks[0]}), flush=True)
os._exit(0)     # as the command ends (quantkit.cli.run): without torch's interpreter teardown
"""


def default_threads(model: Path, ctx: int, batch: int) -> int:
    """The thread count ``imatrix collect`` picks for ``model`` (:attr:`quantkit.imatrix.collect.CollectOptions.threads`),
    without importing torch here."""
    from quantkit.imatrix.collect import VALUES_PER_THREAD, CollectOptions

    config = json.loads((model / "config.json").read_text())
    hidden = (config.get("text_config") or config).get("hidden_size")
    cores = len(os.sched_getaffinity(0))
    values = CollectOptions(ctx=ctx, batch=batch).chunks_per_pass * ctx * int(hidden) if hidden else None
    return max(1, min(cores, values // VALUES_PER_THREAD)) if values else cores


def f32_gguf(root: Path, model: Path, pre_tokenizer: str) -> Path:
    """``model`` as an F32 GGUF (llama-imatrix's input; the same weights as the checkpoint)."""
    from quantkit.testing.recipe_texts import F32_RECIPE

    recipe, out = root / "f32.toml", root / "model-f32.gguf"
    recipe.write_text(F32_RECIPE)
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "convert", str(model), "-o", str(out),
                           "--recipe", str(recipe), "--pre-tokenizer", pre_tokenizer, "--no-progress"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"convert to F32 failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return out


def run_quantkit(model: Path, text: Path, out: Path, ctx: int, batch: int, chunks: int, threads: int,
                 numba_cache: Path, checkout: str | None = None) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba_cache)}
    if checkout is not None:
        env["PYTHONPATH"] = checkout
    # run inside the checkout: ``-c`` puts the working directory first on the path, ahead of PYTHONPATH
    proc, measured = run_timed([sys.executable, "-c", SPEED_DRIVER, str(Path(model).resolve()),
                                str(Path(text).resolve()), str(Path(out).resolve()), str(ctx), str(batch),
                                str(chunks), str(threads)], env, cwd=checkout)
    if proc.returncode != 0:
        raise SystemExit(f"quantkit failed:\n{proc.stderr[-3000:]}")
    return {**measured, **json.loads(proc.stdout.strip().splitlines()[-1])}


def run_llama(binary: str, gguf: Path, text: Path, out: Path, ctx: int, batch: int, chunks: int,
              threads: int) -> dict:
    import re

    command = [binary, "-m", str(gguf), "-f", str(text), "--chunks", str(chunks), "-c", str(ctx), "-b", str(batch),
               "-ub", str(batch), "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-t", str(threads), "--no-ppl",
               "--seed", "0", "-o", str(out)]
    proc, measured = run_timed(command)
    if proc.returncode != 0:
        raise SystemExit(f"llama-imatrix failed:\n{proc.stderr[-3000:]}")
    found = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", proc.stdout + proc.stderr)
    return {**measured, "eval_s": float(found.group(1)) / 1000 if found else None}


def versus_llama(args) -> None:
    import statistics

    from _common import commit, machine

    tokens = args.ctx * args.chunks
    root = Path(tempfile.mkdtemp(prefix="quantkit-bench-imatrix-speed-", dir=args.workdir))
    try:
        if args.synthetic_layers:
            model, _ = synthetic_checkpoint(root, args.synthetic_layers, "imatrix collect speed")
            gguf = f32_gguf(root, model, "qwen2")
        else:
            from quantkit.examples import PRE_TOKENIZER

            model = example_model_dir()
            gguf = f32_gguf(root, model, PRE_TOKENIZER)
        text = TEXT
        if args.text_repeat > 1:     # a calibration set of a real one's size: the same text several times over
            text = root / "calibration.txt"
            text.write_text(TEXT.read_text(encoding="utf-8") * args.text_repeat, encoding="utf-8")
        warm_cache = root / "numba-warm"
        checkouts = [None] + ([str(Path(args.baseline).resolve())] if args.baseline else [])
        for checkout in checkouts:      # fills the cache (each checkout's kernels)
            run_quantkit(model, text, root / "warmup.gguf", args.ctx, args.batch, args.chunks, args.threads, warm_cache,
                         checkout)
        runs: dict[str, list[dict]] = {}
        configs = [("llama-imatrix", None, None), (f"quantkit -t {args.threads}", args.threads, None)]
        if default_threads(model, args.ctx, args.batch) != args.threads:
            configs.append(("quantkit default -t", 0, None))
        if args.baseline:
            configs.append((f"baseline -t {args.threads}", args.threads, checkouts[1]))
        for repeat in range(args.repeats):
            for state in ("warm",) if args.no_cold else ("cold", "warm"):
                for label, threads, checkout in configs:
                    key = f"{label} {state}"
                    if threads is None:
                        if state == "cold" and repeat > 0:
                            continue        # only its first run is cold
                        measured = run_llama(args.vs_llama, gguf, text, root / "llama.gguf", args.ctx, args.batch,
                                             args.chunks, args.threads)
                    else:
                        cache = warm_cache if state == "warm" else root / f"numba-cold-{repeat}-{label}"
                        measured = run_quantkit(model, text, root / "quantkit.gguf", args.ctx, args.batch, args.chunks,
                                                threads, cache, checkout)
                    runs.setdefault(key, []).append(measured)
        records = []
        for key, measured in runs.items():
            med = {k: statistics.median(m[k] for m in measured) for k in measured[0] if measured[0][k] is not None}
            loads = [m["load_average"] for m in measured]
            record = {"name": f"imatrix collect speed: {key}", "runs": len(measured), "tokens": tokens,
                      "ctx": args.ctx, "batch": args.batch, "chunks": args.chunks, **med, "tokens_per_s": tokens / med["wall_s"],
                      "load_average_min": min(loads), "load_average_max": max(loads),
                      "machine": machine(), "commit": commit()}
            record["cpu_tokens_per_s"] = tokens / med["cpu_s"]
            if "chunks_s" in med:
                record["loop_tokens_per_s"] = tokens / med["chunks_s"]
            if "eval_s" in med:
                record["loop_tokens_per_s"] = tokens / med["eval_s"]
            records.append(record)
        by_name = {r["name"].split(": ", 1)[1]: r for r in records}
        for r in records:
            key = r["name"].split(": ", 1)[1]
            state = key.rsplit(" ", 1)[1]
            ref = by_name.get(f"llama-imatrix {state}") or by_name["llama-imatrix warm"]
            if not key.startswith("llama"):
                r["ratio_vs_llama"] = r["tokens_per_s"] / ref["tokens_per_s"]
                r["cpu_ratio_vs_llama"] = r["cpu_tokens_per_s"] / ref["cpu_tokens_per_s"]
                if "loop_tokens_per_s" in r and "loop_tokens_per_s" in ref:
                    r["loop_ratio_vs_llama"] = r["loop_tokens_per_s"] / ref["loop_tokens_per_s"]
            emit(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{tokens} tokens ({args.chunks} chunks of {args.ctx}); medians")
    print(f"{'run':<26}{'wall':>8}{'tok/s':>9}{'ratio':>7}{'import':>8}{'load':>7}{'loop':>7}{'loop tok/s':>11}"
          f"{'ratio':>7}{'CPU s':>8}{'ratio':>7}{'load avg':>11}")
    for r in records:
        key = r["name"].split(": ", 1)[1]
        opt = (lambda k, f: format(r[k], f) if k in r else "-")
        print(f"{key:<26}{r['wall_s']:>7.2f}s{r['tokens_per_s']:>9.0f}{opt('ratio_vs_llama', '.2f'):>7}"
              f"{opt('import_s', '.2f'):>8}{opt('load_s', '.2f'):>7}{opt('chunks_s', '.2f'):>7}"
              f"{opt('loop_tokens_per_s', '.0f'):>11}{opt('loop_ratio_vs_llama', '.2f'):>7}"
              f"{r['cpu_s']:>8.2f}{opt('cpu_ratio_vs_llama', '.2f'):>7}"
              f"{r['load_average_min']:>6.1f}-{r['load_average_max']:<4.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vs-llama", metavar="LLAMA_IMATRIX", help="compare speed with this llama-imatrix binary")
    parser.add_argument("--threads", type=int, default=2, help="threads of both tools (--vs-llama)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each (--vs-llama)")
    parser.add_argument("--text-repeat", type=int, default=1,
                        help="--vs-llama: the bundled calibration text this many times over (92,160 tokens each)")
    parser.add_argument("--gib", type=float, default=6.0, help="checkpoint size at least this many GiB")
    parser.add_argument("--budget", default="1G", help="--max-memory of the streaming run (e.g. 1G)")
    parser.add_argument("--synthetic-layers", type=int, default=0,
                        help="--vs-llama on the synthetic qwen3_moe of bench/convert.py (hidden 2048, 64 experts of "
                             "768, top-8) with this many layers instead of the bundled example")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="--vs-llama: also run quantkit from this source tree (PYTHONPATH), interleaved")
    parser.add_argument("--no-cold", action="store_true", help="--vs-llama: warm runs only")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048,
                        help="tokens per forward pass of both tools (quantkit --batch, llama-imatrix -b/-ub): "
                             "batch / ctx chunks run together")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()
    if args.vs_llama:
        versus_llama(args)
        return
    budget = ByteSize().convert(args.budget, None, None)

    layers = layers_for(args.gib, args.workdir, 1, GIB)
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
            measured = run_collect(ckpt, outputs[label], limit, args.ctx, args.batch, args.chunks)
            pass_s = measured["pass_s"]
            record = {"name": f"imatrix collect {label}", "budget_bytes": measured["cache"]["budget"],
                      "source_bytes": source_bytes, "stacked_tensor_bytes": STACKED_BYTES,
                      "peak_rss": measured["peak_rss"],
                      "peak_rss_anon": measured["peak_rss_anon"], "cache_peak_bytes": measured["cache"]["peak_bytes"],
                      "cache_hits": measured["cache"]["hits"], "cache_misses": measured["cache"]["misses"],
                      "load_s": measured["load_s"], "first_pass_s": pass_s[0],
                      "later_pass_s": sum(pass_s[1:]) / max(1, len(pass_s) - 1), "pass_s": pass_s,
                      "ctx": args.ctx, "batch": args.batch, "chunks": args.chunks, "wall_s": measured["wall_s"]}
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
          f"{'pass 1':>9}{'later':>8}")
    for r in records:
        size = (lambda v: f"{v / GIB:.2f}G")
        print(f"{r['name']:<30}{size(r['budget_bytes']):>10}{size(r['source_bytes']):>10}{size(r['peak_rss']):>10}"
              f"{size(r['peak_rss_anon']):>10}{size(r['cache_peak_bytes']):>10}{r['load_s']:>7.1f}s"
              f"{r['first_pass_s']:>8.1f}s{r['later_pass_s']:>7.1f}s")


if __name__ == "__main__":
    main()
