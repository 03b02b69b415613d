"""Recipes: strict parsing with located errors, precedence and ties, anchored names, protected defaults,
fallbacks, lossless source encodings, and name tags (the published names of CONTEXT.md reproduced)."""
from __future__ import annotations

import re

import pytest

from quantkit.arch import CLASS_GROUPS, TENSOR_CLASSES, OutputTensor, TensorMapping
from quantkit.errors import RecipeError
from quantkit.formats.registry import GGMLType
from quantkit.recipes import (CLASS_LABELS, KEEP_F32_CLASSES, KEEP_SOURCE_CLASSES, SHIPPED_DIR, SMALL_F32_ELEMENTS,
                              load_recipe, name_tag, parse_recipe, resolve, shipped_recipes)

T = GGMLType
HEADER = 'name = "test"\narchitectures = ["deepseek_v4", "glm5_next"]\n'


def recipe(body: str, defaults: str | None = 'type = "Q8_0"'):
    text = HEADER + (f"[defaults]\n{defaults}\n" if defaults is not None else "") + body
    return parse_recipe(text, "test.toml")


def rule(cls: str, type_: str, **extra) -> str:
    lines = ["[[rule]]", f'class = "{cls}"', f'type = "{type_}"']
    lines += [f"{k} = {v!r}" if not isinstance(v, str) else f"{k} = '{v}'" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def tensor(name: str, cls: str, shape: tuple[int, ...], layer: int | None = None, *, transform: tuple = (),
           dtype: str = "float32", assembly: str = "single") -> OutputTensor:
    m = TensorMapping(f"src.{name}", name, cls, layer, None, None, tuple(transform))
    return OutputTensor(name, cls, layer, tuple(shape), dtype, (m,), assembly)


def choose(r, t: OutputTensor, encoding: str = "BF16"):
    return resolve(r, [t], {t.gguf_name: encoding}).choices[t.gguf_name]


# -- shipped recipes and name tags ---------------------------------------------------------------------------------

#: Published file names from CONTEXT.md: the tag sits between the model name and the imatrix/label suffix.
PUBLISHED = {
    "deepseek-v4-flash-iq2xxs-w2q2k": "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf",
    "deepseek-v4-flash-layers37-42-q4k": "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-"
                                         "Q2KDown-AProjQ8-SExpQ8-OutQ8-...",
}
#: The tags of the other shipped recipes, by the documented derivation.
DERIVED = {
    "deepseek-v4-flash-q4k-experts": "Q4KExperts-AProjQ8-SExpQ8-OutQ8",
    "deepseek-v4-flash-mtp-q4k": "Q4KExperts",
    "glm-5.3-flash-q2": "IQ2XXS-w2Q2K-KDAqkQ4K-KDAQ8-MLAQ8-SExpQ8-DenseQ8-EmbdQ8-OutQ8",
    "glm-5.3-flash-q4k": "Q4KExperts-KDAqkQ4K-KDAQ8-MLAQ8-SExpQ8-DenseQ8-EmbdQ8-OutQ8",
    "qwen3.8-flash-next-q2": "IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8",
    "deepseek-v4.1-flash-q2": "IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8",
    "qwen3.8-flash-next-q4": "Q4KExperts-AProjQ8-SExpQ8-OutQ8",
    "q8_0": "Q8",
    "q4_k_m-control": "Q4K-w2Q6K-FFNDownQ6K-AttnVQ6K-OutQ6K",
}


def test_shipped_recipes_are_the_published_layouts():
    recipes = {r.name: r for r in shipped_recipes()}
    assert set(recipes) == set(PUBLISHED) | set(DERIVED)
    for r in recipes.values():
        assert r.path == SHIPPED_DIR / f"{r.name}.toml" and r.description
        assert load_recipe(r.name) == r and load_recipe(r.path) == r
    # the shipped directory is package data of quantkit (pyproject: recipes/**/*.toml)
    assert SHIPPED_DIR.parent.name == "recipes" and SHIPPED_DIR.parent.parent.name == "quantkit"


def test_name_tags_reproduce_the_published_names():
    recipes = {r.name: r for r in shipped_recipes()}
    for name, published in PUBLISHED.items():
        tag = recipes[name].name_tag
        assert published.startswith(f"DeepSeek-V4-Flash-{tag}-"), (tag, published)
    for name, tag in DERIVED.items():
        assert recipes[name].name_tag == tag


def test_class_labels_cover_every_class_and_group():
    assert set(CLASS_LABELS) == set(TENSOR_CLASSES) | set(CLASS_GROUPS)
    assert len(set(CLASS_LABELS.values())) == len(CLASS_LABELS)


@pytest.mark.parametrize("body, defaults, tag", [
    ("", 'type = "Q8_0"', "Q8"),
    ("", 'type = "Q4_K"\nfallback = "Q5_0"', "Q4K"),
    ("", None, ""),
    (rule("routed_experts", "Q4_K"), 'type = "Q8_0"', "Q4KExperts"),
    (rule("routed_gate", "IQ2_XS") + rule("routed_up", "IQ2_XXS") + rule("routed_down", "Q2_K"), None,
     "IQ2XSGate-IQ2XXSUp-w2Q2K"),
    (rule("routed_down", "Q6_K"), 'type = "Q4_K"', "Q4K-w2Q6K"),
    (rule("routed_experts", "source"), None, "NativeExperts"),
    # a ranged expert rule alone: the other layers come from the default type
    (rule("routed_experts", "Q4_K", layers="3-5"), 'type = "Q8_0"', "Layers3-5Q4KExperts-OtherExpertLayersQ8Experts"),
    (rule("routed_experts", "Q4_K", layers=[1, "3-5", 6]) + rule("routed_experts", "Q2_K"), None,
     "Layers1+3-6Q4KExperts-OtherExpertLayersQ2KExperts"),
    # a range's split types each carry the range (a part without one claims every layer); a narrower range takes
    # the types of the wider rules that cover it
    (rule("routed_experts", "Q4_K") + rule("routed_down", "Q2_K", layers="1"), 'type = "Q8_0"',
     "Layers1Q4KGateUp-Layers1Q2KDown-OtherExpertLayersQ4KExperts"),
    (rule("routed_experts", "Q4_K", layers="0-3") + rule("routed_down", "Q2_K", layers="1"), 'type = "Q8_0"',
     "Layers0-3Q4KExperts-Layers1Q4KGateUp-Layers1Q2KDown-OtherExpertLayersQ8Experts"),
    # float and source choices are not quantization choices; tag = "" hides a rule; tag labels a rule
    (rule("indexer", "BF16") + rule("ngram_table", "source") + rule("attn_proj", "Q8_0", tag="")
     + rule("shared_expert", "Q6_K", tag="Shared"), 'type = "Q8_0"', "Q8-SharedQ6K"),
    (rule("attn_q", "Q4_K", layers="0-1") + rule("output", "Q6_K"), 'type = "Q8_0"', "Q8-Layers0-1AQQ4K-OutQ6K"),
    # a named routed rule is an ordinary fragment
    (rule("routed_down", "Q5_K", name=r"blk\.1\.ffn_down_exps\.weight"), 'type = "Q4_K"', "Q4K-DownQ5K"),
])
def test_name_tag_derivation(body, defaults, tag):
    assert recipe(body, defaults).name_tag == tag


# -- strict parsing ------------------------------------------------------------------------------------------------

#: (recipe text, field named, text in the message, line named or None)
BAD_RECIPES = [
    (HEADER + "colour = 1\n", "colour", "unknown key 'colour'", 3),
    (HEADER + 'support = "eagle"\n', "support", "unknown support file kind 'eagle'; known: mtp, dspark", 3),
    (HEADER + "support = 1\n", "support", "expected a string", 3),
    (HEADER + '[defaults]\ntype = "Q8_0"\nmode = 2\n', "defaults.mode", "unknown key 'mode'", 5),
    (HEADER + '[[rule]]\nclass = "norm"\ntype = "F32"\npriority = 1\n', "rule[1].priority", "unknown key", 6),
    ('architectures = ["qwen3_moe"]\n', "name", "missing the required key 'name'", None),
    ('name = "x"\n', "architectures", "missing the required key 'architectures'", None),
    (HEADER + '[[rule]]\ntype = "Q8_0"\n', "rule[1].class", "missing the required key 'class'", 3),
    (HEADER + '[[rule]]\nclass = "norm"\n', "rule[1].type", "missing the required key 'type'", 3),
    (HEADER + '[[rule]]\nclass = "attn"\ntype = "Q8_0"\n', "rule[1].class", "unknown tensor class 'attn'", 4),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q9_K"\n', "rule[1].type", "unknown GGML type 'Q9_K'", 5),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "IQ1_S"\n', "rule[1].type", "cannot write GGML type IQ1_S", 5),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = 8\n', "rule[1].type", "expected a string", 5),
    (HEADER + '[defaults]\ntype = "Q8_K"\n', "defaults.type", "cannot write GGML type Q8_K", 4),
    ('name = "x"\narchitectures = ["llama"]\n', "architectures", "unknown architecture 'llama'", 2),
    ('name = "x"\narchitectures = "qwen3_moe"\n', "architectures", "expected a list of strings", 2),
    ('name = "x"\narchitectures = []\n', "architectures", "at least one", 2),
    ('name = "x y"\narchitectures = ["qwen3_moe"]\n', "name", "may only hold", 1),
    ('name = 3\narchitectures = ["qwen3_moe"]\n', "name", "expected a string", 1),
    (HEADER + 'skip = ["vision", "visual"]\n', "skip", "unknown tensor class 'visual'", 3),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\nname = "blk\\\\.(\\\\d+"\n', "rule[1].name",
     "does not compile", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\nlayers = "42-37"\n', "rule[1].layers", "empty", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\nlayers = "first"\n', "rule[1].layers", "expected", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\nlayers = -1\n', "rule[1].layers", "negative", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\nlayers = []\n', "rule[1].layers", "selects nothing", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\nfallback = "Q8_0"\n', "rule[1].fallback",
     "the type itself", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q4_K"\nfallback = "Q2_K"\n', "rule[1].fallback", "never used", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "BF16"\nfallback = "F16"\n', "rule[1].fallback", "never used", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q4_K"\nfallback = "source"\n', "rule[1].fallback",
     "not allowed", 6),
    (HEADER + '[defaults]\nfallback = "Q8_0"\n', "defaults.fallback", "without a default type", 4),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\ntag = "A Q"\n', "rule[1].tag", "may only hold", 6),
    # a tag file names read as another class's label (they would claim this type for it), or cannot read at all
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q4_K"\ntag = "w2"\n', "rule[1].tag", "label of routed_down", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q4_K"\ntag = "Out"\n', "rule[1].tag", "label of output", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q4_K"\ntag = "lower"\n', "rule[1].tag", "not a word", 6),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q4_K"\ntag = "Q4K"\n', "rule[1].tag", "not a word", 6),
    (HEADER + '[[rule]]\nclass = "hash_routing"\ntype = "F32"\n', "rule[1].class", "always written as I32", 4),
    (HEADER + 'skip = ["mtp"]\n[[rule]]\nclass = "mtp"\ntype = "Q8_0"\n', "rule[1].class", "which the recipe skips",
     5),
    (HEADER + '[[rule]]\nclass = "attn_q"\ntype = "Q8_0"\n\n[[rule]]\nclass = "attn_q"\ntype = "Q4_K"\n',
     "rule[2]", "selects exactly what rule 1", 7),
    (HEADER + 'rule = 3\n', "rule", "expected [[rule]] tables", 3),
    (HEADER + 'defaults = 3\n', "defaults", "must be a table", 3),
]


