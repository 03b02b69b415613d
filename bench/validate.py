"""What ``quantkit validate`` reads: ``sample`` reads the header and the sampled regions, ``full`` every byte once.

    python bench/validate.py [--layers 21] [--experts 128] [--keep]

Generates (seeded, into a temporary directory under $TMPDIR, deleted afterwards unless ``--keep``) a Qwen3-MoE
checkpoint in BF16 of hidden 2048 with ``--experts`` routed experts of width 512 per layer, converts it with the
shipped ``q8_0`` recipe (an artifact of about 8.3 GiB for 21 layers), then runs ``quantkit validate`` in a child
process per mode after evicting every source and artifact page from the page cache (``posix_fadvise
DONTNEED``).  Bytes read from disk come from the child's ``ru_inblock`` (512-byte units, what /proc/<pid>/io calls
read_bytes); the report's own count of artifact bytes it read and of source bytes it hashed split them.

Prints one JSON object per measurement, then a table.  The disk must hold about 3.2x the artifact size.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import QUANTKIT, emit, evict

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERT_WIDTH, VOCAB = 2048, 16, 4, 128, 512, 512
SEED = 20261130
TIME = "/usr/bin/time"
GIB = 1 << 30


def tensor_shapes(layers: int, experts: int) -> dict[str, tuple[int, ...]]:
    """Source tensors of the synthetic checkpoint, transformers' per-expert Qwen3-MoE names."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate.weight": (experts, HIDDEN)})
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (EXPERT_WIDTH, HIDDEN), q + "up_proj.weight": (EXPERT_WIDTH, HIDDEN),
                           q + "down_proj.weight": (HIDDEN, EXPERT_WIDTH)})
    return shapes


def bf16_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random BF16 bit patterns of magnitude 2^-8 .. 2^-4, either sign (fast: no float arithmetic)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return (bits & 0x807F) | np.uint16(0x3B80) + ((bits >> 7) & 0x3) * np.uint16(0x80)


def write_checkpoint(root: Path, layers: int, experts: int, tiny: Path) -> Path:
    from quantkit.io.safetensors import write_safetensors

    src = root / "source"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny / name).is_file():
            shutil.copyfile(tiny / name, src / name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  moe_intermediate_size=EXPERT_WIDTH, intermediate_size=4 * HIDDEN, num_hidden_layers=layers,
                  num_local_experts=experts, num_experts=experts)
    (src / "config.json").write_text(json.dumps(config, indent=1))
    shapes = tensor_shapes(layers, experts)
    groups: list[list[str]] = [[n for n in shapes if not n.startswith("model.layers.")]]
    groups += [[n for n in shapes if n.startswith(f"model.layers.{layer}.")] for layer in range(layers)]
    rng = np.random.default_rng(SEED)
    weight_map = {}
    for i, names in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        arrays = {n: bf16_weights(rng, shapes[n]) for n in names}
        write_safetensors(src / shard, arrays, metadata={"format": "pt"}, dtypes={n: "BF16" for n in names})
        weight_map.update({n: shard for n in names})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


