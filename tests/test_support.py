"""Support (drafter) files: ``convert --support mtp`` and the pairing rule of ``validate --target``.

The MTP file is checked against llama.cpp's own ``convert_hf_to_gguf.py --mtp`` export of the same checkpoint
(tensor for tensor, bytes and metadata, F32); the pairing against a target converted from the same checkpoint and
one converted from another (another seed).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.testing.recipe_texts import F32_RECIPE
from quantkit.testing.tiny_mtp import write_glm_with_nextn

PRE = "glm4"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(checkpoint with a NextN block, the same with another seed, work directory)."""
    root = tmp_path_factory.mktemp("support")
    return write_glm_with_nextn(root / "glm"), write_glm_with_nextn(root / "glm-other", seed=1), root


def convert(src: Path, out: Path, recipe: str = "q8_0", *extra: str):
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--recipe", recipe, "--no-progress",
                                       "-j", "1", "--pre-tokenizer", PRE, *extra])
    assert result.exit_code == 0, result.output
    return out


def test_mtp_support_file_holds_the_mtp_block_and_the_shared_tensors(glm):
    src, _, root = glm
    support = convert(src, root / "mtp.gguf", "q8_0", "--support", "mtp")
    main_file = convert(src, root / "main.gguf")
    ours = {t.name: t for t in gguf.GGUFReader(support).tensors}
    full = {t.name: t for t in gguf.GGUFReader(main_file).tensors}
    n = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert set(ours) == {name for name in full if name.startswith(f"blk.{n}.")} | {
        "token_embd.weight", "output_norm.weight", "output.weight"}
    assert any(name.startswith(f"blk.{n}.nextn.") for name in ours)
    for name, t in ours.items():   # the same bytes as in the target
        assert t.data.tobytes() == full[name].data.tobytes(), name
    fields = gguf.GGUFReader(support).fields
    assert fields["quantkit.support.kind"].contents() == "mtp"
    assert fields["glm5-next.nextn_predict_layers"].contents() == 1


def test_validate_pairs_a_support_file_only_with_its_own_checkpoint(glm, tmp_path):
    src, other, root = glm
    support = convert(src, root / "mtp-pair.gguf", "q8_0", "--support", "mtp")
    same = convert(src, root / "target.gguf")
    foreign = convert(other, root / "other-target.gguf")
    ok = CliRunner().invoke(main, ["validate", str(support), "--source", str(src), "--target", str(same)])
    assert ok.exit_code == 0, ok.output
    assert "support.target" in ok.output
    bad = CliRunner().invoke(main, ["validate", str(support), "--source", str(src), "--target", str(foreign),
                                    "--report", str(tmp_path / "r.json")])
    assert bad.exit_code == 1, bad.output
    report = json.loads((tmp_path / "r.json").read_text())
    failed = {c["check"]: c for c in report["checks"] if c["status"] == "failed"}
    assert set(failed) == {"support.target"}
    assert "from another one" in failed["support.target"]["detail"]
    # a target that is itself a support file, and a model file given as the support file
    twice = CliRunner().invoke(main, ["validate", str(support), "--structure-only", "--target", str(support)])
    assert twice.exit_code == 1 and "itself a mtp support file" in twice.output
    swapped = CliRunner().invoke(main, ["validate", str(same), "--structure-only", "--target", str(support)])
    assert swapped.exit_code == 1 and "is not a support file" in swapped.output


@pytest.mark.parametrize("arch, kind, message", [("deepseek_v4", "mtp", "writes no MTP block"),
                                                 ("deepseek_v4", "dspark", "holds no DSpark drafter")])
def test_support_files_the_maps_cannot_write_are_refused(tiny_checkpoints, tmp_path, arch, kind, message):
    src = tiny_checkpoints.get(arch, "official", "fp4-experts")
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "x.gguf"), "--recipe", "q8_0",
                                       "--pre-tokenizer", "deepseek-v3", "--support", kind, "--dry-run"])
    assert result.exit_code == 3, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.interop
@pytest.mark.slow
def test_mtp_support_file_equals_llama_cpp_mtp_export(glm, tmp_path):
    from test_arch import run_converter
    from test_convert_interop import metadata_differences, recipe_arg, tensor_differences

    src, _, root = glm
    theirs = tmp_path / "mtp-converter.gguf"
    run_converter(src, theirs, PRE, "--mtp")
    ours = convert(src, tmp_path / "mtp-f32.gguf", recipe_arg(tmp_path, F32_RECIPE), "--support", "mtp")
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    assert tensor_differences(a, b) == []
    assert metadata_differences(a, b) == []


