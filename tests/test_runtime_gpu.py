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
    # streamed payloads are decoded, then multiplied; resident ones multiplied packed (fused products)
    assert float(np.abs(streamed - cpu).max()) <= RELATIVE_TOLERANCE * scale


FUSED_NAMES = ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4", "NVFP4", "BF16", "F32")


def _encoded(name: str, rows: int, cols: int, rng) -> np.ndarray:
    from quantkit.formats.api import encode

    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if name == "F32":
        return w.view(np.uint8)
    return encode(w, name, np.ones(cols, np.float32) if name == "IQ2_XXS" else None)


def test_every_fused_type_is_tested():
    from quantkit.kernels.triton_matmul import FUSED_TYPES

    assert {t.name for t in FUSED_TYPES} == set(FUSED_NAMES)


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_products_decode_bit_for_bit(name):
    """The values the fused product multiplies are the numba decoder's, bit for bit: the identity times the packed
    weight in plain float32 (``ieee``: each output is one weight value times 1 plus exact zeros) gives W.T, every
    value equal (bit for bit but the sign of a zero, which a sum started from +0 cannot keep)."""
    from quantkit.kernels.triton_matmul import linear

    qtype = GGMLType[name]
    rows, cols = 200, 512
    raw = _encoded(name, rows, cols, np.random.default_rng(int(qtype)))
    ref = raw.view(np.float32) if name == "F32" else FAST_DECODERS[qtype](
        raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])).reshape(rows, cols)
    eye = torch.eye(cols, device="cuda")
    got = linear(eye, torch.from_numpy(raw).cuda(), qtype, rows, precision="ieee").cpu().numpy()
    assert np.array_equal(got, ref.T)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_products_equal_dequantize_then_matmul(name, dtype):
    """The fused products (dense, and grouped over experts with a per-expert scale) against the weights decoded by
    the bit-exact Triton decoder and multiplied in float64.  Bound per output: 2^-16 (float32 activations, bf16x3:
    each product within ~3 x 2^-18; plain TF32 products would err ~2^-11) or 2^-8 (bfloat16: the weight rounded
    to bfloat16, as the decoded path converts it, and the output rounded) times sum_k |x_k w_k|.  Shapes no tile divides; one expert routed no rows,
    one more rows than a tile."""
    from quantkit.kernels.triton_dequant import dequantize
    from quantkit.kernels.triton_matmul import grouped_linear, linear

    qtype = GGMLType[name]
    rng = np.random.default_rng(int(qtype))
    n_experts, rows, cols = 3, 200, 512
    raw = np.stack([_encoded(name, rows, cols, rng) for _ in range(n_experts)])
    payload = torch.from_numpy(raw).cuda()
    w = dequantize(payload, qtype).view(n_experts, rows, cols)
    dt = getattr(torch, dtype)
    w64 = (w if dt == torch.float32 else w.to(dt)).double()
    counts = torch.tensor([77, 0, 130], device="cuda")
    experts = torch.repeat_interleave(torch.arange(n_experts, device="cuda"), counts)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(int(counts.sum()), cols, generator=gen, device="cuda").to(dt)
    x64 = x.double()
    tol = 2.0 ** -16 if dt == torch.float32 else 2.0 ** -8

    dense = linear(x, payload[0], qtype, rows)
    assert dense.dtype == dt and dense.shape == (x.shape[0], rows)
    bound = tol * (x64.abs() @ w64[0].abs().T)
    assert bool(((dense.double() - x64 @ w64[0].T).abs() <= bound).all()), name

    scale = torch.tensor([0.5, 3.0, 1.25], device="cuda")
    grouped = grouped_linear(x, payload, qtype, rows, counts, scale=scale)
    ref = torch.einsum("mk,mnk->mn", x64, w64[experts]) * scale.double()[experts, None]
    bound = tol * torch.einsum("mk,mnk->mn", x64.abs(), w64[experts].abs()) * scale.double()[experts, None]
    assert bool(((grouped.double() - ref).abs() <= bound).all()), name


@pytest.mark.parametrize("tokens,top_k,n_experts", [(2048, 8, 64), (300, 4, 16), (5, 2, 3), (77, 8, 256),
                                                    (16384, 8, 64), (2048, 8, 256)])
