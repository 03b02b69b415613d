"""Faults a user meets while converting, each ending as the user needs: kill -9 at seeded random points of a
``--jobs 2`` conversion, a full disk, a source edited in place between runs, two conversions to one output, a
partial taken away under the workers, outputs that name inputs, unwritable outputs, and more jobs than the machine
holds.  Every interrupted run leaves nothing under the final name; every resume ends byte-identical to an
uninterrupted run (the reference, made once per module)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.convert import execute as execute_module
from quantkit.convert.journal import Journal, journal_path
from quantkit.convert.pool import WORKER_BASE_BYTES, bound_jobs
from quantkit.convert.source import Hashing
from quantkit.errors import ConcurrentWriteError, OutputPathError
from quantkit.io.atomic import check_output, input_files, output_lock, sha256_file
from quantkit.io.gguf import align
from quantkit.io.gguf_reader import GGUFFile
from quantkit.io.gguf_writer import GGUFWriter, plan_layout
from quantkit.io.safetensors import SafetensorsFile, write_safetensors
from quantkit.testing.recipe_texts import PRE_TOKENIZER as PRE, Q2_RECIPE
from quantkit.testing.tiny_models import TinyCheckpointCache
from test_convert import hashes_first, journal_records, leftovers, one_line_error

CLI = [sys.executable, "-c", "from quantkit.cli import main; main()"]
#: Seeded kill points of the kill -9 test (issue: at least 20).
KILL_POINTS = 20


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny-faults")).get("qwen3_moe", "per-expert", "bf16")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "q2.toml"
    path.write_text(Q2_RECIPE)
    return path


def args_for(src: Path, out: Path, recipe: Path, *more) -> list[str]:
    return [str(a) for a in (src, "-o", out, "--recipe", recipe, "--bootstrap-importance", "--pre-tokenizer", PRE,
                             "--no-progress", *more)]


def run(*args, jobs: int = 1):
    return CliRunner().invoke(main, ["convert", *map(str, args), "-j", str(jobs)])



@pytest.fixture(scope="module")
def reference(qwen, recipe, tmp_path_factory) -> Path:
    """An uninterrupted conversion in one process."""
    out = tmp_path_factory.mktemp("reference") / "ref.gguf"
    result = run(*args_for(qwen, out, recipe))
    assert result.exit_code == 0, result.output
    return out


# -- kill -9 at random points ---------------------------------------------------------------------------------------

def journal_lines(out: Path) -> int:
    try:
        return journal_path(out).read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_kill_9_at_random_points_then_resume(qwen, recipe, reference, tmp_path):
    """KILL_POINTS seeded points over a --jobs 2 conversion (the whole process group, workers included): before the
    journal exists, after a seeded number of journal lines (tensors, the rename note) plus a seeded delay.  The runs
    chain: each resumes the one killed before it.  Never a file under the final name unless it is complete (killed
    after the rename); every chain's last resume ends byte-identical to the reference."""
    tensors = len(GGUFFile(reference).tensors)
    rng = random.Random(18)
    out = tmp_path / "q.gguf"
    killed = resumed_to_end = 0
    for point in range(KILL_POINTS):
        if point % 10 == 0:   # two chains of ten kills, each from a fresh start
            for name in leftovers(out):
                (out.parent / name).unlink()
        target = rng.randint(0, tensors + 1)
        delay = rng.uniform(0, 0.05)
        more = ["-j", "2"] + (["--resume"] if leftovers(out) else [])
        process = subprocess.Popen(CLI + ["convert", *args_for(qwen, out, recipe, *more)], start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while process.poll() is None and journal_lines(out) <= target and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            killed += 1
        stdout, stderr = process.communicate(timeout=60)
        if process.returncode == 0:   # finished before the kill point: complete and identical
            assert sha256_file(out) == sha256_file(reference), f"point {point}"
            assert f"sha256 {sha256_file(reference)};" in stdout   # the file's hash read back while written
            out.unlink()
            resumed_to_end += 1
            continue
        assert process.returncode == -signal.SIGKILL, stderr
        if out.exists():   # killed after the rename: the verified file, and a resume that says so
            assert sha256_file(out) == sha256_file(reference), f"point {point}: a wrong file under the final name"
            if journal_path(out).exists():
                finished = subprocess.run(CLI + ["convert", *args_for(qwen, out, recipe, "--resume")],
                                          capture_output=True, text=True, timeout=300)
                assert finished.returncode == 0 and "already complete" in finished.stdout, finished.stderr
            for name in leftovers(out):
                (out.parent / name).unlink()
            resumed_to_end += 1
            continue
        if point % 10 == 9:   # the chain's end: resume to completion
            finished = subprocess.run(CLI + ["convert", *args_for(qwen, out, recipe, "-j", "2", "--resume")],
                                      capture_output=True, text=True, timeout=300)
            assert finished.returncode == 0, finished.stderr
            assert sha256_file(out) == sha256_file(reference), f"point {point}"
            assert f"sha256 {sha256_file(reference)};" in finished.stdout   # journaled payloads hashed in order too
            assert leftovers(out) == {"q.gguf"}
            out.unlink()
            resumed_to_end += 1
    assert killed >= KILL_POINTS // 2, f"only {killed} of {KILL_POINTS} points hit a running conversion"
    assert resumed_to_end >= 2


def test_killed_between_rename_and_journal_removal(qwen, recipe, reference, tmp_path, monkeypatch):
    """The rename happened, the journal stayed: --resume recognizes the finished file by the header its journal
    noted, removes the journal, and succeeds."""
    out = tmp_path / "q.gguf"
    real = GGUFWriter.finish

    def finish_then_die(self):
        real(self)
        raise KeyboardInterrupt
    monkeypatch.setattr(GGUFWriter, "finish", finish_then_die)
    assert run(*args_for(qwen, out, recipe)).exit_code == 130
    monkeypatch.setattr(GGUFWriter, "finish", real)
    assert {"q.gguf", "q.gguf.journal"} <= leftovers(out)
    result = run(*args_for(qwen, out, recipe, "--resume"))
    assert result.exit_code == 0 and "already complete" in result.output, result.output
    assert leftovers(out) == {"q.gguf"} and sha256_file(out) == sha256_file(reference)


def test_interrupted_while_recording_the_release_manifest(qwen, recipe, reference, tmp_path, monkeypatch):
    """Ctrl-C after the rename, while the release manifest is written: the journal stays (it goes last), the
    message says the file is complete and --resume finishes its records; it said the partial was kept, and
    --resume then refused the existing output, leaving a release without its manifest."""
    from quantkit import names

    out = tmp_path / "q.gguf"
    real = names.release_manifest

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(names, "release_manifest", interrupted)
    result = run(*args_for(qwen, out, recipe))
    assert result.exit_code == 130 and "q.gguf is complete; run again with --resume" in result.stderr, result.stderr
    assert leftovers(out) == {"q.gguf", "q.gguf.journal"}
    monkeypatch.setattr(names, "release_manifest", real)
    result = run(*args_for(qwen, out, recipe, "--resume"))
    assert result.exit_code == 0 and "already complete" in result.output, result.output
    assert leftovers(out) == {"q.gguf"} and sha256_file(out) == sha256_file(reference)
    assert json.loads(names.manifest_path(out).read_text())["sha256"] == sha256_file(reference)


def test_a_full_disk_while_recording_the_release_manifest_says_the_output_is_complete(qwen, recipe, reference,
                                                                                       tmp_path, monkeypatch):
    """ENOSPC after the rename, writing the release manifest: the message says the output is complete (there is
    no partial to keep) and --resume writes the records."""
    from quantkit import names

    out = tmp_path / "q.gguf"
    real = names.release_manifest

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(names.manifest_path(out)))
    monkeypatch.setattr(names, "release_manifest", disk_full)
    line = one_line_error(run(*args_for(qwen, out, recipe)))
    assert f"the output {out} is complete" in line and "--resume" in line and "partial" not in line, line
    assert leftovers(out) == {"q.gguf", "q.gguf.journal"}
    monkeypatch.setattr(names, "release_manifest", real)
    result = run(*args_for(qwen, out, recipe, "--resume"))
    assert result.exit_code == 0 and "already complete" in result.output, result.output
    assert json.loads(names.manifest_path(out).read_text())["sha256"] == sha256_file(reference)


