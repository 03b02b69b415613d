"""Mutated GGUF and safetensors files through ``quantkit inspect`` and ``quantkit validate``: no traceback and no
internal error escape, memory stays bounded whatever the header claims, and every refusal is exit 2 with one line.

Inputs: the field-by-field GGUF of ``tests/test_gguf_malformed.py`` (reused, not rebuilt), a real converted tiny
model (re-planned and compared against its source), a swapset sidecar (payload and manifest), and a checkpoint
shard.  Mutations are byte edits (biased towards the header, where lengths and counts live) and truncations.
``bench/fuzz.py`` runs the same properties with many more examples.
"""
from __future__ import annotations

import re
import shutil
import tempfile
import tracemalloc
from pathlib import Path

import hypothesis
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.cli import main
from test_gguf_malformed import BASE

#: Peak Python-heap allocation allowed while handling one mutated tiny file (the real model's re-plan and
#: re-encoding included); a header claiming a huge count or length must not move it.
PEAK_BYTES = 96 << 20
HEADER_FOCUS_BYTES = 4096
#: How the CLI prints an exception that is not a QuantkitError ("error: IndexError: ..."): an internal error, not a
#: refusal (no file is missing or unreadable here, so no OSError is legitimate either).
_INTERNAL = re.compile(r"^error: [A-Za-z]*(Error|Exception): ")


def mutations(size: int, header: int = HEADER_FOCUS_BYTES):
    """(edits, cut): up to six (offset, byte) edits, a third of them inside the first ``header`` bytes, and a cut in
    about one case of four (a cut file is refused early; uncut ones reach the deeper checks)."""
    offset = st.one_of(st.integers(0, min(size, header) - 1), st.integers(0, size - 1), st.integers(0, size - 1))
    cut = st.one_of(st.sampled_from([None, None, None]), st.integers(0, size))
    return st.tuples(st.lists(st.tuples(offset, st.integers(0, 255)), min_size=1, max_size=6), cut)


def mutate(data: bytes, edits, cut) -> bytes:
    out = bytearray(data)
    for at, byte in edits:
        out[at] = byte
    return bytes(out[:cut])


def invoke(*args: str):
    """Run the CLI; (result, peak traced allocation in bytes)."""
    tracemalloc.start()
    try:
        result = CliRunner().invoke(main, list(args))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak


def assert_clean(result, peak: int, codes: tuple[int, ...]) -> None:
    assert result.exit_code in codes, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert not _INTERNAL.match(lines[0]), lines[0]
    assert peak < PEAK_BYTES, peak


# -- inputs -------------------------------------------------------------------------------------------------------

def build_inputs(root: Path, src: Path) -> tuple[Path, Path, Path]:
    """(source checkpoint, its GGUF conversion, a sidecar beside a copy of the checkpoint), made under ``root``."""
    gguf = root / "q.gguf"
    made = CliRunner().invoke(main, ["convert", str(src), "-o", str(gguf), "--recipe", "q8_0", "--no-progress",
                                     "-j", "1", "--pre-tokenizer", "qwen2"])
    assert made.exit_code == 0, made.output
    with_sidecar = root / "model"
    shutil.copytree(src, with_sidecar)
    made = CliRunner().invoke(main, ["swapset", str(with_sidecar), "--family", "attn", "--format", "fp8-block128"])
    assert made.exit_code == 0, made.output
    (sidecar,) = with_sidecar.glob("fp8-swapset-*.safetensors")
    return src, gguf, sidecar


@pytest.fixture(scope="module")
def model(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path, Path]:
    return build_inputs(tmp_path_factory.mktemp("fuzz"), tiny_checkpoints.get("qwen3_moe"))


def with_file(name: str, data: bytes, run):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        return run(path)


# -- properties: each returns the exit codes it saw ---------------------------------------------------------------

def check_small_gguf(edits, cut) -> list[int]:
    data = mutate(bytes(BASE.buf), edits, cut)
    codes = []
    for args in (["inspect"], ["validate", "--structure-only"]):
        result, peak = with_file("m.gguf", data, lambda p: invoke(*args, str(p)))
        assert_clean(result, peak, (0, 2) if args == ["inspect"] else (0, 1, 2))
        codes.append(result.exit_code)
    return codes


def check_model_gguf(model, edits, cut) -> list[int]:
    src, gguf, _ = model
    original = gguf.read_bytes()
    data = mutate(original, edits, cut)
    result, peak = with_file("m.gguf", data, lambda p: invoke("validate", str(p), "--source", str(src),
                                                              "--payload", "full"))
    assert_clean(result, peak, (0, 1, 2))
    # with every byte compared, any change anywhere is found, and an unchanged file passes
    assert (result.exit_code == 0) == (data == original), result.output
    return [result.exit_code]


def check_sidecar(model, edits, cut, part: str) -> list[int]:
    _, _, sidecar = model
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "model"
        shutil.copytree(sidecar.parent, copy)
        target = copy / (sidecar.name if part == "payload" else sidecar.with_suffix(".json").name)
        original = target.read_bytes()
        size = len(original)
        target.write_bytes(mutate(original, [(at % size, b) for at, b in edits], None if cut is None else cut % size))
        result, peak = invoke("validate", str(copy / sidecar.name), "--payload", "full")
    assert_clean(result, peak, (0, 1, 2))
    return [result.exit_code]


def check_checkpoint(model, edits, cut) -> list[int]:
    src, _, _ = model
    shard = src / "model.safetensors"
    codes = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ckpt"
        shutil.copytree(src, copy)
        (copy / shard.name).write_bytes(mutate(shard.read_bytes(), edits, cut))
        for path in (copy, copy / shard.name):
            result, peak = invoke("inspect", str(path))
            assert_clean(result, peak, (0, 2))
            codes.append(result.exit_code)
    return codes


def model_header(path: Path) -> int:
    from quantkit.io.gguf_reader import GGUFFile

    with GGUFFile(path) as f:
        return f.data_offset


def targets(model) -> dict:
    """name -> (strategy of argument tuples, property taking them)."""
    src, gguf, sidecar = model
    largest_sidecar_file = max(sidecar.stat().st_size, sidecar.with_suffix(".json").stat().st_size)
    return {
        "small-gguf": (mutations(len(BASE.buf)), check_small_gguf),
        "model-gguf": (mutations(gguf.stat().st_size, header=model_header(gguf)),
                       lambda edits, cut: check_model_gguf(model, edits, cut)),
        "sidecar": (st.builds(lambda m, part: (*m, part), mutations(largest_sidecar_file),
                              st.sampled_from(["payload", "manifest"])),
                    lambda edits, cut, part: check_sidecar(model, edits, cut, part)),
        "checkpoint": (mutations((src / "model.safetensors").stat().st_size),
                       lambda edits, cut: check_checkpoint(model, edits, cut)),
    }


FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
            database=None)


def run_target(strategy, prop, max_examples: int, seed: int | None = None, seen=None) -> None:
    """Run ``prop`` on ``max_examples`` examples of ``strategy``; exit codes go to ``seen`` (a Counter)."""
    @settings(max_examples=max_examples, **FUZZ)
    @given(case=strategy)
    def run(case):
        codes = prop(*case)
        if seen is not None:
            seen.update(codes)
    if seed is not None:
        run = hypothesis.seed(seed)(run)
    run()


@pytest.mark.parametrize("name, max_examples", [("small-gguf", 60), ("model-gguf", 12), ("sidecar", 20),
                                                ("checkpoint", 20)])
def test_mutated_files(model, name, max_examples):
    run_target(*targets(model)[name], max_examples)
