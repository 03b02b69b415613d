"""kq_search.cu's CUDA kernels built for the CPU (``cuda_emu.h``): their thread and warp code checked where there is
no GPU.

The C++ build of ``kq_search.cu`` that CI already runs (``gpu_encode.search_extension("cpu")``) takes the file's
non-CUDA branches: the per-lane functions in plain loops.  This one takes its CUDA branches, as nvcc does, with the
kernels launched on emulated thread blocks, so the CUDA-only code (thread indexing, shared memory, barriers, warp
shuffles, the persistent blocks' strides) runs too.  The source is rewritten only where C++ cannot read CUDA:

* ``__CUDACC__`` becomes ``QK_EMULATED_CUDA`` (the torch headers must not see ``__CUDACC__``);
* the ``c10/cuda`` includes are dropped (``cuda_emu.h`` stands in for the few host calls);
* ``kernel<<<grid, block, shared, stream>>>(args);`` becomes ``qk_emu::launch([&] { kernel(args); }, grid, block,
  shared, stream);``
* ``.is_cuda()`` becomes ``.is_cpu()``: the emulated "device" tensors live on the CPU.

Same arithmetic: nvcc builds the kernels with ``-fmad=false`` and round-to-nearest intrinsics, this build with
``-ffp-contract=off`` (float32 operations on x86-64 round to nearest).
"""
from __future__ import annotations

import re
from pathlib import Path

from ..kernels import gpu_encode

HEADER = Path(__file__).with_name("cuda_emu.h")
KERNELS = Path(gpu_encode.__file__).with_name("kq_search.cu")
_LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)


def _close_paren(text: str, start: int) -> int:
    """Index of the parenthesis closing the one just before ``start``."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("a kernel launch's arguments never close")


def _rewrite_launches(text: str) -> str:
    out, at = [], 0
    for m in _LAUNCH.finditer(text):
        if m.start() < at:
            continue
        end = _close_paren(text, m.end())
        out += [text[at:m.start()], f"::qk_emu::launch([&] {{ {m.group(1)}({text[m.end():end]}); }}, {m.group(2)})"]
        at = end + 1
    return "".join(out) + text[at:]


def emulated_source(source: str) -> str:
    """``source`` (kq_search.cu's text) as C++ against ``cuda_emu.h``."""
    text = re.sub(r"^\s*#include <c10/cuda/[^>]*>\s*$", "", source, flags=re.M)
    text = _rewrite_launches(text.replace("__CUDACC__", "QK_EMULATED_CUDA").replace(".is_cuda()", ".is_cpu()"))
    if "<<<" in text:
        raise ValueError("a kernel launch was left unrewritten")
    # the header inlined, not included: torch's extension cache keys a build by its source text
    return f"#include <torch/extension.h>\n{HEADER.read_text()}\n{text}"


_BUILT: dict[Path, object] = {}


def emulated_extension(source: Path = KERNELS, name: str = "quantkit_kq_search_emulated"):
    """``source`` (kq_search.cu, or a variant of it with the same functions) built with its kernels emulated (the
    build's errors raised: check first that torch can build C++ extensions here)."""
    if source not in _BUILT:
        from torch.utils.cpp_extension import load_inline

        _BUILT[source] = load_inline(name, cpp_sources=[emulated_source(source.read_text())],
                                     functions=gpu_encode.SEARCH_FUNCTIONS,
                                     extra_cflags=["-O2", "-ffp-contract=off", "-fno-fast-math"])
    return _BUILT[source]