def test_killed_before_any_tensor_resumes(qwen, recipe, reference, tmp_path, monkeypatch):
    """A partial whose journal lists no tensor yet (killed while the header was being written: short, not yet
    sized) is started over by --resume instead of being refused."""
    out = tmp_path / "q.gguf"

    def cut_header(self):
        self.partial.write_bytes(b"GGUF\x03")
        raise KeyboardInterrupt
    monkeypatch.setattr(GGUFWriter, "write_header", cut_header)
    assert run(*args_for(qwen, out, recipe)).exit_code == 130
    monkeypatch.undo()
    assert {"q.gguf.partial", "q.gguf.journal"} <= leftovers(out)
    result = run(*args_for(qwen, out, recipe, "--resume"))
    assert result.exit_code == 0, result.output
    assert sha256_file(out) == sha256_file(reference)


# -- a full disk ----------------------------------------------------------------------------------------------------

def mount_tmpfs(path: Path, size: int) -> bool:
    """A tmpfs of ``size`` bytes at ``path`` when this process may mount one (root in a mount-capable container)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def fill(directory: Path) -> Path:
    """Write zeros into ``directory`` until the filesystem is full."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, bytes(size))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_full_disk_then_resume(qwen, recipe, reference, tmp_path, monkeypatch):
    """The disk fills up mid-run (a real tmpfs filling up, where the test may mount one; else ENOSPC injected into
    the writes): one line naming the path with the resume hint, the partial and the journal kept, and --resume
    after space is freed ends byte-identical."""
    mount = tmp_path / "small"
    size = reference.stat().st_size
    real_fs = mount_tmpfs(mount, align(size, 4096) + (2 << 20))   # the file, the 1 MiB reserve and a little more
    try:
        if not real_fs:
            mount.mkdir(exist_ok=True)
        out = mount / "q.gguf"
        real_record, real_pwrite, filler = Journal.record, os.pwrite, []

        def record_then_fill(self, *a):
            real_record(self, *a)
            if not filler and journal_lines(out) > 3:
                filler.append(fill(mount) if real_fs else True)
        monkeypatch.setattr(Journal, "record", record_then_fill)
        if not real_fs:   # in-process (one job) so the workers' writes see the injection
            def full_pwrite(fd, data, offset):
                if filler:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_pwrite(fd, data, offset)
            monkeypatch.setattr(os, "pwrite", full_pwrite)
        line = one_line_error(run(*args_for(qwen, out, recipe), jobs=2 if real_fs else 1))
        assert "no space left" in line and "--resume" in line and str(mount) in line, line
        assert {"q.gguf.partial", "q.gguf.journal"} <= leftovers(out) and not out.exists()
        monkeypatch.setattr(Journal, "record", real_record)
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        if real_fs:
            filler[0].unlink()
        result = run(*args_for(qwen, out, recipe, "--resume"), jobs=2)
        assert result.exit_code == 0, result.output
        assert sha256_file(out) == sha256_file(reference) and leftovers(out) == {"q.gguf"}
    finally:
        if real_fs:
            subprocess.run(["umount", str(mount)], check=True)


