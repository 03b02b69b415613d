"""``arithmetic="ggml-cpu"`` against llama.cpp (llama-cpp-python, F32 KV cache, every position's logits) on F16
files of the tiny GLM-5.3-Flash and DeepSeek V4, where ggml's F16 activation rounding applies to every product.

GLM-5.3's attention is nope-only MLA over the indexer's selection; llama.cpp runs it absorbed (``attn_k_b`` into
the query, ``attn_v_b`` after, scores against the latent).  transformers' expanded form, with the activations
rounded to F16 as ggml rounds them, moved layer 1's attention output by ~1e-4, which flipped a near-tie (1.6e-5
apart in the biased router probability) in the expert choice at position 14 of the random tokens below: ggml-cpu
logits 0.51 from llama.cpp's there, while float32's stayed within 1.2e-3.  With the attention absorbed as llama.cpp
runs it (:func:`quantkit.runtime.mla.sparse_absorbed_forward`) every position is within 1e-3, closer than float32.

DeepSeek V4's grouped output projection (``o_a_proj``, transformers' ``bmm`` of a view of the weight) went with
unrounded activations, 1e-4 from llama.cpp's F16 product (``attn_wo_a``) at the first layer; that flipped a near-tie
in layer 1's expert choice at position 12 (6e-5 apart in the biased router probability): ggml-cpu logits 0.36 from
llama.cpp's there, float32's 0.069 (position 47).  With the groups multiplied in ggml as llama.cpp's 3-D
``ggml_mul_mat`` does every position is within 1e-3 (8.6e-4).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from quantkit.runtime import load_model, logits  # noqa: E402
import llama_cpu  # noqa: E402
from test_convert_interop import convert, llama_logits  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.slow]

#: Every matrix F16; the source-precision classes (hyper-connections, indexer) keep the checkpoint's BF16.
F16_RECIPE = """name = "f16-ggml-interop"
architectures = ["{arch}"]
[defaults]
type = "F16"
"""
#: Random byte tokens (never special), as the audit that found the flip ran them.
TOKENS = 64
#: Largest |logit difference| from llama.cpp allowed to ggml-cpu arithmetic (measured: GLM-5.3 7.3e-4, float32
#: 1.2e-3; DeepSeek V4 8.6e-4, float32 0.069).
GGML_TOLERANCE = 1e-3


@pytest.fixture(scope="module", params=["glm5_next", "deepseek_v4"])
def f16_file(request, tiny_checkpoints, tmp_path_factory):
    arch = request.param
    work = tmp_path_factory.mktemp("ggml-cpu-interop")
    source = tiny_checkpoints.get(arch, "per-expert", "bf16")
    return convert(work, source, work / f"{arch}-f16.gguf", F16_RECIPE.format(arch=arch), arch)


def test_ggml_cpu_logits_are_llama_cpps(f16_file, monkeypatch):
    """ggml-cpu logits within :data:`GGML_TOLERANCE` of llama.cpp's at every position, and no further from them
    than float32's (printed with the position of the largest difference)."""
    from quantkit.runtime import ggml_arithmetic

    monkeypatch.setattr(ggml_arithmetic, "REPACK", llama_cpu.repack())   # as llama_logits places the weights
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 256, TOKENS)]
    theirs = llama_logits(f16_file, tokens)
    ggml = np.abs(logits(load_model(f16_file, arithmetic="ggml-cpu"), tokens) - theirs).max(axis=1)
    plain = np.abs(logits(load_model(f16_file), tokens) - theirs).max(axis=1)
    assert ggml.max() <= GGML_TOLERANCE, f"ggml-cpu {ggml.max():.3g} at position {int(ggml.argmax())}"
    assert ggml.max() <= plain.max(), f"ggml-cpu {ggml.max():.3g}, float32 {plain.max():.3g}"
