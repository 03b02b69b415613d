"""Plain causal attention on CUDA in float32: torch's SDPA (the runtime's path before: key/value heads repeated,
the memory-efficient kernel) against the one-launch Triton kernel (quantkit.kernels.triton_causal_attention).

    python bench/causal_attention.py [--tokens 512,2048,16384] [--heads 16] [--kv-heads 4] [--dim 128]
        [--repeats 10] [--configs BM,BN,WARPS,STAGES ...]

One sequence, random queries, keys and values (the bench's 7.6B MoE shapes by default).  Prints, per length and
launch (default: the module's own), the best of ``--repeats`` of each, their ratio, the kernel's effective
TFLOP/s (the causal half of 4 n^2 d per head) and the largest difference of the outputs.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _common import emit
from sliding_attention import best_ms
from quantkit.kernels import triton_causal_attention as kernel

LAUNCH = ("BM", "BN", "WARPS", "STAGES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048,16384")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--configs", nargs="*", default=[], help="kernel launches BM,BN,WARPS,STAGES")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    groups = args.heads // args.kv_heads
    for n in (int(t) for t in args.tokens.split(",")):
        query = torch.randn(1, args.heads, n, args.dim, generator=gen, device="cuda") * 0.5
        key = torch.randn(1, args.kv_heads, n, args.dim, generator=gen, device="cuda")
        value = torch.randn(1, args.kv_heads, n, args.dim, generator=gen, device="cuda")
        scale = args.dim ** -0.5

        def sdpa():
            k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
            return F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale).transpose(1, 2)

        sdpa_ms, want = best_ms(sdpa, "cuda", args.repeats)
        flops = 2 * args.heads * n * n * args.dim     # causal half of 4 n^2 d per head
        for config in args.configs or [",".join(str(getattr(kernel, k)) for k in LAUNCH)]:
            for attr, value_ in zip(LAUNCH, config.split(",")):
                setattr(kernel, attr, int(value_))
            kernel_ms, got = best_ms(lambda: kernel.causal_attention(query, key, value, scale), "cuda", args.repeats)
            emit({"name": "causal attention", "launch": config, "tokens": n, "heads": args.heads,
                  "kv_heads": args.kv_heads, "dim": args.dim, "sdpa_ms": round(sdpa_ms, 3),
                  "kernel_ms": round(kernel_ms, 3), "sdpa_over_kernel": sdpa_ms / kernel_ms,
                  "kernel_tflops": flops / kernel_ms / 1e9, "max_abs_difference": float((got - want).abs().max())})


if __name__ == "__main__":
    main()
