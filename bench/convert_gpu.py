"""``quantkit convert --device cuda`` on a large synthetic MoE checkpoint: wall time against its two bounds, the
reads and the GPU encode, measured in the same run (issue 17: wall <= 1.2 x max(read, encode)).

    python bench/convert_gpu.py [--gib 8] [--jobs 1,2,4] [--recipe iq2] [--workdir /tmp] [--check-layers 1]
                                [--source DIR | --make-source DIR] [--experts 64] [--gen-processes N]
                                [--profile PATH] [--compare TREE ...]

Generates the seeded BF16 qwen3_moe checkpoint of bench/convert.py (at least ``--gib`` GiB, one shard per layer),
a recipe whose every large tensor has a GPU encoder (``iq2``: routed gate/up IQ2_XXS, routed down Q2_K, the rest
Q8_0; ``q4k``: routed experts Q4_K, the rest Q8_0; routers and norms stay F32 as always) and a synthetic imatrix
for every weight of the blocks, then measures, for each process count N of ``--jobs``:

(a) read: every source tensor the plan reads, to the float32 host arrays the CPU path's encoders take
    (``SourceContext.array``: the BF16 bits widened by numpy), each tensor's maps released after it as convert
    does; N processes started and warm beforehand take the tensors largest first (the best balance; convert's
    GPU workers take them in file order); the figure is the wall time from handing out the first tensor to the
    last one read (page cache warm: the checkpoint was just written and synced).  ``raw read`` (first N only) is
    the same with the stored bits copied, not widened.
(b) encode: every tensor with a GPU type encoded on the GPU from float32 already resident there (each expert
    with its imatrix slice, in the encoders' pass sizes), timed between two synchronizations, tensor by tensor,
    summed; uploads excluded; after one warm-up encode of each type (its compile or load reported apart).
    ``batched``: the same with a tensor's experts in one pass (a row of importance per row), as the stream
    encodes them; the bound is the faster of the two.
(c) convert: the whole ``quantkit convert --device cuda -j N`` command, interpreter start to exit (planning,
    hashing the source, workers, encoding, writing, verifying, renaming).  Its parts: ``prepare_s`` (planning,
    the CLI's figure), ``executor_s`` (the report's ``wall_seconds``: the device check with torch's import, the
    header, the tensors, the rest of the source hashes and of the read-back, the rename) and what is left:
    the interpreter, imports, printing and exit.  ``stream_s`` (``-j 1``): the report's seconds per step of the
    stream, summed over threads (the converting thread's "setup" with its parts "setup_pieces", "setup_imatrix"
    and "setup_reader", then "queue", "wait_reader", "wait_write_queue", after a tensor "release" and
    "wait_tensor_writes"; "fill"; the writers' "wait_gpu", "write", "hash"): what bounds the tensors phase;
    ``stream_wall_s``: each step's wall time with overlapping threads counted once.

Fixed costs measured apart, once: ``python -c "import torch"`` plus the first CUDA allocation, and ``quantkit
convert --dry-run`` (interpreter, imports, planning).  ``--compare TREE`` (repeatable): another checkout's
convert right after each of this tree's, same source and jobs (its wall ratio to this tree's, measured side by
side; its output must be equal), each command run inside its tree and checked to import that tree's quantkit.
``--profile PATH``: one more ``-j 1`` convert under a stack sampler of every thread (bench/_sampler.py), its
report written to PATH.  ``--make-source DIR`` writes the checkpoint and imatrix into DIR and exits; ``--source
DIR`` measures one written so (generation can overlap other work); ``--gen-processes`` (default: every CPU)
write its shards at once, each from its own seed, so a large checkpoint takes minutes, not tens of them;
``--experts`` (64 by default) sets the routed experts a layer: 256, a 284B-class model's count, makes each layer
777 source tensors and its stacked expert tensors ~805 MB of BF16, so per-tensor costs weigh as they would there.

(d) hash: the output file's SHA-256 in one thread, read from the page cache right after (c) wrote it.  Not part
    of the target's bound, but a floor under (c) all the same: convert hashes the whole file for the release
    manifest and SHA-256 cannot be split, so a recipe whose output hashes slower than its source reads (large
    types, or a host without fast SHA-256) cannot reach the target at any size.

The ratio is (c) / max(a, b) at the same N; ``tensors_ratio`` is (c)'s tensors phase / max(a, b), the ratio a
conversion approaches as its source grows and the fixed costs (torch's import, the CUDA context, planning) weigh
less; ``hash_ratio`` is (d) / max(a, b).  Every GPU output is compared with the others (same SHA-256), and a
``--check-layers``-layer checkpoint of the same generator is converted on the CPU and on the GPU: the files must
be equal byte for byte.  Prints one JSON object per measurement (``_common.emit``), then a short table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUANTKIT, emit, run_timed  # noqa: E402
from convert import EXPERTS, GIB, layers_for, synthetic_checkpoint  # noqa: E402

from quantkit.testing.recipe_texts import Q2_FALLBACK_RECIPE  # noqa: E402
from quantkit.testing.synthetic_imatrix import write_synthetic_imatrix  # noqa: E402

TARGET = 1.2
PRE_TOKENIZER = "qwen2"
RECIPES = {
    "iq2": Q2_FALLBACK_RECIPE,
    "q4k": """name = "bench-gpu-q4k"
