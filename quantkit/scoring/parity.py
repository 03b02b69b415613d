"""Parity of an engine's output with quantkit's reference on the same model and tokens (``quantkit parity``).

The reference is quantkit's runtime on the model (GGUF or checkpoint), run teacher-forced over the same tokens.
Three kinds of engine output, each read with every check before the model runs:

**(a) logits or log-probabilities** (:func:`read_logits_dump`), one of

* a llama-perplexity ``--kl-divergence-base`` file (:mod:`.kld`: the format, its token stream and chunking): the
  reference is evaluated as llama-perplexity's ``--kl-divergence`` would evaluate a second model, so the summary is
  llama-perplexity's own (:class:`.kld.KldStats`: mean KLD, same-top rate, ...), the file as base;
* ds4's ``--dump-logprobs`` JSON (``ds4_cli.c`` ``run_logprob_dump``: ``{"source": "ds4", "prompt_tokens", "ctx",
  "top_k", "steps": [{"step", "selected": {"id", "text", "bytes"}, "top_logprobs": [{"token": {"id", ...}, "logit",
  "logprob"}, ...]}]}``, a greedy continuation with the top ``top_k`` alternatives per step): the sequence is the
  prompt (which must render to ``prompt_tokens`` tokens) and the selected tokens; only the listed alternatives are
  known, so the KLD is that of the distributions coarsened to the listed tokens and "the rest" (by the data
  processing inequality a lower bound of the full KLD, so a bound it exceeds is exceeded), beside the largest
  log-probability difference over the listed tokens;
* a ``.npy`` float array ``[positions, vocab]`` of logits (or log-probabilities) of the given tokens, row ``i``
  predicting token ``i + 1``.

Per position: the KLD of the engine's distribution from the reference's, ``sum p_engine (log p_engine - log
p_reference)`` (the engine's file is llama-perplexity's base, so its direction is used throughout), whether both
top-1 tokens agree, and the rule **a confident reference top-1 (probability >= ``confident``, default .5) missing
from the engine's top 8 is a bug**: any such position fails the comparison.  Over all positions, the top-1
agreement must reach ``min_top1`` (default .5) and the mean KLD stay within ``max_mean_kld`` (default .01 nats):
an engine computing the same weights differs from the reference by its arithmetic only (mean KLD ~1e-6 to 1e-3),
while a quantization a step coarser already costs ~.01-.03 nats.  Near-ties make the agreement noisy where
distributions are flat (a tiny model's logits with N(0, .05) noise agree on .875 of positions), hence the low
floor: it separates the same weights from logits of another model or of none, which agree on ~0.  Both fail
even where no position is confident (a tiny model's nearly flat distributions gave all-zero logits a mean KLD of
.049 and another model's .104, with no confident position for the top-8 rule).

**(b) sampled token streams** (:func:`read_stream`): a JSON object ``{"tokens": [...], "seed": int, "temperature",
"top_k", "top_p", "presence_penalty", "frequency_penalty", "min_p", "law"}`` (settings default to
:class:`~quantkit.sampling.SamplingParams`', ``law`` to ``"classic"``; ``"ds4"`` for DeepSeek and GLM engines), the
continuation of the prompt.  The law is replayed with the seed on the reference's rows
(:func:`quantkit.sampling.first_divergence`); the first position where it draws another token fails, and for the
classic law the report says whether the faulty top-k-renormalized law reproduces the stream instead.

**(c) per-layer hidden states** (:func:`read_hidden_dump`): a ``.npy`` array ``[layers, positions, ...]`` or an
``.npz`` of one array per layer (in key order, ``layer_2`` before ``layer_10``), compared with transformers'
``output_hidden_states`` of the reference (:func:`quantkit.runtime.loader.hidden_states`: the embeddings, then each
layer's output): the engine's layers align with the reference's last ones (a dump without the embeddings has one
layer fewer) and its positions with the first ones.  Per layer: the cosine of the flattened values (bar
``cosine_bar``, default .9997), the smallest per-position cosine, and the corner values (first three values of the
first position, last three of the last) side by side.  A layer below the bar fails.

Verdict: ``passed`` is false on any failure above (``quantkit parity`` exits 1); an unusable input raises
(exit 2).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import FormatError, ValidationError
from ..sampling import LAW_NAMES, Sampler, SamplingParams, first_divergence
from .kld import MAGIC, KldAccumulator, KldStats
from ..io import jsontext

CONFIDENT = 0.5
MIN_TOP1 = 0.5
MAX_MEAN_KLD = 0.01
TOP_SLOTS = 8
COSINE_BAR = 0.9997
CORNER = 3
#: Largest JSON dump read.
MAX_JSON_BYTES = 256 << 20

Logits = Callable[[Sequence[int]], np.ndarray]
"""The reference: float32 logits ``[len, vocab]`` of a token sequence."""


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top_ids(logprobs: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` best token ids per row, ties by ascending id."""
    return np.argsort(-logprobs, axis=-1, kind="stable")[..., :n]


