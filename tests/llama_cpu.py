"""Where the tests' llama.cpp runs keep their weights, on CPUs with AMX.

By default llama.cpp puts a weight in the first of the CPU backend's "extra" buffer types that takes it: on a CPU
that reports AMX (``amx_int8``), ggml's AMX buffer (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, F16 weights),
else its interleaved ``CPU_REPACK`` one.  On the lent Xeons that report AMX, llama-cpp-python 0.3.36 (built with
``-march=native``) dies in ``ggml_backend_amx_mul_mat`` at its first ``ldtilecfg`` (SIGSEGV, 2026-12-04); and
where AMX works its products are not the ``CPU_REPACK`` ones that quantkit's ``--arithmetic ggml-cpu`` and
``ggml_ref.mul_mat(repack=True)`` reproduce.  So on such CPUs the tests run llama.cpp with its weights in plain
CPU buffers (llama-cli's ``--no-repack``), and the checks of llama.cpp's default placement are left out.
"""
from __future__ import annotations

import contextlib
from pathlib import Path


def _cpu_has_amx() -> bool:
    try:
        return any(line.startswith("flags") and " amx_int8" in line
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


CPU_HAS_AMX = _cpu_has_amx()


def repack(wanted: bool = True) -> bool:
    """Whether a llama.cpp run may keep llama.cpp's default weight placement (``use_extra_bufts``)."""
    return wanted and not CPU_HAS_AMX


@contextlib.contextmanager
def placement(llama_cpp, wanted: bool = True):
    """In this process: llama.cpp models loaded inside use extra buffer types only if :func:`repack` allows."""
    if repack(wanted):
        yield
        return
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def plain_params():
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = plain_params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default_params
