"""A long fuzz run: the properties of ``tests/test_validate_fuzz.py`` on many more mutated files.

    python bench/fuzz.py [--minutes 5] [--batch 50] [--targets small-gguf,model-gguf,sidecar,checkpoint]

Each target (a field-by-field GGUF, a converted tiny model re-planned and compared byte for byte against its
source, a swapset sidecar's payload and manifest, a checkpoint shard) gets an equal share of the time, in batches
of ``--batch`` hypothesis examples with successive seeds.  Properties: no traceback or internal error escapes, a
refusal is exit 2 with one line, memory stays bounded, and ``validate --payload full`` of a changed model file never
passes.  Prints one JSON object per target (examples, exit codes seen, failures with hypothesis' shrunk example),
then a table; exits 1 if any property failed.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import emit

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--targets", default="small-gguf,model-gguf,sidecar,checkpoint")
    opts = parser.parse_args()
    sys.path.insert(0, str(TESTS))
    import test_validate_fuzz as fuzz
    from quantkit.testing.tiny_models import TinyCheckpointCache

    names = opts.targets.split(",")
    with tempfile.TemporaryDirectory(prefix="quantkit-fuzz-") as tmp:
        inputs = Path(tmp) / "inputs"
        inputs.mkdir()
        model = fuzz.build_inputs(inputs, TinyCheckpointCache(Path(tmp) / "tiny").get("qwen3_moe"))
        targets = fuzz.targets(model)
        share = 60 * opts.minutes / len(names)
        rows = []
        for name in names:
            strategy, prop = targets[name]
            seen: collections.Counter = collections.Counter()
            failures = []
            examples, seed = 0, 0
            start = time.perf_counter()
            while time.perf_counter() - start < share:
                before = sum(seen.values())
                try:
                    fuzz.run_target(strategy, prop, opts.batch, seed=seed, seen=seen)
                except Exception as exc:   # noqa: BLE001 - a property failed: record it, go on with the next seed
                    failures.append({"seed": seed, "error": "".join(traceback.format_exception_only(exc)).strip()
                                     [-2000:]})
                examples += sum(seen.values()) - before
                seed += 1
            record = {"name": f"fuzz.{name}", "seconds": time.perf_counter() - start, "batches": seed,
                      "cli_runs": examples, "exit_codes": dict(sorted(seen.items())), "failures": failures}
            emit(record)
            rows.append(record)
    print(f"\n{'target':12}{'seconds':>9}{'runs':>8}  {'exit codes':30}  failures")
    for r in rows:
        codes = ", ".join(f"{k}: {v}" for k, v in r["exit_codes"].items())
        print(f"{r['name'][5:]:12}{r['seconds']:9.0f}{r['cli_runs']:8}  {codes:30}  {len(r['failures'])}")
    sys.exit(1 if any(r["failures"] for r in rows) else 0)


if __name__ == "__main__":
    main()
