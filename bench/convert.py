"""``quantkit convert`` on a large synthetic MoE checkpoint: peak memory and wall time against the bars.

    python bench/convert.py [--gib 8] [--jobs 2] [--recipe q4_k_m-control] [--workdir /tmp]

Generates a seeded BF16 qwen3_moe checkpoint of at least ``--gib`` GiB in a temporary directory (per-expert 2-D
tensors from random bits, one shard per layer, the tiny test tokenizer), converts it with ``quantkit convert`` run under
``/usr/bin/time -v``, and deletes everything afterwards.  Bars (../shared/BENCH.md):

* peak RSS <= 1 GiB + 3 x the largest tensor.  Two figures: ``/usr/bin/time``'s maximum resident set size (the
  largest single process: the parent or one worker) and the peak of the *sum* over the whole process tree,
  sampled every 0.1 s with psutil (the honest figure with several workers).  "Largest tensor" is the largest
  GGUF tensor's source bytes (BF16); the float32 figure is reported too.
* wall time <= 1.15 x (summed per-tensor time / jobs).  The per-tensor time (read, decode, encode, write) comes
  from ``--report``; the wall time is the whole command (interpreter start, planning, hashing the source, spawning
  the workers, encoding, finishing).

Prints one JSON object per measurement (``_common.emit``), then a short table.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from _common import QUANTKIT, emit

from quantkit.io.safetensors import write_safetensors
from quantkit.testing.tiny_models import get_arch
from quantkit.testing.tiny_tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, special_ids

GIB = 1 << 30
HIDDEN = 2048
EXPERT_WIDTH = 768
EXPERTS = 64
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
SEED = 0
#: Scale of the random weights (typical of trained projections).
WEIGHT_STD = 0.02
RSS_BAR_BASE = GIB
RSS_BAR_TENSORS = 3
WALL_BAR = 1.15
SAMPLE_SECONDS = 0.1


def layer_bytes(experts: int = EXPERTS) -> int:
    routed = 3 * experts * EXPERT_WIDTH * HIDDEN
    attention = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2
    return 2 * (routed + attention + experts * HIDDEN)


def config(layers: int, ids: dict[str, int], experts: int = EXPERTS) -> dict:
    # every layer is MoE, so intermediate_size (dense layers) sizes nothing; it stays within the tensors' widths,
    # which quantkit checks a config against (a 512-token vocabulary makes hidden the widest dimension)
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": MODEL_VOCAB_SIZE,
            "hidden_size": HIDDEN, "intermediate_size": HIDDEN, "moe_intermediate_size": EXPERT_WIDTH,
            "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "num_experts": experts, "num_local_experts": experts, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}


def bf16(rng: np.random.Generator, *shape: int, std: float = WEIGHT_STD) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(ml_dtypes.bfloat16)


def bf16_fast(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random BF16 weights straight from random bits (gigabytes per minute instead of per several): random sign
    and mantissa, exponent 120..123, so magnitudes 2^-7 .. 2^-3, every value finite."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return ((bits & np.uint16(_SIGN_EXP2_MANTISSA)) | np.uint16(_EXPONENT_120)).view(ml_dtypes.bfloat16)


_SIGN_EXP2_MANTISSA = 0x81FF   # sign, the two low exponent bits, the 7 mantissa bits
_EXPONENT_120 = 120 << 7


def shard_tensors(shard: int, layers: int, experts: int = EXPERTS) -> list[tuple[str, tuple[int, ...], str]]:
    """Shard ``shard``'s tensors in order: (name, shape, kind), kind "weight" (random, WEIGHT_STD), "norm" (std 1),
    "expert" (:func:`bf16_fast`) or "final_norm" (1 + random).  Shard ``layers`` holds embeddings, head, final norm."""
    if shard == layers:
        return [("model.embed_tokens.weight", (MODEL_VOCAB_SIZE, HIDDEN), "weight"),
                ("lm_head.weight", (MODEL_VOCAB_SIZE, HIDDEN), "weight"),
                ("model.norm.weight", (HIDDEN,), "final_norm")]
    p = f"model.layers.{shard}"
    found = [(f"{p}.self_attn.{name}.weight", shape, "weight")
             for name, shape in (("q_proj", (HEADS * HEAD_DIM, HIDDEN)), ("k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
                                 ("v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)), ("o_proj", (HIDDEN, HEADS * HEAD_DIM)))]
    found += [(f"{p}.self_attn.{name}.weight", (HEAD_DIM,), "norm") for name in ("q_norm", "k_norm")]
    found += [(f"{p}.{name}.weight", (HIDDEN,), "norm") for name in ("input_layernorm", "post_attention_layernorm")]
    found.append((f"{p}.mlp.gate.weight", (experts, HIDDEN), "weight"))
    found += [(f"{p}.mlp.experts.{e}.{name}.weight", shape, "expert") for e in range(experts)
              for name, shape in (("gate_proj", (EXPERT_WIDTH, HIDDEN)), ("up_proj", (EXPERT_WIDTH, HIDDEN)),
                                  ("down_proj", (HIDDEN, EXPERT_WIDTH)))]
    return found


def write_checkpoint(root: Path, layers: int, processes: int = 1, experts: int = EXPERTS) -> Path:
    """Seeded BF16 qwen3_moe checkpoint of ``experts`` routed experts a layer: one shard per layer plus one for
    embeddings, head and final norm, written by ``processes`` processes (each shard seeded by its index: the bytes
    do not depend on how many)."""
    write_config(root, layers, experts)
    shards = layers + 1
    jobs = [(root, shard, layers, experts) for shard in range(shards)]
    if processes > 1:
        with multiprocessing.get_context("spawn").Pool(min(processes, shards)) as pool:
            names = pool.map(_write_shard, jobs, chunksize=1)
    else:
        names = [_write_shard(job) for job in jobs]
    weight_map = {name: shard_name(shard, shards) for shard, shard_names in enumerate(names) for name in shard_names}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def _write_shard(job: tuple[Path, int, int, int]) -> list[str]:
    root, shard, layers, experts = job
    rng = np.random.default_rng([SEED, shard])
    values = {"weight": lambda shape: bf16(rng, *shape), "norm": lambda shape: bf16(rng, *shape, std=1.0),
              "expert": lambda shape: bf16_fast(rng, *shape),
              "final_norm": lambda shape: (1 + bf16(rng, *shape).astype(np.float32)).astype(ml_dtypes.bfloat16)}
    tensors = {name: values[kind](shape) for name, shape, kind in shard_tensors(shard, layers, experts)}
    write_safetensors(root / shard_name(shard, layers + 1), tensors, metadata={"format": "pt"})
    return list(tensors)


def write_config(root: Path, layers: int, experts: int = EXPERTS) -> None:
    """The checkpoint's tokenizer files and config.json."""
    tokens = get_arch("qwen3_moe").tokenizer
    build_tokenizer(tokens).save_pretrained(root)
    (root / "config.json").write_text(json.dumps(config(layers, special_ids(tokens), experts), indent=1))


