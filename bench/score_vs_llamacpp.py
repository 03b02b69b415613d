"""All-position scoring on one GPU: quantkit's CUDA runtime vs llama.cpp's CUDA build, same synthetic GGUFs, one run.

    python bench/score_vs_llamacpp.py --llama-src LLAMA_CPP_TREE [--build /tmp/llama-build] [--jobs 14]
        [--models 1b,7b,v4,glm5,qwen4] [--tokens 512,2048] [--batch 2048] [--long 16384] [--long-models glm5,qwen4]
        [--dtypes float32,bfloat16] [--repeats 3] [--second-half] [--scored PASSES] [--skip-llama] [--overlap-build]
        [--skip-llama-bench] [--markdown FILE] [--logs DIR] [--float32-products tf32x3]

1. Starts building llama.cpp's ``llama-perplexity`` and ``llama-bench`` with CUDA for sm_90 from the vendored
   source tree (``python -m quantkit.testing.llama_src`` prints where it is) in the background (about 5 minutes
   on 16 cores).
2. Writes synthetic GGUFs (random Q4_K routed experts, Q8_0 other matrices, F32 vectors and small sensitive
   tensors: the builder of bench/synthetic_gguf.py) with a small SentencePiece vocabulary so llama-perplexity can
   tokenize a text, and a text of random words (one token each).  ``--models`` picks them (default ``1b,7b``):

   * ``1b``: Qwen3-MoE, 1.02B, 16 experts top-4, 8 layers; ``7b``: Qwen3-MoE, 7.6B, 64 experts top-8, 24 layers;
   * one per seed architecture, each its tiny test model (:mod:`quantkit.testing.tiny_models`, every layer type)
     scaled to hidden 2048 within llama.cpp's constraints (../shared/INTEROP.md), about 2B parameters:
     ``v4``: DeepSeek V4, 2.02B, 32 experts (width 1024) top-6, 8 layers: 2 sliding-window and 3 compressed
     sparse (ratio 4, indexer top-64) and 3 heavily compressed (ratio 128), the first 3 hash-routed;
     ``glm5``: GLM-5 Next, 1.97B, 32 experts (width 1024) top-8, 9 layers: 3 x (KDA linear attention, MLA running
     its indexer, MLA reusing that selection), the first MLP dense;
     ``qwen4``: Qwen4-Exp, 2.03B, 32 experts (width 512) top-8, 12 layers: 3 x (3 gated-delta-net layers, one QSA
     sparse attention layer, indexer budget 256), the PLE n-gram embedding on the first.  Once its sparse
     attention engages, quantkit (transformers) selects blocks and llama.cpp single tokens (INTEROP.md): the
     logits differ, the work compared is the same.
3. quantkit: :func:`quantkit.runtime.logits_batch` (every position's logits, copied to the host; with
   ``--second-half`` those of positions N/2.. only, what llama-perplexity asks for) on random
   tokens of each ``--tokens`` length N (and ``--long`` for the ``--long-models``, by default the first),
   ``max(1, --batch // N)`` sequences per forward pass as llama-perplexity packs ``--batch // N`` chunks per pass
   (its ``n_seq``), per compute
   dtype; tokens/s from the median of ``--repeats`` calls after a warm-up; peak device memory is torch's
   allocator peak for that load and length.  A pass shape that repeats is captured as a CUDA graph by the runtime
   and replayed (:func:`quantkit.runtime.loader._forward`; up to 4096 tokens, float32): the first timed call or
   two run eagerly (one captures), so give ``--repeats`` 5 for a median of replays, the
   steady state of chunked scoring that llama-perplexity's steady figure also measures.  ``--scored``: also
   quantkit score's own host work on those logits (:func:`scored_tokens_per_s`), the "scored" figures.
   Normally after the build has finished (a quiet machine); ``--overlap-build`` times them while it runs
   (to fit a short device lease: give the build fewer ``--jobs`` than the host has cores).
4. llama.cpp (after the build): ``llama-perplexity -c N`` (flash attention on, all layers on the GPU) over
   enough chunks of the text: it scores the second half of each chunk, so it asks for the logits of positions
   N/2.. only (its last layer's attention output, FFN and head run on those rows; those logits are copied to
   the host, where its threads compute the NLL, inside its timed passes); tokens/s (all N tokens of a chunk
   counted) from its log's timestamps (:func:`perplexity_speed`: its own ``--log-file``, else its output; the
   arrival times of its output lines if both lost the last lines); peak memory is the most ``nvidia-smi`` saw in
   use during the run less the idle figure.  ``llama-bench -p N -n 0 -fa 0,1`` (last position only) is shown as context
   (``--skip-llama-bench``: neither built nor run, for a short device lease).

Prints one JSON object per measurement, then a markdown table (also written to ``--markdown``).
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGUFValueType

from _common import commit, emit
from synthetic_gguf import SYNTHETIC, write_synthetic

from quantkit.io.gguf import KV, ArrayOf
from quantkit.runtime import load_model, logits_batch
from quantkit.testing import tiny_models

def seed_config(arch: str, text: dict) -> dict:
    """The ``config.json`` of a seed architecture's model: its tiny test model
    (:func:`quantkit.testing.tiny_models.tiny_config`, every layer type) with the text model's ``text`` values over
    it, the bench vocabulary's size and special ids, and the keys llama.cpp's converter reads (INTEROP.md)."""
    spec = tiny_models.get_arch(arch)
    tiny = tiny_models.tiny_config(arch)
    values = tiny.to_dict()
    body = values["text_config"] if spec.nested else values
    body.update(vocab_size=SYNTHETIC["vocab_size"], bos_token_id=1, eos_token_id=2, pad_token_id=0, **text)
    config = type(tiny).from_dict(values)      # transformers fills in what the values imply (layer schedules)
    values = {**config.to_dict(), **spec.converter_keys(config), "architectures": [spec.model_class]}
    values.pop("transformers_version", None)
    return values


def vocab_size(config: dict) -> int:
    """A config's vocabulary size (a vision-language config holds it in its text model's)."""
    return config.get("text_config", config)["vocab_size"]


MODELS = {
    "1b": SYNTHETIC,
    "7b": {**SYNTHETIC, "num_hidden_layers": 24, "num_experts": 64, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768},
    # sliding (ratio 0) and hash-routed layers first, then compressed sparse (4) and heavily compressed (128);
    # the rope rebuilt from the legacy keys, as the tiny config's carries the rotary fraction of its head_dim
    "v4": seed_config("deepseek_v4", dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, head_dim=512, q_lora_rank=1024,
        qk_rope_head_dim=64, partial_rotary_factor=None, rope_parameters=None,
        rope_scaling=dict(tiny_models.V4_ROPE_SCALING), o_groups=8, o_lora_rank=512, n_routed_experts=32,
        num_experts_per_tok=6, moe_intermediate_size=1024, index_n_heads=32, index_head_dim=128, index_topk=64,
        sliding_window=128,
        layer_types=["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 5)),
    # KDA linear attention, MLA running its indexer, MLA reusing that selection; the first MLP dense
    "glm5": seed_config("glm5_next", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=9, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=1024, kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=32, num_experts_per_tok=8, moe_intermediate_size=1024, index_n_heads=32,
        index_head_dim=128, index_topk=256, linear_head_dim=128, linear_num_heads=16,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"] * 3,
        indexer_types=["full", "full", "shared"] * 3, mlp_layer_types=["dense"] + ["sparse"] * 8)),
    # three gated-delta-net layers per QSA sparse attention layer; the PLE n-gram embedding on layer 0
    "qwen4": seed_config("qwen4_exp", dict(
        hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3, hc_lowrank=320, ple_layer_ids=[1],
        ple_embed_dim=2048, heads_per_ngram=8, ngram_vocab_size_base=50_000, split_ngram_parts=16,
        indexer_n_heads=16, indexer_head_dim=128, indexer_budget=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})),
}
#: Tokens llama-perplexity scores per context length: enough chunks for a steady figure.
PERPLEXITY_TOKENS = 16384
CMAKE_FLAGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DCMAKE_BUILD_TYPE=Release",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
# SentencePiece token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


# -- llama.cpp build --------------------------------------------------------------------------------------------

def start_build(source: Path, build: Path, jobs: int, log: Path,
                targets: tuple[str, ...] = ("llama-perplexity", "llama-bench")) -> subprocess.Popen:
    """Configure and build ``targets`` from the llama.cpp tree ``source`` in the background; the process writes
    ``log``."""
    build.mkdir(parents=True, exist_ok=True)
    script = (f"cmake -S {source} -B {build / 'out'} {' '.join(CMAKE_FLAGS)} && "
              f"cmake --build {build / 'out'} --target {' '.join(targets)} -j {jobs}")
    return subprocess.Popen(["bash", "-c", script], stdout=log.open("w"), stderr=subprocess.STDOUT)


# -- synthetic files --------------------------------------------------------------------------------------------

def vocabulary(size: int) -> list[str]:
    """Specials, the 256 byte tokens, then SentencePiece pieces of one to three letters (with and without the
    word-start mark), ``size`` in all."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [a for a in letters] + [a + b for a in letters for b in letters] + \
             [a + b + c for a in letters for b in letters for c in letters]
    words = ["\u2581" + p for p in pieces] + pieces
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    if len(tokens) < size:
        raise ValueError(f"vocabulary of {size} tokens exceeds the {len(tokens)} pieces generated")
    return tokens[:size]


