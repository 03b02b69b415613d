"""Payload audit: re-encode the planned tensors from the source and compare them byte for byte with the artifact,
and measure each tensor's dequantized error against the source.

Modes:

- ``full``: every piece of every tensor (:func:`quantkit.convert.tensors.pieces`).  Tensors are taken grouped by the first
  source shard they read, and each shard is hashed just before its group, so a shard is read from disk once and
  re-read from the page cache (the artifact is read once: the bytes compared are the bytes scanned for scales).
- ``sample``: every tensor that is neither an expert tensor nor a row table in full; for each routed-expert tensor
  (3-D, class in :data:`EXPERT_CLASSES`) the first, one seeded middle and the last expert in full, and the first
  and last row of *every* expert (so one corrupted expert is caught whatever the seed; an edge row costs a row
  read where the source stores plain floats, else one expert's decode); for each row table
  (class in :data:`ROW_TABLE_CLASSES`) rows 0, 1 and the last, every power-of-two boundary ``2^k - 1, 2^k``, and
  :data:`RANDOM_ROWS` seeded random rows.  Only those regions of the artifact (and of the source, where it allows)
  are read.  The seed of a tensor's choice is ``(seed, crc32(name))``, so choices differ between tensors and
  repeat between runs.
- ``none``: no comparison (structure and inventory only).

A difference names the tensor, the expert (3-D tensors), the row and the first differing block, and the absolute
file offset of that block.

**Error bounds** (:func:`error_bound`).  Per tensor, over the rows compared, with ``e = decode(artifact) - source``:
``rmse(e) <= rel_rmse * rms(source) + abs_floor`` and ``max|e| <= max_abs * max|source| + abs_floor``.

- Float types with ``m`` mantissa bits (F32 23, F16 10, BF16 7): round to nearest is within half an ulp, i.e.
  within ``2^-(m+1) |x|``, so ``rel_rmse = max_abs = 2^-(m+1)`` hold exactly; ``abs_floor`` is half the smallest
  subnormal step (F16: ``2^-25``), where relative precision ends.
- Block types of ``b`` bits per weight (scales included: Q8_0 8.5, Q6_K 6.5625, Q4_K 4.5, MXFP4 4.25, Q2_K 2.625,
  IQ2_XXS 2.0625): a uniform quantizer of ``2^b`` levels over a block's range errs by ``~2^-b`` of the range;
  ``rel_rmse = 2^(3-b)`` and ``max_abs = 2^(4-b)`` leave a margin of 1.5x (Q4_1) to 4x over the worst measured
  on Gaussian, heavy-tailed (Student t, ν = 1.5 and 3), outlier-column, uniform, sparse, row-scaled and tiny
  data, with and without importance (``tests/test_validate_bounds.py``).  ``abs_floor = 2^-15`` covers f16 block scales that underflow (half the
  smallest f16 step, 2^-25, times code x sub-scale magnitudes up to 2^10) on tensors of tiny magnitude.  At 2 bits
  the bounds exceed 1 and only flag gross corruption (a sign flip doubles the error); the byte comparison is
  the exact check.
- Integer tables and lossless repacks (MXFP4/NVFP4 from packed FP4 sources) have no error: their bytes are
  compared.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numba
import numpy as np

from ..arch import CLASS_GROUPS, ROW_TABLE_CLASSES   # row tables are sampled by rows
from ..convert.tensors import SourceContext, TensorJob, tensor_rows
from ..formats.api import decode
from ..formats.registry import GGMLType, layout as type_layout
from ..io.gguf import GGUFTensor, ggml_dims
from ..io.gguf_reader import GGUFFile
from .pieces import chosen
from .foreign import ForeignPlan
from .replan import Replan
from .report import Check, check, skipped
from .structure import ArtifactReader, ScaleScan, locate

PAYLOAD_MODES = ("none", "sample", "full")
EXPERT_CLASSES = CLASS_GROUPS["routed_experts"]
RANDOM_ROWS = 128
#: Differences listed per tensor in the report.
DIFFERENCES_LISTED = 8
_FLOAT_BITS = {GGMLType.F32: (23, 0.0), GGMLType.F16: (10, 2.0 ** -25), GGMLType.BF16: (7, 2.0 ** -134)}
BLOCK_ABS_FLOOR = 2.0 ** -15
_LOSSLESS_KINDS = ("mxfp4-repack", "nvfp4-repack", "nvfp4-scale")


@dataclass(frozen=True)
class ErrorBound:
    rel_rmse: float
    max_abs: float
    abs_floor: float


def error_bound(qtype: "GGMLType | int | str") -> ErrorBound:
    """The error a correct encoding to ``qtype`` stays within (see the module docstring)."""
    fmt = type_layout(qtype)
    if fmt.qtype in _FLOAT_BITS:
        mantissa, floor = _FLOAT_BITS[fmt.qtype]
        return ErrorBound(2.0 ** -(mantissa + 1), 2.0 ** -(mantissa + 1), floor)
    bits = fmt.bits_per_weight
    return ErrorBound(2.0 ** (3 - bits), 2.0 ** (4 - bits), BLOCK_ABS_FLOOR)


# -- what to compare ----------------------------------------------------------------------------------------------

def sample_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of tensor ``name``'s sampled expert and rows."""
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


