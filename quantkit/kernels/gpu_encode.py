"""torch encoders (CUDA, or the CPU for tests) byte-identical to ggml: Q8_0, MXFP4, NVFP4, Q4_K, Q2_K, IQ2_XXS.

The readable definition of each format stays in :mod:`quantkit.formats` (``legacy``, ``fp4``, ``kquants``); this
module is a third implementation beside the numba kernels, vectorized over blocks for a GPU.  Every step is the
reference's float32 operation sequence, written so that torch cannot reorder or fuse it:

* eager torch (no ``torch.compile``/Triton: Triton contracts ``a*b + c`` into FMA by default and divides
  approximately; ggml's x86-64 baseline build has no FMA), one torch op per C operation, in C's order; the
  hand-written kernels of ``kq_search.cu`` (on CUDA: the K-quant searches make_qkx2/qkx3_quants per sub-block and
  make_qp_quants per super-block, and whole encodes of IQ2_XXS and of the Q2_K/Q4_K imatrix paths) use
  round-to-nearest intrinsics for every operation and are built with ``-fmad=false``;
* divisions are tensor / tensor: torch rewrites ``t / scalar`` as ``t * (1/scalar)`` on CUDA (two roundings)
  and ``scalar / t`` as ``reciprocal(t) * scalar``;
* sequential C sums (``s += term``) are explicit loops over the summed axis, never ``sum``/``cumsum`` (pairwise
  or parallel-scan order rounds differently); max/argmax/argmin reductions are used only where the order
  cannot show (abs maxima; ties to the first index like ggml's strict scans), scans elsewhere (the first of
  ±0 is kept);
* NaN is canonicalized where its bits reach an integer (a CUDA NaN is 0x7FFFFFFF, an x86 one 0xFFC00000):
  ``nearest_int(NaN)`` = 0 and f16(NaN) = 0xFE00, what the x86 build gives;
* ``log2f`` (MXFP4's exponent) is replaced by the float's exponent plus a per-binade threshold table built
  from numpy's float32 ``log2``, which the fp4 module documents as equal to glibc's on every positive float32;
* ``sqrtf`` goes through float64 (torch's float32 sqrt on the CPU is not correctly rounded).

IQ2_XXS follows :mod:`quantkit.formats.iquants` steps 1-7 on lanes of 32-weight sub-blocks (on CUDA one thread
per sub-block in ``kq_search.cu``, eagerly elsewhere); the neighbour search runs only on the groups that are off the
grid, over the same neighbour lists (:mod:`quantkit.formats.iq_tables`), taking the first strict minimum as ggml
does.  Where ggml would abort, the CPU encoders' EncodeError is raised, naming the same row.

The K-quant scale searches run on "lanes" (sub-block k = column k of ``xt[n, K]``), as the numba kernels do:
each sub-block sees ggml's exact sequence, the lanes run side by side (on CUDA one thread per lane in
``kq_search.cu``; eagerly where it cannot be built, with the same bytes).  A refinement pass that changes nothing
leaves the state unchanged, so running all of ggml's passes (instead of breaking early) gives the same result.

:func:`encode` is the entry point (numpy in, numpy out, rows streamed through the device in bounded chunks with
the host copies overlapped); :func:`encode_tensor` encodes a tensor already on its device.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path

import numpy as np
import torch

from ..errors import EncodeError, UnsupportedError
from ..formats.registry import GGMLType, get_format

F32 = np.float32
_ROUND_MAGIC = 12582912.0              # 1.5 * 2**23 (exact in float32)
_GROUP_MAX_EPS = float(F32(1e-15))     # ggml's "this group is all zero" threshold
_QK_K = 256
_QP_PASSES = 5                         # make_qp_quants' refinement passes
_F16_NAN = 0xFE00                      # ggml's f16 of the x86 default NaN (sign kept)


# ------------------------------------------------------------------------------------------------ C idioms

def _full(t: torch.Tensor, v) -> torch.Tensor:
    return torch.full_like(t, float(F32(v)), dtype=torch.float32)


def _div(num, den: torch.Tensor) -> torch.Tensor:
    """float32 ``num / den``, one correctly rounded division (a scalar ``num`` is broadcast to a tensor first)."""
    if not isinstance(num, torch.Tensor):
        num = _full(den, num)
    if not isinstance(den, torch.Tensor):
        den = _full(num, den)
    num, den = torch.broadcast_tensors(num, den)
    return num / den


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml ``nearest_int``: add 1.5·2²³ in float32 and read the low mantissa bits (int32); NaN gives 0."""
    biased = v + _ROUND_MAGIC
    r = (biased.view(torch.int32) & 0x007FFFFF) - 0x00400000
    return torch.where(torch.isnan(biased), torch.zeros_like(r), r)


def c_int(v: torch.Tensor) -> torch.Tensor:
    """``(int)v`` on x86 (int64): truncation, INT32_MIN for NaN, ±inf and |v| ≥ 2³¹."""
    ok = v.abs() < 2.0 ** 31
    return torch.where(ok, torch.where(ok, v, torch.zeros_like(v)).to(torch.int64),
                       torch.full_like(v, -2 ** 31, dtype=torch.int64))


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: half away from zero (``torch.round`` is half to even)."""
    t = torch.trunc(v)
    frac = v - t
    return torch.where(frac >= 0.5, t + 1.0, torch.where(frac <= -0.5, t - 1.0, t))


def f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """GGML_FP32_TO_FP16 (round to nearest even) as little-endian bytes [..., 2] (uint8)."""
    h = v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    h = torch.where(torch.isnan(v), torch.full_like(h, _F16_NAN), h)
    return torch.stack([h & 0xFF, h >> 8], dim=-1).to(torch.uint8)


def f16_round(v: torch.Tensor) -> torch.Tensor:
    """The float32 value ggml reads back after storing ``v`` as f16."""
    return v.to(torch.float16).to(torch.float32)


def sqrtf(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 ``sqrtf``: torch's float32 CPU sqrt is not (it misses by an ulp on ~20% of
    inputs); float64 sqrt rounded to float32 is exact (53 ≥ 2·24 + 2 bits: the double rounding is harmless)."""
    return v.to(torch.float64).sqrt().to(torch.float32)


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """``float s = 0; for (i ...) s += t[i];`` over axis 0."""
    s = t[0] + 0.0
    for i in range(1, t.shape[0]):
        s = s + t[i]
    return s


