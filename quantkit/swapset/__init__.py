"""Swapsets: sidecar files that swap selected tensor families of a checkpoint for another encoding.

Public API (the CLI and other tools call only these):

- :func:`build_swapset` / :func:`plan_swapset` with a :class:`SwapsetRequest`: make (or only plan) a sidecar;
- :func:`list_families`: the families of a checkpoint's architecture and what each selects;
- :func:`status`, :func:`gc`, :func:`record_quality`: the inventory beside a checkpoint;
- :func:`apply_sidecars`: the replacement tensors the runtime loads instead of the checkpoint's;
- :func:`validate_sidecar`: the structural, numeric and provenance checks ``quantkit validate`` runs.

Modules: :mod:`.families` (tables), :mod:`.encodings` (target encodings), :mod:`.manifest` (the manifest format),
:mod:`.build`, :mod:`.draft`, :mod:`.calibrate` (torch, lazily), :mod:`.inventory`, :mod:`.apply`,
:mod:`.validate`, :mod:`.writer`, :mod:`.tensors`.
"""
from .apply import Replacement, apply_sidecars
from .build import BuildResult, SwapsetPlan, SwapsetRequest, build_swapset, list_families, plan_swapset
from .families import FAMILIES, Family
from .inventory import StatusReport, gc, record_quality, status
from .validate import ValidationReport, validate_sidecar

__all__ = ["FAMILIES", "BuildResult", "Family", "Replacement", "StatusReport", "SwapsetPlan", "SwapsetRequest",
           "ValidationReport", "apply_sidecars", "build_swapset", "gc", "list_families", "plan_swapset",
           "record_quality", "status", "validate_sidecar"]
