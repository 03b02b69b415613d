"""llama.cpp's CPU activation rounding (quantkit.runtime.ggml_arithmetic), judged by ggml itself.

* The activation type of each weight type equals ``type_traits_cpu[type].vec_dot_type``, read from ggml-cpu.c in
  the vendored llama.cpp tree.
* :func:`round_activations` equals, bit for bit, what libggml-cpu's own ``quantize_row_q8_K`` / ``q8_0`` (the SIMD
  versions the backend runs) produce, decoded by libggml-base: random rows at several scales, rows with zero
  blocks, a single outlier, a negative extreme, tiny values, all-equal rows, products on .5.

Per-token NLL parity with llama.cpp on llama.cpp-made Q4_K_M files is in tests/test_foreign.py.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from quantkit.formats.registry import GGMLType  # noqa: E402
from quantkit.runtime.ggml_arithmetic import activation_type, round_activations  # noqa: E402

pytestmark = pytest.mark.interop


def vec_dot_types(ggml_cpu_c: str) -> dict[str, str]:
    """``type_traits_cpu``: GGML type name -> its vec_dot_type name, as ggml-cpu.c declares them."""
    found = {}
    for entry in re.finditer(r"\[GGML_TYPE_(\w+)\]\s*=\s*\{(.*?)\n\s*\},", ggml_cpu_c, re.S):
        dot = re.search(r"\.vec_dot_type\s*=\s*GGML_TYPE_(\w+)", entry.group(2))
        if dot:
            found[entry.group(1)] = dot.group(1)
    return found


def test_activation_types_are_ggml_cpus(llama_cpp_src):
    declared = vec_dot_types((llama_cpp_src / "ggml/src/ggml-cpu/ggml-cpu.c").read_text())
    # weight types a GGUF holds; the activation forms themselves (Q8_*) and types quantkit has no format for
    # (Q1_0, Q2_0) are not weights quantkit meets
    weights = {name: dot for name, dot in declared.items()
               if name in GGMLType.__members__ and not name.startswith("Q8_")}
    assert len(weights) >= 24, sorted(weights)
    for name, dot in weights.items():
        assert activation_type(GGMLType[name]) == ("Q8_0" if dot == "Q8_1" else dot), name    # Q8_1 = Q8_0 values


def rows(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    out = [(rng.standard_normal(n) * scale).astype(np.float32) for scale in (1e-3, 1.0, 37.0, 1e4)]
    zeros = out[1].copy()
    zeros[:256] = 0                                            # a whole zero block
    outlier = np.full(n, 0.01, np.float32)
    outlier[n // 3] = 500.0
    negative = out[1].copy()
    negative[7] = -50.0                                        # the extreme is negative: Q8_K's scale flips sign
    tiny = (rng.standard_normal(n) * 1e-36).astype(np.float32)    # (below 127/FLT_MAX ggml's inverse overflows)
    equal = np.full(n, -0.75, np.float32)
    ties = np.tile(np.array([127.0, 0.5, -0.5, 1.5, -2.5, 63.5], np.float32), n)[:n]   # x * 127/amax on .5
    return out + [zeros, outlier, negative, tiny, equal, ties]


@pytest.mark.parametrize("kind", ["Q8_K", "Q8_0", "Q8_1"])
def test_rounding_equals_ggml_cpu(ggml, kind):
    ours_kind = "Q8_0" if kind == "Q8_1" else kind
    for i, x in enumerate(rows(1024)):
        expected = ggml.cpu_activations(kind, x)
        ours = round_activations(torch.from_numpy(x), ours_kind).numpy()
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32)), \
            f"row {i}: {int(np.sum(ours.view(np.uint32) != expected.view(np.uint32)))} values differ"


def test_rounding_keeps_shape_and_batches():
    x = torch.from_numpy(np.stack(rows(512))).reshape(2, 5, 512)
    together = round_activations(x, "Q8_K")
    assert together.shape == x.shape
    for b in range(2):
        for r in range(5):
            assert torch.equal(together[b, r], round_activations(x[b, r], "Q8_K"))


def test_lengths_that_do_not_block_are_refused():
    from quantkit.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="blocks of 256"):
        round_activations(torch.zeros(3, 300), "Q8_K")
