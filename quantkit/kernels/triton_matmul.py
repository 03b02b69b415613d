"""Fused packed products (CUDA): activations times GGUF-packed weights, the weights decoded inside the kernel.

:func:`linear` computes ``x @ W.T`` for a weight ``W [n, k]`` held as its GGUF payload (``uint8 [n, row bytes]``),
and :func:`grouped_linear` the routed experts' products ``x[i] @ W[e_i].T`` for rows sorted by expert, every active
expert in one launch (a table maps each row tile to its expert: :func:`expert_tiles`).  No decoded weight is
written to global memory: each program decodes a ``[BN, BK]`` tile of weight rows in registers with the decoders
of :mod:`.triton_dequant` (the same ``*_values`` functions its dequantization kernels store, so the values the
product sees are bit for bit the numba decoders') and multiplies it on the tensor cores.

Arithmetic: products accumulate in float32.  float32 activations multiply with ``bf16x3`` (plain float32 has no
tensor-core path): each operand splits into a high and a low bfloat16 part and three bfloat16 products are summed,
the low x low one dropped, so each product is within about 3 x 2^-18 of float32's (``tf32x3``, three TF32
products, is within about 2^-21 at half the rate: the bench's 7.6B MoE took 101.6 ms a 2,048-token pass against
115.7 ms, and the 2B Qwen3.8 Flash Next's logits moved 5.6e-5 of the largest; bench/results/
score-vs-llamacpp-2026-12-03c.md); bfloat16 activations with the decoded weight rounded to bfloat16 (what
decoding, then converting the weight to bfloat16, then multiplying gives).  Results therefore equal
dequantize-then-matmul up to summation order (and bfloat16 splitting): tests/test_runtime_gpu.py states the bounds.
(Multiplying K-quant / Q8_0 integer codes exactly, two TF32 or three bfloat16 products, and scaling per 32-value
sub-block was measured 1.06-1.5x slower on the H200, across runs: a product per sub-block breaks the accumulator
chain; bench/results/score-vs-llamacpp-2026-12-02c.md.)
An NVFP4 tensor's global scale (one per tensor or per expert) multiplies the product instead of the weight.
(One launch for the gate and up products with ``silu(gate) * up`` in its epilogue, two accumulators in 64 x 64
tiles, was measured 9.7 ms slower per 7.6B 2048-token pass than two launches and torch's gate on the H200:
bench/results/score-vs-llamacpp-2026-12-02e.md.)

Routed experts (:func:`route`, :class:`Routed`): one routing kernel sorts the (token, expert) pairs by expert
(a counting sort) and writes the counts and the tile table; the grouped products then read each sorted row's
token from the unsorted activations and write each result, times its routing weight, to its (token, slot) row,
so no gathered or un-sorted copy of the activations is made.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGMLType

from ..errors import FormatError
from .triton_dequant import (bf16_values, f32_values, iq2_xxs_values, mxfp4_values, nvfp4_values, q2_k_values,
                             q4_k_values, q8_0_values, table)

#: Types multiplied packed: (sub-tiles per block, values per sub-tile, tables) of their ``*_values`` decoder.
#: BF16 and F32 rows are read in pseudo-blocks of 32 values (64 and 128 bytes).
FUSED_TYPES = {
    GGMLType.Q8_0: (1, 32, ()), GGMLType.Q4_K: (8, 32, ()), GGMLType.Q2_K: (16, 16, ()),
    GGMLType.IQ2_XXS: (32, 8, ("grid_iq2xxs", "ksigns")), GGMLType.MXFP4: (2, 16, ("kvalues_e2m1",)),
    GGMLType.NVFP4: (4, 16, ("kvalues_e2m1",)), GGMLType.BF16: (1, 32, ()), GGMLType.F32: (1, 32, ()),
}


@dataclass(frozen=True)
class Config:
    """A launch of the fused kernel: rows (tokens) and output columns per program, values per K step (each step
    decodes a ``[block_n, block_k]`` weight tile once and multiplies it by ``block_m`` rows), warps and software
    pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


