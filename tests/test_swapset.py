"""Swapset pipeline on the tiny checkpoints: families, manifests, native FP8/NVFP4 copies, self-quantization,
shared experts as an extra expert, the inventory (status / gc), apply_sidecars, validate_sidecar, and bad input
(one-line error, exit 2, nothing written)."""
import json
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.arch import ARCHITECTURES, TENSOR_CLASSES
from quantkit.cli import main
from quantkit.errors import FormatError, SourceError, StateError, ValidationError
from quantkit.formats import blockscaled
from quantkit.io.atomic import sha256_file
from quantkit.io.checkpoint import open_checkpoint
from quantkit.io.safetensors import SafetensorsFile, write_safetensors
from quantkit.swapset import (FAMILIES, SwapsetRequest, apply_sidecars, build_swapset, gc, list_families,
                              record_quality, status, validate_sidecar)
from quantkit.swapset.families import Family
from quantkit.swapset.encodings import get_encoding
from quantkit.swapset.manifest import SCHEMA_VERSION, checkpoint_identity, read_manifest, validate_manifest
from quantkit.swapset.tensors import tensor_sha256
from quantkit.swapset.writer import Planned, PlannedSafetensors
from quantkit.testing.tiny_models import TinyCheckpointCache

L0 = "model.language_model.layers.0"
L1 = "model.language_model.layers.1"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return TinyCheckpointCache(tmp_path_factory.getbasetemp() / "swapset-tiny")


@pytest.fixture
def model(tmp_path, tiny):
    """A fresh copy of a tiny checkpoint (sidecars are written beside it)."""
    def copy(arch="glm5_next", encoding="bf16", name="model", layout="per-expert"):
        return shutil.copytree(tiny.get(arch, layout=layout, encoding=encoding), tmp_path / name)
    return copy


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def files(directory):
    return sorted(p.name for p in directory.iterdir())


def rewrite(directory, change):
    """Rewrite a single-file checkpoint's tensors through ``change(dict) -> dict``."""
    f = SafetensorsFile(directory / "model.safetensors")
    tensors = {n: np.array(f.array(n)) for n in f.names()}
    dtypes = {n: e.dtype for n, e in f.entries.items()}
    f.close()
    tensors = change(tensors)
    write_safetensors(directory / "model.safetensors", tensors, {"format": "pt"},
                      dtypes={n: dtypes[n] for n in tensors if n in dtypes}, overwrite=True)


# ---------------------------------------------------------------------------------------------------------------
# families

def test_family_tables_name_real_classes_and_architectures():
    for model_type, families in FAMILIES.items():
        assert model_type in ARCHITECTURES
        assert "lmhead" in families
        for family in families.values():
            assert family.classes <= set(TENSOR_CLASSES), family.name
    assert {"inproj", "mla", "shared", "mtp", "lmhead", "dense"} <= set(FAMILIES["glm5_next"])


def test_families_of_tiny_glm5(model):
    d = model()
    counts = {r["family"]: r["tensors"] for r in list_families(d)}
    # KDA q/k/v of layer 0; q_a + kv_a of layers 1-2 and layer 1's own indexer wq_b; shared gate/up/down x2
    assert counts == {"inproj": 3, "mla": 5, "shared": 6, "dense": 3, "experts": 48, "lmhead": 1, "mtp": 0}
    out = run("swapset", d, "--list-families")
    assert out.exit_code == 0 and "inproj" in out.output and "(opt-in)" in out.output


def test_fused_expert_stacks_without_a_weight_suffix_are_experts(model):
    """transformers' fused layout stores routed experts as [E, out, in] stacks under the module's own name
    (``mlp.experts.gate_up_proj``, no ``.weight``): the experts family selects them; nothing else changes."""
    d = model("qwen3_moe", layout="fused")
    assert {r["family"]: r["tensors"] for r in list_families(d)} == {"attn": 8, "experts": 4, "lmhead": 1}
    result = build_swapset(SwapsetRequest(d, families=("experts",), fmt="fp8-block128"))
    stacks = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    assert [m["module"] for m in result.manifest["modules"]] == stacks
    assert all(list(m["replaces"]) == [m["module"]] for m in result.manifest["modules"])
    shapes = {t["name"]: t["shape"] for t in result.manifest["tensors"]}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj.weight"] == [8, 512, 256]
    assert shapes["model.layers.0.mlp.experts.gate_up_proj.weight_scale_inv"] == [8, 4, 2]
    assert validate_sidecar(result.manifest_path).ok
    assert set(apply_sidecars(d, [result.plan.name])) == set(stacks)


