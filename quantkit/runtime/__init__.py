"""The runtime: quantized GGUF files (and safetensors sources) run through transformers' own model code.

Usage::

    from quantkit.runtime import SamplingParams, greedy, load_model, logits, sample
    model = load_model("tiny-Q4_K.gguf", device="cpu")      # or a safetensors checkpoint directory
    scores = logits(model, [1, 2, 3])                         # float32 [3, vocab]
    tokens = greedy(model, [1, 2, 3], 24).tokens              # greedy continuation, KV cache
    tokens = sample(model, [1, 2, 3], 24, SamplingParams(0.6, 20, 0.95), seed=0).tokens   # sampled

This package and the GPU kernels it loads are the only parts of quantkit that import torch.  Layout: weight
sources (:mod:`.weights`), the inverse of the architecture maps (:mod:`.inverse`), packed weights decoded on use
(:mod:`.packed`), model construction and the forward pass (:mod:`.loader`), greedy and sampled generation
with transformers' KV cache (:mod:`.generate`; the samplers are :mod:`quantkit.sampling`).
"""
from ..sampling import SamplingParams
from .generate import Generation, greedy, sample
from .loader import RuntimeModel, load_model, logits, logits_batch
from .weights import SOURCE_CONFIG_KEY

__all__ = ["Generation", "RuntimeModel", "SOURCE_CONFIG_KEY", "SamplingParams", "greedy", "load_model", "logits",
           "logits_batch", "sample"]
