"""A checkpoint as runtime weights, assembled on demand: the same values as assembling every tensor at open (every
tiny architecture, layout and source encoding), one expert's payload the slice of the whole (assembled from that
expert's source alone when the map stacks per-expert sources), the GGUF type chosen from the headers, the cache
within its budget through a whole forward pass (budgets down to one expert: the same logits and imatrix bit for
bit, every source assembled at most once per pass), the ``replace`` hook; and the packed weights' finiteness check
(once per payload, a failure raised again on every use) and strided placement (the index scatter's result)."""
from __future__ import annotations

from contextlib import closing

import ml_dtypes
import numpy as np
import pytest
import torch

from quantkit.arch import get_arch
from quantkit.convert.plan import inspect_sources
from quantkit.errors import FormatError, MissingSourceError, SourceError, StateError, UnsupportedError
from quantkit.formats.registry import GGMLType
from quantkit.io.checkpoint import open_checkpoint
from quantkit.runtime import load_model, logits
from quantkit.runtime.inverse import VALUE_INVERSES
from quantkit.runtime.packed import Strided
from quantkit.examples import example_model_dir
from quantkit.resources import available_memory
from quantkit.runtime.weights import (DEFAULT_CACHE_FRACTION, CheckpointWeights, GGUFWeights,
                                      open_weights)
from quantkit.testing.tiny_checkpoints import ENCODINGS, OFFICIAL_ENCODINGS, PLAIN_ENCODINGS

ARCHS = ("qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp")
LAYOUTS = ([(arch, "per-expert", e) for arch in ARCHS for e in ENCODINGS]
           + [(arch, "fused", e) for arch in ARCHS for e in PLAIN_ENCODINGS]
           + [("deepseek_v4", "official", e) for e in OFFICIAL_ENCODINGS])
IDS = [1, 17, 42, 99, 3, 250, 7, 64]


def eager(path) -> tuple[dict[str, np.ndarray], dict]:
    """Every GGUF tensor assembled at once, as the runtime did before it became lazy: integer tensors as stored,
    everything else decoded to float32, transformed by the architecture map; and each output's plan."""
    with open_checkpoint(path) as ckpt:
        amap = get_arch(ckpt.config["model_type"]).bind(ckpt.config)
        shapes, encodings = inspect_sources(ckpt)
        outputs = amap.outputs(shapes)

        def load(name):
            return np.asarray(ckpt.raw(name)) if encodings[name] == "int" else ckpt.tensor_f32(name)

        return ({o.gguf_name: amap.assemble(o, load) for o in outputs},
                {o.gguf_name: (o, [encodings[m.hf_name] for m in o.sources]) for o in outputs})


def values(qtype: GGMLType, payload: np.ndarray) -> np.ndarray:
    """The float32 (or int32) values of a BF16/F32/I32 payload, exactly."""
    if qtype == GGMLType.I32:
        return payload.view(np.int32)
    if qtype == GGMLType.BF16:
        return payload.view(ml_dtypes.bfloat16).astype(np.float32)
    assert qtype == GGMLType.F32
    return payload.view(np.float32)


def bf16_lossless(array: np.ndarray) -> bool:
    return np.array_equal(array.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32),
                          array.view(np.uint32))


