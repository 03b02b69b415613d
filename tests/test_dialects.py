"""GGUF dialects: tiny models converted with ``--dialect ds4`` against the names, shapes and keys ds4's loaders
read (tests/data/dialects/*.tsv, each row citing its source), and lossless ``redialect`` round trips."""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.arch.dialects import (DS4, LLAMA_CPP, dialect_of, to_dialect_name, to_llamacpp_name)
from quantkit.cli import main
from quantkit.convert.execute import ConvertRequest, convert, execute, prepare
from quantkit.convert.plan import build_plan
from quantkit.convert.redialect import redialect
from quantkit.errors import RecipeError, UnsupportedError
from quantkit.formats.registry import GGMLType
from quantkit.io.gguf import type_name
from quantkit.io.gguf_reader import GGUFFile
from quantkit.io.gguf_writer import GGUFWriter, plan_layout
from quantkit.recipes.model import parse_recipe
from test_arch import PRE_TOKENIZER

DATA = Path(__file__).parent / "data" / "dialects"


def _rows(name: str) -> list[dict[str, str]]:
    """The rows of a data file: ``#`` lines are comments, the first of them the column names."""
    with open(DATA / name, newline="") as f:
        lines = [line for line in f if line.strip()]
    header = lines[0].lstrip("# ").rstrip("\n").split("\t")
    return [dict(zip(header, r)) for r in csv.reader((line for line in lines if not line.startswith("#")),
                                                      delimiter="\t")]


def _tiny_glm(out: Path, seed: int = 0) -> Path:
    """The tiny GLM-5.3-Flash with an indexer on every sparse-attention layer (ds4's dialect cannot say 'shared')."""
    from quantkit.testing import tiny_models

    original = tiny_models.ARCHS["glm5_next"]

    def make_config(ids):
        config = original.make_config(ids)
        config.text_config.indexer_types = ["full"] * config.text_config.num_hidden_layers
        return config

    # built models are cached by (arch, seed, dtype): drop them so the patched config is used, and again after
    tiny_models._cached_model.cache_clear()
    tiny_models.ARCHS["glm5_next"] = dataclasses.replace(original, make_config=make_config)
    try:
        return tiny_models.save_tiny_checkpoint("glm5_next", out, seed=seed)
    finally:
        tiny_models.ARCHS["glm5_next"] = original
        tiny_models._cached_model.cache_clear()


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    return _tiny_glm(tmp_path_factory.mktemp("glm") / "ckpt")


@pytest.fixture(scope="module")
def sources(tiny_checkpoints, glm_checkpoint):
    """arch -> (model_type, the tiny checkpoint)."""
    return {"glm5-next": ("glm5_next", glm_checkpoint),
            "deepseek4": ("deepseek_v4", tiny_checkpoints.get("deepseek_v4"))}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, sources):
    """(arch, dialect) -> a Q8_0 GGUF of the tiny model in that dialect."""
    out = tmp_path_factory.mktemp("dialects")
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
            "S": v("expert_shared_count"), "P": v("attention.indexer.pool_size")}


def _dims(expr: str, symbols: dict[str, int]) -> tuple[int, ...]:
    return tuple(int(eval(part, {"__builtins__": {}}, symbols)) for part in expr.split(","))  # noqa: S307


def _type_ok(kv, spec: str) -> bool:
    """``spec``: a GGUF type name, alternatives joined by ``|`` (``FLOAT32|UINT32``, ``ARRAY[INT32|UINT32]``)."""
    array = spec.startswith("ARRAY[")
    alternatives = spec[len("ARRAY["):-1].split("|") if array else spec.split("|")
    return type_name(kv.type) in {f"ARRAY[{a}]" if array else a for a in alternatives}


def _same_value(ds4_kv, llama_kv) -> bool:
    """A ds4 key's value against the llama.cpp key it maps to (a per-block llama.cpp array holds one ds4 scalar)."""
    ours = np.atleast_1d(np.asarray(ds4_kv.value, dtype=np.float64))
    theirs = np.atleast_1d(np.asarray(llama_kv.value, dtype=np.float64))
    if ours.size == 1 and theirs.size > 1:
        ours = np.full(theirs.shape, ours[0])
    return ours.shape == theirs.shape and np.array_equal(ours.astype(np.float32), theirs.astype(np.float32))