def test_space_reserve_is_proportional(qwen, recipe, reference, tmp_path, monkeypatch):
    """A small conversion onto a small filesystem is not refused for want of a fixed 1 GiB; the reserve can be set;
    a real shortfall is one line naming the directory."""
    assert execute_module.free_space_reserve(7_800_000) == 1 << 20
    assert execute_module.free_space_reserve(500 << 30) == 1 << 30
    out = tmp_path / "q.gguf"
    size = reference.stat().st_size
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(execute_module.shutil, "disk_usage",
                        lambda path: usage._replace(free=size + (2 << 20)))   # what "20 MB free" is to 7.8 MB
    assert run(*args_for(qwen, out, recipe)).exit_code == 0
    out.unlink()
    line = one_line_error(run(*args_for(qwen, out, recipe, "--free-space-reserve", 4 << 20)))
    assert "not enough free space" in line and str(tmp_path) in line
    assert not leftovers(out)


# -- a source edited in place ---------------------------------------------------------------------------------------

def interrupted_run(src: Path, out: Path, recipe: Path, monkeypatch, after: int) -> None:
    """Ctrl-C once the journal has more than ``after`` lines, its source hashes first (:func:`hashes_first`)."""
    real = Journal.record
    hashes_first(monkeypatch)

    def interrupt(self, *a):
        real(self, *a)
        if journal_lines(out) > after:
            raise KeyboardInterrupt
    monkeypatch.setattr(Journal, "record", interrupt)
    assert run(*args_for(src, out, recipe)).exit_code == 130
    monkeypatch.undo()
    assert [list(r)[0] for r in journal_records(out)][:3] == ["journal", "source_sha256", "tensor"]


