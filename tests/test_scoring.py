"""Scoring: per-case metrics on hand-computed cases, the score table, bad inputs, and llama-perplexity's logits file
and KLD statistics checked against llama.cpp's own functions (compiled from tools/perplexity/perplexity.cpp)."""
from __future__ import annotations

import math
import shutil
import struct
import subprocess

import numpy as np
import pytest

from quantkit.errors import FixtureError, FormatError, TruncatedFileError, ValidationError
from quantkit.fixtures.directory import Alternative, Case, Position, write_fixture
from quantkit.fixtures.tokens import Rendering, TextCodec
from quantkit.scoring import kld
from quantkit.scoring import logprobs
from quantkit.scoring.logprobs import log_normalizers, top_ids
from quantkit.scoring.metrics import ApiCounts, CaseScore, Reference, Totals, case_row, score_case
from quantkit.scoring.score import (PreparedCase, case_batches, one_ahead, overlapped, prepare_cases, run_cases,
                                   save_logits, score_fixture)
from quantkit.scoring.source import ModelIdentity
from quantkit.scoring.table import read_table, table_text, write_table

NEG_INF = -np.inf


# -- log-probabilities ----------------------------------------------------------------------------------------

def _logprob(row, token):
    finite = [v for v in row if math.isfinite(v)]
    top = max(finite)
    return row[token] - (top + math.log(math.fsum(math.exp(v - top) for v in finite)))


def test_log_normalizers_and_top_ids_follow_ds4_rules():
    rows = np.array([[2, 1, 0, NEG_INF], [0, 3, 1, 0], [1, 1, 0, 0]], np.float32)
    logsum, greedy = log_normalizers(rows)
    for r in range(3):
        for t in range(4):
            if math.isfinite(rows[r, t]):
                assert rows[r, t] - logsum[r] == pytest.approx(_logprob(rows[r].tolist(), t), abs=1e-12)
    assert greedy.tolist() == [0, 1, 0]                         # ties: the lower id
    assert top_ids(rows[0], 4).tolist() == [0, 1, 2]            # -inf never listed
    assert top_ids(rows[1], 3).tolist() == [1, 2, 0]            # equal logits 0 at ids 0 and 3: id 0 first
    assert top_ids(rows[2], 1).tolist() == [0]


@pytest.mark.parametrize("bad, what", [(np.nan, "NaN"), (np.inf, r"\+inf")])
def test_non_finite_logits_raise_naming_the_row(bad, what):
    rows = np.zeros((3, 5), np.float32)
    rows[2, 1] = bad
    with pytest.raises(ValidationError, match=f"row 2 holds {what}"):
        log_normalizers(rows)


def test_log_normalizers_split_over_threads_give_the_rows_of_one_thread(monkeypatch):
    """Each row's float64 sum is the same whatever thread has it; the first bad row is reported, from any thread."""
    rows = (np.random.default_rng(3).standard_normal((600, 300)) * 4).astype(np.float32)
    rows[17, :200] = NEG_INF
    monkeypatch.setattr(logprobs, "available_cpus", lambda: 4)
    threaded = log_normalizers(rows)
    monkeypatch.setattr(logprobs, "MAX_THREADS", 1)
    serial = log_normalizers(rows)
    monkeypatch.undo()
    ref = [float(row[-1]) - _logprob(row.tolist(), len(row) - 1) for row in rows[:40]]
    assert threaded[0][:40] == pytest.approx(ref, abs=1e-12)
    assert np.array_equal(threaded[0], serial[0]) and np.array_equal(threaded[1], serial[1])
    monkeypatch.setattr(logprobs, "available_cpus", lambda: 4)
    rows[590, 3] = np.nan                                      # in the last thread's rows
    with pytest.raises(ValidationError, match="row 590 holds NaN"):
        log_normalizers(rows)
    rows[450, :] = NEG_INF                                     # an earlier bad row, in another thread
    with pytest.raises(ValidationError, match="row 450 holds only -inf"):
        log_normalizers(rows)


