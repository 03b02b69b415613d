"""Score a model on a fixture: per-case metrics, summary lines, optional KLD against saved base logits.

Order of work (nothing is written until every check has passed):

1. the model's identity is matched against the fixture's (:func:`.source.check_match`);
2. every case is tokenized (prompt rendered per the fixture, continuation without special tokens) and checked:
   a non-empty continuation, prompt + continuation within ``ctx`` tokens, every response alternative's bytes
   found in the model's vocabulary (an unknown token is an error unless cross-checkpoint scoring was allowed,
   then it is left unmapped as ds4 does);
3. each case is run and scored (:func:`.metrics.score_case`); token ids beyond the model's output width and
   NaN/+inf logits are errors naming the case.  Cases run in groups (:func:`case_batches`): shortest first, as
   many per forward pass as fit in ``batch_tokens`` once right-padded, each its own sequence; a group is scored
   on the host while the next group's forward pass runs;
4. ``save_logits`` / ``kld_base`` (:mod:`.kld`) evaluate the llama-perplexity chunks (``batch_tokens // ctx`` per
   forward pass, as llama-perplexity with ``-b``).

A response whose position count differs from the continuation's token count is *misaligned*: the case is
scored without API metrics and a warning names it (ds4's behaviour; API fixtures are not always re-tokenized to
the same count).  The KLD token stream of ``save_logits`` is every case's prompt and continuation ids, in manifest
order, cut into ``ctx``-token chunks (a trailing partial chunk is dropped, as llama-perplexity drops it).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from ..errors import FixtureError, ValidationError
from ..evidence import evidence
from ..fixtures.directory import Fixture
from ..fixtures.tokens import TextCodec
from .kld import KldAccumulator, KldStats, LogitsFile, chunk_inputs, scored_per_chunk, write_logits_file
from .logprobs import NonFiniteLogits, NormalizedRows, check_logits, log_normalizers
from .metrics import CaseScore, Reference, Totals, score_case
from .source import LogitSource, ModelIdentity, check_match
from .table import TABLE_VERSION, write_table

T = TypeVar("T")
R = TypeVar("R")

#: Tokens per forward pass of :func:`run_cases` (llama-perplexity's ``-b`` default): short cases run together.
DEFAULT_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class PreparedCase:
    id: str
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    reference: Reference | None


@dataclass
class ScoreResult:
    header: dict
    scores: list[CaseScore]
    warnings: list[str] = field(default_factory=list)
    kld: KldStats | None = None
    notes: list[str] = field(default_factory=list)
    """Lines recorded after the summaries (e.g. which sidecars were applied)."""

    @property
    def totals(self) -> Totals:
        return Totals.of(self.scores)

    @property
    def trailer(self) -> list[str]:
        totals = self.totals
        lines = [totals.summary_line(), totals.api_summary_line()]
        return lines + ([self.kld.summary_line()] if self.kld is not None else []) + self.notes

    def write(self, path: str | os.PathLike, *, layout: str = "quantkit") -> None:
        """Write the table in ``layout`` (:data:`.table.LAYOUTS`; a ds4 layout adds the sidecar)."""
        write_table(path, self.header, self.scores, self.trailer, layout=layout)


def _reference(case, codec: TextCodec, n_targets: int, allow_unmapped: bool,
               warnings: list[str]) -> Reference | None:
    if case.response is None:
        return None
    if len(case.response) != n_targets:    # kept: its position count still shows in api_ref_tokens
        warnings.append(f"case {case.id}: the response has {len(case.response)} token positions but the "
                        f"continuation tokenizes to {n_targets} tokens; API metrics skipped for this case")
    alternatives = []
    for i, position in enumerate(case.response):
        ids = []
        for alt in position.top:
            token = codec.token_for_bytes(alt.bytes) if alt.bytes is not None else None
            if token is None and alt.bytes is not None and not allow_unmapped:
                raise FixtureError(f"case {case.id}: position {i} lists token {alt.token!r} (bytes "
                                   f"{alt.bytes!r}) that is not in the model's vocabulary")
            ids.append(-1 if token is None else token)
        alternatives.append((np.array(ids, np.int64), np.array([a.logprob for a in position.top], np.float64)))
    return Reference(np.array([p.logprob for p in case.response], np.float64), tuple(alternatives))


def prepare_cases(fixture: Fixture, codec: TextCodec, *, ctx: int, allow_unmapped: bool = False,
                  warnings: list[str] | None = None) -> list[PreparedCase]:
    """Tokenize and check every case (module doc, step 2)."""
    warnings = [] if warnings is None else warnings
    prepared = []
    for case in fixture.cases:
        prompt = codec.render(case.prompt, fixture.rendering)
        targets = codec.encode_text(case.continuation)
        if not prompt or not targets:
            raise FixtureError(f"case {case.id}: the {'prompt' if not prompt else 'continuation'} tokenizes to "
                               "no tokens", path=fixture.path)
        if len(prompt) + len(targets) > ctx:
            raise FixtureError(f"case {case.id}: {len(prompt)} prompt + {len(targets)} continuation tokens exceed "
                               f"--ctx {ctx}", path=fixture.path)
        prepared.append(PreparedCase(case.id, tuple(prompt), tuple(targets),
                                     _reference(case, codec, len(targets), allow_unmapped, warnings)))
    return prepared


def _checked_logits(source: LogitSource, ids: Sequence[int], what: str) -> np.ndarray:
    try:
        logits = source.logits([int(i) for i in ids])
    except ValidationError as exc:       # e.g. the runtime's non-finite logits: say which case
        raise ValidationError(f"{what}: {exc.detail}", path=exc.path) from None
    return check_logits(logits, len(ids), what)


def _check_vocab(case: PreparedCase, width: int) -> None:
    ids = list(case.prompt_ids + case.target_ids)
    if case.reference is not None:
        ids += [int(i) for alt_ids, _ in case.reference.alternatives for i in alt_ids]
    outside = [i for i in ids if i >= width]
    if outside:
        raise FixtureError(f"case {case.id}: token id {outside[0]} is outside the model's vocabulary of {width}")


def vocabulary_width(source: LogitSource, cases: Sequence[PreparedCase]) -> int:
    """The model's output width (the source's ``output_width`` where it knows it, else from a one-token probe);
    every case's token ids are checked against it."""
    width = getattr(source, "output_width", None) or \
        _checked_logits(source, cases[0].prompt_ids[:1], "vocabulary probe").shape[1]
    for case in cases:
        _check_vocab(case, width)
    return width


