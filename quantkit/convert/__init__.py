"""Conversion of a safetensors checkpoint to GGUF: plan first (:mod:`.plan`), then execute the plan."""
from .plan import Plan, PlannedTensor, build_plan

__all__ = ["Plan", "PlannedTensor", "build_plan"]
