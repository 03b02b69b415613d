"""Numeric formats: the GGML tensor types, their layouts and codecs, and the small float codecs.

Public entry points: :func:`encode`, :func:`encode_experts`, :func:`decode`, :func:`get_format`.
"""
from .api import decode, encode, encode_experts, tensor_nbytes
from .registry import GGMLType, ImatrixUse, QuantFormat, all_formats, get_format

__all__ = ["GGMLType", "ImatrixUse", "QuantFormat", "all_formats", "decode", "encode", "encode_experts",
           "get_format", "tensor_nbytes"]
