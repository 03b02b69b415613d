"""Produce planned tensors in worker processes and write each at its offset in the partial output.

Workers are ``spawn``ed processes, one tensor at a time each.  Only tensor names travel to a worker and only a
small :class:`TensorDone` travels back; every worker opens the checkpoint (and the imatrix) itself, lazily, and
writes its payload with ``pwrite`` at the planned offset of the partial file, hashing the bytes as they go.
Memory per worker is one tensor unit (one expert, one row chunk, or one small tensor; see
:mod:`quantkit.convert.tensors`) plus the source pages read for the current tensor (unmapped after each
tensor).  Numba runs one thread per worker (the workers are the parallelism).  With ``--device cuda`` a worker
streams its tensors through the GPU (:mod:`quantkit.convert.gpu_stream`); workers share the GPU, each with its own
context and a few batches of device memory.  Workers are spawned as soon as the :class:`WorkerPool` exists and
receive the :class:`WorkerSetup` once the caller has planned the file.

Workers die with their parent (``PR_SET_PDEATHSIG``), so a killed conversion leaves no process writing behind.
Each worker opens the partial by name and checks that it is the very file the caller created (device and inode):
a partial renamed, replaced or removed by another process is reported as such, never written blindly.
Failures: an exception in a worker (also while it starts) comes back with the tensor's name and is re-raised in
the caller; a worker that dies is reported with the signal or exit code and the tensor it held.  A full
filesystem is an :class:`~quantkit.errors.OutOfSpaceError` naming the partial, with the resume hint.  On any
failure or interrupt every worker is terminated: tensors not yet reported are simply produced again by a resumed
run.  With ``jobs == 1`` the same code runs in the calling process (no worker processes).

How many workers (:func:`bound_jobs`): at most one per CPU available, and no more than the memory available
holds at :func:`worker_memory` bytes each; a request above either is lowered, with a note saying why.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from ..errors import ConcurrentWriteError, EncodeError, FormatError, OutOfSpaceError, QuantkitError
from ..io.atomic import is_out_of_space
from ..io.gguf_writer import pwrite_all
from ..resources import available_cpus, available_memory
from ..formats.warm import encoder_kinds
from .gpu_stream import held_bytes, payload, timed
from .tensors import ROW_CHUNK_BYTES, SourceContext, TensorJob, tensor_bytes

if TYPE_CHECKING:
    import numpy as np

#: Seconds to wait for workers to exit after they were told to stop, before terminating them.
WORKER_EXIT_TIMEOUT = 10.0
#: Linux prctl option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
#: Resident memory of a worker before its first tensor (Python, numpy, numba, quantkit): measured ~150 MB.
WORKER_BASE_BYTES = 160 << 20
#: Bytes a GPU stream's pieces hold from their queuing until they are written, over all its tensors (see
#: :class:`_InFlight`): how far the host queues work ahead of the GPU.  Far enough that the next tensors' first
#: batches are read and queued before the GPU runs dry (measured at 8.76 GB: unbounded, the host ran up to ~760 MB
#: ahead), and the bound on the device and pinned memory that work holds.
IN_FLIGHT_BYTES = 1 << 30
#: Tensors of a GPU stream still being written and hashed (a thread each) while the next ones encode (see
#: WorkerPool._run_here): a layer's dozen tensors, most of them small, so that a large one's last batches never
#: hold back the queuing of the next layer's.
TENSORS_BEHIND = 16
#: A worker holds a unit as float32 plus its importance, encoder scratch and encoded bytes: about 3x the unit.
UNIT_MEMORY_FACTOR = 3


def out_of_space(path, tensor: str | None = None) -> OutOfSpaceError:
    """The one message of a full filesystem under a conversion: what is kept and how to go on."""
    return OutOfSpaceError("no space left on the device (disk full or quota exhausted); the partial output and its "
                           "journal are kept: free some space, then run the same command again with --resume",
                           path=path, tensor=tensor)


def partial_identity(path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def partial_gone(path) -> ConcurrentWriteError:
    return ConcurrentWriteError("the partial output was renamed, replaced or removed by another process while "
                                "this conversion was writing it; nothing was renamed into place: start over with "
                                "--force", path=path)


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
    partial_identity: tuple[int, int] | None = None
    """(device, inode) of the partial the caller created: a worker writes into that file or into none."""
    device: str = "cpu"
    """Where workers encode (``SourceContext.device``)."""


@dataclass(frozen=True)
class TensorDone:
    name: str
    sha256: str
    nbytes: int
    seconds: float
    """Time spent producing and writing the tensor (reading, decoding, encoding, pwrite)."""


def produce_tensor(context: SourceContext, job: TensorJob, put: Callable[["np.ndarray", int], None]) -> TensorDone:
    """Produce ``job``'s payload, handing each piece to ``put(piece, offset within the payload)``, hashing it as it
    goes; the source pages read are released afterwards."""
    return start_tensor(context, job, put).result()


class PendingTensor:
    """A tensor produced whose last pieces may still be being written and hashed (:func:`start_tensor`)."""

    def __init__(self, job: TensorJob, start: float, written: int, digest, behind: "_WriteBehind | None"):
        self._job, self._start, self._written, self._digest, self._behind = job, start, written, digest, behind

    def done(self) -> bool:
        return self._behind is None or self._behind.finished()

    def result(self) -> TensorDone:
        """Wait for the writes; the tensor's record, or the first write failure."""
        end = None
        if self._behind is not None:
            behind, self._behind = self._behind, None
            with timed("wait_tensor_writes"):
                behind.close()
            end = behind.last_write
        if self._written != self._job.nbytes:
            raise FormatError(f"produced {self._written} bytes, the plan has {self._job.nbytes}",
                              tensor=self._job.name)
        return TensorDone(self._job.name, self._digest.hexdigest(), self._written,
                          (end or time.perf_counter()) - self._start)


