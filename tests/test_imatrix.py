"""Importance matrices: both file formats (round trips; files written by llama.cpp's llama-imatrix read back with
the numbers gguf-py reads; our merge equals llama-imatrix's own merge), coverage, the name and shape rules, the
bootstrap fallback and its record, the provenance guard, malformed inputs, and the ``quantkit imatrix`` CLI."""
from __future__ import annotations

import json
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf.constants import GGUFValueType

from quantkit.cli import main
from quantkit.errors import FormatError, OutputExistsError, TruncatedFileError, ValidationError
from quantkit.imatrix import (Entry, bootstrap_importance, load_imatrix, make_imatrix, merge_imatrices,
                              require_release_imatrix, save_imatrix)
from quantkit.imatrix.bootstrap import expert_ranges
from quantkit.imatrix.formats import write_gguf_imatrix
from quantkit.imatrix.names import expected_entries, to_gguf_names
from quantkit.arch import get_arch
from quantkit.examples import example_model_dir
from quantkit.io.atomic import output_lock
from quantkit.io.gguf_writer import GGUFWriter, TensorSpec, plan_layout

DATA = Path(__file__).parent / "data" / "imatrix"
REF_ARCHS = ("qwen3_moe", "deepseek_v3")
MANIFEST = json.loads((DATA / "manifest.json").read_text())


def sample(seed: int = 0, *, synthetic: bool = False, in_sum: bool = False, experts: int = 4, n: int = 64):
    """A small imatrix: one dense tensor, one stacked expert tensor with an unobserved expert."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 50, experts).astype(np.float32)
    counts[-1] = 0
    sums = (rng.random((experts, n)) * counts[:, None]).astype(np.float32)
    sums[-1] = 0
    dense = (rng.random((1, 128)) * 100).astype(np.float32)
    entries = {
        "blk.0.attn_q.weight": Entry(dense, np.array([100], np.float32),
                                     rng.standard_normal((1, 128)).astype(np.float32) if in_sum else None),
        "blk.0.ffn_up_exps.weight": Entry(sums, counts,
                                          rng.standard_normal((experts, n)).astype(np.float32) if in_sum else None),
    }
    return make_imatrix(entries, datasets=[f"text-{seed}.txt"], chunk_count=3, chunk_size=40, synthetic=synthetic)


def same_entries(a, b) -> None:
    assert sorted(a.entries) == sorted(b.entries)
    for name in a.entries:
        ea, eb = a.entries[name], b.entries[name]
        assert np.array_equal(ea.in_sum2, eb.in_sum2) and np.array_equal(ea.counts, eb.counts), name
        assert (ea.in_sum is None) == (eb.in_sum is None)
        if ea.in_sum is not None:
            assert np.array_equal(ea.in_sum, eb.in_sum)


# -- GGUF imatrix ---------------------------------------------------------------------------------------------------

def test_gguf_round_trip(tmp_path):
    imx = sample(in_sum=True, synthetic=True)
    save_imatrix(imx, tmp_path / "a.gguf")
    back = load_imatrix(tmp_path / "a.gguf")
    same_entries(imx, back)
    assert (back.datasets, back.chunk_count, back.chunk_size, back.synthetic) == (["text-0.txt"], 3, 40, True)
    assert back.path == tmp_path / "a.gguf" and len(back.sha256) == 64
    assert back.provenance["quantkit_version"]


def test_gguf_layout_is_llama_imatrix_layout(tmp_path):
    """gguf-py (the reference reader) sees llama-imatrix's keys, types, tensor names and ggml dims."""
    imx = sample()
    save_imatrix(imx, tmp_path / "a.gguf")
    r = gguf.GGUFReader(tmp_path / "a.gguf")
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.datasets"].contents() == ["text-0.txt"]
    assert r.fields["imatrix.chunk_count"].types == [GGUFValueType.UINT32]
    assert r.fields["imatrix.chunk_size"].contents() == 40
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts",
                             "blk.0.ffn_up_exps.weight.in_sum2", "blk.0.ffn_up_exps.weight.counts"]
    assert tensors["blk.0.ffn_up_exps.weight.in_sum2"].shape.tolist() == [64, 4]   # ggml [n, n_mat]
    assert tensors["blk.0.ffn_up_exps.weight.counts"].shape.tolist() == [1, 4]
    e = imx.entries["blk.0.ffn_up_exps.weight"]
    assert np.array_equal(np.asarray(tensors["blk.0.ffn_up_exps.weight.in_sum2"].data), e.in_sum2)