def seq_sum_from_first(t: torch.Tensor) -> torch.Tensor:
    """``float s = t[0]; for (i = 1 ...) s += t[i];`` over axis 0."""
    s = t[0].clone()
    for i in range(1, t.shape[0]):
        s = s + t[i]
    return s


def _running_max(t: torch.Tensor) -> torch.Tensor:
    """``m = 0; for (i ...) m = m > t[i] ? m : t[i];`` over axis 0 (MAX with NaN as C has it)."""
    m = torch.zeros_like(t[0])
    for i in range(t.shape[0]):
        m = torch.where(m > t[i], m, t[i])
    return m


def _strict_max(t: torch.Tensor) -> torch.Tensor:
    """``m = 0; for (i ...) if (t[i] > m) m = t[i];`` over axis 0."""
    m = torch.zeros_like(t[0])
    for i in range(t.shape[0]):
        m = torch.where(t[i] > m, t[i], m)
    return m


@functools.lru_cache(maxsize=None)
def _table(name: str, device: str) -> torch.Tensor:
    from ..formats import fp4

    if name == "kvalues":
        values = fp4.KVALUES_E2M1X2
    elif name == "e8m0_half":
        values = fp4.e8m0_to_fp32_half(np.arange(256))
    elif name == "ue4m3_half":
        values = fp4.ue4m3_to_fp32_half(np.arange(256))
    elif name == "log2_up":
        values = _log2_round_up_thresholds()
    else:
        raise KeyError(name)
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)


def _log2_round_up_thresholds() -> np.ndarray:
    """For each binade [2^e, 2^(e+1)), e = -149..127: the bits of the smallest float32 whose float32 ``log2``
    floors to e+1 (2^(e+1)'s bits when none does)."""
    e = np.arange(-149, 128)
    lo = np.ldexp(np.float64(1), e).astype(F32).view(np.int32).astype(np.int64)
    hi = np.where(e < 127, np.ldexp(np.float64(1), np.minimum(e + 1, 127)).astype(F32).view(np.int32)
                  .astype(np.int64), np.int64(0x7F800000))
    first, last = lo.copy(), hi.copy()         # invariant: the threshold lies in (first - 1, last]
    with np.errstate(divide="ignore"):
        while (first < last).any():
            mid = (first + last) // 2
            up = np.floor(np.log2(mid.astype(np.int32).view(F32))) > e
            last = np.where((first < last) & up, mid, last)
            first = np.where((first < last) & ~up, mid + 1, first)
    return last.astype(np.int32)


def _floor_log2f(amax: torch.Tensor) -> torch.Tensor:
    """``floorf(log2f(amax))`` (int64) for finite amax > 0, from the float's bits and the threshold table."""
    bits = amax.view(torch.int32).to(torch.int64)
    biased = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    sub_exp = ((mant.to(torch.float32).view(torch.int32).to(torch.int64) >> 23) & 0xFF) - 127 - 149
    e = torch.where(biased > 0, biased - 127, sub_exp)
    thr = _table("log2_up", str(amax.device))[(e + 149).clamp(0, 276)].to(torch.int64)
    return e + (bits >= thr).to(torch.int64)


# ------------------------------------------------------------------------------------------------ Q8_0

def _q8_0(x: torch.Tensor, imatrix) -> torch.Tensor:
    b = x.reshape(-1, 32)
    d = _div(b.abs().amax(dim=1), 127.0)
    inv = torch.where(d != 0, _div(1.0, d), torch.zeros_like(d))
    q = c_int(roundf(b * inv[:, None])) & 0xFF
    return torch.cat([f16_bytes(d), q.to(torch.uint8)], dim=1).reshape(x.shape[0], -1)


# ------------------------------------------------------------------------------------------------ FP4

