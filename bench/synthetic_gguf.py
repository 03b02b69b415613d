"""Synthetic GGUFs of random blocks for the benches, of any architecture quantkit maps (``quantkit.arch``).

:func:`write_synthetic` takes a ``config.json`` dict (its ``model_type`` picks the map), builds the transformers
model it describes on the meta device (:func:`quantkit.runtime.loader.model_skeleton`) and writes every GGUF tensor
the map makes of it, with random payloads that keep activations finite:

* routed experts Q4_K (Q8_0 where a row is not a multiple of 256), other matrices Q8_0 (F32 where a row is not a
  multiple of 32): random quants under fixed scales, weights of about 0.02;
* vectors, and the small sensitive tensors (:data:`F32_CLASSES`: hyper-connections, norms, biases, decay
  parameters, convolutions, sinks, position biases) F32: vectors ones (a value stored as ``-exp(x)`` minus one),
  matrices Gaussian of :data:`F32_MATRIX_STD`;
* hash-routing tables I32: distinct random experts per token.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUFValueType

from quantkit.arch import get_arch
from quantkit.arch.base import OutputTensor
from quantkit.formats.registry import GGMLType
from quantkit.io.gguf import KV
from quantkit.io.gguf_writer import GGUFWriter, TensorSpec, plan_layout
from quantkit.runtime import SOURCE_CONFIG_KEY
from quantkit.runtime.loader import model_skeleton

#: f16 scale fields (byte offset, value) giving weights of ~0.02 from random quants (synthetic model only).
SCALE_FIELDS = {GGMLType.Q4_K: ((0, 1e-4), (2, 1e-4)), GGMLType.Q8_0: ((0, 3e-4),)}
#: Tensor classes written F32 whatever their shape (what the seed teams keep in full precision).
F32_CLASSES = frozenset({"hc", "norm", "bias", "ssm_param", "conv", "sinks", "ape"})
#: Spread of the F32 matrices: about that of the quantized weights.
F32_MATRIX_STD = 0.02
SYNTHETIC = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32000,
             "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 4,
             "moe_intermediate_size": 1024, "norm_topk_prob": True, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def tensor_type(output: OutputTensor) -> GGMLType:
    row = output.shape[-1]
    if output.tensor_class == "hash_routing":
        return GGMLType.I32
    if len(output.shape) < 2 or output.tensor_class in F32_CLASSES:
        return GGMLType.F32
    if output.tensor_class.startswith("routed_") and row % 256 == 0:
        return GGMLType.Q4_K
    return GGMLType.Q8_0 if row % 32 == 0 else GGMLType.F32


def _random_payload(output: OutputTensor, qtype: GGMLType, experts: int, rng) -> np.ndarray:
    shape = output.shape
    if qtype is GGMLType.I32:
        vocab, top_k = shape
        return np.argsort(rng.random((vocab, experts)), axis=1)[:, :top_k].astype(np.int32)
    if qtype is GGMLType.F32:
        if len(shape) >= 2:
            return rng.normal(0.0, F32_MATRIX_STD, shape).astype(np.float32)
        # A = -exp(A_log) is stored: a decay must stay negative (the runtime takes its log back)
        negative = any("neg_exp" in source.transform for source in output.sources)
        return np.full(shape, -1.0 if negative else 1.0, np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for offset, value in SCALE_FIELDS[qtype]:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return raw


def write_synthetic(path: Path, config: dict, extra_metadata: tuple = ()) -> int:
    """A GGUF of random blocks for ``config`` (plus ``extra_metadata`` keys: a tokenizer); returns the parameter
    count (hash-routing tables, integer lookups, not counted)."""
    amap = get_arch(config["model_type"]).bind(config)
    skeleton = model_skeleton(config)
    state = skeleton.state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    outputs = amap.outputs(shapes)
    kind = {o.gguf_name: tensor_type(o) for o in outputs}
    # constants the model computes at construction (n-gram hash constants) are real buffers of the skeleton
    meta = amap.metadata(None, tensor_values=lambda name: state[name].numpy(), tensor_shapes=shapes) + [
        (SOURCE_CONFIG_KEY, KV(json.dumps(config), GGUFValueType.STRING)), *extra_metadata]
    layout = plan_layout(meta, [TensorSpec(o.gguf_name, o.shape, kind[o.gguf_name]) for o in outputs])
    rng = np.random.default_rng(0)
    with GGUFWriter(path, layout, overwrite=True) as writer:
        writer.write_header()
        for o in outputs:
            writer.write_tensor(o.gguf_name, _random_payload(o, kind[o.gguf_name], amap.expert_count, rng))
        writer.finish()
    return sum(int(np.prod(o.shape)) for o in outputs if kind[o.gguf_name] is not GGMLType.I32)
