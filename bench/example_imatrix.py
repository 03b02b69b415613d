"""Does the imatrix-calibrated IQ2_XXS recipe beat the bootstrap one on the bundled example model?  (issue 7, item 3)

Measures, on the bundled ``tiny-moe`` and the example's Q2-class recipe (``tiny-moe-iq2xxs-w2q2k``: routed gate/up
IQ2_XXS, routed down Q2_K, Q8_0 elsewhere), the paired NLL difference of three artifacts:

``Q2-bootstrap``    ``--bootstrap-importance`` (no calibration text)
``Q2-imatrix``      the bundled imatrix (``quantkit/examples/tiny-moe.imatrix.gguf``, 364 chunks of 256 tokens of
                    ``tarfile.py`` + ``difflib.py``)
``Q2-imatrix-2x``   the bundled imatrix merged (``quantkit imatrix merge``) with one collected the same way
                    (``quantkit imatrix collect --ctx 256``) on :data:`EXTRA_CALIBRATION_FILES`: about twice the
                    calibration tokens

scored (``quantkit score --ctx 512``) on two fixtures of held-out text: the bundled 100-case fixture, and a new one
of :data:`HELD_OUT_CASES` prompts drawn from :data:`HELD_OUT_PROMPT_FILES` exactly as the training script draws the
bundled prompts (``prompt_snippets``), captured from the checkpoint exactly as the bundled fixture was
(``scripts/train_example_model.py``'s ``capture``: ``quantkit.fixtures.capture.capture_fixture`` with transformers
in float32 as the logit source; ``quantkit fixture capture`` runs the packed runtime without a KV cache, ~20 s a
case on the shared 2-core machine).  Every file used here is a Python 3.11 standard-library file that is in none of
the training script's lists (never trained on, not the bundled calibration or prompt text), and the extra
calibration files and the new prompt files are disjoint.

For each pair, on each fixture and on both pooled (per-case deltas of both fixtures as one sample of cases):
the token-weighted NLL delta (new - old) and ``quantkit compare``'s paired whole-prompt bootstrap 95% interval
(:func:`quantkit.scoring.compare.bootstrap_interval`, 10,000 resamples) for seeds 0-9, case wins/losses, the exact
two-sided sign test and the Wilcoxon signed-rank test on the per-case NLL deltas (exact distribution; normal
approximation with tie correction if any |delta| ties).

    python bench/example_imatrix.py [--work DIR] [--cases N]

Artifacts go to ``--work`` (default ``/tmp/quantkit-example-imatrix``); a step whose output exists is skipped, so
an interrupted run resumes.  Prints Markdown tables and the commands with their wall times.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantkit import examples  # noqa: E402
from quantkit.scoring.compare import bootstrap_interval, verdict  # noqa: E402
from quantkit.scoring.table import read_table  # noqa: E402

#: Held-out stdlib files added to the bundled calibration text (~95k tokens, as much as the bundled text).
EXTRA_CALIBRATION_FILES = ("_pyio.py", "asyncio/unix_events.py", "xmlrpc/client.py")
#: Held-out stdlib files the new fixture's prompts come from.
#: (Case ids are ``<file stem>-<line>``: stems must be unique and must not start with an underscore.)
HELD_OUT_PROMPT_FILES = ("multiprocessing/managers.py", "asyncio/selector_events.py", "logging/config.py",
                         "xmlrpc/server.py", "multiprocessing/pool.py", "multiprocessing/connection.py",
                         "email/header.py", "xml/dom/expatbuilder.py", "aifc.py", "lib2to3/pytree.py",
                         "lib2to3/refactor.py", "telnetlib.py", "wsgiref/handlers.py")
HELD_OUT_CASES = 200
RECIPE = "tiny-moe-iq2xxs-w2q2k"
IMATRIX_CTX = 256          # as the bundled imatrix (train_example_model.IMATRIX_CTX)
SCORE_CTX = 512            # as the bundled measurements (train_example_model.SCORE_CTX)
SEEDS = range(10)
RESAMPLES = 10_000
#: (old, new) artifact pairs compared.
PAIRS = (("Q2-bootstrap", "Q2-imatrix"), ("Q2-bootstrap", "Q2-imatrix-2x"), ("Q2-imatrix", "Q2-imatrix-2x"))
#: Largest n for the exact Wilcoxon distribution (the DP is O(n^3) in floats).
EXACT_WILCOXON_MAX = 2000


def training_script():
    spec = importlib.util.spec_from_file_location("train_example_model", REPO / "scripts" / "train_example_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_held_out(script) -> None:
    """The files used here are in none of the training script's lists, and the two new lists are disjoint."""
    used = {*script.TRAIN_FILES, *script.EVAL_FILES, *script.CALIBRATION_FILES, *script.PROMPT_FILES}
    ours = (*EXTRA_CALIBRATION_FILES, *HELD_OUT_PROMPT_FILES)
    clash = sorted(used.intersection(ours)) + sorted(set(EXTRA_CALIBRATION_FILES) & set(HELD_OUT_PROMPT_FILES))
    if clash or len(set(ours)) != len(ours):
        raise SystemExit(f"not held-out or not disjoint: {clash}")