def _best_index(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """ggml best_index_mxfp4: first argmin over the 16 codes of |kvalue·d - x| (float32)."""
    grid = _table("kvalues", str(x.device)) * d[..., None]
    return (grid - x[..., None]).abs().argmin(dim=-1)


def _mxfp4(x: torch.Tensor, imatrix) -> torch.Tensor:
    b = x.reshape(-1, 32)
    amax = b.abs().amax(dim=1)
    pos = amax > 0
    e = torch.where(pos, (_floor_log2f(torch.where(pos, amax, torch.ones_like(amax))) + 125) & 0xFF,
                    torch.zeros_like(amax, dtype=torch.int64))
    d = _table("e8m0_half", str(x.device))[e]
    codes = _best_index(b, d[:, None].expand_as(b))
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return torch.cat([e[:, None], qs], dim=1).to(torch.uint8).reshape(x.shape[0], -1)


def fp32_to_ue4m3(v: torch.Tensor) -> torch.Tensor:
    """ggml_fp32_to_ue4m3 (int64 codes); the rules are in :mod:`quantkit.formats.fp4`."""
    v = torch.minimum(v, _full(v, 448.0))
    bits = v.view(torch.int32).to(torch.int64)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    sub = torch.clamp(c_int(v * 512.0 + 0.5), max=7)
    sub = torch.where(sub >= 1, sub, torch.zeros_like(sub))
    man = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    carry = man > 7
    exp_n = torch.where(carry, exp + 1, exp)
    normal = torch.where(exp_n >= 15, torch.full_like(exp, 0x7E),
                         (exp_n << 3) | torch.where(carry, torch.zeros_like(man), man))
    code = torch.where(exp <= 0, sub, torch.where(exp >= 15, torch.full_like(exp, 0x7E), normal))
    return torch.where(v > 0, code, torch.zeros_like(code))


def _nvfp4(x: torch.Tensor, imatrix) -> torch.Tensor:
    g = x.reshape(-1, 4, 16)
    ue = fp32_to_ue4m3(_div(g.abs().amax(dim=2), 6.0))
    d = _table("ue4m3_half", str(x.device))[ue]
    codes = _best_index(g, d[..., None].expand_as(g))
    qs = (codes[..., :8] | (codes[..., 8:] << 4)).reshape(-1, 32)
    return torch.cat([ue, qs], dim=1).to(torch.uint8).reshape(x.shape[0], -1)


# ------------------------------------------------------------------------------------------------ K-quant searches

def make_qkx_quants(xt: torch.Tensor, wt: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool):
    """make_qkx2_quants / make_qkx3_quants on lanes ``xt[n, K]`` with weights ``wt``: (L[n, K] int32,
    scale[K], the_min[K]) — the numba ``make_qkx_quants_lanes`` step for step."""
    mn, mx = xt[0], xt[0]
    for i in range(1, xt.shape[0]):       # a scan, not amin/amax: the first of ±0 is kept, as in ggml
        mn = torch.where(xt[i] < mn, xt[i], mn)
        mx = torch.where(xt[i] > mx, xt[i], mx)
    sum_w = seq_sum_from_first(wt)
    sum_x = seq_sum_from_first(wt * xt)
    mn = torch.where(mn > 0, torch.zeros_like(mn), mn)
    fnmax = float(nmax)
    iscale = _div(fnmax, mx - mn)
    scale = _div(1.0, iscale)
    q_iscale, q_min = iscale, mn

    def quants(isc, m):
        return torch.clamp(nearest_int(isc * (xt - m)), 0, nmax).to(torch.float32)

    def error(sc, fl, m):
        diff = sc * fl + m - xt
        return seq_sum(wt * (diff.abs() if use_mad else diff * diff))

    best_err = error(scale, quants(iscale, mn), mn)
    active = mx > mn              # ggml returns at once when max == min: its quants are 0
    zero = torch.zeros_like(mn)
    scale = torch.where(active, scale, zero)
    q_iscale = torch.where(active, q_iscale, zero)
    for step in range(nstep + 1):
        numer = float(F32(rmin) + F32(rdelta) * F32(step) + F32(nmax))
        iscale = _div(numer, mx - mn)
        fl = quants(iscale, mn)
        wl = wt * fl
        sum_l = seq_sum(wl)
        sum_l2 = seq_sum(wl * fl)
        sum_xl = seq_sum(wl * xt)
        D = sum_w * sum_l2 - sum_l * sum_l
        sc = _div(sum_w * sum_xl - sum_x * sum_l, D)
        m = _div(sum_l2 * sum_x - sum_l * sum_xl, D)
        pos = m > 0
        t_scale = torch.where(pos, _div(sum_xl, sum_l2), sc)
        t_min = torch.where(pos, zero, m)
        err = error(t_scale, fl, t_min)
        win = (D > 0) & (err < best_err) & active
        best_err = torch.where(win, err, best_err)
        scale = torch.where(win, t_scale, scale)
        q_iscale = torch.where(win, iscale, q_iscale)
        q_min = torch.where(win, mn, q_min)
        mn = torch.where(win, t_min, mn)
    L = torch.clamp(nearest_int(q_iscale * (xt - q_min)), 0, nmax)
    return L, scale, -mn


#: Device types on which the K-quant searches run as the fused kernels of ``kq_search.cu`` (one thread per
#: sub-block / super-block, compiled at first use with -fmad=false and round-to-nearest intrinsics; ~1 minute on
#: a fresh machine, then torch's extension cache) instead of the eager :func:`make_qkx_quants` /
#: :func:`make_qp_quants`; both give the same bytes (tests/test_gpu_encoders.py compares them on CUDA, and where
#: there is no GPU runs the CUDA kernels on emulated thread blocks: quantkit.testing.cuda_emulation).
FUSED_SEARCH_ON = {"cuda"}
_SEARCH_DECL = ("std::vector<torch::Tensor> qkx_search_lanes(torch::Tensor xt, torch::Tensor wt, int64_t nmax, "
                "double rmin, double rdelta, int64_t nstep, bool use_mad);\n"
                "std::vector<torch::Tensor> qp_quants_lanes(torch::Tensor xt, torch::Tensor wt, int64_t nmax);\n"
                "std::vector<torch::Tensor> iq2_xxs_encode(torch::Tensor x, torch::Tensor qw, torch::Tensor kmap3, "
                "torch::Tensor grid_codes, torch::Tensor nb_index);\n"
                "torch::Tensor kquant_imatrix_encode(torch::Tensor x, torch::Tensor qw, int64_t sub);")
SEARCH_FUNCTIONS = ["qkx_search_lanes", "qp_quants_lanes", "iq2_xxs_encode", "kquant_imatrix_encode"]


_EXTENSIONS: dict[str, object] = {}
_EXTENSIONS_LOCK = threading.Lock()      # a conversion's warm-up thread and its stream may both ask first
_EXTENSION_NAMES = {"cuda": "quantkit_kq_search_cuda", "cpu": "quantkit_kq_search_cpu"}
#: The types whose encoders run ``kq_search.cu`` where it is built (the others are eager torch).
SEARCH_TYPES = frozenset({GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS})
#: Rows of a warm-up encode, and their length (a multiple of every GPU type's block).
_WARM_ROWS, _WARM_N = 64, 2048


def warm_device(device: str, kinds=()) -> None:
    """What the first encodes of ``kinds`` (``(type, with importance)``, as
    :func:`quantkit.formats.warm.encoder_kinds` lists them) would wait for, done ahead (a conversion does it in a
    thread while it starts): ``device``'s context, the build of ``kq_search.cu`` where one is on disk, and each
    kind's kernels, which CUDA loads at their first launch (one small encode of each kind; its bytes unused).
    Never a build: one cut short by the process's exit would leave torch's extension lock behind, so the first
    encode that needs an extension not built yet builds it, as without a warm-up."""
    dev = torch.device(device)
    torch.empty(1, device=dev)
    would_build = dev.type in FUSED_SEARCH_ON and not _extension_built(dev.type)
    x = torch.linspace(-1.0, 1.0, _WARM_ROWS * _WARM_N, device=dev).reshape(_WARM_ROWS, _WARM_N)
    for qtype, with_importance in kinds:
        fmt = get_format(qtype)
        if fmt.qtype in ENCODERS and not (fmt.qtype in SEARCH_TYPES and would_build):
            encode_rows(x, fmt.qtype, torch.ones(_WARM_N, device=dev) if with_importance else None)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _extension_built(device_type: str) -> bool:
    """Whether :func:`search_extension` is loaded or would load a build on disk (torch's cache of it)."""
    if _EXTENSIONS.get(device_type) is not None:
        return True
    try:
        from torch.utils.cpp_extension import _get_build_directory

        name = _EXTENSION_NAMES[device_type]
        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()
    except Exception:  # noqa: BLE001  (a private helper of torch's: any failure means "do not rely on it")
        return False


def search_extension(device_type: str):
    """The compiled ``kq_search.cu`` for ``device_type`` ("cuda": nvcc; "cpu": the C++ compiler, for checks), or
    None when it cannot be built here (no CUDA toolkit or compiler): the eager search gives the same bytes."""
    with _EXTENSIONS_LOCK:
        if device_type not in _EXTENSIONS:
            from torch.utils.cpp_extension import load_inline

            source = Path(__file__).with_name("kq_search.cu").read_text()
            name = _EXTENSION_NAMES[device_type]
            try:
                if device_type == "cuda":
                    ext = load_inline(name, cpp_sources=[_SEARCH_DECL], cuda_sources=[source],
                                      functions=SEARCH_FUNCTIONS, extra_cuda_cflags=["-O3", "-fmad=false"])
                else:
                    ext = load_inline(name, cpp_sources=[source], functions=SEARCH_FUNCTIONS,
                                      extra_cflags=["-O2", "-ffp-contract=off", "-fno-fast-math"])
            except Exception:  # noqa: BLE001  (a missing toolkit: OSError, RuntimeError, CalledProcessError…)
                ext = None
            _EXTENSIONS[device_type] = ext
        return _EXTENSIONS[device_type]


def qkx_search(xt: torch.Tensor, wt: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
               use_mad: bool):
    """make_qkx_quants on lanes, fused where :data:`FUSED_SEARCH_ON` says so and the kernel builds."""
    ext = search_extension(xt.device.type) if xt.device.type in FUSED_SEARCH_ON else None
    if ext is not None:
        L, scale, the_min = ext.qkx_search_lanes(xt.contiguous(), wt.contiguous(), nmax, float(F32(rmin)),
                                                 float(F32(rdelta)), nstep, use_mad)
        return L, scale, the_min
    return make_qkx_quants(xt, wt, nmax, rmin, rdelta, nstep, use_mad)


def qp_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor):
    """make_qp_quants on lanes, fused where :data:`FUSED_SEARCH_ON` says so and the kernel builds."""
    ext = search_extension(x.device.type) if x.device.type in FUSED_SEARCH_ON else None
    if ext is not None:
        L, scale = ext.qp_quants_lanes(x.contiguous(), qw.contiguous(), nmax)
        return L, scale
    return make_qp_quants(x, nmax, qw)


