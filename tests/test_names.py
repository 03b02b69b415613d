"""Artifact names: every quoted seed name parses and renders back to itself, and parses into the claims read off it by
hand (tests/data/artifact_names.tsv); convert suggests a name and writes a release manifest whose SHA-256 is the
output's; validate fails a file whose name its contents contradict and passes a consistent one."""
from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.io.gguf_reader import GGUFFile
from quantkit.io.gguf_writer import GGUFWriter, plan_layout
from quantkit.names import (CLASSIFIED, contradictions, manifest_path, model_name, parse, restyle, suggest,
                            tensor_classes)
from quantkit.recipes import load_recipe, name_tag, shipped_recipes
from quantkit.testing.recipe_texts import PRE_TOKENIZER as PRE
from quantkit.testing.tiny_models import TinyCheckpointCache

DATA = Path(__file__).parent / "data" / "artifact_names.tsv"
#: Column -> the tensor class whose claimed types it lists.
CLASS_COLUMNS = {"gate": "routed_gate", "up": "routed_up", "down": "routed_down", "attn_proj": "attn_q",
                 "shared_expert": "shared_expert", "output": "output"}
COLUMN_CLASSES = {"routed_gate", "routed_up", "routed_down", "attn_q", "attn_kv", "attn_output", "shared_expert",
                  "output"}


def seed_names() -> list[dict[str, str]]:
    lines = [line.rstrip("\n") for line in DATA.read_text().splitlines() if not line.startswith("#")]
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:]]


ROWS = seed_names()


def _items(claims, cls: str) -> str:
    out = []
    for c in claims:
        if cls in c.classes:
            where = "@" + "+".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in c.layers) if c.layers else ""
            out.append("|".join(c.types) + where)
    return ",".join(out)


def _other(name) -> str:
    if name.style == "swapset":
        return f"{name.mix}:{'-'.join(name.variant)}"
    items = []
    for c in name.claims:
        if not c.classes:
            items.append(f"*={'|'.join(c.types)}")
        elif not c.classes & COLUMN_CLASSES:
            items += [f"{cls}={'|'.join(c.types)}" for cls in sorted(c.classes)]
    return ",".join(items)


def test_the_data_holds_every_name_quoted_in_context():
    quoted = {row["name"] for row in ROWS if row["source"].startswith("shared/CONTEXT.md")}
    assert "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf" in quoted
    assert len(quoted) == 10 and len(ROWS) == len({r["name"] for r in ROWS})
    assert {r["style"] for r in ROWS} == {"ds4", "ggml", "ud", "swapset"}


@pytest.mark.parametrize("row", ROWS, ids=[r["name"][:60] for r in ROWS])
def test_seed_name_round_trips_and_claims_what_it_says(row):
    name = parse(row["name"])
    assert name.render() == row["name"]
    assert name.style == row["style"] and name.model == row["model"]
    for column, cls in CLASS_COLUMNS.items():
        assert _items(name.claims, cls) == row[column], column
    if row["attn_proj"]:   # attention projections: q, kv and output alike
        assert _items(name.claims, "attn_kv") == _items(name.claims, "attn_output") == row["attn_proj"]
    assert _other(name) == row["other"]
    assert (name.calibration or "") == row["calibration"] and (name.label or "") == row["label"]


@pytest.mark.parametrize("name, mix_type", [("Qwen3-30B-A3B-UD-Q4_K_XL.gguf", "Q4_K"),
                                             ("GLM-5.2-UD-IQ2_XXS.gguf", "IQ2_XXS"), ("X-UD-Q3_K_M.gguf", "Q3_K")])
def test_a_ud_mix_claims_tensors_of_its_type(name, mix_type):
    """Unsloth's UD-<mix> is named after its main type (a UD-IQ2_XXS file holds IQ2_XXS tensors): claimed, so a
    renamed file is caught (a UD name claimed nothing)."""
    parsed = parse(name)
    assert parsed.style == "ud" and parsed.claims_anything
    assert contradictions(parsed, _tensors(mix_type, "Q8_0"), {}) == []
    assert contradictions(parsed, _tensors("Q8_0", "F16"), {})