def test_route_sorts_and_tiles_as_torch(tokens, top_k, n_experts):
    """The routing kernel's order is torch's stable argsort of the pairs' experts, its counts their bincount, its
    tile table expert_tiles' (spare tiles: expert -1); one expert takes a slot of every token.  16K tokens: past
    ROUTE_MAX_COUNTS (and 2K tokens over 256 experts), torch's path, the same answer."""
    from quantkit.kernels.triton_matmul import expert_tiles, route

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    idx = torch.argsort(torch.rand(tokens, n_experts, generator=gen, device="cuda"), 1)[:, :top_k]
    idx[:, 0] = n_experts // 2
    pairs = idx.reshape(-1).contiguous()
    order, counts, tiles = route(pairs, n_experts)
    assert torch.equal(order.long(), torch.argsort(pairs, stable=True))
    assert torch.equal(counts, torch.bincount(pairs, minlength=n_experts))
    ref = expert_tiles(counts, pairs.numel()).table
    valid = ref[:, 0] >= 0
    assert torch.equal(tiles.table[valid], ref[valid]) and bool((tiles.table[~valid, 0] == -1).all())


@pytest.mark.parametrize("name", ["Q4_K", "NVFP4"])
def test_routed_products_equal_gather_weight_and_unsort(name):
    """Grouped products that read each routed row's token in place, and write each result times its routing
    weight to its (token, slot) row, equal gathering the tokens, multiplying, weighting and un-sorting with torch,
    bit for bit (same products; the weight multiplies after the NVFP4 scale, as the torch steps do)."""
    from quantkit.kernels.triton_matmul import Routed, grouped_linear, route

    qtype = GGMLType[name]
    rng = np.random.default_rng(int(qtype))
    n_experts, rows, cols, tokens, top_k = 6, 200, 512, 300, 4
    payload = torch.from_numpy(np.stack([_encoded(name, rows, cols, rng) for _ in range(n_experts)])).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(tokens, cols, generator=gen, device="cuda")
    pairs = torch.argsort(torch.rand(tokens, n_experts, generator=gen, device="cuda"), 1)[:, :top_k].reshape(-1)
    weights = torch.rand(tokens * top_k, generator=gen, device="cuda")
    scale = torch.tensor([0.5, 3.0, 1.25, 1.0, 2.0, 0.75], device="cuda") if name == "NVFP4" else None
    order, counts, tiles = route(pairs.contiguous(), n_experts)
    sorted_order = order.long()
    plain = grouped_linear(hidden[sorted_order // top_k], payload, qtype, rows, counts, scale=scale, tiles=tiles)
    gathered = grouped_linear(hidden, payload, qtype, rows, counts, scale=scale, tiles=tiles,
                              routed=Routed(gather=order, gather_div=top_k))
    assert torch.equal(gathered, plain)
    want = torch.empty_like(plain)
    want[sorted_order] = plain * weights[sorted_order, None]
    got = torch.empty_like(plain)
    grouped_linear(hidden[sorted_order // top_k], payload, qtype, rows, counts, scale=scale, tiles=tiles, out=got,
                   routed=Routed(scatter=order, weights=weights))
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(1, 300, 2048), (1, 300, 16, 128), (7, 96)])
def test_rms_norm_kernel_equals_transformers_arithmetic(shape):
    """The one-launch RMSNorm against transformers' float32 steps: within a few float32 ulps (the sum of squares
    is added in another order)."""
    from quantkit.kernels.triton_rmsnorm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = 3 * torch.randn(*shape, generator=gen, device="cuda")
    w = torch.randn(shape[-1], generator=gen, device="cuda")
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = rms_norm(x, w, 1e-6)
    assert float((got - want).abs().max()) <= 2.0 ** -20 * float(want.abs().max())


@pytest.mark.parametrize("dim,group,shape", [(8192, 2048, (1, 300, 8192)), (128, None, (1, 300, 16, 128)),
                                             (96, 32, (7, 96))])
def test_offset_rms_norm_kernel_equals_qwen38_norm(dim, group, shape):
    """The one-launch RMSNorm with ``1 + weight``, over groups of the last axis where asked, against Qwen3.8's
    ``Qwen4ExpTextRMSNorm`` itself: within a few float32 ulps (the sum of squares is added in another order)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    from quantkit.kernels.triton_rmsnorm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(5)
    norm = Qwen4ExpTextRMSNorm(dim, group_size=group, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen, device="cuda"))
        x = 3 * torch.randn(*shape, generator=gen, device="cuda")
        want = norm(x)
    got = rms_norm(x, norm.weight.detach(), 1e-6, group=group, plus_one=True)
    assert float((got - want).abs().max()) <= 2.0 ** -20 * float(want.abs().max())


def test_cuda_qwen38_norms_run_in_one_launch(ggufs, monkeypatch):
    """Every ``Qwen4ExpTextRMSNorm`` of a float32 CUDA Qwen3.8 pass (the heads' and the indexer's, whose query
    heads are slices of a wider projection, and the norms over the hyper-connection streams) runs as the
    one-launch kernel with ``1 + weight``."""
    from quantkit.kernels import triton_rmsnorm
    from quantkit.runtime import load_model, logits
    from test_runtime import token_ids

    offset_calls = []
    original = triton_rmsnorm.rms_norm
    monkeypatch.setattr(triton_rmsnorm, "rms_norm",
                        lambda *a, **k: offset_calls.append(k.get("plus_one", False)) or original(*a, **k))
    model = load_model(ggufs("qwen4_exp", "mixed"), device="cuda")
    model.graphs = False
    norms = []
    for m in model.module.modules():
        if type(m).__name__ == "Qwen4ExpTextRMSNorm":
            m.register_forward_hook(lambda *a: norms.append(1))
    logits(model, token_ids("qwen4_exp", 64))
    assert norms and sum(offset_calls) == len(norms)


def test_f32_weights_multiply_in_place_by_cublas_into_their_columns(monkeypatch):
    """An F32 weight times float32 activations is cuBLAS's float32 product of the payload viewed in place (no
    fused launch), written into its columns of a wider output and nowhere else; bfloat16 activations keep the
    fused kernel."""
    from quantkit.kernels import triton_matmul

    launches = []
    original = triton_matmul._launch
    monkeypatch.setattr(triton_matmul, "_launch", lambda *a, **k: launches.append(a[2]) or original(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(24, 8192, generator=gen, device="cuda")
    x = torch.randn(300, 8192, generator=gen, device="cuda")
    payload = w.view(torch.uint8).reshape(24, -1)
    wide = torch.full((300, 30), 7.0, device="cuda")
    triton_matmul.linear(x, payload, GGMLType.F32, 24, out=wide, out_col=3)
    assert torch.equal(wide[:, 3:27], x @ w.T) and bool((wide[:, :3] == 7).all() and (wide[:, 27:] == 7).all())
    assert torch.equal(triton_matmul.linear(x, payload, GGMLType.F32, 24), x @ w.T) and launches == []
    triton_matmul.linear(x.bfloat16(), payload, GGMLType.F32, 24)
    assert launches == [GGMLType.F32]


def test_wide_f32_weights_multiply_by_cublas_in_bf16x3(monkeypatch):
    """An F32 weight of at least BF16X3_MIN_ROWS rows times float32 activations: one bfloat16 cuBLAS product of
    the split operands (no fused launch), within bf16x3's bound (2^-16 of sum |x w|, as the fused products) of
    float64, into its columns only; ``ieee`` keeps cuBLAS's plain float32 product."""
    from quantkit.kernels import triton_matmul

    launches = []
    original = triton_matmul._launch
    monkeypatch.setattr(triton_matmul, "_launch", lambda *a, **k: launches.append(a[2]) or original(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(320, 8192, generator=gen, device="cuda") * 0.02
    x = torch.randn(300, 8192, generator=gen, device="cuda")
    payload = w.view(torch.uint8).reshape(320, -1)
    want = x.double() @ w.double().T
    bound = 2.0 ** -16 * (x.double().abs() @ w.double().abs().T)
    wide = torch.full((300, 330), 7.0, device="cuda")
    triton_matmul.linear(x, payload, GGMLType.F32, 320, out=wide, out_col=5)
    assert bool(((wide[:, 5:325].double() - want).abs() <= bound).all())
    assert bool((wide[:, :5] == 7).all() and (wide[:, 325:] == 7).all())
    got = triton_matmul.linear(x, payload, GGMLType.F32, 320)
    assert bool(((got.double() - want).abs() <= bound).all()) and not torch.equal(got, x @ w.T)
    assert torch.equal(triton_matmul.linear(x, payload, GGMLType.F32, 320, precision="ieee"), x @ w.T)
    assert launches == []


def test_cuda_runtime_multiplies_packed_weights(ggufs, monkeypatch):
    """On CUDA every matrix of the mixed Qwen3-MoE file (Q4_K experts, Q8_0 and F32 matrices) is multiplied packed:
    after the first pass (which decodes each payload once, for the finiteness check) no weight is built."""
    from quantkit.runtime import load_model, logits
    from quantkit.runtime.packed import Assembler
    from test_runtime import token_ids

    model = load_model(ggufs("qwen3_moe", "mixed"), device="cuda")
    ids = token_ids("qwen3_moe", 64)
    logits(model, ids)
    built = []
    original = Assembler.build
    monkeypatch.setattr(Assembler, "build", lambda self, plan, *a, **k: built.append(plan.name) or
                        original(self, plan, *a, **k))
    logits(model, ids)
    assert built == []


@pytest.mark.parametrize("heads,kv_heads,n,dim", [(16, 4, 300, 128), (4, 4, 45, 64), (8, 1, 2048, 128),
                                                  (2, 2, 7, 128), (3, 3, 97, 16), (1, 1, 16384, 128)])
def test_causal_attention_kernel_is_within_bf16x3_of_float64(heads, kv_heads, n, dim):
    """The one-launch causal attention (grouped-query heads read in place) against float64 attention: within
    bf16x3's bound (each score within 2^-16 of sum |q k|, moving each weight by up to twice that)."""
    from quantkit.kernels.triton_causal_attention import causal_attention, fits

    gen = torch.Generator(device="cuda").manual_seed(n + dim)
    query = torch.randn(2, heads, n, dim, generator=gen, device="cuda") * 0.5
    key = torch.randn(2, kv_heads, n, dim, generator=gen, device="cuda")
    value = torch.randn(2, kv_heads, n, dim, generator=gen, device="cuda")
    assert fits(query, key, value)
    assert not fits(*(torch.zeros(1, 2, n, 256, device="cuda") for _ in range(3)))      # SDPA takes those
    scaling = dim ** -0.5
    got = causal_attention(query, key, value, scaling).double()
    k64 = key.double().repeat_interleave(heads // kv_heads, dim=1)
    v64 = value.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = scaling * query.double() @ k64.transpose(-1, -2)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    want = (scores.softmax(-1) @ v64).transpose(1, 2)
    score_error = scaling * float((query.double().abs() @ k64.abs().transpose(-1, -2)).max())
    bound = 2.0 ** -16 * (2 * score_error + 1) * float(value.abs().max())
    assert got.shape == want.shape and float((got - want).abs().max()) <= bound


def test_cuda_scoring_passes_run_causal_attention_in_one_launch(ggufs, monkeypatch):
    """A float32 CUDA pass of the Qwen3-MoE file runs every attention layer as the one-launch causal kernel (no
    mask in a scoring pass), and gives the logits it gave through torch's SDPA."""
    from quantkit.kernels import triton_causal_attention as kernel
    from quantkit.runtime import load_model, logits
    from test_runtime import token_ids

    model = load_model(ggufs("qwen3_moe", "mixed"), device="cuda")
    model.graphs = False
    ids = token_ids("qwen3_moe", 64)
    calls = []
    original = kernel.causal_attention
    monkeypatch.setattr(kernel, "causal_attention", lambda *a: calls.append(1) or original(*a))
    ours = logits(model, ids)
    layers = sum(type(m).__name__ == "Qwen3MoeDecoderLayer" for m in model.module.modules())
    assert len(calls) == layers
    monkeypatch.setattr(kernel, "fits", lambda *a: False)
    torch_sdpa = logits(model, ids)
    assert float(np.abs(ours - torch_sdpa).max()) <= 1e-4 * float(np.abs(torch_sdpa).max())


def _hyper_connection(hidden: int, seed: int):
    """transformers' DeepSeek V4 hyper-connection module (GLM-5.3's is the same code) with random parameters."""
    from types import SimpleNamespace

    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    config = SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=hidden)
    module = DeepseekV4HyperConnection(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.fn.copy_(torch.randn(module.fn.shape, generator=gen) * (4 * hidden) ** -0.5)
        module.base.copy_(torch.randn(module.base.shape, generator=gen))
        module.scale.copy_(torch.rand(3, generator=gen) * 2)
    return module.cuda()


@pytest.mark.parametrize("hidden,tokens", [(320, 37), (2048, 300)])
def test_hyper_connection_kernel_is_as_close_to_float64_as_transformers(hidden, tokens, monkeypatch):
    """The one-launch hyper-connection weights, Sinkhorn and collapse (their map's norm applied to its outputs)
    against transformers' module in float64: no further from it than a few times transformers' own float32
    error, plus a few ulps of the largest value."""
    from quantkit.kernels import triton_hyper
    from quantkit.runtime.hyper import hyper_connection

    module = _hyper_connection(hidden, tokens)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    h = torch.randn(1, tokens, 4, hidden, generator=gen, device="cuda") * 3
    launches = []
    weights = triton_hyper.hyper_weights
    monkeypatch.setattr(triton_hyper, "hyper_weights", lambda *a: launches.append(1) or weights(*a))
    with torch.no_grad():
        ours = hyper_connection(module, module.forward, h)
        theirs = module.forward(h)
        want = module.double().forward(h.double())
    assert launches == [1]
    for got, mine, ref in zip(theirs, ours, want):
        assert mine.shape == ref.shape and mine.dtype == torch.float32
        their_error = float((got.double() - ref).abs().max())
        assert float((mine.double() - ref).abs().max()) <= 4 * their_error + 2.0 ** -22 * float(ref.abs().max())


def test_hyper_mix_kernel_equals_transformers_mix_within_float32_rounding():
    """The streams after a block, one launch: ``post_k y + sum_j comb[j, k] h_j`` within 2^-21 of the sum of the
    terms' magnitudes of float64 (five float32 roundings at most)."""
    from quantkit.kernels import triton_hyper

    gen = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(2, 45, 4, 320, generator=gen, device="cuda")
    y = torch.randn(2, 45, 320, generator=gen, device="cuda")
    post = torch.rand(2, 45, 4, generator=gen, device="cuda") * 2
    comb = torch.rand(2, 45, 4, 4, generator=gen, device="cuda")
    got = triton_hyper.hyper_mix(h, y, post, comb).double()
    h, y, post, comb = h.double(), y.double(), post.double(), comb.double()
    want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), h)
    size = post.abs().unsqueeze(-1) * y.abs().unsqueeze(-2) + torch.matmul(comb.abs().transpose(-1, -2), h.abs())
    assert bool(((got - want).abs() <= 2.0 ** -21 * size).all())


def test_cuda_deepseek_v4_mixes_streams_and_projects_groups_fused(ggufs, monkeypatch):
    """On CUDA a DeepSeek V4 pass computes every hyper-connection and every mix of the streams with the Triton
    kernels, and multiplies the grouped output projection packed, group by group (its weight never built)."""
    from quantkit.kernels import triton_hyper
    from quantkit.runtime import load_model, logits
    from quantkit.runtime.packed import Assembler
    from test_runtime import token_ids

    model = load_model(ggufs("deepseek_v4", "mixed"), device="cuda")
    ids = token_ids("deepseek_v4", 64)
    logits(model, ids)
    model.graphs = False
    calls, built = [], []
    for name in ("hyper_weights", "hyper_mix"):
        original = getattr(triton_hyper, name)
        monkeypatch.setattr(triton_hyper, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    original_build = Assembler.build
    monkeypatch.setattr(Assembler, "build", lambda self, plan, *a, **k: built.append(plan.name) or
                        original_build(self, plan, *a, **k))
    logits(model, ids)
    layers = sum(type(m).__name__ == "DeepseekV4DecoderLayer" for m in model.module.modules())
    assert calls.count("hyper_weights") == 2 * layers and calls.count("hyper_mix") == 2 * layers
    assert not [name for name in built if "o_a_proj" in name]


def test_cuda_16k_token_nll_equals_the_chunked_reference(ggufs, monkeypatch):
    """Issue 16's long-context check on CUDA: 16384 tokens scored in one pass (fused packed products, the
    one-launch causal attention) against the chunked reference (weights decoded, then multiplied; 2048-token
    chunks through transformers' KV cache and SDPA): NLL equal within test_runtime_long's bounds (mean 1e-3
    relative, each token 1e-3 but FLIPPED_TOKENS), and the pass adds less device memory than a quarter of one
    layer's [heads, n, n] float32 scores."""
    from quantkit.runtime import load_model, logits
    from quantkit.runtime.packed import WeightStore
    from test_runtime_long import FLIPPED_TOKENS, LONG_TOKENS, assert_same_nll, chunked_logits, token_nll

    n = LONG_TOKENS
    path = ggufs("qwen3_moe", "mixed")
    model = load_model(path, device="cuda")
    ids = np.random.default_rng(16).integers(0, model.vocab_size, n)
    logits(model, ids[:64].tolist())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    full = torch.from_numpy(logits(model, ids.tolist())).cuda()
    added = torch.cuda.max_memory_allocated() - base
    heads = model.module.config.num_attention_heads
    model.close()

    monkeypatch.setattr(WeightStore, "fusable", lambda self, name: None)
    ref_model = load_model(path, device="cuda")
    ref = chunked_logits(ref_model, ids)
    ref_model.close()
    got, want = token_nll(full, ids), token_nll(ref, ids)
    print("16K NLL", float(got.mean()), float(want.mean()), "max token diff", float((got - want).abs().max()),
          "tokens beyond 1e-3", int(((got - want).abs() > 1e-3).sum()), "added MiB", added / 2**20)
    assert_same_nll(got, want, FLIPPED_TOKENS)
    assert added < heads * n * n * 4 / 4


def test_cuda_graph_replays_equal_eager_passes(ggufs, tmp_path):
    """A shape repeated back to back is captured as a CUDA graph and replayed (load_model on CUDA in float32); shapes
    that alternate stay eager.  Each replay gives the logits of the eager pass of the same ids bit for bit (same
    kernels, same order; the ids are copied in), and the token embedding rows a replay decodes are still checked: a
    NaN row first looked up in a replay raises, naming the tensor."""
    import shutil

    from quantkit.errors import FormatError
    from quantkit.io.gguf_reader import GGUFFile
    from quantkit.runtime import load_model, logits
    from test_runtime import token_ids

    src = ggufs("qwen3_moe", "mixed")
    bad = tmp_path / "nan-row.gguf"
    shutil.copy(src, bad)
    ids = token_ids("qwen3_moe", 64)
    with GGUFFile(src) as f:
        embd = f.tensor("token_embd.weight")
        row = next(r for r in range(embd.shape[0]) if r not in ids)
        offset = f.data_offset + embd.offset + row * embd.row_bytes
    with open(bad, "r+b") as fh:        # the first Q8_0 block of the row: d = NaN
        fh.seek(offset)
        fh.write(np.array([0x7E00], np.uint16).tobytes())
    model = load_model(bad, device="cuda")
    other = ids[1:] + ids[:1]
    first = logits(model, ids)          # decodes every payload once (finiteness)
    second = logits(model, other)       # eager, nothing decoded for the first time: the shape may be captured
    assert model._graph is None
    assert np.array_equal(logits(model, ids), first)
    assert model._graph is not None and model._graph.checks
    assert np.array_equal(logits(model, other), second)
    captured = model._graph
    shorter = logits(model, ids[:-2])   # shapes that alternate run eager: the graph of the repeated one stays
    assert np.array_equal(logits(model, ids), first) and model._graph is captured
    assert np.array_equal(logits(model, ids[:-2]), shorter) and model._graph is captured
    with pytest.raises(FormatError, match="token_embd.weight"):
        logits(model, ids[:-1] + [row])
    model.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_cuda_graph_captures_every_architecture(ggufs, arch):
    """Every architecture's scoring pass is captured as a CUDA graph (nothing in it waits for the device; GLM-5.3's
    indexer pooling did, and its passes all ran eagerly) and a replay gives the eager pass's logits bit for bit."""
    from quantkit.runtime import load_model, logits
    from test_runtime import token_ids

    model = load_model(ggufs(arch, "mixed"), device="cuda")
    ids = token_ids(arch, 64)
    eager = [logits(model, ids) for _ in range(2)]      # the first decodes every payload once; the second is eager
    replayed = logits(model, ids)
    assert model.graphs and model._graph is not None, arch
    assert np.array_equal(eager[1], replayed) and np.array_equal(logits(model, ids), replayed)
    model.close()


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


@pytest.mark.parametrize("arch", ["deepseek_v4", "glm5_next", "qwen4_exp"])
def test_cuda_long_seed_sequences_run_in_chunks_with_linear_memory(ggufs, arch, monkeypatch):
    """A long seed-architecture sequence on CUDA runs in chunks through the cache (512 tokens here): the device
    memory a pass adds grows linearly (4096 -> 8192 tokens: at most 2.5x), and its logits equal the CPU
    runtime's.  DeepSeek V4's with the packed products in plain float32 (``ieee``); with the default bf16x3
    products its logits move by up to 9.4e-2 of the largest at one position past ~1K tokens, in one pass as in
    chunks (H200, 2026-12-03; cause not found: bench/results/seed-cuda-2026-12-03.md), so those are held to
    the CPU's by their NLL and top-1."""
    from quantkit.kernels import triton_matmul
    from quantkit.runtime import load_model, loader, logits
    from test_runtime import RELATIVE_TOLERANCE, token_ids
    from test_runtime_long import token_nll

    monkeypatch.setattr(loader, "LONG_PASS_TOKENS", 512)
    monkeypatch.setattr(loader, "LONG_CHUNK", 512)
    model = load_model(ggufs(arch, "mixed"), device="cuda")
    ids = token_ids(arch, 8192)
    logits(model, ids[:64])
    added = {}
    for n in (4096, 8192):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        assert np.isfinite(logits(model, ids[:n])).all()
        added[n] = torch.cuda.max_memory_allocated() - base
    print(arch, added)
    assert added[8192] <= 2.5 * added[4096]
    cuda = logits(model, ids[:1536])
    cpu = logits(load_model(ggufs(arch, "mixed")), ids[:1536])
    if arch == "deepseek_v4":
        monkeypatch.setattr(triton_matmul, "FLOAT32_PRECISION", "ieee")
        exact = logits(load_model(ggufs(arch, "mixed"), device="cuda"), ids[:1536])
        assert float(np.abs(exact - cpu).max()) <= RELATIVE_TOLERANCE * float(np.abs(cpu).max())
    else:
        assert float(np.abs(cuda - cpu).max()) <= RELATIVE_TOLERANCE * float(np.abs(cpu).max())
    got, want = (token_nll(torch.from_numpy(x), np.asarray(ids[:1536])) for x in (cuda, cpu))
    print(arch, "mean NLL", float(got.mean()), float(want.mean()), "top-1 agreement",
          float((cuda.argmax(-1) == cpu.argmax(-1)).mean()))
    assert abs(float(got.mean()) - float(want.mean())) <= 1e-4 * abs(float(want.mean()))
    assert float((cuda.argmax(-1) == cpu.argmax(-1)).mean()) >= 0.99


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


def test_cuda_scoring_normalizes_beside_the_pass_as_the_host_does(ggufs):
    """On CUDA, score's log-normalizers are computed beside the forward pass (graph replays included: equal shapes
    repeat); the cases' scores equal those of the same logits normalized on the host, within float64 rounding."""
    from quantkit.runtime import load_model
    from quantkit.scoring.loading import RuntimeSource
    from quantkit.scoring.score import PreparedCase, run_cases
    from quantkit.scoring.source import ModelIdentity
    from test_runtime import token_ids

    ids = token_ids("qwen3_moe", 200)
    cases = [PreparedCase(f"c{i}", tuple(ids[i:i + 5]), tuple(ids[i + 5:i + 40]), None) for i in range(0, 120, 8)]
    source = RuntimeSource(load_model(ggufs("qwen3_moe", "mixed"), device="cuda"), ModelIdentity())

    class HostNormalized:       # the same source without start_normalized_many: arrays, normalized on the host
        logits, start_logits_many = source.logits, source.start_logits_many

    on_device, _ = run_cases(source, cases, batch_tokens=80)     # two 40-token cases a pass
    on_host, _ = run_cases(HostNormalized(), cases, batch_tokens=80)
    assert source.model._graph is not None
    for a, b in zip(on_device, on_host):
        assert a.nll == pytest.approx(b.nll, rel=1e-12)
        assert (a.first_match, a.greedy_lcp, a.target_tokens) == (b.first_match, b.greedy_lcp, b.target_tokens)
    source.close()
