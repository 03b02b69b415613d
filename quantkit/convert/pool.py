"""Produce planned tensors in worker processes and write each at its offset in the partial output.

Workers are ``spawn``ed processes, one tensor at a time each.  Only tensor names travel to a worker and only a
small :class:`TensorDone` travels back; every worker opens the checkpoint (and the imatrix) itself, lazily, and
writes its payload with ``pwrite`` at the planned offset of the partial file, hashing the bytes as they go.
Memory per worker is one tensor unit (one expert, one row chunk, or one small tensor; see
:mod:`quantkit.convert.tensors`) plus the source pages read for the current tensor (unmapped after each
tensor).  Numba runs one thread per worker (the workers are the parallelism).  Workers are spawned as soon as the
:class:`WorkerPool` exists and receive the :class:`WorkerSetup` once the caller has planned the file.

Workers die with their parent (``PR_SET_PDEATHSIG``), so a killed conversion leaves no process writing behind.
Failures: an exception in a worker comes back with the tensor's name and is re-raised in the caller; a worker
that dies (killed, out of memory) is reported with its exit code and the tensor it held.  On any failure or
interrupt every worker is terminated: tensors not yet reported are simply produced again by a resumed run.
With ``jobs == 1`` the same code runs in the calling process (no worker processes).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing
import os
import pickle
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Iterable, Iterator

from ..errors import FormatError, QuantkitError
from ..io.gguf_writer import pwrite_all
from ..formats.warm import encoder_kinds
from .tensors import SourceContext, TensorJob, tensor_bytes

#: Seconds to wait for workers to exit after they were told to stop, before terminating them.
WORKER_EXIT_TIMEOUT = 10.0
#: Linux prctl option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSetup:
    """Sent to each worker once, before its first tensor: where to read, where to write, every job by name."""

    source_path: str
    model_type: str
    imatrix_path: str | None
    partial_path: str
    jobs: dict[str, TensorJob]
    offsets: dict[str, int]
    """Absolute file offset of each tensor's payload."""
    imatrix_shapes: dict[str, tuple[int, int]]
    """(row length, matrices) of every tensor an imatrix may describe (to conform the imatrix the same way)."""
    allow_synthetic_imatrix: bool = False


@dataclass(frozen=True)
class TensorDone:
    name: str
    sha256: str
    nbytes: int
    seconds: float
    """Time spent producing and writing the tensor (reading, decoding, encoding, pwrite)."""


class TensorWriter:
    """Produces tensors by name and writes them into the partial file (one per process)."""

    def __init__(self, setup: WorkerSetup):
        self.setup = setup
        self.context = SourceContext(setup.source_path, setup.model_type, setup.imatrix_path,
                                     setup.imatrix_shapes, setup.allow_synthetic_imatrix)
        self._fd = os.open(setup.partial_path, os.O_RDWR)

    def run(self, name: str) -> TensorDone:
        start = time.perf_counter()
        job = self.setup.jobs[name]
        offset = self.setup.offsets[name]
        digest = hashlib.sha256()
        written = 0
        try:
            for piece in tensor_bytes(self.context, job):
                if written + piece.nbytes > job.nbytes:
                    raise FormatError(f"produced more than the {job.nbytes} bytes planned", tensor=name)
                pwrite_all(self._fd, piece, offset + written)
                digest.update(piece)
                written += piece.nbytes
        finally:
            self.context.release()
        if written != job.nbytes:
            raise FormatError(f"produced {written} bytes, the plan has {job.nbytes}", tensor=name)
        return TensorDone(name, digest.hexdigest(), written, time.perf_counter() - start)

    def close(self) -> None:
        self.context.release()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (QuantkitError subclasses do: their message is their only argument)."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any unpicklable exception is replaced by its text
        return QuantkitError(f"{type(exc).__name__}: {exc}")


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when its parent dies: a crashed or killed parent must not leave workers that
    go on writing into a partial file another run may be resuming."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):   # not Linux: the worker still exits when its pipe closes
        pass