@pytest.mark.parametrize("text", ["model.gguf", "Qwen3-30B-A3B-Q4_K_M.gguf", "ds4flash.gguf", "OLD.gguf", ""])
def test_a_name_outside_the_grammar_claims_nothing_and_still_round_trips(text):
    name = parse(text)
    assert not name.claims_anything and name.render() == text


def test_any_name_built_from_grammar_pieces_round_trips():
    """Parsing never fails and renders every name back: seeded names glued from the grammar's pieces and junk."""
    pieces = ["DeepSeek", "V4", "Flash", "GLM", "5.2", "UD", "IQ2_XXS", "IQ2XXS", "w2Q2K", "AProjQ8", "Q8", "Q8_0",
              "Q4K", "Layers37-42Q4KExperts", "OtherExpertLayersIQ2XXSGateUp", "RoutedIQ2XXS", "_blk78Q2K", "chat",
              "v2", "imatrix", "fixed", "0731", "...", "", "00001-of-00002", "nvfp4", "swapset", "x", "-", "_",
              ".gguf", "Q2KDown", "SExpQ4"]
    rng = random.Random(14)
    for _ in range(5000):
        text = rng.choice(["-", "_", ""]).join(rng.choice(pieces) for _ in range(rng.randint(1, 7)))
        assert parse(text).render() == Path(text).name, text


@pytest.mark.parametrize("row", [r for r in ROWS if r["style"] in ("ds4", "ud") and "Q4_0|" not in r["attn_proj"]
                                 and r["gate"]], ids=lambda r: r["name"][:60])
@pytest.mark.parametrize("style", ["ggml", "ud", "ds4"])
def test_restyled_names_parse_back_to_the_same_routed_claims(row, style):
    name = parse(row["name"])
    restyled = restyle(name, style)
    back = parse(restyled.render())
    assert back.render() == restyled.render() and back.style == style
    assert (back.calibration, back.label, back.model) == (name.calibration, name.label, name.model)
    kept = ("routed_gate", "routed_down") if style == "ggml" else ("routed_gate", "routed_up", "routed_down")
    for cls in kept:   # the unranged type of each routed class survives
        def unranged(claims):
            found = [c for c in claims if cls in c.classes and c.layers is None]
            return max(found, key=lambda c: c.specificity).types[0] if found else None
        assert unranged(back.claims) == unranged(name.claims)


@pytest.mark.parametrize("text", [r["name"] for r in ROWS] + [
    "GLM-5.3-Flash-Q2-0802-00001-of-00002.gguf", "/models/x-0731/DeepSeek-V4-Flash-IQ2XXS-w2Q2K-chat-v2.gguf",
    "model-07310.gguf", "model-0731.gguf", "model-0731.gguf.partial", "0731.gguf", "GLM-5.3-Flash-Q2-0731.gguf"])
def test_the_label_is_the_one_the_scorer_reads_off_a_ds4_name(text):
    from quantkit.scoring.source import file_name_label

    expected = file_name_label(text if text.endswith(".gguf") else text + ".gguf")   # it reads GGUF names
    name = parse(text)
    assert name.label == expected and name.render() == Path(text).name


def test_a_split_part_round_trips_and_is_checked_only_for_the_tensors_it_holds():
    name = parse("GLM-5.3-Flash-IQ2XXS-w2Q2K-SExpQ8-0802-00001-of-00002.gguf")
    assert (name.shard, name.label, name.model) == ("00001-of-00002", "0802", "GLM-5.3-Flash")
    assert name.render() == "GLM-5.3-Flash-IQ2XXS-w2Q2K-SExpQ8-0802-00001-of-00002.gguf"
    assert contradictions(name, _tensors("IQ2_XXS", "Q2_K"), {}) == []       # no shared expert in this part
    assert contradictions(name, _tensors("Q4_K", "Q2_K"), {})                # but what it holds is checked