def sample_experts(n: int, rng: np.random.Generator) -> list[int]:
    """The first, a seeded middle and the last of ``n`` experts."""
    middle = [int(rng.integers(1, n - 1))] if n > 2 else []
    return sorted({0, *middle, n - 1})


def expert_edge_rows(n_experts: int, rows_per_expert: int, full: list[int]) -> np.ndarray:
    """Rows of a ``[n_experts, rows_per_expert, n]`` tensor's ``[rows, n]`` view: the first and last row of every
    expert, and every row of the experts in ``full``."""
    starts = np.arange(n_experts, dtype=np.int64) * rows_per_expert
    whole = [np.arange(e * rows_per_expert, (e + 1) * rows_per_expert, dtype=np.int64) for e in full]
    return np.unique(np.concatenate([starts, starts + rows_per_expert - 1, *whole]))


def sample_rows(n: int, rng: np.random.Generator, random_rows: int = RANDOM_ROWS) -> np.ndarray:
    """Rows 0, 1, the last, ``2^k - 1`` and ``2^k`` below ``n``, and ``random_rows`` seeded random rows."""
    fixed = {0, 1, n - 1}
    for k in range(1, max(1, n.bit_length())):
        fixed |= {(1 << k) - 1, 1 << k}
    rows = np.fromiter((r for r in fixed if 0 <= r < n), dtype=np.int64)
    random = rng.choice(n, size=min(random_rows, n), replace=False)
    return np.unique(np.concatenate([rows, random]))


@dataclass
class TensorResult:
    name: str
    type: str
    shape: list[int]
    compared: str
    experts: list[int] | None = None
    rows: int = 0
    bytes_compared: int = 0
    differences: list[str] = field(default_factory=list)
    differing_rows: int = 0
    differing_experts: list[int] = field(default_factory=list)
    sum_e2: float = 0.0
    sum_x2: float = 0.0
    count: int = 0
    max_abs: float = 0.0
    amax: float = 0.0
    note: str = ""

    def error(self) -> tuple[float | None, float | None]:
        if self.count == 0:
            return None, None
        rmse = math.sqrt(self.sum_e2 / self.count)
        if math.isnan(rmse):
            return math.nan, math.nan
        rel = rmse / math.sqrt(self.sum_x2 / self.count) if self.sum_x2 else (0.0 if rmse == 0 else math.inf)
        return rel, self.max_abs

    def error_problem(self, bound: ErrorBound) -> str | None:
        if self.count == 0:
            return None
        rmse = math.sqrt(self.sum_e2 / self.count)
        rms = math.sqrt(self.sum_x2 / self.count)
        rel, max_abs = self.error()
        if not rmse <= bound.rel_rmse * rms + bound.abs_floor:
            return f"relative RMSE {rel:.4g} exceeds the {self.type} bound {bound.rel_rmse:.4g}"
        if not max_abs <= bound.max_abs * self.amax + bound.abs_floor:
            return (f"max abs error {max_abs:.4g} exceeds the {self.type} bound {bound.max_abs:.4g} x max |w| "
                    f"{self.amax:.4g}")
        return None

    def to_json(self) -> dict:
        rel, max_abs = self.error()
        out = {"name": self.name, "type": self.type, "shape": self.shape, "compared": self.compared,
               "rows": self.rows, "bytes_compared": self.bytes_compared, "match": not self.differences,
               "differing_rows": self.differing_rows, "differing_experts": self.differing_experts,
               "differences": self.differences,
               "rel_rmse": rel, "max_abs": max_abs}
        if self.experts is not None:
            out["experts"] = self.experts
        if self.count:
            bound = error_bound(self.type)
            out["bound"] = {"rel_rmse": bound.rel_rmse, "max_abs": bound.max_abs, "abs_floor": bound.abs_floor}
            out["error_ok"] = self.error_problem(bound) is None
        if self.note:
            out["note"] = self.note
        return out


