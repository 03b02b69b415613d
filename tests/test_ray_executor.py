"""``--executor ray`` on a real Ray cluster: ``ray start --head`` on the loopback with 2 worker CPUs, started once
per session by a fixture in a process session of its own, whose every process is stopped when the test session
ends (not ``ray stop``, which stops every Ray cluster of the machine).

The reference of every comparison is the process pool's output of the same plan (``--executor process -j 2``):
a Ray conversion (tasks writing into the partial, or returning their bytes), one whose worker process is killed
mid-tensor, and one resumed after its driver was killed, each equal byte for byte.  Select with ``-m ray``.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit import examples
from quantkit.cli import main
from quantkit.convert.journal import journal_path
from quantkit.convert.raypool import KILL_ONCE_ENV
from quantkit.testing.recipe_texts import PRE_TOKENIZER, Q2_RECIPE

CLI = [sys.executable, "-c", "from quantkit.cli import main; main()"]
#: Seconds the fixture waits for the cluster to come up.
CLUSTER_START_TIMEOUT = 120


def _ray_command() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.is_file() else (shutil.which("ray") or "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """(address, kill-once directory) of a 2-CPU Ray head on 127.0.0.1, stopped at the end of the session."""
    # Ray's token authentication (its default): `ray start --head` refuses to start without a token, and a driver
    # presents it when RAY_AUTH_MODE=token is set before ray is imported.  The test cluster gets a token of its
    # own in the environment (this process, the head and the CLI subprocesses inherit it; ~/.ray is not touched)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'quantkit[ray]')")
    temp = Path(tempfile.mkdtemp(prefix="qk-ray-"))   # short: Ray's socket paths must fit in 107 bytes
    kill_dir = temp / "kill"
    kill_dir.mkdir()
    port = _free_port()
    env = {**os.environ, KILL_ONCE_ENV: str(kill_dir), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]
                                         if p)}
    start = [_ray_command(), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus",
             "2", "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(temp)]
    # a session of its own: every process of this cluster (and no other Ray on the machine) is stopped at the end
    starter = subprocess.Popen(start, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output, _ = starter.communicate(timeout=CLUSTER_START_TIMEOUT)
        if starter.returncode != 0:
            pytest.fail(f"ray start failed: {output.decode(errors='replace')[-2000:]}")
        yield f"127.0.0.1:{port}", kill_dir
    finally:
        _stop_session(starter.pid)
        shutil.rmtree(temp, ignore_errors=True)


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    members.append(int(entry))
            except OSError:   # gone meanwhile
                pass
    return members


def _stop_session(sid: int, grace: float = 10.0) -> None:
    """SIGTERM every process of session ``sid``, then SIGKILL what is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_members(sid):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _session_members(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _session_members(sid):
            return


def convert(*args) -> object:
    result = CliRunner().invoke(main, ["convert", *map(str, args), "--no-progress"])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def tiny_moe_args():
    return [examples.example_model_dir(), "--recipe", examples.example_recipe("tiny-moe-iq2xxs-w2q2k"),
            "--imatrix", examples.example_imatrix(), "--pre-tokenizer", examples.PRE_TOKENIZER]


@pytest.fixture(scope="module")
def qwen_args(tmp_path_factory, tiny_checkpoints):
    src = tiny_checkpoints.get("qwen3_moe", "per-expert", "bf16")
    recipe = tmp_path_factory.mktemp("ray-recipe") / "q2.toml"
    recipe.write_text(Q2_RECIPE)
    return [src, "--recipe", recipe, "--bootstrap-importance", "--pre-tokenizer", PRE_TOKENIZER]


@pytest.fixture(scope="module")
def qwen_pool(qwen_args, tmp_path_factory) -> bytes:
    """The process pool's output: the reference of every tiny-architecture comparison."""
    out = tmp_path_factory.mktemp("ray-pool") / "pool.gguf"
    convert(*qwen_args, "-o", out, "-j", 2, "--executor", "process")
    return out.read_bytes()


def leftovers(out: Path) -> set[str]:
    return {p.name for p in out.parent.iterdir() if p.name.startswith(out.name) and p != out}


@pytest.mark.ray
def test_example_model_on_ray_equals_the_process_pool(ray_cluster, tiny_moe_args, tmp_path):
    address, _ = ray_cluster
    convert(*tiny_moe_args, "-o", tmp_path / "pool.gguf", "-j", 2)
    convert(*tiny_moe_args, "-o", tmp_path / "ray.gguf", "--executor", "ray", "--address", address)
    assert (tmp_path / "ray.gguf").read_bytes() == (tmp_path / "pool.gguf").read_bytes()
    assert leftovers(tmp_path / "ray.gguf") == set()


@pytest.mark.ray
@pytest.mark.parametrize("transfer", ["write", "return"])
def test_tiny_architecture_on_ray_equals_the_process_pool(ray_cluster, qwen_args, qwen_pool, tmp_path, transfer):
    address, _ = ray_cluster
    out = tmp_path / "ray.gguf"
    convert(*qwen_args, "-o", out, "--executor", "ray", "--address", address, "--ray-transfer", transfer)
    assert out.read_bytes() == qwen_pool
    assert leftovers(out) == set()


@pytest.mark.ray
def test_a_worker_killed_mid_tensor_costs_only_its_tensor(ray_cluster, qwen_args, qwen_pool, tmp_path):
    address, kill_dir = ray_cluster
    (kill_dir / "armed").touch()
    try:
        out = tmp_path / "ray.gguf"
        convert(*qwen_args, "-o", out, "--executor", "ray", "--address", address, "--ray-transfer", "write")
        assert (kill_dir / "fired").exists(), "no worker was killed: the test proved nothing"
        assert out.read_bytes() == qwen_pool
    finally:
        for name in ("armed", "fired"):
            (kill_dir / name).unlink(missing_ok=True)


@pytest.mark.ray
def test_resume_after_the_driver_was_killed(ray_cluster, qwen_args, qwen_pool, tmp_path):
    address, _ = ray_cluster
    out = tmp_path / "ray.gguf"
    args = [*map(str, qwen_args), "-o", str(out), "--executor", "ray", "--address", address, "--no-progress"]
    driver = subprocess.Popen([*CLI, "convert", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while driver.poll() is None and time.monotonic() < deadline:
            text = journal_path(out).read_text() if journal_path(out).is_file() else ""
            if "source_sha256" in text and text.count('"tensor"') >= 2:
                break   # the source hashes and two tensors journaled: those are kept
            time.sleep(0.05)
        assert driver.poll() is None, f"the conversion ended before it could be killed: {driver.stderr.read()!r}"
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    assert not out.exists() and (out.parent / (out.name + ".partial")).exists()
    result = convert(*args[:-1], "--resume")
    assert "from the journal" in result.output
    assert out.read_bytes() == qwen_pool
    assert leftovers(out) == set()


@pytest.mark.ray
def test_without_an_address_a_local_cluster_is_started_and_stopped(qwen_args, qwen_pool, tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'quantkit[ray]')")
    import ray

    out = tmp_path / "ray.gguf"
    convert(*qwen_args, "-o", out, "--executor", "ray", "-j", 2)
    assert out.read_bytes() == qwen_pool
    assert not ray.is_initialized()


#: Cases of the example fixture the scoring tests use (its first ones): enough for each worker to score several.
SCORE_CASES = 6


@pytest.fixture(scope="module")
def small_fixture(tmp_path_factory) -> Path:
    """The example fixture's first :data:`SCORE_CASES` cases, written as a fixture of their own."""
    from quantkit.fixtures.directory import read_fixture, write_fixture

    fx = read_fixture(examples.example_fixture_dir())
    out = tmp_path_factory.mktemp("ray-fixture") / "fx"
    write_fixture(out, fx.cases[:SCORE_CASES], label=fx.label, source=fx.info.source, rendering=fx.rendering,
                  capture=fx.info.capture)
    return out


def table_rows(path: Path) -> list:
    """The table's lines, its header record without the evidence (the command line and thread count differ)."""
    import json

    lines = path.read_text().splitlines()
    tag, _, record = lines[0].partition(" {")
    header = json.loads("{" + record)
    del header["evidence"]
    return [tag, header, *lines[1:]]


@pytest.mark.ray
def test_score_on_ray_equals_a_single_process_run(ray_cluster, small_fixture, tmp_path):
    address, _ = ray_cluster
    model = examples.example_model_dir()
    runner = CliRunner()
    single = runner.invoke(main, ["score", str(model), str(small_fixture), str(tmp_path / "one.tsv"), "--ctx", "512"])
    assert single.exit_code == 0, single.output
    spread = runner.invoke(main, ["score", str(model), str(small_fixture), str(tmp_path / "ray.tsv"), "--ctx", "512",
                                  "--executor", "ray", "--address", address])
    assert spread.exit_code == 0, spread.output
    rows = table_rows(tmp_path / "ray.tsv")
    assert rows == table_rows(tmp_path / "one.tsv")
    from quantkit.fixtures.directory import read_fixture

    ids = [r.split("\t")[0] for r in rows[3:] if not r.startswith("#")]
    assert ids == [c.id for c in read_fixture(small_fixture).cases]   # every case, in the fixture's order


@pytest.mark.ray
def test_imatrix_collected_on_ray_equals_a_single_process_collection(ray_cluster, tmp_path):
    """Forward passes of two chunks run on two actors and arrive in any order; the driver folds them in order, as
    one process adds them: the same bits, file included."""
    address, _ = ray_cluster
    args = ["imatrix", "collect", str(examples.example_model_dir()), "--text", str(examples.example_calibration_text()),
            "--ctx", "64", "--batch", "128", "--chunks", "6", "--no-progress"]
    runner = CliRunner()
    single = runner.invoke(main, [*args, "-o", str(tmp_path / "one.gguf")])
    assert single.exit_code == 0, single.output
    spread = runner.invoke(main, [*args, "-o", str(tmp_path / "ray.gguf"), "--executor", "ray", "--address", address])
    assert spread.exit_code == 0, spread.output
    from quantkit.imatrix import load_imatrix

    one, ray = load_imatrix(tmp_path / "one.gguf"), load_imatrix(tmp_path / "ray.gguf")
    assert one.chunk_count == ray.chunk_count == 6 and sorted(one.entries) == sorted(ray.entries)
    for name, entry in one.entries.items():
        assert entry.in_sum2.tobytes() == ray.entries[name].in_sum2.tobytes(), name
        assert entry.counts.tobytes() == ray.entries[name].counts.tobytes(), name
    assert (tmp_path / "ray.gguf").read_bytes() == (tmp_path / "one.gguf").read_bytes()


def test_without_ray_the_cli_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)   # import ray raises ImportError
    result = CliRunner().invoke(main, ["convert", str(examples.example_model_dir()), "-o", str(tmp_path / "x.gguf"),
                                       "--recipe", str(examples.example_recipe("tiny-moe-f16")), "--executor", "ray"])
    assert result.exit_code == 3
    assert result.output.strip().splitlines() == [
        "error: quantkit convert --executor ray needs the ray extra: pip install 'quantkit[ray]'"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", [["--address", "127.0.0.1:6379"], ["--ray-transfer", "return"]])
def test_a_ray_option_needs_the_ray_executor(tmp_path, option):
    result = CliRunner().invoke(main, ["convert", str(examples.example_model_dir()), "-o", str(tmp_path / "x.gguf"),
                                       "--recipe", str(examples.example_recipe("tiny-moe-f16")), *option])
    assert result.exit_code == 2 and f"{option[0]} needs --executor ray" in result.output
    assert list(tmp_path.iterdir()) == []


def test_an_address_where_nothing_answers_is_refused_at_once(tmp_path):
    """ray.init waited without limit for a head that never answers (over 10 minutes, Ray's retry warnings on
    stderr and no quantkit error): an address where nothing accepts a connection, or that is no port, is one
    line, exit 2, within seconds."""
    with socket.socket() as probe:   # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    for address, expected in [(f"127.0.0.1:{closed}", "nothing answers there"), ("127.0.0.1:99999", "not a port"),
                              ("", "--address")]:
        start = time.monotonic()
        result = CliRunner().invoke(main, ["convert", str(examples.example_model_dir()), "-o", str(tmp_path / "o.gguf"),
                                           "--recipe", "tiny-moe-q4_k", "--pre-tokenizer", "qwen35", "--executor",
                                           "ray", "--address", address, "--no-progress"])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and expected in lines[0], result.stderr
        assert time.monotonic() - start < 60 and not (tmp_path / "o.gguf").exists()


def test_an_interrupt_while_the_local_cluster_starts_stops_it(monkeypatch):
    """Ctrl-C inside ray.init skipped ray.shutdown: the cluster's agents outlived the run (parent PID 1)."""
    import types

    from quantkit import cluster

    calls = []

    def init(**kwargs):
        calls.append("init")
        raise KeyboardInterrupt
    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init, shutdown=lambda: calls.append("shutdown"))
    monkeypatch.setattr(cluster, "require_ray", lambda what: fake)
    with pytest.raises(KeyboardInterrupt):
        with cluster.ray_session(None, 2, "test"):
            pass
    assert calls == ["init", "shutdown"]
