"""GGUF dialects: tiny models converted with ``--dialect ds4`` against the names, shapes and keys ds4's loaders
read (tests/data/dialects/*.tsv, each row citing its source), and lossless ``redialect`` round trips."""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit.arch.dialects import (DS4, LLAMA_CPP, dialect_of, to_dialect_name, to_llamacpp_name)
from quantkit.cli import main
from quantkit.convert.execute import ConvertRequest, convert
from quantkit.convert.redialect import redialect
from quantkit.errors import UnsupportedError
from quantkit.io.gguf import type_name
from quantkit.io.gguf_reader import GGUFFile
from quantkit.io.gguf_writer import GGUFWriter, plan_layout
from test_arch import PRE_TOKENIZER

DATA = Path(__file__).parent / "data" / "dialects"


def _rows(name: str) -> list[dict[str, str]]:
    with open(DATA / name, newline="") as f:
        lines = [line for line in f if line.strip()]
    header = lines[0].lstrip("# ").rstrip("\n").split("\t")
    return [dict(zip(header, r)) for r in csv.reader(lines[1:], delimiter="\t")]


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    """The tiny GLM-5.3-Flash with an indexer on every sparse-attention layer (ds4's dialect cannot say 'shared')."""
    from quantkit.testing import tiny_models

    original = tiny_models.ARCHS["glm5_next"]

    def make_config(ids):
        config = original.make_config(ids)
        config.text_config.indexer_types = ["full"] * config.text_config.num_hidden_layers
        return config

    tiny_models.ARCHS["glm5_next"] = dataclasses.replace(original, make_config=make_config)
    try:
        return tiny_models.save_tiny_checkpoint("glm5_next", tmp_path_factory.mktemp("glm") / "ckpt")
    finally:
        tiny_models.ARCHS["glm5_next"] = original


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_checkpoints, glm_checkpoint):
    """(arch, dialect) -> a Q8_0 GGUF of the tiny model in that dialect."""
    out = tmp_path_factory.mktemp("dialects")
    sources = {"glm5-next": ("glm5_next", glm_checkpoint),
               "deepseek4": ("deepseek_v4", tiny_checkpoints.get("deepseek_v4"))}
    files = {}
    for arch, (model_type, source) in sources.items():
        for dialect in (LLAMA_CPP, DS4):
            path = out / f"{arch}-{dialect}.gguf"
            convert(ConvertRequest(source=str(source), out=path, recipe="q8_0", jobs=1, progress=False,
                                   pre_tokenizer=PRE_TOKENIZER[model_type], dialect=dialect))
            files[arch, dialect] = path
    return files


def _glm_symbols(md) -> dict[str, int]:
    a = "glm5-next."
    v = lambda k: md[a + k].value  # noqa: E731
    hc = v("hyper_connection.count")
    return {"E": v("embedding_length"), "V": v("vocab_size"), "H": v("attention.head_count"),
            "D": v("linear_attention.head_dimension"), "K": v("linear_attention.conv_kernel"), "HC": hc,
            "MIX": (2 + hc) * hc, "QL": v("attention.q_lora_rank"), "KVL": v("attention.kv_lora_rank"),
            "NOPE": v("attention.key_length"), "VD": v("attention.value_length"),
            "IH": v("attention.indexer.head_count"), "ID": v("attention.indexer.key_length"),
            "X": v("expert_count"), "EF": v("expert_feed_forward_length"), "FF": v("feed_forward_length"),
            "S": v("expert_shared_count")}


def _dims(expr: str, symbols: dict[str, int]) -> tuple[int, ...]:
    return tuple(int(eval(part, {"__builtins__": {}}, symbols)) for part in expr.split(","))  # noqa: S307


def _type_ok(kv, spec: str) -> bool:
    """``spec``: a GGUF type name, alternatives joined by ``|`` (``FLOAT32|UINT32``, ``ARRAY[INT32|UINT32]``)."""
    array = spec.startswith("ARRAY[")
    alternatives = spec[len("ARRAY["):-1].split("|") if array else spec.split("|")
    return type_name(kv.type) in {f"ARRAY[{a}]" if array else a for a in alternatives}


