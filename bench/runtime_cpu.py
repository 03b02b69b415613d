"""Scoring throughput of the bundled example model through the CPU runtime: a git revision against the work tree.

    python bench/runtime_cpu.py [--before 3ac5239] [--repeats 5] [--workdir /tmp]

Scores ``quantkit/examples/tiny-moe`` on its bundled fixture (``quantkit.scoring``: every case's prompt +
continuation in one forward pass, ``--ctx 512``) with the runtime of revision ``--before`` (its ``quantkit/``
extracted with ``git archive``) and with the work tree's, each in a child process (``PYTHONPATH`` picks the tree),
interleaved A/B, B/A over ``--repeats`` rounds after one untimed warm-up per tree (numba compiles its caches).
Models: the BF16 safetensors checkpoint (``CheckpointWeights``, payloads assembled once and cached) and two GGUFs
converted from it by the work tree (recipes ``tiny-moe-q4_k`` and ``tiny-moe-iq2xxs-w2q2k`` with the bundled
imatrix), the same files for both trees.

Each child loads the model, then scores the fixture twice: the first pass pays each payload's first use (a
checkpoint's assembly, the finiteness check), the second is the steady state.  Every logits array of every pass
is hashed (SHA-256 of its float32 bytes, in case order): the two trees must give the same digest (checked here).
Prints one JSON object per measurement (``_common.emit``), medians per tree, and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import emit

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "quantkit" / "examples"
SCORE_CTX = 512
#: (label, recipe under quantkit/examples/recipes, extra convert arguments); None: the checkpoint itself.
MODELS = (
    ("checkpoint (BF16)", None, ()),
    ("Q4_K GGUF", "tiny-moe-q4_k", ()),
    ("IQ2_XXS/Q2_K GGUF", "tiny-moe-iq2xxs-w2q2k", ("--imatrix", str(EXAMPLES / "tiny-moe.imatrix.gguf"))),
)
PASSES = 2

# Runs in the child, with PYTHONPATH naming the tree under test.
DRIVER = r"""
import hashlib, json, sys, time
import numpy as np
import quantkit
from quantkit.fixtures.directory import read_fixture
from quantkit.scoring.loading import describe_model, load_source
from quantkit.scoring.score import plan_scoring, run_cases

model, fixture, ctx, passes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
codec, identity = describe_model(model)
plan = plan_scoring(read_fixture(fixture), codec, identity, ctx=ctx)
t0 = time.perf_counter()
source = load_source(identity)
load_s = time.perf_counter() - t0

class Hashed:
    def __init__(self, inner):
        self.inner, self.digest = inner, hashlib.sha256()
    def identity(self):
        return self.inner.identity()
    def logits(self, ids):
        out = self.inner.logits(ids)
        self.digest.update(np.ascontiguousarray(out, np.float32).tobytes())
        return out

seconds, digests, nll = [], [], None
for _ in range(passes):
    hashed = Hashed(source)
    t0 = time.perf_counter()
    scores, _ = run_cases(hashed, plan.cases)
    seconds.append(time.perf_counter() - t0)
    digests.append(hashed.digest.hexdigest())
    nll = sum(s.nll for s in scores) / sum(s.target_tokens for s in scores)
source.close()
tokens = sum(len(c.prompt_ids) + len(c.target_ids) for c in plan.cases)
print(json.dumps({"quantkit": quantkit.__file__, "load_s": load_s, "pass_s": seconds, "digests": digests,
                  "cases": len(plan.cases), "tokens": tokens, "avg_nll": nll}))
"""


def extract(revision: str, root: Path) -> Path:
    """``quantkit/`` of ``revision`` under ``root`` (a tree to put on PYTHONPATH)."""
    root.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "quantkit"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def convert(recipe: str, extra: tuple[str, ...], out: Path) -> Path:
    exe = Path(sys.executable).with_name("quantkit")
    subprocess.run([str(exe), "convert", str(EXAMPLES / "tiny-moe"), "-o", str(out), "--recipe",
                    str(EXAMPLES / "recipes" / f"{recipe}.toml"), "--label", "tiny-moe-v1", "--pre-tokenizer",
                    "qwen35", "--no-progress", "--force", *extra], check=True, stdout=subprocess.DEVNULL)
    return out


def run_child(tree: Path, model: Path, passes: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(model), str(EXAMPLES / "tiny-moe-fixture"),
                           str(SCORE_CTX), str(passes)], env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"scoring with {tree} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["quantkit"].startswith(str(tree)):
        raise SystemExit(f"the child imported {result['quantkit']}, not the tree {tree}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="3ac5239", help="git revision whose runtime is the baseline")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="quantkit-bench-runtime-", dir=args.workdir))
    try:
        trees = {"before": extract(args.before, work / "before"), "after": REPO}
        models = {}
        for label, recipe, extra in MODELS:
            models[label] = EXAMPLES / "tiny-moe" if recipe is None else convert(recipe, extra,
                                                                                 work / f"{recipe}.gguf")
        for tree in trees.values():        # numba compiles (or loads) each tree's kernels once, untimed
            run_child(tree, models[MODELS[1][0]], 1)
        runs = {(label, which): [] for label in models for which in trees}
        for r in range(args.repeats):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for label, model in models.items():
                for which in order:
                    runs[label, which].append(run_child(trees[which], model, PASSES))
        rows = []
        for label in models:
            summary = {}
            for which in trees:
                got = runs[label, which]
                summary[which] = {"first_pass_s": statistics.median(g["pass_s"][0] for g in got),
                                  "steady_pass_s": statistics.median(g["pass_s"][-1] for g in got),
                                  "load_s": statistics.median(g["load_s"] for g in got),
                                  "steady_pass_s_all": [g["pass_s"][-1] for g in got]}
            digests = {d for which in trees for g in runs[label, which] for d in g["digests"]}
            first = runs[label, "after"][0]
            record = {"name": f"runtime cpu scoring: {label}", "before": args.before, "cases": first["cases"],
                      "tokens": first["tokens"], "avg_nll": first["avg_nll"], "repeats": args.repeats,
                      **{f"{which}_{k}": v for which in trees for k, v in summary[which].items()},
                      "steady_speedup": summary["before"]["steady_pass_s"] / summary["after"]["steady_pass_s"],
                      "first_speedup": summary["before"]["first_pass_s"] / summary["after"]["first_pass_s"],
                      "logits_identical": len(digests) == 1}
            emit(record)
            rows.append(record)
            if len(digests) != 1:
                raise SystemExit(f"{label}: logits differ between {args.before} and the work tree")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'model':<22}{'tokens':>8}{'steady before':>15}{'after':>8}{'speedup':>9}{'tok/s after':>13}"
          f"{'first before':>14}{'after':>8}{'identical':>11}")
    for r in rows:
        print(f"{r['name'].split(': ', 1)[1]:<22}{r['tokens']:>8}{r['before_steady_pass_s']:>14.2f}s"
              f"{r['after_steady_pass_s']:>7.2f}s{r['steady_speedup']:>8.2f}x"
              f"{r['tokens'] / r['after_steady_pass_s']:>13.0f}{r['before_first_pass_s']:>13.2f}s"
              f"{r['after_first_pass_s']:>7.2f}s{str(r['logits_identical']):>11}")


if __name__ == "__main__":
    main()