def test_shipped_recipe_tags_render_the_seed_names():
    q2 = load_recipe("deepseek-v4-flash-iq2xxs-w2q2k")
    assert suggest("DeepSeek-V4-Flash", name_tag(q2), calibration="imatrix", label="0731").render() == \
        "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-imatrix-0731.gguf"
    # a label the grammar cannot read back (not 4 digits) stays out of the name: validate reads names back
    for label in ("0731 x", "tiny-moe-v1", "731"):
        named = suggest("DeepSeek-V4-Flash", name_tag(q2), label=label)
        assert named.label is None and parse(named.render()).label is None
    mixed = suggest("DeepSeek-V4-Flash", name_tag(load_recipe("deepseek-v4-flash-layers37-42-q4k")))
    assert mixed.render() == \
        "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8.gguf"
    assert restyle(suggest("DeepSeek-V4.1-Flash", name_tag(q2), calibration="imatrix"), "ggml").render() == \
        "DeepSeek-V4.1-Flash-IQ2_XXS-Q2_K-imatrix.gguf"


def test_a_support_files_name_carries_its_kind_and_parses_back():
    """A drafter made with its target's recipe never gets the target's name: its kind's word ends the model, as
    in ds4's DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf, and the name claims what the target's would."""
    from quantkit.convert.plan import SUPPORT_KINDS
    from quantkit.names import SUPPORT_WORDS

    assert set(SUPPORT_WORDS) == set(SUPPORT_KINDS)
    tag = "Q4KExperts-AProjQ8-SExpQ8-OutQ8"
    target = suggest("DeepSeek-V4-Flash", tag, label="0731")
    drafters = {kind: suggest("DeepSeek-V4-Flash", tag, label="0731", support=kind) for kind in SUPPORT_KINDS}
    assert drafters["mtp"].render() == "DeepSeek-V4-Flash-MTP-Q4KExperts-AProjQ8-SExpQ8-OutQ8-0731.gguf"
    assert drafters["dspark"].render() == "DeepSeek-V4-Flash-DSpark-Q4KExperts-AProjQ8-SExpQ8-OutQ8-0731.gguf"
    for name in drafters.values():
        assert parse(name.render()) == name and name.claims == target.claims and name.label == "0731"
    assert len({n.render() for n in (target, *drafters.values())}) == 1 + len(drafters)
    assert parse("DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf").model == "DeepSeek-V4-Flash-MTP"


def test_model_name_from_repo_snapshot_or_directory(tmp_path):
    assert model_name("deepseek-ai/DeepSeek-V4-Flash", tmp_path) == "DeepSeek-V4-Flash"
    snap = tmp_path / "models--zai-org--GLM-5.3-Flash" / "snapshots" / "84c6a6aa"
    assert model_name(None, snap) == "GLM-5.3-Flash" and model_name(None, tmp_path / "tiny") == "tiny"


# -- contradictions on tensor lists written out by hand -----------------------------------------------------------

def _tensors(gate: str, down: str, layers: int = 2, attn: str = "Q8_0") -> list[tuple[str, str, int]]:
    out = [("token_embd.weight", "Q8_0", 2), ("output.weight", "Q8_0", 2), ("output_norm.weight", "F32", 1)]
    for i in range(layers):
        out += [(f"blk.{i}.ffn_gate_exps.weight", gate, 3), (f"blk.{i}.ffn_up_exps.weight", gate, 3),
                (f"blk.{i}.ffn_down_exps.weight", down, 3), (f"blk.{i}.attn_q.weight", attn, 2),
                (f"blk.{i}.attn_output.weight", attn, 2), (f"blk.{i}.attn_norm.weight", "F32", 1)]
    return out


