"""A checkpoint as runtime weights, assembled on demand: the same values as assembling every tensor at open (every
tiny architecture, layout and source encoding), the GGUF type chosen from the headers, the cache within its budget
through a whole forward pass, and the ``replace`` hook."""
from __future__ import annotations

from contextlib import closing

import ml_dtypes
import numpy as np
import pytest

from quantkit.arch import get_arch
from quantkit.convert.plan import inspect_sources
from quantkit.errors import MissingSourceError, SourceError, StateError, UnsupportedError
from quantkit.formats.registry import GGMLType
from quantkit.io.checkpoint import open_checkpoint
from quantkit.runtime import load_model, logits
from quantkit.runtime.inverse import VALUE_INVERSES
from quantkit.examples import example_model_dir
from quantkit.runtime.weights import (DEFAULT_CACHE_FRACTION, CheckpointWeights, GGUFWeights, available_memory,
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
    finally:
        weights.close()


def test_cache_stays_within_its_budget_through_a_forward_pass(tiny_checkpoints, monkeypatch):
    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "bf16")
    with closing(CheckpointWeights(path, cache_bytes=0)) as w:
        sizes = {name: w.data(name).nbytes for name in w.tensors}
    largest = max(sizes.values())
    budget = 3 * largest        # one layer's three stacked expert tensors: the next layer must evict them
    assert budget < sum(sizes.values()) // 2
    observed = []
    original = CheckpointWeights.data

    def data(self, name):
        payload = original(self, name)
        observed.append(sum(p.nbytes for p in self.cache._entries.values()))     # counted here, not by the cache
        return payload

    monkeypatch.setattr(CheckpointWeights, "data", data)
    reference = load_model(path, cache_bytes=None)
    bounded = load_model(path, cache_bytes=budget)
    try:
        want = logits(reference, IDS)
        assert reference.store.weights.cache.peak_bytes == sum(sizes.values())   # unlimited: everything, once
        observed.clear()
        for _ in range(2):
            assert np.array_equal(logits(bounded, IDS), want)
        cache = bounded.store.weights.cache
        assert observed and max(observed) <= budget and max(observed) == cache.peak_bytes
        assert cache.bytes <= budget
        assert cache.hits > 0 and cache.misses > len(sizes)        # reuse within a layer, evicted across layers
    finally:
        reference.close()
        bounded.close()


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