def tokenizer_metadata(size: int) -> tuple:
    tokens = vocabulary(size)
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (size - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(size - 259)]
    return (("tokenizer.ggml.model", KV("llama", GGUFValueType.STRING)),
            ("tokenizer.ggml.tokens", KV(tokens, ArrayOf(GGUFValueType.STRING))),
            ("tokenizer.ggml.scores", KV(scores, ArrayOf(GGUFValueType.FLOAT32))),
            ("tokenizer.ggml.token_type", KV(types, ArrayOf(GGUFValueType.INT32))),
            ("tokenizer.ggml.unknown_token_id", KV(0, GGUFValueType.UINT32)),
            ("tokenizer.ggml.bos_token_id", KV(1, GGUFValueType.UINT32)),
            ("tokenizer.ggml.eos_token_id", KV(2, GGUFValueType.UINT32)))


def write_text(path: Path, words: int, vocab_size: int) -> None:
    """Random three-letter words of the vocabulary (each one token), one space apart."""
    three = [t[1:] for t in vocabulary(vocab_size) if t.startswith("\u2581") and len(t) == 4]
    rng = np.random.default_rng(2)
    path.write_text(" ".join(three[i] for i in rng.integers(0, len(three), words)) + "\n")


# -- measurements -----------------------------------------------------------------------------------------------