def test_type_contradictions_are_named_and_consistent_files_pass():
    name = parse("M-IQ2XXS-w2Q2K-AProjQ8-OutQ8.gguf")
    assert contradictions(name, _tensors("IQ2_XXS", "Q2_K"), {}) == []
    problems = contradictions(name, _tensors("Q4_K", "Q2_K"), {})
    assert len(problems) == 1 and "routed_gate/routed_up IQ2_XXS" in problems[0] \
        and "blk.0.ffn_gate_exps.weight Q4_K" in problems[0]
    assert any("attn_kv/attn_output/attn_q Q8_0" in p for p in contradictions(name, _tensors("IQ2_XXS", "Q2_K",
                                                                                            attn="Q4_K"), {}))
    # a name claiming a class the file does not have
    assert any("shared_expert Q8_0 but the file has no such tensor" in p
               for p in contradictions(parse("M-IQ2XXS-w2Q2K-SExpQ8.gguf"), _tensors("IQ2_XXS", "Q2_K"), {}))


def test_ranged_and_narrower_claims_win_and_recorded_fallbacks_are_accepted():
    ranged = parse("M-Layers1Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown.gguf")
    tensors = _tensors("IQ2_XXS", "Q2_K")
    tensors = [(n, "Q4_K" if n.startswith("blk.1.ffn_") and "_exps" in n else t, d) for n, t, d in tensors]
    assert contradictions(ranged, tensors, {}) == []
    assert contradictions(ranged, _tensors("IQ2_XXS", "Q2_K"), {})   # layer 1 is not Q4_K
    ud = parse("M-UD-IQ2_XXS_RoutedIQ2XXS_DownQ2K.gguf")
    assert contradictions(ud, _tensors("IQ2_XXS", "Q2_K"), {}) == []
    fallback = _tensors("IQ2_XXS", "Q2_K")
    fallback[3] = (fallback[3][0], "IQ4_NL", 3)
    name = parse("M-IQ2XXS-w2Q2K.gguf")
    assert contradictions(name, fallback, {})
    assert contradictions(name, fallback, {"quantkit.recipe.text": 'type = "IQ2_XXS"\nfallback = "IQ4_NL"\n'}) == []


def test_q4_means_q4_0_or_q4_k_and_bare_types_claim_presence():
    name = parse("M-IQ2XXS-w2Q2K-AProjQ4.gguf")
    assert contradictions(name, _tensors("IQ2_XXS", "Q2_K", attn="Q4_K"), {}) == []
    assert contradictions(name, _tensors("IQ2_XXS", "Q2_K", attn="Q4_0"), {}) == []
    mtp = parse("DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf")
    assert contradictions(mtp, _tensors("Q4_K", "Q4_K"), {}) == []
    assert any("no tensor is Q4_K" in p for p in contradictions(mtp, _tensors("Q2_K", "Q2_K"), {}))


def test_calibration_and_label_are_checked_against_quantkit_provenance_only():
    name = parse("M-IQ2XXS-w2Q2K-imatrix-0731.gguf")
    tensors = _tensors("IQ2_XXS", "Q2_K")
    quantkit = {"quantkit.recipe.name": "q2", "quantkit.imatrix.calibration": "bootstrap",
                "quantkit.checkpoint_label": "0801"}
    problems = contradictions(name, tensors, quantkit)
    assert len(problems) == 2 and "imatrix" in problems[0] and "'bootstrap'" in problems[0] \
        and "label 0731" in problems[1] and "'0801'" in problems[1]
    ok = {**quantkit, "quantkit.imatrix.calibration": "imatrix+bootstrap", "quantkit.checkpoint_label": "0731"}
    assert contradictions(name, tensors, ok) == []
    unlabelled = {k: v for k, v in ok.items() if k != "quantkit.checkpoint_label"}
    assert contradictions(name, tensors, unlabelled) == []   # the scorer takes the label from the name
    assert contradictions(name, tensors, {}) == []   # a foreign file: tensor types only


