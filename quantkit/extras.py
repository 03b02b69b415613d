"""The optional stacks some commands need, and the one-line instruction that installs each.

convert, validate, inspect, recipes, imatrix info/merge/convert and swapset builds without calibration run on the
base install.  Scoring, fixture capture, imatrix collection, calibrated swapsets and the demo run transformers'
model code on torch: the ``runtime`` extra.  ``--executor ray`` (convert, imatrix collect, score) needs the ``ray``
extra: :func:`require_ray`.  :func:`require_runtime` checks for it before any work starts, so a
missing package is one line naming what to install, not a ``ModuleNotFoundError`` minutes in.
"""
from __future__ import annotations

import importlib

from .errors import MissingDependencyError

#: The modules of the runtime extra (``pyproject.toml``: ``[project.optional-dependencies] runtime``).
RUNTIME_MODULES = ("torch", "transformers")
#: How to install it: torch pinned as the CI installs it (a CPU wheel index works as well).
RUNTIME_INSTALL = "pip install torch==2.13.0 'quantkit[runtime]'"


def missing_runtime_module() -> str | None:
    """The first of the runtime extra's modules that cannot be imported here (torch first: transformers without it
    prints a warning of its own), or None."""
    for name in RUNTIME_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def runtime_message(what: str) -> str:
    return f"{what} needs the runtime extra: {RUNTIME_INSTALL}"


def require_runtime(what: str) -> None:
    """Raise :class:`MissingDependencyError` naming ``what`` (e.g. ``"quantkit score"``) and the install command
    when torch or transformers cannot be imported."""
    if missing_runtime_module() is not None:
        raise MissingDependencyError(runtime_message(what))


#: How to install the Ray executor's extra (``pyproject.toml``: ``[project.optional-dependencies] ray``).
RAY_INSTALL = "pip install 'quantkit[ray]'"


def require_ray(what: str):
    """The ``ray`` module, or :class:`MissingDependencyError` naming ``what`` (e.g. ``"quantkit convert --executor
    ray"``) and the install command."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise MissingDependencyError(f"{what} needs the ray extra: {RAY_INSTALL}") from None
