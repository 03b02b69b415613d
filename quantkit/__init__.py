"""quantkit: convert, validate and score quantized artifacts of very large MoE language models."""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("quantkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"

from .errors import QuantkitError  # noqa: E402
from .formats import GGMLType, decode, encode, encode_experts, get_format  # noqa: E402

__all__ = ["GGMLType", "QuantkitError", "__version__", "decode", "encode", "encode_experts", "get_format"]