def test_scopes_keep_mtp_and_main_apart():
    mla = FAMILIES["glm5_next"]["mla"]
    mtp = FAMILIES["glm5_next"]["mtp"]
    q_a = "model.layers.3.self_attn.q_a_proj"
    assert mla.admits(q_a, frozenset({"attn_q"}), mtp=False) and not mla.admits(q_a, frozenset({"attn_q"}), mtp=True)
    assert mtp.admits(q_a, frozenset({"attn_q"}), mtp=True)
    assert not mtp.admits("model.layers.3.embed_tokens", frozenset({"mtp"}), mtp=True)
    assert not mtp.admits("model.layers.3.mlp.gate", frozenset({"router"}), mtp=True)
    assert not Family("x", "", frozenset({"output"})).admits("lm_head", frozenset({"attn_q"}), mtp=False)


def test_mtp_family_on_a_checkpoint_with_a_nextn_block(model):
    d = model()
    config = json.loads((d / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    extra = {"model.language_model.layers.3.eh_proj.weight": (256, 512),
             "model.language_model.layers.3.self_attn.q_a_proj.weight": (128, 256),
             "model.language_model.layers.3.shared_head.head.weight": (512, 256),
             "model.language_model.layers.3.embed_tokens.weight": (512, 256),
             "model.language_model.layers.3.enorm.weight": (256,)}
    rewrite(d, lambda t: {**t, **{n: rng.standard_normal(s).astype(np.float32) for n, s in extra.items()}})
    counts = {r["family"]: r["tensors"] for r in list_families(d)}
    assert counts["mtp"] == 3 and counts["mla"] == 5      # eh_proj, q_a, shared_head.head; main MLA unchanged
    result = build_swapset(SwapsetRequest(d, families=("mtp",), fmt="nvfp4", convention="modelopt"))
    assert result.plan.name == "nvfp4-swapset-mtp" and result.manifest["optional"] is True
    assert {m["module"].split(".")[-1] for m in result.manifest["modules"]} == {"eh_proj", "q_a_proj", "head"}
    assert validate_sidecar(result.manifest_path).ok


# ---------------------------------------------------------------------------------------------------------------
# making sidecars

def test_nvfp4_sidecar_files_and_manifest(model):
    d = model()
    before = files(d)
    out = run("swapset", d, "--family", "inproj", "--format", "nvfp4", "--convention", "modelopt")
    assert out.exit_code == 0, out.output
    assert files(d) == sorted(before + ["nvfp4-swapset-inproj.json", "nvfp4-swapset-inproj.safetensors"])
    m = read_manifest(d / "nvfp4-swapset-inproj.json")
    assert (m["schema_version"], m["kind"], m["families"], m["format"], m["convention"], m["encoding"]) == \
        (SCHEMA_VERSION, "replace", ["inproj"], "nvfp4", "modelopt", "nvfp4-modelopt")
    assert m["tensor_parallel"] == {"layout": "none"} and m["supersedes"] == [] and m["quality"] is None
    assert m["generator"]["name"] == "quantkit" and m["generator"]["arguments"]["families"] == ["inproj"]
    assert m["sidecar"]["sha256"] == sha256_file(d / "nvfp4-swapset-inproj.safetensors")
    with open_checkpoint(d) as ckpt:
        assert m["checkpoint"] == checkpoint_identity(d, "none")
        assert m["source"] == {**m["checkpoint"], "path": "."}
        for module in m["modules"]:
            weight = module["source_tensor"]
            assert module["origin"] == "self-quantized" and module["source_encoding"] == "plain"
            assert module["source_sha256"] == tensor_sha256(ckpt.raw(weight))
            assert module["replaces"] == {weight: tensor_sha256(ckpt.raw(weight))}
            assert module["group"] == "model.layers.0.self_attn.qkv_proj"
    roles = {t["name"].rsplit(".", 1)[1]: (t["role"], t["dtype"]) for t in m["tensors"]}
    assert roles == {"weight": ("weight", "U8"), "weight_scale": ("block_scale", "F8_E4M3"),
                     "weight_scale_2": ("global_scale", "F32")}
    assert all(t["origin"] == "self-quantized" and t["shape"] for t in m["tensors"] if t["role"] == "weight")
    assert validate_sidecar(d / "nvfp4-swapset-inproj.safetensors").ok


def test_a_changed_scale_fails_the_default_validation_and_a_fused_group_shares_its_global_scale(model):
    """A scale changed within the error bound passed validate's default payload mode (its SHA-256 was compared with
    --payload full only); and q/k/v with different global scales passed, though engines run them as one matmul."""
    d = model()
    assert run("swapset", d, "--family", "inproj", "--format", "nvfp4", "--convention", "modelopt").exit_code == 0
    st, js = d / "nvfp4-swapset-inproj.safetensors", d / "nvfp4-swapset-inproj.json"
    with SafetensorsFile(st) as f:       # q's global scale 2% larger, in place (the size stays the manifest's)
        (q_global,) = [n for n in f.names() if n.endswith("q_proj.weight_scale_2")]
        at, larger = f.entries[q_global].begin, np.float32(f.array(q_global)) * np.float32(1.02)
    with open(st, "r+b") as fh:
        fh.seek(at)
        fh.write(larger.tobytes())
    out = run("validate", js)
    assert out.exit_code == 1 and "SHA-256 differs from the manifest" in out.output, out.output
    manifest = json.loads(js.read_text())           # the manifest rewritten to match: the scales check finds it
    manifest["sidecar"].update(sha256=sha256_file(st), bytes=st.stat().st_size)
    js.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    report = validate_sidecar(js)
    assert not report.ok
    (scales,) = [c for c in report.checks if c["check"] == "scales"]
    assert not scales["ok"] and "qkv_proj: its members' global scales differ" in scales["detail"]


def test_fp8_native_tensors_are_copied_and_the_rest_self_quantized(model):
    d, source = model(), model(encoding="fp8-block", name="fp8")
    result = build_swapset(SwapsetRequest(d, families=("mla", "lmhead"), fmt="fp8-block128", source_dir=source,
                                          name="fp8-swapset-mla"))
    m = result.manifest
    origins = {mod["module"]: mod["origin"] for mod in m["modules"]}
    assert origins.pop("lm_head") == "self-quantized"          # BF16 in the FP8 release
    assert set(origins.values()) == {"native"} and len(origins) == 5
    assert m["source"]["path"] == str(source.resolve()) and m["source"]["quantization"] == "fp8-block"
    payload = SafetensorsFile(result.safetensors)
    with open_checkpoint(source) as src:
        for t in m["tensors"]:
            if t["origin"] == "native":
                np.testing.assert_array_equal(payload.array(t["name"]).view(np.uint8) if t["dtype"] != "F32"
                                              else payload.array(t["name"]), src.raw(t["source"]).view(np.uint8)
                                              if t["dtype"] != "F32" else src.raw(t["source"]))
                assert t["source_sha256"] == tensor_sha256(src.raw(t["source"]))
        codes, scale_inv = blockscaled.fp8_block_quantize(src.tensor_f32("lm_head.weight"))
    np.testing.assert_array_equal(payload.array("lm_head.weight").view(np.uint8), codes)
    np.testing.assert_array_equal(payload.array("lm_head.weight_scale_inv"), scale_inv)
    assert validate_sidecar(result.manifest_path).ok


def test_e8m0_blocks_native_only_from_an_e8m0_source(model):
    d, e8m0 = model(), model(encoding="fp8-e8m0", name="e8m0")
    native = build_swapset(SwapsetRequest(d, families=("dense",), fmt="fp8-block128-e8m0", source_dir=e8m0))
    assert {mod["origin"] for mod in native.manifest["modules"]} == {"native"}
    assert {t["dtype"] for t in native.manifest["tensors"] if t["role"] == "block_scale"} == {"F8_E8M0"}
    requantized = build_swapset(SwapsetRequest(d, families=("dense",), fmt="fp8-block128", source_dir=e8m0,
                                               name="v3-dense", supersedes=(native.plan.name,)))
    assert {(mod["origin"], mod["source_encoding"]) for mod in requantized.manifest["modules"]} == \
        {("self-quantized", "fp8-block-e8m0")}
    assert validate_sidecar(native.manifest_path).ok and validate_sidecar(requantized.manifest_path).ok


def test_deepseek_v4_upstream_layout_keeps_its_scale_names(model):
    d = model("deepseek_v4", "bf16", "v4", layout="official")
    source = model("deepseek_v4", "fp8-e8m0", "v4-fp8", layout="official")
    result = build_swapset(SwapsetRequest(d, families=("mla", "lmhead"), fmt="fp8-block128-e8m0", source_dir=source))
    by_module = {m["module"]: m["origin"] for m in result.manifest["modules"]}
    assert by_module.pop("head") == "self-quantized" and set(by_module.values()) == {"native"}
    names = {t["name"] for t in result.manifest["tensors"]}
    assert {"head.weight", "head.scale", "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale"} <= names
    assert validate_sidecar(result.manifest_path).ok


@pytest.mark.parametrize("fmt,scale_shape", [("fp8-tensor", lambda m: [1]), ("fp8-channel", lambda m: [m, 1])])
def test_fp8_tensor_and_channel_sidecars(model, fmt, scale_shape):
    d = model("qwen3_moe")
    result = build_swapset(SwapsetRequest(d, families=("attn",), fmt=fmt))
    shapes = {t["name"]: t["shape"] for t in result.manifest["tensors"]}
    for t in result.manifest["tensors"]:
        if t["role"] == "scale":
            assert t["shape"] == scale_shape(shapes[t["module"] + ".weight"][0])
    assert validate_sidecar(result.manifest_path).ok


def test_nvfp4_from_a_matching_nvfp4_checkpoint_is_native(model):
    d = model(encoding="nvfp4-compressed-tensors")
    result = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="nvfp4"))   # convention from the checkpoint
    assert result.manifest["convention"] == "compressed-tensors"
    assert {mod["origin"] for mod in result.manifest["modules"]} == {"native"}
    assert {t["name"].rsplit(".", 1)[1] for t in result.manifest["tensors"]} == \
        {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
    assert validate_sidecar(result.manifest_path).ok


def test_shared_experts_served_as_an_extra_expert(model):
    d = model()
    result = build_swapset(SwapsetRequest(d, families=("shared",), fmt="nvfp4", convention="modelopt",
                                          shared_experts=True))
    m = result.manifest
    assert m["shared_as_expert"] == {"expert_index": 8} and m["optional"] is True
    projections = ("gate_proj", "up_proj", "down_proj")
    assert {mod["output_module"] for mod in m["modules"]} == {
        f"model.language_model.layers.{layer}.mlp.experts.8.{p}" for layer in (1, 2) for p in projections}
    replacements = apply_sidecars(d, [m["name"]])
    key = f"{L1}.mlp.shared_experts.gate_proj.weight"
    assert replacements[key].removes == (key,)
    assert set(replacements[key].tensors) == {f"{L1}.mlp.experts.8.gate_proj.{s}"
                                              for s in ("weight", "weight_scale", "weight_scale_2")}
    gate, up = (replacements[f"{L1}.mlp.shared_experts.{p}.weight"].tensors for p in ("gate_proj", "up_proj"))
    assert gate[f"{L1}.mlp.experts.8.gate_proj.weight_scale_2"] == up[f"{L1}.mlp.experts.8.up_proj.weight_scale_2"]


# ---------------------------------------------------------------------------------------------------------------
# inventory

def legacy_sidecar(d, name):
    """A sidecar made by another tool: a safetensors file and a JSON that is not a quantkit manifest."""
    write_safetensors(d / f"{name}.safetensors", {"x.weight": np.ones((2, 2), np.float32)})
    (d / f"{name}.json").write_text(json.dumps({"made_by": "slimserve"}))


def test_status_classifies_and_gc_removes_only_obsolete(model, tmp_path):
    d = model()
    legacy_sidecar(d, "fp8-swapset")
    old = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="nvfp4", convention="modelopt", name="old"))
    new = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="fp8-channel", name="new",
                                       supersedes=("old", "fp8-swapset")))
    build_swapset(SwapsetRequest(d, families=("shared",), fmt="nvfp4", convention="modelopt"))
    legacy_sidecar(d, "mystery")
    states = {s.name: s.state for s in status(d).sidecars}
    assert states == {"old": "obsolete", "new": "required", "nvfp4-swapset-shared": "optional",
                      "fp8-swapset": "obsolete", "mystery": "unknown"}

    record = tmp_path / "record.json"
    record.write_text(json.dumps({"sidecars": ["nvfp4-swapset-shared", {"name": "gone"}]}))
    report = status(d, record, full=True)
    assert {s.name: s.state for s in report.sidecars}["nvfp4-swapset-shared"] == "required"
    assert {s.name: s.state for s in report.sidecars}["new"] == "optional"
    assert report.missing == ["gone"] and not report.record_satisfied
    out = run("swapset", "status", d, "--record", record)
    assert out.exit_code == 1 and "missing" in out.output and "obsolete" in out.output
    data = json.loads(run("swapset", "status", d, "--json").output)
    assert data["bytes_by_state"]["obsolete"] == sum(s["bytes"] for s in data["sidecars"] if s["state"] == "obsolete")

    assert run("swapset", "gc", d).exit_code == 2
    out = run("swapset", "gc", d, "--dry-run")
    assert out.exit_code == 0 and "would remove old" in out.output and (d / "old.json").exists()
    report = gc(d, dry_run=False)
    assert {s.name for s in report.removed} == {"old"}
    assert {s.name for s, _ in report.kept} == {"fp8-swapset"}   # another tool's files: listed, never deleted
    names = files(d)
    assert "old.json" not in names and "old.safetensors" not in names
    assert {"new.json", "mystery.json", "mystery.safetensors", "fp8-swapset.json", "fp8-swapset.safetensors"} \
        <= set(names)
    assert validate_sidecar(new.manifest_path).ok and old.manifest_path.name not in names

    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "edited": True}))
    states = {s.name: s.state for s in status(d).sidecars}
    assert states["new"] == "stale" and states["nvfp4-swapset-shared"] == "stale"


