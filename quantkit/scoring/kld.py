"""llama-perplexity's saved-logits file and its KL-divergence statistics (``tools/perplexity/perplexity.cpp``).

File layout (little-endian), as ``llama-perplexity --kl-divergence-base FILE`` writes and reads it::

    char[8]   "_logits_"
    u32       n_ctx
    i32       n_vocab
    i32       n_chunk
    i32       tokens[n_ctx * n_chunk]          the evaluated token stream, chunk after chunk
    then, per chunk, for each of its n_ctx - 1 - n_ctx/2 scored positions (the second half of the chunk):
    u16       record[2*((n_vocab + 1)/2) + 4]

Chunk ``c`` is ``tokens[c*n_ctx : (c+1)*n_ctx]`` evaluated from an empty context, its first token replaced by
BOS when the tokenizer adds one (the file keeps the original token).  The logits at positions
``first = n_ctx/2 .. n_ctx-2`` predict tokens ``first+1 .. n_ctx-1``; each becomes one record: two float32
(``scale``, ``min_log_prob``) in its first 4 u16, then one u16 per vocabulary entry, then a zero u16 when
n_vocab is odd.  With ``max``/``min`` the row's largest/smallest logit, ``lo = max(min, max - 16)``,
``lse = float(log(sum(double(expf(v - max)))))``: ``scale = (max - lo)/65535``, ``min_log_prob = lo - max - lse``,
and entry ``i`` is ``round_half_even((1/scale) * (v_i - lo))`` when ``v_i > lo`` else 0 (all zero when scale
is 0); log p_i is recovered as ``scale*q_i + min_log_prob``.  Arithmetic is float32 except the double sum, as in
llama.cpp (no FMA: its tools are compiled without -march=native); ``expf`` is correctly rounded, as glibc's is.

Statistics (:class:`KldAccumulator`, :class:`KldStats`) mirror ``log_softmax(..., kl_divergence_result&)`` and the
summary of ``kl_divergence()`` operation by operation: per token the candidate's NLL, the base NLL from the
record, ``KLD = sum over p_base(i) > e^-16 of p_base(i) * (log p_base(i) - log p_q(i))``, ``Δp = p_q(tok) -
p_base(tok)`` and whether both argmaxes agree; then means with their uncertainties, the correlation of the two
NLLs, percentiles by linear interpolation over the sorted float values.  llama-perplexity prints the summary
only from 100 scored tokens on; quantkit computes it for any count.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import FormatError, TruncatedFileError, ValidationError
from ..io.atomic import atomic_output

MAGIC = b"_logits_"
_HEADER = struct.Struct("<8sIii")
#: Log-probabilities below max - QUANT_RANGE are stored as the bottom of the range (llama.cpp's 16 nats).
QUANT_RANGE = 16.0
QUANT_LEVELS = 65535.0
#: Base log-probabilities at or below this do not enter the KLD sum.
KLD_FLOOR = -16.0
#: Rows processed at once (bounds temporaries to ROW_BLOCK x n_vocab floats).
ROW_BLOCK = 64
KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90)
KLD_LOW_PERCENTILES = (0.10, 0.05, 0.01, 0.001)
DP_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.75)
DP_LOW_PERCENTILES = (0.25, 0.10, 0.05, 0.01, 0.001)

F32 = np.float32


def record_width(n_vocab: int) -> int:
    """u16 per scored position."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_per_chunk(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def chunk_inputs(tokens: np.ndarray, n_ctx: int, chunk: int, bos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(input ids, targets)`` of one chunk: inputs with BOS in front when ``bos_id`` is given, and the
    original tokens the scored positions predict."""
    ids = np.array(tokens[chunk * n_ctx:(chunk + 1) * n_ctx], dtype=np.int64)
    targets = ids[n_ctx // 2 + 1:].copy()
    if bos_id is not None:
        ids[0] = bos_id
    return ids, targets


def expf(x: np.ndarray) -> np.ndarray:
    """float32 ``expf``, correctly rounded (computed in float64): glibc's expf gives these values, numpy's own
    float32 exp is off by an ulp now and then."""
    return np.exp(x.astype(np.float64)).astype(F32)


def _row_stats(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 max, argmax and ``lse`` (float32 of the log of the double sum of expf) per row."""
    top = rows.max(axis=1)
    total = expf(rows - top[:, None]).astype(np.float64).sum(axis=1)
    return top, rows.argmax(axis=1), np.log(total).astype(F32)