@pytest.mark.parametrize("text, field, message, line", BAD_RECIPES)
def test_bad_recipes_name_file_key_and_line(tmp_path, text, field, message, line):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    err = info.value
    assert err.path == str(path) and err.field == field
    assert message in str(err) and str(path) in str(err)
    if line is not None:
        assert f"line {line}:" in str(err)


def test_bad_toml_and_encoding(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('name = "x\n')
    with pytest.raises(RecipeError, match=r"not valid TOML.*line 1"):
        load_recipe(path)
    path.write_bytes(b'name = "\xff"\n')
    with pytest.raises(RecipeError, match="not UTF-8"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="no shipped recipe or example recipe of that name.*q8_0"):
        load_recipe("no-such-recipe")


def test_layers_parse_and_merge():
    r = recipe(rule("attn_q", "Q4_K", layers=[7, "3-5", "6", 1]))
    assert r.rules[0].layers == ((1, 1), (3, 7))


# -- precedence --------------------------------------------------------------------------------------------------

DOWN = tensor("blk.3.ffn_down_exps.weight", "routed_down", (8, 256, 512), 3, assembly="stack_experts")


def test_most_specific_rule_wins_at_every_level():
    rules = [rule("routed_experts", "Q4_K"),                                      # group
             rule("routed_down", "Q5_K"),                                         # class
             rule("routed_experts", "Q6_K", layers="2-4"),                        # layers beat class
             rule("routed_experts", "Q8_0", layers="3", name=r"blk\.3\..*"),       # name beats everything
             rule("routed_down", "Q2_K", layers="3", name=r"blk\.\d+\.ffn_down_exps\.weight")]   # ... and a class
    expected = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q2_K]
    for n, qtype in enumerate(expected, start=1):
        choice = choose(recipe("".join(rules[:n])), DOWN)
        assert choice.qtype == qtype and choice.rule.startswith(f"rule {n} (line "), n