def test_device_log_normalizers_equal_the_host_ones(monkeypatch):
    """torch's normalizers (the runtime computes them beside a CUDA pass; run here on the CPU) equal numpy's within
    float64 rounding, greedy ids identical (ties to the lower id, -inf excluded), rows widened in several blocks;
    a case scored from them equals the case scored from its array."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((70, 1000)) * 6).astype(np.float32)
    rows[3, :900] = NEG_INF
    rows[4, [10, 500]] = rows[4].max() + 1                    # a tie for the greedy token
    monkeypatch.setattr(logprobs, "DEVICE_BLOCK_VALUES", 16_000)   # 16 rows a block: 5 blocks
    logsum, greedy = logprobs.device_log_normalizers(torch.from_numpy(rows))
    ref_logsum, ref_greedy = log_normalizers(rows)
    assert logsum.dtype == torch.float64 and np.array_equal(greedy.numpy(), ref_greedy) and ref_greedy[4] == 10
    assert np.abs(logsum.numpy() - ref_logsum).max() <= 1e-13 * np.abs(ref_logsum).max()
    targets = rng.integers(0, 1000, 70)
    targets[3] = 950                                          # a finite logit of the masked row
    normalized = logprobs.NormalizedRows(rows, logsum.numpy(), greedy.numpy())
    on_device = score_case("c", 1, targets[2:], normalized[2:], None)
    on_host = score_case("c", 1, targets[2:], rows[2:], None)
    assert on_device.nll == pytest.approx(on_host.nll, rel=1e-13)
    assert (on_device.first_match, on_device.greedy_lcp) == (on_host.first_match, on_host.greedy_lcp)


def test_overlapped_scores_a_pass_while_the_next_is_produced():
    """The work on pass i runs while pass i + 1 is produced (here pass i + 1 cannot be produced before it), results
    come in order, and a pass's error comes after the result of the pass before it."""
    import threading

    started = [threading.Event() for _ in range(4)]

    def produce(i):
        if i > 0:
            assert started[i - 1].wait(10), "the work on the previous pass did not run beside this one"
        return i

    def work(i):
        started[i].set()
        return i * 10

    assert list(overlapped((produce(i) for i in range(4)), work)) == [0, 10, 20, 30]

    def failing_passes():
        yield 1
        raise OSError("pass 2 failed")
    got = []
    with pytest.raises(OSError, match="pass 2 failed"):
        for r in overlapped(failing_passes(), lambda i: i):
            got.append(r)
    assert got == [1]

    def failing_work(i):
        if i == 1:
            raise FixtureError("work on pass 1 failed")
        return i
    with pytest.raises(FixtureError, match="work on pass 1 failed"):
        list(overlapped(failing_passes(), failing_work))


def test_one_ahead_gives_an_item_once_the_next_is_produced():
    """Item i comes out only after item i + 1 was produced (the next pass queued before this one's logits are
    collected); the last comes at the end; an error producing item i + 1 comes after item i."""
    log = []

    def produce(n, fail_at=None):
        for i in range(n):
            if i == fail_at:
                raise OSError(f"item {i} failed")
            log.append(f"made {i}")
            yield i

    for i in one_ahead(produce(3)):
        log.append(f"got {i}")
    assert log == ["made 0", "made 1", "got 0", "made 2", "got 1", "got 2"]
    got = []
    with pytest.raises(OSError, match="item 2 failed"):
        for i in one_ahead(produce(4, fail_at=2)):
            got.append(i)
    assert got == [0, 1]
    assert list(one_ahead(iter([]))) == []


# -- per-case metrics on a hand-computed case ---------------------------------------------------------------

def test_score_case_hand_computed():
    rows = np.array([[2, 1, 0, NEG_INF], [0, 3, 1, 0], [1, 1, 0, 0]], np.float32)
    targets = [0, 2, 0]
    r = [-0.5, -1.0, -0.7]
    # per position: alternatives (id or -1 for a token without bytes, reference logprob)
    alts = [[(0, -0.4), (1, -1.5), (3, -3.0)], [(1, -0.2), (2, -1.0), (-1, -2.0)], [(1, -0.3), (0, -0.6)]]
    reference = Reference(np.array(r), tuple((np.array([i for i, _ in a]), np.array([lp for _, lp in a]))
                                              for a in alts))
    score = score_case("c1", 7, targets, rows, reference)

    lp = [_logprob(rows[i].tolist(), t) for i, t in enumerate(targets)]
    assert score.nll == pytest.approx(-sum(lp), abs=1e-12)
    assert score.avg_nll == pytest.approx(-sum(lp) / 3, abs=1e-12)
    assert (score.first_match, score.greedy_lcp, score.prompt_tokens, score.api_ref_tokens) == (1, 1, 7, 3)
    a = score.api
    assert a.target_count == 3
    assert a.target_abs_delta == pytest.approx(sum(abs(lp[i] - r[i]) for i in range(3)), abs=1e-12)
    assert a.target_signed_delta == pytest.approx(sum(lp[i] - r[i] for i in range(3)), abs=1e-12)
    # position 0: id 3 has logit -inf -> unmapped; position 1: a token without bytes -> unmapped
    assert (a.top_items, a.top_mapped, a.top_logprob_count) == (8, 6, 6)
    # top-1: position 0 id 0 == greedy 0, position 1 id 1 == greedy 1, position 2 id 1 != greedy 0
    assert (a.top1_count, a.top1_match) == (3, 2)
    # top-n: every mapped alternative is within our top-n (n = alternatives listed)
    assert (a.topn_ref, a.topn_hit) == (6, 6)
    # pairs: (0,1) at pos 0 agree, (1,2) at pos 1 agree, (1,0) at pos 2 is a local tie -> not counted
    assert (a.pair_total, a.pair_agree) == (2, 2)
    mapped = [(0, 0, -0.4), (0, 1, -1.5), (1, 1, -0.2), (1, 2, -1.0), (2, 1, -0.3), (2, 0, -0.6)]
    deltas = [_logprob(rows[p].tolist(), t) - ref for p, t, ref in mapped]
    assert a.top_abs_delta == pytest.approx(sum(abs(d) for d in deltas), abs=1e-12)
    assert a.top_signed_delta == pytest.approx(sum(deltas), abs=1e-12)