class GpuMemoryPeak:
    """The most device memory ``nvidia-smi`` reports in use while the context is open (MiB, sampled every 50 ms)."""

    def __enter__(self):
        self.peak = 0
        self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                       "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            try:
                self.peak = max(self.peak, int(line.split()[0]))
            except (ValueError, IndexError):
                pass

    def __exit__(self, *exc):
        time.sleep(0.2)
        self._proc.terminate()
        self._proc.wait()


def idle_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def scored_tokens_per_s(model, seqs: list[list[int]], passes: int, batch: int) -> float:
    """quantkit score's own work on the same sequences: each a case whose first token is the prompt and whose
    other tokens are all targets (NLL, greedy match and first token at every position), ``passes`` passes' worth
    of cases through :func:`quantkit.scoring.score.run_cases` (forward passes of ``batch`` tokens, each scored on
    the host while the next runs); tokens/s of the whole run after a warm-up run, its last pass's scoring (not
    overlapped) included."""
    from quantkit.scoring.loading import RuntimeSource
    from quantkit.scoring.score import PreparedCase, run_cases
    from quantkit.scoring.source import ModelIdentity

    source = RuntimeSource(model, ModelIdentity())
    cases = [PreparedCase(f"c{k}-{i}", tuple(s[:1]), tuple(s[1:]), None)
             for k in range(passes) for i, s in enumerate(seqs)]
    run_cases(source, cases[:2 * len(seqs)], batch_tokens=batch)        # warm-up
    t0 = time.perf_counter()
    run_cases(source, cases, batch_tokens=batch)
    return sum(len(s) for s in seqs) * passes / (time.perf_counter() - t0)


