"""Collecting an imatrix with transformers: agreement with llama.cpp's llama-imatrix on the same F32 model and text
(committed reference files, see tests/data/imatrix/README.md), every architecture's statistics checked against
module hooks and the GGUF shapes, --all-experts, the runtime's packed model (the one the command runs, streamed
from the checkpoint under a memory budget) giving transformers' statistics bit for bit, the command with resume
and bad input, and what it is for: IQ2_XXS with the collected importance beats the weight-energy bootstrap on
imatrix-weighted error."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import quantkit
from quantkit.arch import get_arch
from quantkit.cli import main
from quantkit.examples import example_model_dir
from quantkit.errors import ValidationError
from quantkit.formats.registry import GGMLType
from quantkit.imatrix import Entry, bootstrap_importance, load_imatrix, make_imatrix, save_imatrix
from quantkit.imatrix import collect as collect_module
from quantkit.imatrix.collect import (RESUME_SUFFIX, CollectOptions, Collector, calibration_chunks, chunk_tokens,
                                      collect_imatrix)
from quantkit.imatrix.names import expected_entries, gguf_input_groups
from quantkit.io.gguf_reader import GGUFFile
from quantkit.runtime import load_model
from quantkit.runtime.weights import CheckpointWeights
from quantkit.testing.tiny_models import build_tiny_model, get_arch as tiny_arch
from quantkit.testing.recipe_texts import F32_RECIPE

DATA = Path(__file__).parent / "data" / "imatrix"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
CTX = MANIFEST["ctx"]
#: Relative difference allowed between our Σx² (float64 sums of a float32 forward) and llama-imatrix's (float32
#: sums of ggml's float32 forward); measured worst case 5.5e-6.
REL_TOL = 2e-5
#: The script that made the references (its weights_sha256 ties them to the tiny model).
_spec = importlib.util.spec_from_file_location("make_references", DATA / "make_references.py")
make_references = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_references)
#: GGUF tensor classes that are not matrix products (no importance is collected for them).
NOT_PRODUCTS = frozenset({"norm", "conv", "ape", "ngram_table", "hash_routing", "ssm_param", "sinks", "bias",
                          "metadata", "mtp", "vision", "token_embd", "output", "quant_aux"})


def tiny(arch: str):
    """The float32 tiny model, its tokenizer and its architecture map."""
    model, tokenizer = build_tiny_model(arch, dtype="f32")
    spec = tiny_arch(arch)
    config = model.config.to_dict()
    (config["text_config"] if spec.nested else config).update(spec.converter_keys(model.config))
    return model, tokenizer, get_arch(arch).bind(config)


def collect(model, amap, chunks, **options):
    collector = Collector(model, amap, **options)
    try:
        for chunk in chunks:
            collector.run_chunks(torch.tensor([chunk]))
    finally:
        collector.close()
    return make_imatrix(collector.acc.entries(), chunk_count=len(chunks), chunk_size=len(chunks[0]))


def relative_difference(ours: np.ndarray, ref: np.ndarray) -> float:
    both_zero = (ours == 0) & (ref == 0)
    rel = np.abs(ours.astype(np.float64) - ref) / np.where(both_zero, 1, np.abs(ref.astype(np.float64)))
    return float(rel.max())


# -- agreement with llama-imatrix ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_agrees_with_llama_imatrix(arch):
    model, tokenizer, amap = tiny(arch)
    record = MANIFEST["archs"][arch]
    assert make_references.weights_sha256(model) == record["weights_sha256"], \
        "the tiny model changed since the references were made: run tests/data/imatrix/make_references.py"
    tokens = record["tokens"]["a"]
    text = (DATA / "calibration-a.txt").read_text().removesuffix("\n")
    assert sum(calibration_chunks(tokenizer, text, CTX, MANIFEST["chunks"]["a"]), []) == tokens
    ours = collect(model, amap, chunk_tokens(tokens, CTX, None, None))
    ref = load_imatrix(DATA / f"{arch}-a.imatrix.gguf")
    assert sorted(ours.entries) == sorted(ref.entries)
    ref = ref.conform({n: (e.n_per_row, e.n_mat) for n, e in ours.entries.items()})
    worst = {}
    for name, e in ref.entries.items():
        assert np.array_equal(ours.entries[name].counts, e.counts), name
        worst[name] = relative_difference(ours.entries[name].in_sum2, e.in_sum2)
    assert max(worst.values()) < REL_TOL, worst
    assert str(ours.coverage()) == str(ref.coverage())


# -- every architecture, checked against module hooks -----------------------------------------------------------------

class HookSums:
    """Σx² of every nn.Linear input and of every routed expert's input, from forward pre-hooks (independent of the
    collector's attribution by storage)."""

    def __init__(self, model):
        self.linear: dict[str, tuple[torch.Tensor, int]] = {}
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.handles.append(module.register_forward_pre_hook(self._linear(name + ".weight")))
            elif hasattr(module, "gate_up_proj") and hasattr(module, "num_experts"):
                self.handles.append(module.register_forward_pre_hook(self._experts(name, module.num_experts)))

    def _linear(self, name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums, rows = self.linear.get(name, (0, 0))
            self.linear[name] = (sums + x.square().sum(0), rows + x.shape[0])
        return hook

    def _experts(self, name, n_experts):
        def hook(module, args):
            hidden, top_k_index = args[0].detach().double(), args[1]
            sums = torch.stack([hidden[(top_k_index == e).any(-1)].square().sum(0) for e in range(n_experts)])
            counts = torch.stack([(top_k_index == e).any(-1).sum() for e in range(n_experts)]).double()
            old = self.experts.get(name, (0, 0))
            self.experts[name] = (old[0] + sums, old[1] + counts)
        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_every_architecture(arch):
    model, _, amap = tiny(arch)
    tokens = 96
    chunk = torch.randint(0, 500, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    hooks = HookSums(model)
    try:
        imx = collect(model, amap, [chunk])
    finally:
        hooks.remove()
    outputs = amap.outputs({n: tuple(p.shape) for n, p in model.state_dict().items()})
    expected = expected_entries({o.gguf_name: o.shape for o in outputs})
    required = {o.gguf_name for o in outputs if o.gguf_name in expected and o.tensor_class not in NOT_PRODUCTS}
    imx.check_against(expected, required=required)     # every product has an entry with the GGUF tensor's shape
    checked = 0
    for hf_name, (sums, rows) in hooks.linear.items():
        for m in [m for m in amap.resolve(hf_name) if m.gguf_name in imx.entries and not m.transform]:
            e = imx.entries[m.gguf_name]
            assert e.counts.tolist() == [rows] and rows >= tokens, m.gguf_name
            assert np.allclose(e.in_sum2[0], sums.numpy().astype(np.float32), rtol=1e-6, atol=0), m.gguf_name
            checked += 1
    for module_name, (sums, counts) in hooks.experts.items():
        for m in amap.resolve(module_name + ".gate_up_proj"):
            e = imx.entries[m.gguf_name]
            assert np.array_equal(e.counts, counts.numpy().astype(np.float32)), m.gguf_name
            assert np.allclose(e.in_sum2, sums.numpy().astype(np.float32), rtol=1e-6, atol=0), m.gguf_name
            checked += 1
    assert checked >= 6
    top_k = amap.hp["num_experts_per_tok"]
    for name, e in imx.entries.items():
        if name.endswith("_exps.weight"):
            assert e.counts.sum() == tokens * top_k, name      # each token reaches top_k experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_chunks_in_one_pass_are_separate_sequences(arch):
    """Three chunks in one forward pass (a batch of sequences) give the statistics of three passes of one chunk:
    no chunk attends to another (attention, MLA's absorbed parts, recurrent and compressed state alike)."""
    model, _, amap = tiny(arch)
    generator = torch.Generator().manual_seed(3)
    chunks = [torch.randint(0, 500, (48,), generator=generator).tolist() for _ in range(3)]
    separate = collect(model, amap, chunks)
    collector = Collector(model, amap)
    try:
        collector.run_chunks(torch.tensor(chunks))
    finally:
        collector.close()
    together = collector.acc.entries()
    assert sorted(together) == sorted(separate.entries)
    for name, e in separate.entries.items():
        assert np.array_equal(together[name].counts, e.counts), name
        # float32 rounding of products of another shape (measured up to 2e-5 on values near zero); a chunk that
        # saw another would differ by far more
        assert np.allclose(together[name].in_sum2, e.in_sum2, rtol=1e-4, atol=1e-6 * e.in_sum2.max()), name


def test_all_experts_keeps_the_output_and_observes_every_expert():
    model, _, amap = tiny("deepseek_v3")        # group-limited routing leaves experts unobserved on short text
    chunk = torch.randint(0, 500, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    routed = collect(model, amap, [chunk])
    assert routed.coverage().observed < routed.coverage().total
    logits = {}
    for all_experts in (False, True):
        collector = Collector(model, amap, all_experts=all_experts)
        try:
            with torch.no_grad(), collector.recorder.active():
                logits[all_experts] = model(input_ids=torch.tensor([chunk])).logits
        finally:
            collector.close()
    plain, every = logits[False], logits[True]
    assert torch.equal(plain, every)
    imx = make_imatrix(collector.acc.entries())
    assert str(imx.coverage()) == "observed 8 of 8 experts (100.00%)"
    up, router = imx.entries["blk.1.ffn_up_exps.weight"], imx.entries["blk.1.ffn_gate_inp.weight"]
    assert up.counts.tolist() == [64] * 8
    assert np.array_equal(up.in_sum2, np.repeat(router.in_sum2, 8, axis=0))   # every expert saw every token
    for name in routed.entries:    # non-expert statistics are those of the normal routing
        if "_exps" not in name:
            assert np.array_equal(imx.entries[name].in_sum2, routed.entries[name].in_sum2), name


# -- a grouped weight: llama-imatrix's per-group entry folded ---------------------------------------------------------

def per_group_sums(model, groups: int):
    """Forward pre-hooks on DeepSeek V4's ``o_a_proj``: Σx² of each group's input slice (float64) and the token
    count, as llama-imatrix accumulates them for ``attn_output_a`` (``values[g * n + j]``, one count per token)."""
    sums: dict[str, tuple[torch.Tensor, int]] = {}

    def hook(name):
        def record(module, args):
            x = args[0].detach().double()
            x = x.reshape(-1, groups, x.shape[-1])        # [tokens, groups, n], as llama.cpp's wo_a input
            old, rows = sums.get(name, (0, 0))
            sums[name] = (old + x.square().sum(0), rows + x.shape[0])
        return record

    handles = [m.register_forward_pre_hook(hook(n + ".weight")) for n, m in model.named_modules()
               if n.endswith("self_attn.o_a_proj")]
    return sums, handles


def ulps_apart(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in float32 units in the last place between two arrays of non-negative floats."""
    return int(np.abs(a.astype(np.float32).view(np.int32).astype(np.int64)
                      - b.astype(np.float32).view(np.int32).astype(np.int64)).max())


def test_llama_imatrix_per_group_entry_folds_to_the_collected_one(tiny_checkpoints, tmp_path):
    """llama-imatrix multiplies ``attn_output_a`` as ``o_groups`` matrices (llama.cpp loads ``wo_a`` 3-D) and stores
    ``[1, o_groups * n]`` sums with one count of tokens; quantkit collects the sum over groups with ``o_groups``
    times the count.  Statistics in llama-imatrix's layout, from hooks on transformers' forward, are refused as
    they were before the arch declares the groups, and folded by ``conform`` they equal quantkit's own entry to one
    float32 ulp: llama-imatrix rounds each group's sum to float32 before the fold adds them, the collector rounds
    the total once (the counts are equal exactly; that ulp, like llama-imatrix's float32 accumulation, keeps the
    two files' IQ4_NL bytes apart).  convert with the per-group file writes the bytes of a convert with its fold
    saved in quantkit's form; validate and ``imatrix info --model`` accept it; a length that fits neither form is
    still refused as another model's."""
    model, _, amap = tiny("deepseek_v4")
    groups = amap.hp["o_groups"]
    chunk = torch.randint(0, 500, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    sums, handles = per_group_sums(model, groups)
    try:
        ours = collect(model, amap, [chunk])
    finally:
        for handle in handles:
            handle.remove()
    outputs = amap.outputs({n: tuple(p.shape) for n, p in model.state_dict().items()})
    expected = expected_entries({o.gguf_name: o.shape for o in outputs})
    grouped = amap.input_group_counts(expected)
    assert grouped == {f"blk.{i}.attn_output_a.weight": groups for i in range(3)} and groups > 1

    llama_form = dict(ours.entries)
    for hf_name, (group_sums, rows) in sums.items():
        (m,) = amap.resolve(hf_name)
        n = expected[m.gguf_name][0]
        assert tuple(group_sums.shape) == (groups, n)
        llama_form[m.gguf_name] = Entry(group_sums.numpy().astype(np.float32).reshape(1, groups * n),
                                        np.array([rows], np.float32))
    llama_path = tmp_path / "llama-imatrix.gguf"
    save_imatrix(make_imatrix(llama_form, datasets=["chunk"]), llama_path)
    with GGUFFile(llama_path) as f:                # llama-imatrix's tensors: ggml [groups * n, 1] and [1, 1]
        assert f.tensors["blk.0.attn_output_a.weight.in_sum2"].shape == (1, groups * n)
        assert f.tensors["blk.0.attn_output_a.weight.counts"].shape == (1, 1)

    llama = load_imatrix(llama_path)
    with pytest.raises(ValidationError, match="another model"):
        llama.conform(expected, required=())       # what every command did before the groups were declared
    folded = llama.conform(expected, required=(), groups=grouped)
    for name, e in ours.entries.items():
        got = folded.entries[name]
        assert np.array_equal(got.counts, e.counts), name
        if name in grouped:
            assert e.counts.tolist() == [groups * len(chunk)]
            assert got.in_sum2.shape == e.in_sum2.shape and ulps_apart(got.in_sum2, e.in_sum2) <= 1, name
            # in_sum2 one ulp (2^-23 relative) apart, and each quotient rounded once more: 2^-22 relative
            np.testing.assert_allclose(folded.importance(name), ours.importance(name), rtol=2**-22, atol=0)
        else:
            assert np.array_equal(got.in_sum2, e.in_sum2), name

    # one group more than the model has: another model's imatrix, named as such
    wrong = dict(ours.entries)
    name = "blk.1.attn_output_a.weight"
    n = expected[name][0]
    wrong[name] = Entry(np.ones((1, (groups + 1) * n), np.float32), np.ones(1, np.float32))
    with pytest.raises(ValidationError, match=rf"needs 1 x {n} \(matrices x row length, or {groups} x {n} with its "
                                              rf"{groups} input groups side by side.*another model"):
        make_imatrix(wrong).conform(expected, required=(), groups=grouped)

    # every command that reads an imatrix for a model folds it the same way
    src = tiny_checkpoints.get("deepseek_v4", "per-expert", "f32")
    recipe = tmp_path / "r.toml"
    recipe.write_text(GROUPED_RECIPE)
    runner = CliRunner()
    outs = {}
    folded_path = tmp_path / "folded.imatrix.gguf"
    save_imatrix(replace(folded, path=None), folded_path)
    for label, path in (("llama", llama_path), ("folded", folded_path)):
        outs[label] = tmp_path / f"out-{label}.gguf"
        result = runner.invoke(main, ["convert", str(src), "-o", str(outs[label]), "--recipe", str(recipe),
                                      "--imatrix", str(path), "--pre-tokenizer", "deepseek-v3", "--no-progress"])
        assert result.exit_code == 0, result.output
    payloads = {label: tensor_payloads(out) for label, out in outs.items()}
    assert payloads["llama"] == payloads["folded"]
    with GGUFFile(outs["llama"]) as f:
        assert f.tensors["blk.0.attn_output_a.weight"].type == GGMLType.IQ4_NL
    result = runner.invoke(main, ["validate", str(outs["llama"]), "--source", str(src), "--imatrix", str(llama_path),
                                  "--payload", "full"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["imatrix", "info", str(llama_path), "--model", str(outs["llama"])])
    assert result.exit_code == 0 and "matches" in result.output, result.output
    save_imatrix(make_imatrix(wrong, datasets=["chunk"]), tmp_path / "wrong.gguf")
    result = runner.invoke(main, ["imatrix", "info", str(tmp_path / "wrong.gguf"), "--model", str(outs["llama"])])
    assert result.exit_code != 0 and name in result.output and "another model" in result.output, result.output


#: llama-imatrix's collection rule (tools/imatrix/imatrix.cpp, its MUL_MAT path) as an eval callback on llama.cpp's
#: own graph, for attn_output_a: ``values[mat * ne0 + j] += x[j]²`` in float32 with ``mat = i2 % src0.ne[2]``, and
#: ``count += nrows(src1) / n_mat``.  Runs in a child process: a ggml abort must not end the test session.
LLAMA_GROUPED_COLLECTOR = """
import ctypes, pathlib, sys
import numpy as np
import llama_cpp

path, out, tokens = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]


class Tensor(ctypes.Structure):   # struct ggml_tensor (ggml.h)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


ggml = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
ggml.ggml_op_name.restype, ggml.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
stats = {}


def collect(t_ptr, ask, user_data):
    t = Tensor.from_address(t_ptr)
    if ggml.ggml_op_name(t.op) != b"MUL_MAT" or not t.src[1]:
        return not ask
    src0, src1 = Tensor.from_address(t.src[0]), Tensor.from_address(t.src[1])
    name = src0.name.decode()
    if not name.endswith("attn_output_a.weight"):
        return not ask
    if ask:
        return src1.ne[1] >= 16 and src1.type == 0
    n_mat, ne0 = src0.ne[2] * src0.ne[3], src1.ne[0]
    end = sum((src1.ne[d] - 1) * src1.nb[d] for d in (1, 2, 3)) + ne0 * 4
    x = np.lib.stride_tricks.as_strided(np.frombuffer((ctypes.c_char * end).from_address(src1.data), np.float32),
                                        shape=tuple(src1.ne[::-1]), strides=tuple(src1.nb[::-1]))
    values, count, _ = stats.get(name, (np.zeros(ne0 * n_mat, np.float32), 0, None))
    for i3 in range(src1.ne[3]):
        for i2 in range(src1.ne[2]):
            mat = (i3 % src0.ne[3]) * src0.ne[2] + (i2 % src0.ne[2])
            for row in x[i3, i2]:
                values[mat * ne0:(mat + 1) * ne0] += row * row
    stats[name] = (values, count + src1.ne[1] * src1.ne[2] * src1.ne[3] // n_mat, list(src0.ne))
    return True


callback = llama_cpp.ggml_backend_sched_eval_callback(collect)
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
params = llama_cpp.llama_context_default_params()
params.n_ctx = params.n_batch = params.n_ubatch = max(64, len(tokens))
params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
params.n_threads = params.n_threads_batch = 2
params.cb_eval = callback
ctx = llama_cpp.llama_init_from_model(model, params)
ids = (llama_cpp.llama_token * len(tokens))(*tokens)
if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, len(tokens))) != 0:
    sys.exit("llama_decode failed")
arrays = {}
for name, (values, count, src0_ne) in stats.items():
    arrays[name] = values
    arrays[name + ".count"] = np.array(count)
    arrays[name + ".src0_ne"] = np.array(src0_ne)
np.savez(out, **arrays)
"""


def test_llama_cpp_multiplies_attn_output_a_per_group_and_the_fold_agrees_with_collection(tiny_checkpoints,
                                                                                         tmp_path):
    """On llama.cpp's own graph (quantkit's F32 GGUF of the tiny DeepSeek V4, F32 KV cache), ``attn_output_a`` is a
    MUL_MAT of a 3-D ``[n, o_lora_rank, o_groups]`` weight, so llama-imatrix's rule stores ``o_groups * n`` values
    with one count per token: the refused form.  That entry, written in llama-imatrix's layout and folded with the
    group count from the GGUF's own metadata, agrees with quantkit's collection on transformers for the same
    tokens within the tolerance of :func:`test_agrees_with_llama_imatrix` (float32 forward and float32 sums)."""
    src = tiny_checkpoints.get("deepseek_v4", "per-expert", "f32")
    recipe = tmp_path / "f32.toml"
    recipe.write_text(F32_RECIPE)
    gguf_path = tmp_path / "v4-f32.gguf"
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(gguf_path), "--recipe", str(recipe),
                                       "--pre-tokenizer", "deepseek-v3", "--no-progress"])
    assert result.exit_code == 0, result.output
    chunk = torch.randint(0, 500, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    stats_path = tmp_path / "groups.npz"
    run = subprocess.run([sys.executable, "-c", LLAMA_GROUPED_COLLECTOR, str(gguf_path), str(stats_path),
                          ",".join(map(str, chunk))], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    stats = np.load(stats_path)

    model, _, amap = tiny("deepseek_v4")
    ours = collect(model, amap, [chunk])
    groups, rank = amap.hp["o_groups"], amap.hp["o_lora_rank"]
    with GGUFFile(gguf_path) as f:
        shapes = {name: t.shape for name, t in f.tensors.items()}
        grouped = gguf_input_groups(f.metadata, shapes, gguf_path)
    assert grouped == {f"blk.{i}.attn_output_a.weight": groups for i in range(3)}
    entries = {}
    for name in grouped:
        n = shapes[name][-1]
        assert stats[name + ".src0_ne"].tolist() == [n, rank, groups, 1], name
        assert stats[name].shape == (groups * n,) and int(stats[name + ".count"]) == len(chunk), name
        entries[name] = Entry(stats[name].reshape(1, groups * n), np.array([stats[name + ".count"]], np.float32))
    llama_path = tmp_path / "llama-imatrix.gguf"
    save_imatrix(make_imatrix(entries, datasets=["chunk"]), llama_path)
    folded = load_imatrix(llama_path).conform(expected_entries(shapes), required=(), groups=grouped)
    for name in grouped:
        e = folded.entries[name]
        assert np.array_equal(e.counts, ours.entries[name].counts), name
        assert relative_difference(ours.entries[name].in_sum2, e.in_sum2) < REL_TOL, name


#: attn_output_a (row length 256) and attn_output_b (128) in a 32-block type that uses importance.
GROUPED_RECIPE = """name = "grouped-test"
architectures = ["deepseek_v4"]
[defaults]
type = "Q8_0"
[[rule]]
class = "attn_output"
type = "IQ4_NL"
"""


def tensor_payloads(path: Path) -> dict[str, bytes]:
    with GGUFFile(path) as f:
        return {n: bytes(f.data(n)) for n in f.tensors}


# -- through the runtime: packed weights streamed from the checkpoint ----------------------------------------------

@pytest.mark.parametrize("arch,all_experts", [("qwen3_moe", False), ("deepseek_v3", True), ("deepseek_v4", False),
                                              ("glm5_next", False), ("qwen4_exp", False)])
def test_runtime_model_collects_what_transformers_model_does(tiny_checkpoints, arch, all_experts):
    """The runtime's model (packed weights, recognized by identity, experts by ``weight[e]``) gives bit for bit the
    statistics of transformers' own model with the same float32 weights, with an unlimited cache and with none
    (every weight assembled from the checkpoint at each use)."""
    model, _, amap = tiny(arch)
    chunk = torch.randint(0, 500, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    path = tiny_checkpoints.get(arch, "per-expert", "f32")
    results = {}
    for budget in (None, 0):
        runtime = load_model(path, cache_bytes=budget)
        try:
            results[budget] = collect(runtime.module, amap, [chunk], all_experts=all_experts)
            assert runtime.store.weights.cache.peak_bytes <= (budget if budget is not None else float("inf"))
        finally:
            runtime.close()
    expected = collect(model, amap, [chunk], all_experts=all_experts)
    for budget, imx in results.items():
        assert sorted(imx.entries) == sorted(expected.entries), budget
        for name, e in expected.entries.items():
            assert np.array_equal(imx.entries[name].counts, e.counts), (budget, name)
            assert np.array_equal(imx.entries[name].in_sum2, e.in_sum2), (budget, name)


def test_collect_with_a_tiny_budget_streams_and_gives_the_same_imatrix(tmp_path, monkeypatch):
    """``max_memory`` smaller than one layer: every layer streams from the checkpoint, the cache never holds more
    than the budget, and the imatrix is the unlimited one bit for bit (which also keeps decoded weights from one
    chunk to the next: the kept tensors give what decoding again gives)."""
    peaks = []
    close = CheckpointWeights.close

    def closing(self):
        peaks.append((self.cache.budget, self.cache.peak_bytes, self.cache.misses))
        close(self)

    monkeypatch.setattr(CheckpointWeights, "close", closing)
    opts = dict(ctx=64, batch=64, chunks=2, progress=False)     # two passes: what is kept between them counts
    text = DATA / "calibration-a.txt"
    layer = 3 * 1024 * 1024      # the example's stacked experts of one layer take more than this
    runs = {budget: collect_imatrix(example_model_dir(), text, tmp_path / f"{budget}.gguf",
                                    CollectOptions(**opts, max_memory=budget)) for budget in (None, layer // 4, 0)}
    assert peaks[1][1] <= layer // 4 and peaks[2][1] == 0
    assert peaks[0][2] < peaks[1][2] <= peaks[2][2]         # fewer assemblies the more is kept
    for budget in (layer // 4, 0):
        for name, e in runs[None].entries.items():
            assert np.array_equal(runs[budget].entries[name].counts, e.counts), name
            assert np.array_equal(runs[budget].entries[name].in_sum2, e.in_sum2), name


# -- the command --------------------------------------------------------------------------------------------------

def legacy_bytes(imx, path) -> bytes:
    from quantkit.imatrix import save_imatrix

    save_imatrix(imx, path, fmt="dat")
    return path.read_bytes()


def test_cli_collect_and_bad_input(tmp_path):
    runner = CliRunner()
    out = tmp_path / "out.gguf"
    args = ["imatrix", "collect", str(example_model_dir()), "--text", str(DATA / "calibration-a.txt"), "--ctx", "64",
            "--chunks", "2", "--max-memory", "1M", "--no-progress", "-o", str(out)]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    imx = load_imatrix(out)
    bad_size = runner.invoke(main, [*args[:-1], str(tmp_path / "size.gguf"), "--max-memory", "lots"])
    assert bad_size.exit_code == 2 and "'lots' is not a size" in bad_size.output
    bad_threads = runner.invoke(main, [*args[:-1], str(tmp_path / "threads.gguf"), "--threads", "0"])
    assert bad_threads.exit_code == 2 and "--threads" in bad_threads.output
    assert not (tmp_path / "threads.gguf").exists()
    assert "observed 32 of 32 experts (100.00%)" in result.output
    assert not imx.synthetic                      # the bundled example is an untrained test model
    assert (imx.chunk_count, imx.chunk_size, imx.datasets) == (2, 64, [str(DATA / "calibration-a.txt")])
    assert imx.entries["blk.0.attn_q.weight"].counts.tolist() == [128]
    assert imx.provenance["source_model_type"] == "qwen3_moe" and imx.provenance["ctx"] == "64"
    assert runner.invoke(main, args).exit_code == 2            # the output exists
    dat = tmp_path / "out.dat"                                  # a .dat name: llama.cpp's legacy format
    assert runner.invoke(main, [*args[:-1], str(dat)]).exit_code == 0
    assert dat.read_bytes()[:4] != b"GGUF" and dat.read_bytes() == legacy_bytes(imx, tmp_path / "legacy.dat")
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "short.txt").write_text("too short")
    for text in ("empty.txt", "short.txt"):
        bad = tmp_path / f"{text}.gguf"
        result = runner.invoke(main, [*args[:3], "--text", str(tmp_path / text), *args[5:-1], str(bad)])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert not bad.exists() and not list(tmp_path.glob(f"{text}.gguf*"))


def test_collect_checks_inputs_output_and_ctx_before_any_work(tmp_path, monkeypatch):
    """Never an input as the output (even with --force), a leftover partial refused and kept, --ctx 0 refused as
    --ctx -5 is: one line, exit 2, before the model is loaded."""
    loaded = []

    def load(*args, **kwargs):
        loaded.append(args)
        raise RuntimeError("the model was loaded")

    monkeypatch.setattr(collect_module, "load_collection_model", load)
    checkpoint = tmp_path / "ck"
    shutil.copytree(example_model_dir(), checkpoint)
    text = tmp_path / "cal.txt"
    shutil.copy(DATA / "calibration-a.txt", text)
    before = {p: p.read_bytes() for p in [*checkpoint.iterdir(), text]}
    out = tmp_path / "new.gguf"
    partial = tmp_path / "new.gguf.partial"
    partial.write_text("junk")
    runner = CliRunner()
    for output, extra, expected in (
            (checkpoint / "model.safetensors", ["--force"], "the output would overwrite an input of this command"),
            (checkpoint / "config.json", ["--force"], "the output would overwrite an input of this command"),
            (text, ["--force"], "the output would overwrite an input of this command"),
            (out, [], f"{partial}: an unfinished write of this output exists"),
            (out, ["--ctx", "0"], "context length must be positive, got 0"),
            (out, ["--ctx", "-5"], "context length must be positive, got -5")):
        result = runner.invoke(main, ["imatrix", "collect", str(checkpoint), "--text", str(text), "--ctx", "64",
                                      "--chunks", "1", "--no-progress", "-o", str(output), *extra])
        assert result.exit_code == 2 and result.output.count("\n") == 1, (output, extra, result.output)
        assert expected in result.output, result.output
    assert not loaded and {p: p.read_bytes() for p in before} == before
    assert partial.read_text() == "junk" and not out.exists()


def test_collect_records_the_checkpoint_identity(tiny_checkpoints, tmp_path):
    """``source_digest`` is the checkpoint's identity (the digest release manifests and score records use): two
    checkpoints with one config and other weights differ, and their imatrices do not merge."""
    from quantkit.scoring.source import checkpoint_identity

    runner = CliRunner()
    outs = []
    for seed in (0, 1):
        source = tiny_checkpoints.get("qwen3_moe", seed=seed)
        out = tmp_path / f"seed{seed}.gguf"
        result = runner.invoke(main, ["imatrix", "collect", str(source), "--text", str(DATA / "calibration-a.txt"),
                                      "--ctx", "64", "--chunks", "1", "--no-progress", "-o", str(out)])
        assert result.exit_code == 0, result.output
        provenance = load_imatrix(out).provenance
        assert provenance["source_digest"] == checkpoint_identity(source).source
        config_sha = hashlib.sha256((source / "config.json").read_bytes()).hexdigest()
        assert f"config.json:{config_sha}" in provenance["source_files"].split(",")
        assert f"source_digest: {provenance['source_digest']}" in runner.invoke(main, ["imatrix", "info",
                                                                                       str(out)]).output
        outs.append((out, provenance))
    assert outs[0][1]["source_digest"] != outs[1][1]["source_digest"]
    merged = runner.invoke(main, ["imatrix", "merge", *(str(o) for o, _ in outs), "-o", str(tmp_path / "m.gguf")])
    assert merged.exit_code == 2 and "imatrices of different models" in merged.output, merged.output


def test_collect_resumes_by_forward_passes(tmp_path, monkeypatch):
    """Two chunks per pass, five chunks: passes [0, 1], [2, 3], [4]; killed in the third pass, the state holds four
    chunks, and the resumed run forms the passes an uninterrupted one does."""
    opts = dict(ctx=64, batch=128, chunks=5, save_every=1, progress=False)
    text = DATA / "calibration-b.txt"
    whole = collect_imatrix(example_model_dir(), text, tmp_path / "whole.gguf", CollectOptions(**opts))

    out = tmp_path / "out.gguf"
    passes = []
    original = Collector.run_chunks

    def interrupted(self, input_ids):
        passes.append(tuple(input_ids.shape))
        if len(passes) == 3:
            raise RuntimeError("killed")
        return original(self, input_ids)

    monkeypatch.setattr(Collector, "run_chunks", interrupted)
    with pytest.raises(RuntimeError, match="killed"):
        collect_imatrix(example_model_dir(), text, out, CollectOptions(**opts))
    assert passes == [(2, 64), (2, 64), (1, 64)]
    state = out.with_name(out.name + RESUME_SUFFIX)
    assert not out.exists() and load_imatrix(state).provenance["chunks_done"] == "4"
    with pytest.raises(ValidationError, match="chunks_per_pass"):   # other passes would change the sums' order
        collect_imatrix(example_model_dir(), text, out, CollectOptions(**{**opts, "batch": 64}))
    monkeypatch.setattr(Collector, "run_chunks", original)
    resumed = collect_imatrix(example_model_dir(), text, out, CollectOptions(**opts))
    assert not state.exists() and resumed.chunk_count == 5
    for name, e in whole.entries.items():
        assert np.array_equal(resumed.entries[name].counts, e.counts)
        assert np.allclose(resumed.entries[name].in_sum2, e.in_sum2, rtol=1e-6, atol=0), name


def test_resume_state_of_other_source_files_is_refused_naming_them(tmp_path, monkeypatch):
    checkpoint = tmp_path / "ck"
    shutil.copytree(example_model_dir(), checkpoint)
    opts = CollectOptions(ctx=64, batch=64, chunks=2, save_every=1, progress=False)
    out = tmp_path / "out.gguf"
    original = Collector.run_chunks
    passes = []

    def interrupted(self, input_ids):
        passes.append(1)
        if len(passes) == 2:
            raise RuntimeError("killed")
        return original(self, input_ids)

    monkeypatch.setattr(Collector, "run_chunks", interrupted)
    with pytest.raises(RuntimeError, match="killed"):
        collect_imatrix(checkpoint, DATA / "calibration-a.txt", out, opts)
    with open(checkpoint / "generation_config.json", "a") as f:
        f.write("\n")
    with pytest.raises(ValidationError, match=r"other source files \(generation_config.json\)"):
        collect_imatrix(checkpoint, DATA / "calibration-a.txt", out, opts)


def test_chunks_per_pass_change_only_the_rounding(tmp_path):
    """Chunks run one per pass or four per pass: the same statistics up to float32 rounding of the forward."""
    opts = dict(ctx=64, chunks=4, progress=False)
    text = DATA / "calibration-b.txt"
    single, grouped = (collect_imatrix(example_model_dir(), text, tmp_path / f"{batch}.gguf",
                                       CollectOptions(**opts, batch=batch)) for batch in (64, 256))
    assert (single.provenance["chunks_per_pass"], grouped.provenance["chunks_per_pass"]) == ("1", "4")
    for name, e in single.entries.items():
        assert np.array_equal(grouped.entries[name].counts, e.counts), name
        assert np.allclose(grouped.entries[name].in_sum2, e.in_sum2, rtol=1e-5, atol=0), name


# -- what the imatrix is for ---------------------------------------------------------------------------------------

#: Rows of each matrix encoded (rows are encoded independently, so a row subset measures the same thing faster).
IQ2_ROWS = 64


def test_iq2_xxs_with_the_imatrix_beats_the_bootstrap():
    """For every tensor (every expert) of the tiny qwen3_moe, IQ2_XXS encoded with the collected importance has a
    lower imatrix-weighted squared error than IQ2_XXS encoded with the weight-energy bootstrap."""
    model, _, amap = tiny("qwen3_moe")
    imx = collect(model, amap, chunk_tokens(MANIFEST["archs"]["qwen3_moe"]["tokens"]["a"], CTX, None, None),
                  all_experts=True)
    state = {n: p.detach().numpy() for n, p in model.state_dict().items()}
    outputs = {o.gguf_name: o for o in amap.outputs({n: a.shape for n, a in state.items()})}
    ratios = {}
    for name in sorted(imx.entries):
        w = amap.assemble(outputs[name], state.__getitem__)
        mats = w if w.ndim == 3 else w[None]
        for m in range(mats.shape[0]):
            x = np.ascontiguousarray(mats[m, :IQ2_ROWS])
            importance = imx.importance(name, m if mats.shape[0] > 1 else None)
            errors = []
            for im in (importance, bootstrap_importance(mats[m])):
                decoded = quantkit.decode(quantkit.encode(x, "IQ2_XXS", im), "IQ2_XXS", x.shape)
                errors.append(float(((x - decoded).astype(np.float64) ** 2 * importance).sum()))
            ratios[f"{name}[{m}]"] = errors[0] / errors[1]
    assert len(ratios) == 2 * 5 + 2 * 3 * 8       # per layer: q, k, v, output, router; 3 x 8 experts
    assert max(ratios.values()) < 1, {k: v for k, v in ratios.items() if v >= 1}


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_grouped_experts_forward_is_transformers_eager_bit_for_bit(arch):
    """The collector's grouped experts forward gives the output of the module's own eager forward, bit for bit, on
    random routing (the statistics then see the same inputs as under eager, checked by the tests above)."""
    from quantkit.imatrix.collect import groupable_experts, grouped_experts_forward

    model, _, _ = tiny(arch)
    modules = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert modules and all(groupable_experts(m) for m in modules)
    generator = torch.Generator().manual_seed(4)
    for module in modules:
        tokens, top_k, n_experts = 77, 4, module.num_experts
        hidden = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=generator)
        index = torch.stack([torch.randperm(n_experts, generator=generator)[:top_k] for _ in range(tokens)])
        weights = torch.rand(index.shape, generator=generator)
        with torch.no_grad():
            eager = type(module).forward.__wrapped__(module, hidden, index, weights)
            grouped = grouped_experts_forward(module, hidden, index, weights)
        assert torch.equal(eager, grouped), type(module).__name__


def test_the_command_ends_without_torch_teardown_keeping_its_code_and_output(tmp_path):
    """Once torch is loaded, ``quantkit`` ends without the interpreter's teardown (:func:`quantkit.cli.run`): the
    exit code, stdout and stderr still arrive, and the output is complete."""
    out = tmp_path / "i.gguf"
    args = [sys.executable, "-m", "quantkit.cli", "imatrix", "collect", str(example_model_dir()), "--text",
            str(DATA / "calibration-a.txt"), "-o", str(out), "--ctx", "64", "--chunks", "1", "--no-progress"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and first.stdout.startswith(f"wrote {out}: "), first.stderr
    assert load_imatrix(out).chunk_count == 1
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stdout == "", again.stdout
    assert again.stderr.splitlines() == [f"error: {out}: output exists; refusing to replace it "
                                         f"(pass --force to overwrite)"]