@dataclass
class LogitsParity:
    """Per-position comparison of engine and reference distributions (module doc, (a))."""

    kind: str
    min_top1: float = MIN_TOP1
    max_mean_kld: float = MAX_MEAN_KLD
    positions: int = 0
    confident_positions: int = 0
    same_top: int = 0
    kld: list[float] = field(default_factory=list)
    misses: list[dict] = field(default_factory=list)
    max_logprob_delta: float | None = None
    llama_stats: KldStats | None = None
    kld_bound: bool = False
    """The KLD is the lower bound over a dump's listed tokens (module doc, (a))."""

    @property
    def top1_agreement(self) -> float | None:
        return self.same_top / self.positions if self.positions else None

    @property
    def mean_kld(self) -> float | None:
        return float(np.mean(self.kld)) if self.kld else None

    @property
    def failures(self) -> list[str]:
        """Why the comparison fails, one phrase per broken rule (module doc, (a)); empty when it passes."""
        out = []
        if self.misses:
            out.append(f"{len(self.misses)} confident reference top-1 tokens missing from the engine's top "
                       f"{TOP_SLOTS}")
        if self.top1_agreement is not None and self.top1_agreement < self.min_top1:
            out.append(f"top-1 agreement {self.top1_agreement:.6f} below {self.min_top1}")
        if self.mean_kld is not None and self.mean_kld > self.max_mean_kld:
            out.append(f"mean KLD {self.mean_kld:.6f} above {self.max_mean_kld}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def add(self, reference: np.ndarray, engine_logprobs: np.ndarray, offset: int, confident: float) -> None:
        """Account for reference logits and engine log-probabilities ``[n, vocab]`` of positions ``offset...``."""
        ref = _log_softmax(reference)
        eng = _log_softmax(engine_logprobs)
        self.kld += (np.exp(eng) * (eng - ref)).sum(axis=1).tolist()
        self._tops(ref, _top_ids(eng, TOP_SLOTS), offset, confident)

    def _tops(self, ref: np.ndarray, engine_top: np.ndarray, offset: int, confident: float) -> None:
        ref_top = ref.argmax(axis=1)
        self.same_top += int((ref_top == engine_top[:, 0]).sum())
        confident_rows = np.flatnonzero(np.exp(ref[np.arange(len(ref)), ref_top]) >= confident)
        self.confident_positions += len(confident_rows)
        for i in confident_rows:
            if ref_top[i] not in engine_top[i]:
                self.misses.append({"position": offset + int(i), "reference_top1": int(ref_top[i]),
                                    "reference_probability": float(np.exp(ref[i, ref_top[i]])),
                                    "engine_top": [int(t) for t in engine_top[i]]})
        self.positions += len(ref)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "positions": self.positions, "passed": self.passed,
                               "failures": self.failures, "top1_agreement": self.top1_agreement,
                               "min_top1": self.min_top1, "max_mean_kld": self.max_mean_kld,
                               "confident_positions": self.confident_positions,
                               "confident_top1_missing_from_engine_top8": self.misses}
        if self.kld:
            out.update(mean_kld=float(np.mean(self.kld)), max_kld=float(np.max(self.kld)), kld=self.kld,
                       kld_is_lower_bound=self.kld_bound)
        if self.max_logprob_delta is not None:
            out["max_listed_logprob_delta"] = self.max_logprob_delta
        if self.llama_stats is not None:
            s = self.llama_stats
            out["llama_perplexity"] = {"mean_kld": s.kld[0], "mean_kld_uncertainty": s.kld[1],
                                       "same_top": s.same_top[0], "count": s.count}
        return out

    def report_lines(self) -> list[str]:
        agreement = self.top1_agreement if self.positions else float("nan")
        line = (f"logits ({self.kind}): {self.positions} positions ({self.confident_positions} confident), top-1 "
                f"agreement {agreement:.6f}")
        if self.kld:
            line += f", mean KLD {np.mean(self.kld):.6f}, max KLD {np.max(self.kld):.6f}"
            line += " (at least: listed tokens and the rest)" if self.kld_bound else ""
        if self.max_logprob_delta is not None:
            line += f", max |logprob delta| over listed tokens {self.max_logprob_delta:.6f}"
        lines = [line]
        if self.llama_stats is not None:
            lines += ["", *self.llama_stats.report_lines(), ""]
        for miss in self.misses[:10]:
            lines.append(f"  position {miss['position']}: reference top-1 {miss['reference_top1']} (p "
                         f"{miss['reference_probability']:.4f}) missing from the engine's top {TOP_SLOTS}")
        if len(self.misses) > 10:
            lines.append(f"  ... {len(self.misses) - 10} more")
        lines.append("logits: " + ("pass" if self.passed else f"FAIL ({'; '.join(self.failures)})"))
        return lines


