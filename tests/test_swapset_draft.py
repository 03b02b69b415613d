"""Draft lm-head sidecars and calibration on the tiny GLM-5 model (transformers forward passes on the CPU).

Shown: the reference model's head inputs are what the head multiplies (its logits equal transformers'); the kept
vocabulary is the frequency ranking of the calibration text rounded up to 128 rows; a BF16 head is quantized with
the full head's global amax; an NVFP4 head is sliced natively, so its logits on the kept ids are the source's
bit for bit (top-1 agreement equals coverage); activation scales come from the measured input amax.
"""
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer

from quantkit.cli import main
from quantkit.io.checkpoint import open_checkpoint
from quantkit.io.safetensors import SafetensorsFile, write_safetensors
from quantkit.swapset import SwapsetRequest, build_swapset, validate_sidecar
from quantkit.swapset.calibrate import ReferenceModel, tokenize
from quantkit.swapset.draft import agreement, kept_rows
from quantkit.swapset.encodings import get_encoding
from quantkit.testing.tiny_models import TinyCheckpointCache

TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly hex the jovial boxer. "
        "Numbers 0123456789 and punctuation, too; repeated text repeats tokens. ") * 3
SAMPLE = "A different sample: drafting heads propose tokens that the target model verifies in one pass. " * 2


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    return TinyCheckpointCache(tmp_path_factory.getbasetemp() / "swapset-tiny").get("glm5_next", encoding="bf16")


@pytest.fixture
def texts(tmp_path):
    (tmp_path / "calibration.txt").write_text(TEXT)
    (tmp_path / "sample.txt").write_text(SAMPLE)
    return tmp_path / "calibration.txt", tmp_path / "sample.txt"


def test_reference_model_head_inputs_are_what_the_head_multiplies(glm5):
    ids = tokenize(glm5, SAMPLE)
    with open_checkpoint(glm5) as ckpt, ReferenceModel(ckpt) as ref:
        amax, hidden = ref.measure(ids, ["lm_head.weight"], head=True)
        with torch.no_grad():
            logits = ref.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
        head = ckpt.tensor_f32("lm_head.weight")
    assert hidden.shape == (len(ids), head.shape[1])
    np.testing.assert_allclose(hidden @ head.T, logits, rtol=1e-4, atol=1e-4)
    assert amax == {"lm_head.weight": float(np.abs(hidden).max())}


def test_kept_rows_rules():
    counts = np.array([5, 0, 9, 9, 1] + [0] * 295)
    kept, _ = kept_rows(300, subset=3, counts=counts)
    assert len(kept) == 128 and kept.dtype == np.int32 and list(kept[:5]) == [0, 1, 2, 3, 4]
    assert (np.diff(kept) > 0).all()
    kept, _ = kept_rows(300, subset=129, counts=counts)
    assert len(kept) == 256
    kept, _ = kept_rows(200, subset=190, counts=counts[:200])
    assert len(kept) == 200                                      # capped at the head's rows
    kept, _ = kept_rows(300, token_ids=[299, 7], counts=None)    # padded by id ascending
    assert len(kept) == 128 and {7, 299} <= set(kept.tolist()) and set(range(126)) <= set(kept.tolist())
    kept, selection = kept_rows(300)
    assert len(kept) == 300 and selection == "full vocabulary"


def test_agreement_counts():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((40, 8)).astype(np.float32)
    head = rng.standard_normal((16, 8)).astype(np.float32)
    full = agreement(hidden, head, head, np.arange(16))
    assert full == {"positions": 40, "top1": 1.0, "top5": 1.0, "coverage": 1.0}
    kept = np.arange(8)
    part = agreement(hidden, head, head[kept], kept)
    best = np.argmax(hidden @ head.T, axis=1)
    assert part["top1"] == part["coverage"] == np.isin(best, kept).mean()


