"""quantkit's finite-scale check equals ggml's own ``ggml_validate_row_data``, block by block, for every GGML type.

The reference is ggml itself (``quantkit.ggml_ref``).  Random blocks hit Inf/NaN scale patterns often
(1 in 32 for an f16 field); targeted blocks set every checked field, in turn, to each special value.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

from quantkit.formats.registry import GGMLType
from quantkit.formats.rowdata import SCALE_FIELDS, check_row_data, invalid_blocks

TYPES = [t for t in GGMLType if t in GGML_QUANT_SIZES]
#: f16 / bf16 / f32 / e8m0 bit patterns around the special values, and ordinary ones.
SPECIAL = {2: [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x7BFF, 0x7F80, 0x7F81, 0xFF80, 0x7F7F, 0x0000, 0x8000, 0x3C00],
           4: [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x7F7FFFFF, 0x00000000, 0x3F800000],
           8: [0x7FF0000000000000, 0x7FF8000000000000, 0x47EFFFFFE0000000, 0x47EFFFFFF0000000,
               0x47F0000000000000, 0x3FF0000000000000],
           1: [0xFF, 0xFE, 0x00, 0x7F]}


def ggml_verdicts(ggml, qtype, blocks: np.ndarray) -> np.ndarray:
    return np.array([not ggml.validate_row_data(qtype, b) for b in blocks])


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_random_blocks_match_ggml(ggml, qtype):
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.random.default_rng(int(qtype)).integers(0, 256, (3000, type_size), dtype=np.uint8)
    expected = ggml_verdicts(ggml, qtype, blocks)
    assert np.array_equal(invalid_blocks(qtype, blocks), expected)
    if SCALE_FIELDS[qtype]:
        assert 0 < expected.sum() < len(expected) or qtype in (GGMLType.NVFP4,)


def _field_width(qtype, kind: str) -> int:
    return {"f16": 2, "bf16": 2, "iq1m": 2, "f32": 4, "f64": 8, "e8m0": 1}[kind]


@pytest.mark.parametrize("qtype", [t for t in TYPES if SCALE_FIELDS[t]], ids=lambda t: t.name)
def test_special_values_in_every_field_match_ggml(ggml, qtype):
    type_size = GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(7)
    rows = []
    for offset, kind in SCALE_FIELDS[qtype]:
        width = _field_width(qtype, kind)
        for value in SPECIAL[width]:
            block = rng.integers(0, 256, type_size, dtype=np.uint8)
            for other, other_kind in SCALE_FIELDS[qtype]:   # the other fields ordinary, so only this one decides
                if other_kind in ("f16", "iq1m"):
                    block[other:other + 2] = [0x00, 0x3C]
                elif other_kind == "e8m0":
                    block[other] = 0x7F
            if kind == "iq1m":   # the scale is spread over the top nibbles of four u16
                scales = block[offset:offset + 8].view("<u2").copy()
                scales = (scales & 0x0FFF) | np.array([(value & 0xF) << 12, (value >> 4 & 0xF) << 12,
                                                       (value >> 8 & 0xF) << 12, (value >> 12 & 0xF) << 12],
                                                      dtype=np.uint16)
                block[offset:offset + 8] = scales.view(np.uint8)
            else:
                block[offset:offset + width] = np.frombuffer(int(value).to_bytes(width, "little"), np.uint8)
            rows.append(block)
    blocks = np.stack(rows)
    expected = ggml_verdicts(ggml, qtype, blocks)
    assert expected.any() and not expected.all()
    assert np.array_equal(invalid_blocks(qtype, blocks), expected)


def test_whole_rows_report_the_first_bad_block_and_count(ggml):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    data = ggml.quantize(x, GGMLType.Q4_K).reshape(-1)     # 4 blocks of 144 bytes
    assert check_row_data(GGMLType.Q4_K, data) is None and ggml.validate_row_data(GGMLType.Q4_K, data)
    data[2 * 144 + 3] = 0x7C     # dmin of block 2: 0x7Cxx is Inf/NaN
    data[3 * 144 + 1] = 0xFC     # d of block 3
    problem = check_row_data(GGMLType.Q4_K, data)
    assert (problem.first_block, problem.count) == (2, 2) and "Inf or NaN" in problem.what
    assert not ggml.validate_row_data(GGMLType.Q4_K, data)


def test_q8_1_is_refused_like_ggml(ggml):
    blocks = np.zeros((2, GGML_QUANT_SIZES[GGMLType.Q8_1][1]), dtype=np.uint8)
    assert not ggml.validate_row_data(GGMLType.Q8_1, blocks)
    assert "refuses type Q8_1" in check_row_data(GGMLType.Q8_1, blocks).what