def test_pair_disagreement_topn_miss_and_misaligned_reference():
    rows = np.array([[0, 1, 2, 3]], np.float32)
    reference = Reference(np.array([-1.0]), ((np.array([0, 1, 3]), np.array([-0.1, -0.2, -0.3])),))
    a = score_case("c", 1, [3], rows, reference).api
    assert (a.top1_count, a.top1_match) == (1, 0)               # reference's best (0) is not our greedy (3)
    assert (a.topn_ref, a.topn_hit) == (3, 2)                   # our top-3 is {3, 2, 1}: id 0 misses
    assert (a.pair_total, a.pair_agree) == (3, 0)               # the reference orders every pair the other way
    misaligned = Reference(np.array([-1.0, -2.0]), ((np.array([0]), np.array([-1.0])),) * 2)
    s = score_case("c", 1, [3], rows, misaligned)
    assert s.api == ApiCounts() and s.api_ref_tokens == 2


def test_target_with_no_probability_names_the_case():
    rows = np.array([[0, NEG_INF]], np.float32)
    with pytest.raises(FixtureError, match="case c9: target token 0 .id 1."):
        score_case("c9", 1, [1], rows, None)


# -- summary lines and the table ----------------------------------------------------------------------------

def _score(case_id, nll, tokens, first, lcp, api=None):
    return CaseScore(case_id, 5, tokens, nll, first, lcp, tokens if api else 0, api or ApiCounts())


def test_summary_lines_exact_format():
    api = ApiCounts(target_count=4, target_abs_delta=0.4, target_signed_delta=-0.2, top_items=8, top_mapped=6,
                    top_logprob_count=6, top_abs_delta=0.6, top_signed_delta=0.3, top1_count=4, top1_match=3,
                    topn_ref=6, topn_hit=5, pair_total=10, pair_agree=7)
    totals = Totals.of([_score("a", 2.0, 4, 1, 4, api), _score("b", 1.0, 2, 0, 0)])
    assert totals.summary_line() == "summary cases=2 tokens=6 avg_nll=0.500000000 first_match=1 avg_lcp=2.000"
    assert totals.api_summary_line() == (
        "api_summary ref_tokens=4 target_tokens=4 target_mae=0.100000000 target_mean_delta=-0.050000000 "
        "top_items=8 top_mapped=6 top_coverage=0.750000000 top1_match=3/4 top1_rate=0.750000000 topn_hit=5/6 "
        "topn_recall=0.833333333 top_logprob_count=6 top_mae=0.100000000 top_mean_delta=0.050000000 "
        "pair_agree=7/10 pair_rate=0.700000000")
    assert case_row(_score("b", 1.0, 2, 0, 0)).split("\t")[:7] == ["b", "5", "2", "1.000000000", "0.500000000",
                                                                    "0", "0"]


HEADER = {"version": 1, "fixture": {"content_sha256": "ab" * 32, "label": "0731", "cases": 2, "path": "f"},
          "model": ModelIdentity().to_json(), "ctx": 64, "cross_checkpoint": []}


def test_table_round_trip(tmp_path):
    scores = [_score("a", 2.0, 4, 1, 4), _score("b", 1.0, 2, 0, 0)]
    path = tmp_path / "t.tsv"
    write_table(path, HEADER, scores, [Totals.of(scores).summary_line()])
    table = read_table(path)
    assert table.fixture_sha256 == "ab" * 32 and [s.id for s in table.scores] == ["a", "b"]
    assert [s.nll for s in table.scores] == [2.0, 1.0] and table.totals.avg_nll == pytest.approx(0.5)