def test_gc_deletes_only_files_a_quantkit_manifest_records(model):
    """Issue #18, defect 16: `--supersedes adapter` named a user's adapter.safetensors and `gc --yes` deleted it."""
    d = model()
    write_safetensors(d / "adapter.safetensors", {"lora.weight": np.ones((2, 2), np.float32)})
    adapter = (d / "adapter.safetensors").read_bytes()
    old = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="nvfp4", convention="modelopt", name="old"))
    edited = build_swapset(SwapsetRequest(d, families=("shared",), fmt="nvfp4", convention="modelopt",
                                          name="edited"))
    build_swapset(SwapsetRequest(d, families=("inproj",), fmt="fp8-channel", name="new",
                                 supersedes=("adapter", "old", "edited")))
    payload = bytearray(edited.safetensors.read_bytes())
    payload[-1] ^= 1     # same size, other bytes: not the file quantkit wrote
    edited.safetensors.write_bytes(bytes(payload))
    out = run("swapset", "gc", d, "--yes")
    assert out.exit_code == 0, out.output
    assert (d / "adapter.safetensors").read_bytes() == adapter
    assert "kept adapter" in out.output and "not made by quantkit" in out.output
    assert edited.safetensors.exists() and "kept edited" in out.output
    assert not old.safetensors.exists() and not old.manifest_path.exists() and "removed old" in out.output


