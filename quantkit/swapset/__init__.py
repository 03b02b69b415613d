"""Swapsets: sidecar files that swap selected tensor families of a checkpoint for another encoding.

Public API (the CLI and other tools call only these):

- :func:`build_swapset` / :func:`plan_swapset` with a :class:`SwapsetRequest`: make (or only plan) a sidecar;
- :func:`list_families`: the families of a checkpoint's architecture and what each selects;
- :func:`status`, :func:`gc`, :func:`record_quality`: the inventory beside a checkpoint;
- :func:`apply_sidecars`: the replacement tensors the runtime loads instead of the checkpoint's, and
  :func:`sidecar_replacements`: their float32 values as the runtime's ``replace`` hook takes them;
- :func:`validate_sidecar`: the structural, numeric and provenance checks ``quantkit validate`` runs;
- :func:`sidecars_line`, :func:`record_comparison`: a score table's record of the sidecars it was scored with,
  and a plain-vs-sidecar comparison stored in the sidecar's manifest.

Modules: :mod:`.families` (tables), :mod:`.encodings` (target encodings), :mod:`.manifest` (the manifest format),
:mod:`.build`, :mod:`.draft`, :mod:`.calibrate` (torch, lazily), :mod:`.inventory`, :mod:`.apply`,
:mod:`.validate`, :mod:`.writer`, :mod:`.tensors`, :mod:`.quality`.
"""
from .apply import Replacement, apply_sidecars, sidecar_replacements
from .build import BuildResult, SwapsetPlan, SwapsetRequest, build_swapset, list_families, plan_swapset
from .families import FAMILIES, Family
from .inventory import StatusReport, gc, record_quality, status
from .quality import record_comparison, sidecars_line
from .validate import ValidationReport, validate_sidecar

__all__ = ["FAMILIES", "BuildResult", "Family", "Replacement", "StatusReport", "SwapsetPlan", "SwapsetRequest",
           "ValidationReport", "apply_sidecars", "build_swapset", "gc", "list_families", "plan_swapset",
           "record_comparison", "record_quality", "sidecar_replacements", "sidecars_line", "status",
           "validate_sidecar"]
