"""Fixture capture through the runtime: greedy generation with the KV cache vs the uncached path.

``python bench/fixture_capture.py example [--timed 20] [--cases 100] [--tokens 24]``
    The bundled example model (:mod:`quantkit.examples`) loaded by the runtime, as ``quantkit fixture capture``
    loads it, captures its fixture prompts with the bundled fixture's settings.  The first ``--timed`` prompts are
    captured both ways, A/B interleaved (the order alternates per prompt), and timed; every one of the first
    ``--cases`` cached captures is compared with the bundled fixture (captured through plain transformers, float32):
    continuation text equal, and the largest log-probability difference of the cases that are equal.

``python bench/fixture_capture.py archs``
    The tiny model of each architecture (float32 checkpoint): cached vs uncached greedy tokens and the largest
    logits difference on the test's prompt (122 tokens + 10 generated, crossing every sparse path), with times.

One JSON object per measurement, then a short table.  torch runs one thread (the machine is shared).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

ARCHS = ("deepseek_v3", "deepseek_v4", "glm5_next", "qwen3_moe", "qwen4_exp")
ARCH_PROMPT, ARCH_NEW = 122, 10          # as tests/test_fixtures.py: GREEDY_PROMPT, GREEDY_NEW


class LogitsOnly:
    """The source's ``logits`` and ``identity`` without its ``generate``: capture's uncached path."""

    def __init__(self, source):
        self.logits, self.identity = source.logits, source.identity


def _max_logprob_diff(a, b) -> float:
    diffs = [abs(p.logprob - q.logprob) for p, q in zip(a.response, b.response)]
    diffs += [abs(x.logprob - y.logprob) for p, q in zip(a.response, b.response) for x, y in zip(p.top, q.top)]
    return max(diffs, default=0.0)


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def example(timed: int, n_cases: int, tokens: int) -> None:
    from quantkit import examples
    from quantkit.fixtures.capture import capture_case, read_prompts
    from quantkit.fixtures.directory import read_fixture
    from quantkit.scoring.loading import describe_model, load_source
    from quantkit.scoring.source import GeneratingSource

    bundled = read_fixture(examples.example_fixture_dir())
    top = bundled.info.capture["top_logprobs"]
    codec, identity = describe_model(examples.example_model_dir())
    source = load_source(identity)
    if not isinstance(source, GeneratingSource):
        raise SystemExit("the runtime source has no generate(): nothing to compare")
    prompts = read_prompts(examples.example_prompts())[:n_cases]
    expected = {c.id: c for c in bundled.cases}
    seconds = {"cached": 0.0, "uncached": 0.0}
    matches, same_paths, rows = 0, 0, []
    try:
        capture_case(source, codec, *prompts[0], tokens=2, top_logprobs=top, rendering=bundled.rendering)  # warm-up
        for i, (case_id, prompt) in enumerate(prompts):
            kinds = ("cached", "uncached") if i < timed else ("cached",)
            got, took = {}, {}
            for kind in (kinds if i % 2 == 0 else kinds[::-1]):
                t0 = time.perf_counter()
                got[kind] = capture_case(source if kind == "cached" else LogitsOnly(source), codec, case_id, prompt,
                                         tokens=tokens, top_logprobs=top, rendering=bundled.rendering)
                took[kind] = time.perf_counter() - t0
                if i < timed:
                    seconds[kind] += took[kind]
            case, ref = got["cached"], expected[case_id]
            equal = case.continuation == ref.continuation
            matches += equal
            record = {"name": "capture_case", "case": case_id, "prompt_tokens": len(codec.render(prompt,
                      bundled.rendering)), "tokens": len(case.response), "bundled_tokens": len(ref.response),
                      "matches_bundled": equal, **{f"{kind}_s": t for kind, t in took.items()}}
            if "uncached" in got:
                record["paths_equal"] = got["uncached"] == case
            if equal:
                record["max_logprob_diff"] = _max_logprob_diff(case, ref)
            else:
                record["first_difference_char"] = _first_difference(case.continuation, ref.continuation)
                record["ours"], record["bundled"] = case.continuation, ref.continuation
            same_paths += record.get("paths_equal", False)
            rows.append(record)
            emit(record)
    finally:
        source.close()
    timed_tokens = sum(r["tokens"] for r in rows[:timed])
    summary = {"name": "capture_example", "timed_prompts": timed, "tokens": tokens, "timed_target_tokens": timed_tokens,
               "cached_s": seconds["cached"], "uncached_s": seconds["uncached"],
               "speedup": seconds["uncached"] / seconds["cached"], "paths_equal": f"{same_paths}/{timed}",
               "cases": len(prompts), "matches_bundled": matches,
               "max_logprob_diff_matching": max((r["max_logprob_diff"] for r in rows if "max_logprob_diff" in r),
                                                default=None)}
    emit(summary)
    print(f"\n| prompts | cached s | uncached s | speedup | cached == uncached |\n|---:|---:|---:|---:|---:|\n"
          f"| {timed} x {tokens} tokens | {seconds['cached']:.1f} | {seconds['uncached']:.1f} | "
          f"{summary['speedup']:.2f}x | {same_paths}/{timed} |")
    print(f"\ncached capture == bundled fixture continuation: {matches}/{len(prompts)}; largest log-probability "
          f"difference on matching cases {summary['max_logprob_diff_matching']}")


def archs() -> None:
    from quantkit.runtime import greedy, load_model
    from quantkit.testing.tiny_models import save_tiny_checkpoint

    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 480, ARCH_PROMPT)]
    table = []
    with tempfile.TemporaryDirectory(prefix="quantkit-bench-") as tmp:
        for arch in ARCHS:
            model = load_model(save_tiny_checkpoint(arch, Path(tmp) / arch, "per-expert", "f32"))
            try:
                greedy(model, prompt[:8], 2)                                      # warm-up
                results, times = {}, {}
                for use_cache in (True, False):
                    t0 = time.perf_counter()
                    results[use_cache] = greedy(model, prompt, ARCH_NEW, use_cache=use_cache)
                    times[use_cache] = time.perf_counter() - t0
            finally:
                model.close()
            record = {"name": "greedy_cache_parity", "arch": arch, "prompt_tokens": ARCH_PROMPT, "new": ARCH_NEW,
                      "tokens_equal": results[True].tokens == results[False].tokens,
                      "max_abs_diff": float(np.abs(results[True].logits - results[False].logits).max()),
                      "max_abs_logit": float(np.abs(results[False].logits).max()),
                      "cached_s": times[True], "uncached_s": times[False]}
            emit(record)
            table.append(record)
    print("\n| arch | tokens equal | max abs diff | max abs logit | cached s | uncached s |\n"
          "|---|---|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['arch']} | {r['tokens_equal']} | {r['max_abs_diff']:.2e} | {r['max_abs_logit']:.3f} | "
              f"{r['cached_s']:.2f} | {r['uncached_s']:.2f} |")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    ex = sub.add_parser("example")
    ex.add_argument("--timed", type=int, default=20)
    ex.add_argument("--cases", type=int, default=100)
    ex.add_argument("--tokens", type=int, default=24)
    sub.add_parser("archs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "example":
        example(args.timed, args.cases, args.tokens)
    else:
        archs()


if __name__ == "__main__":
    main()