def make_qp_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor):
    """ggml make_qp_quants on lanes ``x[n, K]`` (the sub-block scales or mins) weighted by ``qw``:
    (L[n, K] in 0..255, scale[K])."""
    n = x.shape[0]
    mx = _running_max(x)
    small = mx < _GROUP_MAX_EPS
    fnmax = float(nmax)
    iscale = _div(fnmax, mx)
    L = nearest_int(iscale * x) & 0xFF
    scale = _div(1.0, iscale)
    diff = x - scale * L.to(torch.float32)
    best_mse = seq_sum(qw * diff * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = _div(float(F32(0.1) * F32(step) + F32(nmax)), mx)
        scale_is = _div(1.0, iscale_is)
        l = torch.clamp(nearest_int(iscale_is * x), max=nmax)
        diff = x - scale_is * l.to(torch.float32)
        mse = seq_sum(qw * diff * diff)
        better = mse < best_mse
        best_mse = torch.where(better, mse, best_mse)
        iscale = torch.where(better, iscale_is, iscale)
    l = torch.clamp(nearest_int(iscale * x), max=nmax)
    L = l & 0xFF
    fl = l.to(torch.float32)
    sumlx = seq_sum(qw * x * fl)
    suml2 = seq_sum(qw * fl * fl)
    L = list(L.unbind(0))
    for _ in range(_QP_PASSES):
        for i in range(n):
            w, xi = qw[i], x[i]
            fli = L[i].to(torch.float32)
            slx = sumlx - w * xi * fli
            sl2 = suml2 - w * fli * fli
            new_l = torch.clamp(nearest_int(_div(xi * sl2, slx)), max=nmax)
            fnl = new_l.to(torch.float32)
            slx2 = slx + w * xi * fnl
            sl22 = sl2 + w * fnl * fnl
            take = (slx > 0) & (sl2 > 0) & (new_l != L[i]) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[i] = torch.where(take, new_l & 0xFF, L[i])
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
    L = torch.stack(L)
    scale = torch.where(suml2 > 0, _div(sumlx, suml2), torch.zeros_like(sumlx))
    L = torch.where(small, torch.zeros_like(L), L)
    return L, torch.where(small, torch.zeros_like(scale), scale)


# ------------------------------------------------------------------------------------------------ K-quant blocks

def _lanes(b: torch.Tensor, sub: int) -> torch.Tensor:
    """Super-blocks b[NB, 256] → lanes [sub, NB·(256/sub)] (sub-block k of block i = column i·(256/sub)+k)."""
    return b.reshape(-1, sub).t().contiguous()


def _unlanes(t: torch.Tensor, nb: int) -> torch.Tensor:
    """Lanes [sub, NB·S] → [NB, 256]."""
    return t.t().reshape(nb, _QK_K)


def _imatrix_weights(xt, qwt, sigma2_lanes):
    """qw · sqrt(σ² + x²) per weight (ggml's importance weighting)."""
    return qwt * sqrtf(sigma2_lanes + xt * xt)


def _sum_sq_blocks(b: torch.Tensor) -> torch.Tensor:
    """Σ x² over each super-block, sequential from 0 (float32)."""
    bt = b.t()
    return seq_sum(bt * bt)


def _requantize(b, d_sub, dm_sub, sub, nmax, L):
    """L = clamp(nearest_int((x + dm)/d), 0, nmax) for sub-blocks with d != 0, else the search's quants."""
    nb = b.shape[0]
    x = b.reshape(nb, -1, sub)
    d = d_sub[..., None].expand_as(x)
    dm = dm_sub[..., None].expand_as(x)
    l = torch.clamp(nearest_int(_div(x + dm, d)), 0, nmax)
    return torch.where(d == 0, L.reshape(nb, -1, sub), l).reshape(nb, _QK_K)


def _search(b, qwb, sub, nmax, ref_params, imatrix_sigma_factor, ref_weights):
    """The per-sub-block scale search of both ggml paths: (L[NB, 256], scales[NB, S], mins[NB, S], sw)."""
    nb = b.shape[0]
    xt = _lanes(b, sub)
    if qwb is None:
        wt = ref_weights(xt)
        rmin, rdelta, nstep = ref_params
        use_mad = sub == 16
        sw = None
    else:
        ss = _sum_sq_blocks(b)
        sigma2 = _div(ss * imatrix_sigma_factor, float(_QK_K)) if imatrix_sigma_factor != 1 else \
            _div(ss, float(_QK_K))
        sigma2_lanes = sigma2.repeat_interleave(_QK_K // sub)[None, :].expand_as(xt)
        wt = _imatrix_weights(xt, _lanes(qwb, sub), sigma2_lanes)
        sw = seq_sum(wt).reshape(nb, -1)
        rmin, rdelta, nstep = -0.9, 0.05, 36
        use_mad = False
    L, scales, mins = qkx_search(xt, wt, nmax, rmin, rdelta, nstep, use_mad)
    return _unlanes(L, nb), scales.reshape(nb, -1), mins.reshape(nb, -1), sw


def _fused_kquant_imatrix(x: torch.Tensor, imatrix, sub: int):
    """The whole imatrix path of Q2_K (sub 16) / Q4_K (sub 32) as one kernel of ``kq_search.cu``, or None where
    it does not run (no importance, a device outside :data:`FUSED_SEARCH_ON`, or no build)."""
    ext = search_extension(x.device.type) if imatrix is not None and x.device.type in FUSED_SEARCH_ON else None
    return None if ext is None else ext.kquant_imatrix_encode(x.contiguous(), imatrix.contiguous(), sub)


def _q2_k(x: torch.Tensor, imatrix) -> torch.Tensor:
    fused = _fused_kquant_imatrix(x, imatrix, 16)
    if fused is not None:
        return fused
    rows, n = x.shape
    b = x.reshape(-1, _QK_K)
    nb = b.shape[0]
    qwb = None if imatrix is None else imatrix.expand(rows, n).reshape(-1, _QK_K)
    L, scales, mins, sw = _search(b, qwb, 16, 3, (-0.5, 0.1, 15), 1, lambda xt: xt.abs())
    if qwb is None:                                       # quantize_row_q2_K_ref
        max_scale = _strict_max(scales.t())
        max_min = _strict_max(mins.t())
        zero = torch.zeros_like(max_scale)
        sc = torch.where((max_scale > 0)[:, None],
                         nearest_int(_div(15.0, max_scale)[:, None] * scales) & 0xFF,
                         torch.zeros_like(scales, dtype=torch.int32))
        d = torch.where(max_scale > 0, _div(max_scale, 15.0), zero)
        sc = torch.where((max_min > 0)[:, None],
                         (sc | (nearest_int(_div(15.0, max_min)[:, None] * mins) << 4)) & 0xFF, sc)
        dmin = torch.where(max_min > 0, _div(max_min, 15.0), zero)
    else:                                                 # quantize_row_q2_K_impl
        Ls, d = qp_quants(scales.t(), 15, sw.t())
        Lm, dmin = qp_quants(mins.t(), 15, sw.t())
        sc = ((Ls | (Lm << 4)) & 0xFF).t()
    dd, dmm = f16_round(d), f16_round(dmin)
    L = _requantize(b, dd[:, None] * (sc & 0xF).to(torch.float32), dmm[:, None] * (sc >> 4).to(torch.float32),
                    16, 3, L)
    q = L.reshape(nb, 2, 4, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(nb, 64)
    out = torch.cat([sc.to(torch.uint8), qs.to(torch.uint8), f16_bytes(d), f16_bytes(dmin)], dim=1)
    return out.reshape(rows, -1)


def _q4_k_ref_weights(xt: torch.Tensor) -> torch.Tensor:
    av_x = sqrtf(_div(seq_sum(xt * xt), 32.0))
    return av_x[None, :] + xt.abs()


def _q4_k(x: torch.Tensor, imatrix) -> torch.Tensor:
    fused = _fused_kquant_imatrix(x, imatrix, 32)
    if fused is not None:
        return fused
    rows, n = x.shape
    b = x.reshape(-1, _QK_K)
    nb = b.shape[0]
    qwb = None if imatrix is None else imatrix.expand(rows, n).reshape(-1, _QK_K)
    L, scales, mins, sw = _search(b, qwb, 32, 15, (-1.0, 0.1, 20), 2, _q4_k_ref_weights)
    if qwb is None:                                       # quantize_row_q4_K_ref
        max_scale = _strict_max(scales.t())
        max_min = _strict_max(mins.t())
        zero = torch.zeros_like(max_scale)
        inv_scale = torch.where(max_scale > 0, _div(63.0, max_scale), zero)
        inv_min = torch.where(max_min > 0, _div(63.0, max_min), zero)
        ls = torch.clamp(nearest_int(inv_scale[:, None] * scales) & 0xFF, max=63)
        lm = torch.clamp(nearest_int(inv_min[:, None] * mins) & 0xFF, max=63)
        d, dmin = _div(max_scale, 63.0), _div(max_min, 63.0)
    else:                                                 # quantize_row_q4_K_impl (no clamp, unlike Q5_K)
        ls, d = qp_quants(scales.t(), 63, sw.t())
        lm, dmin = qp_quants(mins.t(), 63, sw.t())
        ls, lm = ls.t(), lm.t()
    packed = torch.cat([(ls[:, :4] | ((ls[:, 4:] >> 4) << 6)) & 0xFF,
                        (lm[:, :4] | ((lm[:, 4:] >> 4) << 6)) & 0xFF,
                        ((ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)) & 0xFF], dim=1)
    lo, hi, mix = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]        # get_scale_min_k4
    sc = torch.cat([lo & 63, (mix & 0xF) | ((lo >> 6) << 4)], dim=1)
    m = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], dim=1)
    dd, dmm = f16_round(d), f16_round(dmin)
    L = _requantize(b, dd[:, None] * sc.to(torch.float32), dmm[:, None] * m.to(torch.float32), 32, 15, L)
    q = L.reshape(nb, 4, 2, 32)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(nb, 128)
    out = torch.cat([f16_bytes(d), f16_bytes(dmin), packed.to(torch.uint8), qs.to(torch.uint8)], dim=1)
    return out.reshape(rows, -1)