def _malformed_tables():
    scores = [_score("a", 2.0, 4, 1, 4), _score("b", 1.0, 2, 0, 0)]
    good = table_text(HEADER, scores, [Totals.of(scores).summary_line()])
    lines = good.split("\n")
    yield "no header", "\n".join(lines[1:]), "line 4: a '#' line in a ds4 table"     # the column line alone is ds4's
    yield "no column line", "\n".join(lines[:1] + lines[2:]), "line 2: columns"
    yield "missing row", "\n".join(lines[:3] + lines[4:]), "1 case rows but its fixture has 2"
    yield "nan", good.replace("\t2.000000000\t", "\tnan\t"), "column nll is 'nan', expected a decimal number"
    yield "summary mismatch", good.replace("first_match=1", "first_match=2"), "rows add up to"
    yield "no summary", "\n".join(lines[:4]) + "\n", "summary' line is missing"
    yield "duplicate", good.replace("\nb\t", "\na\t"), "appears twice"
    yield "short row", good.replace("\t0.500000000\t0\t0\t", "\t0.500000000\t0\t", 1), "fields, expected"
    yield "overflow", good.replace("\t2.000000000\t", "\t1e999\t"), "expected a finite number"
    yield "underscore", good.replace("\t5\t4\t", "\t5_0\t4\t", 1), "column prompt_tokens is '5_0'"
    yield "lcp > tokens", good.replace("\t1\t4\t", "\t1\t9\t", 1), "inconsistent counts"


@pytest.mark.parametrize("name, text, message", list(_malformed_tables()), ids=[t[0] for t in _malformed_tables()])
def test_malformed_tables_are_refused(tmp_path, name, text, message):
    path = tmp_path / "t.tsv"
    path.write_text(text)
    with pytest.raises(FixtureError, match=message):
        read_table(path)


# -- score_fixture with a fake model: checks before reporting ----------------------------------------------

class FakeSource:
    """Logits that depend only on the last token: a fixed random table, with optional poison."""

    def __init__(self, width, seed=0, identity=None, poison_token=None):
        self.table = np.random.default_rng(seed).normal(size=(width, width)).astype(np.float32)
        self._identity = identity or ModelIdentity(label="0731", source="s" * 64)
        self.poison_token = poison_token

    def identity(self):
        return self._identity

    def logits(self, token_ids):
        out = self.table[np.asarray(token_ids) % len(self.table)].copy()
        if self.poison_token is not None:
            out[np.asarray(token_ids) == self.poison_token, 0] = np.nan
        return out


class RaisingSource(FakeSource):
    """Like the runtime when a kernel produced NaN: it raises, naming the position but not the case."""

    def logits(self, token_ids):
        if len(token_ids) > 1:
            raise ValidationError("non-finite logits at position 3; first non-finite output: module 'lm_head'")
        return super().logits(token_ids)


@pytest.fixture(scope="module")
def codec():
    from quantkit.testing.tiny_models import build_tiny_tokenizer

    return TextCodec(build_tiny_tokenizer("qwen3_moe"))


def _fixture(tmp_path, codec, *, label="0731", source="s" * 64, response=True, bad_bytes=False, name="fx"):
    def position(token_id):
        data = b"\xff\xfe-not-a-token" if bad_bytes else codec.token_bytes(token_id)
        alt = Alternative(codec.token_text(data), -0.5, data)
        return Position(alt.token, -0.5, data, (alt,))

    cases = []
    for i, (prompt, cont) in enumerate([("def f(x):", " return x"), ("import os", "\nimport sys")]):
        ids = codec.encode_text(cont)
        cases.append(Case(f"case_{i}", prompt, cont, tuple(position(t) for t in ids) if response else None))
    return write_fixture(tmp_path / name, cases, label=label, source=ModelIdentity(source=source),
                         rendering=Rendering("raw"), capture=None)


def test_score_fixture_with_fake_model(tmp_path, codec):
    fx = _fixture(tmp_path, codec)
    result = score_fixture(FakeSource(512), codec, fx, ctx=64)
    assert [s.target_tokens for s in result.scores] == [len(codec.encode_text(c.continuation)) for c in fx.cases]
    assert result.totals.api.top1_count == result.totals.tokens and not result.warnings
    result.write(tmp_path / "out.tsv")
    table = read_table(tmp_path / "out.tsv")
    assert table.fixture_sha256 == fx.content_sha256 and table.header["ctx"] == 64