def case_batches(cases: Sequence[PreparedCase], batch_tokens: int) -> list[list[int]]:
    """Indices of ``cases`` grouped for one forward pass each: shortest first, as many as fit in ``batch_tokens``
    tokens once right-padded to the group's longest (a longer case runs alone).  A function of the cases alone,
    so every executor forms the same groups, and so computes the same bits."""
    length = [len(c.prompt_ids) + len(c.target_ids) for c in cases]
    groups: list[list[int]] = []
    for i in sorted(range(len(cases)), key=lambda i: (length[i], i)):
        if groups and (len(groups[-1]) + 1) * length[i] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def start_sequence_logits(source: LogitSource, sequences: Sequence[Sequence[int]], names: Sequence[str],
                          first: int = 0, normalized: bool = False
                          ) -> Callable[[], list[np.ndarray | NormalizedRows]]:
    """A function giving each sequence's logits of positions ``first``.., checked; errors name the sequence
    (``names``, e.g. ``case X``).  All sequences run in one forward pass where the source runs several (its output
    head then multiplies positions ``first``.. only; a 32K-token prompt's logits would be 32K x vocabulary floats):
    ``start_logits_many`` queues the pass now (the runtime: on CUDA nothing waits for the device) and the
    function collects it, so the next pass can be queued before this one's logits are collected
    (:func:`one_ahead`).  ``normalized``: a source that computes the rows' log-normalizers where the logits are
    (``start_normalized_many``: the runtime on CUDA) gives :class:`.logprobs.NormalizedRows`; the others give
    arrays, which :func:`.metrics.score_case` normalizes on the host."""
    sequences = [[int(i) for i in ids] for ids in sequences]
    start = (normalized and getattr(source, "start_normalized_many", None)) or getattr(source, "start_logits_many",
                                                                                      None)
    pending = start(sequences, first=first) if start is not None else None

    def collect() -> list[np.ndarray | NormalizedRows]:
        if pending is not None:
            try:
                return [_checked_rows(rows, len(ids) - first, name)
                        for rows, ids, name in zip(pending(), sequences, names)]
            except ValidationError:     # one at a time, to name the sequence that fails
                pass
        return [_checked_logits(source, ids, name)[first:] for ids, name in zip(sequences, names)]

    return collect