def test_specificity_order_name_then_layers_then_class():
    by_layers = rule("routed_experts", "Q6_K", layers="3")
    by_name = rule("routed_experts", "Q8_0", name=r"blk\.\d+\.ffn_down_exps\.weight")
    by_class = rule("routed_down", "Q5_K")
    for body in (by_layers + by_name + by_class, by_class + by_name + by_layers):
        assert choose(recipe(body), DOWN).qtype == T.Q8_0
    for body in (by_layers + by_class, by_class + by_layers):
        assert choose(recipe(body), DOWN).qtype == T.Q6_K
    assert choose(recipe(rule("routed_experts", "Q4_K") + by_class), DOWN).qtype == T.Q5_K


def test_no_class_group_holds_a_protected_class():
    """Rules reach class-protected tensors only through their own class: no group may contain one."""
    protected = KEEP_F32_CLASSES | KEEP_SOURCE_CLASSES | {"hash_routing"}
    assert all(not (members & protected) for members in CLASS_GROUPS.values())


def test_ties_name_both_rules_and_the_tensor():
    r = recipe(rule("routed_experts", "Q4_K", layers="0-3") + rule("routed_experts", "Q5_K", layers="3-7"))
    with pytest.raises(RecipeError) as info:
        choose(r, DOWN)
    message = str(info.value)
    assert "blk.3.ffn_down_exps.weight" in message and "rule 1 (line 5)" in message and "rule 2 (line 9)" in message
    assert "equally specific" in message
    # layer 1 is only in the first range: no tie
    assert choose(r, tensor("blk.1.ffn_down_exps.weight", "routed_down", (8, 256, 512), 1)).qtype == T.Q4_K
    # equally specific rules that agree are not a tie; the first one is recorded
    same = recipe(rule("routed_experts", "Q4_K", layers="0-3") + rule("routed_experts", "Q4_K", layers="3-7"))
    assert choose(same, DOWN).rule == "rule 1 (line 5)"
    # two name rules with different fallbacks tie too
    names = recipe(rule("routed_down", "Q4_K", name=r"blk\.3\..*", fallback="Q8_0")
                   + rule("routed_down", "Q4_K", name=r".*ffn_down.*", fallback="Q5_0"))
    with pytest.raises(RecipeError, match="equally specific"):
        choose(names, DOWN)