def test_score_refuses_a_support_file_of_another_checkpoint_and_a_support_file_as_model(glm, tmp_path):
    src, other, root = glm
    support = convert(src, root / "mtp-score.gguf", "q8_0", "--support", "mtp")
    foreign = convert(other, root / "other-score.gguf")
    fixture = tmp_path / "fixture"
    fixture.mkdir()
    for model, extra, message in ((foreign, ["--support", str(support)], "from another one"),
                                  (support, [], "support (drafter) file, not a model")):
        result = CliRunner().invoke(main, ["score", str(model), str(fixture), str(tmp_path / "out.tsv"), "--ctx",
                                           "64", *extra])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    from quantkit.testing.tiny_mtp import write_v4_with_mtp

    return write_v4_with_mtp(tmp_path_factory.mktemp("v4-mtp") / "v4")


def v4_recipe(path: Path) -> str:
    """llama.cpp's converter's choices for V4 (test_convert_interop), and Q8_0 for the FP8 ``eh_proj`` it builds."""
    from test_convert_interop import V4_CONVERTER_RECIPE

    path.write_text(V4_CONVERTER_RECIPE + "[[rule]]\nclass = \"mtp\"\nname = 'blk\\.\\d+\\.nextn\\.eh_proj\\.weight'\n"
                                          "type = \"Q8_0\"\n")
    return str(path)


def test_v4_mtp_support_file_validates_and_pairs(v4_mtp, tmp_path):
    support = tmp_path / "v4-mtp.gguf"
    result = CliRunner().invoke(main, ["convert", str(v4_mtp), "-o", str(support), "--recipe", "q8_0", "--no-progress",
                                       "-j", "1", "--pre-tokenizer", "deepseek-v3", "--support", "mtp"])
    assert result.exit_code == 0, result.output
    names = {t.name for t in gguf.GGUFReader(support).tensors}
    assert {"blk.3.nextn.eh_proj.weight", "output_hc_fn.weight", "token_embd.weight"} <= names
    assert not any(n.startswith(("blk.0.", "blk.1.", "blk.2.")) for n in names)
    target = tmp_path / "v4.gguf"
    made = CliRunner().invoke(main, ["convert", str(v4_mtp), "-o", str(target), "--recipe", "q8_0", "--no-progress",
                                     "-j", "1", "--pre-tokenizer", "deepseek-v3"])
    assert made.exit_code == 0, made.output
    checked = CliRunner().invoke(main, ["validate", str(support), "--source", str(v4_mtp), "--payload", "full",
                                        "--target", str(target)])
    assert checked.exit_code == 0, checked.output


@pytest.mark.interop
@pytest.mark.slow
def test_v4_mtp_support_file_equals_llama_cpp_mtp_export(v4_mtp, tmp_path):
    from test_arch import run_converter
    from test_convert_interop import metadata_differences, tensor_differences

    theirs = tmp_path / "mtp-converter.gguf"
    run_converter(v4_mtp, theirs, "deepseek-v3", "--mtp")
    ours = tmp_path / "mtp-quantkit.gguf"
    recipe = v4_recipe(tmp_path / "r.toml")
    result = CliRunner().invoke(main, ["convert", str(v4_mtp), "-o", str(ours), "--recipe", recipe, "--no-progress",
                                       "-j", "1", "--pre-tokenizer", "deepseek-v3", "--support", "mtp"])
    assert result.exit_code == 0, result.output
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    assert tensor_differences(a, b) == []
    assert metadata_differences(a, b) == []


# -- the DSpark drafter (DeepSeek V4) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    from quantkit.testing.tiny_mtp import write_v4_dspark

    root = tmp_path_factory.mktemp("dspark")
    return write_v4_dspark(root / "ds"), write_v4_dspark(root / "ds-other", seed=1), root


def dspark_recipe(path: Path) -> str:
    """llama.cpp's converter's choices for V4, and for the drafter's heads: Q8_0 for the FP8 fc, BF16 as stored for
    the Markov and confidence heads."""
    from test_convert_interop import V4_CONVERTER_RECIPE

    path.write_text(V4_CONVERTER_RECIPE + "[[rule]]\nclass = \"mtp\"\nname = 'fc\\.weight'\ntype = \"Q8_0\"\n"
                    "[[rule]]\nclass = \"mtp\"\nname = 'markov_w\\d\\.weight|conf_proj\\.weight'\n"
                    "type = \"source\"\n")
    return str(path)