def _census(path: Path, reference: Path, rows: list[dict[str, str]], block_kind, symbols_of):
    with GGUFFile(path) as ds4, GGUFFile(reference) as ref:
        md = ds4.metadata
        assert dialect_of(md) == DS4
        arch = md["general.architecture"].value
        keys = [r for r in rows if r["kind"] == "key"]
        for r in keys:
            assert r["ds4_name"] in md, r["ds4_name"]
            assert _type_ok(md[r["ds4_name"]], r["ds4_type"]), (r["ds4_name"], md[r["ds4_name"]].type)
        if arch == "glm5-next":   # the exact key set: nothing else in the model's namespace
            assert {k for k in md if k.startswith(arch + ".")} == {r["ds4_name"] for r in keys}
        symbols = symbols_of(md)
        blocks = md[arch + ".block_count"].value
        expected = {}
        for r in (r for r in rows if r["kind"] == "tensor"):
            layers = [None] if "{L}" not in r["ds4_name"] else \
                [L for L in range(blocks) if r["blocks"] in block_kind(md, L)]
            for L in layers:
                expected[r["ds4_name"].replace("{L}", str(L))] = r
        optional = {n for n, r in expected.items() if r["blocks"] == "optional"}
        assert set(ds4.tensors) - optional == set(expected) - optional
        ref_types = {n: t.type for n, t in ref.tensors.items()}
        for name, t in ds4.tensors.items():
            r = expected[name]
            llama_name = to_llamacpp_name(name, arch)
            assert t.type == ref_types[llama_name], name     # the recipe's type, whatever the dialect
            want = tuple(reversed(ref.tensors[llama_name].shape)) if r["ds4_ggml_dims"] == "=llama.cpp" \
                else _dims(r["ds4_ggml_dims"], symbols)
            assert tuple(reversed(t.shape)) == want, (name, tuple(reversed(t.shape)), want)


def _glm_blocks(md, layer: int) -> set[str]:
    a = "glm5-next."
    kinds = {"all"}
    trunk = md[a + "trunk_block_count"].value
    kinds.add("trunk" if layer < trunk else "nextn")
    kinds.add("linear" if md[a + "layer_types"].value[layer] == 0 else "attention")
    kinds.add("dense" if layer < md[a + "leading_dense_block_count"].value else "moe")
    return kinds


def _v4_blocks(md, layer: int) -> set[str]:
    ratio = list(md["deepseek4.attention.compress_ratios"].value)[layer]
    kinds = {"all", "optional"}
    if ratio:
        kinds.add("compressed")
    if ratio == 4:
        kinds.add("ratio4")
    if layer < md["deepseek4.hash_layer_count"].value:
        kinds.add("hash")
    return kinds


def test_glm_ds4_census(converted):
    _census(converted["glm5-next", DS4], converted["glm5-next", LLAMA_CPP], _rows("ds4_glm5_next.tsv"),
            _glm_blocks, _glm_symbols)


def test_deepseek_v4_ds4_census(converted):
    rows = [r for r in _rows("ds4_deepseek4.tsv") if r["kind"] != "unsupported"]
    _census(converted["deepseek4", DS4], converted["deepseek4", LLAMA_CPP], rows, _v4_blocks, lambda md: {})


@pytest.mark.parametrize("arch", ["glm5-next", "deepseek4"])
def test_redialect_round_trip_is_byte_identical(converted, tmp_path, arch):
    llama = converted[arch, LLAMA_CPP]
    ds4 = tmp_path / "ds4.gguf"
    back = tmp_path / "back.gguf"
    there = redialect(llama, ds4, to=DS4)
    assert there.source_dialect == LLAMA_CPP
    redialect(ds4, back, to=LLAMA_CPP)
    assert back.read_bytes() == llama.read_bytes()
    # and a file converted in ds4's dialect is, in llama.cpp's, the file converted in llama.cpp's
    from_ds4 = tmp_path / "from_ds4.gguf"
    redialect(converted[arch, DS4], from_ds4, to=LLAMA_CPP)
    assert from_ds4.read_bytes() == llama.read_bytes()


def test_redialect_refuses_an_unmapped_tensor_by_name(converted, tmp_path):
    with GGUFFile(converted["glm5-next", LLAMA_CPP]) as f:
        metadata = list(f.metadata.items())
    bad = tmp_path / "bad.gguf"
    layout = plan_layout(metadata, [("blk.0.mystery_proj.weight", (4, 32), "F32")])
    with GGUFWriter(bad, layout) as w:
        w.write_header()
        w.write_tensor("blk.0.mystery_proj.weight", bytes(4 * 32 * 4))
        w.finish()
    out = tmp_path / "out.gguf"
    result = CliRunner().invoke(main, ["redialect", str(bad), "--to", "ds4", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "blk.0.mystery_proj.weight" in result.output
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_ds4_dialect_refuses_qwen4exp_with_the_reason():
    with pytest.raises(UnsupportedError, match="qwen38-next"):
        to_dialect_name("blk.0.attn_qkv.weight", "qwen4exp", DS4)


def test_names_both_ways():
    assert to_llamacpp_name("blk.3.kda_q_conv.weight", "glm5-next") == "blk.3.ssm_conv1d_q.weight"
    assert to_llamacpp_name("blk.3.kda_output.weight", "glm5-next") == "blk.3.attn_output.weight"
    assert to_dialect_name("blk.3.attn_output.weight", "glm5-next", DS4, linear_layers={3}) == \
        "blk.3.kda_output.weight"
    assert to_dialect_name("blk.4.attn_output.weight", "glm5-next", DS4, linear_layers={3}) == \
        "blk.4.attn_output.weight"
    assert to_dialect_name("blk.4.indexer_compressor_gate.weight", "glm5-next", DS4, linear_layers=()) == \
        "blk.4.indexer.pool_gate.weight"
