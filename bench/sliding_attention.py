"""DeepSeek V4's attention layer: transformers' eager function against the runtime's band (quantkit.runtime.sliding).

    python bench/sliding_attention.py [--device cpu|cuda] [--threads 2] [--tokens 2048] [--repeats 3]
        [--configs BM,BN,BD,DV,WARPS,STAGES ...]

The bench's V4 shapes (bench/score_vs_llamacpp.py ``v4``: 16 heads of 512, one key/value head, a 128-key sliding
window), float32, one sequence: a compressed sparse layer (n/4 compressed entries, each query seeing those of its
complete windows) and a heavily compressed one (n/128).  Prints the best of ``--repeats`` per function, their ratio
and the largest difference of the outputs.  On CUDA also the band in torch operations against the one-launch
kernel (quantkit.kernels.triton_sink_attention), once per launch of ``--configs`` (default: the module's own).
"""
from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import torch

from _common import emit
from quantkit.kernels import triton_sink_attention as kernel
from quantkit.runtime import sliding
from quantkit.testing.tiny_models import build_tiny_model

HEADS, DIM, WINDOW = 16, 512, 128
LAUNCH = ("BM", "BN", "BD", "DV", "WARPS", "STAGES")


def best_ms(function, device: str, repeats: int) -> tuple[float, torch.Tensor]:
    times = []
    for _ in range(repeats + 1):            # the first call warms up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = function()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="*", default=[], help="kernel launches BM,BN,BD,DV,WARPS,STAGES")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = build_tiny_model("deepseek_v4", dtype="f32")     # for transformers' module and its eager function
    attention = next(m for m in model.modules() if type(m).__name__ in sliding.ATTENTIONS)
    eager = sys.modules[type(attention).__module__].eager_attention_forward
    gen = torch.Generator().manual_seed(0)
    layer = SimpleNamespace(sliding_window=WINDOW, num_key_value_groups=HEADS, training=False,
                            sinks=torch.randn(HEADS, generator=gen).to(args.device))
    n = args.tokens
    for name, ratio in (("compressed sparse (n/4 entries)", 4), ("heavily compressed (n/128 entries)", 128)):
        entries = n // ratio
        query = (torch.randn(1, HEADS, n, DIM, generator=gen) * 0.5).to(args.device)   # a spread softmax
        key = torch.randn(1, 1, n + entries, DIM, generator=gen).to(args.device)
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = torch.cat([(k <= q) & (k > q - WINDOW), torch.arange(entries)[None, :] < (q + 1) // ratio], -1)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None].to(args.device)
        scale = DIM ** -0.5
        eager_ms, want = best_ms(lambda: eager(layer, query, key, key, mask, scale)[0], args.device, args.repeats)
        band_ms, got = best_ms(lambda: sliding.torch_banded_sink_attention(layer, query, key, mask, scale),
                               args.device, args.repeats)
        emit({"name": f"V4 attention, {name}", "device": args.device, "threads": args.threads, "tokens": n,
              "eager_ms": round(eager_ms, 2), "band_ms": round(band_ms, 2), "eager_over_band": eager_ms / band_ms,
              "max_abs_difference": float((got - want).abs().max()), "max_abs_output": float(want.abs().max())})
        if args.device != "cuda":
            continue
        for config in args.configs or [",".join(str(getattr(kernel, k)) for k in LAUNCH)]:
            for attr, value in zip(LAUNCH, config.split(",")):
                setattr(kernel, attr, int(value))
            kernel_ms, got = best_ms(lambda: kernel.sink_attention(query, key, mask, layer.sinks, WINDOW, scale),
                                     args.device, args.repeats)
            emit({"name": f"V4 attention kernel, {name}", "launch": config, "tokens": n, "band_ms": round(band_ms, 3),
                  "kernel_ms": round(kernel_ms, 3), "band_over_kernel": band_ms / kernel_ms,
                  "max_abs_difference": float((got - want).abs().max()), "max_abs_output": float(want.abs().max())})


if __name__ == "__main__":
    main()