def test_dspark_support_file_loads_in_llama_cpp_and_pairs_only_with_its_checkpoint(dspark, tmp_path):
    import llama_cpp

    src, other, root = dspark
    support = convert(src, tmp_path / "dspark.gguf", "q8_0", "--pre-tokenizer", "deepseek-v3", "--support", "dspark")
    reader = gguf.GGUFReader(support)
    assert reader.fields["general.architecture"].contents() == "dflash"
    assert reader.fields["quantkit.support.kind"].contents() == "dspark"
    assert {"fc.weight", "markov_w1.weight", "blk.1.attn_q_a.weight"} <= {t.name for t in reader.tensors}
    model = llama_cpp.llama_model_load_from_file(str(support).encode(), llama_cpp.llama_model_default_params())
    assert model, "llama.cpp's dflash loader refused the drafter"
    llama_cpp.llama_model_free(model)
    # the target: the same checkpoint's main file, which leaves the drafter's stages out
    target = convert(src, tmp_path / "target.gguf", "q8_0", "--pre-tokenizer", "deepseek-v3")
    assert not any(t.name.startswith(("mtp.", "fc.", "markov")) for t in gguf.GGUFReader(target).tensors)
    ok = CliRunner().invoke(main, ["validate", str(support), "--source", str(src), "--payload", "full", "--target",
                                   str(target)])
    assert ok.exit_code == 0, ok.output
    foreign = convert(other, tmp_path / "other-target.gguf", "q8_0", "--pre-tokenizer", "deepseek-v3")
    bad = CliRunner().invoke(main, ["validate", str(support), "--source", str(src), "--target", str(foreign)])
    assert bad.exit_code == 1 and "from another one" in bad.output, bad.output


def _suggested(result) -> str:
    """The name convert's ``name`` line suggests (not its ``name tag`` line)."""
    return next(line.split()[1] for line in result.output.splitlines() if line.split()[:1] == ["name"]
                and line.split()[1] != "tag")


def test_drafters_are_named_apart_from_their_target_and_validate_under_that_name(v4_mtp, dspark, glm, tmp_path):
    """Main file and drafters of one checkpoint and recipe get three names; a drafter renamed to its suggested name
    passes validate's name check."""
    import shutil

    recipe = ["--recipe", "deepseek-v4-flash-q4k-experts", "--pre-tokenizer", "deepseek-v3", "--no-progress", "-j", "1"]
    runs = {"main": (v4_mtp, []), "mtp": (v4_mtp, ["--support", "mtp"]), "dspark": (dspark[0], ["--support", "dspark"])}
    suggested = {}
    for key, (src, extra) in runs.items():
        result = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / f"{key}.gguf"), *recipe, *extra])
        assert result.exit_code == 0, result.output
        suggested[key] = _suggested(result)
        assert json.loads((tmp_path / f"{key}.release.json").read_text())["suggested_name"] == suggested[key]
    assert suggested["mtp"] == suggested["main"].replace("v4-", "v4-MTP-", 1)
    assert suggested["dspark"].startswith("ds-DSpark-")
    for key in ("mtp", "dspark"):
        named = shutil.copyfile(tmp_path / f"{key}.gguf", tmp_path / suggested[key])
        checked = CliRunner().invoke(main, ["validate", str(named), "--structure-only"])
        assert checked.exit_code == 0, checked.output
        assert any(line.split()[:2] == ["passed", "name.claims"] for line in checked.output.splitlines())
    glm_src = glm[0]
    glm_names = [_suggested(CliRunner().invoke(main, ["convert", str(glm_src), "-o", str(tmp_path / "g.gguf"),
                                                      "--recipe", "q8_0", "--pre-tokenizer", PRE, "--dry-run",
                                                      *extra])) for extra in ([], ["--support", "mtp"])]
    assert glm_names == ["glm-Q8.gguf", "glm-MTP-Q8.gguf"]


def test_validate_refuses_a_drafters_source_without_that_drafter_in_one_line(v4_mtp, dspark, tmp_path):
    """A drafter checked against a checkpoint that holds no drafter of its kind: inputs that do not belong
    together (exit 2), one line naming the checkpoint, not a 'not implemented' (exit 3) about another map."""
    pre = ["--pre-tokenizer", "deepseek-v3"]
    mtp = convert(v4_mtp, tmp_path / "mtp.gguf", "q8_0", *pre, "--support", "mtp")
    drafter = convert(dspark[0], tmp_path / "dspark.gguf", "q8_0", *pre, "--support", "dspark")
    for support, source, lacks in ((mtp, dspark[0], "writes no MTP block"), (drafter, v4_mtp, "holds no DSpark")):
        result = CliRunner().invoke(main, ["validate", str(support), "--source", str(source)])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {source}: field 'support': "), result.output
        assert lacks in lines[0] and "not the checkpoint it was made from" in lines[0]
        assert "qwen4_exp" not in lines[0] and "Traceback" not in result.output


@pytest.mark.interop
@pytest.mark.slow
def test_dspark_support_file_equals_llama_cpp_dspark_export(dspark, tmp_path):
    from test_arch import run_converter
    from test_convert_interop import metadata_differences, tensor_differences

    src, _, root = dspark
    theirs = tmp_path / "dspark-converter.gguf"
    run_converter(src, theirs, "deepseek-v3", "--dspark", "--target-model-dir", str(src))
    ours = tmp_path / "dspark-quantkit.gguf"
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(ours), "--recipe",
                                       dspark_recipe(tmp_path / "r.toml"), "--no-progress", "-j", "1",
                                       "--pre-tokenizer", "deepseek-v3", "--support", "dspark"])
    assert result.exit_code == 0, result.output
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    assert tensor_differences(a, b) == []
    assert metadata_differences(a, b) == []
