"""``--executor ray`` on a real Ray cluster: ``ray start --head`` on the loopback with 2 worker CPUs, started once
per session by a fixture and stopped (``ray stop --force``) when the session ends.

The reference of every comparison is the process pool's output of the same plan (``--executor process -j 2``):
a Ray conversion (tasks writing into the partial, or returning their bytes), one whose worker process is killed
mid-tensor, and one resumed after its driver was killed, each equal byte for byte.  Select with ``-m ray``.
"""
from __future__ import annotations

import os
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
    # Ray's token authentication (its default): the head writes ~/.ray/auth_token; a driver presents it when
    # RAY_AUTH_MODE=token is set before ray is imported (this process, and the CLI subprocesses inherit it)
    os.environ["RAY_AUTH_MODE"] = "token"
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'quantkit[ray]')")
    temp = Path(tempfile.mkdtemp(prefix="qk-ray-"))   # short: Ray's socket paths must fit in 107 bytes
    kill_dir = temp / "kill"
    kill_dir.mkdir()
    port = _free_port()
    env = {**os.environ, KILL_ONCE_ENV: str(kill_dir), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]
                                         if p)}
    ray = _ray_command()
    start = [ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
             "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(temp)]
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, timeout=CLUSTER_START_TIMEOUT)
        yield f"127.0.0.1:{port}", kill_dir
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


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
            if journal_path(out).is_file() and journal_path(out).read_bytes().count(b"\n") >= 3:
                break   # the header line and two tensors journaled
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


def test_without_ray_the_cli_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)   # import ray raises ImportError
    result = CliRunner().invoke(main, ["convert", str(examples.example_model_dir()), "-o", str(tmp_path / "x.gguf"),
                                       "--recipe", str(examples.example_recipe("tiny-moe-f16")), "--executor", "ray"])
    assert result.exit_code == 3
    assert result.output.strip().splitlines() == [
        "error: quantkit convert --executor ray needs the ray extra: pip install 'quantkit[ray]'"]
    assert list(tmp_path.iterdir()) == []