def test_name_patterns_are_anchored():
    hc_fn = tensor("blk.0.hc_attn_fn.weight", "hc", (24, 1024), 0)
    attn_q = tensor("blk.0.attn_q.weight", "attn_q", (512, 256), 0)
    r = recipe(rule("hc", "Q8_0", name="attn_.*") + rule("attn_proj", "Q4_K", name="attn_.*"))
    assert choose(r, hc_fn).qtype == T.BF16         # `attn_.*` is not searched for inside hc_attn_fn
    assert choose(r, attn_q).rule == "[defaults] type (line 4)"   # ... and does not match blk.0.attn_q either
    assert not re.fullmatch("attn_.*", hc_fn.gguf_name) and re.search("attn_.*", hc_fn.gguf_name)
    r = recipe(rule("hc", "Q8_0", name=r"blk\.\d+\.hc_attn_.*") + rule("attn_proj", "Q4_K", name=r"blk\.\d+\.attn_.*"))
    assert choose(r, hc_fn).qtype == T.Q8_0 and choose(r, attn_q).qtype == T.Q4_K


# -- protected defaults ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t, encoding, qtype", [
    (tensor("blk.0.ffn_gate_inp.weight", "router", (256, 4096), 0), "BF16", T.F32),
    (tensor("blk.0.attn_norm.weight", "norm", (4096,), 0), "BF16", T.F32),
    (tensor("blk.0.exp_probs_b.bias", "bias", (256,), 0), "F32", T.F32),
    (tensor("blk.0.ssm_a", "ssm_param", (32,), 0, transform=("neg_exp",)), "F32", T.F32),
    (tensor("blk.0.attn_sinks.weight", "sinks", (64,), 0), "F32", T.F32),
    (tensor("blk.0.ssm_conv1d_q.weight", "conv", (1, 4096, 1, 4), 0), "BF16", T.F32),
    (tensor("blk.0.hc_attn_fn.weight", "hc", (24, 16384), 0), "F32", T.F32),
    (tensor("blk.0.hc_attn_fn.weight", "hc", (24, 16384), 0), "BF16", T.BF16),
    (tensor("blk.0.hc_attn_fn.weight", "hc", (24, 16384), 0), "F16", T.F16),
    (tensor("blk.0.hc_attn_norm.weight", "hc", (16384,), 0), "BF16", T.F32),         # 1-D
    (tensor("blk.1.attn_compressor_ape.weight", "ape", (4, 512), 1), "F32", T.F32),
    (tensor("blk.1.indexer.proj.weight", "indexer", (64, 4096), 1), "BF16", T.BF16),
    (tensor("blk.1.indexer.attn_q_b.weight", "indexer", (8192, 1024), 1), "fp8-block-e8m0", T.F32),
    (tensor("blk.45.nextn.enorm.weight", "mtp", (4096,), 45), "BF16", T.F32),        # 1-D of any class
    (tensor("blk.0.ssm_alpha.weight", "gdn_ab", (32, 128), 0), "F32", T.F32),        # small F32
    (tensor("blk.0.ssm_alpha.weight", "gdn_ab", (32, 128), 0), "BF16", T.Q8_0),      # small, but not F32
    (tensor("blk.0.ssm_alpha.weight", "gdn_ab", (64, 128), 0), "F32", T.Q8_0),       # F32, but not small
    (tensor("blk.0.ffn_gate_tid2eid.weight", "hash_routing", (129280, 6), 0, transform=("to_int32",),
            dtype="int32"), "int", T.I32),
])
def test_protected_defaults(t, encoding, qtype):
    assert 32 * 128 == SMALL_F32_ELEMENTS
    choice = choose(recipe(rule("ffn", "Q4_K") + rule("attn_proj", "Q4_K")), t, encoding)
    protected = qtype is not T.Q8_0
    assert choice.qtype == qtype and choice.rule.startswith("default: " if protected else "[defaults] type")


