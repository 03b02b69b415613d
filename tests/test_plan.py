"""Conversion plans on the tiny checkpoints: every shipped recipe plans every architecture it names, sizes agree
with the format registry and the GGUF layout, importance and lossless choices are recorded, bad inputs are named."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.arch import get_arch
from quantkit.cli import main
from quantkit.convert import build_plan
from quantkit.convert.plan import inspect_sources, source_outputs
from quantkit.errors import RecipeError, SourceError
from quantkit.formats.registry import GGMLType, get_format
from quantkit.io.checkpoint import open_checkpoint
from quantkit.io.gguf import align
from quantkit.io.gguf_reader import GGUFFile
from quantkit.recipes import KEEP_F32_CLASSES, KEEP_SOURCE_CLASSES, parse_recipe, shipped_recipes
from quantkit.testing.tiny_models import TinyCheckpointCache

#: The tiny tokenizers are retrained BPEs whose check-text hash llama.cpp does not know.
PRE_TOKENIZER = {"qwen3_moe": "qwen2", "deepseek_v3": "deepseek-v3", "deepseek_v4": "deepseek-v3",
                 "glm5_next": "glm4", "qwen4_exp": "qwen35"}
#: (architecture, layout, encoding) of the checkpoints planned: the transformers save of each, and what DeepSeek
#: V4 users download (official names, FP8 attention, packed FP4 experts).
SOURCES = [("qwen3_moe", "per-expert", "bf16"), ("deepseek_v3", "per-expert", "bf16"),
           ("deepseek_v4", "per-expert", "bf16"), ("deepseek_v4", "official", "fp4-experts"),
           ("glm5_next", "per-expert", "bf16"), ("qwen4_exp", "per-expert", "bf16")]
FLOAT_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyCheckpointCache:
    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny-plan"))


def plan_of(tiny, arch, recipe, layout="per-expert", encoding="bf16", **kw):
    kw.setdefault("pre_tokenizer", PRE_TOKENIZER[arch])
    return build_plan(tiny.get(arch, layout=layout, encoding=encoding), recipe, **kw)


def rows_times_row_bytes(qtype: GGMLType, shape: tuple[int, ...]) -> int:
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows * get_format(qtype).row_bytes(shape[-1])


#: Recipes of models (a support file's recipe, which plans its drafter alone, is tested in test_mtp_main).
CASES = [(r.name, src) for r in shipped_recipes() if r.support is None for src in SOURCES if src[0] in r.architectures]


@pytest.mark.parametrize("recipe_name, source", CASES, ids=[f"{r}-{'-'.join(s)}" for r, s in CASES])
def test_every_shipped_recipe_plans_every_tiny_architecture_it_names(tiny, recipe_name, source):
    arch, layout, encoding = source
    plan = plan_of(tiny, arch, recipe_name, layout, encoding, bootstrap=True, label="0731")
    path = tiny.get(arch, layout=layout, encoding=encoding)
    with open_checkpoint(path) as ckpt:
        shapes, _ = inspect_sources(ckpt)
        outputs = get_arch(arch).bind(ckpt.config).outputs(shapes)
    # every GGUF tensor of the architecture is planned (nothing unclaimed, nothing silently dropped)
    assert [t.name for t in plan.tensors] == [o.gguf_name for o in outputs] and not plan.skipped
    for t in plan.tensors:
        assert t.nbytes == rows_times_row_bytes(t.qtype, t.output.shape), t.name
        assert t.output.shape[-1] % get_format(t.qtype).block_size == 0
        cls = t.output.tensor_class
        if cls in KEEP_F32_CLASSES or len(t.output.shape) == 1:
            assert t.qtype == GGMLType.F32, t.name
        if cls in KEEP_SOURCE_CLASSES:
            assert t.qtype in FLOAT_TYPES, t.name
        if t.output.dtype == "int32":
            assert t.qtype == GGMLType.I32
        uses = get_format(t.qtype).imatrix.value
        assert t.importance == ("none" if uses == "ignored" or t.lossless else "bootstrap"), t.name
    # the sizes are the GGUF layout's
    layout_ = plan.layout()
    assert {n: g.nbytes for n, g in layout_.tensors.items()} == {t.name: t.nbytes for t in plan.tensors}
    assert layout_.file_size == layout_.data_offset + sum(align(t.nbytes, layout_.alignment) for t in plan.tensors)
    # printable and serializable
    summary = plan.summary()
    assert plan.name_tag in summary and "label 0731" in summary
    total_line = next(line for line in summary.splitlines() if line.startswith("total"))
    assert int(total_line.split()[1]) == len(plan.tensors)
    data = json.loads(json.dumps(plan.to_json()))
    assert data["totals"]["tensor_bytes"] == plan.tensor_bytes == sum(t["nbytes"] for t in data["tensors"])
    assert data["totals"]["file_bytes"] == layout_.file_size and data["name_tag"] == plan.name_tag
    assert sum(c["bytes"] for c in data["classes"].values()) == plan.tensor_bytes


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v4"])
def test_source_outputs_are_each_maps_own(tiny, arch):
    """source_outputs (once per open checkpoint and set of rules) gives every map what its own outputs() gives, MTP
    blocks counted: the default map, the maps keeping the MTP blocks under each dialect's names (other rules on
    DeepSeek V4; the same rules on Qwen3 MoE, which has none to add) and the MTP support file's map."""
    with open_checkpoint(tiny.get(arch)) as ckpt:
        shapes = inspect_sources(ckpt)[0]
        bindings = [{}, {"mtp_dialect": "llama.cpp"}, {"mtp_dialect": "ds4"}, {"support": "mtp"}, {}]
        for kw in bindings if arch == "deepseek_v4" else bindings[:2] + bindings[-1:]:
            fresh = get_arch(arch).bind(ckpt.config, **kw)
            amap = get_arch(arch).bind(ckpt.config, **kw)
            assert source_outputs(ckpt, amap) == fresh.outputs(shapes), kw
            assert amap.mtp_blocks == fresh.mtp_blocks, kw
        if arch == "deepseek_v4":
            assert get_arch(arch).bind(ckpt.config, mtp_dialect="llama.cpp").rules_key != \
                get_arch(arch).bind(ckpt.config).rules_key