def start_tensor(context: SourceContext, job: TensorJob, put: Callable[["np.ndarray", int], None]) -> PendingTensor:
    """:func:`produce_tensor` up to the writes: on a GPU, the last batches may still be encoding, and are written
    and hashed in a thread, when this returns, so that the next tensor is read and queued meanwhile (the GPU never
    waits for the host; a Q2_K tensor encodes faster than one thread hashes its bytes)."""
    start = time.perf_counter()
    digest = hashlib.sha256()
    written = 0
    put = _refusing_invalid_blocks(job, put)
    behind = _WriteBehind(put, digest) if context.device != "cpu" else None
    try:
        with contextlib.closing(tensor_bytes(context, job)) as produced:
            for piece in produced:
                if written + piece.nbytes > job.nbytes:
                    raise FormatError(f"produced more than the {job.nbytes} bytes planned", tensor=job.name)
                if behind is not None:
                    behind.submit(piece, written)
                else:
                    put(piece, written)
                    digest.update(piece)
                written += piece.nbytes
    except BaseException:
        if behind is not None:
            behind.close(quiet=True)
        raise
    finally:
        with timed("release") if behind is not None else contextlib.nullcontext():   # a GPU stream's steps only
            context.release()
    return PendingTensor(job, start, written, digest, behind)


