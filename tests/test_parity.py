"""``quantkit parity`` on the tiny qwen3_moe model: engine outputs made from the reference pass, and made wrong on
purpose, in every format it reads (llama-perplexity's logits file, ds4's --dump-logprobs JSON, .npy logits, sampled
stream JSON, .npy/.npz hidden states).  KLD expectations are computed here with scipy's softmax and rel_entr."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.sampling import Sampler, SamplingParams

PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 480, 24)]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    """(checkpoint path, runtime model) of the tiny qwen3_moe."""
    from quantkit.runtime import load_model

    path = tiny_checkpoints.get("qwen3_moe", "per-expert", "f32")
    model = load_model(path)
    yield path, model
    model.close()


def run(*args):
    out = CliRunner().invoke(main, ["parity", *map(str, args)])
    return out.exit_code, out.output


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


@pytest.fixture()
def prompt_file(tmp_path):
    return write_json(tmp_path / "prompt.json", PROMPT)


# -- (a) logits ------------------------------------------------------------------------------------------------------

def test_npy_logits_of_the_reference_pass_and_a_missing_top1_fails(tiny, tmp_path, prompt_file):
    from scipy.special import rel_entr, softmax

    from quantkit.runtime import logits

    path, model = tiny
    rows = logits(model, PROMPT)
    engine = rows + np.random.default_rng(0).normal(0, 0.05, rows.shape).astype(np.float32)
    np.save(tmp_path / "engine.npy", engine)
    code, output = run(path, "--logits", tmp_path / "engine.npy", "--tokens", prompt_file, "--json",
                       "--confident", "0")
    assert code == 0, output
    report = json.loads(output)["logits"]
    expected = rel_entr(softmax(engine.astype(np.float64), axis=1), softmax(rows.astype(np.float64), axis=1)).sum(1)
    assert np.allclose(report["kld"], expected, rtol=1e-6, atol=1e-12)
    assert report["positions"] == len(PROMPT) and report["passed"]
    assert report["top1_agreement"] == float(np.mean(engine.argmax(1) == rows.argmax(1)))

    broken = engine.copy()
    broken[5, rows[5].argmax()] = -100.0          # the reference's top-1 leaves the engine's top 8
    np.save(tmp_path / "broken.npy", broken)
    code, output = run(path, "--logits", tmp_path / "broken.npy", "--tokens", prompt_file, "--confident", "0")
    assert code == 1 and "position 5: reference top-1" in output and "parity: DIVERGENCE" in output
    # unconfident reference tokens (tiny random models are never confident at .5) do not count
    code, output = run(path, "--logits", tmp_path / "broken.npy", "--tokens", prompt_file)
    assert code == 0, output


def test_logits_of_no_model_or_another_fail_where_no_position_is_confident(tiny, tiny_checkpoints, tmp_path,
                                                                           prompt_file):
    """A tiny model is never confident, so the top-8 rule alone passed all-zero logits and another model's: the
    top-1 agreement floor and the mean KLD bound fail them, each named; the bounds are the user's to set."""
    from quantkit.runtime import load_model, logits

    path, model = tiny
    other = load_model(tiny_checkpoints.get("deepseek_v3", "per-expert", "f32"))
    try:
        foreign = logits(other, PROMPT)[:, :model.vocab_size]
    finally:
        other.close()
    assert foreign.shape[1] == model.vocab_size
    for name, engine in [("zeros", np.zeros((len(PROMPT), model.vocab_size), np.float32)), ("other", foreign)]:
        np.save(tmp_path / f"{name}.npy", engine)
        code, output = run(path, "--logits", tmp_path / f"{name}.npy", "--tokens", prompt_file)
        assert code == 1 and "parity: DIVERGENCE" in output, output
        assert "top-1 agreement" in output.split("logits: FAIL")[1] and "(0 confident)" in output, output
        code, output = run(path, "--logits", tmp_path / f"{name}.npy", "--tokens", prompt_file, "--min-top1", "0",
                           "--max-mean-kld", "100")
        assert code == 0, output
    code, output = run(path, "--logits", tmp_path / "zeros.npy", "--tokens", prompt_file, "--min-top1", "0")
    assert code == 1 and "mean KLD" in output.split("logits: FAIL")[1], output