@numba.njit(cache=True)
def _error_sums(x: np.ndarray, d: np.ndarray) -> tuple[float, float, float, float, bool]:
    """Over float32 ``x`` (source) and ``d`` (decoded), in float64: sum e^2, sum x^2, max |e|, max |x| and whether
    some e is not finite (one pass; numpy would make four, with float64 temporaries)."""
    sum_e2 = 0.0
    sum_x2 = 0.0
    max_e = 0.0
    max_x = 0.0
    nonfinite = False
    for i in range(x.size):
        xi = np.float64(x[i])
        e = np.float64(d[i]) - xi
        if not np.isfinite(e):
            nonfinite = True
        sum_e2 += e * e
        sum_x2 += xi * xi
        max_e = max(max_e, abs(e))
        max_x = max(max_x, abs(xi))
    return sum_e2, sum_x2, max_e, max_x, nonfinite


def _accumulate(result: TensorResult, x: np.ndarray, d: np.ndarray) -> None:
    sum_e2, sum_x2, max_e, max_x, nonfinite = _error_sums(
        np.ascontiguousarray(x, dtype=np.float32).reshape(-1), np.ascontiguousarray(d, dtype=np.float32).reshape(-1))
    result.sum_e2 += sum_e2
    result.sum_x2 += sum_x2
    result.max_abs = math.inf if nonfinite else max(result.max_abs, max_e)
    result.amax = max(result.amax, max_x)
    result.count += x.size


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """(first index into ``rows``, length) of each run of consecutive row numbers."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [rows.size]])
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def _holds_other_row(actual: np.ndarray, expected: np.ndarray, rows: np.ndarray, i: int) -> str:
    """For a differing row: whether it holds another compared row of the source (rows reordered, shifted or
    duplicated), as a note for the difference."""
    same = np.flatnonzero((expected == actual[i]).all(axis=1))
    same = same[same != i]
    # only where that row is far from the one expected here: in a table of few values a flipped bit can spell
    # another row, which says nothing of rows moving
    if same.size and (expected[same[0]] != expected[i]).sum() * 8 > expected.shape[1]:
        return f": holds source row {int(rows[same[0]])} (rows reordered or duplicated)"
    if i > 0 and rows[i - 1] == rows[i] - 1 and np.array_equal(actual[i], actual[i - 1]):
        return f": a duplicate of row {int(rows[i - 1])}"
    return ""


class _Comparer:
    """Reads the artifact rows matching produced pieces, scans their scales, compares bytes, measures error."""

    def __init__(self, f: GGUFFile, reader: ArtifactReader, scan: ScaleScan):
        self.f, self.reader, self.scan = f, reader, scan

    def compare(self, t: GGUFTensor, result: TensorResult, rows: np.ndarray, x: np.ndarray | None,
                expected: np.ndarray) -> None:
        """``rows``: the global row numbers (sorted) of ``expected`` (uint8 [k, row_bytes]) and ``x``."""
        row_bytes = t.row_bytes
        base = self.f.data_offset + t.offset
        actual = np.empty_like(expected)
        for first, length in _runs(rows):
            start = int(rows[first]) * row_bytes
            data = self.reader.read(base + start, length * row_bytes)
            self.scan.scan(t, start, data)
            actual[first:first + length] = data.reshape(length, row_bytes)
        result.rows += rows.size
        result.bytes_compared += actual.size
        if not np.array_equal(actual, expected):
            differs = (actual != expected)
            bad_rows = np.flatnonzero(differs.any(axis=1))
            result.differing_rows += bad_rows.size
            if len(t.shape) == 3:
                experts = set(result.differing_experts) | set((rows[bad_rows] // t.shape[1]).tolist())
                result.differing_experts = sorted(int(e) for e in experts)
            for i in bad_rows[:max(0, DIFFERENCES_LISTED - len(result.differences))]:
                type_size = type_layout(t.type).type_size
                block = (int(rows[i]) * row_bytes + int(np.argmax(differs[i]))) // type_size
                result.differences.append(f"{locate(t, block)} (file offset {base + block * type_size:,})"
                                          + _holds_other_row(actual, expected, rows, int(i)))
        if x is not None:
            decoded = decode(actual, t.type, (rows.size, t.shape[-1]))
            _accumulate(result, x, decoded)


# -- per tensor ---------------------------------------------------------------------------------------------------

def _selection(t: GGUFTensor, job: TensorJob, mode: str, seed: int) -> tuple[str, list[int] | None, np.ndarray | None]:
    """(how compared, experts, rows) of a tensor in ``mode``; experts/rows None: all of them."""
    cls = job.output.tensor_class
    if mode == "sample" and len(t.shape) == 3 and cls in EXPERT_CLASSES:
        experts = sample_experts(t.shape[0], sample_rng(seed, t.name))
        return "sample", experts, expert_edge_rows(t.shape[0], t.shape[1], experts)
    if mode == "sample" and cls in ROW_TABLE_CLASSES:
        return "sample", None, sample_rows(tensor_rows(t.shape), sample_rng(seed, t.name))
    return "full", None, None


def _audit_tensor(ctx: SourceContext, job: TensorJob, t: GGUFTensor, comparer: _Comparer, mode: str,
                  seed: int) -> TensorResult:
    compared, experts, rows = _selection(t, job, mode, seed)
    result = TensorResult(t.name, t.type.name, list(t.shape), compared, experts)
    if job.kind in _LOSSLESS_KINDS:
        result.note = "lossless: bytes compared, no error to measure"
    honoured, parts = chosen(ctx, job, None if rows is not None else experts, rows)
    if not honoured:
        result.compared = "full"
        result.note = "row positions known only after loading: every row compared"
    done = 0
    for piece, local in parts:
        x, expected = piece.produce(local)
        if local is not None:
            comparer.compare(t, result, local + piece.row, x, expected)
            continue
        first = piece.row if piece.row is not None else done
        comparer.compare(t, result, np.arange(first, first + expected.shape[0]), x, expected)
        done = first + expected.shape[0]
    return result


def _in_experts(experts: list[int]) -> str:
    if not experts:
        return ""
    return f", in expert{'s' if len(experts) > 1 else ''} " + ", ".join(map(str, experts))


def _shard_order(ctx: SourceContext, job: TensorJob, shards: list) -> int:
    """Index of the first shard (in ``shards``) the job reads; jobs reading no listed shard come last."""
    index = {p.name: i for i, p in enumerate(shards)}
    found = [index[ctx.checkpoint.tensor_info(m.hf_name).file.name] for m in job.output.sources
             if ctx.checkpoint.tensor_info(m.hf_name).file.name in index]
    return min(found, default=len(shards))


def audit(f: GGUFFile, plan: "Replan | ForeignPlan", reader: ArtifactReader, scan: ScaleScan, mode: str, seed: int
          ) -> tuple[list[Check], list[dict]]:
    """The ``payload.bytes`` and ``payload.error`` checks and the per-tensor results (see the module docstring)."""
    if mode == "none":
        why = "--payload none"
        return [skipped("payload.bytes", why), skipped("payload.error", why)], []
    ctx = SourceContext(str(plan.source_path), plan.model_type, plan.imatrix_path, plan.imatrix_shapes,
                        allow_synthetic_imatrix=True)
    comparer = _Comparer(f, reader, scan)
    results: list[TensorResult] = []
    not_compared = []
    try:
        jobs = list(plan.jobs.values())
        shards = plan.shards
        if mode == "full":
            order = {name: i for i, name in enumerate(plan.jobs)}
            jobs.sort(key=lambda j: (_shard_order(ctx, j, shards), order[j.name]))
        hashed: set[str] = set()
        for job in jobs:
            t = f.tensors.get(plan.stored_name(job.name))
            if t is None or t.type != job.qtype or ggml_dims(t.shape) != ggml_dims(job.output.shape):
                not_compared.append(job.name)
                continue
            if mode == "full":
                shard = _shard_order(ctx, job, shards)
                for s in shards[:shard + 1]:
                    if s.name not in hashed:
                        plan.hash_file(s)
                        hashed.add(s.name)
            results.append(_audit_tensor(ctx, job, t, comparer, mode, seed))
            ctx.release()   # mapped source pages count as resident until unmapped
        if mode == "full":
            for s in shards:
                if s.name not in hashed:
                    plan.hash_file(s)
    finally:
        ctx.release()
    results.sort(key=lambda r: f.tensors[r.name].offset)

    differing = [f"{r.name}: {r.differing_rows} of {r.rows} {'sampled ' if r.compared == 'sample' else ''}rows "
                 f"differ{_in_experts(r.differing_experts)}; first at {r.differences[0]}"
                 for r in results if r.differences]
    sampled = sum(r.compared == "sample" for r in results)
    scope = f"{len(results)} tensors" + (f" ({sampled} sampled)" if sampled else "")
    note = f"; {len(not_compared)} tensors not compared (inventory differs)" if not_compared else ""
    compared_bytes = sum(r.bytes_compared for r in results)
    bytes_check = check("payload.bytes", differing,
                        passed=f"{scope}, {compared_bytes:,} bytes identical to the re-encoded source{note}")
    errors = []
    worst = (0.0, "")
    for r in results:
        if not r.count:
            continue
        bound = error_bound(r.type)
        problem = r.error_problem(bound)
        if problem:
            errors.append(f"{r.name}: {problem}")
        rel, _ = r.error()
        ratio = rel / bound.rel_rmse if rel is not None and not math.isnan(rel) else math.inf
        worst = max(worst, (ratio, r.name))
    error_check = check("payload.error", errors,
                        passed=f"every tensor within its type's bound; worst relative RMSE at "
                               f"{worst[0]:.2f} of its bound ({worst[1]})" if worst[1] else "no float tensor compared")
    return [bytes_check, error_check], [r.to_json() for r in results]