def test_protected_tensors_are_reached_only_by_rules_naming_them():
    hc_fn = tensor("blk.0.hc_attn_fn.weight", "hc", (24, 16384), 0)
    norm = tensor("blk.0.attn_norm.weight", "norm", (4096,), 0)
    enorm = tensor("blk.45.nextn.enorm.weight", "mtp", (4096,), 45)
    eh_proj = tensor("blk.45.nextn.eh_proj.weight", "mtp", (4096, 8192), 45)
    r = recipe(rule("hc", "Q8_0") + rule("norm", "BF16") + rule("mtp", "Q8_0"))
    assert choose(r, hc_fn, "F32").qtype == T.Q8_0          # exact class: the rule says otherwise
    assert choose(r, norm).qtype == T.BF16
    assert choose(r, enorm).qtype == T.F32                  # shape-protected: a class rule passes over it
    assert choose(r, eh_proj).qtype == T.Q8_0
    named = recipe(rule("mtp", "BF16", name=r"blk\.\d+\.nextn\.enorm\.weight"))
    assert choose(named, enorm, "F32").qtype == T.BF16      # a name rule reaches it
    bad = recipe(rule("mtp", "Q8_0", name=r"blk\.\d+\.nextn\..*"))
    with pytest.raises(RecipeError, match="1-D tensors only take float types") as info:
        choose(bad, enorm)
    assert info.value.tensor == "blk.45.nextn.enorm.weight"