def test_a_supersede_cycle_never_makes_every_sidecar_obsolete(model):
    """Remaking A with --supersedes B after B superseded A (a roll-back): the newest wins, A in service, B obsolete;
    a cycle already on disk (written before, or by hand) makes no member obsolete, so gc removes none."""
    d = model()
    build_swapset(SwapsetRequest(d, families=("inproj",), fmt="fp8-tensor", name="A"))
    b = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="nvfp4", convention="modelopt", name="B",
                                     supersedes=("A",)))
    out = run("swapset", d, "--family", "inproj", "--format", "fp8-channel", "--name", "A", "--force",
              "--supersedes", "B")
    assert out.exit_code == 0 and "B.json no longer supersedes A" in out.output, out.output
    assert {s.name: s.state for s in status(d).sidecars} == {"A": "required", "B": "obsolete"}
    assert read_manifest(b.manifest_path)["supersedes"] == [] and validate_sidecar(b.manifest_path).ok
    assert "would remove B" in run("swapset", "gc", d, "--dry-run").output

    for edges, cycle in (({"A": ["B"], "B": ["A"]}, {"A", "B"}), ({"A": ["A"], "B": []}, {"A"})):
        for name, supersedes in edges.items():
            path = d / f"{name}.json"
            path.write_text(json.dumps({**read_manifest(path), "supersedes": supersedes}))
        report = status(d).sidecars
        assert {s.name: s.state for s in report if s.name in cycle} == dict.fromkeys(cycle, "unknown")
        assert all("supersede cycle" in s.reason for s in report if s.name in cycle)
        before = files(d)
        assert gc(d, dry_run=False).removed == [] and files(d) == before


