"""``quantkit fetch``: downloads through huggingface_hub from a Hub served on the loopback (``HF_ENDPOINT``), each
verified against a transport manifest; corrupt bytes are refused by name, dropped connections and killed
downloads resume with ``Range`` requests."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.transport.split import split_file

ROOT = Path(__file__).resolve().parents[1]
REPO = "org/model-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class Hub:
    """The endpoints ``hf_hub_url``/``get_hf_file_metadata``/``http_get`` use: HEAD and GET of
    ``/{repo}/resolve/{revision}/{file}`` with ETag, X-Repo-Commit, Content-Length and byte ranges."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.corrupt: set[str] = set()      # served with one byte flipped
        self.longer: set[str] = set()       # GETs send more bytes than the file (and HEAD) has
        self.drop_once: dict[str, int] = {}  # first GET closes the connection after this many bytes
        self.stall: dict[str, int] = {}      # GETs send this many bytes, then wait for `release`
        self.release = threading.Event()
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                match = RESOLVE.match(self.path)
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                if not match or match["repo"] != REPO or match["file"] not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                name = match["file"]
                data = hub.files[name]
                if name in hub.corrupt:
                    data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
                if name in hub.longer and body:
                    data += b"EXTRA"
                start = 0
                ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if ranged and body:
                    start = int(ranged[1])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("ETag", f'"{hashlib.sha256(hub.files[name]).hexdigest()}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if not body:
                    return
                payload = data[start:]
                cut = hub.drop_once.pop(name, None)
                if cut is not None:   # a dropped connection mid-body
                    self.wfile.write(payload[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if name in hub.stall:
                    self.wfile.write(payload[:hub.stall[name]])
                    self.wfile.flush()
                    hub.release.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def release(tmp_path):
    """A file split into parts with a manifest, as a release repository holds them."""
    blob = tmp_path / "model.gguf.bin"
    blob.write_bytes(np.random.default_rng(5).integers(0, 256, 3_000_000, dtype=np.uint8).tobytes())
    m = split_file(blob, tmp_path / "release", 1_200_000, gguf=False)
    files = {p.name: m.part_path(i).read_bytes() for i, p in enumerate(m.parts)}
    files[m.path.name] = m.path.read_bytes()
    return m, files


@pytest.fixture
def hub(release, monkeypatch):
    with Hub(release[1]) as served:
        monkeypatch.setenv("HF_ENDPOINT", served.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield served


def fetch(*args):
    return CliRunner().invoke(main, ["fetch", REPO, *map(str, args), "--no-progress"])


def test_fetch_downloads_and_verifies_against_the_manifest(release, hub, tmp_path):
    m, files = release
    out = tmp_path / "down"
    result = fetch(*(p.name for p in m.parts), "-o", out, "--manifest", m.path.name)
    assert result.exit_code == 0, result.output
    assert result.output.count("matches the manifest") == len(m.parts)
    for p in m.parts:
        assert (out / p.name).read_bytes() == files[p.name]
    assert not list(out.glob("*.partial")) and not list(out.glob("*.fetch-journal"))
    got = CliRunner().invoke(main, ["transport", "assemble", str(out / m.path.name), "-o", str(tmp_path / "x.bin")])
    assert got.exit_code == 0 and (tmp_path / "x.bin").read_bytes() == b"".join(files[p.name] for p in m.parts)


def test_corrupt_served_bytes_are_refused_by_name(release, hub, tmp_path):
    m, _ = release
    hub.corrupt.add(m.parts[1].name)
    out = tmp_path / "down"
    result = fetch(m.parts[1].name, "-o", out, "--manifest", m.path)
    assert result.exit_code == 1, result.output
    assert f"{REPO}/{m.parts[1].name}" in result.output and "refused" in result.output
    assert not (out / m.parts[1].name).exists() and not list(out.glob("*.partial"))


def test_a_name_the_manifest_does_not_list_is_refused_before_downloading(release, hub, tmp_path):
    m, _ = release
    result = fetch("other.gguf", "-o", tmp_path / "down", "--manifest", m.path)
    assert result.exit_code == 2 and "'other.gguf' is not listed in the manifest" in result.output, result.output
    assert not [r for r in hub.requests if r[0] == "GET"]


def test_a_missing_file_is_named(release, hub, tmp_path):
    result = fetch("nope.bin", "-o", tmp_path / "down")
    assert result.exit_code == 2 and f"{REPO}/nope.bin" in result.output and "404" in result.output, result.output


def test_a_dropped_connection_resumes_with_a_range_request(release, hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # http_get resumes from the bytes its reads handed over: 64 KiB reads, so most of the 400,000 before the drop
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    m, files = release
    name = m.parts[0].name
    hub.drop_once[name] = 400_000
    result = fetch(name, "-o", tmp_path / "down", "--manifest", m.path)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "down" / name).read_bytes() == files[name]
    gets = [r for r in hub.requests if r[0] == "GET"]
    assert len(gets) == 2 and gets[0][2] is None
    assert 0 < int(re.fullmatch(r"bytes=(\d+)-", gets[1][2])[1]) <= 400_000


FETCHER = """
import sys
from huggingface_hub import constants
from quantkit.transport.fetch import fetch
constants.DOWNLOAD_CHUNK_SIZE = 64 * 1024   # bytes reach the partial every 64 KiB
fetch(sys.argv[1], sys.argv[2].split(","), sys.argv[3], manifest=sys.argv[4])
"""


def _kill_a_fetch_while_it_stalls(hub, manifest: Path, names: list[str], out: Path, stall: int) -> None:
    """Run ``fetch`` of ``names`` in a child process, kill it once the last name's partial holds ``stall`` bytes (the
    Hub stops sending there), and let the Hub serve that file whole again."""
    stalled = names[-1]
    hub.stall[stalled] = stall
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen([sys.executable, "-c", FETCHER, REPO, ",".join(names), str(out), str(manifest)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = out / f"{stalled}.partial"
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size >= stall) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill()
    child.wait(30)
    assert partial.stat().st_size == stall and not (out / stalled).exists()
    del hub.stall[stalled]
    hub.release.set()


def test_a_killed_download_resumes_in_a_new_process(release, hub, tmp_path):
    m, files = release
    name, out = m.parts[0].name, tmp_path / "down"
    stall = 5 * 64 * 1024
    _kill_a_fetch_while_it_stalls(hub, m.path, [name], out, stall)
    result = fetch(name, "-o", out, "--manifest", m.path)
    assert result.exit_code == 0 and f"resumed after {stall:,} bytes" in result.output, result.output
    assert (out / name).read_bytes() == files[name]
    assert hub.requests[-1] == ("GET", f"/{REPO}/resolve/main/{name}", f"bytes={stall}-")


def test_a_partial_of_another_version_is_discarded(release, hub, tmp_path):
    m, files = release
    name, out = m.parts[2].name, tmp_path / "down"
    out.mkdir()
    (out / f"{name}.partial").write_bytes(b"x" * 1000)   # bytes of an older upload of the file
    (out / f"{name}.fetch-journal").write_text('{"repo": "%s", "file": "%s", "etag": "old", "commit": "%s", '
                                               '"size": %d}' % (REPO, name, COMMIT, m.parts[2].size))
    result = fetch(name, "-o", out, "--manifest", m.path)
    assert result.exit_code == 0 and "resumed" not in result.output, result.output
    assert (out / name).read_bytes() == files[name]
    assert [r[2] for r in hub.requests if r[0] == "GET"] == [None]


def test_a_second_download_of_one_file_is_refused(release, hub, tmp_path):
    """Two downloads of one file would share its partial and journal: the second is refused (exit 2) while the
    first holds the file's lock, before it touches either."""
    from quantkit.io.atomic import output_lock

    m, _ = release
    out = tmp_path / "down"
    out.mkdir()
    with output_lock(out / m.parts[0].name):
        result = fetch(m.parts[0].name, "-o", out, "--manifest", m.path)
    assert result.exit_code == 2, result.output
    assert "lock" in result.output
    assert not (out / m.parts[0].name).exists() and not list(out.glob("*.partial"))


def test_rerunning_an_interrupted_multi_file_fetch_keeps_the_finished_files_and_resumes(release, hub, tmp_path):
    """The documented resume: the same command again.  A file an earlier run finished is checked against the
    manifest and kept (not asked for again); one under the name that is not the manifest's is refused."""
    m, files = release
    first, second, out = m.parts[0].name, m.parts[1].name, tmp_path / "down"
    stall = 5 * 64 * 1024
    _kill_a_fetch_while_it_stalls(hub, m.path, [first, second], out, stall)
    assert (out / first).read_bytes() == files[first]
    asked = len(hub.requests)
    result = fetch(first, second, "-o", out, "--manifest", m.path)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{out / first}: already there") and \
        "matches the manifest" in lines[0], lines
    assert lines[1].startswith(str(out / second)) and f"resumed after {stall:,} bytes" in lines[1], lines
    assert (out / second).read_bytes() == files[second]
    assert not [r for r in hub.requests[asked:] if r[1].endswith(first)]
    changed = bytearray(files[first])
    changed[7] ^= 1
    (out / first).write_bytes(bytes(changed))
    result = fetch(first, "-o", out, "--manifest", m.path)
    assert result.exit_code == 2 and str(out / first) in result.output and "not the manifest's" in result.output, \
        result.output
    assert (out / first).read_bytes() == bytes(changed)


def test_each_file_is_reported_as_it_finishes(release, hub, tmp_path):
    """A later file's failure does not hide the files already downloaded."""
    m, _ = release
    hub.corrupt.add(m.parts[1].name)
    result = fetch(m.parts[0].name, m.parts[1].name, "-o", tmp_path / "down", "--manifest", m.path)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 2 and m.parts[0].name in lines[0] and "matches the manifest" in lines[0], lines
    assert f"{REPO}/{m.parts[1].name}" in lines[1] and "refused" in lines[1], lines


def test_a_manifest_in_a_repository_folder_is_found_where_it_was_saved(release, hub, tmp_path, monkeypatch):
    m, files = release
    monkeypatch.chdir(tmp_path)   # the manifest's repository path is not also a local file
    remote = f"sub/{m.path.name}"
    hub.files[remote] = files[m.path.name]
    name, out = m.parts[0].name, tmp_path / "down"
    assert fetch(name, "-o", out, "--manifest", remote).exit_code == 0
    asked = len(hub.requests)
    result = fetch(name, "-o", out, "--manifest", remote)
    assert result.exit_code == 0 and "already there" in result.output, result.output
    assert not [r for r in hub.requests[asked:] if r[1].endswith(remote)]


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "no manifest"])
def test_a_body_longer_than_the_file_is_refused_by_name(release, hub, tmp_path, with_manifest):
    """More bytes than the file has is not a download to resume (a rerun gets them again): exit 1, as wrong bytes."""
    m, _ = release
    name, out = m.parts[0].name, tmp_path / "down"
    hub.longer.add(name)
    result = fetch(name, "-o", out, *(["--manifest", m.path] if with_manifest else []))
    assert result.exit_code == 1, result.output
    assert f"{REPO}/{name}" in result.output and "refused" in result.output and "Traceback" not in result.output
    assert not (out / name).exists() and not list(out.glob("*.partial"))


def test_a_revision_asked_for_fetches_its_manifest_again(release, hub, tmp_path, monkeypatch):
    """The manifest an earlier run saved was reused for --revision v2: every old part "matched" it, exit 0, the
    old release kept.  With a revision the manifest is fetched again and the old parts are refused."""
    m, files = release
    monkeypatch.chdir(tmp_path)   # the manifest's repository path is not also a local file
    name, out = m.parts[0].name, tmp_path / "down"
    assert fetch(name, "-o", out, "--manifest", m.path.name).exit_code == 0
    raw = json.loads(files[m.path.name])
    raw["parts"][0]["sha256"] = "0" * 64                 # the next release: another first part
    hub.files[m.path.name] = json.dumps(raw).encode()
    kept = fetch(name, "-o", out, "--manifest", m.path.name)   # no revision: the saved manifest, as before
    assert kept.exit_code == 0 and "already there" in kept.output, kept.output
    result = fetch(name, "-o", out, "--manifest", m.path.name, "--revision", "v2")
    assert result.exit_code == 2 and "not the manifest's" in result.output, result.output