# -- reading the engine's dumps ------------------------------------------------------------------------------------

def _read_json(path: Path) -> Any:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise FormatError(f"JSON dump is larger than {MAX_JSON_BYTES} bytes", path=path)
    try:
        return jsontext.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise FormatError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    except ValueError as exc:
        raise FormatError(f"not JSON ({exc})", path=path) from None


def _read_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise FormatError(f"not a readable .npy array ({exc})", path=path) from None
    if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
        raise FormatError(f"expected a float array, found {getattr(array, 'dtype', type(array).__name__)}",
                          path=path)
    return array


def _int(value: Any, where: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where}: expected an integer, found {value!r}", path=path)
    return value


@dataclass(frozen=True)
class Ds4Dump:
    """ds4 ``--dump-logprobs`` (module doc): the prompt length, the selected ids and per step the listed
    ``(id, logprob)`` alternatives."""

    prompt_tokens: int
    selected: list[int]
    listed: list[list[tuple[int, float]]]


def _read_ds4(data: Any, path: Path) -> Ds4Dump:
    if not isinstance(data.get("steps"), list) or not data["steps"]:
        raise FormatError("ds4 logprob dump: expected a non-empty list 'steps'", path=path)
    selected, listed = [], []
    for i, step in enumerate(data["steps"]):
        where = f"steps[{i}]"
        if not isinstance(step, dict) or not isinstance(step.get("selected"), dict) \
                or not isinstance(step.get("top_logprobs"), list):
            raise FormatError(f"{where}: expected an object with 'selected' and 'top_logprobs'", path=path)
        selected.append(_int(step["selected"].get("id"), f"{where}.selected.id", path))
        alternatives = []
        for j, alt in enumerate(step["top_logprobs"]):
            token = alt.get("token") if isinstance(alt, dict) else None
            logprob = alt.get("logprob") if isinstance(alt, dict) else None
            value = jsontext.finite(logprob)
            if not isinstance(token, dict) or value is None:
                raise FormatError(f"{where}.top_logprobs[{j}]: expected {{'token': {{'id': ...}}, 'logprob': "
                                  "finite number}", path=path)
            alternatives.append((_int(token.get("id"), f"{where}.top_logprobs[{j}].token.id", path), value))
        if not alternatives:   # a step with nothing listed compares nothing: it passed every gate
            raise FormatError(f"{where}: no top_logprobs listed, so nothing to compare (dump with a top-k)",
                              path=path)
        listed.append(alternatives)
    return Ds4Dump(_int(data.get("prompt_tokens"), "prompt_tokens", path), selected, listed)


