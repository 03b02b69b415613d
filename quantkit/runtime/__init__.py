"""The runtime: quantized GGUF files (and safetensors sources) run through transformers' own model code.

Usage::

    from quantkit.runtime import greedy, load_model, logits
    model = load_model("tiny-Q4_K.gguf", device="cpu")      # or a safetensors checkpoint directory
    scores = logits(model, [1, 2, 3])                         # float32 [3, vocab]
    tokens = greedy(model, [1, 2, 3], 24).tokens              # greedy continuation, KV cache

This package and the GPU kernels it loads are the only parts of quantkit that import torch.  Layout: weight
sources (:mod:`.weights`), the inverse of the architecture maps (:mod:`.inverse`), packed weights decoded on use
(:mod:`.packed`), model construction and the forward pass (:mod:`.loader`), greedy generation with transformers'
KV cache (:mod:`.generate`).
"""
from .generate import Greedy, greedy
from .loader import RuntimeModel, load_model, logits
from .weights import SOURCE_CONFIG_KEY

__all__ = ["Greedy", "RuntimeModel", "SOURCE_CONFIG_KEY", "greedy", "load_model", "logits"]