def test_record_quality(model):
    d = model()
    result = build_swapset(SwapsetRequest(d, families=("dense",), fmt="fp8-block128"))
    quality = {"delta_nll": 0.012, "interval": [0.004, 0.02], "wins": "54/100"}
    assert record_quality(d, result.plan.name, quality)["quality"] == quality
    assert read_manifest(result.manifest_path)["quality"] == quality and validate_sidecar(result.manifest_path).ok


# ---------------------------------------------------------------------------------------------------------------
# apply and validate

def test_apply_sidecars_gives_the_payload_and_what_it_replaces(model):
    d = model(encoding="nvfp4-modelopt")
    inproj = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="fp8-block128"))
    dense = build_swapset(SwapsetRequest(d, families=("dense",), fmt="fp8-channel"))
    out = apply_sidecars(d, [inproj.plan.name, dense.plan.name])
    assert len(out) == 6
    q = out[f"{L0}.self_attn.q_proj.weight"]
    assert q.sidecar == inproj.plan.name and q.encoding == "fp8-block128"
    companions = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    assert set(q.removes) == {f"{L0}.self_attn.q_proj.{s}" for s in companions}
    payload = SafetensorsFile(inproj.safetensors)
    for name, array in q.tensors.items():
        np.testing.assert_array_equal(array.view(np.uint8), payload.array(name).view(np.uint8))
    assert q.dtypes[f"{L0}.self_attn.q_proj.weight"] == "F8_E4M3"

    newer = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="nvfp4", name="newer",
                                         supersedes=(inproj.plan.name,)))
    with pytest.raises(SourceError, match="both cover"):
        apply_sidecars(d, [inproj.plan.name, newer.plan.name])
    assert set(apply_sidecars(d, ["newer"])) == {f"{L0}.self_attn.{p}_proj.weight" for p in "qkv"}

    payload_path = newer.safetensors
    data = bytearray(payload_path.read_bytes())
    data[-1] ^= 0x01
    payload_path.write_bytes(bytes(data))
    with pytest.raises(ValidationError, match="SHA-256"):
        apply_sidecars(d, ["newer"])
    assert not validate_sidecar(payload_path).ok

    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "edited": True}))
    with pytest.raises(ValidationError, match="config_sha256"):
        apply_sidecars(d, [dense.plan.name])