#: Default launches, measured on the H200 in float32 (bench/packed_matmul.py; bench/results/score-gpu-2026-12-02c.md):
#: K steps of 64 values (a quarter of a K-quant block) beat whole 256-value blocks 2.0-3.4x in the grouped Q4_K
#: products (a 256-value step's float32 tiles fill shared memory: one program per SM, nothing hides the decode);
#: dense products take 128-row tiles (each decoded weight tile serves more rows), the grouped ones 64-row tiles
#: (a 7.6B MoE's experts see ~250 rows at 2048 tokens: 128-row tiles idle more).
DENSE = Config(128, 64, 64, 8, 3)
GROUPED = Config(64, 128, 64, 4, 3)
#: Narrow dense products (the router: ``n`` at most :data:`NARROW_N`) keep the first kernels' launch: 64 x 64
#: tiles, 128-value steps, two stages (0.08 ms for the 7.6B MoE's router at 2048 tokens; 32-row tiles with
#: 256-value steps took 1.0 ms, and :data:`DENSE` leaves half as many programs for a launch of few row tiles).
NARROW = Config(64, 64, 128, 4, 2)
NARROW_N = 64
#: (format, float32 activations, precision, device, asked config) -> the config that fit the device's shared memory.
_fitting: dict[tuple, Config] = {}
#: Triton's ``input_precision`` for float32 activations (see the module doc).
FLOAT32_PRECISION = "bf16x3"


def block_shape(qtype: GGMLType) -> tuple[int, int]:
    """(values, bytes) of one block of a fused type as the kernels read it."""
    if qtype is GGMLType.BF16:
        return 32, 64
    if qtype is GGMLType.F32:
        return 32, 128
    return GGML_QUANT_SIZES[qtype]


@triton.jit
def _decode(FORMAT: tl.constexpr, base, sub, val, m, t0, t1):
    if FORMAT == "Q8_0":
        v = q8_0_values(base, sub, val, m)
    elif FORMAT == "Q4_K":
        v = q4_k_values(base, sub, val, m)
    elif FORMAT == "Q2_K":
        v = q2_k_values(base, sub, val, m)
    elif FORMAT == "IQ2_XXS":
        v = iq2_xxs_values(base, sub, val, m, t0, t1)
    elif FORMAT == "MXFP4":
        v = mxfp4_values(base, sub, val, m, t0)
    elif FORMAT == "NVFP4":
        v = nvfp4_values(base, sub, val, m, t0)
    elif FORMAT == "BF16":
        v = bf16_values(base, sub, val, m)
    else:
        v = f32_values(base, sub, val, m)
    return v


