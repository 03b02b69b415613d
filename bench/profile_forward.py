"""Where a float32 all-position forward pass goes on CUDA: wall time per call, device time per part, profiler tables.

    python bench/profile_forward.py [--runs 7b:2048,1b:512] [--repeats 3] [--workdir /tmp/score-vs-llamacpp]
        [--dtype float32] [--out DIR] [--label NAME] [--no-profile] [--no-graphs]

For each ``model:tokens`` of ``--runs`` (the synthetic Qwen3-MoE GGUFs of bench/score_vs_llamacpp.py, written into
``--workdir`` unless already there): loads the model on CUDA, scores one warm-up call of
:func:`quantkit.runtime.logits`, then ``--repeats`` timed calls (wall clock, host copy of the logits included:
tokens/s from the median; peak device memory from torch's allocator), then one call where CUDA events bracket each
fused product (dense or grouped, by type and width), each attention call and each routed-experts module
(routing, gathers and products), and one call under :mod:`torch.profiler` (tables by device time and by host
time, one file per run in ``--out``).  The timed calls replay a CUDA graph once the shape repeats (as the runtime
does; ``--no-graphs``: eager passes); the instrumented and profiled calls run eagerly (a replay runs no Python).
Works with the code before and after a kernel change (it only wraps
``triton_matmul._launch`` by position), so two trees can be compared by running it with each on ``PYTHONPATH``.
Prints one JSON object per run.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from _common import emit
from synthetic_gguf import write_synthetic
from score_vs_llamacpp import MODELS, vocab_size

from quantkit.kernels import triton_matmul
from quantkit.runtime import experts as experts_module
from quantkit.runtime import load_model, logits


class Parts:
    """CUDA events around the wrapped calls; :meth:`totals` sums each part's device time (after a sync)."""

    def __init__(self):
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.on = False

    def wrap(self, name_of, fn):
        def wrapped(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events.append((name_of(*args, **kwargs), start, end))
            return out
        return wrapped

    def totals(self) -> dict:
        torch.cuda.synchronize()
        sums, calls = collections.Counter(), collections.Counter()
        for name, start, end in self.events:
            sums[name] += start.elapsed_time(end) / 1e3
            calls[name] += 1
        self.events.clear()
        return {name: {"s": sums[name], "calls": calls[name]} for name in sorted(sums, key=sums.get, reverse=True)}


def product_name(x, payload, qtype, n, out, out_col, tiles, *rest, **kwargs) -> str:
    kind = "grouped" if tiles is not None else "dense"
    return f"fused {kind} {triton_matmul.GGMLType(int(qtype)).name} n={n} k={x.shape[1]}"


def instrument(parts: Parts) -> None:
    triton_matmul._launch = parts.wrap(product_name, triton_matmul._launch)
    F.scaled_dot_product_attention = parts.wrap(lambda *a, **k: "attention (sdpa)", F.scaled_dot_product_attention)
    experts_module.grouped_experts_forward = parts.wrap(lambda *a, **k: "experts module (all)",
                                                        experts_module.grouped_experts_forward)
    experts_module.register()       # registers the wrapped forward under the same name


def table(prof, sort_by: str, rows: int) -> str:
    for key in (sort_by, sort_by.replace("device", "cuda")):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
        except (AttributeError, KeyError, RuntimeError):
            continue
    return "(no table)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="7b:2048,1b:512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/score-vs-llamacpp"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--label", default="run")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-graphs", action="store_true")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    parts = Parts()
    instrument(parts)
    runs = [(name, [int(n) for n in lengths.split("/")]) for name, lengths in
            (r.split(":") for r in args.runs.split(","))]
    for name, lengths in runs:
        path = args.workdir / f"synthetic-{name}.gguf"
        if not path.is_file():
            write_synthetic(path, MODELS[name])
        model = load_model(path, device="cuda", dtype=getattr(torch, args.dtype))
        graphs = getattr(model, "graphs", False) and not args.no_graphs     # False in trees before graphs
        vocab = vocab_size(MODELS[name])         # a seed model's sits in its text config
        for n in lengths:
            ids = np.random.default_rng(n).integers(3, vocab, size=n).tolist()
            model.graphs = graphs
            logits(model, ids)                       # warm-up: Triton compiles
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                logits(model, ids)
                times.append(time.perf_counter() - t0)
            rec = {"name": f"{args.label} {name} {n} {args.dtype}", "tokens": n,
                   "tokens_per_s": n / statistics.median(times), "seconds": times,
                   "peak_device_bytes": torch.cuda.max_memory_allocated()}
            model.graphs = False
            parts.on = True
            t0 = time.perf_counter()
            logits(model, ids)
            rec["instrumented_wall_s"] = time.perf_counter() - t0
            parts.on = False
            rec["parts"] = parts.totals()
            if not args.no_profile:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    logits(model, ids)
                    torch.cuda.synchronize()
                syncs = {e.key: e.count for e in prof.key_averages()
                         if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
                                      "cudaMemcpyAsync", "aten::item")}
                rec["host_syncs"] = syncs
                if args.out:
                    (args.out / f"{args.label}-{name}-{n}.txt").write_text(
                        f"{rec['name']}: by device time\n{table(prof, 'self_device_time_total', 40)}\n\n"
                        f"by host time\n{table(prof, 'cpu_time_total', 40)}\n")
            emit(rec)
        model.close()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