def _restamp(result):
    """Make the manifest's payload hash and size agree with edited payload bytes (a consistent but bad sidecar)."""
    m = read_manifest(result.manifest_path)
    m["sidecar"].update(bytes=result.safetensors.stat().st_size, sha256=sha256_file(result.safetensors))
    result.manifest_path.write_text(json.dumps(m))


def test_validate_finds_bad_scales_convention_mismatch_and_changed_sources(model):
    d = model()
    result = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="nvfp4", convention="modelopt"))
    good = result.safetensors.read_bytes()
    f = SafetensorsFile(result.safetensors)
    entry = f.entries[f"{L0}.self_attn.q_proj.weight_scale"]
    f.close()
    bad = bytearray(good)
    bad[entry.begin] = 0x7F                                    # an E4M3 NaN block scale
    result.safetensors.write_bytes(bytes(bad))
    _restamp(result)
    report = validate_sidecar(result.manifest_path)
    assert not report.ok and any(p.startswith("scales:") for p in report.problems)

    result.safetensors.write_bytes(good)
    _restamp(result)
    m = read_manifest(result.manifest_path)
    m.update(encoding="nvfp4-compressed-tensors", convention="compressed-tensors")
    result.manifest_path.write_text(json.dumps(m))
    report = validate_sidecar(result.manifest_path)
    assert any("convention mismatch" in p for p in report.problems)

    build = json.loads(result.manifest_path.read_text())
    build.update(encoding="nvfp4-modelopt", convention="modelopt")
    result.manifest_path.write_text(json.dumps(build))
    assert validate_sidecar(result.manifest_path).ok
    rewrite(d, lambda t: {**t, f"{L0}.self_attn.k_proj.weight": t[f"{L0}.self_attn.k_proj.weight"][::-1].copy()})
    report = validate_sidecar(result.manifest_path)
    assert any(p.startswith("provenance:") and "changed" in p for p in report.problems)
    assert any(p.startswith("error:") for p in report.problems)


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written

def assert_refused(d, args, match):
    before = files(d)
    out = run("swapset", d, *args)
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], out.output
    assert files(d) == before