def dump_kind(path: str | os.PathLike) -> str:
    """``llama``, ``ds4`` or ``npy``, from the file's first bytes."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head == MAGIC:
        return "llama"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.lstrip()[:1] == b"{":
        return "ds4"
    raise FormatError("not a llama-perplexity logits file, a ds4 --dump-logprobs JSON file or a .npy array",
                      path=path)


def read_logits_dump(path: str | os.PathLike) -> tuple[str, Any]:
    """``(kind, content)`` of an engine's logits dump, checked (module doc, (a)); a llama-perplexity file is
    opened by :func:`compare_logits` itself."""
    path = Path(path)
    kind = dump_kind(path)
    if kind == "ds4":
        data = _read_json(path)
        if not isinstance(data, dict) or data.get("source") != "ds4":
            raise FormatError("a JSON dump must be ds4's --dump-logprobs output ({\"source\": \"ds4\", ...})",
                              path=path)
        return kind, _read_ds4(data, path)
    if kind == "npy":
        array = _read_npy(path)
        if array.ndim != 2 or 0 in array.shape:
            raise FormatError(f"expected logits [positions, vocab], found shape {list(array.shape)}", path=path)
        return kind, array
    return kind, path


def read_stream(path: str | os.PathLike) -> tuple[list[int], SamplingParams, int, str]:
    """``(tokens, settings, seed, law)`` of a sampled stream file (module doc, (b))."""
    path = Path(path)
    data = _read_json(path)
    known = {"tokens", "seed", "law", "temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty",
             "min_p"}
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list) or not data["tokens"] \
            or "seed" not in data or set(data) - known:
        raise FormatError(f"a stream file is a JSON object with a non-empty list 'tokens', an integer 'seed' and "
                          f"optional sampling settings (keys {sorted(known)})", path=path)
    tokens = [_int(t, f"tokens[{i}]", path) for i, t in enumerate(data["tokens"])]
    law = data.get("law", "classic")
    if law not in LAW_NAMES:
        raise FormatError(f"law: expected one of {', '.join(LAW_NAMES)}, found {law!r}", path=path)
    settings = {k: data[k] for k in known - {"tokens", "seed", "law"} if k in data}
    for key, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormatError(f"{key}: expected a number, found {value!r}", path=path)
    seed = _int(data["seed"], "seed", path)
    try:
        params = SamplingParams(**settings)
        Sampler(params, seed, law)         # the law accepts the settings and the seed
    except (ValidationError, TypeError) as exc:
        raise FormatError(str(exc), path=path) from None
    return tokens, params, seed, law


def read_token_ids(path: str | os.PathLike) -> list[int]:
    """The token ids an engine ran: a JSON list or a 1-D integer ``.npy``."""
    path = Path(path)
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise FormatError(f"not a readable .npy array ({exc})", path=path) from None
        if array.ndim != 1 or array.dtype.kind not in "iu" or array.size == 0:
            raise FormatError(f"expected a non-empty 1-D integer array of token ids, found {array.dtype}"
                              f"{list(array.shape)}", path=path)
        return [int(t) for t in array]
    data = _read_json(path)
    if not isinstance(data, list) or not data:
        raise FormatError("expected a non-empty JSON list of token ids", path=path)
    return [_int(t, f"[{i}]", path) for i, t in enumerate(data)]


def _layer_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def read_hidden_dump(path: str | os.PathLike) -> list[np.ndarray]:
    """The engine's per-layer hidden states (module doc, (c)): one float array ``[positions, ...]`` per layer."""
    path = Path(path)
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as archive:
                layers = [np.asarray(archive[k]) for k in sorted(archive.files, key=_layer_key)]
        except (ValueError, OSError, EOFError, KeyError) as exc:
            raise FormatError(f"not a readable .npz archive ({exc})", path=path) from None
    else:
        array = _read_npy(path)
        if array.ndim < 3:
            raise FormatError(f"expected hidden states [layers, positions, ...], found shape {list(array.shape)}",
                              path=path)
        layers = list(array)
    if not layers or any(layer.dtype.kind != "f" or layer.ndim < 2 or layer.shape[0] == 0 for layer in layers):
        raise FormatError("expected one float array [positions, ...] per layer", path=path)
    for i, layer in enumerate(layers):
        if not np.isfinite(layer).all():
            raise FormatError(f"layer {i} holds NaN or infinity", path=path)
    return layers


# -- comparisons ---------------------------------------------------------------------------------------------------

def _check_ids(tokens: Sequence[int], n_vocab: int, what: str) -> None:
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise ValidationError(f"{what}: token id {bad[0]} is outside the reference's vocabulary of {n_vocab}")