def test_header_shapes_are_the_decoded_shapes(tiny):
    """The plan reads headers only; its shapes must be those of the decoded tensors."""
    for arch, layout, encoding in [("deepseek_v4", "official", "fp4-experts"), ("qwen3_moe", "per-expert",
                                                                              "nvfp4-compressed-tensors")]:
        with open_checkpoint(tiny.get(arch, layout=layout, encoding=encoding)) as ckpt:
            shapes, encodings = inspect_sources(ckpt)
            for name, encoding_ in encodings.items():
                if encoding_ != "int":
                    assert shapes[name] == ckpt.tensor_f32(name).shape, name


def test_v4_release_layout_decisions(tiny):
    plan = plan_of(tiny, "deepseek_v4", "deepseek-v4-flash-iq2xxs-w2q2k", "official", "fp4-experts", bootstrap=True)
    by = {t.name: t for t in plan.tensors}
    assert by["blk.0.ffn_gate_exps.weight"].qtype == GGMLType.IQ2_XXS
    assert by["blk.0.ffn_down_exps.weight"].qtype == GGMLType.Q2_K
    assert by["blk.0.attn_q_a.weight"].qtype == by["blk.0.ffn_up_shexp.weight"].qtype == GGMLType.Q8_0
    assert by["output.weight"].qtype == GGMLType.Q8_0
    assert by["blk.0.hc_attn_fn.weight"].qtype == GGMLType.F32                 # F32 in the source, kept
    assert by["blk.1.attn_compressor_ape.weight"].qtype == GGMLType.F32
    assert by["blk.1.indexer.proj.weight"].qtype == GGMLType.BF16             # BF16 in the source, kept
    assert by["blk.0.ffn_gate_tid2eid.weight"].qtype == GGMLType.I32
    assert by["blk.0.ffn_gate_inp.weight"].qtype == GGMLType.F32
    # the rule for V4 Flash's MTP block (block 43) matches nothing in a 3-layer checkpoint without one
    assert len(plan.unused_rules) == 1 and "layers='43'" in plan.unused_rules[0]
    # the layers 37-42 variant on a 3-layer model: its ranged rule matches nothing, and the plan says so
    ranged = plan_of(tiny, "deepseek_v4", "deepseek-v4-flash-layers37-42-q4k", "official", "fp4-experts",
                     bootstrap=True)
    assert [(t.name, t.qtype) for t in ranged.tensors] == [(t.name, t.qtype) for t in plan.tensors]
    assert len(ranged.unused_rules) == 2 and "layers='37-42'" in ranged.unused_rules[0]
    assert "matched no tensor" in ranged.summary()
    # the file holds no Q4_K experts, so its tag is the plain layout's
    assert ranged.recipe.name_tag.startswith("Layers37-42Q4KExperts-") and ranged.name_tag == plan.name_tag


