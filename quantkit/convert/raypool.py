"""Produce planned tensors as Ray tasks (``quantkit convert --executor ray``), behind the interface of
:class:`~quantkit.convert.pool.WorkerPool`: ``run(setup, names)`` yields a :class:`TensorDone` per tensor as it
completes, and the caller journals it, so the journal, ``--resume`` and the final verification are the same.

One task per tensor.  Only the :class:`WorkerSetup` (put into Ray's object store once) and a tensor name travel to
a task; each task opens the source itself (the same path on every host: shared storage or a local copy) and,
per :data:`TRANSFERS`:

- ``write``: writes its payload with ``pwrite`` at the planned offset of the partial output, which every host must
  see at the driver's path (a shared filesystem), and returns only the :class:`TensorDone`;
- ``return``: returns the payload's bytes, which the driver writes at the offset and hashes again;
- ``auto`` (default): writes where the partial is visible as the driver's file, returns bytes elsewhere.

Is it the driver's file?  On the driver's node the device and inode must be the ones the driver created (as for
process workers); on another node the device number of a network filesystem differs, so the inode and size must
match.  A Ray worker process keeps its opened source and partial between tasks of one run.

A worker process (or node) that dies mid-tensor costs only that tensor: Ray runs the task again
(:data:`quantkit.cluster.TASK_RETRIES` times), rewriting the whole payload at the same offset.  A task that fails
with an error (a bad tensor, a full disk) stops the run with that error, like a process worker's; tensors already
journaled are kept for ``--resume``.  At most :data:`IN_FLIGHT_PER_CPU` tasks per cluster CPU are submitted at
once, which bounds the payload bytes held in the object store in ``return`` mode.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Iterator

from ..cluster import TASK_RETRIES, cluster_cpus, ray_session, task_result
from ..errors import ClusterError, ConcurrentWriteError
from ..formats.warm import encoder_kinds
from ..io.gguf_writer import pwrite_all
from .pool import TensorDone, TensorWriter, WorkerSetup, partial_gone, produce_tensor
from .tensors import SourceContext

#: How tasks deliver their payloads (see the module docstring).
TRANSFERS = ("auto", "write", "return")
#: Tasks submitted per cluster CPU: enough to keep every CPU busy while results travel back.
IN_FLIGHT_PER_CPU = 2
#: Test hook: in a worker whose environment names a directory here, the first task to rename ``armed`` in it to
#: ``fired`` exits its process after writing its first piece (the killed-worker test of tests/test_ray_executor.py).
KILL_ONCE_ENV = "QUANTKIT_RAY_KILL_ONCE_DIR"


@dataclass(frozen=True)
class RayRun:
    """What each task is told besides its tensor's name."""

    token: str
    """Names this run: a worker process keeps one writer per run."""
    transfer: str
    driver_node: str
    file_size: int
    """The partial's size: with its inode, how another node recognizes the driver's file."""


# -- in the Ray worker --------------------------------------------------------------------------------------------

_current: dict = {}   # token -> TensorWriter (write) or SourceContext (return): one run at a time per process


def _kill_once_hook() -> None:
    where = os.environ.get(KILL_ONCE_ENV)
    if where:
        with contextlib.suppress(FileNotFoundError):
            os.rename(os.path.join(where, "armed"), os.path.join(where, "fired"))
            os._exit(17)


def _sees_driver_file(setup: WorkerSetup, run: RayRun, same_node: bool) -> bool:
    if same_node:
        return True   # TensorWriter checks device and inode
    try:
        st = os.stat(setup.partial_path)
    except OSError:
        return False
    return setup.partial_identity is not None and st.st_ino == setup.partial_identity[1] \
        and st.st_size == run.file_size


def _producer(setup: WorkerSetup, run: RayRun):
    found = _current.get(run.token)
    if found is not None:
        return found
    for old in _current.values():
        old.close() if isinstance(old, TensorWriter) else old.release()
    _current.clear()
    import numba
    import ray

    numba.set_num_threads(1)   # the tasks are the parallelism
    same_node = ray.get_runtime_context().get_node_id() == run.driver_node
    visible = run.transfer != "return" and _sees_driver_file(setup, run, same_node)
    if run.transfer == "write" and not visible:
        raise ConcurrentWriteError("the partial output is not visible at this path on a worker's node (not a "
                                   "shared filesystem): use --ray-transfer return or auto", path=setup.partial_path)
    if visible:
        producer = TensorWriter(setup if same_node else replace(setup, partial_identity=None))
    else:
        producer = SourceContext(setup.source_path, setup.model_type, setup.imatrix_path, setup.imatrix_shapes,
                                 setup.allow_synthetic_imatrix, setup.device)
    _current[run.token] = producer
    return producer