def score_quantkit(path: Path, lengths: list[int], repeats: int, dtype: torch.dtype, vocab: int,
                   batch: int, second_half: bool = False, scored: int = 0) -> list[dict]:
    """Sequences of n tokens, ``max(1, batch // n)`` per forward pass (as llama-perplexity's ``-b`` packs chunks
    and ``quantkit score`` packs cases): tokens/s (all n tokens of each sequence, as llama-perplexity counts)
    over the median call; ``second_half``: logits of positions n/2.. only; ``scored`` passes (0: none): also
    :func:`scored_tokens_per_s` (logits and quantkit's scoring of them, as llama-perplexity's figure includes its
    NLL arithmetic)."""
    records = []
    model = load_model(path, device="cuda", dtype=dtype)
    try:
        for n in lengths:
            rng = np.random.default_rng(n)
            per_pass = max(1, batch // n)
            seqs = [rng.integers(3, vocab, size=n).tolist() for _ in range(per_pass)]
            first = n // 2 if second_half else 0
            logits_batch(model, seqs, first)    # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                logits_batch(model, seqs, first)
                times.append(time.perf_counter() - t0)
            records.append({"tokens": n, "sequences_per_pass": per_pass, "dtype": str(dtype).removeprefix("torch."),
                            "logits_from": first,
                            "tokens_per_s": n * per_pass / statistics.median(times), "seconds": times,
                            "peak_device_bytes": torch.cuda.max_memory_allocated(),
                            "payload_device_bytes": model.store.device_bytes})
            if scored:
                records[-1]["scored_tokens_per_s"] = scored_tokens_per_s(model, seqs, scored, batch)
            emit({"name": f"quantkit {path.stem} {n} {dtype}", **records[-1]})
    finally:
        model.close()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return records


_STAMP = r"(\d+)\.(\d+)\.(\d+)\.(\d+) I "


def _seconds(match, first: int) -> float:
    minutes, seconds, ms, us = (int(match.group(i)) for i in range(first, first + 4))
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def perplexity_speed(log: str) -> dict | None:
    """Tokens/s of a llama-perplexity run from its log's timestamps (``M.SS.mmm.uuu``; its perf summary is not
    printed at the default verbosity): ``tokens_per_s`` from the start of scoring to the final estimate (every
    pass, the first one's warm-up and the NLL arithmetic on the CPU included), ``steady_tokens_per_s`` without
    the first pass (the figure to compare with warmed-up quantkit calls)."""
    start = re.search(_STAMP + r"perplexity: calculating perplexity over (\d+) chunks, n_ctx=(\d+), "
                      r"batch_size=\d+, n_seq=(\d+)", log)
    first = re.search(r"perplexity: ([\d.]+) seconds per pass", log)
    end = re.search(_STAMP + r"Final estimate", log)
    if start is None or end is None or first is None:
        return None
    chunks, n_ctx, n_seq = int(start.group(5)), int(start.group(6)), int(start.group(7))
    total = _seconds(end, 1) - _seconds(start, 1)
    rec = {"chunks": chunks, "scored_tokens": chunks * n_ctx, "seconds": total,
           "tokens_per_s": chunks * n_ctx / total, "first_pass_s": float(first.group(1))}
    if chunks > n_seq and total > rec["first_pass_s"]:
        rec["steady_tokens_per_s"] = (chunks - n_seq) * n_ctx / (total - rec["first_pass_s"])
    return rec


def arrival_speed(stamped: list[tuple[float, str]]) -> dict | None:
    """:func:`perplexity_speed` from the times the output's lines reached the bench (the fallback when llama.cpp's
    logger loses its last lines at exit): scoring starts at the ``calculating perplexity`` line and ends at the
    ``Final estimate`` line, or at the last line seen."""
    text = "".join(line for _, line in stamped)
    start = next((t for t, line in stamped if "calculating perplexity over" in line), None)
    shape = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=\d+, n_seq=(\d+)", text)
    first = re.search(r"perplexity: ([\d.]+) seconds per pass", text)
    if start is None or shape is None or first is None:
        return None
    end = next((t for t, line in stamped if "Final estimate" in line), stamped[-1][0])
    chunks, n_ctx, n_seq = (int(shape.group(i)) for i in (1, 2, 3))
    total = end - start
    rec = {"chunks": chunks, "scored_tokens": chunks * n_ctx, "seconds": total, "clock": "arrival",
           "tokens_per_s": chunks * n_ctx / total, "first_pass_s": float(first.group(1))}
    if chunks > n_seq and total > rec["first_pass_s"]:
        rec["steady_tokens_per_s"] = (chunks - n_seq) * n_ctx / (total - rec["first_pass_s"])
    return rec


def _append(log: Path, cmd: list[str], output: str) -> None:
    """Every llama.cpp run's command line and output, one after another in one log."""
    with log.open("a") as f:
        f.write(f"==== {' '.join(cmd)}\n{output}\n")


def run_perplexity(binary: Path, path: Path, text: Path, n: int, log: Path) -> dict:
    """llama-perplexity's speed: its own log file (``--log-file``, prefix and timestamps on) parsed first; the
    arrival times of its output lines (read as they come) otherwise."""
    chunks = max(2, PERPLEXITY_TOKENS // n)
    own_log = log.with_name(f"{path.stem}-{n}.perplexity.log")
    cmd = [str(binary), "-m", str(path), "-f", str(text), "-c", str(n), "--chunks", str(chunks), "-ngl", "999",
           "-fa", "on", "--log-prefix", "--log-timestamps", "--log-file", str(own_log)]
    idle = idle_mib()
    stamped: list[tuple[float, str]] = []
    with GpuMemoryPeak() as mem:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            stamped.append((time.perf_counter(), line))
        code = proc.wait(timeout=300)
        wall = time.perf_counter() - t0
    output = "".join(line for _, line in stamped)
    own = own_log.read_text(errors="replace") if own_log.is_file() else ""
    own_log.unlink(missing_ok=True)     # kept in the one log: the device returns few files
    _append(log, cmd, output + "\n---- --log-file\n" + own)
    rec = None
    if code == 0:
        rec = perplexity_speed(own) or perplexity_speed(output) or arrival_speed(stamped)
    if rec is None:
        return {"tokens": n, "error": f"exit {code}, see {log.name}"}
    rec.update(tokens=n, wall_s=wall, peak_device_mib=mem.peak - idle)
    emit({"name": f"llama-perplexity {path.stem} {n}", **rec})
    return rec


def run_llama_bench(binary: Path, path: Path, lengths: list[int], log: Path) -> list[dict]:
    cmd = [str(binary), "-m", str(path), "-p", ",".join(map(str, lengths)), "-n", "0", "-ngl", "999",
           "-fa", "0,1", "-r", "3", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    _append(log, cmd, proc.stdout + proc.stderr)
    try:
        return [{"tokens": r["n_prompt"], "flash_attn": r["flash_attn"], "tokens_per_s": r["avg_ts"]}
                for r in json.loads(proc.stdout)]
    except (ValueError, KeyError, TypeError):     # a failed run: its log says why
        return []


# -- report -----------------------------------------------------------------------------------------------------

def markdown(results: dict, dtypes: list[str], second_half: bool = False) -> str:
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, commit {commit()}", "",
             "quantkit logits: " + ("positions N/2.. of each sequence (llama-perplexity's outputs)" if second_half
                                    else "every position's"), ""]
    for name, r in results.items():
        lines += [f"### {name}: {r['parameters'] / 1e9:.2f}B parameters, file {r['file_bytes'] / 2**30:.2f} GiB", "",
                  "| tokens x sequences per pass | " + " | ".join(f"quantkit {d} tok/s" for d in dtypes) +
                  " | llama-perplexity tok/s (steady; all passes) | " + " | ".join(f"ratio {d}" for d in dtypes) +
                  " | quantkit peak GiB (" + ", ".join(dtypes) + ") | llama.cpp peak GiB |",
                  "|---" * (3 + 2 * len(dtypes)) + "|---|"]
        ppl = {p["tokens"]: p for p in r.get("perplexity", [])}
        for n in r["lengths"]:
            ours = [next((q for q in r["quantkit"] if q["tokens"] == n and q["dtype"] == d), None) for d in dtypes]
            ref = ppl.get(n, {})
            ref_tps = ref.get("steady_tokens_per_s", ref.get("tokens_per_s"))
            cells = [(f"{q['tokens_per_s']:,.0f}" + (f" (scored {q['scored_tokens_per_s']:,.0f})"
                                                      if "scored_tokens_per_s" in q else "")) if q else "-"
                     for q in ours]
            ratios = [(f"{q['tokens_per_s'] / ref_tps:.2f}x" + (f" (scored {q['scored_tokens_per_s'] / ref_tps:.2f}x)"
                                                                 if "scored_tokens_per_s" in q else ""))
                      if q and ref_tps else "-" for q in ours]
            peaks = ", ".join(f"{q['peak_device_bytes'] / 2**30:.2f}" if q else "-" for q in ours)
            ref_peak = f"{ref['peak_device_mib'] / 1024:.2f}" if "peak_device_mib" in ref else ref.get("error", "-")
            ref_cell = f"{ref_tps:,.0f}; {ref['tokens_per_s']:,.0f}" if ref_tps else "-"
            per_pass = next((q["sequences_per_pass"] for q in ours if q), 1)
            lines.append(f"| {n} x {per_pass} | {' | '.join(cells)} | {ref_cell} | "
                         f"{' | '.join(ratios)} | {peaks} | {ref_peak} |")
        if r.get("llama_bench"):
            lines += ["", "llama-bench (last-position logits only): " + ", ".join(
                f"pp{b['tokens']} fa={int(b['flash_attn'])} {b['tokens_per_s']:,.0f} tok/s" for b in r["llama_bench"])]
        lines.append("")
    return "\n".join(lines)


def wait_for(build: subprocess.Popen, logs: Path) -> None:
    if build.wait() != 0:
        print((logs / "build.log").read_text()[-3000:], file=sys.stderr)
        sys.exit("llama.cpp build failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-src", type=Path)
    parser.add_argument("--build", type=Path, default=Path("/tmp/llama-build"))
    parser.add_argument("--jobs", type=int, default=14)
    parser.add_argument("--models", default="1b,7b", help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--long", default="", help="extra lengths scored on the --long-models only")
    parser.add_argument("--long-models", default="", help="comma-separated models the --long lengths run on "
                                                          "(default: the first of --models)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--float32-products", metavar="PRECISION",
                        help="Triton input_precision of the fused products for float32 activations (an A/B of "
                             "quantkit.kernels.triton_matmul.FLOAT32_PRECISION, e.g. tf32x3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2048,
                        help="tokens per forward pass for quantkit (llama-perplexity's -b default, which it uses)")
    parser.add_argument("--second-half", action="store_true",
                        help="quantkit returns the logits of positions N/2.. only, the ones llama-perplexity asks "
                             "for (default: every position's)")
    parser.add_argument("--scored", type=int, default=0, metavar="PASSES",
                        help="also time quantkit's own scoring of the logits (quantkit score's run_cases) over "
                             "this many passes")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--skip-llama-bench", action="store_true")
    parser.add_argument("--overlap-build", action="store_true",
                        help="time quantkit while llama.cpp builds (give the build fewer --jobs than cores)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/score-vs-llamacpp"))
    parser.add_argument("--logs", type=Path, default=Path("/tmp/score-vs-llamacpp/logs"))
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.tokens.split(",")]
    dtypes = args.dtypes.split(",")
    if args.float32_products:
        from quantkit.kernels import triton_matmul
        triton_matmul.FLOAT32_PRECISION = args.float32_products
    build = None
    if not args.skip_llama:
        if args.llama_src is None or shutil.which("cmake") is None:
            sys.exit("--llama-src and cmake are needed unless --skip-llama")
        targets = ("llama-perplexity",) if args.skip_llama_bench else ("llama-perplexity", "llama-bench")
        build = start_build(args.llama_src, args.build, args.jobs, args.logs / "build.log", targets)
    results = {}
    text = args.workdir / "text.txt"
    long = [int(n) for n in args.long.split(",") if n]
    long_models = args.long_models.split(",") if args.long_models else args.models.split(",")[:1]
    for name in args.models.split(","):
        config = MODELS[name]
        path = args.workdir / f"synthetic-{name}.gguf"
        t0 = time.perf_counter()
        params = write_synthetic(path, config, tokenizer_metadata(vocab_size(config)))
        emit({"name": f"wrote {path.name}", "parameters": params, "seconds": time.perf_counter() - t0})
        results[name] = {"path": path, "parameters": params, "file_bytes": path.stat().st_size,
                         "lengths": lengths + (long if name in long_models else []),
                         "quantkit": []}
    write_text(text, 2 * PERPLEXITY_TOKENS + 2 * max(lengths + long) + 1000, SYNTHETIC["vocab_size"])
    if build is not None and not args.overlap_build:     # quiet machine for the timings: the build finishes first
        wait_for(build, args.logs)
    for name, r in results.items():
        for d in dtypes:
            try:
                r["quantkit"] += score_quantkit(r["path"], r["lengths"], args.repeats, getattr(torch, d),
                                                vocab_size(MODELS[name]), args.batch, args.second_half, args.scored)
            except Exception as exc:  # noqa: BLE001 - one model's failure is reported; the others are measured
                emit({"name": f"quantkit {name} {d}", "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
                gc.collect()
                torch.cuda.empty_cache()
        if args.markdown:
            args.markdown.write_text(markdown(results, dtypes, args.second_half))
    if build is not None and args.overlap_build:
        wait_for(build, args.logs)
    for name, r in results.items():
        if build is not None:
            tools = args.build / "out" / "bin"
            r["perplexity"] = [run_perplexity(tools / "llama-perplexity", r["path"], text, n,
                                              args.logs / "llama.log") for n in r["lengths"]]
            if not args.skip_llama_bench:
                r["llama_bench"] = run_llama_bench(tools / "llama-bench", r["path"], lengths,
                                                   args.logs / "llama.log")
        if args.markdown:       # after each model: a run cut short keeps what it measured
            args.markdown.write_text(markdown(results, dtypes, args.second_half))
    print(markdown(results, dtypes, args.second_half))


if __name__ == "__main__":
    main()