def test_bad_input_is_refused_with_one_line(model, tmp_path):
    d = model()
    assert_refused(d, ["--family", "nope", "--format", "nvfp4", "--convention", "modelopt"], "unknown family 'nope'")
    assert_refused(d, ["--family", "inproj", "--format", "nvfp4"], "--convention")
    assert_refused(d, ["--family", "inproj", "--format", "fp8-tensor", "--convention", "modelopt"], "nvfp4 only")
    assert_refused(d, ["--family", "mtp", "--format", "nvfp4", "--convention", "modelopt"], "selects no tensors")
    assert_refused(d, ["--draft-lm-head", "--vocab-subset", "64", "--convention", "modelopt"], "--calibration")
    assert_refused(d, ["--family", "inproj", "--format", "nvfp4", "--convention", "modelopt", "--name", "model"],
                   "sidecar name")
    assert_refused(d, ["--family", "inproj", "--format", "fp8-tensor", "--supersedes", "ghost"], "ghost")

    assert run("swapset", d, "--family", "inproj", "--format", "fp8-tensor").exit_code == 0
    assert_refused(d, ["--family", "inproj", "--format", "nvfp4", "--convention", "modelopt"], "already covers")
    assert_refused(d, ["--family", "inproj", "--format", "fp8-tensor"], "output exists")


def test_negative_or_non_integer_sizes_and_counts_are_refused(model):
    """Sizes and counts are non-negative integers; anything else is refused naming the field, and status shows
    such a sidecar as unknown with that reason."""
    d = model()
    result = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="fp8-tensor", name="A"))
    shard = next(iter(result.manifest["checkpoint"]["shards"]))
    blocks = {"calibration": {"text_sha256": "0" * 64, "tokens": 3, "calibrated": [], "uncalibrated": []},
              "draft_lm_head": {"source_rows": 256, "kept_rows": 128, "selection": "top 128", "token_ids": None,
                                "agreement": {"positions": 4, "top1": 0.5, "top5": 1, "coverage": None}},
              "shared_as_expert": {"expert_index": 8}}
    good = json.loads(json.dumps({**result.manifest, **blocks}))
    validate_manifest(good, result.manifest_path)
    fields = [("sidecar", "bytes"), ("checkpoint", "shards", shard, "bytes"), ("source", "shards", shard, "bytes"),
              ("calibration", "tokens"), ("draft_lm_head", "source_rows"), ("draft_lm_head", "kept_rows"),
              ("draft_lm_head", "agreement", "positions"), ("shared_as_expert", "expert_index")]
    for field in fields:
        for bad in (-5, True, 5.0, "5"):
            manifest = json.loads(json.dumps(good))
            parent = manifest
            for key in field[:-1]:
                parent = parent[key]
            parent[field[-1]] = bad
            with pytest.raises(FormatError, match=re.escape(f"{'.'.join(field)} has an invalid value")) as e:
                validate_manifest(manifest, result.manifest_path)
            assert e.value.field == ".".join(field)

    result.manifest_path.write_text(json.dumps({**result.manifest, "sidecar": {**result.manifest["sidecar"],
                                                                               "bytes": -5}}))
    (entry,) = status(d).sidecars
    assert entry.state == "unknown" and "sidecar.bytes" in entry.reason
    out = run("validate", result.safetensors)
    assert out.exit_code == 2 and "sidecar.bytes" in out.output and len(out.output.strip().splitlines()) == 1


def test_deeply_nested_json_is_a_format_error_naming_the_file(model, tmp_path):
    """json's parser recurses per nesting level: a deep file is unusable input (exit 2), not an internal error."""
    d = model()
    result = build_swapset(SwapsetRequest(d, families=("inproj",), fmt="fp8-tensor", name="A"))
    deep = "[" * 100_000 + "]" * 100_000
    record = tmp_path / "record.json"
    record.write_text(deep)
    out = run("swapset", "status", d, "--record", record)
    lines = out.output.strip().splitlines()
    assert out.exit_code == 2 and len(lines) == 1 and "record.json" in lines[0] and "internal" not in lines[0], \
        out.output
    result.manifest_path.write_text(f'{{"schema": "quantkit.swapset", "x": {deep}}}')
    with pytest.raises(FormatError, match="nested too deeply") as e:
        read_manifest(result.manifest_path)
    assert e.value.path == str(result.manifest_path)
    out = run("swapset", "status", d)
    assert out.exit_code == 0 and out.output.startswith("unknown   A"), out.output


def test_missing_source_tensor_and_convention_mismatch(model):
    d, source = model(), model(encoding="fp8-block", name="fp8")
    rewrite(source, lambda t: {n: a for n, a in t.items() if ".1.self_attn.q_a_proj." not in n})
    assert_refused(d, ["--family", "mla", "--format", "fp8-block128", "--source", source], "q_a_proj")

    ct = model(encoding="nvfp4-compressed-tensors", name="ct")
    assert_refused(ct, ["--family", "inproj", "--format", "nvfp4", "--convention", "modelopt"],
                   "convention mismatch")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (ct / "config.json").write_text(json.dumps(config))
    assert_refused(ct, ["--family", "inproj", "--format", "nvfp4"], "nvfp4-compressed-tensors")


