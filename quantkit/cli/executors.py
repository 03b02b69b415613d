"""The options that choose where ``convert``, ``imatrix collect`` and ``score`` run: this machine or a Ray cluster."""
from __future__ import annotations

import re

import click


class TorchDevice(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N``, checked when the option is read (torch says whether the device exists)."""

    name = "cpu|cuda[:N]"
    _FORM = re.compile(r"^(cpu|cuda(:\d+)?)$")

    def convert(self, value, param, ctx):
        if not self._FORM.match(str(value)):
            self.fail(f"unknown device {value!r}: use cpu, cuda or cuda:N", param, ctx)
        return str(value)


def default_jobs() -> int:
    from ..resources import available_cpus

    return available_cpus()


_OPTIONS = [
    click.option("--executor", type=click.Choice(["process", "ray"]), default="process", show_default=True,
                 help="this process, or Ray workers on a cluster (the ray extra) sharing the work"),
    click.option("--address", metavar="HOST:PORT",
                 help="with --executor ray: the cluster to join [default: a local cluster of --jobs CPUs, started "
                      "and stopped by this run]"),
    click.option("-j", "--jobs", type=click.IntRange(min=1), default=default_jobs, show_default="CPUs available",
                 help="with --executor ray and no --address: the local cluster's workers"),
]


def executor_options(func):
    """Add ``--executor``, ``--address`` and ``-j/--jobs`` to a command."""
    for option in reversed(_OPTIONS):
        func = option(func)
    return func


def check_executor(what: str, executor: str, address: str | None) -> None:
    if address is not None and executor != "ray":
        raise click.UsageError("--address needs --executor ray")
    if address is not None and not address.strip():
        raise click.BadParameter("empty: give the cluster head's HOST:PORT", param_hint="--address")
    if executor == "ray":
        from ..extras import require_ray

        require_ray(f"{what} --executor ray")