@pytest.mark.parametrize("arch,layout,encoding", LAYOUTS, ids=["-".join(x) for x in LAYOUTS])
def test_lazy_data_equals_eager_assembly(tiny_checkpoints, arch, layout, encoding):
    path = tiny_checkpoints.get(arch, layout, encoding)
    expected, plans = eager(path)
    weights = CheckpointWeights(path, cache_bytes=0)
    try:
        assert sorted(weights.tensors) == sorted(expected)
        for name, array in expected.items():
            stored = weights.tensors[name]
            payload = weights.data(name)
            assert stored.shape == array.shape and payload.shape[:-1] == array.shape[:-1], name
            got = values(stored.qtype, payload)
            assert got.dtype == (np.int32 if array.dtype.kind in "iu" else np.float32), name
            if got.dtype == np.float32:
                assert np.array_equal(got.view(np.uint32), array.view(np.uint32)), name    # bit for bit, NaN too
            else:
                assert np.array_equal(got, array), name
            output, sources = plans[name]
            moved_only = not any(s in VALUE_INVERSES for m in output.sources for s in m.transform)
            if stored.qtype == GGMLType.BF16:
                assert set(sources) == {"BF16"} and moved_only and bf16_lossless(array), name
            elif stored.qtype == GGMLType.F32:
                assert set(sources) != {"BF16"} or not moved_only, name
            if encoding == "bf16" and array.dtype == np.float32:
                # a BF16 release keeps exactly the type the eager choice gave (BF16 when lossless, else F32)
                assert (stored.qtype == GGMLType.BF16) == bf16_lossless(array), name
        assert weights.cache.hits == 0 and weights.cache.bytes == 0      # cache_bytes=0 keeps nothing
        loaded = []
        load = weights._load
        weights._load = lambda source: loaded.append(source) or load(source)
        for name, output in ((n, o) for n, (o, _) in plans.items() if len(o.shape) == 3):
            whole = weights.data(name)
            for index in [*range(output.shape[0]), -1]:
                loaded.clear()
                part = weights.data(name, index)
                assert part.shape == whole.shape[1:] and np.array_equal(part, whole[index]), (name, index)
                if output.assembly == "stack_experts":      # that expert's source only, not the stack
                    assert loaded == [output.sources[index].hf_name], (name, index)
    finally:
        weights.close()


def test_cache_stays_within_its_budget_through_a_forward_pass(tiny_checkpoints, monkeypatch):
    """Budgets from a layer's stacked experts down to one expert and none: the unlimited logits bit for bit, the
    cache never above its budget, and no source assembled twice in a pass (an expert's use assembles that expert,
    not its stack)."""
    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "bf16")
    with closing(CheckpointWeights(path, cache_bytes=0)) as w:
        sizes = {name: w.data(name).nbytes for name in w.tensors}
        stacked = [name for name in w.tensors if "_exps" in name]
        expert = w.data(stacked[0], 0).nbytes
    largest = max(sizes.values())
    assert largest == max(sizes[name] for name in stacked) and expert < largest // 2
    # one layer's three stacked expert tensors (the next layer must evict them); less than one stacked tensor;
    # one expert; nothing
    budgets = (3 * largest, largest // 2, expert, 0)
    assert budgets[0] < sum(sizes.values()) // 2
    observed, loads = [], []
    original, load = CheckpointWeights.data, CheckpointWeights._load

    def data(self, name, index=None):
        payload = original(self, name, index)
        observed.append(sum(p.nbytes for p in self.cache._entries.values()))     # counted here, not by the cache
        return payload

    monkeypatch.setattr(CheckpointWeights, "data", data)
    monkeypatch.setattr(CheckpointWeights, "_load", lambda self, name: loads.append(name) or load(self, name))
    reference = load_model(path, cache_bytes=None)
    try:
        want = logits(reference, IDS)
        cache = reference.store.weights.cache
        assert 0 < cache.peak_bytes < sum(sizes.values())       # unlimited: what the pass used, the routed experts
        misses = cache.misses
        assert np.array_equal(logits(reference, IDS), want) and cache.misses == misses      # all kept
    finally:
        reference.close()
    for budget in budgets:
        bounded = load_model(path, cache_bytes=budget)
        try:
            observed.clear()
            for _ in range(2):
                loads.clear()
                assert np.array_equal(logits(bounded, IDS), want), budget
                assert loads and len(loads) == len(set(loads)), budget      # no source assembled twice in a pass
            cache = bounded.store.weights.cache
            assert observed and max(observed) <= budget and max(observed) == cache.peak_bytes, budget
            assert cache.bytes <= budget
        finally:
            bounded.close()


def test_imatrix_with_a_budget_of_two_experts_is_the_unlimited_one(tmp_path, monkeypatch):
    """The bundled model's imatrix collected with ``max_memory`` of two experts' payloads (far less than one stacked
    tensor): bit for bit the unlimited one, the cache within the budget."""
    from quantkit.imatrix.collect import CollectOptions, collect_imatrix

    peaks = []
    close = CheckpointWeights.close

    def closing_(self):
        peaks.append(self.cache.peak_bytes)
        close(self)

    monkeypatch.setattr(CheckpointWeights, "close", closing_)
    with closing(CheckpointWeights(example_model_dir(), cache_bytes=0)) as w:
        name = next(n for n in w.tensors if "_exps" in n)
        budget = 2 * w.data(name, 0).nbytes
        assert budget < w.data(name).nbytes // 2
    opts = dict(ctx=64, chunks=2, progress=False)
    text = example_model_dir().parent / "tiny-moe-text" / "calibration.txt"
    peaks.clear()
    runs = {limit: collect_imatrix(example_model_dir(), text, tmp_path / f"{limit}.gguf",
                                   CollectOptions(**opts, max_memory=limit)) for limit in (None, budget)}
    assert 0 < peaks[1] <= budget
    assert sorted(runs[budget].entries) == sorted(runs[None].entries)
    for entry, e in runs[None].entries.items():
        assert np.array_equal(runs[budget].entries[entry].counts, e.counts), entry
        assert np.array_equal(runs[budget].entries[entry].in_sum2, e.in_sum2), entry


# -- replace ----------------------------------------------------------------------------------------------------------

EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"
DENSE = "model.layers.1.self_attn.q_proj.weight"


def test_replace_uses_the_given_values(tiny_checkpoints):
    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "bf16")
    with open_checkpoint(path) as ckpt:
        expert, dense = ckpt.tensor_f32(EXPERT), ckpt.tensor_f32(DENSE)
    calls = []

    def doubled(array):
        def make():
            calls.append(1)
            return array * np.float32(2)
        return make

    plain = CheckpointWeights(path, cache_bytes=0)
    replaced = CheckpointWeights(path, cache_bytes=0, replace={EXPERT: doubled(expert), DENSE: doubled(dense)})
    try:
        changed = {"blk.0.ffn_up_exps.weight", "blk.1.attn_q.weight"}
        for name, stored in plain.tensors.items():
            before = values(stored.qtype, plain.data(name))
            after = values(replaced.tensors[name].qtype, replaced.data(name))
            if name not in changed:
                assert replaced.tensors[name] == stored and np.array_equal(after, before), name
                continue
            assert (stored.qtype, replaced.tensors[name].qtype) == (GGMLType.BF16, GGMLType.F32), name
            if name == "blk.1.attn_q.weight":
                assert np.array_equal(after, dense * 2)
            else:
                assert np.array_equal(after[3], expert * 2)
                assert np.array_equal(np.delete(after, 3, axis=0), np.delete(before, 3, axis=0))
        assert len(calls) == 2
        replaced.data("blk.1.attn_q.weight")
        assert len(calls) == 3           # no cache: the replacement is asked again
    finally:
        plain.close()
        replaced.close()
    model = load_model(path, replace={EXPERT: lambda: expert, DENSE: lambda: dense})   # the same values again
    reference = load_model(path)
    try:
        assert np.array_equal(logits(model, IDS), logits(reference, IDS))
    finally:
        model.close()
        reference.close()