def _checked_rows(rows, n_rows: int, what: str) -> np.ndarray | NormalizedRows:
    """:func:`.logprobs.check_logits` of a source's rows, normalized ones kept with their normalizers."""
    if isinstance(rows, NormalizedRows):
        check_logits(rows.rows, n_rows, what)
        return rows
    return check_logits(rows, n_rows, what)


def one_ahead(items: Iterable[T]) -> Iterator[T]:
    """Each of ``items``, given once the next one has been produced: with items that queue a forward pass
    (:func:`start_sequence_logits`), a pass's logits are collected while the device computes the next.  An error
    producing the next item comes after the item before it."""
    items = iter(items)
    held: list[T] = []
    while True:
        try:
            item = next(items)
        except StopIteration:
            break
        except BaseException:  # noqa: BLE001 - re-raised after the earlier item
            yield from held
            raise
        yield from held
        held = [item]
    yield from held


def score_logits(case: PreparedCase, logits: np.ndarray | NormalizedRows, width: int, first: int = 0) -> CaseScore:
    """Score one prepared case from its logits of positions ``first``.. (module doc, step 3)."""
    if logits.shape[1] != width:
        raise ValidationError(f"case {case.id}: the model returned {logits.shape[1]} logits per token, "
                              f"{width} before")
    p, t = len(case.prompt_ids), len(case.target_ids)
    try:
        return score_case(case.id, p, case.target_ids, logits[p - 1 - first:p + t - 1 - first], case.reference)
    except NonFiniteLogits as exc:
        raise ValidationError(f"case {case.id}: the model's logits at target position {exc.row} hold NaN "
                              f"or +inf ({exc.detail})") from None


def score_group(source: LogitSource, cases: Sequence[PreparedCase], width: int) -> list[CaseScore]:
    """Run ``cases`` (one group of :func:`case_batches`) and score each: the logits from the group's first scored
    position on (a case's prompt positions but its last are not scored)."""
    return _score_group_logits(cases, _start_group_logits(source, cases)(), width)


def _first_scored(cases: Sequence[PreparedCase]) -> int:
    """The first position whose logits a group needs: its shortest prompt's last."""
    return min(len(c.prompt_ids) for c in cases) - 1


def _start_group_logits(source: LogitSource, cases: Sequence[PreparedCase]
                        ) -> Callable[[], list[np.ndarray | NormalizedRows]]:
    return start_sequence_logits(source, [c.prompt_ids + c.target_ids for c in cases],
                                 [f"case {c.id}" for c in cases], _first_scored(cases), normalized=True)


def _score_group_logits(cases: Sequence[PreparedCase], logits: list[np.ndarray | NormalizedRows], width: int
                        ) -> list[CaseScore]:
    first = _first_scored(cases)
    return [score_logits(c, rows, width, first) for c, rows in zip(cases, logits)]


def overlapped(passes: Iterable[T], work: Callable[[T], R]) -> Iterator[R]:
    """``work(p)`` for each of ``passes``, in order, each on a worker thread while the next pass is produced: the
    host scores one forward pass while the device computes the next (the float64 log-normalizers of 2048 x 32K
    logits take longer on a CPU than a 7.6B MoE's pass on an H200).  An error comes in its place: a pass's error
    after the result of the pass before it."""
    passes = iter(passes)
    error = None
    with ThreadPoolExecutor(1, thread_name_prefix="quantkit-score") as worker:
        pending = None
        while True:
            try:
                item = next(passes)
            except StopIteration:
                break
            except BaseException as exc:  # noqa: BLE001 - raised after the earlier pass's result
                error = exc
                break
            if pending is not None:
                yield pending.result()
            pending = worker.submit(work, item)
        if pending is not None:
            yield pending.result()
    if error is not None:
        raise error


def run_cases(source: LogitSource, cases: Sequence[PreparedCase],
              progress: Callable[[CaseScore], None] | None = None,
              batch_tokens: int = DEFAULT_BATCH_TOKENS) -> tuple[list[CaseScore], int]:
    """Score prepared cases (module doc, step 3) in the groups of :func:`case_batches`, each group scored on the
    host while the next one's forward pass runs (:func:`overlapped`); returns the scores in case order and the
    model's vocabulary width.

    The output width comes first (:func:`vocabulary_width`), so every case's token ids are checked before any
    runs."""
    width = vocabulary_width(source, cases)
    scores: list[CaseScore | None] = [None] * len(cases)
    groups = case_batches(cases, batch_tokens)
    started = ((group, _start_group_logits(source, group)) for group in ([cases[i] for i in g] for g in groups))
    ran = ((group, collect()) for group, collect in one_ahead(started))
    for indices, group_scores in zip(groups, overlapped(ran, lambda r: _score_group_logits(*r, width))):
        for i, score in zip(indices, group_scores):
            scores[i] = score
            if progress is not None:
                progress(score)
    return scores, width


