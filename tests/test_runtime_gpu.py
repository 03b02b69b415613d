"""CUDA: every Triton dequantization kernel is bit-identical to the numba decoder it stands for, and the runtime on
CUDA (payloads on the device, and streamed from the file; routed experts as grouped products) gives the CPU runtime's
logits (eager per-expert loop).  Skipped without a CUDA
device (CI has none: these run on the H200 whenever GPU code changes; the note records the run)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from quantkit.formats.registry import GGMLType  # noqa: E402
from quantkit.kernels.dequant import FAST_DECODERS  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from test_runtime import ggufs  # noqa: E402,F401  (the GGUF fixture of the CPU tests)

KERNEL_TYPES = sorted(("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                       "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
                       "MXFP4", "NVFP4"))
#: Block counts: one block, a count no tile size divides, and enough random blocks to hit every scale byte value.
BLOCK_COUNTS = (1, 37, 20000)


def same_bits(got: np.ndarray, ref: np.ndarray) -> bool:
    """Identical bits everywhere except NaN payloads (NaN positions must agree)."""
    nan = np.isnan(ref)
    return bool(np.array_equal(nan, np.isnan(got))
                and np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32)))


def test_every_kernel_type_is_listed():
    from quantkit.kernels.triton_dequant import TRITON_TYPES

    assert {t.name for t in TRITON_TYPES} == set(KERNEL_TYPES)


@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_triton_kernel_is_bit_identical_to_the_cpu_decoder(name):
    from quantkit.kernels.triton_dequant import dequantize

    qtype = GGMLType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    for n_blocks in BLOCK_COUNTS:
        count = n_blocks * (64 if block == 1 else 1)
        raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
        ref = FAST_DECODERS[qtype](raw).reshape(-1)
        got = dequantize(torch.from_numpy(raw).cuda(), qtype).cpu().numpy()
        assert got.shape == ref.shape
        assert same_bits(got, ref), f"{name}: {n_blocks} blocks differ"


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_cuda_runtime_matches_cpu(ggufs, arch):
    from quantkit.runtime import load_model, logits
    from test_runtime import RELATIVE_TOLERANCE, token_ids

    path = ggufs(arch, "mixed")
    ids = token_ids(arch, 64)
    cpu = logits(load_model(path), ids)
    cuda = logits(load_model(path, device="cuda"), ids)
    streamed = logits(load_model(path, device="cuda", stream=True), ids)
    scale = float(np.abs(cpu).max())
    assert float(np.abs(cuda - cpu).max()) <= RELATIVE_TOLERANCE * scale
    assert np.array_equal(streamed, cuda)


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_bf16_equals_per_expert_products(transposed):
    """The bfloat16 grouped product (torch's grouped_mm) against float32 per-expert products of the same bfloat16
    inputs: within bfloat16's rounding of the output (2^-8 relative) on a max-normalized scale."""
    from quantkit.runtime.experts import grouped_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_experts, rows_in, rows_out = 8, 256, 192
    experts = torch.sort(torch.randint(0, n_experts - 1, (1000,), generator=gen, device="cuda")).values
    counts = torch.bincount(experts, minlength=n_experts)
    x = torch.randn(1000, rows_in, generator=gen, device="cuda").bfloat16()
    shape = (n_experts, rows_in, rows_out) if transposed else (n_experts, rows_out, rows_in)
    weight = torch.randn(*shape, generator=gen, device="cuda").bfloat16()
    got = grouped_linear(x, weight, experts, counts, transposed).float()
    w32 = weight.float() if transposed else weight.float().transpose(-2, -1)
    ref = torch.cat([x[experts == e].float() @ w32[e] for e in range(n_experts)])
    assert float((got - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max())


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_cuda_long_sequence_memory_grows_linearly(ggufs, arch):
    """SDPA's memory-efficient kernel (causal, no mask tensor; grouped-query heads repeated in float32): the device
    memory a forward pass adds grows linearly with the sequence (4096 -> 8192 tokens at most 2.5x, where any
    n x n term makes it 4x) and stays below half of one layer's [heads, n, n] float32 score matrix."""
    from quantkit.runtime import load_model, logits
    from test_runtime import token_ids

    model = load_model(ggufs(arch, "mixed"), device="cuda")
    assert model.module.config._attn_implementation == "sdpa"
    ids = token_ids(arch, 8192)
    logits(model, ids[:64])     # weights placed, kernels compiled
    added = {}
    for n in (4096, 8192):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        logits(model, ids[:n])
        added[n] = torch.cuda.max_memory_allocated() - base
    print(arch, added)
    assert added[8192] <= 2.5 * added[4096]
    assert added[8192] < model.module.config.num_attention_heads * 8192 * 8192 * 4 / 2


def test_cuda_nan_payload_raises_naming_the_tensor(ggufs, tmp_path):
    import shutil

    from quantkit.errors import FormatError
    from quantkit.io.gguf_reader import GGUFFile
    from quantkit.runtime import load_model, logits

    src = ggufs("qwen3_moe", "mixed")
    bad = tmp_path / "nan.gguf"
    shutil.copy(src, bad)
    with GGUFFile(src) as f:
        offset = f.data_offset + f.tensor("blk.1.ffn_down_exps.weight").offset
    with open(bad, "r+b") as fh:        # expert 0's first Q4_K block: d = NaN
        fh.seek(offset)
        fh.write(np.array([0x7E00], np.uint16).tobytes())
    model = load_model(bad, device="cuda")
    with pytest.raises(FormatError, match="blk.1.ffn_down_exps.weight"):
        for start in range(0, 512, 64):     # until a token routes to expert 0
            logits(model, list(range(start, start + 64)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_cuda_cached_greedy_matches_uncached_and_cpu(tiny_checkpoints, arch):
    """The KV-cache path on CUDA: the tokens of the uncached path, and the CPU runtime's first logits row."""
    from quantkit.runtime import greedy, load_model
    from test_runtime import RELATIVE_TOLERANCE

    path = tiny_checkpoints.get(arch, "per-expert", "f32")
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 480, 122)]
    cuda_model, cpu_model = load_model(path, device="cuda"), load_model(path)
    try:
        cached = greedy(cuda_model, prompt, 10)
        uncached = greedy(cuda_model, prompt, 10, use_cache=False)
        cpu_first = greedy(cpu_model, prompt, 1)
    finally:
        cuda_model.close()
        cpu_model.close()
    assert cached.tokens == uncached.tokens and len(cached.tokens) == 10
    scale = float(np.abs(uncached.logits).max())
    assert float(np.abs(cached.logits - uncached.logits).max()) <= RELATIVE_TOLERANCE * scale
    assert float(np.abs(cached.logits[0] - cpu_first.logits[0]).max()) <= RELATIVE_TOLERANCE * scale


def test_cuda_collection_streamed_under_a_budget_matches_cpu(tmp_path):
    """``imatrix collect --device cuda --max-memory``: weights streamed to the device per use give the CPU
    statistics (summation order differs: compared per tensor within 1e-4; each tensor's total count is routing-
    independent: tokens x experts used)."""
    from quantkit.examples import example_model_dir
    from quantkit.imatrix.collect import CollectOptions, collect_imatrix
    from test_imatrix_collect import DATA

    text = DATA / "calibration-a.txt"
    runs = {device: collect_imatrix(example_model_dir(), text, tmp_path / f"{device}.gguf",
                                    CollectOptions(ctx=64, chunks=2, progress=False, device=device,
                                                   max_memory=1 << 20))
            for device in ("cpu", "cuda")}
    assert sorted(runs["cuda"].entries) == sorted(runs["cpu"].entries)
    for name, e in runs["cpu"].entries.items():
        got = runs["cuda"].entries[name]
        assert float(got.counts.sum()) == float(e.counts.sum()), name
        total, ref = float(got.in_sum2.astype(np.float64).sum()), float(e.in_sum2.astype(np.float64).sum())
        assert abs(total - ref) <= 1e-4 * ref, name