def test_draft_head_from_a_bf16_head(tmp_path, glm5, texts):
    d = shutil.copytree(glm5, tmp_path / "model")
    calibration, sample = texts
    out = CliRunner().invoke(main, ["swapset", str(d), "--draft-lm-head", "--vocab-subset", "100",
                                    "--calibration", str(calibration), "--sample", str(sample),
                                    "--convention", "modelopt"])
    assert out.exit_code == 0, out.output
    assert "top-1" in out.output and "128 of 512 rows" in out.output
    manifest = json.loads((d / "nvfp4-swapset-draft-lmhead.json").read_text())
    info = manifest["draft_lm_head"]
    assert manifest["kind"] == "draft-lm-head" and manifest["modules"][0]["replaces"] == {}

    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    counts = np.bincount(ids, minlength=512)
    expected = np.sort(np.lexsort((np.arange(512), -counts))[:128])
    payload = SafetensorsFile(d / "nvfp4-swapset-draft-lmhead.safetensors")
    kept = payload.array("draft.lm_head.token_ids")
    np.testing.assert_array_equal(kept, expected)
    assert info["kept_rows"] == 128 and info["source_rows"] == 512

    with open_checkpoint(d) as ckpt:
        head = ckpt.tensor_f32("lm_head.weight")
        with ReferenceModel(ckpt) as ref:
            amax, _ = ref.measure(ids, ["lm_head.weight"])
            hidden = ref.measure(tokenize(d, SAMPLE), head=True)[1]
    enc = get_encoding("nvfp4", "modelopt")
    for suffix, (array, _) in enc.encode(head[kept], float(np.abs(head).max())).items():
        np.testing.assert_array_equal(payload.array(f"draft.lm_head.{suffix}").view(array.dtype), array)
    np.testing.assert_array_equal(payload.array("draft.lm_head.input_scale"), enc.input_scale(amax["lm_head.weight"]))
    draft_head = enc.decode({s: payload.array(f"draft.lm_head.{s}") for s in enc.weight_suffixes})
    assert info["agreement"] == agreement(hidden, head, draft_head, kept)
    a = info["agreement"]
    assert a["positions"] == len(tokenize(d, SAMPLE)) and 0 <= a["top1"] <= a["top5"] <= a["coverage"] <= 1
    assert validate_sidecar(d / "nvfp4-swapset-draft-lmhead.json").ok


def nvfp4_head_checkpoint(glm5, d):
    """The tiny model with its lm_head stored as ModelOpt NVFP4 (as an NVFP4 release might ship it)."""
    shutil.copytree(glm5, d)
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: np.array(f.array(n)) for n in f.names()}
    dtypes = {n: e.dtype for n, e in f.entries.items()}
    f.close()
    parts = get_encoding("nvfp4", "modelopt").encode(tensors.pop("lm_head.weight").astype(np.float32))
    for suffix, (array, dtype) in parts.items():
        tensors[f"lm_head.{suffix}"] = array
        dtypes[f"lm_head.{suffix}"] = dtype
    write_safetensors(d / "model.safetensors", tensors, {"format": "pt"},
                      dtypes={n: dtypes[n] for n in tensors}, overwrite=True)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_draft_head_sliced_natively_from_an_nvfp4_head(tmp_path, glm5, texts):
    d = nvfp4_head_checkpoint(glm5, tmp_path / "model")
    (tmp_path / "ids.txt").write_text("3 500\n17 42\n")
    result = build_swapset(SwapsetRequest(d, draft_lm_head=True, token_ids_file=tmp_path / "ids.txt",
                                          sample=texts[1]))
    assert result.manifest["modules"][0]["origin"] == "native"
    payload = SafetensorsFile(result.safetensors)
    kept = payload.array("draft.lm_head.token_ids")
    assert len(kept) == 128 and {3, 17, 42, 500} <= set(kept.tolist())
    with open_checkpoint(d) as ckpt:
        for suffix in ("weight", "weight_scale"):
            np.testing.assert_array_equal(payload.array(f"draft.lm_head.{suffix}").view(np.uint8),
                                          ckpt.raw(f"lm_head.{suffix}").view(np.uint8)[kept])
        np.testing.assert_array_equal(payload.array("draft.lm_head.weight_scale_2"), ckpt.raw("lm_head.weight_scale_2"))
    a = result.manifest["draft_lm_head"]["agreement"]
    assert a["top1"] == a["coverage"] and a["top5"] == a["coverage"]   # same logits on every kept id
    assert validate_sidecar(result.manifest_path).ok


def test_fp8_draft_head_over_the_whole_vocabulary(tmp_path, glm5):
    d = shutil.copytree(glm5, tmp_path / "model")
    result = build_swapset(SwapsetRequest(d, draft_lm_head=True, fmt="fp8-channel"))
    info = result.manifest["draft_lm_head"]
    assert info["kept_rows"] == 512 and info["selection"] == "full vocabulary" and info["agreement"] is None
    assert result.plan.name == "fp8-swapset-draft-lmhead-channel"
    assert not any(t["role"] == "token_ids" for t in result.manifest["tensors"])
    assert validate_sidecar(result.manifest_path).ok