def kld_stream(cases: Sequence[PreparedCase]) -> np.ndarray:
    """The token stream a saved-logits file evaluates: every case's prompt + continuation, in order."""
    return np.array([t for case in cases for t in case.prompt_ids + case.target_ids], np.int64)


def _chunk_rows(source: LogitSource, tokens: np.ndarray, n_ctx: int, n_chunk: int, bos_id: int | None,
                batch_tokens: int):
    """(scored rows, targets) of each llama-perplexity chunk, ``batch_tokens // n_ctx`` chunks per forward pass
    (a pass's rows checked on the host while the next pass runs)."""
    first, per_pass = n_ctx // 2, max(1, batch_tokens // n_ctx)

    def start(begin: int) -> tuple:
        chunks = range(begin, min(begin + per_pass, n_chunk))
        inputs = [chunk_inputs(tokens, n_ctx, chunk, bos_id) for chunk in chunks]
        return chunks, inputs, start_sequence_logits(source, [ids for ids, _ in inputs],
                                                     [f"chunk {chunk}" for chunk in chunks], first)

    def check(ran: tuple) -> list:
        chunks, inputs, logits = ran
        checked = []
        for chunk, chunk_logits, (_, targets) in zip(chunks, logits, inputs):
            rows = chunk_logits[:n_ctx - 1 - first]
            try:
                log_normalizers(rows)
            except NonFiniteLogits as exc:
                raise ValidationError(f"chunk {chunk}: the model's logits hold NaN or +inf ({exc.detail})") from None
            checked.append((rows, targets))
        return checked

    started = one_ahead(start(begin) for begin in range(0, n_chunk, per_pass))
    for checked in overlapped(((chunks, inputs, collect()) for chunks, inputs, collect in started), check):
        yield from checked


def _logits_chunks(n_tokens: int, n_ctx: int) -> int:
    """Chunks of a base logits file of ``n_tokens`` tokens; at least one, with a position to score."""
    n_chunk = n_tokens // n_ctx
    if n_chunk == 0 or scored_per_chunk(n_ctx) < 1:
        raise FixtureError(f"the fixture's {n_tokens} tokens do not fill one chunk of --ctx {n_ctx} with a "
                           "position to score; lower --ctx for --save-logits")
    return n_chunk


def save_logits(source: LogitSource, codec: TextCodec, cases: Sequence[PreparedCase], n_ctx: int,
                path: str | os.PathLike, n_vocab: int, batch_tokens: int = DEFAULT_BATCH_TOKENS) -> int:
    """Write the base logits file of ``cases`` with ``n_ctx``-token chunks; returns the number of chunks."""
    tokens = kld_stream(cases)
    n_chunk = _logits_chunks(len(tokens), n_ctx)
    bos = codec.bos_id if codec.add_bos else None
    write_logits_file(path, n_ctx, n_vocab, tokens[:n_chunk * n_ctx],
                      (rows for rows, _ in _chunk_rows(source, tokens, n_ctx, n_chunk, bos, batch_tokens)))
    return n_chunk


def kld_against(source: LogitSource, codec: TextCodec, base_path: str | os.PathLike, n_vocab: int,
                each: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                batch_tokens: int = DEFAULT_BATCH_TOKENS) -> KldStats:
    """KLD statistics of ``source`` against a saved base logits file (its own token stream and chunking);
    ``each(rows, records, targets)`` also sees every chunk (``quantkit parity``'s per-position checks)."""
    base = LogitsFile(base_path)
    if base.n_vocab != n_vocab:
        raise ValidationError(f"the base logits have a vocabulary of {base.n_vocab}, the model {n_vocab}",
                              path=base_path)
    acc = KldAccumulator()
    bos = codec.bos_id if codec.add_bos else None
    for chunk, (rows, targets) in enumerate(_chunk_rows(source, base.tokens, base.n_ctx, base.n_chunk, bos,
                                                        batch_tokens)):
        acc.add(rows, base.records[chunk], targets)
        if each is not None:
            each(rows, base.records[chunk], targets)
    return acc.stats()