# ------------------------------------------------------------------------------------------------ IQ2_XXS

_FLT_MAX = float(np.finfo(np.float32).max)


@functools.lru_cache(maxsize=None)
def _iq2_xxs_tables(device: str):
    """(kmap[65536], neighbour lists padded with -1 [n_lists, max_len], lattice values 2l+1 [256, 8]) on device."""
    from ..formats.iq_tables import tables

    t = tables(GGMLType.IQ2_XXS)
    width = int(t.nb_count.max())
    lists = np.full((t.nb_count.size, width), -1, np.int64)
    for i, (start, count) in enumerate(zip(t.nb_start, t.nb_count)):
        lists[i, :count] = t.nb_index[start:start + count]
    lattice = 2 * t.levels.astype(np.float32) + 1
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device)
                 for a in (t.kmap.astype(np.int64), lists, lattice))


@functools.lru_cache(maxsize=None)
def _iq2_xxs_fused_tables(device: str):
    """The tables of ``kq_search.cu``'s IQ2_XXS kernel on device: (kmap3[3^8] int32, grid codes[256] int16,
    neighbour lists uint8[total]).  kmap3 is indexed by the base-3 code Σ l_i·3^i of levels 0..2 (the only ones
    the encoder rounds to): the grid index, or ``INT32_MIN | start << 8 | count`` of the point's neighbour list
    (ggml's order) in the lists array."""
    from ..formats.iq_tables import tables

    t = tables(GGMLType.IQ2_XXS)
    lists = [t.nb_index[start:start + count] for start, count in zip(t.nb_start, t.nb_count)]
    starts = np.concatenate([[0], np.cumsum([len(a) for a in lists])[:-1]]).astype(np.int64)
    levels = (np.arange(3 ** 8)[:, None] // 3 ** np.arange(8)) % 3
    entry = t.kmap[(levels << (2 * np.arange(8))).sum(axis=1)].astype(np.int64)
    lst = np.where(entry < 0, -entry - 1, 0)
    packed = np.int64(-2 ** 31) | (starts[lst] << 8) | t.nb_count[lst]
    kmap3 = np.where(entry >= 0, entry, packed).astype(np.int32)
    grid_codes = (t.levels.astype(np.int64) << (2 * np.arange(8))).sum(axis=1).astype(np.int16)
    nb = np.concatenate(lists).astype(np.uint8)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (kmap3, grid_codes, nb))


