"""Ray clusters for ``--executor ray`` (``convert``, ``imatrix collect``, ``score``): connect or start one.

With an address, quantkit joins that cluster as a driver (``ray start --head`` on one host and ``ray start
--address HEAD`` on the others; every host sees the source, and ideally the output, at the same path).  Without
one, quantkit starts a local cluster of ``workers`` CPUs for the run and shuts it down afterwards.  Ray itself
schedules tasks, retries a task whose worker process or node died (:data:`TASK_RETRIES`) and kills a driver's
workers when the driver goes away; quantkit has no cluster code of its own.
"""
from __future__ import annotations

import contextlib
import logging
import socket
from typing import Iterator

from .errors import ClusterError
from .extras import require_ray

#: Times Ray runs a task again after its worker process (or node) died under it: a lost worker costs its tasks.
TASK_RETRIES = 3
#: Seconds a cluster's head may take to accept a TCP connection: ray.init itself waits without limit for a head
#: that never answers, printing Ray's own retry warnings.
CONNECT_SECONDS = 10.0


def check_reachable(address: str) -> None:
    """Refuse, in one line, a ``HOST:PORT`` (or ``ray://HOST:PORT``) where nothing accepts a connection; other
    forms (``auto``, a cluster Ray finds itself) are left to Ray."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or "/" in hostport:
        return
    try:
        number = int(port)
        if not 0 < number < 65536:
            raise ValueError
    except ValueError:
        raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: {port!r} is not a port") from None
    try:
        socket.create_connection((host.strip("[]"), number), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: nothing answers there within "
                           f"{CONNECT_SECONDS:.0f} s ({reason})") from None


@contextlib.contextmanager
def ray_session(address: str | None, workers: int, what: str) -> Iterator[object]:
    """The ``ray`` module, connected to the cluster at ``address`` or to a local cluster of ``workers`` CPUs
    started here; disconnected (and the local cluster stopped) on leaving."""
    ray = require_ray(what)
    if address is not None:
        check_reachable(address)
    if ray.is_initialized():
        raise ClusterError("this process is already connected to a Ray cluster; quantkit connects for each run")
    options = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                   configure_logging=True)
    try:
        if address is None:
            # "local": a new cluster, never one a `ray start` left on this machine
            ray.init(address="local", num_cpus=max(1, workers), **options)
        else:
            ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        ray.shutdown()
        where = f"the Ray cluster at {address!r}" if address else "a local Ray cluster"
        hint = ("; a cluster with token authentication (Ray's default) needs RAY_AUTH_MODE=token and its token "
                "(~/.ray/auth_token or RAY_AUTH_TOKEN) in this environment" if address else "")
        raise ClusterError(f"cannot {'connect to' if address else 'start'} {where}: "
                           f"{' '.join(str(exc).split())[:300]}{hint}") from None
    except BaseException:   # Ctrl-C while the local cluster starts: its processes must not outlive the run
        ray.shutdown()
        raise
    try:
        yield ray
    finally:
        ray.shutdown()


def cluster_cpus(ray) -> int:
    """CPUs the connected cluster has (at least 1)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def lost_worker_errors(ray) -> tuple[type[BaseException], ...]:
    """The exceptions of a task whose worker process or node died more often than it was retried."""
    names = ("WorkerCrashedError", "NodeDiedError", "OwnerDiedError", "ObjectLostError", "LocalRayletDiedError")
    return tuple(getattr(ray.exceptions, n) for n in names if hasattr(ray.exceptions, n))


def task_result(ray, ref, what: str, tensor: str | None = None):
    """``ray.get(ref)``: a task's own error re-raised as it was raised; a lost worker or actor, after Ray's
    retries, as a :class:`ClusterError` naming ``what`` (e.g. ``"scoring actor"``)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        raise (exc.cause if exc.cause is not None else ClusterError(str(exc), tensor=tensor)) from None
    except ray.exceptions.RayActorError as exc:
        cause = getattr(exc, "error_msg", "") or str(exc)
        raise ClusterError(f"a Ray {what} failed: {' '.join(str(cause).split())[:300]}", tensor=tensor) from None
    except lost_worker_errors(ray) as exc:
        raise ClusterError(f"the Ray worker running this {what} was lost {TASK_RETRIES + 1} times "
                           f"({type(exc).__name__})", tensor=tensor) from None


__all__ = ["TASK_RETRIES", "cluster_cpus", "lost_worker_errors", "ray_session", "task_result"]
