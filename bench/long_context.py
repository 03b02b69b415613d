"""Long sequences of the seed architectures on the CPU: one pass against chunks through the cache, same run.

    python bench/long_context.py [--tokens 16384] [--threads 2] [--archs deepseek_v4,glm5_next,qwen4_exp]

For each architecture the tiny model of the tests (quantkit.testing.tiny_models, float32 GGUF written with the
tests' helper) scores one ``--tokens``-token sequence with :func:`quantkit.runtime.logits` twice, each in its own
process: ``one pass`` (``loader.LONG_PASS_TOKENS`` raised past the sequence: attention holds every query's scores
against every key) and ``chunked`` (the runtime's default past ``LONG_PASS_TOKENS``: ``LONG_CHUNK``-token chunks
through transformers' cache).  Reported: the scoring call's wall time, the process's peak resident memory (after
loading and a 64-token warm-up, and at the end), and the two runs' next-token NLL (mean, and the largest
difference of one token's).  One JSON object per run, then a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
import numpy as np, torch
sys.path.insert(0, sys.argv[5])
from quantkit.runtime import load_model, loader, logits
from test_runtime import token_ids
arch, n, mode, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(int(sys.argv[6]))
if mode == "one pass":
    loader.LONG_PASS_TOKENS = 1 << 40
model = load_model(path)
ids = token_ids(arch, n)
logits(model, ids[:64])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
out = logits(model, ids)
seconds = time.perf_counter() - t0
x = torch.from_numpy(out[:-1]).double()
nll = torch.logsumexp(x, -1) - x.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
np.save(sys.argv[7], nll.numpy())
print(json.dumps({"seconds": seconds, "peak_mib_before": before / 1024,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_model(arch: str, root: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from test_runtime import f32_types, write_gguf

    from quantkit.testing.tiny_models import build_tiny_model

    model, tokenizer = build_tiny_model(arch, dtype="f32")
    source = root / arch
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    return write_gguf(source, root / f"{arch}.gguf", arch, f32_types)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--archs", default="deepseek_v4,glm5_next,qwen4_exp")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for arch in args.archs.split(","):
            path = write_model(arch, root)
            nll = {}
            for mode in ("one pass", "chunked"):
                saved = root / f"{arch}-{mode.replace(' ', '_')}.npy"
                done = subprocess.run([sys.executable, "-c", CHILD, arch, str(args.tokens), mode, str(path),
                                       str(REPO / "tests"), str(args.threads), str(saved)],
                                      capture_output=True, text=True, cwd=REPO)
                if done.returncode != 0:
                    raise SystemExit(f"{arch} {mode} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                nll[mode] = np.load(saved)
                row = {"name": f"{arch} {args.tokens} tokens, {mode}", "arch": arch, "mode": mode,
                       "tokens": args.tokens, "threads": args.threads, "mean_nll": float(nll[mode].mean()), **result}
                emit(row)
                rows.append(row)
            difference = float(np.abs(nll["one pass"] - nll["chunked"]).max())
            relative = abs(float(nll["chunked"].mean() / nll["one pass"].mean()) - 1)
            emit({"name": f"{arch} NLL, chunked vs one pass", "max_token_difference": difference,
                  "mean_relative_difference": relative})
            rows[-1]["vs_one_pass"] = (difference, relative)
    print("\n| architecture | mode | seconds | peak RSS MiB (after warm-up -> end) | mean NLL | vs one pass: max token "
          "diff, mean rel. diff |\n|---|---|---|---|---|---|")
    for r in rows:
        versus = "%.1e, %.1e" % r["vs_one_pass"] if "vs_one_pass" in r else ""
        print(f"| {r['arch']} | {r['mode']} | {r['seconds']:.1f} | {r['peak_mib_before']:.0f} -> {r['peak_mib']:.0f} "
              f"| {r['mean_nll']:.6f} | {versus} |")


if __name__ == "__main__":
    main()
