"""CPU scoring throughput: quantkit's runtime against llama-perplexity on the same GGUFs, threads and text.

    python bench/score_cpu_vs_llamacpp.py --llama-perplexity PATH [--threads 2] [--ctx 512] [--batch 2048]
        [--chunks 8] [--repeats 3] [--arithmetic float32] [--second-half] [--compare TREE] [--markdown OUT.md]

The bundled example (``quantkit/examples/tiny-moe``, a qwen3_moe) is converted by quantkit with the example
recipes ``tiny-moe-q4_k`` and ``tiny-moe-iq2xxs-w2q2k`` (bundled imatrix).  Both tools then score the same text
(the example's calibration text, repeated) in ``--chunks`` chunks of ``--ctx`` tokens, quantkit's logits at every
position (``--second-half``: of positions ctx/2.. only, what llama-perplexity computes and what ``quantkit score``'s
KLD chunks ask for), ``--batch / --ctx`` chunks per forward pass (llama-perplexity's ``-b``; quantkit's ``logits_batch``).  Each
measurement is a child process, quantkit and llama-perplexity interleaved over ``--repeats`` rounds:

- llama-perplexity: tokens/s of the chunk loop, from the walls of two runs (one pass of chunks, and one pass +
  ``--chunks``), and the process wall of the longer one;
- quantkit: ``load_model`` + one untimed warm-up chunk (numba caches, first-use checks, as llama's warm-up), then
  the timed chunks through :func:`quantkit.runtime.logits` (log-softmax included), and the process wall.

``--compare TREE`` (repeatable): another checkout's quantkit measured the same way in every round, so a change's
ratios before and after come from one run (these machines drift between runs).  Each quantkit child also reports the
mean NLL of its warm-up pass (the same text and positions for every tree).

Ratio = quantkit tokens/s / llama-perplexity tokens/s of the same round; medians over rounds.  The wall ratio
(llama-perplexity's process wall / quantkit's) includes start-up: imports, load, tokenization, warm-up.  Prints one JSON
object per measurement and a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import commit, emit, machine
from runtime_cpu import EXAMPLES, MODELS, convert

REPO = Path(__file__).resolve().parent.parent
#: The example's GGUFs of the runtime bench (its checkpoint entry aside: llama-perplexity reads GGUFs only).
GGUFS = [(label, recipe, extra) for label, recipe, extra in MODELS if recipe is not None]

#: The quantkit child: prints "<NLL> <tokens> <seconds>": the mean NLL of the warm-up pass's positions, then the
#: timed chunks.
CHILD = r"""
import os, sys, time
import numpy as np, torch
from tokenizers import Tokenizer
from quantkit.resources import keep_budget
from quantkit.runtime import load_model, logits_batch
gguf, text, ctx, chunks, threads, arithmetic = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
per_pass, first = int(sys.argv[8]), int(sys.argv[9])
torch.set_num_threads(threads)
ids = Tokenizer.from_file(sys.argv[7]).encode(open(text).read()).ids
model = load_model(gguf, arithmetic=arithmetic, keep_bytes=keep_budget())   # as quantkit score loads it on the CPU
def score(chunk):
    seqs = [ids[c * ctx:(c + 1) * ctx] for c in range(chunk, chunk + per_pass)]
    return seqs, [torch.log_softmax(torch.from_numpy(out), -1) for out in logits_batch(model, seqs, first=first)]
seqs, logprobs = score(0)
nll = [-lp[:-1].gather(1, torch.tensor(s[first + 1:])[:, None]) for s, lp in zip(seqs, logprobs)]
t0 = time.perf_counter()
for chunk in range(0, chunks, per_pass):
    score(chunk)
