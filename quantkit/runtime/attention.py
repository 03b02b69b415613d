"""SDPA that stays linear in memory for grouped-query attention in float32 on CUDA.

transformers' ``sdpa`` attention hands grouped-query attention to torch as ``enable_gqa=True`` when there is no
mask (scoring: causal, no padding).  On CUDA only the flash and cuDNN kernels take that flag, and they compute in
half precision: in float32 torch falls back to the math kernel, which holds a ``[heads, n, n]`` score matrix per
layer (2.7 GB at 8192 tokens for four heads, 69 GB at 16K tokens for 16).  :func:`sdpa_attention_forward` repeats
the key/value heads instead (what transformers does with a mask; ``heads x n x head_dim`` more memory, linear in
n), so torch's memory-efficient kernel runs: attention memory is then O(n), no score matrix.  The product is
the same attention: the wrapper is installed as transformers' ``sdpa`` function for the process (it changes
nothing but the kernel choice, and only for float32 CUDA tensors).  Plain causal attention (no mask, as many keys as
queries: the scoring passes) goes to a flash-attention Triton launch instead
(:mod:`quantkit.kernels.triton_causal_attention`: tensor-core bf16x3 products, key/value heads read in place, O(n)
memory); the repeat serves what it does not take.

Inside :func:`one_sequence_per_row` transformers' search of the position ids for several sequences packed in one
row is skipped (the runtime's rows are one sequence each, positions ``0..n-1``): it reads a flag back from the
device (a host wait per pass) and, while a CUDA graph is being captured, skips that read and builds an explicit
``[n, n]`` mask instead of SDPA's causal kernel, so a captured pass would compute otherwise than the eager one.
:func:`replace_in_passes` gives transformers functions the runtime's versions inside these passes only.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref

import torch

_WRAPPED = "_quantkit_sdpa"
_ONE_SEQUENCE = contextvars.ContextVar("quantkit_one_sequence_per_row", default=False)
_CAUSAL_CHUNKS = contextvars.ContextVar("quantkit_causal_chunks", default=False)


@contextlib.contextmanager
def _raised(flag: contextvars.ContextVar):
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def one_sequence_per_row():
    """Forward passes inside have one sequence per row, positions from 0 (see the module doc)."""
    return _raised(_ONE_SEQUENCE)


def in_one_sequence_per_row() -> bool:
    """Whether the forward pass running is inside :func:`one_sequence_per_row`."""
    return _ONE_SEQUENCE.get()


def causal_chunks():
    """Forward passes inside are consecutive chunks of sequences through transformers' dynamic cache, one
    sequence per row from position 0, right-padded: each chunk's queries see the keys before them, a plain causal
    mask."""
    return _raised(_CAUSAL_CHUNKS)


def in_causal_chunks() -> bool:
    """Whether the forward pass running is inside :func:`causal_chunks`."""
    return _CAUSAL_CHUNKS.get()


def replace_in_passes(module_names, name: str, ours) -> None:
    """Make the function ``name`` of each transformers module of ``module_names`` already imported call ``ours``
    inside the runtime's passes (:func:`one_sequence_per_row`, :func:`causal_chunks`), the module's own function
    elsewhere (tests' references, generation steps); that one is kept as the wrapper's ``theirs``.  Idempotent."""
    for module_name in module_names:
        module = sys.modules.get(module_name)
        if module is None or hasattr(getattr(module, name), "theirs"):
            continue
        theirs = getattr(module, name)

        def function(*args, _theirs=theirs, **kwargs):
            if in_one_sequence_per_row() or in_causal_chunks():
                return ours(*args, **kwargs)
            return _theirs(*args, **kwargs)

        function.theirs = theirs
        setattr(module, name, function)


def _plain_causal(module, query, attention_mask, args, kwargs) -> bool:
    """Whether an SDPA call is plain causal attention over as many keys as queries, on float32 CUDA tensors:
    no mask, dropout, position bias, cache or soft cap (the one-launch kernel,
    :mod:`quantkit.kernels.triton_causal_attention`, computes exactly that)."""
    causal = kwargs.get("is_causal")
    return (attention_mask is None and not args and query.is_cuda and query.dtype == torch.float32
            and query.shape[2] > 1 and not kwargs.get("dropout", 0.0)
            and all(kwargs.get(name) is None for name in ("position_bias", "cache", "softcap"))
            and (getattr(module, "is_causal", True) if causal is None else causal))


def replace_method(module, name: str, ours) -> None:
    """Make ``module.<name>(...)`` call ``ours(module, theirs, ...)``, ``theirs`` the class's method bound to the
    module.  The replacement holds the module weakly: a closure holding it would make a reference cycle (module,
    its method, module) that keeps the module and the weights it reaches on the device after the model is
    dropped, until the garbage collector runs."""
    ref = weakref.ref(module)
    method = getattr(type(module), name)

    def replaced(*args, **kwargs):
        target = ref()
        return ours(target, method.__get__(target), *args, **kwargs)

    setattr(module, name, replaced)


class _OneGroup:
    """An attention module as transformers' SDPA function sees it, with key/value heads already repeated."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def install() -> None:
    """Make transformers' ``sdpa`` attention repeat key/value heads for float32 CUDA tensors, and its packed-sequence
    search answer "none" inside :func:`one_sequence_per_row` (idempotent)."""
    from transformers import masking_utils
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.modeling_utils import AttentionInterface

    search = masking_utils.find_packed_sequence_indices
    if not getattr(search, _WRAPPED, False):
        def find_packed_sequence_indices(position_ids):
            return None if _ONE_SEQUENCE.get() else search(position_ids)

        setattr(find_packed_sequence_indices, _WRAPPED, True)
        masking_utils.find_packed_sequence_indices = find_packed_sequence_indices

    original = AttentionInterface._global_mapping["sdpa"]
    if getattr(original, _WRAPPED, False):
        return

    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        if _plain_causal(module, query, attention_mask, args, kwargs):
            from ..kernels import triton_causal_attention as kernel

            if kernel.fits(query, key, value):
                scaling = kwargs.get("scaling")
                return kernel.causal_attention(query, key, value,
                                               query.shape[-1] ** -0.5 if scaling is None else scaling), None
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1 and attention_mask is None and query.is_cuda and query.dtype == torch.float32:
            return original(_OneGroup(module), query, repeat_kv(key, groups), repeat_kv(value, groups),
                            attention_mask, *args, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(sdpa_attention_forward, _WRAPPED, True)
    AttentionInterface.register("sdpa", sdpa_attention_forward)