def test_unclaimed_tensors_are_listed_and_skip_is_explicit():
    ts = [tensor("token_embd.weight", "token_embd", (512, 256)), tensor("blk.0.attn_q.weight", "attn_q", (256, 256), 0),
          tensor("blk.45.nextn.eh_proj.weight", "mtp", (256, 512), 45),
          tensor("blk.0.attn_norm.weight", "norm", (256,), 0)]
    encodings = {t.gguf_name: "BF16" for t in ts}
    r = recipe(rule("attn_proj", "Q8_0"), defaults=None)
    with pytest.raises(RecipeError) as info:
        resolve(r, ts, encodings)
    message = str(info.value)
    assert "2 tensors are claimed by no rule" in message
    assert "token_embd.weight (token_embd)" in message and "blk.45.nextn.eh_proj.weight (mtp)" in message
    r = parse_recipe(HEADER + 'skip = ["mtp", "ffn"]\n' + rule("attn_proj", "Q8_0") + rule("token_embd", "Q8_0"))
    res = resolve(r, ts, encodings)
    assert res.choices["blk.45.nextn.eh_proj.weight"] is None
    assert res.choices["blk.0.attn_norm.weight"].qtype == T.F32 and res.unused_rules == ()


def test_unused_rules_are_reported():
    r = recipe(rule("routed_experts", "Q4_K", layers="37-42") + rule("attn_proj", "Q8_0"))
    res = resolve(r, [DOWN], {DOWN.gguf_name: "BF16"})
    assert [u.index for u in res.unused_rules] == [1, 2]
    assert res.explain_unused(res.unused_rules[0]).endswith("matched no tensor of this model")


ALPHA = tensor("blk.0.ssm_alpha.weight", "gdn_ab", (16, 256), 0)     # 4096 values: small enough to protect
ATTN_Q = tensor("blk.0.attn_q.weight", "attn_q", (256, 256), 0)