def compare_logits(kind: str, content: Any, reference: Logits, tokens: Sequence[int] | None, n_vocab: int, *,
                   confident: float = CONFIDENT, min_top1: float = MIN_TOP1, max_mean_kld: float = MAX_MEAN_KLD,
                   kld_against: Callable | None = None) -> LogitsParity:
    """Compare an engine's logits dump with the reference (module doc, (a)).  ``tokens``: the sequence for
    ``npy`` and the prompt for ``ds4`` (a llama-perplexity file holds its own); ``kld_against``:
    :func:`.score.kld_against` bound to the reference source and codec, for llama-perplexity files."""
    result = LogitsParity(kind, min_top1=min_top1, max_mean_kld=max_mean_kld)
    if kind == "llama":
        def each(rows, records, targets):
            per_position = KldAccumulator()         # llama.cpp's per-token KLD, one definition
            per_position.add(rows, records, targets)
            result.kld += [float(v) for v in np.concatenate(per_position.kld_values)]   # blocks of ROW_BLOCK
            q = np.asarray(records[:, 4:4 + n_vocab])
            head = np.ascontiguousarray(records[:, :4]).view(np.float32)
            engine = head[:, :1] * q.astype(np.float32) + head[:, 1:2]
            ref = _log_softmax(rows)
            result._tops(ref, _top_ids(engine, TOP_SLOTS), result.positions, confident)

        result.llama_stats = kld_against(content, each)
        return result
    if tokens is None:
        raise ValidationError(f"a {kind} dump needs the tokens it was computed on: pass --prompt or --tokens")
    if kind == "npy":
        if content.shape[1] != n_vocab:
            raise ValidationError(f"the engine's logits have a vocabulary of {content.shape[1]}, the reference "
                                  f"{n_vocab}")
        if content.shape[0] > len(tokens):
            raise ValidationError(f"{content.shape[0]} rows of engine logits for {len(tokens)} tokens")
        engine = np.asarray(content, np.float64)
        if not np.isfinite(engine).all():
            raise ValidationError("the engine's logits hold NaN or infinity")
        result.add(reference(tokens)[:len(engine)], engine, 0, confident)
        return result
    dump: Ds4Dump = content
    if len(tokens) != dump.prompt_tokens:
        raise ValidationError(f"the prompt renders to {len(tokens)} tokens, the ds4 dump's to {dump.prompt_tokens} "
                              "(render it as ds4 did: --rendering, --chat-template-kwargs)")
    _check_ids(dump.selected + [t for step in dump.listed for t, _ in step], n_vocab, "ds4 dump")
    p = len(tokens)
    ref = _log_softmax(reference(list(tokens) + dump.selected[:-1])[p - 1:])
    result.kld_bound = True
    engine_top = np.array([[t for t, _ in step[:TOP_SLOTS]] + [-1] * (TOP_SLOTS - len(step[:TOP_SLOTS]))
                           for step in dump.listed])
    engine_top[:, 0] = dump.selected        # the engine's choice is its top-1 (greedy dump)
    result._tops(ref, engine_top, 0, confident)
    deltas = [abs(ref[i, t] - lp) for i, step in enumerate(dump.listed) for t, lp in step]
    result.max_logprob_delta = float(max(deltas)) if deltas else 0.0
    result.kld = [_coarse_kld(np.array([lp for _, lp in step]), ref[i, [t for t, _ in step]])
                  for i, step in enumerate(dump.listed)]
    return result


def _coarse_kld(engine: np.ndarray, reference: np.ndarray) -> float:
    """KLD of the engine's distribution from the reference's over the listed tokens (their log-probabilities) and
    one outcome holding the rest of each: at most the KLD over the whole vocabulary."""
    p, q = np.exp(engine), np.exp(reference)
    p_rest, q_rest = max(0.0, 1.0 - p.sum()), max(1.0 - q.sum(), np.finfo(np.float64).tiny)
    listed = float(np.sum(np.where(p > 0, p * (engine - reference), 0.0)))
    return listed + (p_rest * np.log(p_rest / q_rest) if p_rest > 0 else 0.0)


@dataclass(frozen=True)
class StreamParity:
    tokens: int
    seed: int
    params: SamplingParams
    law: str
    divergence: Any
    faulty_law_matches: bool

    @property
    def passed(self) -> bool:
        return self.divergence is None

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "seed": self.seed, "law": self.law, "sampling": self.params.to_json(),
                "passed": self.passed,
                "first_divergence": None if self.divergence is None else self.divergence.to_json(),
                "top_k_renormalized_law_matches": self.faulty_law_matches}

    def report_lines(self) -> list[str]:
        head = f"stream: {self.tokens} tokens, seed {self.seed}"
        if self.divergence is None:
            return [f"{head}: the {self.law} law replayed on the reference draws every token: pass"]
        d = self.divergence
        lines = [f"{head}: FAIL: first divergence at token {d.position}: the {self.law} law draws {d.expected}, the "
                 f"stream has {d.found} (reference law probability {d.found_probability:.6g})"]
        if self.faulty_law_matches:
            lines.append("  the top-k-renormalized law reproduces the whole stream: the engine normalizes top-p "
                         "over the top-k slice")
        return lines