def resident(paths: list[Path]) -> int:
    """Bytes of these files in the page cache (util-linux ``fincore``), i.e. read since they were evicted."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line) for line in out.split())


def run_measured(args: list[str], evict_paths: list[Path], log: Path) -> dict:
    """Run ``args`` in a child after evicting ``evict_paths``; wall time, bytes read from disk, peak RSS.  The
    child's output goes to ``log`` (a pipe could fill while we wait).  Peak RSS comes from ``/usr/bin/time``: a
    child forked from this process would report this process's own peak (Linux carries it across fork and exec)."""
    evict(evict_paths)
    rss = log.with_suffix(".rss")
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([TIME, "-f", "%M", "-o", str(rss), *args], stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return {"rc": os.waitstatus_to_exitcode(status), "wall_s": time.perf_counter() - t0,
            "disk_read_bytes": usage.ru_inblock * 512, "peak_rss_bytes": int(rss.read_text().split()[-1]) * 1024,
            "output": log.read_text(errors="replace")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=21)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=2, help="convert workers")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to generate (default $TMPDIR)")
    parser.add_argument("--reuse", type=Path, help="a directory a --keep run left: measure again, generate nothing")
    opts = parser.parse_args()

    expected = sum(int(np.prod(s)) for s in tensor_shapes(opts.layers, opts.experts).values())
    need = int(expected * (2 + 1.0625) * 1.05)
    free = shutil.disk_usage(opts.dir).free
    print(f"# {opts.dir}: {free / GIB:.1f} GiB free, need about {need / GIB:.1f} GiB", file=sys.stderr)
    if opts.reuse is None and free < need + 4 * GIB:
        raise SystemExit(f"not enough free space in {opts.dir}")
    root = opts.reuse or Path(tempfile.mkdtemp(prefix="quantkit-bench-validate-", dir=opts.dir))
    src, art = root / "source", root / "synthetic-q8_0.gguf"
    try:
        conv = {"wall_s": None, "peak_rss_bytes": None, "disk_read_bytes": None}
        if opts.reuse is None:
            tiny = Path(subprocess.run([sys.executable, "-c", "import sys; from quantkit.testing.tiny_models import "
                                        "TinyCheckpointCache as C; print(C(sys.argv[1]).get('qwen3_moe'))",
                                        str(root / "tiny")], capture_output=True, text=True, check=True
                                       ).stdout.strip().splitlines()[-1])
            t0 = time.perf_counter()
            write_checkpoint(root, opts.layers, opts.experts, tiny)
            print(f"# generated {src} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            conv = run_measured(QUANTKIT + ["convert", str(src), "-o", str(art), "--recipe", "q8_0", "-j",
                                            str(opts.jobs), "--pre-tokenizer", "qwen2", "--no-progress"],
                                sorted(src.iterdir()), root / "convert.log")
            if conv["rc"] != 0:
                raise SystemExit(conv["output"])
        source_bytes = sum(p.stat().st_size for p in src.iterdir())
        artifact_bytes = art.stat().st_size
        emit({"name": "validate.setup", "artifact_bytes": artifact_bytes, "source_bytes": source_bytes,
              "layers": opts.layers, "experts": opts.experts, "convert_wall_s": conv["wall_s"],
              "convert_peak_rss_bytes": conv["peak_rss_bytes"], "convert_disk_read_bytes": conv["disk_read_bytes"]})
        rows = []
        for mode in ("sample", "full"):
            report_path = root / f"report-{mode}.json"
            r = run_measured(QUANTKIT + ["validate", str(art), "--source", str(src), "--payload", mode, "--report",
                                         str(report_path)], [art, *sorted(src.iterdir())], root / f"{mode}.log")
            report = json.loads(report_path.read_text())
            io = report["io"]
            sources = sorted(p for p in src.iterdir())
            record = {"name": f"validate.{mode}", "rc": r["rc"], "ok": report["ok"], "wall_s": r["wall_s"],
                      "peak_rss_bytes": r["peak_rss_bytes"], "disk_read_bytes": r["disk_read_bytes"],
                      "artifact_bytes": artifact_bytes, "artifact_bytes_read": io["artifact_bytes_read"],
                      "header_bytes": io["header_bytes"], "source_bytes": source_bytes,
                      "source_bytes_hashed": io["source_files_hashed_bytes"],
                      "artifact_bytes_in_page_cache": resident([art]),
                      "source_bytes_in_page_cache": resident(sources),
                      "bytes_compared": sum(t["bytes_compared"] for t in report["tensors"]),
                      "tensors_sampled": sum(t["compared"] == "sample" for t in report["tensors"])}
            emit(record)
            rows.append(record)
        print(f"\n{'mode':8}{'wall s':>8}{'peak RSS':>10}{'disk read':>11}{'artifact: asked':>17}{'cached':>9}"
              f"{'of file':>9}{'source: cached':>16}{'of files':>10}")
        for r in rows:
            print(f"{r['name'][9:]:8}{r['wall_s']:8.1f}{r['peak_rss_bytes'] / GIB:9.2f}G"
                  f"{r['disk_read_bytes'] / GIB:10.2f}G{r['artifact_bytes_read'] / GIB:16.3f}G"
                  f"{r['artifact_bytes_in_page_cache'] / GIB:8.3f}G"
                  f"{r['artifact_bytes_in_page_cache'] / r['artifact_bytes']:9.4f}"
                  f"{r['source_bytes_in_page_cache'] / GIB:15.3f}G"
                  f"{r['source_bytes_in_page_cache'] / r['source_bytes']:10.4f}")
        print(f"artifact {artifact_bytes / GIB:.2f} GiB, source {source_bytes / GIB:.2f} GiB")
    finally:
        if not opts.keep and opts.reuse is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