architectures = ["qwen3_moe"]
[defaults]
type = "Q8_0"
[[rule]]
class = "routed_experts"
type = "Q4_K"
fallback = "Q5_0"
""",
}


def prepared_jobs(ckpt: Path, recipe: Path, imatrix: Path):
    from quantkit.convert.execute import ConvertRequest, prepare

    return prepare(ConvertRequest(str(ckpt), ckpt.parent / "unused.gguf", str(recipe), imatrix=str(imatrix),
                                  allow_synthetic_imatrix=True, pre_tokenizer=PRE_TOKENIZER))


# -- (a) reads, in N processes ----------------------------------------------------------------------------------

_WORKER = {}


def _reader_init(args) -> None:
    from quantkit.convert.tensors import SourceContext

    source, model_type, imatrix, shapes, jobs = args
    _WORKER["ctx"] = SourceContext(source, model_type, imatrix, shapes, True)
    _WORKER["jobs"] = jobs


def _started(_) -> None:
    time.sleep(1.0)      # long enough for every process to take one


def _read(args) -> int:
    name, widen = args
    ctx, job = _WORKER["ctx"], _WORKER["jobs"][name]
    total = 0
    try:
        for m in job.output.sources:
            x = ctx.array(m.hf_name) if widen else np.array(ctx.checkpoint.raw(m.hf_name))
            total += x.nbytes
    finally:
        ctx.release()
    return total


def time_reads(prepared, imatrix: Path, processes: int, widen: bool) -> float:
    from quantkit.convert.execute import _order

    jobs = prepared.jobs
    init = (str(prepared.source.path), prepared.plan.model_type, str(imatrix), prepared.imatrix_shapes, jobs)
    names = _order(jobs, list(jobs))
    with multiprocessing.get_context("spawn").Pool(processes, _reader_init, (init,)) as pool:
        pool.map(_started, range(processes), chunksize=1)      # every process started and imported
        start = time.perf_counter()
        for _ in pool.imap_unordered(_read, [(n, widen) for n in names], chunksize=1):
            pass
        return time.perf_counter() - start


# -- (b) encode on the GPU, from resident float32 ---------------------------------------------------------------

def time_encode(prepared, imatrix: Path, device: str) -> dict:
    import torch

    from quantkit.convert.gpu_stream import _TORCH_DTYPES
    from quantkit.convert.tensors import SourceContext, _importance, _self_importance, _unit_name, pieces
    from quantkit.formats.api import _check_imatrix
    from quantkit.formats.registry import get_format
    from quantkit.kernels import gpu_encode

    ctx = SourceContext(str(prepared.source.path), prepared.plan.model_type, str(imatrix), prepared.imatrix_shapes,
                        True)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    seconds, batched, weights, skipped, warm, warmed = 0.0, 0.0, 0, 0, 0.0, set()
    for job in prepared.jobs.values():
        if job.kind != "encode" or not gpu_encode.supports(job.qtype):
            skipped += job.nbytes
            continue
        fmt = get_format(job.qtype)
        units = []
        for piece in pieces(ctx, job):
            name = _unit_name(job, piece.matrix)
            if piece.stored and not _self_importance(job, piece.matrix):   # widened on the device (exact)
                dtype, rows = piece.stored()
                with warnings.catch_warnings():   # read-only map: copied to the device at once
                    warnings.simplefilter("ignore", UserWarning)
                    bits = torch.from_numpy(np.ascontiguousarray(rows).view(np.uint8)).to(dev)
                x = bits.view(getattr(torch, _TORCH_DTYPES[dtype])).to(torch.float32).reshape(rows.shape)
                im = _importance(ctx, job, piece.matrix, None)
            else:
                host = np.asarray(piece.stored()[1]).astype(np.float32) if piece.stored else \
                    piece.produce(None)[0]
                x, im = torch.from_numpy(host).to(dev), _importance(ctx, job, piece.matrix, host)
            im = _check_imatrix(im, x.shape[1], fmt, name)
            units.append((x, None if im is None else torch.from_numpy(im).to(dev), name))
        ctx.release()
        kind = (job.qtype, units[0][1] is not None)
        if kind not in warmed:
            sync()
            t0 = time.perf_counter()
            gpu_encode.encode_tensor(units[0][0], job.qtype, units[0][1])
            sync()
            warm += time.perf_counter() - t0
            warmed.add(kind)
        sync()
        t0 = time.perf_counter()
        for x, im, name in units:
            step = max(1, gpu_encode.chunk_weights_for(job.qtype) // x.shape[1])
            for r0 in range(0, x.shape[0], step):
                gpu_encode.encode_tensor(x[r0:r0 + step], job.qtype, im, first_row=r0, name=name)
            weights += x.numel()
        sync()
        one_by_one = time.perf_counter() - t0
        seconds += one_by_one
        # the same tensor in passes of many experts, each row with its expert's importance (as the stream does)
        ims = [im for _, im, _ in units]
        if len({x.shape[1] for x, _, _ in units}) == 1 and (all(i is None for i in ims) or
                                                             all(i is not None for i in ims)):
            x = torch.cat([u[0] for u in units])
            im = None if ims[0] is None else torch.cat([i.expand(len(u[0]), -1) for i, u in zip(ims, units)])
            step = max(1, gpu_encode.chunk_weights_for(job.qtype) // x.shape[1])
            sync()
            t0 = time.perf_counter()
            for r0 in range(0, x.shape[0], step):
                gpu_encode.encode_tensor(x[r0:r0 + step], job.qtype, None if im is None else im[r0:r0 + step],
                                         first_row=r0, name=job.name)
            sync()
            batched += time.perf_counter() - t0
            del x, im
        else:
            batched += one_by_one
        del units
    return {"seconds": seconds, "batched_seconds": batched, "weights": weights, "warmup_seconds": warm,
            "cpu_type_bytes": skipped}


# -- (c) convert --------------------------------------------------------------------------------------------------

CHECKOUT = Path(__file__).resolve().parent.parent


def tree_dir(tree: Path | None) -> Path:
    """Where ``tree``'s commands run (a directory holding ``quantkit/``; default this checkout): ``python -c`` puts
    its working directory first on the path, ahead of PYTHONPATH, so only a run inside the tree imports its code."""
    return (tree or CHECKOUT).resolve()


def tree_env(tree: Path | None) -> dict | None:
    """The environment of ``tree``'s commands: another checkout keeps its compiled ``kq_search.cu`` in a torch
    extension folder of its own (torch's cache holds one build per name, so two trees with different kernels
    would rebuild it at every run, inside the timed convert)."""
    if tree is None:
        return None
    key = hashlib.sha256(str(tree_dir(tree)).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"quantkit-bench-ext-{key}"
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}


def warm_tree(tree: Path, device: str) -> None:
    """Build (or load) ``tree``'s search kernels before its timed runs, as this tree's were by the encode bench."""
    if not device.startswith("cuda"):
        return
    proc, timing = run_timed([sys.executable, "-c", "from quantkit.kernels import gpu_encode; "
                              "assert gpu_encode.search_extension('cuda') is not None"],
                             env=tree_env(tree), cwd=tree_dir(tree))
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: its search kernels did not build:\n{proc.stderr[-3000:]}")
    emit({"name": f"kernels of {tree} built or loaded", "seconds": timing["wall_s"]})


def check_tree(tree: Path | None) -> None:
    """Stop unless a command run in ``tree`` imports ``tree``'s quantkit (an A/B of one tree against itself proves
    nothing)."""
    found = subprocess.run([sys.executable, "-c", "import quantkit; print(quantkit.__file__)"], capture_output=True,
                           text=True, cwd=tree_dir(tree)).stdout.strip()
    wanted = (tree or CHECKOUT).resolve()
    if not Path(found).resolve().is_relative_to(wanted):
        raise SystemExit(f"{wanted}: its command imports quantkit from {found or 'nowhere'}")


def run_convert(ckpt: Path, out: Path, recipe: Path, imatrix: Path, jobs: int, device: str,
                tree: Path | None = None) -> dict:
    """(c): the whole command, from this checkout or from ``tree`` (another checkout)."""
    ckpt, out, recipe, imatrix = (p.resolve() for p in (ckpt, out, recipe, imatrix))
    report = out.with_suffix(".json")
    command = [*QUANTKIT, "convert", str(ckpt), "-o", str(out), "--recipe", str(recipe), "--imatrix", str(imatrix),
               "--allow-synthetic-imatrix", "--pre-tokenizer", PRE_TOKENIZER, "-j", str(jobs), "--device", device,
               "--no-progress", "--report", str(report), "--force"]
    proc, timing = run_timed(command, env=tree_env(tree), cwd=tree_dir(tree))
    if proc.returncode != 0:
        raise SystemExit(f"convert failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rep = json.loads(report.read_text())
    digest = hashlib.sha256()
    hash_start = time.perf_counter()      # (d): the output just written, so in the page cache
    with open(out, "rb") as f:
        while block := f.read(64 << 20):
            digest.update(block)
    hash_s = time.perf_counter() - hash_start
    out.unlink()
    report.unlink()
    return {**timing, "sha256": digest.hexdigest(), "hash_s": hash_s, "prepare_s": rep["prepare_seconds"],
            "executor_s": rep["wall_seconds"], "phases_s": rep["phases"],
            "jobs_used": rep["jobs"], "slowest_tensors": sorted(((d["seconds"], d["name"]) for d in rep["produced"]),
                                                                reverse=True)[:6],
            "tensor_seconds": rep["tensor_seconds"], "file_size": rep["file_size"],
            "stream_s": rep["stream_seconds"], "stream_wall_s": rep["stream_wall_seconds"],
            "by_kind": _by_kind(rep["produced"])}


def _by_kind(produced: list[dict]) -> dict:
    """Tensor seconds and output bytes summed by the name's last two parts (``ffn_gate_exps.weight``), with the
    first tensor of each kind apart (it pays the kind's first kernel launch): the stream's steady state."""
    kinds: dict[str, dict] = {}
    for d in produced:
        kind = ".".join(d["name"].split(".")[-2:])
        k = kinds.setdefault(kind, {"count": 0, "first_s": d["seconds"], "rest_s": 0.0, "out_bytes": 0})
        if k["count"]:
            k["rest_s"] += d["seconds"]
        k["count"] += 1
        k["out_bytes"] += d["nbytes"]
    return kinds


def fixed_costs(ckpt: Path, recipe: Path, imatrix: Path, device: str) -> dict:
    """Wall of the parts every convert pays whatever its size: torch with a CUDA context, and the dry run."""
    torch_proc, torch_t = run_timed([sys.executable, "-c", f"import torch; torch.zeros(1, device={device!r})"])
    block = bytes(256 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(block).hexdigest()
    sha_rate = len(block) / (time.perf_counter() - t0)
    dry, dry_t = run_timed([*QUANTKIT, "convert", str(ckpt), "-o",
                            str(ckpt.parent / "dry.gguf"), "--recipe", str(recipe), "--imatrix", str(imatrix),
                            "--allow-synthetic-imatrix", "--pre-tokenizer", PRE_TOKENIZER, "--dry-run"])
    if torch_proc.returncode or dry.returncode:
        raise SystemExit(f"fixed-cost runs failed:\n{torch_proc.stderr[-2000:]}\n{dry.stderr[-2000:]}")
    return {"torch_with_context_s": torch_t["wall_s"], "dry_run_s": dry_t["wall_s"],
            "sha256_bytes_per_s_one_thread": sha_rate}


def profile_convert(ckpt: Path, out: Path, recipe: Path, imatrix: Path, device: str, path: Path) -> None:
    """A ``-j 1`` convert under the stack sampler (bench/_sampler.py): where every thread spends its wall time."""
    args = ["convert", str(ckpt), "-o", str(out), "--recipe", str(recipe), "--imatrix", str(imatrix),
            "--allow-synthetic-imatrix", "--pre-tokenizer", PRE_TOKENIZER, "-j", "1", "--device", device,
            "--no-progress", "--force"]
    proc, timing = run_timed([sys.executable, str(Path(__file__).with_name("_sampler.py")), str(path), "--",
                              "quantkit", *args])
    if proc.returncode != 0:
        raise SystemExit(f"sampled convert failed:\n{proc.stderr[-4000:]}")
    out.unlink()


def make_source(root: Path, gib: float, workdir: str, processes: int | None, experts: int
                ) -> tuple[Path, Path, int]:
    """The seeded checkpoint of at least ``gib`` GiB with ``experts`` routed experts a layer in ``root/ckpt``
    (``processes`` writing its shards) and its synthetic imatrix."""
    layers = layers_for(gib, workdir, 1.5, 2 * GIB, experts)
    ckpt, source_bytes = synthetic_checkpoint(root, layers, "convert-gpu", processes, experts)
    os.sync()
    imatrix = root / "bench.imatrix.gguf"
    write_synthetic_imatrix(ckpt, imatrix, seed=1, dataset="synthetic:bench")
    return ckpt, imatrix, source_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="checkpoint size at least this many GiB")
    parser.add_argument("--jobs", default="1,2,4", help="process counts, comma-separated")
    parser.add_argument("--recipe", default="iq2", help=f"comma-separated, of {sorted(RECIPES)}")
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--device", default="cuda", help="the GPU (cpu runs torch's CPU encoders: a smoke test)")
    parser.add_argument("--check-layers", type=int, default=1, help="layers of the CPU = GPU check (0: skip it)")
    parser.add_argument("--make-source", type=Path, help="write the checkpoint and imatrix here, then exit")
    parser.add_argument("--source", type=Path, help="a directory --make-source wrote (kept)")
    parser.add_argument("--experts", type=int, default=EXPERTS,
                        help="routed experts a layer (256: a 284B-class model's tensor sizes and count per layer)")
    parser.add_argument("--gen-processes", type=int,
                        help="processes writing the checkpoint's shards [default: every CPU] (the bytes do not "
                             "depend on it)")
    parser.add_argument("--profile", type=Path, help="write a stack-sampler report of one -j 1 convert here")
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="another checkout (a directory holding quantkit/): its convert runs right after each "
                             "of this tree's, same source and jobs; wall ratio to this tree's, equal output")
    args = parser.parse_args()
    if args.make_source:
        args.make_source.mkdir(parents=True)
        make_source(args.make_source, args.gib, str(args.make_source), args.gen_processes, args.experts)
        return
    counts = [int(j) for j in args.jobs.split(",")]
    recipes = args.recipe.split(",")
    for tree in [None, *args.compare]:
        check_tree(tree)
    for tree in args.compare:
        warm_tree(tree, args.device)

    root = Path(tempfile.mkdtemp(prefix="quantkit-bench-convert-gpu-", dir=args.workdir))
    records = []
    try:
        if args.source:
            ckpt, imatrix = args.source / "ckpt", args.source / "bench.imatrix.gguf"
            source_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        else:
            ckpt, imatrix, source_bytes = make_source(root, args.gib, args.workdir, args.gen_processes, args.experts)
        for key in recipes:
            recipe = root / f"{key}.toml"
            recipe.write_text(RECIPES[key])
            prepared = prepared_jobs(ckpt, recipe, imatrix)
            encode = time_encode(prepared, imatrix, args.device)
            fixed = fixed_costs(ckpt, recipe, imatrix, args.device)
            emit({"name": "fixed costs", **fixed})
            emit({"name": f"encode on the GPU ({key})", **encode, "weights_per_s": encode["weights"] /
                  encode["seconds"]})
            outputs = set()
            for n in counts:
                read = time_reads(prepared, imatrix, n, widen=True)
                raw = time_reads(prepared, imatrix, n, widen=False) if n == counts[0] else float("nan")
                conv = run_convert(ckpt, root / f"{key}-j{n}.gguf", recipe, imatrix, n, args.device)
                outputs.add(conv.pop("sha256"))
                encode_s = min(encode["seconds"], encode["batched_seconds"])
                bound = max(read, encode_s)
                record = {"name": f"convert --device cuda ({key}) -j {n}", "recipe": key, "jobs": n,
                          "read_s": read, "raw_read_s": raw, "encode_s": encode_s, "convert_s":
                          conv["wall_s"], "ratio": conv["wall_s"] / bound, "target": TARGET,
                          "pass": conv["wall_s"] / bound <= TARGET,
                          "tensors_ratio": conv["phases_s"]["tensors"] / bound, "source_bytes": source_bytes,
                          "hash_ratio": conv["hash_s"] / bound,
                          "rest_s": conv["wall_s"] - conv["prepare_s"] - conv["executor_s"], **conv}
                emit(record)
                records.append(record)
                for tree in args.compare:   # side by side in one run: these machines drift between runs
                    other = run_convert(ckpt, root / f"{key}-j{n}-other.gguf", recipe, imatrix, n, args.device,
                                        tree)
                    outputs.add(other.pop("sha256"))
                    emit({"name": f"convert --device cuda ({key}) -j {n}, {tree}", "tree": str(tree),
                          "convert_s": other["wall_s"], "vs_this_tree": other["wall_s"] / conv["wall_s"],
                          "tensors_s": other["phases_s"]["tensors"], "stream_s": other["stream_s"],
                          "stream_wall_s": other["stream_wall_s"]})
            if args.profile:
                profile_convert(ckpt, root / f"{key}-profile.gguf", recipe, imatrix, args.device, args.profile)
            emit({"name": f"GPU outputs equal across --jobs and trees ({key})", "pass": len(outputs) == 1})
            if args.check_layers:
                small = root / "small"
                small.mkdir()
                ckpt_small, _ = synthetic_checkpoint(small, args.check_layers, "convert-gpu check",
                                                     experts=args.experts)
                imatrix_small = small / "im.gguf"
                write_synthetic_imatrix(ckpt_small, imatrix_small, seed=1, dataset="synthetic:bench")
                cpu = run_convert(ckpt_small, small / "cpu.gguf", recipe, imatrix_small, os.cpu_count(), "cpu")
                gpu = run_convert(ckpt_small, small / "gpu.gguf", recipe, imatrix_small, 1, args.device)
                emit({"name": f"convert --device cuda = CPU file ({key}, {args.check_layers} layer(s))",
                      "pass": cpu["sha256"] == gpu["sha256"], "cpu_wall_s": cpu["wall_s"],
                      "gpu_wall_s": gpu["wall_s"], "bytes": gpu["file_size"]})
                shutil.rmtree(small)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'recipe':<6}{'jobs':>5}{'read s':>9}{'raw s':>8}{'encode s':>10}{'hash s':>8}{'convert s':>11}"
          f"{'prepare':>9}{'executor':>10}{'tensors':>9}{'rest':>7}{'ratio':>8}{'tensors ratio':>15}  pass")
    for r in records:
        print(f"{r['recipe']:<6}{r['jobs']:>5}{r['read_s']:>9.2f}{r['raw_read_s']:>8.2f}{r['encode_s']:>10.2f}"
              f"{r['hash_s']:>8.2f}"
              f"{r['convert_s']:>11.2f}{r['prepare_s']:>9.2f}{r['executor_s']:>10.2f}"
              f"{r['phases_s']['tensors']:>9.2f}{r['rest_s']:>7.2f}{r['ratio']:>8.2f}{r['tensors_ratio']:>15.2f}"
              f"  {r['pass']}")
        if r["stream_s"]:
            print("    stream steps, s: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["stream_s"].items())))
            print("    stream steps' wall, s: " + ", ".join(f"{k} {v:.2f}"
                                                        for k, v in sorted(r["stream_wall_s"].items())))


if __name__ == "__main__":
    main()
