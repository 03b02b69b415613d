"""GPU runtime speed (H200): Triton dequantization bandwidth vs a device copy, and scored tokens/s of a ~1B MoE.

    python bench/runtime_gpu.py [--types Q8_0,Q4_K] [--values 268435456] [--repeats 7] [--tokens 512]
                                [--skip-model] [--markdown FILE]

1. Per GGML type: random blocks decoding to ``--values`` float32 values are first checked bit for bit against the
   CPU (numba) decoder on a sample, then timed with CUDA events, interleaved with a device-to-device copy of a
   buffer the size of the output: GB/s = (bytes read + bytes written) / time for both, and the ratio (bar >= 70%,
   ../shared/BENCH.md).  Medians of ``--repeats`` after a warm-up.
2. A synthetic Qwen3-MoE of about 1e9 parameters (Q4_K routed experts, Q8_0 other matrices, F32 vectors; random
   blocks with fixed scales so activations stay finite) is written as a GGUF and scored by the runtime on CUDA,
   payloads resident on the device and streamed from the mapped file: teacher-forced tokens/s over
   ``--tokens``-token sequences (one :func:`quantkit.runtime.logits` call each), peak device memory against the
   file size.

Prints one JSON object per measurement, then a markdown table (also written to ``--markdown``).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from _common import emit
from synthetic_gguf import SYNTHETIC, write_synthetic

from quantkit.formats.registry import GGMLType
from quantkit.kernels.dequant import FAST_DECODERS
from quantkit.kernels.triton_dequant import TRITON_TYPES, dequantize
from quantkit.runtime import load_model, logits

BAR = 0.70
CHECK_BLOCKS = 8192


def cuda_median(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def bench_type(name: str, values: int, repeats: int) -> dict:
    qtype = GGMLType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    sample = rng.integers(0, 256, size=(CHECK_BLOCKS, size), dtype=np.uint8)
    ref = FAST_DECODERS[qtype](sample).reshape(-1)
    got = dequantize(torch.from_numpy(sample).cuda(), qtype).cpu().numpy()
    nan = np.isnan(ref)
    identical = bool(np.array_equal(nan, np.isnan(got)) and np.array_equal(ref[~nan].view(np.uint32),
                                                                          got[~nan].view(np.uint32)))
    n_blocks = values // block
    packed = torch.randint(0, 256, (n_blocks * size,), dtype=torch.uint8, device="cuda")
    out = torch.empty(n_blocks * block, dtype=torch.float32, device="cuda")
    src = torch.empty_like(out).uniform_()
    dst = torch.empty_like(out)
    dequantize(packed, qtype, out)
    dst.copy_(src)
    torch.cuda.synchronize()
    t_deq, t_copy = [], []
    for _ in range(repeats):         # interleaved: drift hits both alike
        t_deq += cuda_median(lambda: dequantize(packed, qtype, out), 1)
        t_copy += cuda_median(lambda: dst.copy_(src), 1)
    moved = packed.numel() + out.numel() * 4
    deq_gbs = moved / statistics.median(t_deq) / 1e9
    copy_gbs = 2 * out.numel() * 4 / statistics.median(t_copy) / 1e9
    rec = {"name": f"dequant {name}", "values": out.numel(), "bytes_read": packed.numel(),
           "dequant_gb_s": deq_gbs, "copy_gb_s": copy_gbs, "ratio": deq_gbs / copy_gbs,
           "bit_identical_sample": identical, "bar": BAR}
    emit(rec)
    return rec


def _score(path: Path, tokens: int, repeats: int, stream: bool) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = load_model(path, device="cuda", stream=stream)
    load_s = time.perf_counter() - t0
    ids = np.random.default_rng(1).integers(3, SYNTHETIC["vocab_size"], size=tokens).tolist()
    logits(model, ids)               # warm-up: Triton compiles, cuBLAS picks kernels
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits(model, ids)
        times.append(time.perf_counter() - t0)
    rec = {"device_payload_bytes": model.store.device_bytes, "peak_device_bytes": torch.cuda.max_memory_allocated(),
           "tokens_per_s": tokens / statistics.median(times), "load_s": load_s}
    model.close()
    return rec


def bench_model(tokens: int, repeats: int) -> dict:
    """Scored tokens/s with the payloads on the device, and streamed from the mapped file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic-moe.gguf"
        params = write_synthetic(path, SYNTHETIC)
        rec = {"name": "score synthetic qwen3_moe", "parameters": params, "file_bytes": path.stat().st_size,
               "tokens_per_call": tokens, "resident": _score(path, tokens, repeats, False),
               "streamed": _score(path, tokens, repeats, True)}
    emit(rec)
    return rec


def markdown(types: list[dict], model: dict | None) -> str:
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| type | values | dequant GB/s (read+write) | copy GB/s | ratio | bar 70% | bit-identical sample |",
             "|---|---|---|---|---|---|---|"]
    for r in types:
        lines.append(f"| {r['name'].split()[-1]} | {r['values']:,} | {r['dequant_gb_s']:.0f} | {r['copy_gb_s']:.0f} | "
                     f"{r['ratio']:.2f} | {'pass' if r['ratio'] >= BAR else 'FAIL'} | {r['bit_identical_sample']} |")
    if model:
        lines += ["", f"Synthetic Qwen3-MoE, {model['parameters'] / 1e9:.2f}B parameters (Q4_K experts, Q8_0 "
                      f"matrices), file {model['file_bytes'] / 2**30:.2f} GiB, {model['tokens_per_call']}-token "
                      f"sequences, one forward each:", "",
                  "| payloads | scored tokens/s | payload on device GiB | peak device memory GiB | load s |",
                  "|---|---|---|---|---|"]
        for kind in ("resident", "streamed"):
            r = model[kind]
            lines.append(f"| {kind} | {r['tokens_per_s']:.0f} | {r['device_payload_bytes'] / 2**30:.2f} | "
                         f"{r['peak_device_bytes'] / 2**30:.2f} | {r['load_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default=",".join(sorted(t.name for t in TRITON_TYPES if t is not GGMLType.F32)))
    parser.add_argument("--values", type=int, default=1 << 28)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    types = [bench_type(name, args.values, args.repeats) for name in args.types.split(",")]
    model = None if args.skip_model else bench_model(args.tokens, args.repeats)
    table = markdown(types, model)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