GDN_AB_RECIPE = ('name = "gdn"\narchitectures = ["qwen4_exp"]\n[defaults]\ntype = "Q8_0"\n'
                 '[[rule]]\nclass = "gdn_ab"\ntype = "Q4_K"\n')


def test_a_rule_a_protection_overrides_leaves_the_file_tag_and_the_plan_names_the_protection(tiny, tmp_path):
    """Issue 18 #5: in an F32 release the tiny gdn alpha/beta projections (4 x 256) stay F32 by protection: the
    rule selected them but decided nothing, so the file's tag has no GDNabQ4K and the plan says what won."""
    recipe = parse_recipe(GDN_AB_RECIPE)
    plan = plan_of(tiny, "qwen4_exp", recipe, encoding="f32")
    ab = [t for t in plan.tensors if t.output.tensor_class == "gdn_ab"]
    assert ab and all(t.qtype == GGMLType.F32 and t.rule.startswith("default: small F32") for t in ab)
    assert recipe.name_tag == "Q8-GDNabQ4K" and plan.name_tag == "Q8"
    (explanation,) = plan.unused_rules
    assert explanation.startswith("rule 1 (line 5) [class='gdn_ab', type='Q4_K']: selects 2 tensors, decided none: "
                                  "default: small F32 tensor (<= 4096 values) stays F32 won for 2 ")
    assert f"unused      {explanation}" in plan.summary() and "matched no tensor" not in plan.summary()
    # the tag recorded in the file is the plan's
    out = tmp_path / "gdn.gguf"
    (tmp_path / "gdn.toml").write_text(GDN_AB_RECIPE)
    result = CliRunner().invoke(main, ["convert", str(tiny.get("qwen4_exp", encoding="f32")), "-o", str(out),
                                       "--recipe", str(tmp_path / "gdn.toml"), "--pre-tokenizer", "qwen35",
                                       "--no-progress", "-j", "1"])
    assert result.exit_code == 0, result.output
    with GGUFFile(out) as f:
        assert f.metadata["quantkit.recipe.tag"].value == "Q8"
    # where the projections are BF16 (no protection), the rule decides them and is tagged
    assert plan_of(tiny, "qwen4_exp", recipe).name_tag == "Q8-GDNabQ4K"


def test_packed_fp4_experts_repack_to_mxfp4(tiny):
    recipe = parse_recipe('name = "native"\narchitectures = ["deepseek_v4"]\n[defaults]\ntype = "Q8_0"\n'
                          '[[rule]]\nclass = "routed_experts"\ntype = "source"\n')
    plan = plan_of(tiny, "deepseek_v4", recipe, "official", "fp4-experts")
    experts = [t for t in plan.tensors if t.output.tensor_class.startswith("routed_")]
    assert experts and all((t.qtype, t.lossless, t.importance) == (GGMLType.MXFP4, "mxfp4-repack", "none")
                           for t in experts)
    assert plan.name_tag == "NativeExperts"
    # the transformers save holds BF16 experts: kept as a BF16 copy
    plan = plan_of(tiny, "deepseek_v4", recipe)
    assert {(t.qtype, t.lossless) for t in plan.tensors if t.output.tensor_class.startswith("routed_")} == {
        (GGMLType.BF16, "copy")}


@pytest.mark.parametrize("encoding", ["nvfp4-modelopt", "nvfp4-compressed-tensors"])
def test_nvfp4_repacks_with_a_scale_tensor(tiny, encoding):
    recipe = parse_recipe('name = "native"\narchitectures = ["qwen3_moe"]\n[defaults]\ntype = "Q8_0"\n'
                          '[[rule]]\nclass = "routed_experts"\ntype = "source"\n'
                          '[[rule]]\nclass = "attn_proj"\ntype = "source"\n')
    plan = plan_of(tiny, "qwen3_moe", recipe, encoding=encoding)
    for i, t in enumerate(plan.tensors):
        if t.lossless == "nvfp4-repack":
            scale = plan.tensors[i + 1]
            assert t.qtype == GGMLType.NVFP4 and scale.name == t.name.removesuffix(".weight") + ".scale"
            assert (scale.qtype, scale.lossless, scale.output.tensor_class) == (GGMLType.F32, "nvfp4-scale",
                                                                                t.output.tensor_class)
            assert scale.output.shape == ((t.output.shape[0],) if t.output.assembly == "stack_experts" else (1,))
            assert scale.nbytes == 4 * scale.output.shape[0]
    assert {t.output.tensor_class for t in plan.tensors if t.lossless == "nvfp4-repack"} == {
        "routed_gate", "routed_up", "routed_down", "attn_q", "attn_kv", "attn_output"}
    assert plan.layout().file_size > plan.tensor_bytes
    # an FP8 source has no lossless GGUF type: an error naming the tensor
    with pytest.raises(RecipeError, match="fp8-block sources have no lossless GGUF type") as info:
        plan_of(tiny, "qwen3_moe", recipe, encoding="fp8-block")
    assert info.value.tensor is not None