def _iq2_xxs_fused(ext, x: torch.Tensor, imatrix) -> tuple[torch.Tensor, torch.Tensor]:
    qw = imatrix if imatrix is not None else torch.empty(0, dtype=torch.float32, device=x.device)
    out, status = ext.iq2_xxs_encode(x.contiguous(), qw.contiguous(), *_iq2_xxs_fused_tables(str(x.device)))
    first = (status > 0).to(torch.int8).argmax(dim=1, keepdim=True)   # each row's first failing sub-block, or 0
    return out, status.gather(1, first).squeeze(1).to(torch.int32)


def _group_codes(L: torch.Tensor) -> torch.Tensor:
    """Lattice codes Σ l_i << 2i of each group of 8 of lanes L[32, K]: [4, K] (int64)."""
    g = L.reshape(4, 8, -1).to(torch.int64)
    code = torch.zeros_like(g[:, 0])
    for i in range(8):
        code = code | (g[:, i] << (2 * i))
    return code


def _iq2_snap(inv_scale, scale, xval, waux, active):
    """Round every group to levels at ``inv_scale`` and move the off-grid ones to their best listed neighbour
    at ``scale`` (iq2_find_best_neighbour): (L[32, K], lanes where every neighbour distance was inf/NaN)."""
    kmap, lists, lattice = _iq2_xxs_tables(str(xval.device))
    L = torch.clamp(nearest_int(0.5 * (inv_scale * xval - 1.0)), 0, 2)
    grid = kmap[_group_codes(L)]                                  # [4, K]
    K = xval.shape[1]
    off = (grid < 0) & active[None, :]
    failed = torch.zeros(K, dtype=torch.bool, device=xval.device)
    idx = off.reshape(-1).nonzero().squeeze(1)
    if idx.numel() == 0:
        return L, failed
    grp, lane = idx // K, idx % K
    cand = lists[-grid.reshape(-1)[idx] - 1]                      # [m, width], -1 padded
    safe = cand.clamp(min=0)
    s = scale[lane][:, None]
    d2 = torch.zeros(cand.shape, dtype=torch.float32, device=xval.device)
    for i in range(8):
        xi = xval[8 * grp + i, lane][:, None]
        diff = s * lattice[safe, i] - xi
        d2 = d2 + waux[8 * grp + i, lane][:, None] * diff * diff
    valid = (cand >= 0) & (d2 < _FLT_MAX)
    pick = torch.where(valid, d2, torch.full_like(d2, float("inf"))).argmin(dim=1)
    failed[lane[~valid.any(dim=1)]] = True
    chosen = safe.gather(1, pick[:, None]).squeeze(1)
    levels = ((lattice[chosen] - 1) / 2).to(L.dtype)              # [m, 8], exact small integers
    L = L.reshape(4, 8, K)
    L[grp, :, lane] = levels
    return L.reshape(32, K), failed