LOG: list[str] = []


def run_quantkit(args: list[str], cwd: Path = REPO) -> str:
    started = time.monotonic()
    exe = Path(sys.executable).with_name("quantkit")
    done = subprocess.run([str(exe), *args], cwd=cwd, check=True, stdout=subprocess.PIPE, text=True)
    LOG.append(f"$ quantkit {' '.join(args)}  ({time.monotonic() - started:.0f} s)")
    print(LOG[-1], flush=True)
    return done.stdout


# -- inputs -----------------------------------------------------------------------------------------------------------

def larger_imatrix(script, work: Path) -> Path:
    text = work / "extra-calibration.txt"
    text.write_text("".join(t.rstrip("\n") + "\n\n" for t in script.corpus_text(EXTRA_CALIBRATION_FILES)),
                    encoding="utf-8")
    extra, merged = work / "extra.imatrix.gguf", work / "tiny-moe-2x.imatrix.gguf"
    if not extra.exists():
        run_quantkit(["imatrix", "collect", str(examples.example_model_dir()), "--text", str(text), "--ctx",
                      str(IMATRIX_CTX), "--no-progress", "-o", str(extra)])
    if not merged.exists():
        run_quantkit(["imatrix", "merge", str(examples.example_imatrix()), str(extra), "-o", str(merged)])
    return merged


def held_out_fixture(script, work: Path, cases: int) -> Path:
    """``cases`` prompts from HELD_OUT_PROMPT_FILES by the script's own selection, captured as the bundled fixture."""
    out = work / f"held-out-fixture-{cases}"
    if out.exists():
        return out
    prompts = work / f"held-out-prompts-{cases}.jsonl"
    bundled_files = script.PROMPT_FILES
    script.PROMPT_FILES = HELD_OUT_PROMPT_FILES          # prompt_snippets reads the module's list
    try:
        snippets = script.prompt_snippets(cases)
    finally:
        script.PROMPT_FILES = bundled_files
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in snippets), encoding="utf-8")
    started = time.monotonic()
    script.capture(examples.example_model_dir(), prompts, out)
    LOG.append(f"capture {len(snippets)} held-out prompts -> {out.name}  ({time.monotonic() - started:.0f} s)")
    print(LOG[-1], flush=True)
    return out


def artifacts(work: Path, imatrix_2x: Path) -> dict[str, Path]:
    recipe = str(examples.example_recipe(RECIPE))
    variants = {"Q2-bootstrap": ["--bootstrap-importance"],
                "Q2-imatrix": ["--imatrix", str(examples.example_imatrix())],
                "Q2-imatrix-2x": ["--imatrix", str(imatrix_2x)]}
    made = {}
    for name, extra in variants.items():
        made[name] = work / f"tiny-moe-{name}.gguf"
        if not made[name].exists():
            run_quantkit(["convert", str(examples.example_model_dir()), "-o", str(made[name]), "--recipe", recipe,
                          "--label", examples.FIXTURE_LABEL, "--pre-tokenizer", examples.PRE_TOKENIZER,
                          "--no-progress", "-j", "1", *extra])
    return made


def score(artifact: Path, fixture: Path, fixture_name: str, work: Path):
    table = work / f"{artifact.stem}.{fixture_name}.tsv"
    if not table.exists():
        run_quantkit(["score", str(artifact), str(fixture), str(table), "--ctx", str(SCORE_CTX)])
    return read_table(table)


# -- statistics -------------------------------------------------------------------------------------------------------