def test_gguf_bytes_do_not_depend_on_entry_order(tmp_path):
    imx = sample()
    reordered = make_imatrix(dict(reversed(list(imx.entries.items()))), datasets=imx.datasets, chunk_count=3,
                             chunk_size=40)
    save_imatrix(imx, tmp_path / "a.gguf")
    save_imatrix(reordered, tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_save_refuses_to_replace_and_leaves_nothing_on_failure(tmp_path):
    save_imatrix(sample(), tmp_path / "a.gguf")
    with pytest.raises(OutputExistsError):
        save_imatrix(sample(1), tmp_path / "a.gguf")
    broken = sample()
    broken.chunk_size = 0  # a .dat needs a chunk size
    with pytest.raises(FormatError, match="chunk size"):
        save_imatrix(broken, tmp_path / "b.dat")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]


# -- legacy .dat ------------------------------------------------------------------------------------------------------

def test_dat_round_trip_is_byte_exact(tmp_path):
    save_imatrix(sample(), tmp_path / "a.dat")
    first = load_imatrix(tmp_path / "a.dat")
    save_imatrix(first, tmp_path / "b.dat")
    assert (tmp_path / "a.dat").read_bytes() == (tmp_path / "b.dat").read_bytes()
    assert first.counts_unit == "chunks" and first.datasets == ["text-0.txt"] and first.chunk_count == 3


def test_gguf_to_dat_keeps_importance(tmp_path):
    imx = sample()
    save_imatrix(imx, tmp_path / "a.dat")
    back = load_imatrix(tmp_path / "a.dat").conform({"blk.0.attn_q.weight": (128, 1),
                                                    "blk.0.ffn_up_exps.weight": (64, 4)})
    for name, mats in (("blk.0.attn_q.weight", [None]), ("blk.0.ffn_up_exps.weight", [0, 1, 2])):
        for m in mats:
            want, got = imx.importance(name, m), back.importance(name, m)
            assert np.allclose(got, want, rtol=3e-7, atol=0), (name, m)
    assert back.importance("blk.0.ffn_up_exps.weight", 3) is None   # llama's "1.0" placeholder read as unobserved
    assert str(back.coverage()) == str(imx.coverage()) == "observed 3 of 4 experts (75.00%)"


def test_dat_layout(tmp_path):
    """The bytes are the legacy layout written out by hand (values (Σx²/count)·ncall, ncall = ceil(max/chunk))."""
    e = Entry(np.array([[2.0, 4.0], [0.0, 0.0]], np.float32), np.array([80, 0], np.float32))
    save_imatrix(make_imatrix({"w": e}, datasets=["d"], chunk_count=7, chunk_size=64), tmp_path / "x.dat")
    ncall = 2  # ceil(80 / 64)
    want = (struct.pack("<ii", 1, 1) + b"w" + struct.pack("<ii", ncall, 4)
            + np.array([2 / 80 * 2, 4 / 80 * 2, 2, 2], np.float32).tobytes() + struct.pack("<ii", 7, 1) + b"d")
    assert (tmp_path / "x.dat").read_bytes() == want


# -- llama-imatrix's own files ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", REF_ARCHS)
def test_llama_imatrix_gguf_reads_the_same_numbers(arch):
    path = DATA / f"{arch}-a.imatrix.gguf"
    imx = load_imatrix(path)
    assert not imx.synthetic and imx.datasets == ["calibration-a.txt"]
    assert imx.chunk_size == MANIFEST["ctx"] and imx.chunk_count == MANIFEST["chunks"]["a"]
    ref = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    assert len(ref) == 2 * len(imx.entries)
    for name, e in imx.entries.items():
        assert np.array_equal(e.in_sum2.reshape(-1), ref[name + ".in_sum2"].reshape(-1))
        assert np.array_equal(e.counts, ref[name + ".counts"].reshape(-1))
    tokens = MANIFEST["chunks"]["a"] * MANIFEST["ctx"]
    assert imx.entries["blk.0.attn_q_a.weight" if arch == "deepseek_v3" else "blk.0.attn_q.weight"].counts[0] == tokens