def _llama_payload(ds4: GGUFFile, name: str, row: dict[str, str]) -> bytes:
    """What llama.cpp stores for a ds4 tensor: the same bytes, except ssm_a = -exp(A_log) (float64, rounded once:
    the DwarfStar header rewriter's rule)."""
    raw = bytes(ds4.data(name))
    if row["llama_cpp_name"].endswith(".ssm_a"):
        return (-np.exp(np.frombuffer(raw, "<f4").astype(np.float64))).astype("<f4").tobytes()
    return raw


def _census(path: Path, reference: Path, rows: list[dict[str, str]], block_kind, symbols_of, *, ordered: bool):
    """Every key (name, type, value against the llama.cpp key the data file maps it to) and every tensor (name,
    order, shape, type, payload against the llama.cpp tensor the data file maps it to) of the ds4-dialect file
    ``path`` against the data ``rows``; ``reference`` is the same model converted in llama.cpp's dialect.
    ``ordered``: tensors and model keys must follow the rows' order (the ds4 builder's); else the reference's."""
    with GGUFFile(path) as ds4, GGUFFile(reference) as ref:
        md = ds4.metadata
        assert dialect_of(md) == DS4
        arch = md["general.architecture"].value
        keys = [r for r in rows if r["kind"] == "key"]
        for r in keys:
            key = r["ds4_name"]
            assert key in md, key
            assert _type_ok(md[key], r["ds4_type"]), (key, md[key].type)
            if r["llama_cpp_name"] in ref.metadata:
                assert _same_value(md[key], ref.metadata[r["llama_cpp_name"]]), (key, r["llama_cpp_name"])
            elif r["llama_cpp_name"] != "-":   # a key llama.cpp's loader defaults to 0 (nextn_predict_layers)
                assert md[key].value == 0, (key, r["llama_cpp_name"])
        if ordered:   # the exact key set, in the builder's order: nothing else in the model's namespace
            assert [k for k in md if k.startswith(arch + ".")] == [r["ds4_name"] for r in keys]
        symbols = symbols_of(md)
        blocks = md[arch + ".block_count"].value
        tensor_rows = [r for r in rows if r["kind"] == "tensor"]
        first_block = next(i for i, r in enumerate(tensor_rows) if "{L}" in r["ds4_name"])
        expected = {}   # name -> (row, llama.cpp name, place in the builder's order)
        for index, r in enumerate(tensor_rows):
            layers = [None] if "{L}" not in r["ds4_name"] else \
                [L for L in range(blocks) if r["blocks"] in block_kind(md, L)]
            for L in layers:
                name = r["ds4_name"].replace("{L}", str(L))
                section = 1 if L is not None else (0 if index < first_block else 2)
                expected[name] = (r, r["llama_cpp_name"].replace("{L}", str(L)), (section, L or 0, index))
        optional = {n for n, (r, _, _) in expected.items() if r["blocks"] == "optional"}
        assert set(ds4.tensors) - optional == set(expected) - optional
        if ordered:
            assert list(ds4.tensors) == sorted(ds4.tensors, key=lambda n: expected[n][2])
        else:
            assert [expected[n][1] for n in ds4.tensors] == list(ref.tensors)
        for name, t in ds4.tensors.items():
            r, llama_name, _ = expected[name]
            assert to_llamacpp_name(name, arch) == llama_name, name     # the code's table agrees with the data
            theirs = ref.tensors[llama_name]
            want_type = theirs.type if r["ds4_type"] == "-" else GGMLType[r["ds4_type"]]   # the loader's, or the recipe's
            assert GGMLType(t.type) == GGMLType(want_type), (name, GGMLType(t.type).name)
            want = tuple(reversed(theirs.shape)) if r["ds4_ggml_dims"] == "=llama.cpp" \
                else _dims(r["ds4_ggml_dims"], symbols)
            assert tuple(reversed(t.shape)) == want, (name, tuple(reversed(t.shape)), want)
            assert _llama_payload(ds4, name, r) == bytes(ref.data(llama_name)), name


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
            _glm_blocks, _glm_symbols, ordered=True)