def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided binomial test of wins vs losses at p = 1/2 (ties dropped)."""
    n, k = wins + losses, min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def wilcoxon(deltas: np.ndarray) -> tuple[float, float]:
    """Wilcoxon signed-rank test, two-sided: ``(W+, p)`` (zeros dropped; average ranks for ties)."""
    d = deltas[deltas != 0]
    n = len(d)
    order = np.argsort(np.abs(d), kind="stable")
    ranks = np.empty(n)
    ranks[order] = np.arange(1, n + 1)
    absd = np.abs(d)
    tied = False
    for value in np.unique(absd):                       # average ranks of tied |delta|
        where = absd == value
        if where.sum() > 1:
            ranks[where] = ranks[where].mean()
            tied = True
    w_plus = float(ranks[d > 0].sum())
    if not tied and n <= EXACT_WILCOXON_MAX:
        total = n * (n + 1) // 2
        dist = np.zeros(total + 1)
        dist[0] = 1.0
        for r in range(1, n + 1):                     # P(W+ = s) with each rank in W+ with probability 1/2
            dist[r:] = 0.5 * dist[r:] + 0.5 * dist[:-r]
            dist[:r] *= 0.5
        w = int(round(w_plus))
        p = 2 * min(dist[:w + 1].sum(), dist[w:].sum())
        return w_plus, min(1.0, float(p))
    mean = n * (n + 1) / 4
    _, counts = np.unique(absd, return_counts=True)
    var = n * (n + 1) * (2 * n + 1) / 24 - (counts ** 3 - counts).sum() / 48
    z = (w_plus - mean) / math.sqrt(var)
    return w_plus, math.erfc(abs(z) / math.sqrt(2))


def paired(old_tables, new_tables) -> dict:
    """Statistics of new vs old over the cases of every (old, new) table pair, pooled."""
    nll_old = np.concatenate([[round(s.nll, 9) for s in t.scores] for t in old_tables])
    nll_new = np.concatenate([[round(s.nll, 9) for s in t.scores] for t in new_tables])
    tokens = np.concatenate([[s.target_tokens for s in t.scores] for t in old_tables])
    for old, new in zip(old_tables, new_tables):
        if [s.id for s in old.scores] != [s.id for s in new.scores] or old.fixture_sha256 != new.fixture_sha256:
            raise SystemExit("tables not paired")
    delta = float((nll_new - nll_old).sum() / tokens.sum())
    intervals = [bootstrap_interval(nll_old, nll_new, tokens, resamples=RESAMPLES, seed=s) for s in SEEDS]
    d = nll_new - nll_old
    wins, losses = int((d < 0).sum()), int((d > 0).sum())
    w_plus, p_wilcoxon = wilcoxon(d)
    return {"cases": len(d), "tokens": int(tokens.sum()), "delta": delta, "intervals": intervals,
            "verdicts": [verdict(delta, lo, hi) for lo, hi in intervals], "wins": wins, "losses": losses,
            "p_sign": sign_test(wins, losses), "w_plus": w_plus, "p_wilcoxon": p_wilcoxon,
            "relative": delta / float(nll_old.sum() / tokens.sum())}


def row(where: str, pair: tuple[str, str], s: dict) -> str:
    lows, highs = [lo for lo, _ in s["intervals"]], [hi for _, hi in s["intervals"]]
    better = sum(v == "better" for v in s["verdicts"])
    seed0 = s["intervals"][0]
    return (f"| {where} | {pair[0]} -> {pair[1]} | {s['cases']} | {s['tokens']} | {s['delta']:+.6f} "
            f"({100 * s['relative']:+.3f}%) | [{seed0[0]:+.6f}, {seed0[1]:+.6f}] | "
            f"{min(highs):+.6f} .. {max(highs):+.6f} | {min(lows):+.6f} .. {max(lows):+.6f} | {better}/{len(SEEDS)} | "
            f"{s['wins']}/{s['losses']} | {s['p_sign']:.3g} | {s['p_wilcoxon']:.3g} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/quantkit-example-imatrix"))
    parser.add_argument("--cases", type=int, default=HELD_OUT_CASES, help="cases of the held-out fixture")
    args = parser.parse_args(argv)
    import torch

    script = training_script()
    torch.set_num_threads(script.TORCH_THREADS)      # the capture's float rounding, as the bundled fixture's
    check_held_out(script)
    args.work.mkdir(parents=True, exist_ok=True)
    imatrix_2x = larger_imatrix(script, args.work)
    fixtures = {"bundled": examples.example_fixture_dir(), "held-out": held_out_fixture(script, args.work, args.cases)}
    made = artifacts(args.work, imatrix_2x)
    tables = {(a, f): score(path, fixture, f, args.work)
              for a, path in made.items() for f, fixture in fixtures.items()}

    print("\n| artifact | fixture | cases | tokens | avg NLL | first match | avg greedy prefix | API top-1 | "
          "target MAE |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (a, f), t in tables.items():
        tot, api = t.totals, t.totals.api
        print(f"| {a} | {f} | {tot.cases} | {tot.tokens} | {tot.avg_nll:.6f} | {tot.first_matches}/{tot.cases} | "
              f"{tot.avg_lcp:.2f} | {api.top1_match}/{api.top1_count} | "
              f"{api.target_abs_delta / api.target_count:.6f} |")
    print("\n| fixture | old -> new | cases | tokens | NLL delta | 95% CI, seed 0 | CI upper, seeds 0-9 | "
          "CI lower, seeds 0-9 | 'better' seeds | wins/losses | sign test p | Wilcoxon p |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for pair in PAIRS:
        for where, names in (("bundled", ["bundled"]), ("held-out", ["held-out"]),
                             ("pooled", ["bundled", "held-out"])):
            s = paired([tables[pair[0], f] for f in names], [tables[pair[1], f] for f in names])
            print(row(where, pair, s))
    print("\n```\n" + "\n".join(LOG) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