class ManySource(FakeSource):
    """:class:`FakeSource` that also runs several sequences per call, recording each call's lengths."""

    def __init__(self, *args, fail=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.firsts, self.fail = [], [], fail

    def start_logits_many(self, sequences, first=0):
        self.calls.append([len(s) for s in sequences])
        self.firsts.append(first)

        def collect():
            if self.fail:
                raise ValidationError("non-finite logits at position 3; first non-finite output: module 'lm_head'")
            return [self.logits(s)[first:] for s in sequences]
        return collect


def test_case_batches_run_shortest_first_within_the_token_budget():
    lengths = [10, 3, 7, 40, 3, 20]
    cases = [PreparedCase(f"c{i}", (1,) * (n - 1), (2,), None) for i, n in enumerate(lengths)]
    # sorted by length (then index): 1, 4, 2, 0, 5, 3; a group grows while (count x its longest) <= 24
    assert case_batches(cases, 24) == [[1, 4, 2], [0], [5], [3]]
    assert case_batches(cases, 1) == [[1], [4], [2], [0], [5], [3]]
    assert case_batches(cases, 10_000) == [[1, 4, 2, 0, 5, 3]]


def test_cases_scored_in_groups_equal_cases_scored_alone(tmp_path, codec):
    fx = _fixture(tmp_path, codec)
    alone = score_fixture(FakeSource(512), codec, fx, ctx=64)
    many = ManySource(512)
    grouped = score_fixture(many, codec, fx, ctx=64)
    assert grouped.scores == alone.scores
    assert max(len(call) for call in many.calls) > 1
    # each group asks for the logits from its first scored position on (the last prompt token's), not all
    cases = prepare_cases(fx, codec, ctx=64)
    groups = case_batches(cases, 2048)
    assert many.firsts[-len(groups):] == [min(len(cases[i].prompt_ids) for i in g) - 1 for g in groups]
    assert max(many.firsts) > 0
    # a group that fails reruns its cases one at a time, so the error names the case
    with pytest.raises(ValidationError, match=r"^case case_\d+: non-finite logits at position 3"):
        score_fixture(RaisingMany(512, fail=True), codec, fx, ctx=64)


def test_logits_files_written_in_groups_equal_chunks_one_at_a_time(tmp_path, codec):
    cases = prepare_cases(_fixture(tmp_path, codec), codec, ctx=64)
    files = {}
    for batch in (6, 2048):      # one chunk of 6 tokens per pass, then every chunk in one
        many = ManySource(512)
        files[batch] = tmp_path / f"{batch}.bin"
        n_chunk = save_logits(many, codec, cases, 6, files[batch], 512, batch_tokens=batch)
        assert n_chunk >= 3 and max(map(len, many.calls), default=1) == (1 if batch == 6 else n_chunk)
    assert files[6].read_bytes() == files[2048].read_bytes()


class StartingSource(ManySource):
    """:class:`ManySource` whose passes are started, then collected (as the runtime on CUDA), logging both."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def start_logits_many(self, sequences, first=0):
        n = sum(entry.startswith("start") for entry in self.log)
        self.log.append(f"start {n}")
        collect = super().start_logits_many(sequences, first)

        def logged():
            self.log.append(f"collect {n}")
            return collect()
        return logged

    def started_before_collected(self) -> bool:
        """Pass i + 1 started before pass i was collected, for every pass; every pass collected once."""
        n = sum(entry.startswith("start") for entry in self.log)
        return sorted(self.log) == sorted([f"start {i}" for i in range(n)] + [f"collect {i}" for i in range(n)]) \
            and all(self.log.index(f"start {i + 1}") < self.log.index(f"collect {i}") for i in range(n - 1))


def test_a_pass_is_started_before_the_previous_one_is_collected(tmp_path, codec):
    """quantkit score and the saved-logits chunks queue pass i + 1 before collecting pass i's logits, with the
    scores and files of one pass at a time."""
    cases = prepare_cases(_fixture(tmp_path, codec), codec, ctx=64)
    alone, _ = run_cases(FakeSource(512), cases, batch_tokens=1)
    starting = StartingSource(512)
    assert run_cases(starting, cases, batch_tokens=1)[0] == alone
    assert len(starting.log) >= 4 and starting.started_before_collected()
    one, pipelined = tmp_path / "one.bin", tmp_path / "pipelined.bin"
    save_logits(FakeSource(512), codec, cases, 6, one, 512, batch_tokens=12)
    starting = StartingSource(512)
    save_logits(starting, codec, cases, 6, pipelined, 512, batch_tokens=12)
    assert one.read_bytes() == pipelined.read_bytes()
    assert len(starting.log) >= 4 and starting.started_before_collected()


def test_runtime_source_ggml_cpu_errors_name_the_case(tmp_path, codec, monkeypatch):
    """The runtime's ggml-cpu arithmetic runs a group one sequence at a time when it is collected, so a non-finite
    pass is reported with its case's name, as a failing group is."""
    from types import SimpleNamespace

    from quantkit.scoring.loading import RuntimeSource

    source = RuntimeSource(SimpleNamespace(arithmetic="ggml-cpu"), ModelIdentity())
    monkeypatch.setattr(source, "logits", RaisingSource(512).logits)
    cases = prepare_cases(_fixture(tmp_path, codec), codec, ctx=64)
    with pytest.raises(ValidationError, match=r"^case case_\d+: non-finite logits at position 3"):
        run_cases(source, cases)


class RaisingMany(ManySource, RaisingSource):
    """Fails in a group, and alone on every case longer than one token."""


def test_score_refuses_bad_inputs_before_reporting(tmp_path, codec):
    fx = _fixture(tmp_path, codec)
    out = tmp_path / "out.tsv"
    cases = [
        (lambda: score_fixture(FakeSource(512, poison_token=int(codec.encode_text(" return x")[0])), codec, fx,
                               ctx=64), ValidationError, "case case_0: .*NaN"),
        (lambda: score_fixture(RaisingSource(512), codec, fx, ctx=64), ValidationError,
         "case case_0: non-finite logits at position 3; first non-finite output: module 'lm_head'"),
        (lambda: score_fixture(FakeSource(300), codec, fx, ctx=64), FixtureError,
         "case case_0: token id \\d+ is outside the model's vocabulary of 300"),
        (lambda: score_fixture(FakeSource(512), codec, fx, ctx=5), FixtureError, "case case_0: .* exceed --ctx 5"),
        (lambda: score_fixture(FakeSource(512, identity=ModelIdentity(label="0800")), codec, fx, ctx=64),
         FixtureError, "checkpoint label differs: fixture '0731', model '0800'"),
        (lambda: score_fixture(FakeSource(512, identity=ModelIdentity(source="t" * 64)), codec, fx, ctx=64),
         FixtureError, "source checkpoint digest differs"),
        (lambda: score_fixture(FakeSource(512, identity=ModelIdentity()), codec, fx, ctx=64), FixtureError,
         "neither the checkpoint label nor the source digest is known on both sides"),
        (lambda: score_fixture(FakeSource(512), codec, _fixture(tmp_path, codec, bad_bytes=True, name="bad"), ctx=64),
         FixtureError, "case case_0: position 0 lists token .* not in the model's vocabulary"),
    ]
    for run, error, message in cases:
        with pytest.raises(error, match=message):
            run()
        assert not out.exists()


def test_cross_checkpoint_and_misaligned_cases_are_reported(tmp_path, codec):
    fx = _fixture(tmp_path, codec, bad_bytes=True)
    other = FakeSource(512, identity=ModelIdentity(label="0800"))
    result = score_fixture(other, codec, fx, ctx=64, allow_cross_checkpoint=True)
    assert result.header["cross_checkpoint"] == ["cross-checkpoint: checkpoint label differs: fixture '0731', "
                                                 "model '0800'"]
    assert result.totals.api.top_items > 0 and result.totals.api.top_mapped == 0   # unknown tokens left unmapped
    # a response with another token count than the continuation: ds4 skips its API metrics, and so do we
    good = _fixture(tmp_path, codec, name="good")
    misaligned = [Case(c.id, c.prompt, c.continuation, c.response[:1]) for c in good.cases]
    fx2 = write_fixture(tmp_path / "mis", misaligned, label="0731", source=ModelIdentity(source="s" * 64),
                        rendering=Rendering("raw"), capture=None)
    result = score_fixture(FakeSource(512), codec, fx2, ctx=64)
    assert len(result.warnings) == 2 and "API metrics skipped" in result.warnings[0]
    assert result.totals.api.target_count == 0 and result.totals.api_ref_tokens == 2


# -- llama-perplexity logits file -----------------------------------------------------------------------------

def _logits(rng, n, vocab, spread=3.0):
    rows = (rng.normal(size=(n, vocab)) * spread).astype(np.float32)
    rows[0] = 1.25                                  # all equal: scale 0
    rows[1, :vocab // 2] -= 40                      # range beyond 16 nats: clamped at max - 16
    return rows


def test_logits_file_round_trip_and_layout(tmp_path):
    rng = np.random.default_rng(1)
    n_ctx, vocab, n_chunk = 10, 33, 2
    tokens = rng.integers(0, vocab, size=n_ctx * n_chunk)
    rows = [_logits(rng, kld.scored_per_chunk(n_ctx), vocab) for _ in range(n_chunk)]
    path = tmp_path / "base.kld"
    kld.write_logits_file(path, n_ctx, vocab, tokens, rows)
    data = path.read_bytes()
    assert data[:8] == b"_logits_" and struct.unpack("<Iii", data[8:20]) == (n_ctx, vocab, n_chunk)
    width = 2 * ((vocab + 1) // 2) + 4
    assert len(data) == 20 + 4 * n_ctx * n_chunk + 2 * width * 4 * n_chunk
    f = kld.LogitsFile(path)
    assert f.tokens.tolist() == tokens.tolist() and f.records.shape == (n_chunk, 4, width)
    rec = np.asarray(f.records[0])
    assert (rec[:, -1] == 0).all()                                  # odd vocabulary: zero pad entry
    scale, lo = rec[:, :4].copy().view(np.float32).T
    assert scale[0] == 0 and (rec[0, 4:4 + vocab] == 0).all()
    # dequantized log-probabilities are within half a step of the true ones (above the 16-nat floor)
    logp = rows[0] - np.log(np.exp(rows[0].astype(np.float64)).sum(axis=1))[:, None]
    recovered = scale[:, None] * rec[:, 4:4 + vocab].astype(np.float32) + lo[:, None]
    above = logp >= logp.max(axis=1, keepdims=True) - 16
    assert np.abs(recovered - logp)[above].max() <= scale.max() / 2 + 1e-5


def test_malformed_logits_files_are_refused(tmp_path):
    path = tmp_path / "base.kld"
    kld.write_logits_file(path, 4, 5, np.arange(8) % 5, [np.zeros((1, 5), np.float32)] * 2)
    good = path.read_bytes()
    cases = [("bad magic", b"_logitz_" + good[8:], FormatError, "magic"),
             ("truncated", good[:-3], TruncatedFileError, "implies"),
             ("trailing", good + b"\0\0", FormatError, "implies"),
             ("short header", good[:10], TruncatedFileError, "header"),
             ("zero ctx", good[:8] + struct.pack("<I", 0) + good[12:], FormatError, "n_ctx"),
             ("token outside", good[:20] + struct.pack("<i", 9) + good[24:], FormatError, "outside the vocab"),
             # a NaN head: its row dropped out of the KLD as if it agreed (KLD 0), its NLL made the PPL NaN
             ("nan head", good[:52] + struct.pack("<f", float("nan")) + good[56:], FormatError,
              "chunk 0, scored position 0: the record's scale")]
    for name, data, error, message in cases:
        path.write_bytes(data)
        with pytest.raises(error, match=message):
            kld.LogitsFile(path)


def test_kld_statistics_against_float64_formula():
    rng = np.random.default_rng(2)
    base = _logits(rng, 120, 50)
    cand = (base + rng.normal(size=base.shape).astype(np.float32) * 0.3).astype(np.float32)
    targets = rng.integers(0, 50, size=120)
    records = kld.quantize_rows(base)
    acc = kld.KldAccumulator()
    acc.add(cand, records, targets)
    stats = acc.stats()
    scale, lo = records[:, :4].copy().view(np.float32).T.astype(np.float64)
    logp_base = scale[:, None] * records[:, 4:54] + lo[:, None]
    logq = cand - np.log(np.exp(cand.astype(np.float64)).sum(axis=1))[:, None]
    per_token = np.where(logp_base > -16, np.exp(logp_base) * (logp_base - logq), 0).sum(axis=1)
    assert stats.kld[0] == pytest.approx(per_token.mean(), abs=1e-5)
    at = np.arange(120)
    assert stats.ppl[0] == pytest.approx(math.exp(-logq[at, targets].mean()), rel=1e-5)
    assert stats.same_top[0] == pytest.approx(np.mean(cand.argmax(1) == logp_base.argmax(1)))
    same = kld.KldAccumulator()
    same.add(base, records, targets)
    assert abs(same.stats().kld[0]) < 1e-4 and same.stats().same_top[0] == 1.0


HARNESS_INCLUDES = "\n".join(f"#include <{h}>" for h in ("algorithm", "cmath", "cstdint", "cstdio", "cstring",
                                                         "fstream", "utility", "vector"))
HARNESS_MAIN = r'''
int main(int argc, char ** argv) {
    if (argc != 3) return 2;
    FILE * in = fopen(argv[1], "rb");
    int32_t n_ctx, n_vocab, n_chunk;
    if (fread(&n_ctx, 4, 1, in) != 1 || fread(&n_vocab, 4, 1, in) != 1 || fread(&n_chunk, 4, 1, in) != 1) return 3;
    const int first = n_ctx/2, n_scored = n_ctx - 1 - first;
    std::vector<int32_t> tokens(size_t(n_ctx) * n_chunk);
    std::vector<float> base(size_t(n_chunk) * n_scored * n_vocab), cand(base.size());
    if (fread(tokens.data(), 4, tokens.size(), in) != tokens.size()
        || fread(base.data(), 4, base.size(), in) != base.size()
        || fread(cand.data(), 4, cand.size(), in) != cand.size()) return 3;
    fclose(in);
    const int nv = 2*((n_vocab + 1)/2) + 4;
    std::vector<uint16_t> log_probs(size_t(n_scored) * nv);
    std::ofstream out(argv[2], std::ios::binary);
    const uint32_t ctx_u = n_ctx;
    out.write("_logits_", 8);
    out.write((const char *)&ctx_u, 4);
    out.write((const char *)&n_vocab, 4);
    out.write((const char *)&n_chunk, 4);
    out.write((const char *)tokens.data(), tokens.size()*4);
    kl_divergence_result kld;
    std::vector<float> kld_values, p_diff_values;
    for (int c = 0; c < n_chunk; ++c) {
        const int32_t * tok = tokens.data() + size_t(c)*n_ctx + first;
        const float * chunk_base = base.data() + size_t(c)*n_scored*n_vocab;
        const float * chunk_cand = cand.data() + size_t(c)*n_scored*n_vocab;
        for (int i = 0; i < n_scored; ++i) {
            log_softmax(n_vocab, chunk_base + size_t(i)*n_vocab, log_probs.data() + size_t(i)*nv, tok[i+1]);
        }
        out.write((const char *)log_probs.data(), log_probs.size()*2);
        for (int i = 0; i < n_scored; ++i) {
            auto v = log_softmax(n_vocab, chunk_cand + size_t(i)*n_vocab, log_probs.data() + size_t(i)*nv,
                                 tok[i+1], kld);
            kld_values.push_back((float)v.first);
            p_diff_values.push_back(v.second);
        }
    }
    out.close();
'''


def _block(src: str, marker: str, trailing: str = "") -> str:
    start = src.index(marker)
    depth, i = 0, src.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[start:i + 1] + trailing
        i += 1


@pytest.fixture(scope="module")
def llama_kld(llama_cpp_src, tmp_path_factory):
    """A program made of llama.cpp's own writer, KLD accumulation and summary code from perplexity.cpp, fed by a
    small main that lays chunks out as ``perplexity()`` and ``kl_divergence()`` do."""
    if shutil.which("g++") is None:
        pytest.fail("g++ is needed to compile llama.cpp's perplexity functions")
    src = (llama_cpp_src / "tools" / "perplexity" / "perplexity.cpp").read_text()
    functions = [_block(src, "static inline int nearest_int("),
                 _block(src, "static double log_softmax(int n_vocab, const float * logits, uint16_t * log_prob"),
                 _block(src, "struct kl_divergence_result {", ";"),
                 _block(src, "static std::pair<double, float> log_softmax(int n_vocab, const float * logits, "
                             "const uint16_t * base_log_prob")]
    lambdas = [_block(src, "auto mean_and_uncertainty = ", ";"), _block(src, "auto covariance = ", ";")]
    body = _block(src, "static void kl_divergence(llama_context * ctx")
    summary = body[body.index("    std::sort(kld_values.begin()"):body.rindex("}")]
    code = "\n".join([HARNESS_INCLUDES, "#define LOG(...) printf(__VA_ARGS__)", *functions, HARNESS_MAIN, *lambdas,
                      summary, "    return 0;\n}\n"])
    folder = tmp_path_factory.mktemp("llama_kld")
    (folder / "harness.cpp").write_text(code)
    # llama.cpp's tools build with plain -O3 (no -march=native), so no FMA contraction
    subprocess.run(["g++", "-O3", "-std=c++17", "-o", str(folder / "harness"), str(folder / "harness.cpp")],
                   check=True, capture_output=True)
    return folder / "harness"


def test_logits_file_and_kld_report_equal_llama_cpp(llama_kld, tmp_path):
    rng = np.random.default_rng(3)
    n_ctx, vocab, n_chunk = 64, 257, 4                     # 31 scored positions per chunk, 124 in all
    tokens = rng.integers(0, vocab, size=n_ctx * n_chunk).astype(np.int32)
    scored = kld.scored_per_chunk(n_ctx)
    base = [_logits(rng, scored, vocab) for _ in range(n_chunk)]
    cand = [(b + rng.normal(size=b.shape) * 0.5).astype(np.float32) for b in base]
    inputs = tmp_path / "in.bin"
    inputs.write_bytes(struct.pack("<iii", n_ctx, vocab, n_chunk) + tokens.tobytes()
                       + np.concatenate(base).tobytes() + np.concatenate(cand).tobytes())
    theirs = tmp_path / "llama.kld"
    run = subprocess.run([str(llama_kld), str(inputs), str(theirs)], check=True, capture_output=True, text=True)
    ours = tmp_path / "ours.kld"
    kld.write_logits_file(ours, n_ctx, vocab, tokens, base)
    assert ours.read_bytes() == theirs.read_bytes()

    file = kld.LogitsFile(theirs)
    acc = kld.KldAccumulator()
    for c in range(n_chunk):
        _, targets = kld.chunk_inputs(file.tokens, n_ctx, c, None)
        acc.add(cand[c], file.records[c], targets)
    assert acc.stats().report_lines() == run.stdout.rstrip("\n").split("\n")
