"""ggml's own encoders and decoders, called through ctypes: the judge for byte-identity tests and benches; and
its CPU backend's activation quantizers (:func:`cpu_activations`) and matrix product (:func:`mul_mat`, one
``ggml_mul_mat`` with the weight in plain or repacked buffers), the judges of llama.cpp's arithmetic.

The library is ``libggml-base.so`` from llama-cpp-python 0.3.36 (the ``interop`` extra).  Tests and ``bench/``
import it; of quantkit's own code only the runtime's ``ggml-cpu`` arithmetic does
(:mod:`quantkit.runtime.ggml_arithmetic`), when it loads.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from .formats.registry import GGMLType, get_format


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


# -- ggml's CPU matrix product, one op at a time ------------------------------------------------------------------

class _InitParams(ctypes.Structure):      # struct ggml_init_params (ggml.h)
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _Tensor(ctypes.Structure):          # the head of struct ggml_tensor (ggml.h), up to its ``extra`` pointer
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p)]


class _ComputePlan(ctypes.Structure):   # struct ggml_cplan (ggml-cpu.h)
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


@functools.lru_cache(maxsize=1)
def _graph_api() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    base, cpu = library(), cpu_library()
    ptr = ctypes.c_void_p
    base.ggml_init.restype, base.ggml_init.argtypes = ptr, [_InitParams]
    base.ggml_new_tensor_2d.restype = ptr
    base.ggml_new_tensor_2d.argtypes = [ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_new_tensor_3d.restype = ptr
    base.ggml_new_tensor_3d.argtypes = [ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    base.ggml_silu.restype, base.ggml_silu.argtypes = ptr, [ptr, ptr]
    base.ggml_sigmoid.restype, base.ggml_sigmoid.argtypes = ptr, [ptr, ptr]
    base.ggml_soft_max_ext.restype = ptr
    base.ggml_soft_max_ext.argtypes = [ptr, ptr, ptr, ctypes.c_float, ctypes.c_float]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = ptr, [ptr, ptr, ptr]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = ptr, [ptr]
    base.ggml_build_forward_expand.argtypes = [ptr, ptr]
    base.ggml_free.argtypes = [ptr]
    base.ggml_graph_overhead.restype = ctypes.c_size_t
    base.ggml_backend_reg_get_proc_address.restype = ptr
    base.ggml_backend_reg_get_proc_address.argtypes = [ptr, ctypes.c_char_p]
    base.ggml_backend_reg_dev_get.restype, base.ggml_backend_reg_dev_get.argtypes = ptr, [ptr, ctypes.c_size_t]
    base.ggml_backend_buft_name.restype, base.ggml_backend_buft_name.argtypes = ctypes.c_char_p, [ptr]
    base.ggml_backend_alloc_ctx_tensors_from_buft.restype = ptr
    base.ggml_backend_alloc_ctx_tensors_from_buft.argtypes = [ptr, ptr]
    base.ggml_backend_tensor_set.argtypes = [ptr, ptr, ctypes.c_size_t, ctypes.c_size_t]
    base.ggml_backend_buffer_free.argtypes = [ptr]
    cpu.ggml_backend_cpu_reg.restype = ptr
    cpu.ggml_graph_plan.restype, cpu.ggml_graph_plan.argtypes = _ComputePlan, [ptr, ctypes.c_int, ptr]
    cpu.ggml_graph_compute.restype = ctypes.c_int
    cpu.ggml_graph_compute.argtypes = [ptr, ctypes.POINTER(_ComputePlan)]
    cpu.ggml_cpu_init()
    return base, cpu


def _repack_buffer_type(base: ctypes.CDLL, cpu: ctypes.CDLL):
    """The CPU backend's ``CPU_REPACK`` buffer type (llama.cpp's default home for weights it can interleave)."""
    reg = cpu.ggml_backend_cpu_reg()
    extra_bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(
        base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts"))
    found = extra_bufts(base.ggml_backend_reg_dev_get(reg, 0))
    i = 0
    while found[i]:
        if base.ggml_backend_buft_name(found[i]) == b"CPU_REPACK":
            return found[i]
        i += 1
    raise GGMLUnavailable("this ggml CPU backend has no CPU_REPACK buffer type")


def mul_mat(qtype, payload: np.ndarray, rows: int, x: np.ndarray, *, repack: bool = False, expert: bool = False,
            threads: int = 2) -> np.ndarray:
    """``x[n, k] @ W.T`` as ggml's CPU backend computes one ``ggml_mul_mat`` (float32 ``[n, rows]``): ``W`` is the
    ``rows x k`` weight whose GGUF payload is ``payload`` (``qtype``), ``x`` float32 activations.  ggml converts the
    activations to the weight's vec_dot_type and picks its kernel (vec_dot, llamafile's sgemm, its tiled K-quant
    kernel) as it does inside llama.cpp's graph.  ``repack=True`` places the weight in the ``CPU_REPACK`` buffer
    first, as llama.cpp does by default (without ``--no-repack``), when ggml has an interleaved layout for it on
    this CPU; the product then runs ggml's interleaved kernels.  ``expert=True``: ``W`` is one expert of a
    ``MUL_MAT_ID``, whose repacked form multiplies each activation row on its own (ggml's gemv kernel)."""
    base, cpu = _graph_api()
    fmt = get_format(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x.shape
    raw = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
    if raw.nbytes != rows * fmt.row_bytes(k):
        raise ValueError(f"{fmt.name}: {raw.nbytes} bytes for {rows} rows of {k}, expected {rows * fmt.row_bytes(k)}")
    weights_ctx = base.ggml_init(_InitParams(1 << 16, None, True))
    # the operands, the result and a graph; the work buffer is allocated apart, at the size ggml plans
    size = raw.nbytes + x.nbytes + n * rows * 4 + base.ggml_graph_overhead() + (1 << 16)
    ctx = base.ggml_init(_InitParams(size, None, False))
    buffer = None
    try:
        weight = None
        if repack:
            packed = base.ggml_new_tensor_2d(weights_ctx, int(fmt.qtype), k, rows)
            buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(weights_ctx, _repack_buffer_type(base, cpu))
            if _Tensor.from_address(packed).extra:      # ggml has an interleaved layout for this type and shape
                base.ggml_backend_tensor_set(packed, raw.ctypes.data, 0, raw.nbytes)
                weight = packed
        if weight is None:
            weight = base.ggml_new_tensor_2d(ctx, int(fmt.qtype), k, rows)
            ctypes.memmove(_Tensor.from_address(weight).data, raw.ctypes.data, raw.nbytes)
        if expert and buffer and weight == packed:
            return np.concatenate([mul_mat_rows(base, weight, x[i:i + 1], rows, threads) for i in range(n)])
        activations = base.ggml_new_tensor_2d(ctx, 0, k, n)       # GGML_TYPE_F32
        ctypes.memmove(_Tensor.from_address(activations).data, x.ctypes.data, x.nbytes)
        return _compute(ctx, base.ggml_mul_mat(ctx, weight, activations), (n, rows), threads)
    finally:
        if buffer:
            base.ggml_backend_buffer_free(buffer)
        base.ggml_free(ctx)
        base.ggml_free(weights_ctx)


def mul_mat_rows(base, weight, x: np.ndarray, rows: int, threads: int) -> np.ndarray:
    """``ggml_mul_mat(weight, x)`` for a weight tensor already placed (in its own context): ``[len(x), rows]``."""
    ctx = base.ggml_init(_InitParams(x.nbytes + x.shape[0] * rows * 4 + base.ggml_graph_overhead() + (1 << 16),
                                     None, False))
    try:
        activations = base.ggml_new_tensor_2d(ctx, 0, x.shape[1], x.shape[0])
        ctypes.memmove(_Tensor.from_address(activations).data, np.ascontiguousarray(x).ctypes.data, x.nbytes)
        return _compute(ctx, base.ggml_mul_mat(ctx, weight, activations), (x.shape[0], rows), threads)
    finally:
        base.ggml_free(ctx)


def _compute(ctx, out, shape: tuple[int, ...], threads: int) -> np.ndarray:
    """Run the graph ending in ``out`` (float32) on the CPU backend; its values, numpy ``shape``."""
    base, cpu = _graph_api()
    graph = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(graph, out)
    plan = cpu.ggml_graph_plan(graph, threads, None)
    work = np.zeros(max(plan.work_size, 1), dtype=np.uint8)
    plan.work_data = work.ctypes.data
    status = cpu.ggml_graph_compute(graph, ctypes.byref(plan))
    if status != 0:
        raise RuntimeError(f"ggml_graph_compute failed (status {status})")
    result = (ctypes.c_float * int(np.prod(shape))).from_address(_Tensor.from_address(out).data)
    return np.ctypeslib.as_array(result).reshape(shape).copy()


def _float_op(build, *arrays: np.ndarray, threads: int = 2) -> np.ndarray:
    """``build(ctx, *tensors)`` on float32 copies of ``arrays`` (at most 3-D, numpy order): ggml's result, the
    first array's shape."""
    base, _ = _graph_api()
    arrays = tuple(np.ascontiguousarray(a, dtype=np.float32) for a in arrays)
    size = 3 * sum(a.nbytes for a in arrays) + base.ggml_graph_overhead() + (1 << 16)
    ctx = base.ggml_init(_InitParams(size, None, False))
    try:
        tensors = []
        for a in arrays:
            ne = a.shape[::-1] + (1,) * (3 - a.ndim)
            t = base.ggml_new_tensor_3d(ctx, 0, *ne)                    # GGML_TYPE_F32
            ctypes.memmove(_Tensor.from_address(t).data, a.ctypes.data, a.nbytes)
            tensors.append(t)
        return _compute(ctx, build(base, ctx, *tensors), arrays[0].shape, threads)
    finally:
        base.ggml_free(ctx)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """ggml's ``sigmoid`` on the CPU (``1 / (1 + expf(-x))``)."""
    return _float_op(lambda base, ctx, a: base.ggml_sigmoid(ctx, a), x)


def silu(x: np.ndarray) -> np.ndarray:
    """ggml's ``silu`` on the CPU (its own vectorized exponential: not ``x * sigmoid(x)`` rounded correctly)."""
    return _float_op(lambda base, ctx, a: base.ggml_silu(ctx, a), x)


def soft_max(x: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """ggml's ``soft_max_ext(x, mask, scale)`` on the CPU over the last axis of ``x[heads, rows, n]``: ``softmax(x *
    scale + mask)``, ``mask[rows, n]`` (0 or -inf) shared by the heads."""
    return _float_op(lambda base, ctx, a, m: base.ggml_soft_max_ext(ctx, a, m, scale, 0.0), x, mask)