def test_qwen_ngram_table_is_copied_in_bf16(tiny):
    for name in ("qwen3.8-flash-next-q2", "qwen3.8-flash-next-q4"):
        plan = plan_of(tiny, "qwen4_exp", name, bootstrap=True)
        table = next(t for t in plan.tensors if t.name == "per_layer_token_embd.weight")
        assert (table.qtype, table.lossless, table.importance) == (GGMLType.BF16, "copy", "none")
        assert table.output.tensor_class == "ngram_table"
    # the Q4_K_M-like control puts it where llama-quantize does, through its declared fallback
    control = plan_of(tiny, "qwen4_exp", "q4_k_m-control")
    table = next(t for t in control.tensors if t.name == "per_layer_token_embd.weight")
    assert (table.qtype, table.fallback_from) == (GGMLType.Q5_0, GGMLType.Q4_K)
    assert "fallbacks   " in control.summary() and "per_layer_token_embd.weight Q4_K->Q5_0" in control.summary()
    assert all(t.qtype in FLOAT_TYPES for t in control.tensors if t.output.tensor_class in ("hc", "indexer"))


def test_importance_is_required_for_iq2_types(tiny):
    with pytest.raises(RecipeError) as info:
        plan_of(tiny, "glm5_next", "glm-5.3-flash-q2")
    message = str(info.value)
    assert "requires importance" in message and "no imatrix" in message
    assert "blk.1.ffn_gate_exps.weight (IQ2_XXS, rule 1 (line" in message and "--bootstrap-importance" in message
    # an imatrix covering the layer-1 experts only: those use it, the layer-2 IQ2_XXS experts still lack it
    imatrix = {f"blk.1.ffn_{p}_exps.weight": np.ones(256, np.float32) for p in ("gate", "up", "down")}
    with pytest.raises(RecipeError, match="no imatrix entry for them: blk.2.ffn_gate_exps.weight"):
        plan_of(tiny, "glm5_next", "glm-5.3-flash-q2", imatrix=imatrix)
    plan = plan_of(tiny, "glm5_next", "glm-5.3-flash-q2", imatrix=imatrix, bootstrap=True)
    importance = {t.name: t.importance for t in plan.tensors}
    assert importance["blk.1.ffn_gate_exps.weight"] == importance["blk.1.ffn_down_exps.weight"] == "imatrix"
    assert importance["blk.2.ffn_gate_exps.weight"] == "bootstrap"
    assert importance["blk.1.attn_q_a.weight"] == "none"                     # Q8_0 ignores importance
    assert importance["blk.0.attn_q.weight"] == "bootstrap"                  # KDA q in Q4_K uses it optionally
    assert plan.imatrix_entries == 3 and "imatrix 3" in plan.summary()
    # per-expert vectors (experts x row) are accepted too
    per_expert = {"blk.1.ffn_gate_exps.weight": np.ones(8 * 256, np.float32)}
    assert plan_of(tiny, "glm5_next", "glm-5.3-flash-q2", imatrix=per_expert, bootstrap=True)


@pytest.mark.parametrize("imatrix, message", [
    ({"blk.9.ffn_gate_exps.weight": np.ones(256)}, "names no tensor of this qwen3_moe model"),
    ({"blk.0.ffn_gate_exps.weight": np.ones(4096)}, "has 4096 values; the tensor needs 256 or 2048 \\(8 matrices\\)"),
    ({"blk.0.attn_q.weight": np.ones(512)}, "has 512 values; the tensor needs 256 "),
])
def test_an_imatrix_for_another_model_is_rejected(tiny, imatrix, message):
    with pytest.raises(SourceError, match=message) as info:
        plan_of(tiny, "qwen3_moe", "q4_k_m-control", imatrix=imatrix)
    assert info.value.field == "imatrix"