def test_llama_perplexity_logits_file(tiny, tmp_path):
    """A base file in llama-perplexity's format (quantkit's writer, proven byte-identical elsewhere) of the
    reference's own chunks: every top-1 agrees, KLD is the 16-bit quantization's alone; a file of another model's
    logits reports llama.cpp's statistics and fails the top-8 rule where its top-1 is confident."""
    from quantkit.runtime import logits
    from quantkit.scoring.kld import chunk_inputs, scored_per_chunk, write_logits_file

    path, model = tiny
    n_ctx, tokens = 16, np.array(PROMPT[:16] * 2, np.int64)
    chunks = [logits(model, chunk_inputs(tokens, n_ctx, c, None)[0])[n_ctx // 2:n_ctx - 1] for c in range(2)]
    write_logits_file(tmp_path / "base.kld", n_ctx, model.vocab_size, tokens, chunks)
    code, output = run(path, "--logits", tmp_path / "base.kld", "--json")
    assert code == 0, output
    report = json.loads(output)["logits"]
    assert report["positions"] == 2 * scored_per_chunk(n_ctx) == report["llama_perplexity"]["count"]
    assert report["top1_agreement"] == 1.0 == report["llama_perplexity"]["same_top"]
    assert 0 <= report["mean_kld"] < 1e-6 and abs(report["mean_kld"] - report["llama_perplexity"]["mean_kld"]) < 1e-9
    code, output = run(path, "--logits", tmp_path / "base.kld")
    assert code == 0 and "Same top p: 100.000 ±" in output

    sharp = [c * 0 + np.where(np.arange(c.shape[1]) == (c.argmax(1)[:, None] + 1) % c.shape[1], 30.0, 0.0)
             .astype(np.float32) for c in chunks]      # an "engine" sure of a token the reference does not rank 1st
    write_logits_file(tmp_path / "other.kld", n_ctx, model.vocab_size, tokens, sharp)
    code, output = run(path, "--logits", tmp_path / "other.kld", "--confident", "0")
    assert code == 1 and "Mean    KLD:" in output and "missing from the engine's top 8" in output


def test_llama_perplexity_logits_file_counts_every_scored_position(tiny, tmp_path):
    """Chunks scoring more positions than the KLD accumulator's row block (64): every position counts in the
    mean KLD the gate uses, which equals llama-perplexity's Mean KLD of the same file."""
    from quantkit.runtime import logits
    from quantkit.scoring.kld import ROW_BLOCK, chunk_inputs, scored_per_chunk, write_logits_file

    path, model = tiny
    n_ctx = 160
    assert scored_per_chunk(n_ctx) > ROW_BLOCK
    tokens = np.random.default_rng(5).integers(0, 480, 2 * n_ctx).astype(np.int64)
    noise = np.random.default_rng(6)
    chunks = []
    for c in range(2):
        ref = logits(model, chunk_inputs(tokens, n_ctx, c, None)[0])[n_ctx // 2:n_ctx - 1]
        scale = np.where(np.arange(len(ref))[:, None] < ROW_BLOCK, 0.0, 2.0)   # only rows past the first block differ
        chunks.append((ref + scale * noise.standard_normal(ref.shape)).astype(np.float32))
    write_logits_file(tmp_path / "base.kld", n_ctx, model.vocab_size, tokens, chunks)
    code, output = run(path, "--logits", tmp_path / "base.kld", "--json", "--max-mean-kld", "1e-3")
    report = json.loads(output)["logits"]
    assert report["positions"] == 2 * scored_per_chunk(n_ctx) == len(report["kld"])
    assert report["mean_kld"] == pytest.approx(report["llama_perplexity"]["mean_kld"], rel=1e-5)
    assert report["mean_kld"] > 1e-3 and code == 1, output


def test_ds4_logprob_dump(tiny, tmp_path, prompt_file):
    """A dump in ds4's --dump-logprobs layout (ds4_cli.c) of the reference's greedy continuation."""
    from quantkit.runtime import greedy, logits

    path, model = tiny
    continuation = greedy(model, PROMPT, 4).tokens
    rows = logits(model, PROMPT + continuation[:-1])[len(PROMPT) - 1:].astype(np.float64)
    logprobs = rows - np.log(np.exp(rows).sum(1, keepdims=True))

    def token(i):
        return {"id": int(i), "text": "", "bytes": []}

    def dump(selected):
        return {"source": "ds4", "prompt_tokens": len(PROMPT), "ctx": 64, "top_k": 20, "steps": [
            {"step": s, "selected": token(selected[s]), "top_logprobs": [
                {"token": token(t), "logit": float(rows[s, t]), "logprob": float(logprobs[s, t])}
                for t in np.argsort(-logprobs[s], kind="stable")[:20]]} for s in range(len(selected))]}

    write_json(tmp_path / "ds4.json", dump(continuation))
    code, output = run(path, "--logits", tmp_path / "ds4.json", "--tokens", prompt_file, "--json")
    assert code == 0, output
    report = json.loads(output)["logits"]
    assert report["top1_agreement"] == 1.0 and report["max_listed_logprob_delta"] < 1e-5
    assert report["kld_is_lower_bound"] and 0 <= report["mean_kld"] < 1e-9
    # the same ranking with other log-probabilities (4 lp - 1): top-1 agrees everywhere, the KLD bound fails it
    flat = dump(continuation)
    for step in flat["steps"]:
        for entry in step["top_logprobs"]:
            entry["logprob"] = 4 * entry["logprob"] - 1
    write_json(tmp_path / "flat.json", flat)
    code, output = run(path, "--logits", tmp_path / "flat.json", "--tokens", prompt_file)
    assert code == 1 and "top-1 agreement 1.000000" in output and "mean KLD" in output.split("FAIL")[1], output
    wrong = dump([(t + 1) % model.vocab_size for t in continuation])
    for step in wrong["steps"]:
        step["top_logprobs"] = step["top_logprobs"][1:]      # the engine never lists the reference's top-1
    write_json(tmp_path / "wrong.json", wrong)
    code, output = run(path, "--logits", tmp_path / "wrong.json", "--tokens", prompt_file, "--confident", "0")
    assert code == 1 and "top-1 agreement 0.000000" in output
    code, output = run(path, "--logits", tmp_path / "ds4.json", "--tokens",
                       write_json(tmp_path / "short.json", PROMPT[:-1]))
    assert code == 2 and "prompt renders to 23 tokens, the ds4 dump's to 24" in output
    # nothing listed compares nothing (it passed every gate); a logprob past float64 is no number
    empty = dump(continuation)
    empty["steps"][1]["top_logprobs"] = []
    code, output = run(path, "--logits", write_json(tmp_path / "empty.json", empty), "--tokens", prompt_file)
    assert code == 2 and "steps[1]: no top_logprobs listed" in output
    huge = dump(continuation)
    huge["steps"][0]["top_logprobs"][0]["logprob"] = -10 ** 400
    code, output = run(path, "--logits", write_json(tmp_path / "huge.json", huge), "--tokens", prompt_file)
    assert code == 2 and "steps[0].top_logprobs[0]: expected" in output


# -- (b) sampled streams -----------------------------------------------------------------------------------------

def test_sampled_streams(tiny, tmp_path, prompt_file):
    from quantkit.runtime import sample
    from quantkit.runtime.generate import continuation

    path, model = tiny
    params = SamplingParams(1.0, 20, 0.3)
    settings = {"temperature": 1.0, "top_k": 20, "top_p": 0.3}
    good = sample(model, PROMPT, 16, params, 7).tokens
    faulty = continuation(model, PROMPT, 16, Sampler(params, 7, law="top-k-renormalized").next).tokens
    first = sample(model, PROMPT, 1, params, 7).tokens
    switched = continuation(model, PROMPT + first, 15, Sampler(params, 8).next).tokens   # new stream after token 0
    files = {name: write_json(tmp_path / f"{name}.json", {"tokens": tokens, "seed": 7, **settings})
             for name, tokens in {"good": good, "faulty": faulty, "switched": first + switched}.items()}
    code, output = run(path, "--stream", files["good"], "--tokens", prompt_file)
    assert code == 0 and "draws every token: pass" in output
    assert good != faulty
    code, output = run(path, "--stream", files["faulty"], "--tokens", prompt_file, "--json")
    report = json.loads(output)["streams"][0]
    assert code == 1 and report["top_k_renormalized_law_matches"]
    assert report["first_divergence"]["position"] == next(i for i, (a, b) in enumerate(zip(good, faulty)) if a != b)
    code, output = run(path, "--stream", files["switched"], "--stream", files["good"], "--tokens", prompt_file,
                       "--json")
    report = json.loads(output)
    assert code == 1 and report["streams"][0]["first_divergence"]["position"] >= 1 and report["streams"][1]["passed"]
    # a DeepSeek/GLM engine's stream follows the ds4 law and generator
    ds4 = continuation(model, PROMPT, 16, Sampler(params, 7, law="ds4").next).tokens
    ds4_file = write_json(tmp_path / "ds4.json", {"tokens": ds4, "seed": 7, "law": "ds4", **settings})
    code, output = run(path, "--stream", ds4_file, "--tokens", prompt_file)
    assert code == 0 and "the ds4 law replayed on the reference draws every token" in output
    code, output = run(path, "--stream", write_json(tmp_path / "as_classic.json", {"tokens": ds4, "seed": 7,
                                                                                    **settings}),
                       "--tokens", prompt_file)
    assert code == 1, output


# -- (c) hidden states -------------------------------------------------------------------------------------------

def test_hidden_states(tiny, tmp_path, prompt_file):
    from quantkit.runtime.loader import hidden_states

    path, model = tiny
    layers = hidden_states(model, PROMPT)
    np.save(tmp_path / "all.npy", np.stack(layers))
    code, output = run(path, "--hidden", tmp_path / "all.npy", "--tokens", prompt_file, "--json")
    assert code == 0, output
    report = json.loads(output)["hidden"]
    assert [layer["reference_layer"] for layer in report["layers"]] == list(range(len(layers)))
    assert all(layer["cosine"] > 0.9999999 for layer in report["layers"])
    # without the embeddings, first 10 positions only, one layer perturbed: that layer fails, named
    noisy = [layer[:10].copy() for layer in layers[1:]]
    noisy[0] += np.random.default_rng(0).normal(0, float(np.abs(noisy[0]).mean()) * 0.1, noisy[0].shape)
    np.savez(tmp_path / "noisy.npz", **{f"layer_{i}": a for i, a in enumerate(noisy)})
    code, output = run(path, "--hidden", tmp_path / "noisy.npz", "--tokens", prompt_file)
    assert code == 1 and "first layer below the bar: 1" in output
    code, output = run(path, "--hidden", tmp_path / "noisy.npz", "--tokens", prompt_file, "--cosine-bar", "0.9")
    assert code == 0, output


# -- unusable input ------------------------------------------------------------------------------------------------

def test_unusable_inputs_exit_2_with_one_line(tiny, tmp_path, prompt_file):
    path, _ = tiny
    np.save(tmp_path / "ok.npy", np.zeros((4, 7), np.float32))
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes((tmp_path / "ok.npy").read_bytes()[:-9])
    cases = [
        (["--logits", truncated, "--tokens", prompt_file], "truncated.npy"),
        (["--logits", tmp_path / "ok.npy", "--tokens", prompt_file], "vocabulary of 7"),
        (["--stream", write_json(tmp_path / "s.json", {"tokens": [1, 2]}), "--tokens", prompt_file], "s.json"),
        (["--stream", write_json(tmp_path / "t.json", {"tokens": [1, 2], "seed": 0, "top_k": -1}), "--tokens",
          prompt_file], "top_k"),
        (["--stream", write_json(tmp_path / "k.json", {"tokens": [1, 2], "seed": 0, "top_k": 2.5}), "--tokens",
          prompt_file], "top_k must be a whole number"),
        (["--stream", write_json(tmp_path / "n.json", {"tokens": [1, 2], "seed": -1}), "--tokens", prompt_file],
         "seed must be a whole number in 0..2^64-1"),
        (["--logits", write_json(tmp_path / "x.json", {"source": "other"}), "--tokens", prompt_file], "x.json"),
        (["--stream", write_json(tmp_path / "u.json", {"tokens": [1, 10 ** 6], "seed": 0}), "--tokens",
          prompt_file], "outside the reference's vocabulary"),
        (["--stream", write_json(tmp_path / "l.json", {"tokens": [1], "seed": 0, "law": "nucleus"}), "--tokens",
          prompt_file], "law: expected one of"),
        (["--stream", write_json(tmp_path / "p.json", {"tokens": [1], "seed": 0, "law": "ds4",
                                                         "presence_penalty": 1}), "--tokens", prompt_file],
         "no presence or frequency penalties"),
        (["--logits", tmp_path / "ok.npy"], "--prompt or --tokens"),
        (["--logits", tmp_path / "ok.npy", "--tokens", write_json(tmp_path / "ids.json", ["a"])], "ids.json: [0]"),
        (["--logits", tmp_path / "ok.npy", "--tokens", tmp_path / "ok.npy"], "1-D integer array"),
        ([], "nothing to compare"),
    ]
    for args, message in cases:
        code, output = run(path, *args)
        assert code == 2 and message in output, (args, output)
        assert "Traceback" not in output


# -- llama-perplexity's own base file -------------------------------------------------------------------------------
#
# The tiny qwen3_moe as an F32 GGUF and a mixed one (Q4_K experts, Q8_0 matrices), both written by quantkit; text of
# 22 chunks of -c 64 (682 scored tokens); F32 KV cache, no flash attention, so llama.cpp's arithmetic is float32
# throughout apart from the quantized products.

LLAMA_PERPLEXITY = os.environ.get("QUANTKIT_LLAMA_PERPLEXITY")
LLAMA_PERPLEXITY_RUNS = 5
needs_llama_perplexity = pytest.mark.skipif(not LLAMA_PERPLEXITY,
                                            reason="set QUANTKIT_LLAMA_PERPLEXITY to a llama-perplexity binary")


@pytest.fixture(scope="module")
def llama_kld(tiny_checkpoints, tmp_path_factory):
    """``(f32.gguf, mixed.gguf, perplexity)``: ``perplexity(base, *args)`` runs llama-perplexity with the settings
    above and ``--kl-divergence-base base``, returning its stdout; ``perplexity(base, "-m", M, "-f", TEXT)``
    writes the base file of M."""
    import subprocess

    from test_runtime import TEXT, f32_types, mixed_types, write_gguf

    folder = tmp_path_factory.mktemp("llama_kld")
    source = tiny_checkpoints.get("qwen3_moe", "per-expert", "f32")
    f32, mixed = (write_gguf(source, folder / f"{k}.gguf", "qwen3_moe", t)
                  for k, t in (("f32", f32_types), ("mixed", mixed_types)))
    text = folder / "text.txt"
    text.write_text(TEXT * 12)

    def perplexity(base, *args):
        command = [LLAMA_PERPLEXITY, "-c", "64", "-t", "2", "-fa", "off", "-ctk", "f32", "-ctv", "f32",
                   "--kl-divergence-base", str(base), *map(str, args)]
        # llama.cpp's logger writes from its own thread and is never flushed at exit (common/log.cpp leaks it on
        # purpose), so the summary's tail is now and then lost: run again until it is complete
        for _ in range(LLAMA_PERPLEXITY_RUNS):
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            if "--kl-divergence" not in args or "Same top p:" in out:
                return out
        pytest.fail(f"llama-perplexity printed no complete summary in {LLAMA_PERPLEXITY_RUNS} runs")

    def base_of(model):
        base = folder / f"{model.stem}.kld"
        if not base.exists():
            perplexity(base, "-m", model, "-f", text)
        return base

    return f32, mixed, perplexity, base_of


def summary(printed: str) -> list[str]:
    """llama-perplexity's statistics block (from its first heading to "Same top p"), blank lines kept."""
    lines = printed.splitlines()
    first = lines.index("====== Perplexity statistics ======")
    last = next(i for i, line in enumerate(lines) if line.startswith("Same top p"))
    return lines[first:last + 1]


def figure_line(printed: str, name: str) -> str:
    return next(line for line in printed.splitlines() if line.startswith(name))


@pytest.mark.interop
@needs_llama_perplexity
def test_kld_statistics_of_llama_cpp_logits_are_llama_perplexitys_to_the_byte(llama_kld):
    """Given llama.cpp's own logits (llama-cpp-python, bit-identical to llama-perplexity's on the machine this was
    measured on), quantkit's side of ``parity`` reproduces llama-perplexity exactly: chunking, BOS and the base
    file's records (quantkit's writer on llama.cpp's F32 logits gives llama-perplexity's base file byte for byte),
    the scored token set and every printed statistic (all 39 lines of the summary, Mean KLD and Same top p among
    them).  What remains between ``quantkit parity`` and llama-perplexity is therefore the logits alone."""
    from test_runtime import llama_cpp_logits

    from quantkit.fixtures.tokens import TextCodec
    from quantkit.scoring.kld import (KldAccumulator, LogitsFile, chunk_inputs, scored_per_chunk,
                                      write_logits_file)
    from quantkit.scoring.loading import load_tokenizer

    f32, mixed, perplexity, base_of = llama_kld
    base = LogitsFile(base_of(f32))
    codec = TextCodec(load_tokenizer(mixed, None))
    bos = codec.bos_id if codec.add_bos else None
    first = base.n_ctx // 2

    def llama_rows(model):
        for chunk in range(base.n_chunk):
            ids, targets = chunk_inputs(base.tokens, base.n_ctx, chunk, bos)
            yield llama_cpp_logits(model, ids.tolist())[first:first + scored_per_chunk(base.n_ctx)], targets

    ours_base = base.path.with_name("quantkit-written.kld")
    write_logits_file(ours_base, base.n_ctx, base.n_vocab, base.tokens, (rows for rows, _ in llama_rows(f32)))
    assert ours_base.read_bytes() == base.path.read_bytes()

    acc = KldAccumulator()
    for chunk, (rows, targets) in enumerate(llama_rows(mixed)):
        acc.add(rows, base.records[chunk], targets)
    assert acc.stats().report_lines() == summary(perplexity(base.path, "-m", mixed, "--kl-divergence"))


@pytest.mark.interop
@needs_llama_perplexity
@pytest.mark.parametrize("scored", ["f32", "mixed"])
def test_parity_on_llama_perplexitys_base_file_prints_its_kld_and_same_top(llama_kld, scored):
    """llama-perplexity writes the base file of one GGUF and scores the other against it; ``quantkit parity SCORED.gguf
    --logits base --arithmetic ggml-cpu`` prints the same "Mean KLD" and "Same top p" lines, value and uncertainty,
    to the printed digit, in both directions (the issue's: the F32 file's base, the mixed file scored).

    The quantized direction needs the products in ggml (:mod:`quantkit.runtime.ggml_arithmetic`): with the
    activation rounding only emulated in torch, float32 summation order moved a value across a Q8 rounding boundary
    in 16 of the 22 chunks (chunk 8, layer 0, position 38, MoE input element 82: -91.499985 quantization steps here,
    -91.500012 in llama.cpp), and the lines read 0.000175 vs 0.000174 and 95.455% vs 95.601%.  The F32 file has no
    activation rounding to flip: even then its logits were within 8.4e-7 nat of llama.cpp's on all 682 rows."""
    f32, mixed, perplexity, base_of = llama_kld
    model, other = (f32, mixed) if scored == "f32" else (mixed, f32)
    base = base_of(other)
    theirs = perplexity(base, "-m", model, "--kl-divergence")
    code, ours = run(model, "--logits", base, "--arithmetic", "ggml-cpu")
    assert code == 0, ours
    for name in ("Mean    KLD", "Same top p"):
        assert figure_line(ours, name) == figure_line(theirs, name)
