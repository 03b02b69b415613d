"""The runtime against its references, on the tiny model of every architecture.

* F32 GGUF -> quantkit runtime vs transformers on the source model: logits within 1e-4 x max|logit|, on a
  sequence long enough to engage every layer type (DeepSeek V4's 128-token compression included); and every
  model tensor rebuilt from the file equals the source tensor (bit for bit, or 1 ulp for the ``plus_one`` and
  ``neg_exp`` value steps).
* The safetensors checkpoint through the same loader gives the same logits.
* A quantized GGUF (Q4_K routed experts, Q8_0 other matrices) in the quantkit runtime vs llama.cpp
  (llama-cpp-python, F32 KV cache, every position's logits) on the same file and tokens: top-1 agreement >= 99%;
  the max logit difference is printed (``-s``) and kept in ``RESULTS``.
* Packed weights stay packed: routed experts are decoded one routed expert at a time, embeddings by the rows looked
  up; bad inputs (NaN payloads, unknown tokens, a config that does not describe the file) fail naming the culprit.

The GGUFs are written here from the arch maps, quantkit's encoders and GGUF writer (:func:`write_gguf`) with the
source ``config.json`` stored under ``quantkit.source.config``, until ``quantkit convert`` can be called instead.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.arch import get_arch
from quantkit.errors import FixtureError, FormatError, UnsupportedError
from quantkit.formats.api import decode, encode
from quantkit.formats.registry import GGMLType, get_format
from quantkit.io.checkpoint import open_checkpoint
from quantkit.io.gguf import KV
from quantkit.io.gguf_reader import GGUFFile
from quantkit.io.gguf_writer import GGUFWriter, TensorSpec, plan_layout
from quantkit.runtime import SOURCE_CONFIG_KEY, load_model, logits, logits_batch
from quantkit.runtime.loader import start_logits_batch
from quantkit.scoring.logprobs import device_log_normalizers, log_normalizers
from quantkit.runtime.packed import PackedTensor
from quantkit.testing.tiny_models import ARCHS, build_tiny_model
from gguf.constants import GGUFValueType
import llama_cpu

ARCH_NAMES = sorted(ARCHS)
#: The tiny BPEs hash to no pre-tokenizer llama.cpp knows; name one (as tests/test_arch.py does).
PRE_TOKENIZER = {"qwen3_moe": "qwen2", "deepseek_v3": "deepseek-v3", "deepseek_v4": "deepseek-v3",
                 "glm5_next": "glm4", "qwen4_exp": "qwen35"}
TEXT = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, item):\n"
        "        self.items.append(item)\n    def pop(self):\n        return self.items.pop()\n")
#: Past 128 tokens DeepSeek V4's heavily compressed layer emits its first compressed entry.
LONG_TOKENS = 160
#: qwen4_exp's QSA selects whole blocks in transformers but single tokens in llama.cpp once it engages
#: (INTEROP.md): compare on sequences it does not engage on.
LLAMA_TOKENS = {"qwen4_exp": 18}
LLAMA_DEFAULT_TOKENS = 96
TOP1_BAR = 0.99
RELATIVE_TOLERANCE = 1e-4
QUANTIZED_CLASSES = {"routed_gate": "Q4_K", "routed_up": "Q4_K", "routed_down": "Q4_K"}
Q8_CLASSES = frozenset({"token_embd", "output", "shared_expert", "dense_ffn", "attn_q", "attn_kv", "attn_output",
                        "compressor", "indexer", "kda_qk", "kda_v", "kda_output", "gdn_qkv", "gdn_gate",
                        "gdn_output", "ple"})
RESULTS: dict[str, dict] = {}


# -- GGUF files of the tiny checkpoints -------------------------------------------------------------------------------

def f32_types(tensor_class: str, shape: tuple[int, ...]) -> str:
    return "F32"


def mixed_types(tensor_class: str, shape: tuple[int, ...]) -> str:
    """Q4_K routed experts, Q8_0 other matrices, F32 for vectors and for rows no block fits."""
    if len(shape) < 2:
        return "F32"
    for name in (QUANTIZED_CLASSES.get(tensor_class), "Q8_0" if tensor_class in Q8_CLASSES else None):
        if name is not None and shape[-1] % get_format(name).block_size == 0:
            return name
    return "F32"


def _ints(values):
    return [int(v) for v in values]


def write_gguf(model_dir: Path, out: Path, arch: str, choose) -> Path:
    """The checkpoint at ``model_dir`` as a GGUF: tensors planned by the arch map, types from ``choose(class,
    shape)``, the map's metadata with the tokenizer, and the source config under ``quantkit.source.config``."""
    config = json.loads((model_dir / "config.json").read_text())
    amap = get_arch(arch).bind(config)
    with open_checkpoint(model_dir) as ckpt:
        def load(name):
            info = ckpt.tensor_info(name)
            return np.asarray(ckpt.raw(name)) if info.dtype.startswith(("I", "U")) else ckpt.tensor_f32(name)

        shapes = {n: tuple(ckpt.tensor_info(n).shape) for n in ckpt.tensor_names()}
        outputs = amap.outputs(shapes)
        arrays = {o.gguf_name: amap.assemble(o, load) for o in outputs}
        meta = amap.metadata(model_dir, pre_tokenizer=PRE_TOKENIZER[arch], tensor_values=load, tensor_shapes=shapes)
    meta = [(k, v) for k, v in meta if k != "general.file_type"]
    meta.append((SOURCE_CONFIG_KEY, KV((model_dir / "config.json").read_text(), GGUFValueType.STRING)))
    types = {o.gguf_name: ("I32" if arrays[o.gguf_name].dtype == np.int32 else choose(o.tensor_class, o.shape))
             for o in outputs}
    layout = plan_layout(meta, [TensorSpec(o.gguf_name, o.shape, types[o.gguf_name]) for o in outputs])
    with GGUFWriter(out, layout, overwrite=True) as writer:
        writer.write_header()
        for o in outputs:
            data = arrays[o.gguf_name]
            if types[o.gguf_name] not in ("F32", "I32"):
                data = encode(data.reshape(-1, data.shape[-1]), types[o.gguf_name], name=o.gguf_name)
            writer.write_tensor(o.gguf_name, np.ascontiguousarray(data))
        writer.finish()
    return out