@triton.jit
def _packed_matmul_kernel(x, w, out, tiles, scale, t0, t1, gather, scatter, row_weights, M, N, stride_x,
                          stride_out, out_col, expert_bytes, row_bytes, scale_stride, gather_div,
                          FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                          S_STEP: tl.constexpr, K_STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          GROUPED: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
                          SCALED: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:     # tile table: (expert or -1, first row, end of the expert's rows)
        expert = tl.load(tiles + 3 * pid_m)
        row0 = tl.load(tiles + 3 * pid_m + 1)
        row_end = tl.load(tiles + 3 * pid_m + 2)
    else:
        expert = pid_m * 0
        row0 = pid_m * BM
        row_end = M
    if expert >= 0:
        BK: tl.constexpr = S_STEP * SUB
        rows = row0 + tl.arange(0, BM)
        row_ok = rows < row_end
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < N
        # the weight tile [BN, S_STEP, SUB]: step t holds sub-tiles g = t * S_STEP + s of the row, sub-tile g % NSUB
        # of block g // NSUB (a step may hold several blocks, or part of one)
        s = tl.arange(0, S_STEP)[None, :, None]
        val = tl.arange(0, SUB)[None, None, :]
        w_row = w + expert.to(tl.int64) * expert_bytes + cols.to(tl.int64)[:, None, None] * row_bytes
        w_ok = col_ok[:, None, None]
        if GATHER:      # product row i reads row gather[i] // gather_div of x (the token of a routed pair)
            src = tl.load(gather + rows, mask=row_ok, other=0) // gather_div
        else:
            src = rows
        x_tile = x + src.to(tl.int64)[:, None] * stride_x + tl.arange(0, BK)[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for step in range(K_STEPS):
            g = step * S_STEP + s
            wv = _decode(FORMAT, w_row + (g // NSUB) * TYPE_SIZE, g % NSUB, val, w_ok, t0, t1)
            wv = tl.reshape(wv, (BN, BK))
            xv = tl.load(x_tile + step * BK, mask=row_ok[:, None], other=0.0)
            if FP32:
                acc = tl.dot(xv, tl.trans(wv), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(xv, tl.trans(wv.to(xv.dtype)), acc)
        if SCALED:
            acc = acc * tl.load(scale + expert * scale_stride)
        if SCATTER:     # product row i, times row_weights[scatter[i]], is row scatter[i] of out
            dst_row = tl.load(scatter + rows, mask=row_ok, other=0)
            acc = acc * tl.load(row_weights + dst_row, mask=row_ok, other=0.0)[:, None]
        else:
            dst_row = rows
        dst = out + dst_row.to(tl.int64)[:, None] * stride_out + out_col + cols[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _step_values(k: int, sub: int, asked: int) -> int:
    """Values per K step: the largest power-of-two multiple of the decoder's sub-tile, at most ``asked`` (and at
    least the 16 a product needs), that divides ``k`` (the sub-tile always does: it divides the block)."""
    step = sub
    while step * 2 <= max(asked, 16) and k % (step * 2) == 0:
        step *= 2
    return step


@dataclass(frozen=True)
class ExpertTiles:
    """Row tiles of rows sorted by expert (:func:`expert_tiles`): ``table`` int32 ``[tiles, 3]`` (expert or -1 for
    a spare tile, first row, end of the expert's rows), ``block_m`` rows each."""

    table: torch.Tensor
    block_m: int


def expert_tiles(counts: torch.Tensor, rows: int, block_m: int = GROUPED.block_m) -> ExpertTiles:
    """The :class:`ExpertTiles` of ``rows`` rows sorted by expert, ``counts[e]`` rows of expert ``e``, ``block_m``
    rows per tile.  Computed on the device without waiting for it: the table has the most tiles any counts of
    ``rows`` rows can need."""
    n_experts = counts.numel()
    counts = counts.to(torch.int64)
    per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(per_expert, 0)
    row_starts = torch.cumsum(counts, 0) - counts
    t = torch.arange(triton.cdiv(rows, block_m) + n_experts, device=counts.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    valid = expert < n_experts
    expert = expert.clamp(max=n_experts - 1)
    first = row_starts[expert] + (t - (tile_ends[expert] - per_expert[expert])) * block_m
    table = torch.stack([torch.where(valid, expert, -1), first, row_starts[expert] + counts[expert]], 1)
    return ExpertTiles(table.to(torch.int32), block_m)


#: Most per-chunk expert counts the routing kernel reads into one program (chunks x experts, powers of two):
#: 4,096 tokens x top-8 over 64 experts; a 16K-token pass would hold 64K of them (registers spill), 2,048 tokens
#: over 256 experts 128K.  Beyond, torch's sort (no host wait either: CUDA graphs capture it).
ROUTE_MAX_COUNTS = 1 << 14


@dataclass(frozen=True)
class Routed:
    """Routed (token, expert) pairs read and written where they are by a grouped product, with no gathered or
    un-sorted copy: product row ``i`` (rows sorted by expert) reads row ``gather[i] // gather_div`` of ``x``
    (the pair's token); its result times ``weights[scatter[i]]`` (float32) is row ``scatter[i]`` of ``out``."""

    gather: torch.Tensor | None = None
    gather_div: int = 1
    scatter: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@triton.jit
def _route_count_kernel(pairs, chunk_counts, P, CH: tl.constexpr, EP: tl.constexpr):
    c = tl.program_id(0)
    i = c * CH + tl.arange(0, CH)
    e = tl.load(pairs + i, mask=i < P, other=-1)
    hot = (e[:, None] == tl.arange(0, EP)[None, :]).to(tl.int32)
    tl.store(chunk_counts + c * EP + tl.arange(0, EP), tl.sum(hot, 0))


@triton.jit
def _route_place_kernel(pairs, chunk_counts, order, counts, table, P, E, CHUNKS, TILES, CH: tl.constexpr,
                        EP: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr, TB: tl.constexpr):
    c = tl.program_id(0)
    ch = tl.arange(0, CP)
    ex = tl.arange(0, EP)
    per_chunk = tl.load(chunk_counts + ch[:, None] * EP + ex[None, :], mask=ch[:, None] < CHUNKS, other=0)
    totals = tl.sum(per_chunk, 0)
    starts = tl.cumsum(totals, 0) - totals
    # a counting sort, stable: a pair's place is its expert's first row, plus the expert's pairs in earlier
    # chunks, plus those before it in this chunk
    base = starts + tl.sum(tl.where(ch[:, None] < c, per_chunk, 0), 0)
    i = c * CH + tl.arange(0, CH)
    e = tl.load(pairs + i, mask=i < P, other=-1)
    hot = (e[:, None] == ex[None, :]).to(tl.int32)
    place = tl.sum(hot * (base[None, :] + tl.cumsum(hot, 0) - 1), 1)
    tl.store(order + place, i, mask=i < P)
    if c == 0:
        tl.store(counts + ex, totals.to(tl.int64), mask=ex < E)
    # program c also writes tiles c * TB .. c * TB + TB - 1 of the table
    per_expert = (totals + BM - 1) // BM
    tile_end = tl.cumsum(per_expert, 0)
    tile_start = tile_end - per_expert
    t = c * TB + tl.arange(0, TB)
    inside = (t[:, None] >= tile_start[None, :]) & (t[:, None] < tile_end[None, :])
    expert = tl.where(tl.sum(inside.to(tl.int32), 1) > 0, tl.sum(tl.where(inside, ex[None, :], 0), 1), -1)
    first = tl.sum(tl.where(inside, starts[None, :] + (t[:, None] - tile_start[None, :]) * BM, 0), 1)
    end = tl.sum(tl.where(inside, starts[None, :] + totals[None, :], 0), 1)
    ok = t < TILES
    tl.store(table + 3 * t, expert, mask=ok)
    tl.store(table + 3 * t + 1, first, mask=ok)
    tl.store(table + 3 * t + 2, end, mask=ok)


def route(pairs: torch.Tensor, n_experts: int, block_m: int = GROUPED.block_m
          ) -> tuple[torch.Tensor, torch.Tensor, ExpertTiles]:
    """``(order, counts, tiles)`` of the routed experts ``pairs`` (int64, one per (token, slot) pair): ``order``
    int32, the pairs' indices sorted by expert (stably: ``torch.argsort(pairs, stable=True)``), ``counts`` int64
    pairs per expert, ``tiles`` :func:`expert_tiles` of them (spare tiles ``(-1, 0, 0)``).  Two launches and no
    host wait, where sorting and tabulating with torch took about 25 kernels (a radix sort over 64-bit keys).
    Past :data:`ROUTE_MAX_COUNTS` (long passes, many experts) torch's sort and :func:`expert_tiles` instead:
    every program of the placing kernel holds all chunks' counts."""
    rows = pairs.numel()
    ep = triton.next_power_of_2(max(n_experts, 2))
    ch = max(16, min(256, 8192 // ep))          # a chunk's one-hot [ch, ep] stays in registers
    chunks = triton.cdiv(rows, ch)
    if triton.next_power_of_2(chunks) * ep > ROUTE_MAX_COUNTS:
        order = torch.argsort(pairs, stable=True).to(torch.int32)
        counts = torch.zeros(n_experts, dtype=torch.int64, device=pairs.device).scatter_add_(
            0, pairs, torch.ones_like(pairs, dtype=torch.int64))            # bincount would wait for the device
        return order, counts, expert_tiles(counts, rows, block_m)
    n_tiles = triton.cdiv(rows, block_m) + n_experts
    chunk_counts = torch.empty(chunks, ep, dtype=torch.int32, device=pairs.device)
    order = torch.empty(rows, dtype=torch.int32, device=pairs.device)
    counts = torch.empty(n_experts, dtype=torch.int64, device=pairs.device)
    table = torch.empty(n_tiles, 3, dtype=torch.int32, device=pairs.device)
    if rows:
        tb = max(16, min(128, 8192 // ep))
        _route_count_kernel[(chunks,)](pairs, chunk_counts, rows, CH=ch, EP=ep)
        _route_place_kernel[(max(chunks, triton.cdiv(n_tiles, tb)),)](
            pairs, chunk_counts, order, counts, table, rows, n_experts, chunks, n_tiles, CH=ch, EP=ep,
            CP=triton.next_power_of_2(chunks), BM=block_m, TB=tb)
    else:
        counts.zero_()
        table.copy_(torch.tensor([-1, 0, 0], dtype=torch.int32, device=pairs.device).expand(n_tiles, 3))
    return order, counts, ExpertTiles(table, block_m)


def _fallbacks(config: Config, sub: int):
    """``config``, then ones needing less shared memory: fewer stages, then shorter K steps, then fewer columns."""
    yield config
    for stages in range(config.stages - 1, 0, -1):
        yield replace(config, stages=stages)
    block_k = config.block_k
    while block_k > max(sub, 16):
        block_k //= 2
        yield replace(config, block_k=block_k, stages=1)
    block_n = config.block_n
    while block_n > 16:
        block_n //= 2
        yield replace(config, block_k=max(sub, 16), block_n=block_n, stages=1)


def _launch(x: torch.Tensor, payload: torch.Tensor, qtype: GGMLType, n: int, out: torch.Tensor, out_col: int,
            tiles: ExpertTiles | None, scale: torch.Tensor | None, precision: str, config: Config | None,
            routed: Routed | None = None) -> torch.Tensor:
    qtype = GGMLType(int(qtype))
    if qtype not in FUSED_TYPES:
        raise FormatError(f"no fused product for {qtype.name}")
    if x.dtype not in (torch.float32, torch.bfloat16) or out.dtype != x.dtype:
        raise FormatError(f"fused products take float32 or bfloat16 activations and output, got {x.dtype}/"
                          f"{out.dtype}")
    if payload.dtype != torch.uint8 or payload.device != x.device or not payload.is_contiguous():
        raise FormatError(f"{qtype.name} payload must be a contiguous uint8 tensor on the activations' device")
    nsub, sub, tables = FUSED_TYPES[qtype]
    block_values, type_size = block_shape(qtype)
    k = x.shape[1]
    if k % block_values or x.stride(1) != 1 or out.stride(1) != 1:
        raise FormatError(f"{qtype.name} product over {k} values: not whole {block_values}-value blocks, or "
                          f"strided rows")
    row_bytes = k // block_values * type_size
    experts = 1 if tiles is None else payload.numel() // (n * row_bytes)
    if payload.numel() != experts * n * row_bytes:
        raise FormatError(f"{qtype.name} payload of {payload.numel()} bytes is not {experts} x {n} rows of "
                          f"{row_bytes} bytes")
    args = [table(name, x.device) for name in tables] + [payload] * (2 - len(tables))
    m = x.shape[0] if routed is None or routed.gather is None else routed.gather.numel()
    if m == 0 or n == 0:
        return out
    fp32 = x.dtype == torch.float32
    if config is None:
        config = GROUPED if tiles is not None else NARROW if n <= NARROW_N else DENSE
    if tiles is not None and tiles.block_m != config.block_m:
        raise FormatError(f"expert tiles of {tiles.block_m} rows for a launch of {config.block_m}-row programs")
    gather = routed.gather if routed is not None else None
    scatter = routed.scatter if routed is not None else None
    key = (qtype.name, fp32, precision, x.device, config, gather is not None, scatter is not None)
    for fit in ((_fitting[key],) if key in _fitting else _fallbacks(config, sub)):
        step = _step_values(k, sub, fit.block_k)
        grid = (triton.cdiv(m, fit.block_m) if tiles is None else tiles.table.shape[0], triton.cdiv(n, fit.block_n))
        try:
            _packed_matmul_kernel[grid](
                x, payload, out, tiles.table if tiles is not None else payload, scale if scale is not None else
                payload, *args, payload if gather is None else gather, payload if scatter is None else scatter,
                payload if scatter is None else routed.weights, m, n, x.stride(0), out.stride(0), out_col,
                n * row_bytes, row_bytes, 0 if scale is None or scale.numel() == 1 else 1,
                1 if gather is None else routed.gather_div,
                FORMAT=qtype.name, TYPE_SIZE=type_size, NSUB=nsub, SUB=sub, S_STEP=step // sub, K_STEPS=k // step,
                BM=fit.block_m, BN=fit.block_n, GROUPED=tiles is not None, GATHER=gather is not None,
                SCATTER=scatter is not None, SCALED=scale is not None, FP32=fp32,
                PRECISION=precision, num_warps=fit.warps, num_stages=fit.stages)
        except triton.runtime.errors.OutOfResources:
            continue
        _fitting[key] = fit
        return out
    raise FormatError(f"no launch configuration of the fused {qtype.name} product fits this device's shared memory")


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device) if out is None else out


def linear(x: torch.Tensor, payload: torch.Tensor, qtype: "GGMLType | int", n: int, *,
           out: torch.Tensor | None = None, out_col: int = 0, scale: torch.Tensor | None = None,
           precision: str | None = None, config: Config | None = None) -> torch.Tensor:
    """``x @ W.T`` (``x [m, k]``; ``W [n, k]`` as its packed payload), into ``out[:, out_col:out_col + n]``
    (a new ``[m, n]`` tensor by default); ``scale``: an NVFP4 global scale (one value); ``precision``: Triton's
    ``input_precision`` for float32 activations (by default :data:`FLOAT32_PRECISION`; ``ieee``: plain float32
    products, no tensor cores); ``config``: the launch (by default :data:`DENSE`, or :data:`NARROW`).  An F32
    weight times float32 activations goes to cuBLAS instead (:func:`_by_cublas`, :func:`_cublas_f32_linear`)."""
    payload = payload.reshape(-1)
    if _by_cublas(x, payload, qtype, scale, config):
        return _cublas_f32_linear(x, payload, n, _output(x, n, out), out_col, precision or FLOAT32_PRECISION)
    return _launch(x, payload, qtype, n, _output(x, n, out), out_col, None, scale, precision or FLOAT32_PRECISION,
                   config)


def _by_cublas(x: torch.Tensor, payload: torch.Tensor, qtype, scale, config) -> bool:
    """Whether a dense product goes to cuBLAS: an F32 weight (its payload is the matrix itself, nothing to
    decode) times float32 activations, no launch asked for.  Its kernels suit the narrow and long shapes of such
    weights (Qwen3.8's and DeepSeek V4's hyper-connection maps: ``[2048, 8192] x [8192, 320]`` took the fused
    kernel 1.5 ms for 80 programs on the H200's 132 SMs, and the 24- and 4-column maps over 8,192 values were
    as slow)."""
    return (int(qtype) == GGMLType.F32 and x.dtype == torch.float32 and scale is None and config is None
            and payload.dtype == torch.uint8 and payload.storage_offset() % 4 == 0 and x.device == payload.device)


#: F32 weights of at least this many rows multiply in bf16x3 by one bfloat16 cuBLAS product three times as long
#: (:func:`bf16x3_split`, float32 sums: the fused products' arithmetic) rather than in plain float32 (no tensor
#: cores: Qwen3.8's ``[2048, 8192] x [8192, 320]`` hyper-connection maps took ~228 us each on the H200).
#: Narrower maps (4 and 24 rows) stay float32: their products are short, splitting the activations would dominate.
#: The weight is split at each product (~10 us for 2.6M values): a kept split would hold 1.5x the weight again.
BF16X3_MIN_ROWS = 64


def _cublas_f32_linear(x: torch.Tensor, payload: torch.Tensor, n: int, out: torch.Tensor, out_col: int,
                       precision: str) -> torch.Tensor:
    """``x @ W.T`` for an F32 payload viewed in place as ``W [n, k]``, into ``out[:, out_col:out_col + n]``."""
    k = x.shape[1]
    if payload.numel() != n * k * 4:
        raise FormatError(f"F32 payload of {payload.numel()} bytes is not {n} rows of {k * 4} bytes")
    weight = payload.view(torch.float32).view(n, k)
    whole = out_col == 0 and out.shape[1] == n
    if precision == "bf16x3" and n >= BF16X3_MIN_ROWS:
        operands = bf16x3_split(x, low=2), bf16x3_split(weight, low=1).t()
        if whole:
            torch.mm(*operands, out_dtype=torch.float32, out=out)
        else:
            out[:, out_col:out_col + n] = torch.mm(*operands, out_dtype=torch.float32)
    elif whole:
        torch.mm(x, weight.t(), out=out)
    else:
        out[:, out_col:out_col + n] = x @ weight.t()
    return out


@triton.jit
def _split_kernel(x, out, k, LOW: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < k
    v = tl.load(x + row * k + cols, mask=keep)
    high = v.to(tl.bfloat16)
    low = (v - high.to(tl.float32)).to(tl.bfloat16)
    base = out + row * 3 * k + cols
    for slot in tl.static_range(3):
        if slot == LOW:
            tl.store(base + slot * k, low, mask=keep)
        else:
            tl.store(base + slot * k, high, mask=keep)


def bf16x3_split(x: torch.Tensor, low: int) -> torch.Tensor:
    """float32 ``x [m, k]`` as bfloat16 ``[m, 3k]``: its bfloat16 rounding ``hi`` in two k-wide slots and the
    rounding of the remainder ``lo`` in slot ``low``.  An operand split with ``low=2`` times one split with
    ``low=1`` (transposed) sums ``hi hi + hi lo + lo hi``: bf16x3's three products, within about 3 x 2^-18 of
    float32's each, as :data:`FLOAT32_PRECISION`."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, 3 * k, dtype=torch.bfloat16, device=x.device)
    if x.numel():
        _split_kernel[(m, triton.cdiv(k, 1024))](x, out, k, LOW=low, BLOCK=1024, num_warps=4)
    return out


def grouped_linear(x: torch.Tensor, payload: torch.Tensor, qtype: "GGMLType | int", n: int, counts: torch.Tensor,
                   *, out: torch.Tensor | None = None, out_col: int = 0, scale: torch.Tensor | None = None,
                   tiles: ExpertTiles | None = None, config: Config | None = None,
                   routed: Routed | None = None) -> torch.Tensor:
    """``x[i] @ W[e_i].T`` for rows sorted by expert (``counts[e]`` rows of expert ``e``; ``W [experts, n, k]`` as
    its packed payload), every expert in one launch; ``scale``: NVFP4 global scales (one, or one per expert);
    ``tiles``: :func:`expert_tiles` of ``counts`` (computed here if not given, of ``config``'s rows per tile);
    ``config``: the launch (by default :data:`GROUPED`); ``routed``: rows read from, or written to, where they
    are (:class:`Routed`; ``out`` must be given for a scatter)."""
    rows = x.shape[0] if routed is None or routed.gather is None else routed.gather.numel()
    if routed is not None and routed.scatter is not None and (out is None or routed.weights is None
                                                              or routed.weights.dtype != torch.float32):
        raise FormatError("a scattered product needs its output and float32 row weights")
    if tiles is None:
        tiles = expert_tiles(counts, rows, (config or GROUPED).block_m)
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    return _launch(x, payload.reshape(-1), qtype, n, out, out_col, tiles, scale, FLOAT32_PRECISION, config, routed)