def test_deepseek_v4_ds4_census(converted):
    rows = [r for r in _rows("ds4_deepseek4.tsv") if r["kind"] != "unsupported"]
    _census(converted["deepseek4", DS4], converted["deepseek4", LLAMA_CPP], rows, _v4_blocks, lambda md: {},
            ordered=False)


@pytest.mark.parametrize("arch", ["glm5-next", "deepseek4"])
def test_redialect_round_trip_is_byte_identical(converted, sources, tmp_path, arch):
    llama, ds4 = converted[arch, LLAMA_CPP], converted[arch, DS4]
    there, back = tmp_path / "ds4.gguf", tmp_path / "back.gguf"
    assert redialect(llama, there, to=DS4, source=sources[arch][1]).source_dialect == LLAMA_CPP
    redialect(there, back, to=LLAMA_CPP)
    assert back.read_bytes() == llama.read_bytes()
    # and a file converted in ds4's dialect is, in llama.cpp's, the file converted in llama.cpp's, and back
    from_ds4, again = tmp_path / "from_ds4.gguf", tmp_path / "again.gguf"
    redialect(ds4, from_ds4, to=LLAMA_CPP)
    assert from_ds4.read_bytes() == llama.read_bytes()
    redialect(from_ds4, again, to=DS4, source=sources[arch][1])
    assert again.read_bytes() == ds4.read_bytes()


@pytest.mark.parametrize("arch", ["glm5-next", "deepseek4"])
def test_redialect_to_ds4_writes_the_file_convert_writes(converted, sources, tmp_path, arch):
    """llama.cpp -> ds4 is ``convert --dialect ds4``'s file byte for byte -- key order, a stash without convert's
    provenance keys, payloads, GLM's A_log read from --source (DeepSeek V4, which has none, needs no source) -- and
    validates in full against the checkpoint."""
    out = tmp_path / "ds4.gguf"
    source = str(sources[arch][1])
    glm = arch == "glm5-next"
    result = CliRunner().invoke(main, ["redialect", str(converted[arch, LLAMA_CPP]), "--to", "ds4", "-o", str(out),
                                       *(["--source", source] if glm else [])])
    assert result.exit_code == 0, result.output
    assert ("read from the source checkpoint" in result.output) == glm, result.output
    ours = np.frombuffer(out.read_bytes(), np.uint8)
    theirs = np.frombuffer(converted[arch, DS4].read_bytes(), np.uint8)
    assert ours.size == theirs.size
    differ = np.flatnonzero(ours != theirs)
    assert differ.size == 0, f"{differ.size} bytes differ from convert --dialect ds4's, the first at {differ[0]}"
    result = CliRunner().invoke(main, ["validate", str(out), "--source", source, "--payload", "full"])
    assert result.exit_code == 0, result.output


