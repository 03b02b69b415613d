"""Fused packed products vs dequantize-then-matmul on CUDA, same payloads, one run (H200).

    python bench/packed_matmul.py [--configs 64x64x4x2,128x64x8x3] [--repeats 20] [--markdown FILE]

Shapes of the synthetic Qwen3-MoE GGUFs of bench/score_vs_llamacpp.py: dense Q8_0 products (attention's query
projection and the 32000-row output head, hidden 2048) and the routed experts' Q4_K products grouped by expert
(``1b``: 16 experts top-4, width 1024; ``7b``: 64 experts top-8, width 768), at 512 and 2048 tokens, in float32
and bfloat16.  Reference: the payload decoded by the Triton decoders into a float32 buffer, converted to the
compute dtype, then ``torch.matmul`` (dense) or :func:`quantkit.runtime.experts.grouped_linear` (experts) —
the runtime's path before the fused kernels.  Fused: :mod:`quantkit.kernels.triton_matmul` for each tile
configuration of ``--configs`` (BLOCK_M x BLOCK_N x warps x stages).  Times are CUDA-event medians after a
warm-up; the ratio is reference time / fused time (above 1: fused faster).
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
CASES = [  # name, qtype, experts, top_k, n, k
    ("dense q_proj", GGMLType.Q8_0, 0, 0, 2048, 2048),
    ("dense output", GGMLType.Q8_0, 0, 0, 32000, 2048),
    ("1b experts gate_up", GGMLType.Q4_K, 16, 4, 2048, 2048),
    ("1b experts down", GGMLType.Q4_K, 16, 4, 2048, 1024),
    ("7b experts gate_up", GGMLType.Q4_K, 64, 8, 1536, 2048),
    ("7b experts down", GGMLType.Q4_K, 64, 8, 2048, 768),
]


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
    parser.add_argument("--configs", default="64x64x4x2,128x64x4x3,64x128x4x3,128x128x8x3")
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    lines = ["| case | tokens | dtype | decode+matmul ms | " + " | ".join(f"fused {c} ms" for c in
                                                                       args.configs.split(",")) + " | best ratio |",
             "|---" * (5 + len(configs)) + "|"]
    for name, qtype, n_experts, top_k, n, k in CASES:
        w = payload(qtype, max(n_experts, 1) * n, k, rng)
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows = tokens * max(top_k, 1)
            if n_experts:
                experts = torch.sort(torch.randint(0, n_experts, (rows,), device="cuda")).values
                counts = torch.bincount(experts, minlength=n_experts)
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, k, device="cuda") * 0.5).to(dtype)
                if n_experts:
                    def reference():
                        weight = dequantize(w, qtype).view(n_experts, n, k).to(dtype)
                        return decoded_grouped_linear(x, weight, experts, counts)
                else:
                    def reference():
                        return x @ dequantize(w, qtype).view(n, k).to(dtype).T
                ref_s = timed(reference, args.repeats)
                fused_s = []
                for bm, bn, warps, stages in configs:
                    triton_matmul.BLOCK_M, triton_matmul.NUM_WARPS = bm, warps
                    triton_matmul.LAUNCH_CONFIGS = ((stages, bn),)     # only this one: a misfit fails loudly
                    triton_matmul._fitting.clear()
                    if n_experts:
                        tiles = triton_matmul.expert_tiles(counts, rows)
                        def fused():
                            return triton_matmul.grouped_linear(x, w, qtype, n, counts, tiles=tiles)
                    else:
                        def fused():
                            return triton_matmul.linear(x, w, qtype, n)
                    fused_s.append(timed(fused, args.repeats))
                    got, want = fused().float(), reference().float()
                    err = float((got - want).abs().max() / want.abs().max())
                    emit({"name": f"{name} {tokens} {dtype} {bm}x{bn}x{warps}x{stages}", "fused_s": fused_s[-1],
                          "reference_s": ref_s, "ratio": ref_s / fused_s[-1], "max_rel_err": err})
                lines.append(f"| {name} | {tokens} | {str(dtype).removeprefix('torch.')} | {ref_s * 1e3:.3f} | "
                             + " | ".join(f"{t * 1e3:.3f}" for t in fused_s) + f" | {ref_s / min(fused_s):.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
