"""Fused packed products vs dequantize-then-matmul on CUDA, same payloads, one run (H200).

    python bench/packed_matmul.py [--configs 64x64x64x4x3,128x64x64x8x3] [--cases q,head,7b] [--tokens 512,2048]
        [--dtypes float32,bfloat16] [--repeats 20] [--markdown FILE]

Shapes of the synthetic Qwen3-MoE GGUFs of bench/score_vs_llamacpp.py, one launch as the runtime makes it (one per
GGUF tensor): dense Q8_0 products (attention's query and key projections, the 7b router and the 32000-row output
head, hidden 2048) and the routed experts' Q4_K products grouped by expert (``1b``: 16 experts top-4, width 1024; ``7b``: 64
experts top-8, width 768; gate and up are separate tensors of the same shape), at each ``--tokens`` count.
Reference: the payload decoded by the Triton decoders into a float32 buffer, converted to the compute dtype, then
``torch.matmul`` (dense) or :func:`quantkit.runtime.experts.grouped_linear` (experts) — the runtime's path before
the fused kernels.  Fused: :mod:`quantkit.kernels.triton_matmul` for each launch configuration of ``--configs``
(rows x columns x K-step values x warps x stages; one the device's shared memory cannot hold falls back as the
runtime does, and the row shows the one that ran), and the runtime's own choice (``auto``).  Times are CUDA-event
medians after a warm-up; the ratio is reference time / best fused time (above 1: fused faster).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from _common import emit
from runtime_gpu import cuda_median

from quantkit.formats.registry import GGMLType
from quantkit.kernels import triton_matmul
from quantkit.kernels.triton_dequant import dequantize
from quantkit.runtime.experts import grouped_linear as decoded_grouped_linear

SCALES = {GGMLType.Q4_K: ((0, 1e-4), (2, 1e-4)), GGMLType.Q8_0: ((0, 3e-4),)}
CASES = {  # short name: (name, qtype, experts, top_k, n, k)
    "q": ("dense q_proj", GGMLType.Q8_0, 0, 0, 2048, 2048),
    "kv": ("dense k_proj", GGMLType.Q8_0, 0, 0, 512, 2048),
    "router": ("dense router (7b)", GGMLType.Q8_0, 0, 0, 64, 2048),
    "head": ("dense output", GGMLType.Q8_0, 0, 0, 32000, 2048),
    "1b": ("1b experts gate", GGMLType.Q4_K, 16, 4, 1024, 2048),
    "1b-down": ("1b experts down", GGMLType.Q4_K, 16, 4, 2048, 1024),
    "7b": ("7b experts gate", GGMLType.Q4_K, 64, 8, 768, 2048),
    "7b-down": ("7b experts down", GGMLType.Q4_K, 64, 8, 2048, 768),
}


def payload(qtype: GGMLType, rows: int, k: int, rng) -> torch.Tensor:
    """Random blocks with fixed f16 scales (weights of ~0.02, as bench/runtime_gpu.py's synthetic model)."""
    block, size = triton_matmul.block_shape(qtype)
    raw = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for offset, value in SCALES[qtype]:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return torch.from_numpy(raw).cuda()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up (CUDA events)."""
    fn()
    return statistics.median(cuda_median(fn, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="64x64x64x4x3,128x64x64x8x3,128x128x64x8x3")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    configs = [triton_matmul.Config(*(int(v) for v in c.split("x"))) for c in args.configs.split(",")] + [None]
    names = args.configs.split(",") + ["auto"]
    lines = ["| case | tokens | dtype | decode+matmul ms | " + " | ".join(f"{c} ms" for c in names)
             + " | best ratio |", "|---" * (5 + len(configs)) + "|"]
    for name, qtype, n_experts, top_k, n, k in (CASES[c] for c in args.cases.split(",")):
        w = payload(qtype, max(n_experts, 1) * n, k, rng)
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows = tokens * max(top_k, 1)
            if n_experts:
                experts = torch.sort(torch.randint(0, n_experts, (rows,), device="cuda")).values
                counts = torch.bincount(experts, minlength=n_experts)
            for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                x = (torch.randn(rows, k, device="cuda") * 0.5).to(dtype)
                if n_experts:
                    def reference():
                        weight = dequantize(w, qtype).view(n_experts, n, k).to(dtype)
                        return decoded_grouped_linear(x, weight, experts, counts)
                else:
                    def reference():
                        return x @ dequantize(w, qtype).view(n, k).to(dtype).T
                ref_s = timed(reference, args.repeats)
                want = reference().float()
                cells, best = [], float("inf")
                for label, config in zip(names, configs):
                    if n_experts:
                        tiles = triton_matmul.expert_tiles(counts, rows, (config or triton_matmul.GROUPED).block_m)

                        def fused():
                            return triton_matmul.grouped_linear(x, w, qtype, n, counts, tiles=tiles, config=config)
                    else:
                        def fused():
                            return triton_matmul.linear(x, w, qtype, n, config=config)
                    try:
                        fused_s = timed(fused, args.repeats)
                    except Exception as exc:        # a config no fallback fits: recorded, the sweep goes on
                        emit({"name": f"{name} {tokens} {dtype} {label}", "error": repr(exc)[:300]})
                        cells.append("fails")
                        continue
                    asked = config or (triton_matmul.GROUPED if n_experts else triton_matmul.NARROW
                                       if n <= triton_matmul.NARROW_N else triton_matmul.DENSE)
                    ran = triton_matmul._fitting[qtype.name, dtype == torch.float32,
                                                 triton_matmul.FLOAT32_PRECISION, x.device, asked]
                    err = float((fused().float() - want).abs().max() / want.abs().max())
                    emit({"name": f"{name} {tokens} {dtype} {label}", "ran": str(ran), "fused_s": fused_s,
                          "reference_s": ref_s, "ratio": ref_s / fused_s, "max_rel_err": err,
                          "tflops": 2 * rows * n * k / fused_s / 1e12})
                    best = min(best, fused_s)
                    ran_label = "x".join(str(v) for v in (ran.block_m, ran.block_n, ran.block_k, ran.warps,
                                                          ran.stages))
                    cells.append(f"{fused_s * 1e3:.3f}" + ("" if ran_label == label else f" ({ran_label})"))
                lines.append(f"| {name} | {tokens} | {str(dtype).removeprefix('torch.')} | {ref_s * 1e3:.3f} | "
                             + " | ".join(cells) + f" | {ref_s / best:.2f}x |")
                print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
