"""Transport parts: move a large artifact as verifiable pieces and put it back together.

* :mod:`.sizes` — ``3MB``/``49GB`` (powers of 1000) and ``1.5GiB`` (powers of 1024), one parser;
* :mod:`.manifest` — the JSON manifest beside the parts (its format is that module's docstring);
* :mod:`.split` — byte parts, or llama.cpp ``-00001-of-0000N.gguf`` shards split at tensor boundaries;
* :mod:`.assemble` — checks, free-space preflight, copy while hashing, resume from a journal, atomic rename;
* :mod:`.fetch` — resumable downloads from a Hugging Face repository, verified against a manifest;
* :mod:`.stream` — the bounded, hashing copy all of them use.

``quantkit validate`` proves a manifest or a shard set without assembling (:mod:`quantkit.validate.transport`).
"""
from .manifest import Manifest, load_manifest
from .sizes import parse_size
from .split import split_file

# (``assemble`` is not re-exported: the name is the module's, which tests patch.)
__all__ = ["Manifest", "load_manifest", "parse_size", "split_file"]