print(float(torch.cat(nll).mean()), chunks * ctx, time.perf_counter() - t0, flush=True)
os._exit(0)     # as the command ends (quantkit.cli.run): without torch's interpreter teardown
"""


def run_llama(binary: str, gguf: Path, text: Path, args) -> tuple[float, float]:
    """(tokens/s of the chunk loop, wall of the whole run): two runs, of 1 and of 1 + ``--chunks`` chunks.

    The difference of their walls is the time of ``--chunks`` chunks (load, tokenization and warm-up cancel out);
    llama.cpp's own log stamps cannot be used, as its asynchronous logger may lose the last line at exit.
    """
    walls = []
    per_pass = args.batch // args.ctx
    for chunks in (per_pass, per_pass + args.chunks):
        t0 = time.perf_counter()
        done = subprocess.run([binary, "-m", str(gguf), "-f", str(text), "-c", str(args.ctx), "-b", str(args.batch),
                               "--chunks", str(chunks), "-t", str(args.threads), "-tb", str(args.threads)],
                              capture_output=True, text=True,
                              env={**os.environ, "LD_LIBRARY_PATH": str(Path(binary).resolve().parent)})
        walls.append(time.perf_counter() - t0)
        if done.returncode != 0:
            raise SystemExit(f"llama-perplexity failed on {gguf} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return args.chunks * args.ctx / (walls[1] - walls[0]), walls[1]


def run_quantkit(gguf: Path, text: Path, args, tree: Path = REPO) -> tuple[float, float, float]:
    """(tokens/s of the timed chunks, process wall, mean NLL of the warm-up pass) with ``tree``'s quantkit."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(gguf), str(text), str(args.ctx), str(args.chunks),
                           str(args.threads), args.arithmetic, str(EXAMPLES / "tiny-moe" / "tokenizer.json"),
                           str(args.batch // args.ctx), str(args.ctx // 2 if args.second_half else 0)],
                          capture_output=True, text=True, cwd=tree,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(tree)})
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"quantkit ({tree}) failed on {gguf}:\n{done.stderr[-2000:]}")
    nll, tokens, seconds = done.stdout.split()[-3:]
    return int(tokens) / float(seconds), wall, float(nll)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-perplexity", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=None,
                        help="tokens per forward pass of both tools (llama-perplexity -b): batch / ctx chunks run "
                             "together; a multiple of --ctx dividing --chunks x --ctx (default --ctx)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arithmetic", default="float32", choices=("float32", "ggml-cpu"))
    parser.add_argument("--second-half", action="store_true",
                        help="quantkit's logits of positions ctx/2.. only (llama-perplexity's outputs)")
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="another checkout (a directory holding quantkit/): its quantkit scores the same GGUFs in "
                             "each round too, interleaved with this tree's and llama-perplexity's")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    args.batch = args.batch or args.ctx
    if args.batch % args.ctx or args.chunks % (args.batch // args.ctx):
        parser.error("--batch must be a multiple of --ctx, and --chunks a multiple of --batch / --ctx")
    with tempfile.TemporaryDirectory(prefix="qk-score-cpu-") as tmp:
        workdir = Path(tmp)
        text = workdir / "text.txt"
        base = (EXAMPLES / "tiny-moe-text" / "calibration.txt").read_text()
        text.write_text(base * max(1, 4 * (args.chunks + 1) * args.ctx // max(1, len(base) // 4)))
        models = [(label, convert(recipe, extra, workdir / f"{recipe}.gguf")) for label, recipe, extra in GGUFS]
        rows = []
        trees = [REPO, *args.compare]
        for label, gguf in models:
            samples = {tool: {"tok_s": [], "wall": [], "ratio": [], "nll": []} for tool in ["llama", *trees]}
            for round_no in range(args.repeats):
                order = ["llama", *trees]
                if round_no % 2:
                    order.reverse()
                measured = {}
                for tool in order:
                    if tool == "llama":
                        measured[tool] = run_llama(args.llama_perplexity, gguf, text, args)
                    else:
                        measured[tool] = run_quantkit(gguf, text, args, tool)
                    emit({"bench": "score_cpu_vs_llamacpp", "model": label, "round": round_no,
                          "tool": "llama" if tool == "llama" else "quantkit", "tree": str(tool),
                          "tokens_per_s": measured[tool][0], "wall_s": measured[tool][1],
                          "nll": measured[tool][2] if tool != "llama" else None, "threads": args.threads,
                          "ctx": args.ctx, "batch": args.batch, "chunks": args.chunks, "arithmetic": args.arithmetic,
                          "load_avg": os.getloadavg()[0]})
                for tool, (tok_s, wall, *nll) in measured.items():
                    samples[tool]["tok_s"].append(tok_s)
                    samples[tool]["wall"].append(wall)
                    samples[tool]["ratio"].append(tok_s / measured["llama"][0])
                    samples[tool]["nll"].extend(nll)
            rows.append((label, {tool: {k: statistics.median(v) if v else None for k, v in m.items()}
                                 for tool, m in samples.items()}))
    lines = [f"{machine()}, commit {commit()}, {args.threads} threads, ctx {args.ctx}, batch {args.batch}, "
             f"{args.chunks} chunks, "
             f"arithmetic {args.arithmetic}, quantkit logits of "
             f"{'positions ctx/2..' if args.second_half else 'every position'}, "
             f"medians of {args.repeats} interleaved rounds",
             "", "| model | tree | llama-perplexity tok/s | quantkit tok/s | ratio | llama wall s | quantkit wall s | "
                 "wall ratio | NLL |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, m in rows:
        llama = m["llama"]
        for tree in trees:
            q = m[tree]
            lines.append(f"| {label} | {'this' if tree == REPO else tree} | {llama['tok_s']:,.0f} | "
                         f"{q['tok_s']:,.0f} | {q['ratio']:.2f} | {llama['wall']:.2f} | {q['wall']:.2f} | "
                         f"{llama['wall'] / q['wall']:.2f} | {q['nll']:.6f} |")
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