def test_a_rule_a_protection_overrides_decides_nothing_and_leaves_the_file_tag():
    """Issue 18 #5: a gdn_ab rule whose tensors stay F32 by protection selected them but decided nothing."""
    r = recipe(rule("gdn_ab", "Q4_K") + rule("routed_down", "Q6_K"))
    tensors = [ALPHA, ATTN_Q, DOWN]
    res = resolve(r, tensors, {ALPHA.gguf_name: "F32", ATTN_Q.gguf_name: "BF16", DOWN.gguf_name: "BF16"})
    assert res.choices[ALPHA.gguf_name].qtype == T.F32
    assert [u.index for u in res.unused_rules] == [1] and res.decided == {2: 1} and res.default_decided == 1
    explanation = res.explain_unused(res.unused_rules[0])
    assert explanation.startswith("rule 1 (line 5) [class='gdn_ab'")
    assert (f"selects 1 tensors, decided none: default: small F32 tensor (<= {SMALL_F32_ELEMENTS} values) stays "
            f"F32 won for 1 (blk.0.ssm_alpha.weight)") in explanation
    # the recipe implies GDNab Q4_K; the file holds none: its tag says what it holds
    assert r.name_tag == "Q8-w2Q6K-GDNabQ4K"
    assert name_tag(r, res) == "Q8-w2Q6K"
    # once a gdn_ab tensor is large enough to be quantized, the rule decides it and is tagged
    big = tensor("blk.1.ssm_alpha.weight", "gdn_ab", (32, 256), 1)
    res = resolve(r, tensors + [big], {ALPHA.gguf_name: "F32", ATTN_Q.gguf_name: "BF16", DOWN.gguf_name: "BF16",
                                       big.gguf_name: "F32"})
    assert res.unused_rules == () and name_tag(r, res) == r.name_tag


def test_a_rule_a_more_specific_rule_beats_everywhere_is_explained_and_untagged():
    r = recipe(rule("attn_proj", "Q6_K") + rule("attn_q", "Q4_K", name=r"blk\.\d+\.attn_q\.weight"))
    res = resolve(r, [ATTN_Q], {ATTN_Q.gguf_name: "BF16"})
    assert [u.index for u in res.unused_rules] == [1] and res.default_decided == 0
    assert "decided none: rule 2 (line 8) won for 1 (blk.0.attn_q.weight)" in res.explain_unused(res.unused_rules[0])
    assert r.name_tag == "Q8-AProjQ6K-AQQ4K" and name_tag(r, res) == "AQQ4K"


def test_unused_expert_ranges_leave_the_file_tag():
    r = recipe(rule("routed_experts", "Q4_K", layers="37-42") + rule("routed_experts", "IQ2_XXS"))
    res = resolve(r, [DOWN], {DOWN.gguf_name: "BF16"})
    assert r.name_tag == "Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSExperts"
    assert name_tag(r, res) == "IQ2XXSExperts"


# -- row lengths and fallbacks ------------------------------------------------------------------------------------

Q_B = tensor("blk.0.attn_q_b.weight", "attn_q", (512, 128), 0)


def test_fallback_is_used_and_recorded():
    choice = choose(recipe(rule("attn_q", "Q4_K", fallback="Q8_0")), Q_B)
    assert (choice.qtype, choice.fallback_from, choice.rule) == (T.Q8_0, T.Q4_K, "rule 1 (line 5)")
    wide = tensor("blk.0.attn_q_a.weight", "attn_q", (128, 4096), 0)
    assert choose(recipe(rule("attn_q", "Q4_K", fallback="Q8_0")), wide).fallback_from is None


def test_missing_or_unfit_fallback_is_an_error_naming_the_tensor():
    with pytest.raises(RecipeError) as info:
        choose(recipe(rule("attn_q", "Q4_K")), Q_B)
    err = info.value
    assert err.tensor == "blk.0.attn_q_b.weight" and err.path == "test.toml"
    assert "row length 128 is not a multiple of Q4_K's block size 256" in str(err) and "rule 1 (line 5)" in str(err)
    odd = tensor("blk.0.attn_q_b.weight", "attn_q", (512, 48), 0)
    with pytest.raises(RecipeError, match="row length 48 fits neither Q4_K .* nor .* fallback Q8_0"):
        choose(recipe(rule("attn_q", "Q4_K", fallback="Q8_0")), odd)
    with pytest.raises(RecipeError, match=r"\[defaults\] type \(line 4\) gives no fallback"):
        choose(recipe("", defaults='type = "Q2_K"'), Q_B)


