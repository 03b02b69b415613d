"""DeepSeek V4's MTP block kept in the main file: as llama.cpp's deepseek4 loader reads it (llama.cpp dialect) and
as ds4.c binds it (ds4 dialect, ``tests/data/dialects/ds4_deepseek4_mtp.tsv``); validated against the source;
dropped when the recipe skips class ``mtp``; refused by ``redialect``.

The references: llama.cpp itself loads the llama.cpp-dialect file with its MTP layers required (``load_mtp``;
its loader checks every name and shape and refuses extra tensors), and llama.cpp's own ``convert_hf_to_gguf.py
--mtp`` export gives the MTP block's tensors (interop test); the ds4 names, dims and types are ds4.c's, recorded
row by row in the TSV with the commit they come from.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.testing.recipe_texts import F32_RECIPE

DATA = Path(__file__).parent / "data" / "dialects" / "ds4_deepseek4_mtp.tsv"
PRE = "deepseek-v3"


def ds4_rows() -> list[dict[str, str]]:
    lines = [line for line in DATA.read_text().splitlines() if not line.startswith("#")]
    fields = ["kind", "ds4_name", "ds4_ggml_dims", "ds4_type", "relation", "source"]
    return [dict(zip(fields, row)) for row in csv.reader(lines, delimiter="\t")]


def run(*args: str):
    return CliRunner().invoke(main, [*args])


def convert(src: Path, out: Path, recipe: str, *extra: str) -> Path:
    result = run("convert", str(src), "-o", str(out), "--recipe", recipe, "--no-progress", "-j", "1",
                 "--pre-tokenizer", PRE, *extra)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from quantkit.testing.tiny_mtp import write_v4_with_mtp

    root = tmp_path_factory.mktemp("v4-mtp-main")
    src = write_v4_with_mtp(root / "v4")
    f32 = root / "f32.toml"
    f32.write_text(F32_RECIPE)
    return src, root, str(f32)


def tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def field(path: Path, key: str):
    f = gguf.GGUFReader(path).fields.get(key)
    return None if f is None else f.contents()


def f32(t: gguf.ReaderTensor) -> np.ndarray:
    assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
    return np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])


def test_llama_cpp_dialect_main_file_loads_in_llama_cpp_with_its_mtp_layer(v4):
    import ctypes

    import llama_cpp

    src, root, _ = v4
    out = convert(src, root / "main-q8.gguf", "q8_0")
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    assert field(out, "deepseek4.block_count") == n + 1
    assert field(out, "deepseek4.nextn_predict_layers") == 1
    assert f"blk.{n}.nextn.eh_proj.weight" in tensors(out)
    params = llama_cpp.llama_model_default_params()
    params.load_mtp = True   # the MTP tensors are required, with the shapes llama.cpp's loader expects
    model = llama_cpp.llama_model_load_from_file(str(out).encode(), params)
    assert model, "llama.cpp refused the main file with its MTP block"
    try:
        nextn = llama_cpp.llama_cpp._lib.llama_model_n_layer_nextn
        nextn.argtypes, nextn.restype = [ctypes.c_void_p], ctypes.c_int32
        assert nextn(model) == 1
        assert llama_cpp.llama_model_n_layer(model) == n
    finally:
        llama_cpp.llama_model_free(model)


def _dims(expr: str, sym: dict[str, int]) -> list[int]:
    return [int(eval(part, {}, dict(sym))) for part in expr.split(",")]   # the TSV's arithmetic on its symbols


def test_ds4_dialect_main_file_carries_the_mtp_block_as_ds4_binds_it(v4):
    src, root, f32_recipe = v4
    q8 = convert(src, root / "ds4-q8.gguf", "q8_0", "--dialect", "ds4")
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    sym = {"E": config["hidden_size"], "HC": config["hc_mult"], "MIX": (2 + config["hc_mult"]) * config["hc_mult"],
           "LQ": config["q_lora_rank"], "H": config["num_attention_heads"], "D": config["head_dim"],
           "OG": config["o_groups"], "LO": config["o_lora_rank"], "X": config["n_routed_experts"],
           "F": config["moe_intermediate_size"]}
    rows = ds4_rows()
    ours = tensors(q8)
    assert {name for name in ours if name.startswith("mtp.")} == {r["ds4_name"] for r in rows}
    assert not any(".nextn." in name or name.startswith(f"blk.{n}.") for name in ours)
    assert field(q8, "deepseek4.block_count") == n   # ds4.c: block_count is the trunk's
    for r in rows:
        t = ours[r["ds4_name"]]
        assert [int(d) for d in t.shape] == _dims(r["ds4_ggml_dims"], sym), r["ds4_name"]
        kind = t.tensor_type.name
        if r["ds4_type"] == "plain":
            assert kind in ("F16", "F32"), r["ds4_name"]
        elif r["ds4_type"] != "routed":
            assert kind == r["ds4_type"], r["ds4_name"]

    # payloads: the same values as llama.cpp's names for the block (main file) and its --mtp export (hc_head)
    ds4 = tensors(convert(src, root / "ds4-f32.gguf", f32_recipe, "--dialect", "ds4"))
    llama = tensors(convert(src, root / "llama-f32.gguf", f32_recipe))
    support = tensors(convert(src, root / "support-f32.gguf", f32_recipe, "--support", "mtp"))
    hidden = sym["E"]
    for r in rows:
        kind, _, leaf = r["relation"].partition(":")
        ours_values = f32(ds4[r["ds4_name"]])
        if kind == "eh":
            eh = f32(llama[f"blk.{n}.nextn.eh_proj.weight"])
            expected = eh[:, int(leaf) * hidden:(int(leaf) + 1) * hidden]
        elif kind == "blk":
            expected = f32(llama[f"blk.{n}.{leaf}"])
        else:
            expected = f32(support[leaf])
        assert np.array_equal(ours_values.view(np.uint32), np.ascontiguousarray(expected).view(np.uint32)), r


@pytest.mark.parametrize("dialect, name", [("llama.cpp", "blk.3.nextn.eh_proj.weight"),
                                           ("ds4", "mtp.0.e_proj.weight")])
def test_validate_compares_the_mtp_block_with_the_source(v4, tmp_path, dialect, name):
    src, root, _ = v4
    out = convert(src, tmp_path / "m.gguf", "q8_0", "--dialect", dialect)
    ok = run("validate", str(out), "--source", str(src), "--payload", "full")
    assert ok.exit_code == 0, ok.output
    t = tensors(out)[name]
    data = bytearray(out.read_bytes())
    data[int(t.data_offset) + 7] ^= 0x40    # a quant byte of the first Q8_0 block
    out.write_bytes(bytes(data))
    bad = run("validate", str(out), "--source", str(src), "--payload", "full", "--report", str(tmp_path / "r.json"))
    assert bad.exit_code == 1, bad.output
    report = json.loads((tmp_path / "r.json").read_text())
    failed = [c for c in report["checks"] if c["status"] == "failed"]
    assert any(name in c["detail"] for c in failed), failed


def test_a_recipe_skipping_mtp_writes_the_trunk_alone(v4, tmp_path):
    src, root, _ = v4
    recipe = tmp_path / "skip.toml"
    recipe.write_text('name = "skip-mtp"\narchitectures = ["deepseek_v4"]\nskip = ["mtp"]\n\n[defaults]\n'
                      'type = "Q8_0"\n')
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for dialect in ("llama.cpp", "ds4"):
        out = convert(src, tmp_path / f"{dialect}.gguf", str(recipe), "--dialect", dialect)
        names = tensors(out)
        assert not any(x.startswith(("mtp.", f"blk.{n}.")) for x in names), dialect
        assert field(out, "deepseek4.block_count") == n
        assert field(out, "deepseek4.nextn_predict_layers") is None


def test_redialect_refuses_the_mtp_block_naming_why(v4, tmp_path):
    src, root, _ = v4
    for dialect, to in (("llama.cpp", "ds4"), ("ds4", "llama.cpp")):
        made = convert(src, tmp_path / f"{dialect}.gguf", "q8_0", "--dialect", dialect)
        result = run("redialect", str(made), "-o", str(tmp_path / f"to-{to}.gguf"), "--to", to)
        assert result.exit_code != 0, result.output
        assert "convert it from the source checkpoint" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
        assert not (tmp_path / f"to-{to}.gguf").exists()


@pytest.mark.interop
@pytest.mark.slow
def test_mtp_block_of_the_main_file_equals_llama_cpp_mtp_export(v4, tmp_path):
    from test_arch import run_converter
    from test_support import v4_recipe

    src, root, _ = v4
    theirs = tmp_path / "mtp-converter.gguf"
    run_converter(src, theirs, PRE, "--mtp")
    ours = convert(src, tmp_path / "main.gguf", v4_recipe(tmp_path / "r.toml"))
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    a, b = tensors(ours), tensors(theirs)
    block = {name for name in b if name.startswith(f"blk.{n}.")}
    assert block and block <= set(a)
    for name in block:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert a[name].data.tobytes() == b[name].data.tobytes(), name
    for key in ("deepseek4.block_count", "deepseek4.nextn_predict_layers", "deepseek4.attention.compress_ratios",
                "deepseek4.swiglu_clamp_exp"):
        assert field(ours, key) == field(theirs, key), key


def test_ds4_mtp_support_file_holds_what_ds4_binds_and_pairs_only_with_its_checkpoint(v4, tmp_path):
    from quantkit.testing.tiny_mtp import write_v4_with_mtp

    src, root, _ = v4
    support = convert(src, tmp_path / "mtp-ds4.gguf", "q8_0", "--dialect", "ds4", "--support", "mtp")
    assert set(tensors(support)) == {r["ds4_name"] for r in ds4_rows()}   # ds4.c binds nothing else from it
    assert field(support, "quantkit.support.kind") == "mtp"
    # the shipped recipe of ds4's MTP file (Q4_K experts, Q8_0, F32): every type ds4.c requires, in its dialect
    shipped_path = convert(src, tmp_path / "mtp-shipped.gguf", "deepseek-v4-flash-mtp-q4k", "--support", "mtp")
    shipped = tensors(shipped_path)
    # the recipe is for the MTP file: it implies --support mtp (never the main model) and refuses another kind
    implied = convert(src, tmp_path / "mtp-implied.gguf", "deepseek-v4-flash-mtp-q4k")
    assert implied.read_bytes() == shipped_path.read_bytes()
    other_kind = run("convert", str(src), "-o", str(tmp_path / "d.gguf"), "--recipe", "deepseek-v4-flash-mtp-q4k",
                     "--support", "dspark", "--pre-tokenizer", PRE)
    assert other_kind.exit_code == 2 and "writes the mtp support file, not dspark" in other_kind.output
    for r in ds4_rows():
        kind = shipped[r["ds4_name"]].tensor_type.name
        wanted = {"plain": ("F16", "F32"), "routed": ("Q4_K",)}.get(r["ds4_type"], (r["ds4_type"],))
        assert kind in wanted, (r["ds4_name"], kind)
    target = convert(src, tmp_path / "target-ds4.gguf", "q8_0", "--dialect", "ds4")
    ok = run("validate", str(support), "--source", str(src), "--payload", "full", "--target", str(target))
    assert ok.exit_code == 0, ok.output
    other = write_v4_with_mtp(tmp_path / "other", seed=1)
    foreign = convert(other, tmp_path / "other-ds4.gguf", "q8_0", "--dialect", "ds4")
    bad = run("validate", str(support), "--source", str(src), "--target", str(foreign))
    assert bad.exit_code == 1 and "from another one" in bad.output, bad.output


@pytest.mark.parametrize("shipped", ["deepseek-v4-flash-iq2xxs-w2q2k", "deepseek-v4-flash-layers37-42-q4k"])
def test_shipped_v4_q2_recipes_give_the_mtp_experts_q4_k_in_both_dialects(v4, tmp_path, shipped):
    """The MTP block of V4 Flash is block num_hidden_layers (transformers' default, 43); no imatrix of the trunk
    covers it, so the Q2 recipes give its experts Q4_K (ds4's MTP file) and keep their name tags."""
    from quantkit.arch.deepseek_v4 import DEFAULTS
    from quantkit.convert.plan import build_plan
    from quantkit.recipes import load_recipe

    src, root, _ = v4
    flash_mtp_block = str(DEFAULTS["num_hidden_layers"])
    text = load_recipe(shipped).text
    assert f'layers = "{flash_mtp_block}"' in text
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    recipe = tmp_path / "r.toml"
    recipe.write_text(text.replace(f'layers = "{flash_mtp_block}"', f'layers = "{n}"'))
    for dialect, prefix in (("llama.cpp", f"blk.{n}."), ("ds4", "mtp.0.")):
        plan = build_plan(src, str(recipe), dialect=dialect, pre_tokenizer=PRE, bootstrap=True)
        experts = {t.name: t.qtype.name for t in plan.tensors if t.name.startswith(prefix) and "_exps" in t.name}
        assert len(experts) == 3 and set(experts.values()) == {"Q4_K"}, experts
        assert plan.name_tag == build_plan(src, shipped, dialect=dialect, pre_tokenizer=PRE,
                                           bootstrap=True).name_tag


@pytest.mark.parametrize("dialect", ["llama.cpp", "ds4"])
def test_a_main_file_with_the_mtp_block_not_written_by_quantkit_is_proven_with_it(v4, tmp_path, dialect):
    from quantkit.testing.foreign_files import without_quantkit_keys

    src, root, _ = v4
    ours = convert(src, tmp_path / "ours.gguf", "q8_0", "--dialect", dialect)
    bare = without_quantkit_keys(ours, tmp_path / "bare.gguf")
    result = run("validate", str(bare), "--source", str(src), "--payload", "full", "--report", str(tmp_path / "r.json"))
    report = json.loads((tmp_path / "r.json").read_text())
    checks = {c["check"]: c for c in report["checks"]}
    # every tensor is proven, the hash-routing table (I32) as the copy convert makes, MTP or not
    n = len(tensors(bare))
    assert checks["payload.bytes"]["status"] == "passed" and checks["payload.bytes"]["detail"].startswith(f"{n} "), \
        checks["payload.bytes"]
    assert checks["inventory.tensors"]["status"] == checks["inventory.metadata"]["status"] == "passed", result.output
    assert result.exit_code == 0 and f"valid ({n} of {n} tensors proven)" in result.output, result.output


def test_the_runtime_runs_a_main_file_with_the_mtp_block_as_the_trunk_alone(v4, tmp_path):
    """The transformers model has no MTP block: its tensors are left aside, the metadata counting them still checks
    against the config, and the logits equal those of the same conversion without the block (with the recorded
    config, the source config, and the config rebuilt from the keys of a file without quantkit's keys)."""
    from quantkit.runtime import load_model, logits
    from quantkit.testing.foreign_files import without_quantkit_keys

    src, root, _ = v4
    recipe = tmp_path / "skip.toml"
    recipe.write_text('name = "skip-mtp"\narchitectures = ["deepseek_v4"]\nskip = ["mtp"]\n\n[defaults]\n'
                      'type = "Q8_0"\n')
    trunk = convert(src, tmp_path / "trunk.gguf", str(recipe))
    config = json.loads((src / "config.json").read_text())
    ids = list(range(3, 40))
    expected = logits(load_model(trunk), ids)
    for dialect in ("llama.cpp", "ds4"):
        out = convert(src, tmp_path / f"{dialect}.gguf", "q8_0", "--dialect", dialect)
        bare = without_quantkit_keys(out, tmp_path / f"{dialect}-bare.gguf")   # config from the keys alone
        for path, kwargs in ((out, {}), (out, {"config": config}), (bare, {})):
            got = logits(load_model(path, **kwargs), ids)
            assert np.array_equal(got, expected), (dialect, path.name, kwargs)


def test_dspark_stages_under_mtp_are_not_taken_for_an_mtp_block(v4, tmp_path):
    """llama.cpp's DeepseekV4DSparkModel (conversion/deepseek.py) reads a DSpark checkpoint's draft stages from
    ``mtp.*``: with DSpark settings in the config the main file leaves them out, as llama.cpp's main export does."""
    import shutil

    from quantkit.convert.plan import build_plan

    src, root, _ = v4
    dspark = tmp_path / "dspark"
    shutil.copytree(src, dspark)
    config = json.loads((dspark / "config.json").read_text())
    config["dspark_block_size"] = 4
    (dspark / "config.json").write_text(json.dumps(config))
    n = config["num_hidden_layers"]
    for dialect in ("llama.cpp", "ds4"):
        plan = build_plan(dspark, "q8_0", dialect=dialect, pre_tokenizer=PRE)
        assert not any(t.name.startswith(("mtp.", f"blk.{n}.")) for t in plan.tensors), dialect
        assert "deepseek4.nextn_predict_layers" not in dict(plan.metadata)
    refused = run("convert", str(dspark), "-o", str(tmp_path / "x.gguf"), "--recipe", "q8_0", "--pre-tokenizer", PRE,
                  "--support", "mtp", "--dry-run")
    assert refused.exit_code == 3 and "writes no MTP block" in refused.output, refused.output