def test_imatrix_vectors_per_head_of_3d_attention_tensors(tiny):
    """llama-imatrix records one vector per matrix of a 3-D weight: per expert, and per head of MLA's attn_k_b."""
    for values in (np.ones(64), np.ones(4 * 64)):
        plan = plan_of(tiny, "deepseek_v3", "q4_k_m-control", imatrix={"blk.0.attn_k_b.weight": values})
        assert next(t for t in plan.tensors if t.name == "blk.0.attn_k_b.weight").importance == "imatrix"
    with pytest.raises(SourceError, match="needs 64 or 256 \\(4 matrices\\)"):
        plan_of(tiny, "deepseek_v3", "q4_k_m-control", imatrix={"blk.0.attn_k_b.weight": np.ones(128)})


def test_recipe_for_another_architecture(tiny):
    with pytest.raises(RecipeError, match="is for deepseek_v4; the source is model_type 'qwen3_moe'") as info:
        plan_of(tiny, "qwen3_moe", "deepseek-v4-flash-q4k-experts")
    assert info.value.field == "architectures"


def test_unclaimed_tensors_fail_the_plan(tiny):
    recipe = parse_recipe('name = "partial"\narchitectures = ["qwen3_moe"]\n'
                          '[[rule]]\nclass = "ffn"\ntype = "Q4_K"\n[[rule]]\nclass = "attn_proj"\ntype = "Q8_0"\n')
    with pytest.raises(RecipeError, match=r"2 tensors are claimed by no rule .*output.weight \(output\)"):
        plan_of(tiny, "qwen3_moe", recipe)
    skipping = parse_recipe(recipe.text.replace('"qwen3_moe"]\n', '"qwen3_moe"]\nskip = ["token_embd", "output"]\n'))
    plan = plan_of(tiny, "qwen3_moe", skipping)
    assert sorted(o.gguf_name for o in plan.skipped) == ["output.weight", "token_embd.weight"]
    assert "skipped     2: output, token_embd" in plan.summary()
    assert {"output.weight", "token_embd.weight"}.isdisjoint(t.name for t in plan.tensors)


def test_summary_reports_classes_and_totals(tiny):
    plan = plan_of(tiny, "deepseek_v3", "q4_k_m-control")
    summary = plan.summary()
    totals = plan.class_totals()
    for cls, entry in totals.items():
        line = next(line for line in summary.splitlines() if line.startswith(f"{cls} "))
        assert line.split()[1] == str(entry["tensors"]) and f"{entry['bpw']:.3f}" in line
    assert totals["routed_down"]["types"] == {"Q6_K": 1} and totals["output"]["types"] == {"Q6_K": 1}
    assert totals["attn_q"]["types"] == {"Q4_K": 2, "Q5_0": 2}          # q_b rows are 128 wide: fallback
    assert re.search(r"^name tag    Q4K-w2Q6K-FFNDownQ6K-AttnVQ6K-OutQ6K$", summary, re.M)
    assert totals["norm"]["bpw"] == 32.0
    metadata = plan.to_json()["metadata"]
    tokens = next(m for m in metadata if m["key"] == "tokenizer.ggml.tokens")
    assert tokens["type"] == "ARRAY[STRING]" and tokens["value"]["count"] == 512
    assert len(tokens["value"]["sha256"]) == 64


def test_recipes_command_lists_the_shipped_recipes():
    from quantkit.recipes.catalog import EXAMPLE_DIR

    runner = CliRunner()
    result = runner.invoke(main, ["recipes"])
    assert result.exit_code == 0, result.output
    for r in shipped_recipes():
        assert re.search(rf"^{re.escape(r.name)}\n    architectures  {', '.join(r.architectures)}\n"
                         rf"    name tag       {re.escape(r.name_tag)}\n", result.output, re.M)
    listed = json.loads(runner.invoke(main, ["recipes", "--json"]).output)
    examples = [r.name for r in shipped_recipes(EXAMPLE_DIR)]
    assert [e["name"] for e in listed] == [r.name for r in shipped_recipes()] + examples and examples
    assert [e["name"] for e in listed if e["example"]] == examples
    shown = runner.invoke(main, ["recipes", "q8_0"])
    assert shown.exit_code == 0 and 'name = "q8_0"' in shown.output
    missing = runner.invoke(main, ["recipes", "q9_0"])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1 and "no shipped recipe" in missing.output
