"""ggml's own encoders and decoders, called through ctypes: the judge for byte-identity tests and benches.

The library is ``libggml-base.so`` from llama-cpp-python 0.3.36 (the ``interop`` extra).  Nothing here is used
by quantkit's pipelines; tests and ``bench/`` import it.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from ..formats.registry import GGMLType, get_format


class GGMLUnavailable(RuntimeError):
    """llama-cpp-python (with libggml-base) is not installed."""


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    try:
        import llama_cpp  # noqa: F401  (its import loads the shared libraries it ships)
    except Exception as exc:  # noqa: BLE001
        raise GGMLUnavailable(f"llama-cpp-python is not importable: {exc}") from exc
    root = Path(llama_cpp.__file__).resolve().parent
    candidates = sorted(root.rglob("libggml-base.so*")) + sorted(root.rglob("libggml-base.dylib"))
    if not candidates:
        raise GGMLUnavailable(f"no libggml-base shared library under {root}")
    lib = ctypes.CDLL(str(candidates[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def available() -> bool:
    try:
        library()
        return True
    except GGMLUnavailable:
        return False


def quantize(x: np.ndarray, qtype, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk over all rows of float32 ``x[rows, n]``: uint8[rows, row_bytes]."""
    fmt = get_format(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    out = np.zeros((rows, fmt.row_bytes(n)), dtype=np.uint8)
    im = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    if im is not None and im.shape != (n,):
        raise ValueError(f"imatrix shape {im.shape} != ({n},)")
    written = library().ggml_quantize_chunk(int(fmt.qtype), x.ctypes.data, out.ctypes.data, 0, rows, n,
                                            None if im is None else im.ctypes.data)
    if written != out.nbytes:
        raise RuntimeError(f"ggml wrote {written} bytes, expected {out.nbytes}")
    return out


def requires_imatrix(qtype) -> bool:
    return bool(library().ggml_quantize_requires_imatrix(int(get_format(qtype).qtype)))


def validate_row_data(qtype, data: np.ndarray) -> bool:
    data = np.ascontiguousarray(data, dtype=np.uint8)
    return bool(library().ggml_validate_row_data(int(get_format(qtype).qtype), data.ctypes.data, data.nbytes))


def dequantize_row(qtype, data: np.ndarray, n: int) -> np.ndarray:
    """ggml's ``dequantize_row_<type>`` (exported for most types) over ``n`` weights."""
    fmt = get_format(qtype)
    fn = getattr(library(), f"dequantize_row_{_c_name(fmt.qtype)}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.nbytes != fmt.row_bytes(n):
        raise ValueError(f"{fmt.name}: {data.nbytes} bytes for {n} weights, expected {fmt.row_bytes(n)}")
    y = np.zeros(n, dtype=np.float32)
    fn(data.ctypes.data, y.ctypes.data, n)
    return y


def _c_name(qtype: GGMLType) -> str:
    # ggml spells K-quants with a capital K (dequantize_row_q4_K) and everything else lower case.
    name = qtype.name.lower()
    return name[:-2] + "_K" if name.endswith("_k") else name


Q8_1_BLOCK_BYTES = 36


@functools.lru_cache(maxsize=1)
def cpu_library() -> ctypes.CDLL:
    """``libggml-cpu.so``: the CPU backend, with the SIMD activation quantizers its matrix products run."""
    library()
    import llama_cpp

    root = Path(llama_cpp.__file__).resolve().parent
    candidates = sorted(root.rglob("libggml-cpu.so*")) + sorted(root.rglob("libggml-cpu.dylib"))
    if not candidates:
        raise GGMLUnavailable(f"no libggml-cpu shared library under {root}")
    return ctypes.CDLL(str(candidates[0]))


def cpu_activations(vec_dot_type: str, x: np.ndarray) -> np.ndarray:
    """float32 ``x[n]`` as ggml's CPU backend holds it before a product: converted by libggml-cpu's own
    ``quantize_row_<vec_dot_type>`` (the build's SIMD version) and decoded by libggml-base's ``dequantize_row_*``."""
    fmt = get_format(vec_dot_type)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    # Q8_1 blocks are 36 bytes in ggml (fp16 d and sum); gguf-py's table still says 40 (float32 d and sum)
    row_bytes = x.size // 32 * Q8_1_BLOCK_BYTES if fmt.name == "Q8_1" else fmt.row_bytes(x.size)
    packed = np.zeros(row_bytes, dtype=np.uint8)
    fn = getattr(cpu_library(), f"quantize_row_{_c_name(fmt.qtype)}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(x.ctypes.data, packed.ctypes.data, x.size)
    if fmt.name == "Q8_1":      # no dequantize_row_q8_1 in ggml: its blocks are fp16 d, fp16 sum, int8[32]
        blocks = packed.reshape(-1, Q8_1_BLOCK_BYTES)
        scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (blocks[:, 4:].view(np.int8).astype(np.float32) * scale).reshape(-1)
    return dequantize_row(fmt.qtype, packed, x.size)