# -- convert and validate on the tiny example model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny qwen3_moe checkpoint converted with the example Q2 recipe (bootstrap importance, label 0731)."""
    root = tmp_path_factory.mktemp("names")
    source = TinyCheckpointCache(root / "cache").get("qwen3_moe", "per-expert", "bf16")
    out = root / "out" / "q.gguf"
    out.parent.mkdir()
    report = root / "report.json"
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), "--recipe", "tiny-moe-iq2xxs-w2q2k",
                                       "--bootstrap-importance", "--label", "0731", "--pre-tokenizer", PRE,
                                       "--report", str(report), "--no-progress", "-j", "1"])
    assert result.exit_code == 0, result.output
    return source, out, report, result.output


def test_an_imatrix_no_tensor_takes_is_not_named(tmp_path):
    """A Q8_0 recipe takes no importance: the file records calibration none, and the name convert suggested said
    -imatrix, which validate's name.claims then refused."""
    from quantkit.testing.synthetic_imatrix import write_synthetic_imatrix

    source = TinyCheckpointCache(tmp_path / "cache").get("qwen3_moe", "per-expert", "bf16")
    imatrix = tmp_path / "imatrix.gguf"
    write_synthetic_imatrix(source, imatrix, seed=1)
    out = tmp_path / "q.gguf"
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), "--recipe", "q8_0", "--imatrix",
                                       str(imatrix), "--allow-synthetic-imatrix",
                                       "--pre-tokenizer", PRE, "--no-progress", "-j", "1"])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("name        ")]
    suggested = line.split()[1]
    assert "imatrix" not in suggested
    named = out.with_name(suggested)
    out.rename(named)
    result = CliRunner().invoke(main, ["validate", str(named), "--source", str(source)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("arch, encoding", [("qwen3_moe", "bf16"), ("deepseek_v4", "fp4-experts"),
                                            ("qwen3_moe", "nvfp4-modelopt")])
def test_native_experts_are_named_as_convert_suggests(tmp_path, arch, encoding):
    """type = "source" is named Native: validate compared the claim with a type called "source" and refused the
    name convert itself suggested (BF16 kept as BF16, packed FP4 as MXFP4, NVFP4 as NVFP4)."""
    source = TinyCheckpointCache(tmp_path / "cache").get(arch, "per-expert", encoding)
    recipe = tmp_path / "native.toml"
    recipe.write_text(f'name = "native"\narchitectures = ["{arch}"]\n[defaults]\ntype = "Q8_0"\n[[rule]]\n'
                      f'class = "routed_experts"\ntype = "source"\n')
    out = tmp_path / "q.gguf"
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), "--recipe", str(recipe),
                                       "--pre-tokenizer", PRE, "--no-progress", "-j", "1"])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("name        ")]
    named = out.with_name(line.split()[1])
    assert "Native" in named.name
    out.rename(named)
    result = CliRunner().invoke(main, ["validate", str(named), "--source", str(source)])
    assert result.exit_code == 0, result.output


def test_a_label_the_name_cannot_carry_is_noted(tmp_path):
    """A label outside the name grammar is recorded in the file and left out of the name: it was left out silently."""
    source = TinyCheckpointCache(tmp_path / "cache").get("qwen3_moe", "per-expert", "bf16")
    for label, noted in (("v2 beta", True), ("0731", False)):
        result = CliRunner().invoke(main, ["convert", str(source), "-o", str(tmp_path / "q.gguf"), "--recipe", "q8_0",
                                           "--label", label, "--pre-tokenizer", PRE, "--dry-run"])
        assert result.exit_code == 0, result.output
        assert (f"label {label!r} is recorded in the file" in result.stderr) == noted, result.output