# -- keeping the source encoding --------------------------------------------------------------------------------

EXPS = tensor("blk.0.ffn_gate_exps.weight", "routed_gate", (8, 256, 512), 0, assembly="stack_experts")
SOURCE = recipe(rule("routed_experts", "source", fallback="Q8_0") + rule("attn_proj", "source")
                + rule("ngram_table", "source") + rule("gdn_ab", "source"))


@pytest.mark.parametrize("t, encoding, qtype, lossless", [
    (EXPS, "fp4-e8m0", T.MXFP4, "mxfp4-repack"),
    (EXPS, "nvfp4-modelopt", T.NVFP4, "nvfp4-repack"),
    (EXPS, "nvfp4-compressed-tensors", T.NVFP4, "nvfp4-repack"),
    (EXPS, "BF16", T.BF16, "copy"),
    (tensor("per_layer_token_embd.weight", "ngram_table", (2048, 128), assembly="concat_shards"), "BF16", T.BF16,
     "copy"),
    (tensor("blk.0.attn_q.weight", "attn_q", (256, 256), 0), "F32", T.F32, "copy"),
    # a pure permutation keeps values: still a copy
    (tensor("blk.0.ssm_alpha.weight", "gdn_ab", (32, 256), 0, transform=("gdn_heads_order",)), "BF16", T.BF16, "copy"),
    # NVFP4's block is 64: a 32-wide row takes the fallback, and is no longer lossless
    (tensor("blk.0.ffn_gate_exps.weight", "routed_gate", (8, 256, 96), 0), "nvfp4-modelopt", T.Q8_0, None),
])
def test_source_encodings_kept_losslessly(t, encoding, qtype, lossless):
    choice = choose(SOURCE, t, encoding)
    assert (choice.qtype, choice.lossless) == (qtype, lossless)


@pytest.mark.parametrize("t, encoding, message", [
    (EXPS, "fp8-block-e8m0", "fp8-block-e8m0 sources have no lossless GGUF type"),
    (EXPS, "mixed", "mixed sources have no lossless"),
    (EXPS, "F64", "F64 sources have no lossless"),
    (tensor("blk.0.attn_q_a.weight", "attn_q", (128, 256), 0), "nvfp4-modelopt", "llama.cpp loads no '.scale'"),
    (tensor("blk.0.ffn_gate_exps.weight", "routed_gate", (8, 256, 512), 0, transform=("gate_half",)), "fp4-e8m0",
     r"transforms this tensor \(gate_half\)"),
    (tensor("blk.0.ssm_alpha.weight", "gdn_ab", (32, 256), 0, transform=("plus_one",)), "BF16",
     r"transforms this tensor \(plus_one\)"),
])
def test_source_encoding_without_a_lossless_path_is_an_error(t, encoding, message):
    with pytest.raises(RecipeError, match=message) as info:
        choose(SOURCE, t, encoding)
    assert info.value.tensor == t.gguf_name


def test_explicit_float_types_record_copies():
    t = tensor("blk.0.attn_q.weight", "attn_q", (256, 256), 0)
    r = recipe(rule("attn_q", "BF16"))
    assert choose(r, t, "BF16").lossless == "copy"
    assert choose(r, t, "F32").lossless is None                 # a rounding, not a copy
    norm = tensor("blk.0.attn_norm.weight", "norm", (256,), 0, transform=("plus_one",))
    assert choose(r, norm, "F32").lossless is None              # w + 1 changes the values