def test_replace_refuses_what_it_cannot_replace(tiny_checkpoints):
    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "fp8-block")
    with open_checkpoint(path) as ckpt:
        companion = ckpt.companions(DENSE)["scale_inv"]
        shape = ckpt.tensor_f32(DENSE).shape
    with pytest.raises(MissingSourceError, match="model.layers.0.mlp.experts.99.up_proj.weight"):
        CheckpointWeights(path, replace={"model.layers.0.mlp.experts.99.up_proj.weight": lambda: None})
    with pytest.raises(SourceError, match=f"{companion}.*feeds no GGUF tensor"):
        CheckpointWeights(path, replace={companion: lambda: None})
    for bad in (lambda: np.zeros(shape, np.float64), lambda: np.zeros((shape[0], shape[1] // 2), np.float32), lambda: [0.0]):
        w = CheckpointWeights(path, cache_bytes=0, replace={DENSE: bad})
        try:
            with pytest.raises(SourceError, match=f"{DENSE}.*replacement gave .*expected float32"):
                w.data("blk.1.attn_q.weight")
        finally:
            w.close()
    v4 = tiny_checkpoints.get("deepseek_v4", "per-expert", "bf16")
    with open_checkpoint(v4) as ckpt:
        integer = next(n for n, e in inspect_sources(ckpt)[1].items() if e == "int")
    with pytest.raises(SourceError, match=f"{integer}.*integer tensor"):
        CheckpointWeights(v4, replace={integer: lambda: None})
    gguf = example_model_dir().parent / "tiny-moe.imatrix.gguf"      # any GGUF file: refused before it is read
    with pytest.raises(UnsupportedError, match="needs a safetensors checkpoint"):
        open_weights(gguf, replace={DENSE: lambda: None})
    weights = open_weights(gguf, config={"model_type": "qwen3_moe"}, cache_bytes=0)     # ignored for a GGUF
    assert isinstance(weights, GGUFWeights)
    weights.close()


# -- the budget ---------------------------------------------------------------------------------------------------

def test_budget_default_bad_values_and_close(tiny_checkpoints):
    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "bf16")
    w = CheckpointWeights(path)
    try:
        assert 0 < w.cache.budget <= DEFAULT_CACHE_FRACTION * available_memory() * 1.5
        name = "blk.0.attn_q.weight"
        first = w.data(name)
        assert w.data(name) is first and w.cache.hits == 1            # kept
    finally:
        w.close()
    with pytest.raises(StateError, match="closed"):
        w.data(name)
    with pytest.raises(SourceError, match="cache_bytes must be >= 0"):
        CheckpointWeights(path, cache_bytes=-1)
    small = CheckpointWeights(path, cache_bytes=w.tensors[name].shape[0] * 2)       # smaller than any matrix
    try:
        assert small.data(name) is not small.data(name) and small.cache.bytes == 0
    finally:
        small.close()


# -- packed weights: finiteness and placement -----------------------------------------------------------------------

def test_finiteness_is_checked_once_per_payload_and_a_failure_every_time(tiny_checkpoints, monkeypatch):
    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "bf16")
    from quantkit.runtime import packed

    checks = []
    flag = packed.finite_flag
    monkeypatch.setattr(packed, "finite_flag", lambda x: checks.append(x.numel()) or flag(x))
    model = load_model(path, cache_bytes=0)
    try:
        want = logits(model, IDS)
        assert checks
        checks.clear()
        assert np.array_equal(logits(model, IDS), want)
        # payloads decoded finite once are not checked again; only the embedding rows looked up are (a few rows)
        assert checks == [len(set(IDS)) * model.module.config.hidden_size]
        routed = model.store._finite
        assert any(index is not None for _, index in routed) and ("blk.0.attn_q.weight", None) in routed
    finally:
        model.close()
    with open_checkpoint(path) as ckpt:
        dense = ckpt.tensor_f32(DENSE)
    dense[3, 5] = np.nan
    model = load_model(path, replace={DENSE: lambda: dense})
    try:
        for _ in range(2):      # raised on first use, and again on the next: a failed payload is never trusted
            with pytest.raises(FormatError, match="blk.1.attn_q.weight.*NaN or infinity"):
                logits(model, IDS)
    finally:
        model.close()


@pytest.mark.parametrize("rows,cols", [
    (np.arange(4) * 6, np.arange(6)),              # contiguous block
    (3 + np.arange(4) * 12, np.arange(6)),         # one half of each row (gate/up halves)
    (np.arange(3) * 2, np.arange(4) * 6),          # transposed
    (np.array([5]), np.arange(7)),                 # one row
    (np.arange(5) * 3, np.array([0])),             # one column
    (np.array([0, 6, 18, 12]), np.arange(6)),      # permuted rows: index scatter
    (np.arange(4)[::-1] * 6, np.arange(6)),        # reversed rows: index scatter
])
def test_strided_placement_equals_the_index_scatter(rows, cols):
    rows, cols = rows.astype(np.int64), cols.astype(np.int64)
    batch, size = 3, int((rows[:, None] + cols[None, :]).max()) + 1
    values = torch.arange(batch * rows.size * cols.size, dtype=torch.float32).reshape(batch, -1) + 1
    expected = torch.zeros(batch, size)
    expected[:, torch.from_numpy((rows[:, None] + cols[None, :]).reshape(-1))] = values
    strided = Strided.of(rows, cols)
    even = rows.size < 2 or (np.diff(rows) == rows[1] - rows[0]).all() and rows[1] > rows[0]
    assert (strided is not None) == bool(even)
    if strided is not None:
        out = torch.zeros(batch, size)
        strided.view(out, batch).copy_(values.reshape(strided.shape(batch)))
        assert torch.equal(out, expected)