def _iq2_xxs(x: torch.Tensor, imatrix) -> tuple[torch.Tensor, torch.Tensor]:
    ext = search_extension(x.device.type) if x.device.type in FUSED_SEARCH_ON else None
    if ext is not None:
        return _iq2_xxs_fused(ext, x, imatrix)
    rows, n = x.shape
    b = x.reshape(-1, _QK_K)
    nb = b.shape[0]
    qwb = imatrix.expand(rows, n).reshape(-1, _QK_K)
    sigma2 = _div(_sum_sq_blocks(b), float(_QK_K))
    xt = _lanes(b, 32)
    K = xt.shape[1]
    weight = _imatrix_weights(xt, _lanes(qwb, 32), sigma2.repeat_interleave(8)[None, :].expand_as(xt))
    waux = sqrtf(weight)
    xval = torch.where(xt >= 0, xt, -xt)
    neg = (xt < 0).to(torch.int64).reshape(4, 8, K)
    signs = torch.zeros_like(neg[:, 0])
    for i in range(8):
        signs = signs | (neg[:, i] << i)
    odd = (neg.sum(dim=1) % 2) == 1                               # [4, K]: one sign cannot be stored
    cost = (weight * xt * xt).reshape(4, 8, K)
    imin = torch.zeros_like(signs)
    for i in range(1, 8):
        imin = torch.where(cost[:, i] < cost.gather(1, imin[:, None]).squeeze(1), torch.full_like(imin, i), imin)
    flip = torch.zeros((4, 8, K), dtype=torch.bool, device=x.device)
    flip.scatter_(1, imin[:, None], odd[:, None])
    xval = torch.where(flip.reshape(32, K), -xval, xval)
    signs = (signs ^ (odd.to(torch.int64) << imin)) & 127
    max_x = xval[0]
    for i in range(1, 32):
        max_x = torch.where(max_x > xval[i], max_x, xval[i])
    _, scale = make_qp_quants(xval, 4, weight)
    denom = scale * 3.0
    active = ~((max_x < _GROUP_MAX_EPS) | (denom <= 0))
    best = torch.zeros_like(scale)
    L = torch.zeros_like(xt, dtype=torch.int32)
    failed = torch.zeros(K, dtype=torch.bool, device=x.device)
    for step in range(-6, 7):
        inv_scale = _div(float(F32(5) + F32(step) * F32(0.1)), denom)
        this_scale = _div(1.0, inv_scale)
        Laux, bad = _iq2_snap(inv_scale, this_scale, xval, waux, active)
        failed |= bad
        q = (2 * Laux + 1).to(torch.float32)
        sumqx = seq_sum(weight * xval * q)
        sumq2 = seq_sum(weight * q * q)
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = torch.where(take, _div(sumqx, sumq2), scale)
        best = torch.where(take, scale * sumqx, best)
        L = torch.where(take[None, :], Laux, L)
    refine = active & (scale > 0)
    Lr, bad = _iq2_snap(_div(1.0, scale), scale, xval, waux, refine)
    failed |= bad
    L = torch.where(refine[None, :], Lr, L)
    q = (2 * L + 1).to(torch.float32)
    sumqx = seq_sum(weight * xval * q)
    sumq2 = seq_sum(weight * q * q)
    scale = torch.where(refine & (sumq2 > 0), _div(sumqx, sumq2), scale)
    kmap, _, _ = _iq2_xxs_tables(str(x.device))
    grid = kmap[_group_codes(L)]
    status = torch.zeros(K, dtype=torch.int64, device=x.device)
    status = torch.where(active & ((grid < 0).any(dim=0)), torch.full_like(status, 3), status)     # OFF_GRID
    status = torch.where(active & torch.isnan(scale), torch.full_like(status, 2), status)          # NAN_SCALE
    status = torch.where(active & failed, torch.full_like(status, 1), status)                     # NO_NEIGHBOUR
    per_row = status.reshape(rows, -1)                             # each row's sub-blocks in order
    first = (per_row > 0).to(torch.int8).argmax(dim=1, keepdim=True)   # ggml stops at the first that fails
    aborted = per_row.gather(1, first).squeeze(1).to(torch.int32)
    negative = scale < 0
    scale = torch.where(negative, -scale, scale)
    signs = torch.where(negative[None, :], ~signs & 127, signs)
    scale = torch.where(active, scale, torch.zeros_like(scale))
    grid = torch.where(active[None, :], grid, torch.zeros_like(grid))
    signs = torch.where(active[None, :], signs, torch.zeros_like(signs))
    scales = scale.reshape(nb, 8)
    max_scale = torch.zeros_like(scales[:, 0])
    for j in range(8):
        max_scale = torch.where(max_scale > scales[:, j], max_scale, scales[:, j])
    d = _div(max_scale, 31.0)
    inv_d = _div(1.0, d)
    ls = torch.clamp(nearest_int(0.5 * (inv_d[:, None] * scales - 1.0)), 0, 15).to(torch.int64)
    g = grid.t().reshape(nb, 8, 4)
    sg = signs.t().reshape(nb, 8, 4)
    sign_word = sg[..., 0] | (sg[..., 1] << 7) | (sg[..., 2] << 14) | (sg[..., 3] << 21) | (ls << 28)
    sign_bytes = torch.stack([(sign_word >> (8 * k)) & 0xFF for k in range(4)], dim=-1)
    words = torch.cat([g, sign_bytes], dim=-1).reshape(nb, 64)
    out = torch.cat([f16_bytes(d), words.to(torch.uint8)], dim=1)
    out = torch.where((max_scale == 0)[:, None], torch.zeros_like(out), out)
    return out.reshape(rows, -1), aborted


# ------------------------------------------------------------------------------------------------ entry points

ENCODERS = {
    GGMLType.Q8_0: _q8_0,
    GGMLType.MXFP4: _mxfp4,
    GGMLType.NVFP4: _nvfp4,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q2_K: _q2_k,
    GGMLType.IQ2_XXS: _iq2_xxs,
}
"""The types with a torch encoder proven byte-identical to ggml (tests/test_gpu_encoders.py).  IQ2_XXS's gives
(bytes, each row's abort reason: one of iquants' status codes, 0 where the row encodes) without waiting for the
device; the others cannot fail on finite input and give the bytes."""

#: Weights encoded per device pass.  The eager encoders launch thousands of small kernels per pass, so a pass
#: must be large to keep the GPU busy; it also bounds device memory: peak ≈ 60 bytes/weight for the K-quants
#: (~20 float32 temporaries), 200 for FP4's 16-way code search, more for IQ2_XXS's neighbour lists; the
#: whole-encode kernels of ``kq_search.cu`` (IQ2_XXS, the K-quant imatrix paths) need under 1 byte/weight beyond
#: input and output (bench/gpu_encode.py reports the peaks).
DEFAULT_CHUNK_WEIGHTS = 1 << 26
CHUNK_WEIGHTS = {GGMLType.IQ2_XXS: 1 << 24, GGMLType.MXFP4: 1 << 25, GGMLType.NVFP4: 1 << 25}


_CPU_CHUNK_WEIGHTS = 1 << 20          # the CPU path is for tests and machines without a GPU: small passes


def chunk_weights_for(qtype) -> int:
    return CHUNK_WEIGHTS.get(get_format(qtype).qtype, DEFAULT_CHUNK_WEIGHTS)