def quantize_rows(rows: np.ndarray) -> np.ndarray:
    """The records of float32 logits ``rows [n, n_vocab]`` (module doc): uint16 ``[n, record_width]``."""
    n, n_vocab = rows.shape
    out = np.zeros((n, record_width(n_vocab)), np.uint16)
    for start in range(0, n, ROW_BLOCK):
        block = rows[start:start + ROW_BLOCK]
        top, _, lse = _row_stats(block)
        lo = np.maximum(block.min(axis=1), top - F32(QUANT_RANGE))
        min_log_prob = (lo - top) - lse
        scale = (top - lo) / F32(QUANT_LEVELS)
        head = np.stack([scale, min_log_prob], axis=1).astype(F32)
        out[start:start + len(block), :4] = head.view(np.uint16)
        keep = (block > lo[:, None]) & (scale[:, None] != 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(keep, (F32(1) / scale)[:, None] * (block - lo[:, None]), F32(0))
        q = np.rint(scaled).astype(np.int64)
        out[start:start + len(block), 4:4 + n_vocab] = (q & 0xFFFF).astype(np.uint16)  # C's int -> uint16_t
    return out


def write_logits_file(path: str | os.PathLike, n_ctx: int, n_vocab: int, tokens: Sequence[int],
                      chunk_rows: Iterable[np.ndarray], *, overwrite: bool = True) -> None:
    """Write a logits file: ``tokens`` holds the ``n_chunk * n_ctx`` evaluated tokens; ``chunk_rows`` yields, per
    chunk, the float32 logits of its scored positions ``[n_ctx - 1 - n_ctx/2, n_vocab]``."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if n_ctx < 2 or len(tokens) == 0 or len(tokens) % n_ctx:
        raise ValidationError(f"logits file needs n_ctx >= 2 and a whole number of chunks; got n_ctx {n_ctx} and "
                              f"{len(tokens)} tokens")
    n_chunk = len(tokens) // n_ctx
    with atomic_output(path, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, n_ctx, n_vocab, n_chunk))
        f.write(tokens.astype("<i4").tobytes())
        written = 0
        for rows in chunk_rows:
            if rows.shape != (scored_per_chunk(n_ctx), n_vocab) or rows.dtype != np.float32:
                raise ValidationError(f"chunk {written}: logits of shape {rows.shape} and dtype {rows.dtype}, "
                                      f"expected float32 [{scored_per_chunk(n_ctx)}, {n_vocab}]")
            f.write(quantize_rows(rows).astype("<u2").tobytes())
            written += 1
        if written != n_chunk:
            raise ValidationError(f"{written} chunks of logits for {n_chunk} chunks of tokens")


class LogitsFile:
    """A logits file opened for reading: header checked against the file size before anything is mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise TruncatedFileError(f"reading the header: expected {_HEADER.size} bytes, found {len(head)}",
                                     path=self.path, offset=0)
        magic, n_ctx, n_vocab, n_chunk = _HEADER.unpack(head)
        if magic != MAGIC:
            raise FormatError(f"not a llama-perplexity logits file: magic {magic!r}, expected {MAGIC!r}",
                              path=self.path, offset=0)
        if n_ctx < 2 or n_vocab < 1 or n_chunk < 1:
            raise FormatError(f"header declares n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}; "
                              "expected n_ctx >= 2 and positive counts", path=self.path, offset=8)
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.width = record_width(n_vocab)
        self.scored = scored_per_chunk(n_ctx)
        tokens_bytes = 4 * n_ctx * n_chunk
        expected = _HEADER.size + tokens_bytes + 2 * self.width * self.scored * n_chunk
        if size != expected:
            kind = TruncatedFileError if size < expected else FormatError
            raise kind(f"file is {size} bytes, but its header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk "
                       f"{n_chunk}) implies {expected}", path=self.path)
        self.tokens = np.memmap(self.path, dtype="<i4", mode="r", offset=_HEADER.size, shape=(n_ctx * n_chunk,))
        bad = np.flatnonzero((self.tokens < 0) | (self.tokens >= n_vocab))
        if len(bad):
            raise FormatError(f"token {int(self.tokens[bad[0]])} at position {int(bad[0])} is outside the "
                              f"vocabulary of {n_vocab}", path=self.path, offset=_HEADER.size + 4 * int(bad[0]))
        self.records = np.memmap(self.path, dtype="<u2", mode="r", offset=_HEADER.size + tokens_bytes,
                                 shape=(n_chunk, self.scored, self.width))
        # each record's (scale, min_log_prob): a NaN made its row drop out of the KLD as if it agreed (KLD 0)
        heads = np.ascontiguousarray(self.records[:, :, :4]).view("<f4")
        bad = np.argwhere(~np.isfinite(heads).all(axis=2) | (heads[:, :, 0] < 0))
        if len(bad):
            chunk, row = (int(v) for v in bad[0])
            raise FormatError(f"chunk {chunk}, scored position {row}: the record's scale or log-probability floor "
                              f"is {heads[chunk, row].tolist()} (finite, scale >= 0 expected): a damaged file",
                              path=self.path, offset=_HEADER.size + tokens_bytes + 2 * self.width * (
                                  chunk * self.scored + row))


def _percentile(values: np.ndarray, fraction: float) -> np.float32:
    """llama.cpp's ``percentile`` lambda over sorted float32 ``values`` (float32 arithmetic)."""
    fraction = F32(fraction)
    if fraction <= 0:
        return values[0]
    if fraction >= 1:
        return values[-1]
    p = fraction * F32(len(values) - 1)
    ip = int(p)
    p = F32(p - F32(ip))
    return F32((F32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def _median(values: np.ndarray) -> np.float32:
    n = len(values)
    return F32(F32(0.5) * (values[n // 2] + values[n // 2 - 1])) if n % 2 == 0 else values[n // 2]


def _mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def _c_sqrt(x: float) -> float:
    """C's sqrt: NaN for a negative argument (rounding can make a variance difference negative)."""
    with np.errstate(invalid="ignore"):
        return float(np.sqrt(np.float64(x)))


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


@dataclass
class KldAccumulator:
    """Running sums of llama.cpp's ``kl_divergence_result`` plus the per-token KLD and Δp values."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, rows: np.ndarray, records: np.ndarray, targets: np.ndarray) -> None:
        """Account for float32 logits ``rows [n, n_vocab]`` against base ``records [n, width]`` predicting
        ``targets [n]``."""
        n, n_vocab = rows.shape
        if records.shape != (n, record_width(n_vocab)):
            raise ValidationError(f"base records of shape {records.shape} for logits of shape {rows.shape} "
                                  f"(expected [{n}, {record_width(n_vocab)}]): the vocabularies differ")
        for start in range(0, n, ROW_BLOCK):
            self._add_block(rows[start:start + ROW_BLOCK], np.ascontiguousarray(records[start:start + ROW_BLOCK]),
                            np.asarray(targets[start:start + ROW_BLOCK], np.int64))

    def _add_block(self, rows: np.ndarray, records: np.ndarray, targets: np.ndarray) -> None:
        n_vocab = rows.shape[1]
        at = np.arange(len(rows))
        top, imax, lse = _row_stats(rows)
        head = records[:, :4].copy().view(F32)
        scale, min_log_prob = head[:, 0], head[:, 1]
        q = records[:, 4:4 + n_vocab]
        nll = (top + lse) - rows[at, targets]
        nll_base = -(scale * q[at, targets].astype(F32) + min_log_prob)
        self.sum_nll += float(nll.astype(np.float64).sum())
        self.sum_nll2 += float((nll * nll).astype(np.float64).sum())
        self.sum_nll_base += float(nll_base.astype(np.float64).sum())
        self.sum_nll_base2 += float((nll_base * nll_base).astype(np.float64).sum())
        self.sum_nll_nll_base += float((nll * nll_base).astype(np.float64).sum())
        log_z = top + lse
        p_log_base = scale[:, None] * q.astype(F32) + min_log_prob[:, None]
        terms = expf(p_log_base) * ((p_log_base - rows) + log_z[:, None])
        kld = np.where(p_log_base > F32(KLD_FLOOR), terms, F32(0)).astype(np.float64).sum(axis=1)
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float((kld * kld).sum())
        self.n_same_top += int((imax == p_log_base.argmax(axis=1)).sum())
        self.count += len(rows)
        p_diff = expf(-nll) - expf(-nll_base)
        p_diff2 = (p_diff * p_diff).astype(np.float64)
        self.sum_p_diff += float(p_diff.astype(np.float64).sum())
        self.sum_p_diff2 += float(p_diff2.sum())
        self.sum_p_diff4 += float((p_diff2 * p_diff2).sum())
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()))
        self.kld_values.append(kld.astype(F32))
        self.p_diff_values.append(p_diff)

    def stats(self) -> "KldStats":
        if self.count == 0:
            raise ValidationError("no scored tokens: KLD statistics need at least one")
        return KldStats.of(self)


@dataclass(frozen=True)
class KldStats:
    """The figures llama-perplexity prints after ``--kl-divergence`` (see :meth:`report_lines`)."""

    count: int
    ppl: tuple[float, float]
    ppl_base: tuple[float, float]
    cor: float
    ln_ratio: tuple[float, float]
    ppl_ratio: tuple[float, float]
    ppl_diff: tuple[float, float]
    kld: tuple[float, float]
    kld_max: float
    kld_percentiles: dict[float, float]
    kld_median: float
    kld_min: float
    p_diff: tuple[float, float]
    p_diff_max: float
    p_diff_percentiles: dict[float, float]
    p_diff_median: float
    p_diff_min: float
    rms_p_diff: tuple[float, float]
    same_top: tuple[float, float]

    @classmethod
    def of(cls, acc: KldAccumulator) -> "KldStats":
        n = acc.count
        kld_values = np.sort(np.concatenate(acc.kld_values))
        p_diff_values = np.sort(np.concatenate(acc.p_diff_values))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            log_ppl = _mean_and_uncertainty(acc.sum_nll, acc.sum_nll2, n)
            ppl = math.exp(log_ppl[0])
            log_base = _mean_and_uncertainty(acc.sum_nll_base, acc.sum_nll_base2, n)
            ppl_base = math.exp(log_base[0])
            cov = _covariance(acc.sum_nll, acc.sum_nll_base, acc.sum_nll_nll_base, n)
            cor = float(np.float64(cov) / (np.float64(log_ppl[1]) * np.float64(log_base[1])))
            ratio = (log_ppl[0] - log_base[0], _c_sqrt(log_ppl[1] ** 2 + log_base[1] ** 2 - 2.0 * cov))
            ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
            ppl_cov = ppl * ppl_base * cov
            mse = _mean_and_uncertainty(acc.sum_p_diff2, acc.sum_p_diff4, n)
            rms = _c_sqrt(mse[0])
            rms_unc = float(np.float64(0.5) / np.float64(rms) * np.float64(mse[1]))
            same = acc.n_same_top / n
            same_unc = math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else float("nan")
        return cls(
            count=n, ppl=(ppl, ppl_unc), ppl_base=(ppl_base, base_unc), cor=cor, ln_ratio=ratio,
            ppl_ratio=(math.exp(ratio[0]), math.exp(ratio[0]) * ratio[1]),
            ppl_diff=(ppl - ppl_base, _c_sqrt(ppl_unc ** 2 + base_unc ** 2 - 2.0 * ppl_cov)),
            kld=_mean_and_uncertainty(acc.sum_kld, acc.sum_kld2, n), kld_max=float(kld_values[-1]),
            kld_percentiles={f: float(_percentile(kld_values, f)) for f in KLD_PERCENTILES + KLD_LOW_PERCENTILES},
            kld_median=float(_median(kld_values)), kld_min=float(kld_values[0]),
            p_diff=_mean_and_uncertainty(acc.sum_p_diff, acc.sum_p_diff2, n), p_diff_max=float(p_diff_values[-1]),
            p_diff_percentiles={f: float(_percentile(p_diff_values, f))
                                for f in DP_PERCENTILES + DP_LOW_PERCENTILES},
            p_diff_median=float(_median(p_diff_values)), p_diff_min=float(p_diff_values[0]),
            rms_p_diff=(rms, rms_unc), same_top=(same, same_unc))

    def report_lines(self) -> list[str]:
        """The summary exactly as llama-perplexity prints it."""
        def pm(v: tuple[float, float]) -> str:
            return f"{v[0]:10.6f} ± {v[1]:10.6f}"

        def pct(f: float) -> str:
            return f"{100 * f:4.1f}%"

        lines = ["====== Perplexity statistics ======",
                 f"Mean PPL(Q)                   : {pm(self.ppl)}",
                 f"Mean PPL(base)                : {pm(self.ppl_base)}",
                 f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * self.cor:6.2f}%",
                 f"Mean ln(PPL(Q)/PPL(base))     : {pm(self.ln_ratio)}",
                 f"Mean PPL(Q)/PPL(base)         : {pm(self.ppl_ratio)}",
                 f"Mean PPL(Q)-PPL(base)         : {pm(self.ppl_diff)}",
                 "",
                 "====== KL divergence statistics ======",
                 f"Mean    KLD: {pm(self.kld)}",
                 f"Maximum KLD: {self.kld_max:10.6f}"]
        lines += [f"{pct(f)}   KLD: {self.kld_percentiles[f]:10.6f}" for f in KLD_PERCENTILES]
        lines.append(f"Median  KLD: {self.kld_median:10.6f}")
        lines += [f"{pct(f)}   KLD: {self.kld_percentiles[f]:10.6f}" for f in KLD_LOW_PERCENTILES]
        lines += [f"Minimum KLD: {self.kld_min:10.6f}",
                  "",
                  "====== Token probability statistics ======",
                  f"Mean    Δp: {100.0 * self.p_diff[0]:6.3f} ± {100.0 * self.p_diff[1]:5.3f} %",
                  f"Maximum Δp: {100.0 * self.p_diff_max:6.3f}%"]
        lines += [f"{pct(f)}   Δp: {100.0 * self.p_diff_percentiles[f]:6.3f}%" for f in DP_PERCENTILES]
        lines.append(f"Median  Δp: {100.0 * self.p_diff_median:6.3f}%")
        lines += [f"{pct(f)}   Δp: {100.0 * self.p_diff_percentiles[f]:6.3f}%" for f in DP_LOW_PERCENTILES]
        lines += [f"Minimum Δp: {100.0 * self.p_diff_min:6.3f}%",
                  f"RMS Δp    : {100.0 * self.rms_p_diff[0]:6.3f} ± {100.0 * self.rms_p_diff[1]:5.3f} %",
                  f"Same top p: {100.0 * self.same_top[0]:6.3f} ± {100.0 * self.same_top[1]:5.3f} %"]
        return lines

    def summary_line(self) -> str:
        """One line for the score table's trailer."""
        return (f"kld_summary tokens={self.count} ppl_q={self.ppl[0]:.6f} ppl_base={self.ppl_base[0]:.6f} "
                f"ln_ratio={self.ln_ratio[0]:.6f} mean_kld={self.kld[0]:.6f} max_kld={self.kld_max:.6f} "
                f"kld_p99={self.kld_percentiles[0.99]:.6f} median_kld={self.kld_median:.6f} "
                f"mean_dp={self.p_diff[0]:.6f} rms_dp={self.rms_p_diff[0]:.6f} same_top={self.same_top[0]:.6f}")