def test_an_interrupted_forced_rerun_resumes_with_resume_force(qwen, recipe, reference, tmp_path, monkeypatch):
    """convert --force over a finished output, interrupted: --resume refused (the output exists) and --resume
    --force started over; now --resume --force continues the partial and then replaces the output."""
    out = tmp_path / "q.gguf"
    assert run(*args_for(qwen, out, recipe)).exit_code == 0
    real = Journal.record

    def interrupt(self, *a):
        real(self, *a)
        if journal_lines(out) > 4:
            raise KeyboardInterrupt
    monkeypatch.setattr(Journal, "record", interrupt)
    assert run(*args_for(qwen, out, recipe), "--force").exit_code == 130
    monkeypatch.undo()
    kept = len([r for r in journal_records(out) if "tensor" in r])
    assert kept >= 1 and out.exists()
    line = one_line_error(run(*args_for(qwen, out, recipe), "--resume"))
    assert "output exists" in line and "--resume --force" in line
    result = run(*args_for(qwen, out, recipe), "--resume", "--force", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert f"{kept} from the journal" in result.output
    assert out.read_bytes() == reference.read_bytes() and leftovers(out) == {out.name}
    # the report lists every tensor: those made now and those the journal kept (it listed the first alone)
    report = json.loads((tmp_path / "r.json").read_text())
    listed = report["produced"] + report["from_journal"]
    assert len(report["from_journal"]) == kept == report["resumed"]
    with GGUFFile(out) as f:
        assert sorted(d["name"] for d in listed) == sorted(f.tensors)
        assert all(hashlib.sha256(f.data(d["name"]).tobytes()).hexdigest() == d["sha256"]
                   and d["nbytes"] == f.tensors[d["name"]].nbytes for d in report["from_journal"])


def test_an_interrupt_before_any_output_does_not_call_the_output_complete(tmp_path):
    """A journal left before the partial existed (or a stale one) made the interrupt message say the output was
    complete when there was none."""
    from quantkit.cli.convert import _interrupted_state

    out = tmp_path / "q.gguf"
    journal_path(out).write_text("{}\n")
    assert _interrupted_state(out, recorded=False) == "before any output was written; nothing is kept"
    out.write_bytes(b"GGUF")
    assert "q.gguf is complete" in _interrupted_state(out, recorded=False)


def test_an_output_larger_than_a_file_may_be_is_named_and_nothing_kept(qwen, recipe, tmp_path, monkeypatch):
    """EFBIG (FAT32's 4 GiB, ``ulimit -f``) printed "error: File too large" naming nothing and left the partial and
    its journal, which no --resume on that filesystem could finish."""
    import resource

    out = tmp_path / "q.gguf"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        result = run(*args_for(qwen, out, recipe))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    line = one_line_error(result)
    assert result.exit_code == 2 and "larger than one file may be there" in line and "q.gguf.partial" in line, line
    assert not leftovers(out)
    # a resume meeting the limit keeps the earlier run's work, for a resume where the limit is lifted
    interrupted_run(qwen, out, recipe, monkeypatch, after=3)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        result = run(*args_for(qwen, out, recipe), "--resume")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert result.exit_code == 2 and "the partial and its journal are kept" in one_line_error(result)
    assert {"q.gguf.partial", "q.gguf.journal"} <= leftovers(out)


def test_a_journaled_payload_lost_in_a_crash_is_made_again(qwen, recipe, reference, tmp_path, monkeypatch):
    """Journal lines are synced within 0.5 s, payload pages by the kernel: after a power loss a journaled tensor's
    bytes can be stale.  --resume stopped on it ("does not match its journal hash"), leaving only --force."""
    out = tmp_path / "q.gguf"
    interrupted_run(qwen, out, recipe, monkeypatch, after=4)
    lost = next(r["tensor"] for r in journal_records(out) if "tensor" in r)
    partial = out.with_name("q.gguf.partial")
    with GGUFFile(partial) as f:
        at = f.data_offset + f.tensors[lost].offset
    with open(partial, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes(16))
    result = run(*args_for(qwen, out, recipe), "--resume")
    assert result.exit_code == 0, result.output
    assert f"made again: {lost}" in result.output
    assert out.read_bytes() == reference.read_bytes()


def edit_in_place(path: Path, tensor: str) -> None:
    """Change one value of ``tensor``, keeping the file's size and its access and modification times."""
    st = path.stat()
    with SafetensorsFile(path) as f:
        arrays = {n: np.array(f.array(n)) for n in f.names()}
        dtypes = {n: f.entry(n).dtype for n in f.names()}
    arrays[tensor].reshape(-1).view(np.uint16)[7] ^= 0x0100
    write_safetensors(path, arrays, metadata={"format": "pt"}, dtypes=dtypes, overwrite=True)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def source_of(src: Path, out: Path, recipe: Path, pick) -> str:
    """The first Hugging Face source of the first planned tensor (by name) that ``pick(name)`` accepts."""
    request = execute_module.ConvertRequest(source=str(src), out=out, recipe=str(recipe), bootstrap=True,
                                            pre_tokenizer=PRE, progress=False)
    return next(j.output.sources[0].hf_name for n, j in sorted(execute_module.prepare(request).jobs.items())
                if pick(n))


@pytest.mark.parametrize("edited", ["kept", "not converted yet"])
def test_source_edited_keeping_size_and_mtime_is_refused(qwen, recipe, tmp_path, monkeypatch, edited):
    """Once the journal holds the source hashes, a resume checks the whole files: a tensor kept or one still to
    convert, an edit in place keeping size and mtime is refused with one line naming the file."""
    src = tmp_path / "ckpt"
    shutil.copytree(qwen, src)
    out = tmp_path / "q.gguf"
    interrupted_run(src, out, recipe, monkeypatch, after=3)
    kept = {r["tensor"] for r in journal_records(out) if "tensor" in r}
    hf_name = source_of(src, out, recipe, (lambda n: n in kept) if edited == "kept" else
                        (lambda n: n not in kept and n.startswith("blk.1.attn_q")))
    edit_in_place(src / "model.safetensors", hf_name)
    line = one_line_error(run(*args_for(src, out, recipe, "--resume")))
    assert "'model.safetensors' changed" in line and "SHA-256" in line and "--force" in line, line
    assert {"q.gguf.partial", "q.gguf.journal"} <= leftovers(out) and not out.exists()
    assert run(*args_for(src, out, recipe, "--force")).exit_code == 0
    fresh = tmp_path / "fresh.gguf"
    assert run(*args_for(src, fresh, recipe)).exit_code == 0
    assert sha256_file(out) == sha256_file(fresh)


def test_source_edited_where_nothing_was_kept_resumes_to_the_new_bytes(qwen, recipe, tmp_path, monkeypatch):
    """Interrupted before the source hashes were journaled, nothing is kept: an in-place edit (size and mtime
    kept) is no error, and the resume ends byte-identical to an uninterrupted conversion of the edited source
    (its header hashes the new file)."""
    src = tmp_path / "ckpt"
    shutil.copytree(qwen, src)
    out = tmp_path / "q.gguf"
    real = Journal.record

    def interrupt(self, *a):
        real(self, *a)
        raise KeyboardInterrupt
    monkeypatch.setattr(Hashing, "done", lambda self: False)
    monkeypatch.setattr(Journal, "record", interrupt)
    assert run(*args_for(src, out, recipe)).exit_code == 130
    monkeypatch.undo()
    assert [list(r)[0] for r in journal_records(out)] == ["journal", "tensor"]
    edit_in_place(src / "model.safetensors", source_of(src, out, recipe, lambda n: n.startswith("blk.1.attn_q")))
    assert run(*args_for(src, out, recipe, "--resume")).exit_code == 0
    fresh = tmp_path / "fresh.gguf"
    assert run(*args_for(src, fresh, recipe)).exit_code == 0
    assert sha256_file(out) == sha256_file(fresh)


# -- two writers ----------------------------------------------------------------------------------------------------

def test_second_convert_to_the_same_output_is_refused(qwen, recipe, reference, tmp_path):
    """While one conversion runs (slowed down), a second one to the same output, even with --force, is refused
    with one line naming the holder; the first ends with a valid file identical to the reference."""
    out = tmp_path / "q.gguf"
    slow = ("import time\n"
            "from quantkit.convert import journal\n"
            "real = journal.Journal.record\n"
            "def record(self, *a):\n"
            "    real(self, *a)\n"
            "    time.sleep(0.05)\n"
            "journal.Journal.record = record\n"
            "from quantkit.cli import main\n"
            "main()\n")
    first = subprocess.Popen([sys.executable, "-c", slow, "convert", *args_for(qwen, out, recipe, "-j", "2")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while journal_lines(out) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        second = run(*args_for(qwen, out, recipe, "--force"), jobs=2)
        line = one_line_error(second)
        assert "another process (pid" in line and "q.gguf.lock" in line, line
    finally:
        _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert sha256_file(out) == sha256_file(reference) and leftovers(out) == {"q.gguf"}


def test_output_lock_is_exclusive_and_released(tmp_path):
    out = tmp_path / "x.gguf"
    with output_lock(out) as lock:
        assert f"pid {os.getpid()}" in lock.read_text()
        with pytest.raises(ConcurrentWriteError, match=f"pid {os.getpid()}"):
            with output_lock(out):
                pass
    assert not lock.exists()
    with output_lock(out):   # free again
        pass


def test_writer_never_truncates_a_partial_in_use(tmp_path):
    """Starting over replaces the partial with a new file: a writer still holding the old one keeps its bytes."""
    layout = plan_layout({"general.architecture": "llama"}, [("t", (4, 32), "F32")])
    out = tmp_path / "x.gguf"
    first = GGUFWriter(out, layout)
    first.write_header()
    first.write_tensor("t", np.ones((4, 32), np.float32))
    old = os.open(first.partial, os.O_RDONLY)
    second = GGUFWriter(out, layout, overwrite=True)
    try:
        second.write_header()
        assert os.fstat(old).st_size == layout.file_size
        assert np.frombuffer(os.pread(old, 512, layout.data_offset), np.float32).tolist() == [1.0] * 128
        assert first.partial.read_bytes()[layout.data_offset:layout.data_offset + 512] == bytes(512)
    finally:
        os.close(old)
        first.close()
        second.close()


def test_payloads_are_read_back_before_the_rename(qwen, recipe, tmp_path, monkeypatch):
    """Bytes in the partial that differ from those hashed as they were written (as another writer would leave
    them) are caught by the read-back: no file under the final name, the partial kept."""
    out = tmp_path / "q.gguf"
    real = execute_module.ReadBack.written

    def corrupt_then_check(self, name, sha256):
        if name not in self._done:   # a payload just written (not one of a journal)
            t = self._layout.tensor(name)
            with open(out.with_name("q.gguf.partial"), "r+b") as f:
                f.seek(self._layout.data_offset + t.offset)
                flipped = bytes(b ^ 0xFF for b in f.read(min(64, t.nbytes)))
                f.seek(self._layout.data_offset + t.offset)
                f.write(flipped)
        return real(self, name, sha256)
    monkeypatch.setattr(execute_module.ReadBack, "written", corrupt_then_check)
    line = one_line_error(run(*args_for(qwen, out, recipe)))
    assert "does not match its journal hash" in line
    assert not out.exists() and "q.gguf.partial" in leftovers(out)


def test_read_back_flushes_beside_the_hash_one_at_a_time(qwen, recipe, reference, tmp_path, monkeypatch):
    """The whole-file hash hands its periodic flushes to another thread: one flush at a time, a slow disk never
    holding the hash back, and the file is the same."""
    from quantkit.convert import readback

    flushes, running, hashing = [], [], threading.get_ident()

    def slow_flush(fd):
        assert threading.get_ident() != hashing and not running
        running.append(fd)
        time.sleep(0.02)
        flushes.append(fd)
        running.pop()
    real_run = readback.ReadBack._run

    def run_noting_thread(self, final_header):
        nonlocal hashing
        hashing = threading.get_ident()
        real_run(self, final_header)
    monkeypatch.setattr(readback, "SYNC_BYTES", 1)
    monkeypatch.setattr(readback, "_datasync", slow_flush)
    monkeypatch.setattr(readback.ReadBack, "_run", run_noting_thread)
    out = tmp_path / "q.gguf"
    result = run(*args_for(qwen, out, recipe))
    assert result.exit_code == 0, result.output
    assert flushes and out.read_bytes() == reference.read_bytes()


def test_partial_renamed_away_under_the_workers(qwen, recipe, tmp_path, monkeypatch):
    """Not 'died … out of memory?': the workers find the partial gone and say so; nothing is renamed into place."""
    out = tmp_path / "q.gguf"
    real = execute_module.ReadBack

    def read_back_then_rename(*a, **k):   # after the header, before any tensor
        readback = real(*a, **k)
        out.with_name("q.gguf.partial").rename(tmp_path / "elsewhere")
        return readback
    monkeypatch.setattr(execute_module, "ReadBack", read_back_then_rename)
    line = one_line_error(run(*args_for(qwen, out, recipe), jobs=2))
    assert "renamed, replaced or removed by another process" in line and "memory" not in line, line
    assert not out.exists()


# -- outputs that are inputs, outputs that cannot be written --------------------------------------------------------

@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
def test_convert_output_that_is_a_source_file_is_refused(qwen, recipe, tmp_path, how):
    src = tmp_path / "ckpt"
    shutil.copytree(qwen, src)
    shard = src / "model.safetensors"
    before = sha256_file(shard)
    out = {"same path": shard, "symlink": tmp_path / "link.gguf", "hard link": tmp_path / "hard.gguf"}[how]
    if how == "symlink":
        out.symlink_to(shard)
    elif how == "hard link":
        os.link(shard, out)
    line = one_line_error(run(*args_for(src, out, recipe, "--force")))
    assert "would overwrite an input" in line and "model.safetensors" in line, line
    assert sha256_file(shard) == before and not out.with_name(out.name + ".partial").exists()


@pytest.mark.parametrize("target", ["config.json", "recipe", "existing"])
def test_convert_report_never_replaces_inputs_or_files(qwen, recipe, tmp_path, target):
    src = tmp_path / "ckpt"
    shutil.copytree(qwen, src)
    report = {"config.json": src / "config.json", "recipe": recipe, "existing": tmp_path / "r.json"}[target]
    if target == "existing":
        report.write_text("keep")
    before = report.read_bytes()
    out = tmp_path / "q.gguf"
    line = one_line_error(run(*args_for(src, out, recipe, "--report", report, "--force")
                              if target != "existing" else args_for(src, out, recipe, "--report", report)))
    assert ("would overwrite an input" in line) if target != "existing" else ("exists" in line), line
    assert report.read_bytes() == before and not leftovers(out)   # refused before any work


def test_outputs_in_unwritable_places_are_refused_before_work(qwen, recipe, reference, tmp_path):
    out = tmp_path / "q.gguf"
    line = one_line_error(run(*args_for(qwen, out, recipe, "--report", tmp_path / "missing" / "r.json")))
    assert "does not exist" in line and not leftovers(out)
    blocked = tmp_path / "file"
    blocked.write_text("")
    line = one_line_error(run(*args_for(qwen, blocked / "q.gguf", recipe)))
    assert "does not exist" in line
    runner = CliRunner()
    result = runner.invoke(main, ["validate", str(reference), "--structure-only", "--report",
                                  str(tmp_path / "missing" / "v.json")])
    assert "does not exist" in one_line_error(result)


def test_validate_json_never_replaces_inputs_or_files(reference, tmp_path):
    runner = CliRunner()
    before = sha256_file(reference)
    line = one_line_error(runner.invoke(main, ["validate", str(reference), "--structure-only", "--report",
                                               str(reference), "--force"]))
    assert "would overwrite an input" in line and sha256_file(reference) == before
    existing = tmp_path / "v.json"
    existing.write_text("keep")
    assert "exists" in one_line_error(runner.invoke(main, ["validate", str(reference), "--structure-only",
                                                           "--report", str(existing)]))
    assert existing.read_text() == "keep"
    result = runner.invoke(main, ["validate", str(reference), "--structure-only", "--report", str(existing), "--force"])
    assert result.exit_code == 0, result.output
    assert json.loads(existing.read_text())["ok"] is True


def test_score_outputs_are_checked_before_scoring(reference, tmp_path):
    fixture = tmp_path / "fixture"
    fixture.mkdir()
    (fixture / "cases.jsonl").write_text("")
    runner = CliRunner()
    for out, more in [(reference, []), (fixture / "cases.jsonl", []),
                      (tmp_path / "s.tsv", ["--save-logits", str(reference)]),
                      (tmp_path / "missing" / "s.tsv", [])]:
        result = runner.invoke(main, ["score", str(reference), str(fixture), str(out), "--ctx", "64", *more])
        line = one_line_error(result)
        assert "would overwrite an input" in line or "does not exist" in line, line
    assert (fixture / "cases.jsonl").read_text() == "" and GGUFFile(reference).tensors


def test_check_output_unit(tmp_path):
    source = tmp_path / "a.bin"
    source.write_bytes(b"x")
    (tmp_path / "link").symlink_to(source)
    with pytest.raises(OutputPathError, match="would overwrite an input"):
        check_output(tmp_path / "link", inputs=[source], overwrite=True)
    with pytest.raises(OutputPathError, match="is a directory"):
        check_output(tmp_path, overwrite=True)
    # a fixture's prompts/ are inputs too: score -o FIXTURE/prompts/x.txt --force overwrote one
    fixture = tmp_path / "fixture"
    (fixture / "prompts").mkdir(parents=True)
    (fixture / "prompts" / "case.txt").write_text("a prompt")
    with pytest.raises(OutputPathError, match="would overwrite an input"):
        check_output(fixture / "prompts" / "case.txt", inputs=input_files([fixture]), overwrite=True)
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(OutputPathError, match="not a regular file"):   # renaming over it would delete it
        check_output(fifo, overwrite=True)
    for special in ("/dev/null",):
        with pytest.raises(OutputPathError, match="not a regular file"):
            check_output(special, overwrite=True)
    assert check_output(tmp_path / "new.bin", inputs=[source]) == tmp_path / "new.bin"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".probe")] == []


# -- how many workers -----------------------------------------------------------------------------------------------

def test_jobs_are_bounded_by_cpus_and_memory():
    per_worker = WORKER_BASE_BYTES
    assert bound_jobs(2, per_worker, cpus=4, memory=1 << 40) == (2, None)
    jobs, note = bound_jobs(64, per_worker, cpus=4, memory=1 << 40)
    assert jobs == 4 and "4 CPUs available" in note
    jobs, note = bound_jobs(8, per_worker, cpus=16, memory=3 * per_worker)
    assert jobs == 3 and "GiB of memory available" in note
    assert bound_jobs(8, per_worker, cpus=16, memory=per_worker // 2)[0] == 1


def test_too_many_jobs_are_lowered_with_a_note(qwen, recipe, tmp_path):
    out = tmp_path / "q.gguf"
    result = run(*args_for(qwen, out, recipe, "--dry-run"), jobs=1000)
    assert result.exit_code == 0, result.output
    assert "note: using" in result.stderr and "instead of 1000" in result.stderr and not leftovers(out)


def test_workers_starting_ignore_ctrl_c_and_leave_quietly_when_the_parent_goes():
    """A Ctrl-C reaches the terminal's whole process group: a worker still starting its interpreter printed a
    KeyboardInterrupt traceback from multiprocessing's spawn (and died); one whose parent closed the pipe printed a
    BrokenPipeError or EOFError traceback.  Now a worker is born ignoring SIGINT and ends quietly (exit 0)."""
    from quantkit.convert.pool import WorkerPool

    workers = WorkerPool(2)
    try:
        for w in workers._workers:   # at once: each is still importing, before its own code can ignore SIGINT
            os.kill(w.process.pid, signal.SIGINT)
        time.sleep(1.0)
        assert all(w.process.is_alive() for w in workers._workers)
        for w in workers._workers:
            w.conn.close()
        for w in workers._workers:
            w.process.join(30)
        assert [w.process.exitcode for w in workers._workers] == [0, 0]
    finally:
        workers.close(terminate=True)
