"""The bundled example model (``quantkit/examples``): a real trained model, and the imatrix and fixture bundled with
it belong to it.

- it loads in transformers as a BF16 Qwen3-MoE whose every matrix row is a multiple of 256, within the size
  budget, and its loss on held-out standard-library text is far below an untrained model's;
- the training manifest is honest: the corpus lists are disjoint, their SHA-256s match this Python's stdlib files
  (same CPython release only), the held-out loss it records is what the bundled weights give, and the bundled
  calibration text and prompts are what the script derives from those files;
- training is deterministic (two short runs give identical weights);
- the imatrix was collected from this model on the bundled calibration text, is not synthetic, and covers every
  matrix product and every expert; the fixture was captured from these weights (label, source digest, tokenizer,
  and transformers reproducing its greedy continuations and logprobs).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import platform
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from quantkit import examples
from quantkit.arch import get_arch
from quantkit.fixtures.directory import read_fixture
from quantkit.fixtures.tokens import TextCodec
from quantkit.imatrix import load_imatrix
from quantkit.imatrix.names import expected_entries
from quantkit.scoring.source import checkpoint_identity

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_example_model.py"
#: Bundled weights budget (the issue: <= 20 MB in BF16) and everything bundled together.
MAX_WEIGHT_BYTES = 20_000_000
MAX_BUNDLE_BYTES = 25_000_000
#: Held-out loss bound, as a fraction of ln(vocab) = 6.238 (a uniform guess).  Measured on the first 8 windows of
#: the calibration text: bundled model 3.397 nats/token, the same architecture untrained 6.316, the training
#: files' unigram distribution 5.346; the bound (3.743) fails for anything that learned only token frequencies.
HELD_OUT_FRACTION = 0.6
#: Windows of the calibration text scored in the loss test (each SEQ tokens).
LOSS_WINDOWS = 8
#: Agreement of transformers (float32 compute, as the capture) with the fixture's recorded logprobs and greedy
#: tokens; exact on the capture machine, the slack is for other CPUs' rounding.
LOGPROB_TOL = 1e-3
MIN_GREEDY_AGREEMENT = 0.99
FIXTURE_CASES_CHECKED = 12
#: Text the determinism test trains on (a few windows' worth).
DETERMINISM_CHARS = 4000


def _script():
    spec = importlib.util.spec_from_file_location("train_example_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture(scope="module")
def manifest():
    return json.loads(examples.example_manifest().read_text())


@pytest.fixture(scope="module")
def release():
    directory = examples.example_model_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def _same_python(manifest) -> bool:
    return manifest["corpus"]["python"] == platform.python_version()


def _skip_other_python(manifest):
    if not _same_python(manifest):
        pytest.skip(f"the corpus is Python {manifest['corpus']['python']}'s standard library; this is "
                    f"{platform.python_version()}, whose files may differ")


# -- the model ----------------------------------------------------------------------------------------------------

def test_bundled_model_is_a_small_bf16_moe_with_256_multiple_rows(release):
    model, _ = release
    directory = examples.example_model_dir()
    assert (directory / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES
    bundled = sum(p.stat().st_size for p in examples.EXAMPLES.rglob("*") if p.is_file() and "__pycache__" not in
                  p.parts)
    assert bundled <= MAX_BUNDLE_BYTES
    assert model.config.model_type == "qwen3_moe" and model.dtype == torch.bfloat16
    assert model.config.num_experts > model.config.num_experts_per_tok > 1
    matrices = [(n, p.shape) for n, p in model.named_parameters() if p.ndim >= 2]
    assert matrices and all(shape[-1] % 256 == 0 for _, shape in matrices), matrices


def test_held_out_loss_is_far_below_an_untrained_models(release, script):
    model, tokenizer = release
    ids = tokenizer(examples.example_calibration_text().read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    loss = script.mean_loss(model, script.eval_windows(ids, LOSS_WINDOWS))
    untrained = math.log(model.config.vocab_size)
    assert loss < HELD_OUT_FRACTION * untrained, (loss, untrained)


def test_manifest_records_the_bundled_weights_held_out_loss(release, script, manifest):
    _skip_other_python(manifest)
    model, tokenizer = release
    windows = script.eval_windows(script.token_stream(tokenizer, script.EVAL_FILES), manifest["loss"]["eval_windows"])
    assert abs(script.mean_loss(model, windows) - manifest["loss"]["held_out_bf16"]) < 1e-3
    assert manifest["loss"]["held_out_bf16"] < manifest["loss"]["train_bf16"] + 1.0 < manifest["loss"]["uniform"]


# -- the corpus ---------------------------------------------------------------------------------------------------

def test_corpus_lists_are_disjoint_and_match_the_script(script, manifest):
    corpus = manifest["corpus"]
    lists = {role: [f["path"] for f in corpus[role]] for role in ("train", "eval", "calibration", "prompts")}
    assert lists == {"train": list(script.TRAIN_FILES), "eval": list(script.EVAL_FILES),
                     "calibration": list(script.CALIBRATION_FILES), "prompts": list(script.PROMPT_FILES)}
    seen = [path for paths in lists.values() for path in paths]
    assert len(seen) == len(set(seen))          # no file in two roles: held-out text is never trained on
    tokenizer_files = [f["path"] for f in corpus["tokenizer"]]
    assert tokenizer_files == list(script.tiny_tokenizer.CORPUS_FILES)
    assert set(tokenizer_files) <= set(lists["train"])


def test_corpus_hashes_match_the_local_standard_library(script, manifest):
    _skip_other_python(manifest)
    for role, files in (("tokenizer", script.tiny_tokenizer.CORPUS_FILES), ("train", script.TRAIN_FILES),
                        ("eval", script.EVAL_FILES), ("calibration", script.CALIBRATION_FILES),
                        ("prompts", script.PROMPT_FILES)):
        assert manifest["corpus"][role] == script.file_manifest(files), role


def test_bundled_texts_are_derived_from_the_manifest_files(script, manifest):
    _skip_other_python(manifest)
    assert examples.example_calibration_text().read_text(encoding="utf-8") == script.calibration_text()
    lines = examples.example_prompts().read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [{"id": i, "prompt": p} for i, p in script.prompt_snippets()]


def test_training_is_deterministic(script):
    tokenizer = script.example_tokenizer()
    text = examples.example_calibration_text().read_text(encoding="utf-8")[:DETERMINISM_CHARS]
    ids = tokenizer(text, add_special_tokens=False).input_ids
    states = []
    for _ in range(2):
        torch.manual_seed(12345)                  # the script must not depend on the global RNG
        model = script.initial_model(script.example_config(tokenizer), seed=3)
        script.train(model, ids, ids, seed=3, steps=2, batch=2, log=lambda _: None)
        states.append(model.state_dict())
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
    torch.manual_seed(0)
    fresh = script.initial_model(script.example_config(tokenizer), seed=3).state_dict()
    assert any(not torch.equal(fresh[name], states[0][name]) for name in fresh)   # training changed the weights


# -- the imatrix --------------------------------------------------------------------------------------------------

def test_bundled_imatrix_belongs_to_the_model(release):
    model, _ = release
    directory = examples.example_model_dir()
    imx = load_imatrix(examples.example_imatrix())
    assert not imx.synthetic
    assert imx.datasets == [f"{examples.TEXT_DIR}/{examples.CALIBRATION_TEXT}"]
    provenance = imx.provenance
    assert provenance["source_sha256"] == hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()
    assert provenance["text_sha256"] == hashlib.sha256(examples.example_calibration_text().read_bytes()).hexdigest()
    assert provenance["source_model_type"] == "qwen3_moe"
    amap = get_arch("qwen3_moe").bind(json.loads((directory / "config.json").read_text()))
    outputs = amap.outputs({n: tuple(p.shape) for n, p in model.state_dict().items()})
    expected = expected_entries({o.gguf_name: o.shape for o in outputs})
    required = {o.gguf_name for o in outputs if o.gguf_name in expected and o.tensor_class != "output"}
    imx.check_against(expected, required=required)
    coverage = imx.coverage()
    assert coverage.total == model.config.num_experts * model.config.num_hidden_layers
    assert coverage.observed == coverage.total and not coverage.unobserved_tensors
    tokens = imx.chunk_count * imx.chunk_size
    assert imx.entries["blk.0.attn_q.weight"].counts.tolist() == [tokens]
    routed = imx.entries["blk.0.ffn_gate_exps.weight"].counts
    assert routed.sum() == tokens * model.config.num_experts_per_tok


# -- the fixture --------------------------------------------------------------------------------------------------

def test_bundled_fixture_belongs_to_the_model(release):
    model, tokenizer = release
    fx = read_fixture(examples.example_fixture_dir())        # verifies content_sha256 over every case
    codec = TextCodec(tokenizer)
    identity = checkpoint_identity(examples.example_model_dir(), tokenizer=codec.fingerprint)
    assert fx.label == examples.FIXTURE_LABEL
    assert fx.identity.source == identity.source and fx.identity.tokenizer == identity.tokenizer
    assert fx.rendering.mode == "raw"
    prompts = [json.loads(line) for line in examples.example_prompts().read_text(encoding="utf-8").splitlines()]
    assert [(c.id, c.prompt) for c in fx.cases] == [(p["id"], p["prompt"]) for p in prompts]


def test_transformers_reproduces_the_fixture_continuations(release):
    _, tokenizer = release
    model = transformers.AutoModelForCausalLM.from_pretrained(examples.example_model_dir(),
                                                              dtype=torch.float32).eval()
    fx = read_fixture(examples.example_fixture_dir())
    codec = TextCodec(tokenizer)
    agree = total = 0
    for case in fx.cases[:FIXTURE_CASES_CHECKED]:
        prompt = codec.render(case.prompt, fx.rendering)
        target = codec.encode_text(case.continuation)
        ids = torch.tensor([prompt + target])
        with torch.inference_mode():
            rows = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
        recorded = np.array([p.logprob for p in case.response])
        ours = rows[torch.arange(len(target)), torch.tensor(target)].numpy()
        assert len(recorded) == len(target) and np.abs(ours - recorded).max() < LOGPROB_TOL, case.id
        agree += int((rows.argmax(-1) == torch.tensor(target)).sum())
        total += len(target)
    assert agree >= MIN_GREEDY_AGREEMENT * total


def test_demo_runs_end_to_end(tmp_path):
    """README's first command: convert -> validate -> score both -> compare, each step's outcome printed."""
    from click.testing import CliRunner

    from quantkit.cli import main

    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    steps = [line for line in lines if line.startswith("== ")]
    assert [s.split()[1] for s in steps] == ["plan", "validate", "F16", "score", "score", "compare:"]
    assert "valid" in lines
    assert sum(line.startswith("summary cases=100 ") for line in lines) == 2
    # the Q2 candidate loses to the F16 control on NLL (the scores of bench/results/example-model-*.md)
    assert "verdict=worse" in lines
    assert {p.name for p in tmp_path.iterdir()} >= {"tiny-moe-q2.gguf", "tiny-moe-f16.gguf", "tiny-moe-q2.tsv",
                                                   "tiny-moe-f16.tsv"}
    again = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path)])    # an earlier demo's files stay
    assert again.exit_code == 2 and "of an earlier demo; pass --force" in again.output, again.output