@pytest.fixture(scope="module")
def ggufs(tiny_checkpoints, tmp_path_factory):
    """(arch, kind) -> GGUF path, each written once: ``f32`` and ``mixed`` (Q4_K experts, Q8_0 matrices)."""
    root = tmp_path_factory.mktemp("runtime-gguf")
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in made:
            source = tiny_checkpoints.get(arch, "per-expert", "f32")
            made[arch, kind] = write_gguf(source, root / f"{arch}-{kind}.gguf", arch,
                                          f32_types if kind == "f32" else mixed_types)
        return made[arch, kind]

    return get


def model_tensors(module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer the source's state_dict holds, packed ones included."""
    found = {}
    for prefix, sub in module.named_modules():
        for attr, tensor in [*sub._parameters.items(), *sub._buffers.items()]:
            persistent = attr in sub._parameters or attr not in sub._non_persistent_buffers_set \
                or isinstance(tensor, PackedTensor)
            if tensor is not None and persistent:
                found[f"{prefix}.{attr}" if prefix else attr] = tensor
    return found


def token_ids(arch: str, n: int) -> list[int]:
    _, tok = build_tiny_model(arch, dtype="f32")
    ids = tok(TEXT).input_ids
    return (ids * (n // len(ids) + 1))[:n]


def reference_logits(arch: str, ids: list[int]) -> np.ndarray:
    model, _ = build_tiny_model(arch, dtype="f32")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# -- parity with transformers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_f32_gguf_logits_match_transformers(ggufs, arch):
    ids = token_ids(arch, LONG_TOKENS)
    expected = reference_logits(arch, ids)
    model = load_model(ggufs(arch, "f32"))
    got = logits(model, ids)
    diff = float(np.abs(got - expected).max())
    RESULTS.setdefault(arch, {})["f32_vs_transformers"] = (diff, float(np.abs(expected).max()))
    print(f"\n{arch}: F32 GGUF vs transformers over {len(ids)} tokens: max |diff| {diff:.3g}, "
          f"max |logit| {np.abs(expected).max():.3g}")
    assert diff <= RELATIVE_TOLERANCE * float(np.abs(expected).max())


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_every_model_tensor_is_rebuilt_from_the_f32_gguf(ggufs, arch):
    source, _ = build_tiny_model(arch, dtype="f32")
    model = load_model(ggufs(arch, "f32"))
    want = source.state_dict()
    rebuilt, packed = model_tensors(model.module), 0
    assert set(rebuilt) == set(want)
    for name, tensor in rebuilt.items():
        if tensor.is_meta:
            assert ".visual." in name       # the only part a text GGUF does not carry
            continue
        packed += isinstance(tensor, PackedTensor)
        value = tensor.materialize() if isinstance(tensor, PackedTensor) else tensor
        ref = want[name]
        assert value.shape == ref.shape and value.dtype == ref.dtype, name
        if not torch.equal(value, ref):
            # value steps are undone with one rounding each: g - 1 (plus_one), log(-A) (neg_exp)
            assert value.dtype == torch.float32, name
            step = (value - ref).abs() / torch.finfo(torch.float32).eps
            assert float((step / ref.abs().clamp(min=1.0)).max()) <= 1.0, name
    assert packed >= 10


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_safetensors_source_runs_through_the_same_loader(tiny_checkpoints, arch):
    ids = token_ids(arch, 48)
    expected = reference_logits(arch, ids)
    got = logits(load_model(tiny_checkpoints.get(arch, "per-expert", "f32")), ids)
    assert np.abs(got - expected).max() <= RELATIVE_TOLERANCE * np.abs(expected).max()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sequences_in_one_pass_give_their_own_logits(ggufs, arch):
    """Three sequences of different lengths in one forward pass (right-padded): each gets the logits it gets
    alone, within the runtime's tolerance (only the products' shapes differ), on packed weights."""
    model = load_model(ggufs(arch, "mixed"))
    ids = token_ids(arch, 60)
    sequences = [ids[:23], ids[5:65], ids[30:41]]
    together = logits_batch(model, sequences)
    later = logits_batch(model, sequences, first=7)     # positions 7.. only: the head multiplies those rows
    for seq, got, tail in zip(sequences, together, later):
        alone = logits(model, seq)
        assert got.shape == alone.shape and tail.shape == (len(seq) - 7, alone.shape[1])
        assert model.output_width == alone.shape[1]        # scoring's vocabulary width, read off the packed head
        assert np.abs(got - alone).max() <= RELATIVE_TOLERANCE * np.abs(alone).max()
        assert np.abs(tail - alone[7:]).max() <= RELATIVE_TOLERANCE * np.abs(alone).max()
    with pytest.raises(FixtureError, match="shortest sequence has 11 tokens"):
        logits_batch(model, sequences, first=11)
    # scoring's normalizers computed where the logits are: each sequence's rows, padding and positions < 7 left out
    pending = start_logits_batch(model, sequences, first=7, row_stats=device_log_normalizers)
    for rows, tail, (logsum, greedy) in zip(pending.result(), later, pending.result_stats()):
        ref_logsum, ref_greedy = log_normalizers(rows)
        assert np.array_equal(rows, tail) and np.array_equal(greedy, ref_greedy)
        assert np.abs(logsum - ref_logsum).max() <= 1e-13 * np.abs(ref_logsum).max()


def test_qwen3moe_config_is_rebuilt_from_gguf_hyperparameters(ggufs, tmp_path):
    """Without quantkit.source.config the qwen3moe config comes from the GGUF keys and runs the same."""
    src = ggufs("qwen3_moe", "f32")
    with GGUFFile(src) as f:
        meta = [(k, v) for k, v in f.metadata.items() if k != SOURCE_CONFIG_KEY and not k.startswith("GGUF.")]
        layout = plan_layout(meta, list(f.tensors.values()))
        out = tmp_path / "no-config.gguf"
        with GGUFWriter(out, layout) as writer:
            writer.write_header()
            for name in f.tensors:
                writer.write_tensor(name, np.ascontiguousarray(f.data(name)))
            writer.finish()
    ids = token_ids("qwen3_moe", 40)
    assert np.array_equal(logits(load_model(out), ids), logits(load_model(src), ids))


# -- packed weights -------------------------------------------------------------------------------------------------

def test_weights_stay_packed_and_experts_decode_one_at_a_time(ggufs, monkeypatch):
    model = load_model(ggufs("deepseek_v3", "mixed"))
    dense = sum(t.numel() * t.element_size() for t in model.module.state_dict(keep_vars=True).values()
                if not isinstance(t, PackedTensor) and not t.is_meta)
    payload = Path(model.path).stat().st_size
    assert dense < 0.05 * payload          # only vectors and small tables were decoded at load
    calls = []
    decode = model.store.decode
    monkeypatch.setattr(model.store, "decode",
                        lambda name, index=None, rows=None: calls.append((name, index, rows)) or decode(name, index,
                                                                                                        rows))
    ids = token_ids("deepseek_v3", 8)
    logits(model, ids)
    experts = [c for c in calls if "_exps" in c[0]]
    assert experts and all(index is not None for _, index, _ in experts)
    routed = {index for name, index, _ in experts if name == "blk.1.ffn_gate_exps.weight"}
    assert len(routed) <= len(ids) * model.module.config.num_experts_per_tok
    embedding = [c for c in calls if c[0] == "token_embd.weight"]
    assert len(embedding) == 1 and embedding[0][2] is not None and len(embedding[0][2]) == len(set(ids))


def test_nan_payload_raises_naming_the_tensor(ggufs, tmp_path):
    src = ggufs("qwen3_moe", "mixed")
    bad = tmp_path / "nan.gguf"
    shutil.copy(src, bad)
    with GGUFFile(src) as f:
        t = f.tensor("blk.0.attn_q.weight")
        assert t.type == GGMLType.Q8_0
        offset = f.data_offset + t.offset
    with open(bad, "r+b") as fh:        # the first block's f16 scale becomes NaN
        fh.seek(offset)
        fh.write(np.array([0x7E00], np.uint16).tobytes())
    model = load_model(bad)
    with pytest.raises(FormatError, match="blk.0.attn_q.weight"):
        logits(model, token_ids("qwen3_moe", 4))


def test_bad_requests_are_refused(ggufs):
    model = load_model(ggufs("qwen3_moe", "f32"))
    with pytest.raises(FixtureError, match="position 1"):
        logits(model, [1, model.vocab_size + 3])
    config = json.loads(GGUFFile(ggufs("qwen3_moe", "f32")).metadata[SOURCE_CONFIG_KEY].value)
    with pytest.raises(FormatError, match="expert_used_count"):
        load_model(ggufs("qwen3_moe", "f32"), config={**config, "num_experts_per_tok": 3})
    with pytest.raises(UnsupportedError, match="model_type"):
        load_model(ggufs("qwen3_moe", "f32"), config={**config, "model_type": "llama"})


# -- parity with llama.cpp -----------------------------------------------------------------------------------------

def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    with llama_cpu.placement(llama_cpp):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(256, len(ids)), n_batch=512, n_ubatch=512,
                              logits_all=True, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                              n_gpu_layers=0, n_threads=2, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


def dequantized_copy(src: Path, out: Path) -> Path:
    """``src`` with every tensor decoded to F32 (integer tables kept): the same weights, no quantized arithmetic."""
    with GGUFFile(src) as f:
        meta = [(k, v) for k, v in f.metadata.items() if not k.startswith("GGUF.")]
        kept = {GGMLType.F32, GGMLType.I32}
        specs = [TensorSpec(t.name, t.shape, t.type if t.type in kept else GGMLType.F32) for t in f.tensors.values()]
        with GGUFWriter(out, plan_layout(meta, specs), overwrite=True) as writer:
            writer.write_header()
            for t in f.tensors.values():
                data = np.ascontiguousarray(f.data(t.name))
                writer.write_tensor(t.name, data if t.type in kept else decode(data, t.type, t.shape))
            writer.finish()
    return out


def _top1_margin(x: np.ndarray) -> np.ndarray:
    top2 = np.sort(x, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


@pytest.mark.interop
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_quantized_gguf_matches_llama_cpp(ggufs, arch):
    """quantkit on a Q4_K/Q8_0 GGUF computes the model llama.cpp computes on the same weights decoded to F32 (top-1
    on every position, logits within 1e-4 x max); against llama.cpp running the quantized file itself, whose CPU
    kernels round the activations to Q8_K/Q8_0 before each quantized dot product, every top-1 difference sits at
    a position where that rounding alone (llama.cpp quantized vs llama.cpp dequantized) moves the logits by more
    than half the top-1 margin.  Agreement and the largest difference are printed for the report."""
    path = ggufs(arch, "mixed")
    ids = token_ids(arch, LLAMA_TOKENS.get(arch, LLAMA_DEFAULT_TOKENS))
    ours = logits(load_model(path), ids)
    theirs = llama_cpp_logits(path, ids)
    same_weights = llama_cpp_logits(dequantized_copy(path, path.with_suffix(".f32.gguf")), ids)
    scale = float(np.abs(same_weights).max())
    exact_diff = float(np.abs(ours - same_weights).max())
    assert (ours.argmax(-1) == same_weights.argmax(-1)).all()
    assert exact_diff <= RELATIVE_TOLERANCE * scale

    agree = ours.argmax(-1) == theirs.argmax(-1)
    rounding = np.abs(theirs - same_weights).max(-1)
    diff = float(np.abs(ours - theirs).max())
    RESULTS.setdefault(arch, {})["quantized_vs_llama_cpp"] = (float(agree.mean()), diff, exact_diff, scale, len(ids))
    print(f"\n{arch}: Q4_K/Q8_0 GGUF over {len(ids)} tokens: vs llama.cpp on the same weights in F32: max |diff| "
          f"{exact_diff:.3g}; vs llama.cpp on the quantized file: top-1 agreement {agree.mean():.4f}, max |diff| "
          f"{diff:.3g} (max |logit| {scale:.3g})")
    unexplained = [int(p) for p in np.nonzero(~agree)[0] if rounding[p] <= _top1_margin(same_weights)[p] / 2]
    assert unexplained == []


@pytest.mark.parametrize("arch", ["qwen4_exp", "glm5_next"])
def test_a_dropped_model_frees_its_weights_without_the_garbage_collector(ggufs, arch):
    """The runtime's replacements of transformers methods (indexers here) hold their modules weakly: dropping the
    model frees its weight store at once (a cycle would keep it, on the device too, until a collection)."""
    import gc
    import weakref

    from quantkit.runtime import load_model, logits

    model = load_model(ggufs(arch, "mixed"))
    logits(model, token_ids(arch, 16))
    store = weakref.ref(model.store)
    gc.collect()
    gc.disable()
    try:
        model.close()
        del model
        assert store() is None
    finally:
        gc.enable()


def test_replaced_methods_call_ours_with_the_module_and_theirs():
    from quantkit.runtime.attention import replace_method

    layer = torch.nn.Linear(3, 2)
    replace_method(layer, "forward", lambda module, theirs, x: (module, theirs(x) * 2))
    x = torch.randn(4, 3)
    module, doubled = layer(x)
    assert module is layer and torch.equal(doubled, 2 * torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_v4_hyper_connection_wiring_keeps_cpu_logits_bit_for_bit(ggufs, monkeypatch):
    """quantkit.runtime.hyper's DeepSeek V4 decoder layer (installed on CUDA models) is transformers' layer with
    its two stream mixes swapped for ``hyper.mix``: on the CPU, where the kernels do not apply and every piece
    falls back to transformers' operations, the logits are the same bits."""
    from quantkit.runtime import hyper, load_model, logits

    model = load_model(ggufs("deepseek_v4", "mixed"))
    ids = token_ids("deepseek_v4", 32)
    want = logits(model, ids)
    hyper.install(model.module)
    mixes = []
    original = hyper.mix
    monkeypatch.setattr(hyper, "mix", lambda *a: mixes.append(1) or original(*a))
    got = logits(model, ids)
    layers = sum(type(m).__name__ in hyper.MIXING_LAYERS for m in model.module.modules())
    assert layers and len(mixes) == 2 * layers
    assert np.array_equal(got, want)