def compare_stream(tokens: Sequence[int], params: SamplingParams, seed: int, reference: Logits,
                   prompt: Sequence[int], n_vocab: int, law: str = "classic") -> StreamParity:
    """Replay the law on the reference's rows (module doc, (b))."""
    _check_ids(tokens, n_vocab, "stream")
    rows = reference(list(prompt) + list(tokens)[:-1])[len(prompt) - 1:]
    divergence = first_divergence(rows, tokens, params, seed, law)
    faulty = law == "classic" and divergence is not None \
        and first_divergence(rows, tokens, params, seed, "top-k-renormalized") is None
    return StreamParity(len(tokens), seed, params, law, divergence, faulty)


@dataclass(frozen=True)
class HiddenParity:
    layers: list[dict]
    bar: float

    @property
    def passed(self) -> bool:
        return all(layer["cosine"] >= self.bar for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        return {"bar": self.bar, "passed": self.passed, "layers": self.layers}

    def report_lines(self) -> list[str]:
        lines = [f"hidden states: {len(self.layers)} layers, cosine bar {self.bar}"]
        for layer in self.layers:
            mark = "" if layer["cosine"] >= self.bar else "  BELOW BAR"
            lines.append(f"  layer {layer['reference_layer']:3d}: cosine {layer['cosine']:.7f} (min per position "
                         f"{layer['min_position_cosine']:.7f}) first {_fmt(layer['engine_first'])} vs "
                         f"{_fmt(layer['reference_first'])}, last {_fmt(layer['engine_last'])} vs "
                         f"{_fmt(layer['reference_last'])}{mark}")
        below = [layer["reference_layer"] for layer in self.layers if layer["cosine"] < self.bar]
        lines.append("hidden states: " + ("pass" if not below else f"FAIL (first layer below the bar: {below[0]})"))
        return lines


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.5g}" for v in values) + "]"


def _cosine(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
    dot = (a * b).sum(axis=axis)
    norms = np.sqrt((a * a).sum(axis=axis) * (b * b).sum(axis=axis))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norms > 0, dot / np.where(norms > 0, norms, 1), np.where((a == b).all(axis=axis), 1.0, 0.0))


def compare_hidden(engine: list[np.ndarray], reference: list[np.ndarray], *, bar: float = COSINE_BAR) -> HiddenParity:
    """Per-layer cosines and corner values (module doc, (c))."""
    offset = len(reference) - len(engine)
    if offset not in (0, 1):
        raise ValidationError(f"the engine dump has {len(engine)} layers, the reference {len(reference)} (the "
                              f"embeddings and each layer's output): expected {len(reference)} or "
                              f"{len(reference) - 1}")
    layers = []
    for i, eng in enumerate(engine):
        ref = reference[offset + i]
        if eng.shape[0] > ref.shape[0] or eng.shape[1:] != ref.shape[1:]:
            raise ValidationError(f"engine layer {i} has shape {list(eng.shape)}, the reference layer "
                                  f"{offset + i} {list(ref.shape)}: positions must not exceed, the rest must match")
        ref = ref[:eng.shape[0]].astype(np.float64)
        eng = np.asarray(eng, np.float64)
        flat_e, flat_r = eng.reshape(len(eng), -1), ref.reshape(len(ref), -1)
        layers.append({"engine_layer": i, "reference_layer": offset + i,
                       "cosine": float(_cosine(flat_e.ravel(), flat_r.ravel())),
                       "min_position_cosine": float(_cosine(flat_e, flat_r, axis=1).min()),
                       "engine_first": flat_e[0, :CORNER].tolist(), "reference_first": flat_r[0, :CORNER].tolist(),
                       "engine_last": flat_e[-1, -CORNER:].tolist(), "reference_last": flat_r[-1, -CORNER:].tolist()})
    return HiddenParity(layers, bar)

