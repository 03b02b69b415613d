"""Encoder and decoder speed: quantkit vs ggml (encode) and vs gguf-py (decode), same tensor, same run.

    python bench/encode.py [--types Q4_K,IQ2_XXS] [--repeats 5] [--rows 256] [--cols 4096]

Prints one JSON object per measurement, then a table.  Bars (../shared/BENCH.md): encode >= 1.0x ggml single
thread; 2 threads >= 1.8x 1 thread; decode >= 5x gguf-py; and every encoded byte identical to ggml's.
"""
from __future__ import annotations

import argparse

import numba
import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from _common import emit, interleaved_medians

from quantkit import encode
from quantkit.formats import ImatrixUse, all_formats, decode, get_format
from quantkit import ggml_ref

DEFAULT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
                 "IQ2_XS", "IQ3_XXS", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4"]


def bench_encode(name: str, x: np.ndarray, imatrix, repeats: int) -> dict:
    fmt = get_format(name)
    numba.set_num_threads(1)
    ours = encode(x, name, imatrix)  # warm-up and JIT compile
    ref = ggml_ref.quantize(x, name, imatrix)
    identical = bool(np.array_equal(ours, ref))
    t = interleaved_medians({
        "quantkit": lambda: encode(x, name, imatrix),
        "ggml": lambda: ggml_ref.quantize(x, name, imatrix),
    }, repeats=repeats)
    numba.set_num_threads(2)
    encode(x, name, imatrix)
    t2 = interleaved_medians({"quantkit_2t": lambda: encode(x, name, imatrix)}, repeats=repeats)
    numba.set_num_threads(1)
    n = x.size
    rec = {"name": f"encode {fmt.name}" + (" +imatrix" if imatrix is not None else ""),
           "quantkit_mw_s": n / t["quantkit"] / 1e6, "reference_mw_s": n / t["ggml"] / 1e6,
           "ratio": t["ggml"] / t["quantkit"], "threads2_speedup": t["quantkit"] / t2["quantkit_2t"],
           "byte_identical": identical, "reference": "ggml_quantize_chunk (1 thread)"}
    emit(rec)
    return rec


def bench_decode(name: str, x: np.ndarray, repeats: int) -> dict:
    fmt = get_format(name)
    im = np.ones(x.shape[1], np.float32) if fmt.imatrix is ImatrixUse.REQUIRED else None
    data = ggml_ref.quantize(x, name, im)
    numba.set_num_threads(1)
    ours = decode(data, name, x.shape)
    ref = np.asarray(gguf_dequantize(data.reshape(-1), fmt.qtype), np.float32).reshape(x.shape)
    identical = bool(np.array_equal(ours.view(np.uint32), ref.view(np.uint32)))
    t = interleaved_medians({
        "quantkit": lambda: decode(data, name, x.shape),
        "gguf": lambda: gguf_dequantize(data.reshape(-1), fmt.qtype),
    }, repeats=repeats)
    rec = {"name": f"decode {fmt.name}", "quantkit_mw_s": x.size / t["quantkit"] / 1e6,
           "reference_mw_s": x.size / t["gguf"] / 1e6, "ratio": t["gguf"] / t["quantkit"],
           "bit_identical": identical, "reference": "gguf-py quants.dequantize (numpy)"}
    emit(rec)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.cols)).astype(np.float32)
    imatrix = (rng.random(args.cols).astype(np.float32) + 0.1) ** 2
    rows = []
    for name in args.types.split(","):
        fmt = get_format(name)
        if not fmt.can_encode:
            print(f"# {fmt.name}: no quantkit encoder, skipped")
            continue
        if fmt.imatrix is not ImatrixUse.REQUIRED:
            rows.append(bench_encode(name, x, None, args.repeats))
        if fmt.imatrix is not ImatrixUse.IGNORED:
            rows.append(bench_encode(name, x, imatrix, args.repeats))
        if not args.no_decode:
            rows.append(bench_decode(name, x, args.repeats))
    print(f"\n{'measurement':<24}{'quantkit Mw/s':>15}{'reference Mw/s':>16}{'ratio':>8}{'2t/1t':>8}  identical")
    for r in rows:
        same = r.get("byte_identical", r.get("bit_identical"))
        two = f"{r['threads2_speedup']:.2f}" if "threads2_speedup" in r else "-"
        print(f"{r['name']:<24}{r['quantkit_mw_s']:>15.1f}{r['reference_mw_s']:>16.1f}{r['ratio']:>8.2f}{two:>8}  {same}")


if __name__ == "__main__":
    _ = all_formats()
    main()