def produce_task(setup: WorkerSetup, run: RayRun, name: str) -> tuple[TensorDone, bytes | None]:
    """One tensor: written into the partial (no bytes returned) or returned as bytes."""
    producer = _producer(setup, run)
    if isinstance(producer, TensorWriter):
        offset = setup.offsets[name]
        first = [True]

        def put(piece, at: int) -> None:
            pwrite_all(producer.fileno(), piece, offset + at)
            if first[0]:
                first[0] = False
                _kill_once_hook()

        try:
            return produce_tensor(producer.context, setup.jobs[name], put), None
        except OSError as exc:
            from ..io.atomic import is_out_of_space
            from .pool import out_of_space

            if is_out_of_space(exc):
                raise out_of_space(setup.partial_path, name) from None
            raise
    payload = bytearray(setup.jobs[name].nbytes)

    def keep(piece, at: int) -> None:
        payload[at:at + piece.nbytes] = piece.tobytes()

    done = produce_tensor(producer, setup.jobs[name], keep)
    _kill_once_hook()
    return done, bytes(payload)


def warm_task(kinds) -> None:
    from ..formats.warm import warm_encoders

    with contextlib.suppress(Exception):   # a failure comes back with its tensor when that tensor is encoded
        warm_encoders(kinds)


# -- in the driver ------------------------------------------------------------------------------------------------

class RayPool:
    """Tensor jobs as Ray tasks on the cluster at ``address`` (None: a local cluster of ``jobs`` CPUs started for
    the run).  A context manager, like :class:`~quantkit.convert.pool.WorkerPool`."""

    def __init__(self, jobs: int, address: str | None = None, transfer: str = "auto"):
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, not {transfer!r}")
        self.transfer = transfer
        self._session = ray_session(address, jobs, "quantkit convert --executor ray")
        self._ray = self._session.__enter__()
        self._pending: dict = {}
        self._started = False

    def run(self, setup: WorkerSetup, names: Iterable[str]) -> Iterator[TensorDone]:
        if self._started:
            raise RuntimeError("RayPool.run() may be called once")
        self._started = True
        ray = self._ray
        queue = deque(names)
        cpus = cluster_cpus(ray)
        warm = ray.remote(num_cpus=1)(warm_task)
        kinds = encoder_kinds(setup.jobs[n] for n in queue)
        ray.get([warm.remote(kinds[i::cpus]) for i in range(min(cpus, len(kinds)))])
        produce = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(produce_task)
        run = RayRun(uuid.uuid4().hex, self.transfer, ray.get_runtime_context().get_node_id(),
                     os.stat(setup.partial_path).st_size)
        setup_ref = ray.put(setup)
        fd = os.open(setup.partial_path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if setup.partial_identity is not None and (st.st_dev, st.st_ino) != setup.partial_identity:
                raise partial_gone(setup.partial_path)
            while queue or self._pending:
                while queue and len(self._pending) < IN_FLIGHT_PER_CPU * cpus:
                    name = queue.popleft()
                    self._pending[produce.remote(setup_ref, run, name)] = name
                ready, _ = ray.wait(list(self._pending), num_returns=1)
                for ref in ready:
                    name = self._pending.pop(ref)
                    try:
                        done, payload = task_result(ray, ref, "tensor task", tensor=name)
                    except ClusterError as exc:
                        raise ClusterError(f"{exc.detail}; the partial output and its journal are kept: run again "
                                           f"with --resume", tensor=name) from None
                    if payload is not None:
                        yield self._write(fd, setup, done, payload)
                    else:
                        yield done
        finally:
            os.close(fd)

    @staticmethod
    def _write(fd: int, setup: WorkerSetup, done: TensorDone, payload: bytes) -> TensorDone:
        """Write a returned payload at its offset; the journal gets the hash of the bytes written here."""
        digest = hashlib.sha256(payload).hexdigest()
        if len(payload) != done.nbytes or digest != done.sha256:
            raise ClusterError("the payload a Ray task returned differs from the hash it reported", tensor=done.name)
        pwrite_all(fd, payload, setup.offsets[done.name])
        return done

    def close(self) -> None:
        ray = self._ray
        for ref in self._pending:   # after an error or an interrupt: nothing may go on writing into the partial
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        self._pending.clear()
        self._session.__exit__(None, None, None)

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close()


__all__ = ["IN_FLIGHT_PER_CPU", "KILL_ONCE_ENV", "TRANSFERS", "RayPool", "RayRun"]