def check_device(device: str) -> None:
    """Raise :class:`UnsupportedError` unless torch can encode on ``device`` ("cuda", "cuda:N" or "cpu")."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UnsupportedError(f"unknown device {device!r}: use cuda, cuda:N or cpu") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError(f"device {device!r}: torch {torch.__version__} sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UnsupportedError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise UnsupportedError(f"device {device!r}: GPU encoders run on cuda (or cpu), not {dev.type}")


def supports(qtype) -> bool:
    return get_format(qtype).qtype in ENCODERS


def encode_rows(x: torch.Tensor, qtype, imatrix: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queue the encode of float32 ``x[rows, n]`` on its device without waiting for it: (uint8[rows, row_bytes],
    int32[rows] of the rows' abort reasons (0: encodes), or None for a type that cannot abort), both on the device.
    ``imatrix``: float32[n] for every row, or [rows, n], a row of importance per row (pieces with different
    importance in one pass: rows encode independently, so the bytes are those of one call per piece).  The rows
    must be finite (the input checks of :func:`quantkit.formats.encode` are the caller's)."""
    fmt = get_format(qtype)
    fn = ENCODERS.get(fmt.qtype)
    if fn is None:
        raise UnsupportedError(f"no GPU encoder for {fmt.name}; GPU encoders: "
                               f"{', '.join(t.name for t in ENCODERS)}")
    with torch.no_grad():
        out = fn(x, imatrix)
    return out if isinstance(out, tuple) else (out, None)


def abort_error(qtype, row: int, reason: int, name: str | None) -> EncodeError:
    """The error of row ``row`` (numbered as the user sees it) that ggml aborts on, for abort ``reason``."""
    from ..formats.iquants import _ABORT_REASONS, _abort_error

    err = _abort_error(get_format(qtype).qtype, row, _ABORT_REASONS[reason])
    return EncodeError(err.detail, tensor=name)


def encode_tensor(x: torch.Tensor, qtype, imatrix: torch.Tensor | None = None, *, first_row: int = 0,
                  name: str | None = None) -> torch.Tensor:
    """:func:`encode_rows`, waiting for the abort reasons: uint8[rows, row_bytes] on ``x``'s device, or the error
    of the first row ggml aborts on (``first_row`` numbers the rows in error messages)."""
    try:
        out, reasons = encode_rows(x, qtype, imatrix)
    except UnsupportedError as exc:
        raise UnsupportedError(exc.detail, tensor=name) from None
    if reasons is not None and bool((reasons > 0).any()):   # a host sync, only for the types that can abort
        row = int((reasons > 0).nonzero()[0, 0])
        raise abort_error(qtype, first_row + row, int(reasons[row]), name)
    return out


def encode(x, qtype, imatrix=None, *, device: str = "cuda", name: str | None = None,
           chunk_weights: int | None = None) -> np.ndarray:
    """Encode float32 ``x[rows, n]`` on ``device`` like :func:`quantkit.formats.encode` (same checks, same
    bytes): rows go through the device in chunks of about ``chunk_weights`` weights (default
    :func:`chunk_weights_for`); on CUDA the next chunk's
    upload and the previous chunk's download overlap the current chunk's encode."""
    from ..formats.api import _check_imatrix, _check_rows

    fmt = get_format(qtype)
    if fmt.qtype not in ENCODERS:
        raise UnsupportedError(f"no GPU encoder for {fmt.name}", tensor=name)
    x = _check_rows(x, fmt, name)
    im = _check_imatrix(imatrix, x.shape[1], fmt, name)
    rows, n = x.shape
    out = np.empty((rows, fmt.row_bytes(n)), np.uint8)
    if rows == 0:
        return out
    dev = torch.device(device)
    im_t = None if im is None else torch.from_numpy(im).to(dev)
    if chunk_weights is None:
        chunk_weights = chunk_weights_for(fmt.qtype) if dev.type == "cuda" else _CPU_CHUNK_WEIGHTS
    step = max(1, chunk_weights // max(n, 1))
    spans = [(r, min(rows, r + step)) for r in range(0, rows, step)]
    if dev.type != "cuda":
        for r0, r1 in spans:
            out[r0:r1] = encode_tensor(torch.from_numpy(x[r0:r1]).to(dev), fmt.qtype, im_t, first_row=r0,
                                       name=name).cpu().numpy()
        return out
    return _encode_cuda(x, fmt.qtype, im_t, dev, spans, out, name)


def _encode_cuda(x, qtype, im_t, dev, spans, out, name):
    """Pinned staging, uploads on a copy stream one chunk ahead, downloads overlapping the next encode."""
    compute = torch.cuda.current_stream(dev)
    copier = torch.cuda.Stream(dev)
    stage_in = [torch.empty((spans[0][1] - spans[0][0], x.shape[1]), dtype=torch.float32).pin_memory()
                for _ in range(2)]
    stage_out = [torch.empty((spans[0][1] - spans[0][0], out.shape[1]), dtype=torch.uint8).pin_memory()
                 for _ in range(2)]

    def upload(i):
        r0, r1 = spans[i]
        host = stage_in[i % 2][:r1 - r0]
        host.numpy()[:] = x[r0:r1]
        with torch.cuda.stream(copier):
            dev_x = host.to(dev, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copier)
        return dev_x, ready

    pending = None            # (span index, event, pinned buffer) of the download in flight
    nxt = upload(0)
    for i in range(len(spans)):
        dev_x, ready = nxt
        compute.wait_event(ready)
        dev_x.record_stream(compute)
        encoded = encode_tensor(dev_x, qtype, im_t, first_row=spans[i][0], name=name)
        done = torch.cuda.Event()
        done.record(compute)
        if i + 1 < len(spans):
            ready.synchronize()                       # stage_in[(i+1)%2] was last read by upload i-1: done
            nxt = upload(i + 1)
        if pending is not None:
            j, ev, buf = pending
            ev.synchronize()
            out[spans[j][0]:spans[j][1]] = buf.numpy()
        r0, r1 = spans[i]
        buf = stage_out[i % 2][:r1 - r0]
        with torch.cuda.stream(copier):
            copier.wait_event(done)
            buf.copy_(encoded, non_blocking=True)
            encoded.record_stream(copier)
            ev = torch.cuda.Event()
            ev.record(copier)
        pending = (i, ev, buf)
    j, ev, buf = pending
    ev.synchronize()
    out[spans[j][0]:spans[j][1]] = buf.numpy()
    return out