def test_nan_weights_stop_the_build_and_leave_nothing(model):
    d = model()

    def poison(t):
        w = t[f"{L0}.self_attn.v_proj.weight"].astype(np.float32)
        w[5, 7] = np.nan
        return {**t, f"{L0}.self_attn.v_proj.weight": w.astype(t[f"{L0}.self_attn.v_proj.weight"].dtype)}
    rewrite(d, poison)
    # the dense groups are written before the q/k/v group fails: the error comes mid-file
    assert_refused(d, ["--family", "dense,inproj", "--format", "fp8-tensor"], "v_proj.weight")
    assert not any(name.endswith(".partial") for name in files(d))


# ---------------------------------------------------------------------------------------------------------------
# building blocks

def test_planned_writer_matches_write_safetensors_in_any_order(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"b.weight": rng.integers(0, 255, (4, 6), dtype=np.uint8), "a.scale": rng.random((3,), np.float32),
               "c.ids": np.arange(5, dtype=np.int32), "d.fp8": rng.integers(0, 126, (2, 2), dtype=np.uint8)}
    dtypes = {"b.weight": "U8", "a.scale": "F32", "c.ids": "I32", "d.fp8": "F8_E4M3"}
    write_safetensors(tmp_path / "ref.safetensors", tensors, {"k": "v"}, dtypes=dtypes)
    with open(tmp_path / "planned.safetensors", "wb") as f:
        writer = PlannedSafetensors(f, {n: Planned(dtypes[n], a.shape) for n, a in tensors.items()}, {"k": "v"})
        for name in ("d.fp8", "a.scale", "c.ids", "b.weight"):
            writer.write(name, tensors[name])
        writer.finish()
    assert (tmp_path / "planned.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with open(tmp_path / "short.safetensors", "wb") as f:
        writer = PlannedSafetensors(f, {n: Planned(dtypes[n], a.shape) for n, a in tensors.items()})
        writer.write("a.scale", tensors["a.scale"])
        with pytest.raises(StateError, match="written twice"):
            writer.write("a.scale", tensors["a.scale"])
        with pytest.raises(FormatError, match="planned shape"):
            writer.write("c.ids", np.arange(4, dtype=np.int32))
        with pytest.raises(StateError, match="not written"):
            writer.finish()


@pytest.mark.parametrize("fmt,convention", [("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"),
                                            ("fp8-tensor", None), ("fp8-channel", None), ("fp8-block128", None),
                                            ("fp8-block128-e8m0", None)])
def test_fused_expert_weights_encode_per_expert(fmt, convention):
    enc = get_encoding(fmt, convention)
    w = np.random.default_rng(2).standard_normal((3, 130, 64)).astype(np.float32)
    stacked = enc.encode(w)
    specs = enc.output_specs(w.shape)
    assert {k: (a.shape, d) for k, (a, d) in stacked.items()} == {k: (tuple(s), d) for k, (s, d) in specs.items()}
    for e in range(3):
        for suffix, (array, _) in enc.encode(w[e]).items():
            np.testing.assert_array_equal(stacked[suffix][0][e].reshape(array.shape), array)
    decoded = enc.decode({k: a for k, (a, _) in stacked.items()})
    np.testing.assert_array_equal(decoded[1], enc.decode({k: a for k, (a, _) in enc.encode(w[1]).items()}))


def test_a_sidecar_never_replaces_a_shard_it_is_made_from(model):
    """A sidecar named like a shard of a sharded checkpoint is refused before any work, even with --force."""
    d = model()
    shard = d / "weights-a.safetensors"
    (d / "model.safetensors").rename(shard)
    names = SafetensorsFile(shard)
    weight_map = {n: shard.name for n in names.names()}
    names.close()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    before = sha256_file(shard)
    out = run("swapset", d, "--family", "inproj", "--format", "fp8-tensor", "--name", "weights-a", "--force")
    lines = out.output.strip().splitlines()
    assert out.exit_code == 2 and len(lines) == 1, out.output
    assert "weights-a.safetensors" in lines[0]
    assert sha256_file(shard) == before and not (d / "weights-a.json").exists()