def _worker_main(conn) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent handles Ctrl-C and terminates its workers
    import numba

    numba.set_num_threads(1)
    setup = conn.recv()   # sent once the parent has planned the file; None: stopped before any work
    if setup is None:
        return
    share = conn.recv()   # this worker's share of the encoders to compile before any tensor
    if share is None:
        return
    from ..formats.warm import warm_encoders

    # a failure here comes back with its tensor's name when that tensor is encoded
    with contextlib.suppress(Exception):
        warm_encoders(share)
    conn.send(("ready",))
    writer = TensorWriter(setup)
    try:
        while (name := conn.recv()) is not None:
            try:
                conn.send(("ok", writer.run(name)))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
                conn.send(("error", name, _portable(exc)))
    finally:
        writer.close()


class _Worker:
    def __init__(self, context, index: int):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True,
                                       name=f"quantkit-convert-{index}")
        self.process.start()
        child.close()
        self.task: str | None = None

    def send(self, message) -> None:
        try:
            self.conn.send(message)
        except OSError:   # the worker is gone (BrokenPipeError and the like)
            raise _died(self) from None


def _died(worker: _Worker) -> QuantkitError:
    worker.process.join(WORKER_EXIT_TIMEOUT)   # a killed process in the middle of I/O can take a moment to go
    code = worker.process.exitcode
    why = ("still exiting" if code is None else
           f"killed by signal {-code}" if code < 0 else f"exit code {code}")
    return QuantkitError(f"worker process {worker.process.pid} died ({why}; out of memory?) while producing "
                         f"this tensor", tensor=worker.task)


class WorkerPool:
    """``jobs`` worker processes (none for ``jobs == 1``: the caller's process does the work).

    The workers are spawned when the pool is created, so they import quantkit while the caller hashes the source
    and writes the header; :meth:`run` then sends them the setup and the tensor names.  Use it as a context
    manager: leaving it stops idle workers and terminates busy ones (after an error or an interrupt).
    """

    def __init__(self, jobs: int):
        self.jobs = max(1, jobs)
        self._workers: list[_Worker] = []
        if self.jobs > 1:
            context = multiprocessing.get_context("spawn")
            self._workers = [_Worker(context, i) for i in range(self.jobs)]
        self._started = False

    def run(self, setup: WorkerSetup, names: Iterable[str]) -> Iterator[TensorDone]:
        """Produce and write the named tensors, yielding each as it completes (in completion order)."""
        if self._started:
            raise RuntimeError("WorkerPool.run() may be called once")
        self._started = True
        if not self._workers:
            writer = TensorWriter(setup)
            try:
                for name in names:
                    yield writer.run(name)
            finally:
                writer.close()
            return
        queue = deque(names)

        def assign(worker: _Worker) -> None:
            worker.task = queue.popleft() if queue else None
            if worker.task is not None:
                worker.send(worker.task)

        # Each worker first compiles (or loads from numba's disk cache) its own share of the encoders the
        # tensors need, all shares in parallel; then every worker finds every kernel in the cache.
        kinds = encoder_kinds(setup.jobs[name] for name in queue)
        for i, worker in enumerate(self._workers):
            worker.send(setup)
            worker.send(kinds[i::len(self._workers)])
        for worker in self._workers:
            try:
                worker.conn.recv()
            except (EOFError, OSError):
                raise _died(worker) from None
        for worker in self._workers:
            assign(worker)
        while any(w.task is not None for w in self._workers):
            busy = [w for w in self._workers if w.task is not None]
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
            for worker in busy:
                try:
                    message = worker.conn.recv() if worker.conn in ready or worker.conn.poll() else None
                except (EOFError, OSError):   # the pipe closed or was reset: the worker is gone
                    raise _died(worker) from None
                if message is None:
                    if worker.process.sentinel in ready:
                        raise _died(worker)
                    continue
                if message[0] == "error":
                    raise message[2]
                yield message[1]
                assign(worker)

    def close(self, *, terminate: bool = False) -> None:
        """Stop the workers: tell idle ones to exit (or terminate all), then reap them."""
        for worker in self._workers:
            if not terminate and worker.task is None and worker.process.is_alive():
                with contextlib.suppress(OSError):
                    worker.conn.send(None)
        for worker in self._workers:
            if not terminate:
                worker.process.join(WORKER_EXIT_TIMEOUT)
            if worker.process.is_alive():
                worker.process.terminate()
            worker.process.join()
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close(terminate=kind is not None)
