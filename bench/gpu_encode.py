"""GPU encoder speed: quantkit's torch encoders on CUDA vs ggml (1 thread) and quantkit's CPU encoders (numba,
1 and 2 threads and every core), same host, same run; every GPU byte checked against the CPU encoder first.

    python bench/gpu_encode.py [--types Q4_K,Q2_K] [--rows 8192] [--cols 4096] [--cpu-rows 256] [--repeats 5]

GPU figures: ``device`` times the encode of a tensor already on the GPU (synchronized), ``host`` the whole
numpy → GPU → numpy path (:func:`quantkit.kernels.gpu_encode.encode`, chunked, copies overlapped).  CPU
figures are measured on ``--cpu-rows`` rows of the same tensor.  Prints one JSON object per measurement, then a
table.  Targets (issue 17, one H200): IQ2_XXS >= 0.85 G weights/s; Q2_K/Q4_K >= 20 G weights/s with imatrix.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch

from _common import emit, interleaved_medians

from quantkit import encode
from quantkit.formats import get_format
from quantkit.kernels import gpu_encode
from quantkit import ggml_ref
from quantkit.testing import corpus

CASES = [("Q8_0", False), ("MXFP4", False), ("NVFP4", False), ("Q4_K", False), ("Q4_K", True), ("Q2_K", False),
         ("Q2_K", True), ("IQ2_XXS", True)]


def _cuda_median(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench(name: str, with_imatrix: bool, x: np.ndarray, cpu_rows: int, repeats: int) -> dict:
    fmt = get_format(name)
    n = x.shape[1]
    im = corpus.imatrix("random", n, 1) if with_imatrix else None
    xs = x[:cpu_rows]
    gpu_bytes = gpu_encode.encode(x, name, im, device="cuda")
    identical = bool(np.array_equal(gpu_bytes[:cpu_rows], ggml_ref.quantize(xs, name, im)))
    identical_cpu = bool(np.array_equal(gpu_bytes, encode(x, name, im)))
    xd = torch.from_numpy(x).cuda()
    imd = None if im is None else torch.from_numpy(im).cuda()
    step = max(1, gpu_encode.chunk_weights_for(name) // n)

    def on_device():
        for r in range(0, x.shape[0], step):
            gpu_encode.encode_tensor(xd[r:r + step], name, imd)

    torch.cuda.reset_peak_memory_stats()
    t_dev = _cuda_median(on_device, repeats)
    peak = torch.cuda.max_memory_allocated() - xd.nbytes
    t_host = _cuda_median(lambda: gpu_encode.encode(x, name, im, device="cuda"), repeats)
    numba.set_num_threads(1)
    t_cpu = interleaved_medians({"ggml": lambda: ggml_ref.quantize(xs, name, im),
                                 "quantkit_1t": lambda: encode(xs, name, im)}, repeats=3)
    numba.set_num_threads(2)
    t_cpu.update(interleaved_medians({"quantkit_2t": lambda: encode(xs, name, im)}, repeats=3))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    t_cpu.update(interleaved_medians({"quantkit_all": lambda: encode(xs, name, im)}, repeats=3))
    big, small = x.size, xs.size
    rec = {"name": f"gpu encode {fmt.name}" + (" +imatrix" if with_imatrix else ""),
           "gpu_device_gw_s": big / t_dev / 1e9, "gpu_host_gw_s": big / t_host / 1e9,
           "ggml_1t_mw_s": small / t_cpu["ggml"] / 1e6,
           "quantkit_1t_mw_s": small / t_cpu["quantkit_1t"] / 1e6,
           "quantkit_2t_mw_s": small / t_cpu["quantkit_2t"] / 1e6,
           "quantkit_all_mw_s": small / t_cpu["quantkit_all"] / 1e6,
           "cpu_threads_all": numba.config.NUMBA_NUM_THREADS,
           "gpu_vs_ggml_1t": t_cpu["ggml"] / small * big / t_dev,
           "gpu_vs_quantkit_2t": t_cpu["quantkit_2t"] / small * big / t_dev,
           "byte_identical_ggml": identical, "byte_identical_cpu": identical_cpu,
           "fused_kquant_search": gpu_encode.search_extension("cuda") is not None,
           "gpu_peak_bytes_per_weight": peak / min(big, step * n), "weights_gpu": big, "weights_cpu": small,
           "device": torch.cuda.get_device_name()}
    emit(rec)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=None, help="comma list of TYPE or TYPE+imatrix (default: all cases)")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--cpu-rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cases = CASES if not args.types else [(t.split("+")[0], t.endswith("+imatrix")) for t in args.types.split(",")]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    rows = [bench(name, im, x, args.cpu_rows, args.repeats) for name, im in cases]
    print(f"\n{'type':<18}{'GPU dev Gw/s':>13}{'GPU host Gw/s':>14}{'ggml 1t Mw/s':>13}{'qk 1t':>8}{'qk 2t':>8}"
          f"{'qk all':>8}{'x ggml1t':>9}{'x qk2t':>8}{'B/w':>6}  identical")
    for r in rows:
        print(f"{r['name'][11:]:<18}{r['gpu_device_gw_s']:>13.3f}{r['gpu_host_gw_s']:>14.3f}"
              f"{r['ggml_1t_mw_s']:>13.1f}{r['quantkit_1t_mw_s']:>8.1f}{r['quantkit_2t_mw_s']:>8.1f}"
              f"{r['quantkit_all_mw_s']:>8.1f}{r['gpu_vs_ggml_1t']:>9.0f}{r['gpu_vs_quantkit_2t']:>8.0f}"
              f"{r['gpu_peak_bytes_per_weight']:>6.0f}"
              f"  {r['byte_identical_ggml'] and r['byte_identical_cpu']}")


if __name__ == "__main__":
    main()
