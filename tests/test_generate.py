"""Sampled generation through the runtime: one seed, one token stream, whatever the execution mode.

On every tiny architecture a 64-token stream sampled with seed 0 (T=1, k=20, p=.95: the tiny models' logits are
small, so the law keeps many tokens and a stream is far from greedy) drawn with the KV cache is the classic law
replayed on one teacher-forced pass (:func:`quantkit.sampling.first_divergence`, what ``quantkit parity`` does),
and (slow: uncached generation costs 64 passes) identical with and without the cache, with packed weights decoded
per use and kept decoded; on CUDA (skipped without it) also resident and streamed on the device, cached and
uncached, against the CPU stream.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.sampling import SamplingParams, first_divergence
from test_fixtures import text_model  # noqa: F401 - the module fixture, used by name

ARCH_NAMES = ["deepseek_v3", "deepseek_v4", "glm5_next", "qwen3_moe", "qwen4_exp"]
PARAMS = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
NEW_TOKENS = 64
SEED = 0


def _prompt(n=16):
    return [int(t) for t in np.random.default_rng(7).integers(0, 480, n)]


def _stream(model, **kwargs):
    from quantkit.runtime import sample

    return sample(model, _prompt(), NEW_TOKENS, PARAMS, SEED, **kwargs)


def _replay_rows(model, tokens):
    """The teacher-forced pass over prompt + stream: the rows each stream token was drawn from."""
    from quantkit.runtime import logits

    prompt = _prompt()
    return logits(model, prompt + tokens)[len(prompt) - 1:-1]


def _check_stream(model, tokens):
    rows = _replay_rows(model, tokens)
    assert len(tokens) == NEW_TOKENS
    assert first_divergence(rows, tokens, PARAMS, SEED) is None     # the law replayed on one pass draws the same
    assert first_divergence(rows, tokens, PARAMS, SEED + 1) is not None
    assert any(int(np.argmax(r)) != t for r, t in zip(rows, tokens))   # sampled, not greedy
    return rows


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sampled_stream_is_the_law_replayed(tiny_checkpoints, arch):
    """The KV-cache stream equals the classic law replayed on one teacher-forced pass (the parity replay)."""
    from quantkit.runtime import load_model

    model = load_model(tiny_checkpoints.get(arch, "per-expert", "f32"))
    try:
        _check_stream(model, _stream(model).tokens)
    finally:
        model.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sampled_stream_is_equal_across_cpu_modes(tiny_checkpoints, arch):
    """Cached and uncached, packed weights decoded per use and kept decoded: one stream."""
    from quantkit.runtime import load_model

    path = tiny_checkpoints.get(arch, "per-expert", "f32")
    streams = {}
    for mode, kwargs in {"decoded per use": {}, "decoded kept": {"keep_bytes": 1 << 30}}.items():
        model = load_model(path, **kwargs)
        try:
            streams[f"{mode} cached"] = _stream(model).tokens
            if not kwargs:
                streams[f"{mode} uncached"] = _stream(model, use_cache=False).tokens
        finally:
            model.close()
    reference = streams.pop("decoded per use uncached")
    assert all(tokens == reference for tokens in streams.values()), streams
    assert len(reference) == NEW_TOKENS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sampled_stream_is_equal_on_cuda(tiny_checkpoints, arch, capsys):
    """CUDA resident and streamed, cached and uncached, give the CPU stream; the logits differences are printed."""
    from quantkit.runtime import load_model

    path = tiny_checkpoints.get(arch, "per-expert", "f32")
    model = load_model(path)
    try:
        cpu = _stream(model)
    finally:
        model.close()
    for mode, kwargs in {"resident": {}, "streamed": {"stream": True}}.items():
        model = load_model(path, device="cuda", **kwargs)
        try:
            for use_cache in (True, False):
                result = _stream(model, use_cache=use_cache)
                diff = float(np.abs(result.logits - cpu.logits).max())
                with capsys.disabled():
                    print(f"\n{arch} cuda {mode} {'cached' if use_cache else 'uncached'}: max |logit - cpu| "
                          f"{diff:.3g} (max |logit| {np.abs(cpu.logits).max():.3g})")
                assert result.tokens == cpu.tokens, (mode, use_cache)
        finally:
            model.close()


# -- the CLI --------------------------------------------------------------------------------------------------------

def test_cli_generate_prints_the_sampled_continuation(tiny_checkpoints):
    from quantkit.fixtures.tokens import Rendering, TextCodec
    from quantkit.runtime import load_model, sample
    from quantkit.scoring.loading import load_tokenizer

    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "f32")
    codec = TextCodec(load_tokenizer(path))
    prompt_ids = codec.render("def mean(values):", Rendering("raw"))
    model = load_model(path)
    try:
        expected = sample(model, prompt_ids, 12, SamplingParams(0.8, 10, 0.9), 3,
                          stop=lambda t: not codec.is_text_token(t)).tokens
    finally:
        model.close()
    args = ["generate", str(path), "--prompt", "def mean(values):", "--rendering", "raw", "-n", "12",
            "--temperature", "0.8", "--top-k", "10", "--top-p", "0.9", "--seed", "3"]
    out = CliRunner().invoke(main, args + ["--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["tokens"] == expected and report["sampling"]["seed"] == 3
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0 and out.output == codec.decode(expected) + "\n"
    out = CliRunner().invoke(main, args + ["--temperature", "nan"])
    assert out.exit_code == 2 and out.output.startswith("error: ") and out.output.count("\n") == 1
    out = CliRunner().invoke(main, args + ["--min-p", "0.1"])
    assert out.exit_code == 2 and "min_p belongs to the ds4 law" in out.output
    out = CliRunner().invoke(main, args + ["--law", "ds4", "--min-p", "0.1", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["sampling"]["law"] == "ds4"
    # past the model's context (max_position_embeddings): refused before a token is made; an empty prompt too
    context = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    out = CliRunner().invoke(main, args[:6] + ["-n", str(context)])
    assert out.exit_code == 2 and f"pass the model's context of {context} tokens" in out.output, out.output
    out = CliRunner().invoke(main, ["generate", str(path), "--prompt", "", "--rendering", "raw"])
    assert out.exit_code == 2 and "--prompt" in out.output and out.output.count("\n") == 1, out.output


def test_cli_sampled_capture_records_its_law(tmp_path, text_model):  # noqa: F811 - pytest fixture
    from quantkit.fixtures.directory import read_fixture
    from quantkit.fixtures.tokens import Rendering
    from quantkit.sampling import classic_distribution

    model, codec, folder = text_model
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def foo(x):\nimport os\n")
    runner = CliRunner()
    greedy_fx, sampled_fx = tmp_path / "greedy", tmp_path / "sampled"
    common = [str(folder), "--prompts", str(prompts), "--tokens", "6", "--label", "0731", "--rendering", "raw"]
    assert runner.invoke(main, ["fixture", "capture", *common, "-o", str(greedy_fx)]).exit_code == 0
    out = runner.invoke(main, ["fixture", "capture", *common, "-o", str(sampled_fx), "--sample", "--temperature",
                               "0.8", "--top-k", "3", "--top-p", "1", "--seed", "4"])
    assert out.exit_code == 0, out.output
    info = json.loads((sampled_fx / "fixture.json").read_text())
    assert info["capture"]["sampling"] == {"temperature": 0.8, "top_k": 3, "top_p": 1.0, "presence_penalty": 0.0,
                                           "frequency_penalty": 0.0, "seed": 4, "law": "classic"}
    sampled, greedy = read_fixture(sampled_fx), read_fixture(greedy_fx)
    assert [c.continuation for c in sampled.cases] != [c.continuation for c in greedy.cases]
    # every kept token is what the law draws from the source's teacher-forced rows with that seed
    params = SamplingParams(0.8, 3, 1.0)
    for case in sampled.cases:
        prompt_ids = codec.render(case.prompt, Rendering("raw"))
        target = codec.encode_text(case.continuation)       # capture keeps continuations that round-trip
        with torch.no_grad():
            rows = model(torch.tensor([prompt_ids + target])).logits[0].float().numpy()
        rows = rows[len(prompt_ids) - 1:-1]
        assert len(target) >= 1 and first_divergence(rows, target, params, 4) is None
        assert all(classic_distribution(r, params)[t] > 0 for r, t in zip(rows, target))