@pytest.mark.parametrize("arch", REF_ARCHS)
def test_llama_imatrix_dat_matches_its_gguf(arch):
    """llama-imatrix's own .dat of the same statistics: every importance equal (to float rounding)."""
    g = load_imatrix(DATA / f"{arch}-a.imatrix.gguf")
    d = load_imatrix(DATA / f"{arch}-a.imatrix.dat")
    assert sorted(d.entries) == sorted(n for n, e in g.entries.items() if e.observed.any())
    shapes = {n: (e.n_per_row, e.n_mat) for n, e in g.entries.items()}
    d = d.conform({n: shapes[n] for n in d.entries})
    for name, e in d.entries.items():
        for m in range(e.n_mat):
            want, got = g.importance(name, m if e.n_mat > 1 else None), d.importance(name, m if e.n_mat > 1 else None)
            assert (want is None) == (got is None), (name, m)
            if want is not None:
                assert np.allclose(got, want, rtol=5e-7, atol=0), (name, m)


@pytest.mark.parametrize("arch", REF_ARCHS)
def test_merge_equals_llama_imatrix_merge(arch):
    a, b = load_imatrix(DATA / f"{arch}-a.imatrix.gguf"), load_imatrix(DATA / f"{arch}-b.imatrix.gguf")
    ref = load_imatrix(DATA / f"{arch}-ab.imatrix.gguf")
    merged = merge_imatrices([a, b])
    same_entries(merged, ref)
    assert merged.datasets == ref.datasets and merged.chunk_count == ref.chunk_count


def test_merge_weights_by_counts_and_checks_shapes():
    a, b = sample(0), sample(1)
    m = merge_imatrices([a, b])
    name = "blk.0.ffn_up_exps.weight"
    ea, eb = a.entries[name], b.entries[name]
    want = (ea.in_sum2[1] + eb.in_sum2[1]) / (ea.counts[1] + eb.counts[1])
    assert np.array_equal(m.importance(name, 1), want)
    assert m.chunk_count == 6 and m.datasets == ["text-0.txt", "text-1.txt"] and not m.synthetic
    assert merge_imatrices([a, sample(2, synthetic=True)]).synthetic
    with pytest.raises(FormatError, match="mismatched expert counts"):
        merge_imatrices([a, sample(1, experts=2, n=128)])
    with pytest.raises(FormatError, match="sums do not match"):
        merge_imatrices([a, sample(1, n=32)])


def test_merge_legacy_with_gguf_scales_by_chunk_size(tmp_path):
    a = sample(0)
    save_imatrix(a, tmp_path / "a.dat")
    legacy = load_imatrix(tmp_path / "a.dat")
    merged = merge_imatrices([legacy, sample(1)])
    assert merged.counts_unit == "tokens"
    assert merged.entries["blk.0.attn_q.weight"].counts[0] == 100 + 3 * 40  # ncall 3 chunks of 40 tokens


def with_source(imx, model_type: str, digest: str | None = None, path: str = "ck"):
    source = {"source": path, "source_model_type": model_type, **({"source_digest": digest} if digest else {})}
    return replace(imx, provenance={**imx.provenance, **source})