def shard_name(shard: int, shards: int) -> str:
    return f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"


class TreeSampler:
    """Peak of the summed RSS of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            try:
                for p in [self.root, *self.root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            self.peak = max(self.peak, total)
            time.sleep(SAMPLE_SECONDS)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def synthetic_checkpoint(root: Path, layers: int, bench: str, processes: int | None = None,
                         experts: int = EXPERTS) -> tuple[Path, int]:
    """:func:`write_checkpoint` into ``root/ckpt`` (``processes``: every CPU by default), its size and the time it
    took emitted as a record."""
    processes = processes or os.cpu_count() or 1
    t0 = time.perf_counter()
    (root / "ckpt").mkdir()
    ckpt = write_checkpoint(root / "ckpt", layers, processes, experts)
    source_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    emit({"name": f"{bench} synthetic checkpoint", "layers": layers, "experts": experts, "hidden": HIDDEN,
          "expert_width": EXPERT_WIDTH, "source_bytes": source_bytes, "processes": processes,
          "seconds": time.perf_counter() - t0})
    return ckpt, source_bytes


def layers_for(gib: float, workdir: str, need_per_layer: float, extra: int, experts: int = EXPERTS) -> int:
    """Layers of the synthetic checkpoint of at least ``gib`` GiB, after checking ``workdir`` has room for
    ``need_per_layer`` times a layer's bytes each, plus ``extra`` bytes (else exit naming the shortfall)."""
    layers = max(1, -(-int(gib * GIB) // layer_bytes(experts)))
    need = layers * layer_bytes(experts) * need_per_layer + extra
    free = shutil.disk_usage(workdir).free
    emit({"name": "disk check", "workdir": workdir, "free_bytes": free, "needed_bytes": int(need)})
    if free < need:
        raise SystemExit(f"{workdir} has {free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed")
    return layers


def run_convert(ckpt: Path, out: Path, report: Path, recipe: str, jobs: int) -> dict:
    command = ["/usr/bin/time", "-v", *QUANTKIT, "convert",
               str(ckpt), "-o", str(out), "--recipe", recipe, "--pre-tokenizer", "qwen2", "-j", str(jobs),
               "--no-progress", "--report", str(report), "--force"]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    tree_peak = sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"convert failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    max_rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1)) * 1024
    return {"wall": wall, "time_max_rss": max_rss, "tree_peak_rss": tree_peak, "stdout": stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="checkpoint size at least this many GiB")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--recipe", default="q4_k_m-control")
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()

    layers = layers_for(args.gib, args.workdir, 1.5, 2 * GIB)   # checkpoint, output (< half of it), reserve

    root = Path(tempfile.mkdtemp(prefix="quantkit-bench-convert-", dir=args.workdir))
    try:
        ckpt, source_bytes = synthetic_checkpoint(root, layers, "convert")
        out, report_path = root / "out.gguf", root / "report.json"
        measured = run_convert(ckpt, out, report_path, args.recipe, args.jobs)
        report = json.loads(report_path.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    largest_elements = EXPERTS * EXPERT_WIDTH * HIDDEN
    largest_source = 2 * largest_elements
    rss_bar = RSS_BAR_BASE + RSS_BAR_TENSORS * largest_source
    per_jobs = report["tensor_seconds"] / args.jobs
    records = [
        {"name": "convert peak RSS (process tree, summed)", "quantkit_bytes": measured["tree_peak_rss"],
         "reference_bytes": rss_bar, "ratio": measured["tree_peak_rss"] / rss_bar,
         "reference": "1 GiB + 3 x largest tensor (BF16 source bytes)", "pass": measured["tree_peak_rss"] <= rss_bar,
         "bar_with_f32_tensor": RSS_BAR_BASE + RSS_BAR_TENSORS * 4 * largest_elements},
        {"name": "convert peak RSS (largest process, /usr/bin/time -v)", "quantkit_bytes": measured["time_max_rss"],
         "reference_bytes": rss_bar, "ratio": measured["time_max_rss"] / rss_bar,
         "reference": "1 GiB + 3 x largest tensor (BF16 source bytes)", "pass": measured["time_max_rss"] <= rss_bar},
        {"name": "convert wall time", "quantkit_s": measured["wall"], "reference_s": per_jobs,
         "ratio": measured["wall"] / per_jobs, "reference": f"summed per-tensor time / jobs ({args.jobs})",
         "bar": WALL_BAR, "pass": measured["wall"] / per_jobs <= WALL_BAR,
         "executor_wall_s": report["wall_seconds"], "phases_s": report["phases"], "tensors": report["tensors"],
         "recipe": args.recipe,
         "output_bytes": report["file_size"], "source_bytes": source_bytes},
    ]
    for record in records:
        emit(record)
    print(f"\n{'measure':<52}{'quantkit':>14}{'bar':>14}{'ratio':>8}  pass")
    for r in records:
        mine = r.get("quantkit_bytes", r.get("quantkit_s"))
        bar = r.get("reference_bytes", r.get("reference_s"))
        unit = (lambda v: f"{v / GIB:.2f} GiB") if "quantkit_bytes" in r else (lambda v: f"{v:.1f} s")
        print(f"{r['name']:<52}{unit(mine):>14}{unit(bar):>14}{r['ratio']:>8.3f}  {r['pass']}")


if __name__ == "__main__":
    main()
