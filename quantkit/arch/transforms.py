"""Tensor transforms between a Hugging Face source tensor and its GGUF tensor, as named steps.

Each architecture rule names the steps its tensor goes through (``("squeeze", "gdn_conv_v_order")``); this module
holds the one implementation of every step, next to the function that computes the shape it produces, and
:func:`assemble`, which builds one GGUF tensor from its sources (stacking experts, concatenating shards).

Conventions (the same as llama.cpp's ``convert_hf_to_gguf.py``, whose behaviour every step mirrors):

* Arrays are numpy arrays in PyTorch dimension order (row-major, ``[out_features, in_features]``); GGUF lists the
  same dimensions reversed.  Shapes here are always numpy order.
* Floating sources are widened to float32 *before* any step (the converter casts every non-F16/F32 dtype to
  float32 first), so ``plus_one`` and ``neg_exp`` run in float32.  Integer sources stay integer and must go
  through ``to_int32``.
* Steps read hyperparameters from the normalized hyperparameter dict of the architecture (``hp``).

Every step is exact (a permutation, a slice, a reshape or one correctly rounded float32 operation) except
``neg_exp``: ``-exp(x)`` evaluated in float64 and rounded to float32, i.e. correctly rounded except for rare
double-rounding cases.  The converter uses PyTorch's vectorized float32 ``exp``, which is not correctly rounded:
the two differ by one unit in the last place on about 1% of inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import SourceError

Shape = tuple[int, ...]
Hparams = Mapping[str, object]

# the largest value an I32 GGUF tensor can hold (tid2eid routing tables are stored as I32)
INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class Step:
    """One named transform: the array function and the shape function that must agree with it."""

    name: str
    apply: Callable[[np.ndarray, Hparams], np.ndarray]
    shape: Callable[[Shape, Hparams], Shape]
    doc: str


def _int(hp: Hparams, key: str) -> int:
    value = hp[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise SourceError(f"expected an integer hyperparameter, found {value!r}", field=key)
    return value


def _need(cond: bool, what: str, shape: Shape, step: str) -> None:
    if not cond:
        raise SourceError(f"transform {step!r} needs {what}, found a tensor of shape {shape}")


# --- halves of a fused [n_expert, 2*n_ff, n_embd] gate_up tensor (gate first, as transformers concatenates) ---

def _half_shape(shape: Shape, hp: Hparams) -> Shape:
    _need(len(shape) == 3 and shape[1] % 2 == 0, "a 3-D [experts, 2*ff, embd] tensor", shape, "gate_half")
    return (shape[0], shape[1] // 2, shape[2])


def _gate_half(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x[:, : x.shape[1] // 2, :]


def _up_half(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x[:, x.shape[1] // 2:, :]


# --- MLA kv_b split for the absorbed attention: kv_b [H*(nope+v), rank] -> k_b [H, rank, nope], v_b [H, v, rank] ---

def _kv_b_dims(shape: Shape, hp: Hparams) -> tuple[int, int, int, int]:
    heads, nope, v = _int(hp, "num_attention_heads"), _int(hp, "qk_nope_head_dim"), _int(hp, "v_head_dim")
    _need(len(shape) == 2 and shape[0] == heads * (nope + v),
          f"[num_attention_heads*(qk_nope_head_dim+v_head_dim) = {heads * (nope + v)}, kv_lora_rank]", shape, "kv_b")
    return heads, nope, v, shape[1]


def _kv_b_k_shape(shape: Shape, hp: Hparams) -> Shape:
    heads, nope, _, rank = _kv_b_dims(shape, hp)
    return (heads, rank, nope)


def _kv_b_v_shape(shape: Shape, hp: Hparams) -> Shape:
    heads, _, v, rank = _kv_b_dims(shape, hp)
    return (heads, v, rank)


def _kv_b_k(x: np.ndarray, hp: Hparams) -> np.ndarray:
    heads, nope, v, rank = _kv_b_dims(x.shape, hp)
    return x.reshape(heads, nope + v, rank)[:, :nope, :].transpose(0, 2, 1)


def _kv_b_v(x: np.ndarray, hp: Hparams) -> np.ndarray:
    heads, nope, v, rank = _kv_b_dims(x.shape, hp)
    return x.reshape(heads, nope + v, rank)[:, nope:, :]


# --- elementwise ---

def _same(shape: Shape, hp: Hparams) -> Shape:
    return shape


def _neg_exp(x: np.ndarray, hp: Hparams) -> np.ndarray:
    # A_log -> A = -exp(A_log), what the recurrent kernels take.  exp in float64 rounded once to float32: correctly
    # rounded but for rare double-rounding cases, and the same on every platform (numpy's float32 exp is not)
    return np.negative(np.exp(x.astype(np.float64)).astype(np.float32))


def _plus_one(x: np.ndarray, hp: Hparams) -> np.ndarray:
    # zero-centred RMSNorm gammas (weight stored as w - 1)
    return np.add(x, np.float32(1.0), dtype=np.float32)


def _to_int32(x: np.ndarray, hp: Hparams) -> np.ndarray:
    if x.dtype.kind not in "iu":
        raise SourceError(f"transform 'to_int32' needs an integer tensor, found dtype {x.dtype}")
    if x.size and (int(x.min()) < 0 or int(x.max()) > INT32_MAX):
        raise SourceError(f"transform 'to_int32': values in [{int(x.min())}, {int(x.max())}] do not fit I32 ids")
    return x.astype(np.int32)


# --- GLM-5 KDA heads and short convolutions ---

def _first_heads_shape(shape: Shape, hp: Hparams) -> Shape:
    heads = _int(hp, "num_attention_heads")
    _need(int(np.prod(shape)) >= heads, f"at least num_attention_heads = {heads} values", shape, "first_heads")
    return (heads,)


def _first_heads(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x.reshape(-1)[: _int(hp, "num_attention_heads")]


def _conv_4d_shape(shape: Shape, hp: Hparams) -> Shape:
    _need(len(shape) in (2, 3) and (len(shape) == 2 or shape[1] == 1),
          "a [channels, 1, kernel] or [channels, kernel] convolution", shape, "conv_4d")
    return (1, shape[0], 1, shape[-1])


def _conv_4d(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x.reshape(_conv_4d_shape(x.shape, hp))


def _conv_3d_shape(shape: Shape, hp: Hparams) -> Shape:
    _need(len(shape) in (2, 3) and (len(shape) == 2 or shape[1] == 1),
          "a [channels, 1, kernel] or [channels, kernel] convolution", shape, "conv_3d")
    return (shape[0], 1, shape[-1])


def _conv_3d(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x.reshape(_conv_3d_shape(x.shape, hp))


def _kda_conv_part(index: int) -> tuple[Callable[[np.ndarray, Hparams], np.ndarray], Callable[[Shape, Hparams], Shape]]:
    # transformers' internal layout concatenates the q, k and v short convolutions along the channels
    def sizes(shape: Shape, hp: Hparams) -> int:
        width = _int(hp, "linear_num_heads") * _int(hp, "linear_head_dim")
        _need(len(shape) >= 2 and shape[0] == 3 * width, f"[3*linear_num_heads*linear_head_dim = {3 * width}, ...]",
              shape, "kda_conv_part")
        return width

    def shape_fn(shape: Shape, hp: Hparams) -> Shape:
        return (sizes(shape, hp), *shape[1:])

    def apply(x: np.ndarray, hp: Hparams) -> np.ndarray:
        width = sizes(x.shape, hp)
        return x[index * width:(index + 1) * width]

    return apply, shape_fn


# --- squeeze (PyTorch's: drop every size-1 dimension) ---

def _squeeze_shape(shape: Shape, hp: Hparams) -> Shape:
    return tuple(d for d in shape if d != 1)


def _squeeze(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x.reshape(_squeeze_shape(x.shape, hp))


# --- Qwen3.5 / Qwen4-Exp gated delta net: V heads from grouped-by-K order to tiled order ---
# HF stores V heads grouped by K head [G0_v0..v(r-1), G1_v0..]; ggml broadcasts tiled [G0_v0, G1_v0, .., G0_v1, ..].

def _gdn_dims(hp: Hparams) -> tuple[int, int, int, int]:
    k_heads, v_heads = _int(hp, "linear_num_key_heads"), _int(hp, "linear_num_value_heads")
    if k_heads <= 0 or v_heads % k_heads:
        raise SourceError(f"linear_num_value_heads ({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})",
                          field="linear_num_value_heads")
    return k_heads, v_heads // k_heads, _int(hp, "linear_key_head_dim"), _int(hp, "linear_value_head_dim")


def _reorder_v(x: np.ndarray, axis: int, k_heads: int, v_per_k: int, head_dim: int) -> np.ndarray:
    axis = axis % x.ndim
    if x.shape[axis] != k_heads * v_per_k * head_dim:
        raise SourceError(f"V-head reorder expects {k_heads * v_per_k * head_dim} entries on axis {axis}, "
                          f"found a tensor of shape {x.shape}")
    split = x.shape[:axis] + (k_heads, v_per_k, head_dim) + x.shape[axis + 1:]
    return np.swapaxes(x.reshape(split), axis, axis + 1).reshape(x.shape)


def _gdn_qkv_v_order(x: np.ndarray, hp: Hparams) -> np.ndarray:
    k_heads, v_per_k, k_dim, v_dim = _gdn_dims(hp)
    qk = 2 * k_heads * k_dim
    return np.concatenate([x[:qk], _reorder_v(x[qk:], 0, k_heads, v_per_k, v_dim)], axis=0)


def _gdn_rows_v_order(x: np.ndarray, hp: Hparams) -> np.ndarray:
    k_heads, v_per_k, _, v_dim = _gdn_dims(hp)
    return _reorder_v(x, 0, k_heads, v_per_k, v_dim)


def _gdn_heads_order(x: np.ndarray, hp: Hparams) -> np.ndarray:
    k_heads, v_per_k, _, _ = _gdn_dims(hp)
    return _reorder_v(x, 0, k_heads, v_per_k, 1)


def _gdn_conv_v_order(x: np.ndarray, hp: Hparams) -> np.ndarray:
    k_heads, v_per_k, k_dim, v_dim = _gdn_dims(hp)
    qk = 2 * k_heads * k_dim
    return np.concatenate([x[:qk], _reorder_v(x[qk:], 0, k_heads, v_per_k, v_dim)], axis=0)


def _gdn_cols_v_order(x: np.ndarray, hp: Hparams) -> np.ndarray:
    k_heads, v_per_k, _, v_dim = _gdn_dims(hp)
    return _reorder_v(x, 1, k_heads, v_per_k, v_dim)


# --- ds4's Qwen3.8 layout (qwen38-next): the fused GDN q/k/v and the gated query, split without reordering ---

def _gdn_part(index: int) -> tuple[Callable[[np.ndarray, Hparams], np.ndarray], Callable[[Shape, Hparams], Shape]]:
    # rows (or conv channels) of in_proj_qkv / conv1d in the checkpoint's order: [q | k | v], V heads grouped by K
    def bounds(shape: Shape, hp: Hparams) -> tuple[int, int]:
        k_heads, v_per_k, k_dim, v_dim = _gdn_dims(hp)
        qk, v = k_heads * k_dim, k_heads * v_per_k * v_dim
        _need(len(shape) >= 1 and shape[0] == 2 * qk + v, f"[2*linear_num_key_heads*linear_key_head_dim + "
              f"linear_num_value_heads*linear_value_head_dim = {2 * qk + v}, ...]", shape, "gdn_part")
        return ((0, qk), (qk, 2 * qk), (2 * qk, 2 * qk + v))[index]

    def shape_fn(shape: Shape, hp: Hparams) -> Shape:
        start, stop = bounds(shape, hp)
        return (stop - start, *shape[1:])

    def apply(x: np.ndarray, hp: Hparams) -> np.ndarray:
        start, stop = bounds(x.shape, hp)
        return x[start:stop]

    return apply, shape_fn


def _gated_query(half: int) -> tuple[Callable[[np.ndarray, Hparams], np.ndarray], Callable[[Shape, Hparams], Shape]]:
    # q_proj of the gated attention: per head [query (head_dim rows) | output gate (head_dim rows)]
    def dims(shape: Shape, hp: Hparams) -> tuple[int, int]:
        heads = _int(hp, "num_attention_heads")
        head_dim = hp.get("head_dim") or _int(hp, "hidden_size") // heads
        _need(len(shape) == 2 and shape[0] == 2 * heads * head_dim,
              f"[2*num_attention_heads*head_dim = {2 * heads * head_dim}, hidden]", shape, "gated_query")
        return heads, int(head_dim)

    def shape_fn(shape: Shape, hp: Hparams) -> Shape:
        heads, head_dim = dims(shape, hp)
        return (heads * head_dim, shape[1])

    def apply(x: np.ndarray, hp: Hparams) -> np.ndarray:
        heads, head_dim = dims(x.shape, hp)
        return x.reshape(heads, 2, head_dim, x.shape[1])[:, half].reshape(heads * head_dim, x.shape[1])

    return apply, shape_fn


# --- Qwen4-Exp indexer: one [q; k] projection split in two ---

def _indexer_q_rows(shape: Shape, hp: Hparams) -> int:
    n_q = _int(hp, "indexer_n_heads") * _int(hp, "indexer_head_dim")
    _need(len(shape) == 2 and shape[0] > n_q, f"more than indexer_n_heads*indexer_head_dim = {n_q} rows", shape,
          "indexer_q")
    return n_q


def _indexer_q(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x[: _indexer_q_rows(x.shape, hp)]


def _indexer_k(x: np.ndarray, hp: Hparams) -> np.ndarray:
    return x[_indexer_q_rows(x.shape, hp):]


def _steps() -> dict[str, Step]:
    q_apply, q_shape = _kda_conv_part(0)
    k_apply, k_shape = _kda_conv_part(1)
    v_apply, v_shape = _kda_conv_part(2)
    gdn = [_gdn_part(i) for i in range(3)]
    query, gate = _gated_query(0), _gated_query(1)
    table = [
        Step("gate_half", _gate_half, _half_shape, "first half of a fused [E, 2*ff, embd] gate_up tensor"),
        Step("up_half", _up_half, _half_shape, "second half of a fused [E, 2*ff, embd] gate_up tensor"),
        Step("kv_b_k", _kv_b_k, _kv_b_k_shape, "MLA kv_b -> k_b [heads, kv_lora_rank, qk_nope_head_dim]"),
        Step("kv_b_v", _kv_b_v, _kv_b_v_shape, "MLA kv_b -> v_b [heads, v_head_dim, kv_lora_rank]"),
        Step("neg_exp", _neg_exp, _same, "A = -exp(A_log) in float32"),
        Step("plus_one", _plus_one, _same, "w + 1 for zero-centred norm weights, in float32"),
        Step("to_int32", _to_int32, _same, "integer ids to int32 (range checked)"),
        Step("first_heads", _first_heads, _first_heads_shape, "flatten, keep the first num_attention_heads values"),
        Step("conv_4d", _conv_4d, _conv_4d_shape, "[C, 1, K] short convolution -> [1, C, 1, K]"),
        Step("conv_3d", _conv_3d, _conv_3d_shape, "[C, 1, K] or [C, K] short convolution -> [C, 1, K] (ds4)"),
        Step("kda_conv_q", q_apply, q_shape, "q channels of transformers' fused KDA conv1d"),
        Step("kda_conv_k", k_apply, k_shape, "k channels of transformers' fused KDA conv1d"),
        Step("kda_conv_v", v_apply, v_shape, "v channels of transformers' fused KDA conv1d"),
        Step("squeeze", _squeeze, _squeeze_shape, "drop every size-1 dimension (PyTorch squeeze)"),
        Step("gdn_qkv_v_order", _gdn_qkv_v_order, _same, "V rows of the fused qkv projection to tiled head order"),
        Step("gdn_rows_v_order", _gdn_rows_v_order, _same, "rows (V heads x head_v_dim) to tiled head order"),
        Step("gdn_heads_order", _gdn_heads_order, _same, "one entry per V head, to tiled head order"),
        Step("gdn_conv_v_order", _gdn_conv_v_order, _same, "V channels of the squeezed conv to tiled head order"),
        Step("gdn_cols_v_order", _gdn_cols_v_order, _same, "columns (V heads x head_v_dim) to tiled head order"),
        Step("gdn_q_part", *gdn[0], "q rows (or conv channels) of in_proj_qkv, checkpoint order (ds4)"),
        Step("gdn_k_part", *gdn[1], "k rows (or conv channels) of in_proj_qkv, checkpoint order (ds4)"),
        Step("gdn_v_part", *gdn[2], "v rows (or conv channels) of in_proj_qkv, V heads grouped by K (ds4)"),
        Step("query_half", *query, "query rows of a per-head [query | gate] q_proj (ds4's attn_q)"),
        Step("gate_half_rows", *gate, "output-gate rows of a per-head [query | gate] q_proj (ds4's attn_gate)"),
        Step("indexer_q", _indexer_q, lambda s, hp: (_indexer_q_rows(s, hp), s[1]), "q rows of index_qk_proj"),
        Step("indexer_k", _indexer_k, lambda s, hp: (s[0] - _indexer_q_rows(s, hp), s[1]), "k rows of index_qk_proj"),
    ]
    return {step.name: step for step in table}


STEPS: Mapping[str, Step] = _steps()


def get_step(name: str) -> Step:
    try:
        return STEPS[name]
    except KeyError:
        raise SourceError(f"unknown transform step {name!r}; known: {', '.join(sorted(STEPS))}") from None


def output_shape(steps: Sequence[str], shape: Shape, hp: Hparams) -> Shape:
    """The shape a source tensor of ``shape`` has after ``steps`` (numpy order)."""
    for name in steps:
        shape = tuple(int(d) for d in get_step(name).shape(tuple(shape), hp))
    return tuple(shape)


def apply(steps: Sequence[str], x: np.ndarray, hp: Hparams) -> np.ndarray:
    """Run ``steps`` on a source array; floats are widened to float32 first, as the converter does."""
    x = np.asarray(x)
    if x.dtype.kind == "f" and x.dtype != np.float32:
        x = x.astype(np.float32)
    elif x.dtype.kind not in "fiu":
        raise SourceError(f"cannot transform a tensor of dtype {x.dtype}")
    if x.dtype.kind in "iu" and "to_int32" not in steps:
        x = x.astype(np.float32)  # the converter casts integer tensors to float32 unless a rule keeps them integer
    for name in steps:
        step = get_step(name)
        expected = step.shape(tuple(x.shape), hp)
        x = step.apply(x, hp)
        if tuple(x.shape) != tuple(expected):
            raise SourceError(f"transform {name!r} produced shape {x.shape}, its shape rule says {expected}")
    return np.ascontiguousarray(x)