def _refusing_invalid_blocks(job: TensorJob, put: Callable[["np.ndarray", int], None]):
    """``put`` behind the check ggml's loader makes (:func:`quantkit.formats.rowdata.check_row_data`): a finite
    weight beyond what the type can hold (above 65504 in F16; a block's F16 scale overflowing in Q8_0 at ~8.3e6)
    encodes as Inf, which llama.cpp refuses to load and ``validate`` fails; refused here, naming the row, before
    the bytes are written.  F32 outputs are the checked input itself, and integer types and NVFP4 have no
    invalid values."""
    from ..formats.rowdata import SCALE_FIELDS, check_row_data
    from ..formats.registry import GGMLType, layout

    if job.kind not in ("encode", "copy") or job.qtype == GGMLType.F32 or not SCALE_FIELDS.get(job.qtype):
        return put
    row_bytes = layout(job.qtype).row_bytes(int(job.output.shape[-1]))
    type_size = layout(job.qtype).type_size

    def put_checked(piece: "np.ndarray", at: int) -> None:
        problem = check_row_data(job.qtype, piece)
        if problem is not None:
            row = (at + problem.first_block * type_size) // row_bytes
            raise EncodeError(f"row {row}: {problem.what} once encoded as {job.qtype.name} (a weight's magnitude "
                              f"exceeds what the type holds); choose a wider type for this tensor in the recipe",
                              tensor=job.name)
        put(piece, at)
    return put_checked


class _InFlight:
    """The bytes held by a process's pieces between their queuing and their write, at most :data:`IN_FLIGHT_BYTES`
    (a piece larger than that alone)."""

    def __init__(self):
        self._held = 0
        self._changed = threading.Condition()

    def hold(self, nbytes: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self._held or self._held + nbytes <= IN_FLIGHT_BYTES)
            self._held += nbytes

    def free(self, nbytes: int) -> None:
        with self._changed:
            self._held -= nbytes
            self._changed.notify_all()


_IN_FLIGHT = _InFlight()


class _WriteBehind:
    """Wait for a GPU stream's pieces (:func:`quantkit.convert.gpu_stream.payload`), ``put`` and hash them in a
    thread, in order, while the next batches are queued (on the CPU the encoders are the bound and the workers use
    every core).  :meth:`submit` waits while the pieces of all tensors not yet written hold :data:`IN_FLIGHT_BYTES`;
    the first failure is raised by the next :meth:`submit` or by :meth:`close`."""

    def __init__(self, put: Callable[["np.ndarray", int], None], digest):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.last_write: float | None = None
        self._thread = threading.Thread(target=self._run, args=(put, digest), daemon=True, name="quantkit-write")
        self._thread.start()

    def _run(self, put, digest) -> None:
        while (item := self._queue.get()) is not None:
            piece, at, held = item
            try:
                if self._error is None:
                    piece = payload(piece)   # a GPU batch: waits for its download here, not in the producer
                    with timed("write"):
                        put(piece, at)
                    with timed("hash"):
                        digest.update(piece)
            except BaseException as exc:  # noqa: BLE001 - raised in the producing thread
                self._error = exc
            finally:
                _IN_FLIGHT.free(held)
            self.last_write = time.perf_counter()
            self._queue.task_done()

    def submit(self, piece, at: int) -> None:
        if self._error is not None:
            raise self._error
        held = held_bytes(piece)
        with timed("wait_write_queue"):
            _IN_FLIGHT.hold(held)
        self._queue.put((piece, at, held))

    def finished(self) -> bool:
        """Every piece submitted so far is written (or a write failed)."""
        return self._queue.unfinished_tasks == 0

    def close(self, *, quiet: bool = False) -> None:
        """Wait for every piece to be written; raise the first failure unless ``quiet`` (already failing)."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None and not quiet:
            raise self._error


class TensorWriter:
    """Produces tensors by name and writes them into the partial file (one per process)."""

    def __init__(self, setup: WorkerSetup):
        self.setup = setup
        self.context = SourceContext(setup.source_path, setup.model_type, setup.imatrix_path,
                                     setup.imatrix_shapes, setup.allow_synthetic_imatrix, setup.device)
        try:
            self._fd = os.open(setup.partial_path, os.O_RDWR)
        except FileNotFoundError:
            raise partial_gone(setup.partial_path) from None
        st = os.fstat(self._fd)
        if setup.partial_identity is not None and (st.st_dev, st.st_ino) != setup.partial_identity:
            self.close()
            raise partial_gone(setup.partial_path)

    def run(self, name: str) -> TensorDone:
        return self.finish(name, self.start(name))

    def start(self, name: str) -> PendingTensor:
        """Produce tensor ``name`` (its last writes may still be under way: :meth:`finish`)."""
        offset = self.setup.offsets[name]
        with self._named(name):
            return start_tensor(self.context, self.setup.jobs[name],
                                lambda piece, at: pwrite_all(self._fd, piece, offset + at))

    def finish(self, name: str, pending: PendingTensor) -> TensorDone:
        with self._named(name):
            return pending.result()

    @contextlib.contextmanager
    def _named(self, name: str):
        """A full filesystem as the error that names the partial and the tensor."""
        try:
            yield
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(self.setup.partial_path, name) from None
            raise

    def fileno(self) -> int:
        """The partial's descriptor (open for reading and writing)."""
        return self._fd

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
    """A worker's life; a parent gone away (its pipe closed: killed, or stopping) ends it quietly, not with a
    traceback on the terminal the user's Ctrl-C or kill came from."""
    try:
        _serve(conn)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass


def _serve(conn) -> None:
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
    if setup.device != "cpu":
        with contextlib.suppress(Exception):
            from ..kernels.gpu_encode import warm_device

            warm_device(setup.device)
    conn.send(("ready",))
    try:
        writer = TensorWriter(setup)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the failure of its first tensor
        failure = _portable(exc)
        with contextlib.suppress(EOFError, OSError):
            while (name := conn.recv()) is not None:
                conn.send(("error", name, failure))
        return
    try:
        while (name := conn.recv()) is not None:
            try:
                conn.send(("ok", writer.run(name)))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
                conn.send(("error", name, _portable(exc)))
    finally:
        writer.close()


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while workers start: they inherit it, so a Ctrl-C to the terminal's process group cannot
    interrupt their interpreter's start-up (a KeyboardInterrupt traceback from multiprocessing's spawn, before
    :func:`_serve` ignores it itself).  The parent's own Ctrl-C in this window of a few milliseconds is lost.
    Only the main thread may change signal handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _Worker:
    def __init__(self, context, index: int):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True,
                                       name=f"quantkit-convert-{index}")
        self.process.start()
        child.close()
        self.task: str | None = None

    def send(self, message, setup: "WorkerSetup") -> None:
        try:
            self.conn.send(message)
        except OSError:   # the worker is gone (BrokenPipeError and the like)
            raise _died(self, setup) from None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _died(worker: _Worker, setup: "WorkerSetup") -> QuantkitError:
    """What became of a worker that vanished: the partial taken away under it, or the signal / exit code."""
    worker.process.join(WORKER_EXIT_TIMEOUT)   # a killed process in the middle of I/O can take a moment to go
    if setup.partial_identity is not None and partial_identity(setup.partial_path) != setup.partial_identity:
        return partial_gone(setup.partial_path)
    code = worker.process.exitcode
    if code is None:
        why = "it is still exiting"
    elif code == -signal.SIGKILL:
        why = "killed by signal 9, SIGKILL: the kernel's out-of-memory killer or another process"
    elif code < 0:
        why = f"killed by signal {-code}, {_signal_name(-code)}"
    else:
        why = f"exit code {code}"
    return QuantkitError(f"worker process {worker.process.pid} died ({why}) while producing this tensor; the "
                         f"partial output and its journal are kept: run again with --resume", tensor=worker.task)


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
            with _sigint_ignored():
                self._workers = [_Worker(context, i) for i in range(self.jobs)]
        self._started = False

    def run(self, setup: WorkerSetup, names: Iterable[str]) -> Iterator[TensorDone]:
        """Produce and write the named tensors, yielding each as it completes (in completion order)."""
        if self._started:
            raise RuntimeError("WorkerPool.run() may be called once")
        self._started = True
        if not self._workers:
            yield from self._run_here(setup, names)
            return
        queue = deque(names)

        def assign(worker: _Worker) -> None:
            worker.task = queue.popleft() if queue else None
            if worker.task is not None:
                worker.send(worker.task, setup)

        # Each worker first compiles (or loads from numba's disk cache) its own share of the encoders the
        # tensors need, all shares in parallel; then every worker finds every kernel in the cache.
        kinds = encoder_kinds(setup.jobs[name] for name in queue)
        if setup.device != "cpu":   # the types the GPU encodes need no CPU kernel
            from ..kernels.gpu_encode import supports

            kinds = [k for k in kinds if not supports(k[0])]
        for i, worker in enumerate(self._workers):
            worker.send(setup, setup)
            worker.send(kinds[i::len(self._workers)], setup)
        for worker in self._workers:
            try:
                worker.conn.recv()
            except (EOFError, OSError):
                raise _died(worker, setup) from None
        for worker in self._workers:
            assign(worker)
        while any(w.task is not None for w in self._workers):
            busy = [w for w in self._workers if w.task is not None]
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
            for worker in busy:
                try:
                    message = worker.conn.recv() if worker.conn in ready or worker.conn.poll() else None
                except (EOFError, OSError):   # the pipe closed or was reset: the worker is gone
                    raise _died(worker, setup) from None
                if message is None:
                    if worker.process.sentinel in ready:
                        raise _died(worker, setup)
                    continue
                if message[0] == "error":
                    raise message[2]
                yield message[1]
                assign(worker)

    @staticmethod
    def _run_here(setup: WorkerSetup, names: Iterable[str]) -> Iterator[TensorDone]:
        """In this process, one tensor at a time; on a GPU the next tensor encodes while up to
        :data:`TENSORS_BEHIND` earlier ones finish their writes."""
        writer = TensorWriter(setup)
        behind: deque = deque()
        try:
            for name in names:
                behind.append((name, writer.start(name)))
                while behind and (len(behind) > TENSORS_BEHIND or behind[0][1].done()):
                    yield writer.finish(*behind.popleft())
            while behind:
                yield writer.finish(*behind.popleft())
        finally:
            for _, pending in behind:   # failing: stop the writes still under way
                with contextlib.suppress(BaseException):
                    pending.result()
            writer.close()

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