def test_merge_refuses_imatrices_of_different_models_and_keeps_the_common_source(tmp_path):
    a, b = with_source(sample(0), "qwen3_moe", "1" * 64), with_source(sample(1), "qwen3_moe", "1" * 64, "elsewhere")
    merged = merge_imatrices([a, b, sample(2)])      # sample(2): no provenance (a legacy file): not checked
    assert merged.provenance["source_model_type"] == "qwen3_moe" and merged.provenance["source_digest"] == "1" * 64
    assert "source" not in merged.provenance      # the checkpoint's path differs: not common
    older = with_source(sample(1), "qwen3_moe")   # an older quantkit's file: no digest
    assert "source_digest" not in merge_imatrices([a, older]).provenance
    with pytest.raises(ValidationError, match="imatrices of different models.*qwen3_moe.*deepseek_v3"):
        merge_imatrices([a, with_source(sample(1), "deepseek_v3", "1" * 64)])
    with pytest.raises(ValidationError, match="imatrices of different models.*source digest 1111.*source digest 2222"):
        merge_imatrices([a, with_source(sample(1), "qwen3_moe", "2" * 64)])

    runner = CliRunner()
    paths = {}
    for name, imx in (("q.gguf", a), ("d.gguf", with_source(sample(1), "deepseek_v3")), ("old.gguf", older)):
        paths[name] = tmp_path / name
        save_imatrix(imx, paths[name])
    save_imatrix(sample(2), tmp_path / "legacy.dat")
    out = tmp_path / "m.gguf"
    result = runner.invoke(main, ["imatrix", "merge", str(paths["q.gguf"]), str(paths["d.gguf"]), "-o", str(out)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert (f"imatrices of different models: {paths['q.gguf']} comes from qwen3_moe, {paths['d.gguf']} from "
            f"deepseek_v3" in result.output) and not out.exists()
    result = runner.invoke(main, ["imatrix", "merge", str(paths["q.gguf"]), str(paths["old.gguf"]),
                                  str(tmp_path / "legacy.dat"), "--chunk-size", "40", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"note: {tmp_path / 'legacy.dat'}: no source model recorded" in result.output
    assert f"note: {paths['old.gguf']}: no source digest recorded" in result.output
    assert load_imatrix(out).provenance["source_model_type"] == "qwen3_moe"


# -- coverage, names and shapes --------------------------------------------------------------------------------------

def test_coverage_line():
    entries = {}
    rng = np.random.default_rng(0)
    unseen = set(rng.choice(60 * 256, 438, replace=False).tolist())
    for layer in range(60):
        counts = np.array([0 if layer * 256 + e in unseen else 5 for e in range(256)], np.float32)
        for kind in ("gate", "up"):
            entries[f"blk.{layer}.ffn_{kind}_exps.weight"] = Entry(np.outer(counts, np.ones(1)).astype(np.float32),
                                                                    counts)
        entries[f"blk.{layer}.attn_q.weight"] = Entry(np.ones((1, 1), np.float32), np.ones(1, np.float32))
    cov = make_imatrix(entries).coverage()
    assert str(cov) == "observed 14,922 of 15,360 experts (97.15%)"
    assert sum(t - o for o, t in cov.layers.values()) == 438 and cov.unobserved_tensors == []


def test_check_against_rules():
    imx = sample()
    expected = {"blk.0.attn_q.weight": (128, 1), "blk.0.ffn_up_exps.weight": (64, 4), "blk.0.attn_k.weight": (128, 1)}
    imx.check_against(expected, required=["blk.0.attn_q.weight"])        # attn_k not required: may be missing
    with pytest.raises(ValidationError, match="'blk.0.attn_k.weight'.*needs importance"):
        imx.check_against(expected)
    with pytest.raises(ValidationError, match="'blk.0.ffn_up_exps.weight'.*names no tensor"):
        imx.check_against({"blk.0.attn_q.weight": (128, 1)})
    with pytest.raises(ValidationError, match="'blk.0.attn_q.weight'.*needs 1 x 256"):
        imx.check_against({**expected, "blk.0.attn_q.weight": (256, 1)}, required=())
    with pytest.raises(ValidationError, match="mismatched expert counts"):
        imx.check_against({**expected, "blk.0.ffn_up_exps.weight": (32, 8)}, required=())


def test_conform_splits_a_single_count():
    """llama-imatrix writes one count for a dense 3-D weight (MLA attn_k_b); conform gives one row per matrix."""
    flat = Entry(np.arange(8, dtype=np.float32)[None, :], np.array([2], np.float32))
    imx = make_imatrix({"blk.0.attn_k_b.weight": flat}).conform({"blk.0.attn_k_b.weight": (4, 2)})
    e = imx.entries["blk.0.attn_k_b.weight"]
    assert e.in_sum2.shape == (2, 4) and e.counts.tolist() == [2, 2]
    assert imx.importance("blk.0.attn_k_b.weight", 1).tolist() == [2, 2.5, 3, 3.5]


def test_grouped_entry_folds_from_every_stored_form(tmp_path):
    """A grouped weight's statistics stored per group (llama-imatrix's GGUF with one count, an older GGUF with a
    count per group, the legacy .dat with Σx²/count·ncall per group) fold to importance = mean of x² over every
    group's slice of every token; the same form with a length for another group count is refused."""
    rng = np.random.default_rng(5)
    n, groups, tokens = 64, 4, 96
    x = rng.standard_normal((tokens, groups, n)).astype(np.float32)
    per_group = np.square(x.astype(np.float64)).sum(axis=0)                   # [groups, n]
    pooled = np.square(x.astype(np.float64)).reshape(-1, n).mean(axis=0)      # what quantkit's collector keeps
    name = "blk.0.attn_output_a.weight"
    expected, grouped = {name: (n, 1)}, {name: groups}
    one_count = make_imatrix({name: Entry(per_group.astype(np.float32).reshape(1, groups * n),
                                          np.array([tokens], np.float32))}, chunk_size=tokens, chunk_count=1)
    save_imatrix(one_count, tmp_path / "legacy.dat")
    forms = {"one count": one_count, "legacy .dat": load_imatrix(tmp_path / "legacy.dat"),
             "count per group": make_imatrix({name: Entry(per_group.astype(np.float32),
                                                          np.full(groups, tokens, np.float32))})}
    for label, imx in forms.items():
        folded = imx.conform(expected, required=(), groups=grouped)
        e = folded.entries[name]
        assert e.in_sum2.shape == (1, n), label
        assert e.counts.tolist() == [groups * (1 if label == "legacy .dat" else tokens)], label
        # per-group sums rounded to float32, their sum rounded once more, then the quotient: a few float32 ulps
        np.testing.assert_allclose(folded.importance(name), pooled, rtol=4 * 2**-24, atol=0, err_msg=label)
    with pytest.raises(ValidationError, match="another model"):
        one_count.conform({name: (n, 1)}, required=(), groups={name: groups // 2})
    with pytest.raises(ValidationError, match="another model"):
        one_count.conform(expected, required=())


def test_gguf_input_groups_from_model_metadata():
    from quantkit.io.gguf import KV
    from quantkit.imatrix.names import gguf_input_groups

    names = ["blk.0.attn_output_a.weight", "blk.1.attn_output_a.weight", "blk.0.attn_output_b.weight"]
    arch = KV("deepseek4", GGUFValueType.STRING)
    meta = {"general.architecture": arch, "deepseek4.attention.output_group_count": KV(8, GGUFValueType.UINT32)}
    assert gguf_input_groups(meta, names) == {"blk.0.attn_output_a.weight": 8, "blk.1.attn_output_a.weight": 8}
    assert gguf_input_groups({"general.architecture": KV("llama", GGUFValueType.STRING)}, names) == {}
    for bad in ({}, {"deepseek4.attention.output_group_count": KV("8", GGUFValueType.STRING)}):
        with pytest.raises(FormatError, match="deepseek4.attention.output_group_count.*positive integer"):
            gguf_input_groups({"general.architecture": arch, **bad}, names, Path("m.gguf"))


def test_importance_values():
    imx = sample()
    e = imx.entries["blk.0.ffn_up_exps.weight"]
    assert np.array_equal(imx.importance("blk.0.ffn_up_exps.weight", 2), e.in_sum2[2] / e.counts[2])
    assert imx.importance("blk.0.ffn_up_exps.weight", 3) is None
    assert imx.importance("blk.9.attn_q.weight") is None
    with pytest.raises(ValidationError, match="outside"):
        imx.importance("blk.0.ffn_up_exps.weight", 4)


def test_hugging_face_names_through_the_arch_map():
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": 4, "hidden_size": 64}
    amap = get_arch("qwen3_moe").bind(config)
    one = lambda v, c: Entry(np.full((1, 64), v, np.float32), np.array([c], np.float32))  # noqa: E731
    hf = make_imatrix({"model.layers.0.self_attn.q_proj.weight": one(2, 1),
                       "model.layers.0.mlp.experts.1.up_proj.weight": one(6, 3),
                       "model.layers.0.mlp.experts.3.up_proj.weight": one(8, 2)})
    imx = to_gguf_names(hf, amap)
    assert sorted(imx.entries) == ["blk.0.attn_q.weight", "blk.0.ffn_up_exps.weight"]
    assert imx.entries["blk.0.ffn_up_exps.weight"].counts.tolist() == [0, 3, 0, 2]
    assert imx.importance("blk.0.ffn_up_exps.weight", 3)[0] == 4
    v3 = get_arch("deepseek_v3").bind({"model_type": "deepseek_v3", "num_hidden_layers": 1})
    kv_b = make_imatrix({"model.layers.0.self_attn.kv_b_proj.weight": one(1, 1)})
    with pytest.raises(ValidationError, match="changes the columns"):
        to_gguf_names(kv_b, v3)


def test_expected_entries_from_gguf_shapes():
    shapes = {"token_embd.weight": (512, 256), "blk.0.attn_norm.weight": (256,), "blk.0.attn_q.weight": (256, 256),
              "blk.0.ffn_up_exps.weight": (8, 256, 256), "blk.0.attn_k_b.weight": (4, 128, 64),
              "output.weight": (512, 256)}
    assert expected_entries(shapes) == {"blk.0.attn_q.weight": (256, 1), "blk.0.ffn_up_exps.weight": (256, 8),
                                        "blk.0.attn_k_b.weight": (64, 4), "output.weight": (256, 1)}


# -- bootstrap and provenance -----------------------------------------------------------------------------------------

def test_bootstrap_importance_is_weight_energy():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 7)).astype(np.float32)
    want = [sum(float(w[r, c]) ** 2 for r in range(5)) for c in range(7)]
    assert np.allclose(bootstrap_importance(w), want, rtol=1e-7)
    assert bootstrap_importance(w).dtype == np.float32


def test_expert_ranges():
    assert expert_ranges([0, 5, 6, 7, 9]) == "0,5-7,9"
    assert expert_ranges([3]) == "3" and expert_ranges([]) == ""


def test_provenance_guard(tmp_path):
    synthetic = sample(synthetic=True)
    with pytest.raises(ValidationError, match="--allow-synthetic-imatrix"):
        require_release_imatrix(synthetic)
    require_release_imatrix(synthetic, allow_synthetic=True)
    require_release_imatrix(sample())
    save_imatrix(synthetic, tmp_path / "s.dat")           # no keys in a .dat: the dataset name carries the mark
    assert load_imatrix(tmp_path / "s.dat").synthetic
    for name in ("tests/fixtures/calib.txt", "synthetic-prompts.txt"):
        marked = make_imatrix(sample().entries, datasets=[name])
        save_imatrix(marked, tmp_path / f"{len(name)}.gguf")
        assert load_imatrix(tmp_path / f"{len(name)}.gguf").synthetic
    for arch in REF_ARCHS:   # llama-imatrix's files: real dataset names, no mark
        assert not load_imatrix(DATA / f"{arch}-a.imatrix.gguf").synthetic


# -- malformed input ---------------------------------------------------------------------------------------------------

def _gguf_with(tmp_path, name: str, tensors: dict[str, np.ndarray], meta=None, qtype="F32") -> Path:
    meta = meta if meta is not None else [("general.type", "imatrix")]
    layout = plan_layout(meta, [TensorSpec(n, a.shape, qtype) for n, a in tensors.items()])
    writer = GGUFWriter(tmp_path / name, layout)
    writer.write_header()
    for n, a in tensors.items():
        writer.write_tensor(n, a)
    writer.finish()
    return tmp_path / name


def malformed_files(tmp_path) -> dict[str, tuple[Path, type, str]]:
    """name -> (file, error type, message fragment)."""
    good = tmp_path / "good.gguf"
    save_imatrix(sample(), good)
    raw = good.read_bytes()
    dat = tmp_path / "good.dat"
    save_imatrix(sample(), dat)
    draw = dat.read_bytes()
    cases: dict[str, tuple[bytes | Path, type, str]] = {
        "empty": (b"", TruncatedFileError, "empty"),
        "gguf cut in the header": (raw[:40], TruncatedFileError, "EOF"),
        "gguf cut in the payload": (raw[:-20], TruncatedFileError, "EOF"),
        "dat cut in values": (draw[:30], TruncatedFileError, "EOF"),
        "dat cut in the trailer": (draw[:-3], TruncatedFileError, "EOF"),
        "dat with trailing bytes": (draw + b"xx", FormatError, "unexpected bytes"),
        "text": (b"hello, this is not an imatrix\n", FormatError, "not a legacy imatrix"),
    }
    vec = np.ones((1, 8), np.float32)
    one = np.ones((1, 1), np.float32)
    for label, sums, counts in (("nan", np.full((1, 8), np.nan, np.float32), one),
                                ("inf", np.full((1, 8), np.inf, np.float32), one),
                                ("negative", -vec, one),
                                ("negative count", vec, -one),
                                ("zero count with sums", vec, np.zeros((1, 1), np.float32))):
        cases[label] = (_gguf_with(tmp_path, f"{label}.gguf", {"w.in_sum2": sums, "w.counts": counts}),
                        FormatError, label.split()[0] if label != "zero count with sums" else "count 0")
    zeros = {"w.in_sum2": np.zeros((1, 8), np.float32), "w.counts": np.zeros((1, 1), np.float32)}
    cases["all counts zero"] = (_gguf_with(tmp_path, "zeros.gguf", zeros), FormatError, "observed nothing")
    cases["mismatched expert counts"] = (_gguf_with(tmp_path, "mis.gguf", {"w.in_sum2": np.ones((3, 5), np.float32),
                                                                           "w.counts": np.ones((2, 1), np.float32)}),
                                         FormatError, "mismatched expert counts")
    cases["sums without counts"] = (_gguf_with(tmp_path, "nocount.gguf", {"w.in_sum2": vec}), FormatError,
                                    "no .counts")
    cases["F16 sums"] = (_gguf_with(tmp_path, "f16.gguf", {"w.in_sum2": np.ones((1, 8), np.float16),
                                                           "w.counts": np.ones((1, 1), np.float16)}, qtype="F16"),
                         FormatError, "must be F32")
    cases["a model file"] = (_gguf_with(tmp_path, "model.gguf", {"blk.0.attn_q.weight": vec},
                                        meta=[("general.type", "model")]), FormatError, "not an imatrix")
    cases["no tensors"] = (_gguf_with(tmp_path, "none.gguf", {}), FormatError, "no imatrix entries")
    out = {}
    for label, (content, kind, fragment) in cases.items():
        path = content if isinstance(content, Path) else tmp_path / (label.replace(" ", "_") + ".bin")
        if not isinstance(content, Path):
            path.write_bytes(content)
        out[label] = (path, kind, fragment)
    return out


def test_malformed_inputs_are_refused(tmp_path):
    for label, (path, kind, fragment) in malformed_files(tmp_path).items():
        with pytest.raises(kind, match=fragment) as info:
            load_imatrix(path)
        assert "\n" not in str(info.value), label


def test_cli_malformed_inputs_exit_2_and_write_nothing(tmp_path):
    runner = CliRunner()
    for label, (path, _, fragment) in malformed_files(tmp_path).items():
        out = tmp_path / "out.gguf"
        for args in (["imatrix", "convert", str(path), str(out)], ["imatrix", "info", str(path)],
                     ["imatrix", "merge", str(path), "-o", str(out)]):
            result = runner.invoke(main, args)
            assert result.exit_code == 2, (label, args, result.output)
            assert result.output.count("\n") == 1 and result.output.startswith("error:"), (label, result.output)
            assert not out.exists() and not (tmp_path / "out.gguf.partial").exists(), label


# -- CLI ----------------------------------------------------------------------------------------------------------------

def test_cli_info_merge_convert(tmp_path):
    runner = CliRunner()
    a = DATA / "deepseek_v3-a.imatrix.gguf"
    result = runner.invoke(main, ["imatrix", "info", str(a)])
    assert result.exit_code == 0, result.output
    cov = str(load_imatrix(a).coverage())
    assert f"coverage: {cov}" in result.output and "blk.1.ffn_up_exps.weight" in result.output
    report = json.loads(runner.invoke(main, ["imatrix", "info", "--json", str(a)]).output)
    assert report["coverage"]["summary"] == cov and report["synthetic"] is False

    out = tmp_path / "m.gguf"
    result = runner.invoke(main, ["imatrix", "merge", str(a), str(DATA / "deepseek_v3-b.imatrix.gguf"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    same_entries(load_imatrix(out), load_imatrix(DATA / "deepseek_v3-ab.imatrix.gguf"))
    assert runner.invoke(main, ["imatrix", "merge", str(a), "-o", str(out)]).exit_code == 2     # exists
    dat = tmp_path / "m.dat"
    result = runner.invoke(main, ["imatrix", "convert", str(out), str(dat)])
    assert result.exit_code == 0, result.output
    back = tmp_path / "back.gguf"
    assert runner.invoke(main, ["imatrix", "convert", str(dat), str(back)]).exit_code == 0
    assert load_imatrix(back).provenance["converted_from"] == load_imatrix(dat).sha256


def test_cli_info_checks_against_a_model(tmp_path):
    imx = sample()
    path = tmp_path / "i.gguf"
    save_imatrix(imx, path)
    fits = {"blk.0.attn_q.weight": np.zeros((4, 128), np.float32),
            "blk.0.ffn_up_exps.weight": np.zeros((4, 2, 64), np.float32)}
    model = _gguf_with(tmp_path, "model.gguf", fits, meta=[("general.architecture", "qwen3moe")])
    result = CliRunner().invoke(main, ["imatrix", "info", str(path), "--model", str(model)])
    assert result.exit_code == 0 and "matches" in result.output, result.output
    dat = tmp_path / "i.dat"
    save_imatrix(imx, dat)
    result = CliRunner().invoke(main, ["imatrix", "info", str(dat), "--model", str(model)])
    assert result.exit_code == 0 and "coverage: observed 3 of 4 experts (75.00%)" in result.output, result.output
    other = _gguf_with(tmp_path, "other.gguf", {**fits, "blk.0.ffn_up_exps.weight": np.zeros((8, 2, 64), np.float32)},
                       meta=[("general.architecture", "qwen3moe")])
    result = CliRunner().invoke(main, ["imatrix", "info", str(path), "--model", str(other)])
    assert result.exit_code == 2 and "blk.0.ffn_up_exps.weight" in result.output, result.output


def test_cli_info_says_what_of_the_model_an_imatrix_misses_and_whose_checkpoint_it_records(tmp_path):
    """An imatrix of a shallower model of the same widths names only tensors of the model: the tensors it
    misses are listed; one collected from another checkpoint than the model's source (both record one) is noted."""
    from quantkit.scoring.source import source_digest

    files = [("model.safetensors", "ab" * 32), ("config.json", "cd" * 32)]
    meta = [("general.architecture", "qwen3moe"), ("quantkit.source.files", [n for n, _ in files]),
            ("quantkit.source.sha256", [h for _, h in files])]
    model = _gguf_with(tmp_path, "model.gguf", {"blk.0.attn_q.weight": np.zeros((4, 128), np.float32),
                                                "blk.0.ffn_up_exps.weight": np.zeros((4, 2, 64), np.float32),
                                                "blk.1.attn_q.weight": np.zeros((4, 128), np.float32)}, meta=meta)
    for digest, other in [(source_digest(files), False), ("ef" * 32, True)]:
        path = tmp_path / f"{other}.imatrix.gguf"
        save_imatrix(with_source(sample(), "qwen3_moe", digest), path)
        result = CliRunner().invoke(main, ["imatrix", "info", str(path), "--model", str(model)])
        assert result.exit_code == 0, result.output
        assert "2 of its 3 weight tensors covered (missing: blk.1.attn_q.weight)" in result.output, result.output
        assert ("collected from another checkpoint" in result.output) == other, result.output


def test_write_gguf_imatrix_aborts_cleanly(tmp_path, monkeypatch):
    def fail(self, name, data):
        raise OSError("disk full")
    monkeypatch.setattr(GGUFWriter, "write_tensor", fail)
    with pytest.raises(OSError):
        write_gguf_imatrix(sample(), tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []


def test_write_gguf_imatrix_keeps_a_partial_it_refused(tmp_path):
    """A partial it did not create (an interrupted run's, another process's) is refused and left as it was."""
    out = tmp_path / "x.gguf"
    partial = tmp_path / "x.gguf.partial"
    partial.write_text("another writer's")
    with pytest.raises(OutputExistsError):
        write_gguf_imatrix(sample(), out)
    assert partial.read_text() == "another writer's" and not out.exists()


def test_cli_merge_and_convert_never_write_an_input(tmp_path):
    runner = CliRunner()
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    save_imatrix(sample(0), a)
    save_imatrix(sample(1), b)
    checkpoint = tmp_path / "ck"
    shutil.copytree(example_model_dir(), checkpoint)
    before = {p: p.read_bytes() for p in (a, b, checkpoint / "config.json")}
    for args, target in ((["merge", str(a), str(b)], a),
                         (["convert", str(b), "--config", str(checkpoint)], checkpoint / "config.json"),
                         (["convert", str(b)], b)):
        result = runner.invoke(main, ["imatrix", *args, "-o", str(target), "--force"])
        assert result.exit_code == 2 and result.output.count("\n") == 1, (args, result.output)
        assert "the output would overwrite an input of this command" in result.output, result.output
    assert {p: p.read_bytes() for p in before} == before


def test_cli_merge_and_convert_refuse_a_leftover_partial_and_keep_it(tmp_path):
    runner = CliRunner()
    a = tmp_path / "a.gguf"
    save_imatrix(sample(0), a)
    for command, out in ((["merge", str(a)], tmp_path / "m.gguf"), (["convert", str(a)], tmp_path / "c.gguf"),
                         (["convert", str(a)], tmp_path / "c.dat")):
        partial = out.with_name(out.name + ".partial")
        partial.write_text("junk")
        result = runner.invoke(main, ["imatrix", *command, "-o", str(out)])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert result.output.startswith(f"error: {partial}: an unfinished write of this output exists")
        assert "--force" in result.output and "GGUFWriter" not in result.output
        assert partial.read_text() == "junk" and not out.exists()
        with output_lock(out):     # another quantkit writing this output: refused even with --force
            result = runner.invoke(main, ["imatrix", *command, "-o", str(out), "--force"])
        assert result.exit_code == 2 and "another process" in result.output, result.output
        assert partial.read_text() == "junk" and not out.exists()
        result = runner.invoke(main, ["imatrix", *command, "-o", str(out), "--force"])    # --force: start over
        assert result.exit_code == 0, result.output
        assert not partial.exists() and load_imatrix(out).entries.keys() == sample(0).entries.keys()