def test_convert_suggests_the_name_and_writes_a_manifest_with_the_outputs_sha256(converted):
    source, out, report, output = converted
    suggested = f"{source.name}-IQ2XXS-w2Q2K-AProjQ8-OutQ8-0731.gguf"
    assert f"name        {suggested}  (suggested; writing q.gguf)" in output
    manifest = json.loads(manifest_path(out).read_text())
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert manifest["sha256"] == digest and manifest["size"] == out.stat().st_size
    assert manifest["name"] == "q.gguf" and manifest["suggested_name"] == suggested and manifest["label"] == "0731"
    recipe = load_recipe("tiny-moe-iq2xxs-w2q2k")
    assert manifest["recipe"] == {"name": recipe.name, "sha256": recipe.sha256,
                                  "tag": "IQ2XXS-w2Q2K-AProjQ8-OutQ8"}
    assert manifest["calibration"] == {"kind": "bootstrap", "imatrix": None}
    files = {f["name"]: f["sha256"] for f in manifest["source"]["files"]}
    assert files and all(files[n] == hashlib.sha256((source / n).read_bytes()).hexdigest() for n in files)
    weights = sorted(p for p in source.iterdir() if p.suffix == ".safetensors")
    lines = "".join(f"{p.name}\t{hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in weights)
    assert manifest["source"]["digest"] == hashlib.sha256(lines.encode()).hexdigest()
    recorded = json.loads(report.read_text())
    assert recorded["sha256"] == digest and recorded["suggested_name"] == suggested
    assert recorded["release_manifest"] == str(manifest_path(out))


def test_convert_refuses_an_existing_manifest_without_force_before_any_work(converted, tmp_path):
    source, *_ = converted
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    for resume in ([], ["--resume"]):   # --resume continues a conversion; it does not license replacing files
        result = CliRunner().invoke(main, ["convert", str(source), "-o", str(tmp_path / "x.gguf"), "--recipe",
                                           "tiny-moe-f16", "--pre-tokenizer", PRE, "--release-manifest", str(taken),
                                           "--no-progress", "-j", "1", *resume])
        assert result.exit_code == 2 and "release manifest" in result.stderr and taken.read_text() == "{}"
        assert not (tmp_path / "x.gguf").exists()


def test_convert_replaces_its_own_stale_manifest(converted, tmp_path):
    source, *_ = converted
    out = tmp_path / "f16.gguf"
    args = ["convert", str(source), "-o", str(out), "--recipe", "tiny-moe-f16", "--pre-tokenizer", PRE,
            "--no-progress", "-j", "1"]
    assert CliRunner().invoke(main, args).exit_code == 0
    stale = manifest_path(out).read_text()
    out.unlink()   # the output is gone; its manifest is left behind
    result = CliRunner().invoke(main, [*args, "--label", "0731"])
    assert result.exit_code == 0, result.output
    fresh = json.loads(manifest_path(out).read_text())
    assert manifest_path(out).read_text() != stale and fresh["label"] == "0731"
    assert fresh["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()


def _validate(path: Path):
    return CliRunner().invoke(main, ["validate", str(path), "--structure-only"])


@pytest.mark.parametrize("claimed, why", [
    ("tiny-Q4KExperts-AProjQ8-OutQ8-0731.gguf", "routed_down/routed_gate/routed_up Q4_K"),
    ("tiny-IQ2XXS-w2Q2K-AProjQ8-OutQ8-imatrix-0731.gguf", "imatrix calibration"),
    ("tiny-IQ2XXS-w2Q2K-AProjQ8-OutQ8-0801.gguf", "checkpoint label 0801"),
    ("tiny-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-0731.gguf", "shared_expert Q8_0 but the file has no such tensor"),
])
def test_validate_fails_a_name_its_contents_contradict(converted, tmp_path, claimed, why):
    _, out, _, _ = converted
    renamed = tmp_path / claimed
    shutil.copyfile(out, renamed)
    result = _validate(renamed)
    assert result.exit_code == 1, result.output
    line = next(line for line in result.output.splitlines() if "name.claims" in line)
    assert line.split()[0] == "failed" and why in result.output


@pytest.mark.parametrize("claimed", ["tiny-IQ2XXS-w2Q2K-AProjQ8-OutQ8-0731.gguf",
                                     "DeepSeek-V4.1-Flash-IQ2_XXS-Q2_K-0731.gguf", "anything.gguf"])
def test_validate_passes_a_consistent_name_and_skips_one_without_claims(converted, tmp_path, claimed):
    _, out, _, _ = converted
    renamed = tmp_path / claimed
    shutil.copyfile(out, renamed)
    result = _validate(renamed)
    assert result.exit_code == 0, result.output
    lines = [line.split()[0] for line in result.output.splitlines() if "name.claims" in line]
    assert lines == ([] if claimed == "anything.gguf" else ["passed"])   # a name claiming nothing adds no check
    with GGUFFile(renamed) as f:   # the claims were checked against tensors that are there
        assert any(t.type.name == "IQ2_XXS" for t in f.tensors.values())


def _foreign_gguf(path: Path) -> Path:
    """A GGUF with no quantkit provenance: routed gate/up Q8_0, routed down and output F16."""
    tensors = [("blk.0.ffn_gate_exps.weight", (2, 32, 64), "Q8_0"), ("blk.0.ffn_up_exps.weight", (2, 32, 64), "Q8_0"),
               ("blk.0.ffn_down_exps.weight", (2, 64, 32), "F16"), ("output.weight", (16, 64), "F16")]
    layout = plan_layout({"general.architecture": "llama"}, tensors)
    with GGUFWriter(path, layout) as writer:
        writer.write_header()
        for name, _, _ in tensors:
            writer.write_tensor(name, bytes(layout.tensor(name).nbytes))
        writer.finish()
    return path


@pytest.mark.parametrize("claimed, status", [
    ("M-Q8GateUp-F16Down-OutF16.gguf", "passed"),
    ("M-Q8GateUp-F16Down-imatrix-0731.gguf", "passed"),   # no provenance: only the tensor types are checked
    ("M-IQ2XXS-w2Q2K.gguf", "failed"),
    ("M-Q8_0.gguf", "failed"),                             # every routed expert Q8_0: the down projection is F16
])
def test_a_foreign_file_is_checked_for_tensor_types_only(tmp_path, claimed, status):
    result = _validate(_foreign_gguf(tmp_path / claimed))
    lines = [line.split() for line in result.output.splitlines() if "name.claims" in line]
    assert len(lines) == 1 and lines[0][0] == status, result.output
    if status == "failed":
        assert result.exit_code == 1


@pytest.mark.parametrize("dialect", ["llama.cpp", "ds4"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_tensor_classes_agree_with_the_architecture_maps(tmp_path_factory, arch, dialect):
    """The name check's GGUF-name classifier gives every tensor of a planned conversion the class quantkit's own
    architecture map gives it, for every class it claims to find."""
    from quantkit.convert import build_plan
    from quantkit.errors import QuantkitError

    source = TinyCheckpointCache(tmp_path_factory.getbasetemp() / "names-cache").get(arch, "per-expert", "bf16")
    try:
        plan = build_plan(source, "q8_0", dialect=dialect, pre_tokenizer=PRE)
    except QuantkitError as exc:   # no ds4 dialect for the architecture, or not for this tiny config
        pytest.skip(str(exc))
    matrices = {t.name: t.output.tensor_class for t in plan.tensors if len(t.output.shape) >= 2}
    (architecture,) = [kv.value for key, kv in plan.metadata if key == "general.architecture"]
    found = tensor_classes(matrices, architecture)
    expected = {n: cls for n, cls in matrices.items() if cls in CLASSIFIED}
    assert found == expected and expected


PLANNED = [(r.name, arch) for r in shipped_recipes()
           for arch in ("qwen3_moe", "deepseek_v3", "deepseek_v4", "glm5_next", "qwen4_exp") if arch in r.architectures]


@pytest.mark.parametrize("recipe_name, arch", PLANNED, ids=[f"{r}-{a}" for r, a in PLANNED])
def test_the_suggested_name_of_every_shipped_recipe_holds_for_its_plan(tmp_path_factory, recipe_name, arch):
    """What convert would suggest for a tiny model of each architecture a shipped recipe names, checked against the
    types quantkit plans for it: no claim contradicted, every routed-expert claim backed by tensors."""
    from quantkit.convert import build_plan

    if load_recipe(recipe_name).support == "mtp":   # a recipe of the MTP file: a checkpoint that holds the block
        from quantkit.testing.tiny_mtp import write_v4_with_mtp

        source = write_v4_with_mtp(tmp_path_factory.mktemp("mtp"))
    else:
        source = TinyCheckpointCache(tmp_path_factory.getbasetemp() / "names-cache").get(arch, "per-expert", "bf16")
    plan = build_plan(source, recipe_name, bootstrap=True, label="0731", pre_tokenizer=PRE)
    name = suggest(arch, plan.name_tag, label="0731", support=plan.support)
    tensors = [(t.name, t.qtype.name, len(t.output.shape)) for t in plan.tensors]
    metadata = {"general.architecture": next(kv.value for k, kv in plan.metadata if k == "general.architecture"),
                "quantkit.recipe.name": recipe_name, "quantkit.recipe.text": plan.recipe.text,
                "quantkit.checkpoint_label": "0731"}
    assert contradictions(parse(name.render()), tensors, metadata) == []
    routed = {t.name: t.qtype.name for t in plan.tensors if "_exps." in t.name}
    if any(c.classes & {"routed_gate", "routed_down"} for c in name.claims):
        assert contradictions(parse(name.render()), [(n, "TQ1_0", 3) for n in routed], {})   # the check can fail


#: Recipes whose ranged rules split a range's expert types or overlap (qwen3_moe's tiny model has layers 0-3).
RANGED_RECIPES = {
    "narrow-down": 'class = "routed_experts"\ntype = "Q4_K"\n[[rule]]\nclass = "routed_down"\nlayers = "1"\n'
                   'type = "Q2_K"\n',
    "overlapping": 'class = "routed_experts"\nlayers = "0-2"\ntype = "Q4_K"\n[[rule]]\nclass = "routed_down"\n'
                   'layers = "1"\ntype = "Q2_K"\n',
}


@pytest.mark.parametrize("body", RANGED_RECIPES.values(), ids=list(RANGED_RECIPES))
def test_the_suggested_name_of_a_ranged_recipe_holds_for_its_plan(tmp_path_factory, tmp_path, body):
    """A range's down projection named without its range claimed every layer's down projection, and a narrower
    range took the default type for what a wider range gives: validate refused the names convert suggested."""
    from quantkit.convert import build_plan

    path = tmp_path / "r.toml"
    path.write_text(f'name = "r"\narchitectures = ["qwen3_moe"]\n[defaults]\ntype = "Q8_0"\n[[rule]]\n{body}')
    source = TinyCheckpointCache(tmp_path_factory.getbasetemp() / "names-cache").get("qwen3_moe", "per-expert",
                                                                                       "bf16")
    plan = build_plan(source, str(path), pre_tokenizer=PRE)
    name = parse(suggest("qwen3_moe", plan.name_tag).render())
    tensors = [(t.name, t.qtype.name, len(t.output.shape)) for t in plan.tensors]
    assert contradictions(name, tensors, {}) == [], name.render()
    down = next(t.name for t in plan.tensors if t.name.startswith("blk.1.ffn_down_exps"))
    assert contradictions(name, [(n, "Q4_K" if n == down else q, d) for n, q, d in tensors], {})   # it can fail

