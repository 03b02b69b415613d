"""The llama.cpp source tree vendored in the llama-cpp-python 0.3.36 sdist, for interop tests.

The wheel carries ggml's libraries but not llama.cpp's Python converter (``convert_hf_to_gguf.py``) or its C
sources; tests that compare with the converter need the tree.  ``python -m quantkit.testing.llama_src`` fetches
the sdist from the package index (pip) once into a cache folder and prints the tree's path; tests find it there,
or wherever ``QUANTKIT_LLAMA_CPP_SRC`` points.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_ROOT = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantkit"


def source_dir() -> Path:
    """Where the llama.cpp tree is (or would be): ``QUANTKIT_LLAMA_CPP_SRC``, else the cache folder."""
    env = os.environ.get("QUANTKIT_LLAMA_CPP_SRC")
    return Path(env) if env else CACHE / SDIST_ROOT / "vendor" / "llama.cpp"


def fetch() -> Path:
    """Download and unpack the sdist into the cache unless the tree is already there; return the tree."""
    tree = source_dir()
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(Path(tmp) / SDIST_ROOT, CACHE / SDIST_ROOT)
    return tree


if __name__ == "__main__":
    print(fetch())