@dataclass(frozen=True)
class ScoringPlan:
    """Everything checked before the model runs (module doc, steps 1-2)."""

    fixture: Fixture
    identity: ModelIdentity
    ctx: int
    cases: list[PreparedCase]
    cross_checkpoint: list[str]
    warnings: list[str]


def plan_scoring(fixture: Fixture, codec: TextCodec, identity: ModelIdentity, *, ctx: int,
                 allow_cross_checkpoint: bool = False, kld_base: str | os.PathLike | None = None,
                 save_logits: bool = False) -> ScoringPlan:
    """Steps 1-2 of the module doc; needs the model's tokenizer and identity, not its weights.  A ``kld_base``
    file is read (header, size, tokens) and a base file to ``save_logits`` sized here too: before the cases run."""
    if ctx < 2:
        raise FixtureError(f"--ctx must be at least 2, found {ctx}")
    cross = [f"cross-checkpoint: {problem}" for problem in
             check_match(fixture.identity, identity, allow_cross_checkpoint=allow_cross_checkpoint,
                         fixture_path=fixture.path)]
    warnings = list(cross)
    cases = prepare_cases(fixture, codec, ctx=ctx, allow_unmapped=allow_cross_checkpoint, warnings=warnings)
    if kld_base is not None:
        LogitsFile(kld_base)
    if save_logits:
        _logits_chunks(len(kld_stream(cases)), ctx)
    return ScoringPlan(fixture, identity, ctx, cases, cross, warnings)


def run_scoring(source: LogitSource, codec: TextCodec, plan: ScoringPlan, *,
                kld_base: str | os.PathLike | None = None, save_logits_to: str | os.PathLike | None = None,
                progress: Callable[[CaseScore], None] | None = None,
                command: Sequence[str] | None = None,
                scored: tuple[list[CaseScore], int] | None = None,
                batch_tokens: int = DEFAULT_BATCH_TOKENS) -> ScoreResult:
    """Steps 3-4 of the module doc, and the table's evidence record (:func:`quantkit.evidence.evidence`: the
    scored file's SHA-256, the source's ``device``/``dtype`` when it has them, ``command`` or ``sys.argv``).
    ``scored``: the cases' scores (in case order) and the vocabulary width, computed elsewhere (``--executor ray``:
    :mod:`quantkit.scoring.rayscore`, in the same groups of ``batch_tokens``); ``source`` then only tells the
    device, dtype and arithmetic.
    Raises before any output exists when a check fails."""
    scores, n_vocab = run_cases(source, plan.cases, progress, batch_tokens) if scored is None else scored
    kld = kld_against(source, codec, kld_base, n_vocab, batch_tokens=batch_tokens) if kld_base is not None else None
    if save_logits_to is not None:
        save_logits(source, codec, plan.cases, plan.ctx, save_logits_to, n_vocab, batch_tokens)
    fixture = plan.fixture
    fixture_record = {"content_sha256": fixture.content_sha256, "label": fixture.label,
                      "cases": len(fixture.cases), "path": str(fixture.path)}
    record = evidence(artifact=plan.identity.path, source_digest=plan.identity.source, fixture=fixture_record,
                      device=getattr(source, "device", None), dtype=getattr(source, "dtype", None), command=command)
    header = {"version": TABLE_VERSION, "fixture": fixture_record, "model": plan.identity.to_json(), "ctx": plan.ctx,
              "cross_checkpoint": plan.cross_checkpoint, "evidence": record,
              "arithmetic": getattr(source, "arithmetic", "float32"), "batch_tokens": batch_tokens}
    return ScoreResult(header, scores, list(plan.warnings), kld)


def score_fixture(source: LogitSource, codec: TextCodec, fixture: Fixture, *, ctx: int,
                  allow_cross_checkpoint: bool = False, kld_base: str | os.PathLike | None = None,
                  save_logits_to: str | os.PathLike | None = None,
                  progress: Callable[[CaseScore], None] | None = None) -> ScoreResult:
    """Score ``source`` on ``fixture``: :func:`plan_scoring` with its identity, then :func:`run_scoring`."""
    plan = plan_scoring(fixture, codec, source.identity(), ctx=ctx, allow_cross_checkpoint=allow_cross_checkpoint)
    return run_scoring(source, codec, plan, kld_base=kld_base, save_logits_to=save_logits_to, progress=progress)