def test_redialect_to_ds4_refuses_glm_without_its_source(converted, sources, tmp_path):
    """llama.cpp's ssm_a = -exp(A_log) does not determine A_log: without the checkpoint the file was made from (or
    with another one: a different seed, another architecture) GLM is refused in one line, nothing written."""
    llama = str(converted["glm5-next", LLAMA_CPP])
    out = tmp_path / "ds4.gguf"
    other = _tiny_glm(tmp_path / "other", seed=1)
    runs = {"none": [], "seed 1": ["--source", str(other)], "V4": ["--source", str(sources["deepseek4"][1])]}
    for what, extra in runs.items():
        result = CliRunner().invoke(main, ["redialect", llama, "--to", "ds4", "-o", str(out), *extra])
        assert result.exit_code == 2, (what, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output, result.output
        assert not out.exists() and not out.with_name(out.name + ".partial").exists()
        if what == "none":
            assert "tensor 'blk.0.ssm_a'" in result.output and "--source CKPT" in result.output, result.output
        elif what == "seed 1":
            assert "tensor 'blk.0.ssm_a'" in result.output and str(other) in result.output, result.output
        else:
            assert "not the checkpoint the file was made from" in result.output, result.output
    # the source is read, never written
    before = {p.name: p.read_bytes() for p in sources["glm5-next"][1].iterdir() if p.is_file()}
    redialect(llama, out, to=DS4, source=sources["glm5-next"][1])
    assert {p.name: p.read_bytes() for p in sources["glm5-next"][1].iterdir() if p.is_file()} == before


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


def test_redialect_never_replaces_its_input(converted, tmp_path):
    """-o naming the input (or a link to it) is refused before anything is written, even with --force."""
    import shutil

    src = tmp_path / "in.gguf"
    shutil.copyfile(converted["glm5-next", LLAMA_CPP], src)
    link = tmp_path / "link.gguf"
    link.symlink_to(src)
    before = src.read_bytes()
    for out in (src, link):
        result = CliRunner().invoke(main, ["redialect", str(src), "--to", "ds4", "-o", str(out), "--force"])
        assert result.exit_code == 2 and "would overwrite an input" in result.output, result.output
    assert src.read_bytes() == before and link.resolve() == src


def test_ds4_dialect_names_refuse_qwen4exp_with_the_reason():
    with pytest.raises(UnsupportedError, match="ssm_out.*kda_output"):
        to_dialect_name("blk.0.attn_qkv.weight", "qwen4exp", DS4)


# -- Qwen3.8 Flash Next: ds4's own layout, built from the checkpoint ----------------------------------------------

@pytest.fixture(scope="module")
def qwen_converted(tmp_path_factory, tiny_checkpoints):
    """(recipe, dialect) -> the tiny qwen4_exp converted with the Q8_0 recipe or in F32, in either dialect."""
    from test_convert_interop import F32_RECIPE

    out = tmp_path_factory.mktemp("qwen38")
    source = tiny_checkpoints.get("qwen4_exp")
    f32 = out / "f32.toml"
    f32.write_text(F32_RECIPE)
    files = {}
    for recipe in ("q8_0", "f32"):
        for dialect in (LLAMA_CPP, DS4):
            path = out / f"{recipe}-{dialect}.gguf"
            convert(ConvertRequest(source=str(source), out=path, recipe=str(f32) if recipe == "f32" else recipe,
                                   jobs=1, progress=False, pre_tokenizer=PRE_TOKENIZER["qwen4_exp"], dialect=dialect))
            files[recipe, dialect] = path
    return files


def _qwen38_symbols(md) -> dict[str, int]:
    v = lambda k: int(md["qwen38-next." + k].value)  # noqa: E731
    d = v("linear_attention.head_dimension")
    return {"E": v("embedding_length"), "QK": v("linear_attention.qk_head_count") * d,
            "VD": v("linear_attention.head_count") * d, "HV": v("linear_attention.head_count"), "D": d,
            "K": v("linear_attention.conv_kernel"), "H": v("attention.head_count"), "HD": v("attention.key_length"),
            "HC": v("hyper_connection.count"), "PC": v("hyper_connection.count") * v("embedding_length")}


def _qwen38_blocks(md, layer: int) -> set[str]:
    kinds = {"all", "linear" if md["qwen38-next.layer_types"].value[layer] == 0 else "attention"}
    if layer == md["qwen38-next.ple.layer"].value:
        kinds.add("ple")
    return kinds


def _untiled(n_k: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """Index of each checkpoint row among llama.cpp's tiled rows: llama.cpp's ``_reorder_v_heads`` reshapes to
    [n_k, v_per_k, head_dim] and swaps the first two axes (conversion/qwen.py:466-490), so its row i is the
    checkpoint's row ``tiled[i]``."""
    n = n_k * v_per_k * head_dim
    tiled = np.arange(n).reshape(n_k, v_per_k, head_dim).transpose(1, 0, 2).reshape(n)
    return np.argsort(tiled)


def _from_llama(relation: str, theirs: np.ndarray, md) -> np.ndarray:
    """The values of a ds4 tensor as the data file's ``relation`` derives them from llama.cpp's F32 tensor."""
    sym = _qwen38_symbols(md)
    n_k, d = int(md["qwen38-next.linear_attention.qk_head_count"].value), sym["D"]
    v_per_k = sym["HV"] // n_k
    qk = sym["QK"]
    if relation in ("qkv_q", "conv_q"):
        return theirs[:qk]
    if relation in ("qkv_k", "conv_k"):
        return theirs[qk:2 * qk]
    if relation in ("qkv_v", "conv_v"):
        return theirs[2 * qk:][_untiled(n_k, v_per_k, d)]
    if relation == "v_rows":
        return theirs[_untiled(n_k, v_per_k, d)]
    if relation in ("v_heads", "a_log"):
        return theirs[_untiled(n_k, v_per_k, 1)]
    if relation == "v_cols":
        return theirs[:, _untiled(n_k, v_per_k, d)]
    if relation in ("query", "gate"):   # llama.cpp writes q_proj as it is: per head [query | output gate]
        heads, hd = sym["H"], sym["HD"]
        return theirs.reshape(heads, 2, hd, -1)[:, 0 if relation == "query" else 1].reshape(heads * hd, -1)
    assert relation == "same", relation
    return theirs


def test_qwen4exp_ds4_census(qwen_converted):
    """Every key and tensor of the tiny Qwen3.8 in ds4's dialect against ds4's builder (the data file): names, order,
    key types and values, tensor shapes and types, and the F32 payload of every ds4 tensor against the rows of the
    llama.cpp tensor it comes from."""
    rows = _rows("ds4_qwen4exp.tsv")
    with GGUFFile(qwen_converted["q8_0", DS4]) as ds4, GGUFFile(qwen_converted["q8_0", LLAMA_CPP]) as ref:
        md = ds4.metadata
        assert md["general.architecture"].value == "qwen38-next" and dialect_of(md) == DS4
        keys = [r for r in rows if r["kind"] == "key"]
        assert [k for k in md if k.startswith("qwen38-next.")] == [r["ds4_name"] for r in keys]
        recurrent = list(ref.metadata["qwen4exp.attention.recurrent_layers"].value)
        for r in keys:
            kv, rel = md[r["ds4_name"]], r["relation"]
            assert _type_ok(kv, r["ds4_type"]), (r["ds4_name"], kv.type)
            theirs = ref.metadata.get(r["llama_cpp_name"])
            if rel == "copy":
                assert _same_value(kv, theirs), r["ds4_name"]
            elif rel.startswith("constant:"):
                assert float(kv.value) == float(rel.split(":")[1]), r["ds4_name"]
            elif rel == "vocab":
                assert kv.value == len(ref.metadata["tokenizer.ggml.tokens"].value)
            elif rel == "nonzero":
                assert {int(v) for v in theirs.value if v} == {kv.value}, r["ds4_name"]
            elif rel == "only":
                assert list(theirs.value) == [kv.value], r["ds4_name"]
            else:
                assert rel == "layer_types" and list(kv.value) == [0 if x else 1 for x in recurrent]
        symbols = _qwen38_symbols(md)
        blocks = md["qwen38-next.block_count"].value
        tensor_rows = [r for r in rows if r["kind"] == "tensor"]
        first_block = next(i for i, r in enumerate(tensor_rows) if "{L}" in r["ds4_name"])
        expected = {}
        for index, r in enumerate(tensor_rows):
            layers = [None] if "{L}" not in r["ds4_name"] else \
                [L for L in range(blocks) if r["blocks"] in _qwen38_blocks(md, L)]
            for L in layers:
                section = 1 if L is not None else (0 if index < first_block else 2)
                expected[r["ds4_name"].replace("{L}", str(L))] = \
                    (r, r["llama_cpp_name"].replace("{L}", str(L)), (section, L or 0, index))
        assert list(ds4.tensors) == sorted(expected, key=lambda n: expected[n][2])
        for name, t in ds4.tensors.items():
            r, llama_name, _ = expected[name]
            theirs = ref.tensors[llama_name]
            want_type = theirs.type if r["ds4_type"] == "-" else GGMLType[r["ds4_type"]]
            assert GGMLType(t.type) == GGMLType(want_type), (name, GGMLType(t.type).name)
            want = tuple(reversed(theirs.shape)) if r["ds4_ggml_dims"] == "=llama.cpp" \
                else _dims(r["ds4_ggml_dims"], symbols)
            assert tuple(reversed(t.shape)) == want, (name, tuple(reversed(t.shape)), want)
    relations = {n: (r["relation"], llama) for n, (r, llama, _) in expected.items()}
    with GGUFFile(qwen_converted["f32", DS4]) as ds4, GGUFFile(qwen_converted["f32", LLAMA_CPP]) as ref:
        assert list(ds4.tensors) == sorted(expected, key=lambda n: expected[n][2])   # the same census in F32
        for name, t in ds4.tensors.items():
            relation, llama_name = relations[name]
            assert GGMLType(t.type) is GGMLType.F32 and GGMLType(ref.tensors[llama_name].type) is GGMLType.F32
            ours = np.frombuffer(bytes(ds4.data(name)), "<f4").reshape(t.shape)
            theirs = np.frombuffer(bytes(ref.data(llama_name)), "<f4").reshape(ref.tensors[llama_name].shape)
            if relation.startswith("conv_"):
                ours = ours.reshape(ours.shape[0], ours.shape[-1])   # [C, 1, K]; llama.cpp squeezed [C, K]
            want = _from_llama(relation, theirs, ds4.metadata)
            if relation == "a_log":   # llama.cpp stores -exp(A_log)
                np.testing.assert_allclose(-np.exp(ours.astype(np.float64)), want, rtol=3e-7, err_msg=name)
            else:
                assert np.array_equal(ours.reshape(-1), want.reshape(-1)), name
                assert ours.size == want.size, name


def test_qwen4exp_redialect_is_refused_naming_the_tensor(qwen_converted, tmp_path):
    for src, to in ((qwen_converted["q8_0", LLAMA_CPP], "ds4"), (qwen_converted["q8_0", DS4], "llama.cpp")):
        out = tmp_path / f"to-{to}.gguf"
        result = CliRunner().invoke(main, ["redialect", str(src), "--to", to, "-o", str(out)])
        assert result.exit_code != 0, result.output
        assert "ssm_out" in result.output and "kda_output" in result.output, result.output
        assert not out.exists()


def test_names_both_ways():
    assert to_llamacpp_name("blk.3.kda_q_conv.weight", "glm5-next") == "blk.3.ssm_conv1d_q.weight"
    assert to_llamacpp_name("blk.3.kda_output.weight", "glm5-next") == "blk.3.attn_output.weight"
    assert to_dialect_name("blk.3.attn_output.weight", "glm5-next", DS4, linear_layers={3}) == \
        "blk.3.kda_output.weight"
    assert to_dialect_name("blk.4.attn_output.weight", "glm5-next", DS4, linear_layers={3}) == \
        "blk.4.attn_output.weight"
    assert to_dialect_name("blk.4.indexer_compressor_gate.weight", "glm5-next", DS4, linear_layers=()) == \
        "blk.4.indexer.pool_gate.weight"


# -- the recipe's default dialect ---------------------------------------------------------------------------------

_DS4_RECIPE = '''name = "q8-ds4"
architectures = ["glm5_next"]
dialect = "ds4"

[defaults]
type = "Q8_0"
fallback = "BF16"
'''


def test_recipe_dialect_is_convert_default(glm_checkpoint):
    recipe = parse_recipe(_DS4_RECIPE)
    assert recipe.dialect == DS4 and recipe.to_dict()["dialect"] == DS4
    assert parse_recipe(_DS4_RECIPE.replace('dialect = "ds4"\n', "")).dialect is None
    pre = PRE_TOKENIZER["glm5_next"]
    default = build_plan(glm_checkpoint, recipe, pre_tokenizer=pre)
    assert default.dialect == DS4 and "blk.0.kda_q.weight" in {t.name for t in default.tensors}
    asked = build_plan(glm_checkpoint, recipe, pre_tokenizer=pre, dialect=LLAMA_CPP)   # --dialect wins
    assert asked.dialect == LLAMA_CPP and "blk.0.attn_q.weight" in {t.name for t in asked.tensors}


def test_recipe_dialect_must_be_known():
    with pytest.raises(RecipeError, match="dialect.*'ds5'.*llama.cpp, ds4"):
        parse_recipe(_DS4_RECIPE.replace('"ds4"', '"ds5"'))
    with pytest.raises(RecipeError, match="dialect"):
        parse_recipe(_DS4_RECIPE.replace('"ds4"', "4"))


# -- an imatrix in the ds4 dialect --------------------------------------------------------------------------------

_IMATRIX_RECIPE = '''name = "imatrix-mix"
architectures = ["glm5_next"]

[defaults]
type = "Q8_0"
fallback = "BF16"

[[rule]]
class = "routed_experts"
type = "Q2_K"

[[rule]]
class = "kda_qk"
type = "Q4_K"

[[rule]]
class = "kda_output"
type = "Q4_K"
'''


def test_ds4_dialect_with_an_imatrix_has_the_llama_cpp_payloads(glm_checkpoint, tmp_path):
    """The imatrix names tensors the llama.cpp way; a ds4-dialect conversion finds every entry under its renamed
    tensors (kda_q, kda_output ...) and writes, tensor for tensor, the llama.cpp-dialect conversion's bytes."""
    from quantkit.convert.tensors import imatrix_shapes
    from quantkit.imatrix import Entry, make_imatrix, save_imatrix
    from test_convert import decoded_outputs

    rng = np.random.default_rng(5)
    entries = {}
    for name, (row, matrices) in imatrix_shapes(decoded_outputs(glm_checkpoint)[1].values()).items():
        if name.startswith("blk."):   # what llama-imatrix collects, under llama.cpp's names
            counts = rng.integers(5, 50, matrices).astype(np.float32)
            if name == "blk.1.ffn_gate_exps.weight":
                counts[2] = 0   # an expert never observed: bootstrap importance
            entries[name] = Entry((rng.random((matrices, row)) * counts[:, None]).astype(np.float32), counts)
    imatrix = tmp_path / "imatrix.gguf"
    save_imatrix(make_imatrix(entries, datasets=["synthetic:unit-test"], chunk_count=3, chunk_size=64,
                              synthetic=True), imatrix)
    recipe = tmp_path / "imatrix-mix.toml"
    recipe.write_text(_IMATRIX_RECIPE)
    files, importance = {}, {}
    for dialect in (LLAMA_CPP, DS4):
        request = ConvertRequest(source=str(glm_checkpoint), out=tmp_path / f"{dialect}.gguf", recipe=str(recipe),
                                 imatrix=str(imatrix), allow_synthetic_imatrix=True, jobs=1, progress=False,
                                 pre_tokenizer=PRE_TOKENIZER["glm5_next"], dialect=dialect)
        prepared = prepare(request)
        importance[dialect] = sorted((to_llamacpp_name(t.name, "glm5-next") if dialect == DS4 else t.name,
                                      t.importance) for t in prepared.plan.tensors)
        files[dialect] = execute(prepared, request).path
    assert importance[DS4] == importance[LLAMA_CPP]
    used = {name for name, how in importance[DS4] if how == "imatrix"}
    assert {"blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.1.ffn_gate_exps.weight"} <= used
    with GGUFFile(files[DS4]) as ds4, GGUFFile(files[LLAMA_CPP]) as llama:
        assert dialect_of(ds4.metadata) == DS4
        for name in ds4.tensors:
            if not name.endswith(".kda_a_log.weight"):   # A_log itself; llama.cpp stores -exp(A_log)
                assert bytes(ds4.data(name)) == bytes(llama.data(to_llamacpp_name(name, "glm5-next"))), name
    back = tmp_path / "back.gguf"
    redialect(files[DS4], back, to=LLAMA_CPP)
    assert back.read_bytes() == files[LLAMA_CPP].read_bytes()


@pytest.mark.parametrize("arch", ["glm5-next", "deepseek4"])
def test_runtime_reads_a_ds4_file_as_its_llama_cpp_twin(converted, arch):
    """Foreign-file readers see a ds4-dialect file through llama.cpp's names: the same model config rebuilt from
    its keys alone and, tensor by tensor, the same values (GLM's A_log converted back to ``-exp(A_log)``,
    convolutions reshaped)."""
    from quantkit.arch.gguf_config import config_from_keys, llama_cpp_view
    from quantkit.runtime.weights import GGUFWeights

    def rebuilt_config(path):   # as for a file quantkit did not write: the quantkit.* keys left out
        f = GGUFFile(path)
        try:
            view = llama_cpp_view(f.metadata, f.tensors)
            keys = {k: v for k, v in view.metadata.items() if not k.startswith("quantkit.")}
            shapes = {n: (tuple(view.relaid[n].shape) if n in view.relaid else tuple(f.tensors[s].shape))
                      for n, s in view.stored.items()}
            return config_from_keys(keys, shapes, path)
        finally:
            f.close()

    assert rebuilt_config(converted[arch, DS4]) == rebuilt_config(converted[arch, LLAMA_CPP])
    reference, ds4 = (GGUFWeights(converted[arch, d]) for d in (LLAMA_CPP, DS4))
    try:
        assert set(ds4.tensors) == set(reference.tensors)
        for name, info in reference.tensors.items():
            assert ds4.tensors[name] == info, name
            assert np.array_equal(np.asarray(ds4.data(name)).view(np.uint8),
                                  np.asarray(reference.data(name)).view(np.uint8)), name
    finally:
        reference.close()
        ds4.close()


def test_qwen4exp_ds4_refuses_an_imatrix_for_kda_output(tiny_checkpoints):
    """llama.cpp's ssm_out has its input columns in tiled V-head order, ds4's kda_output in the checkpoint's: the
    imatrix entry collected under llama.cpp's name does not apply column for column, so the plan refuses it."""
    recipe = parse_recipe('name = "gdn-q4k"\narchitectures = ["qwen4_exp"]\n[defaults]\ntype = "Q8_0"\n'
                          'fallback = "BF16"\n[[rule]]\nclass = "gdn_output"\ntype = "Q4_K"\n')
    source = tiny_checkpoints.get("qwen4_exp")
    pre = PRE_TOKENIZER["qwen4_exp"]
    imatrix = {"blk.0.ssm_out.weight": np.ones(256, np.float32)}
    assert build_plan(source, recipe, imatrix=imatrix, pre_tokenizer=pre).dialect == LLAMA_CPP
    with pytest.raises(RecipeError, match="kda_output.*blk.0.ssm_out.weight"):
        build_plan(source, recipe, imatrix=imatrix, pre_tokenizer=pre, dialect=DS4)
    ds4 = build_plan(source, recipe, bootstrap=True, pre_tokenizer=pre, dialect=DS4)   # own weight energy: fine
    assert {t.name: t.importance for t in ds4.tensors}["blk.0.kda_output.weight"] == "bootstrap"


@pytest.mark.parametrize("recipe", ["f32", "q8_0"])
def test_runtime_reads_qwen38_next(qwen_converted, recipe):
    """A ds4-layout Qwen3.8 file (``qwen38-next``: split GDN q/k/v, split query and gate, kept PLE table) runs
    through the architecture map redirected to its own tensors (:func:`quantkit.arch.dialects.relaid_mappings`):
    the same logits as its llama.cpp-dialect twin, bit for bit (Q8_0 blocks lie inside the split rows and the
    column groups llama.cpp tiles, so both files hold the same values)."""
    from quantkit.runtime import load_model, logits

    ids = list(range(1, 40))
    twin = logits(load_model(qwen_converted[recipe, LLAMA_CPP]), ids)
    assert np.array_equal(logits(load_model(qwen_converted[recipe, DS4]), ids), twin)


def test_validate_reads_qwen38_next(qwen_converted, tiny_checkpoints):
    source = tiny_checkpoints.get("qwen4_exp")
    result = CliRunner().invoke(main, ["validate", str(qwen_converted["q8_0", DS4]), "--source", str(source),
                                       "--payload", "full"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("arch", ["glm5-next", "deepseek4"])
def test_validate_reads_ds4_files(converted, tiny_checkpoints, glm_checkpoint, arch):
    """quantkit's own ds4-dialect files re-plan in their recorded dialect and validate in full (ds4's key
    types, names and order)."""
    source = glm_checkpoint if arch == "glm5-next" else tiny_checkpoints.get("deepseek_v4")
    result = CliRunner().invoke(main, ["validate", str(converted[arch, DS4]), "--source", str(source),
                                       "--payload", "full"])
    assert result.exit_code == 0, result.output