# -- how many workers ---------------------------------------------------------------------------------------------

def _unit_bytes(job: TensorJob) -> int:
    """float32 bytes of the largest unit a job holds at once (see :mod:`quantkit.convert.tensors`)."""
    shape = job.output.shape
    if len(shape) == 3:
        return 4 * math.prod(shape[1:])   # one expert
    whole = 4 * math.prod(shape)
    return whole if any(m.transform for m in job.output.sources) else min(whole, ROW_CHUNK_BYTES)


def worker_memory(jobs: Iterable[TensorJob]) -> int:
    """Estimated peak resident bytes of one worker over these jobs: its base plus a few copies of the largest
    float32 unit it holds at once."""
    return WORKER_BASE_BYTES + UNIT_MEMORY_FACTOR * max((_unit_bytes(j) for j in jobs), default=0)


def bound_jobs(requested: int, per_worker_bytes: int, *, cpus: int | None = None,
               memory: int | None = None) -> tuple[int, str | None]:
    """(jobs to run, a note when fewer than ``requested``): no more workers than CPUs, nor than ``memory`` holds
    at ``per_worker_bytes`` each (measured now unless given)."""
    cpus = available_cpus() if cpus is None else cpus
    memory = available_memory() if memory is None else memory
    jobs, why = max(1, requested), []
    if jobs > cpus:
        jobs = cpus
        why.append(f"{cpus} CPU{'s' if cpus > 1 else ''} available")
    if memory is not None and jobs > 1 and jobs * per_worker_bytes > memory:
        jobs = max(1, memory // per_worker_bytes)
        why.append(f"{memory / 2**30:.1f} GiB of memory available at ~{per_worker_bytes / 2**20:.0f} MiB per "
                   f"worker")
    if jobs >= requested:
        return requested, None
    return jobs, f"using {jobs} job{'s' if jobs > 1 else ''} instead of {requested}: {'; '.join(why)}"
