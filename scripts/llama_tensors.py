"""Dump every float32 tensor llama.cpp computes for one token sequence, to find the first op where quantkit's
runtime (``load_model(..., arithmetic="ggml-cpu")``) and llama.cpp part.

``python scripts/llama_tensors.py MODEL.gguf OUT.npz 1,2,3,... [--no-repack]`` runs llama-cpp-python's
``llama_decode`` on the whole sequence at once (F32 KV cache, no flash attention, 2 threads: the configuration
``tests/test_foreign.py`` scores against) with an eval callback that copies each F32 result (views and
permutations read through their strides) into ``OUT.npz`` under the graph's tensor name (``kq-0``, ``kqv-1``;
``#1``, ``#2`` for a name met again), and writes ``OUT.npz.order.txt``: one line per tensor, in execution order,
with its op, ``ne`` and source names.  Every position asks for logits, as when scoring.  ``--no-repack`` leaves
the weights in ggml's plain CPU buffers (llama-cli's ``--no-repack``).

Example finding (the tiny DeepSeek V3, Q4_K_M): element 100 of head 3, token 35 of ``kqv-0`` (``attn_v_b``'s
input, rounded to Q8_0 before the product) is 9.4999924 Q8_0 steps with repacking and 9.5000057 without.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np


class Tensor(ctypes.Structure):     # struct ggml_tensor (ggml.h)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


GGML_TYPE_F32 = 0


def read(t: Tensor) -> np.ndarray:
    """The tensor's values as a contiguous array, numpy axis order (``ne`` reversed)."""
    end = sum((t.ne[d] - 1) * t.nb[d] for d in range(4)) + 4
    raw = np.frombuffer((ctypes.c_char * end).from_address(t.data), np.float32)
    return np.lib.stride_tricks.as_strided(raw, shape=tuple(t.ne[::-1]), strides=tuple(t.nb[::-1])).copy()


def dump(model_path: str, tokens: list[int], repack: bool = True) -> tuple[dict[str, np.ndarray], list[str]]:
    import llama_cpp

    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_op_name.restype, ggml.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    tensors: dict[str, np.ndarray] = {}
    order: list[str] = []

    def on_tensor(address, ask, _user_data):
        if ask:
            return True
        t = Tensor.from_address(address)
        if t.type != GGML_TYPE_F32 or not all(t.ne):
            return True
        name = key = t.name.decode()
        again = 0
        while key in tensors:
            again += 1
            key = f"{name}#{again}"
        tensors[key] = read(t)
        sources = [Tensor.from_address(s).name.decode() for s in t.src if s]
        order.append(f"{key}\t{ggml.ggml_op_name(t.op).decode()}\t{list(t.ne)}\t{sources}")
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_tensor)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = repack
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), model_params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {model_path}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = max(64, len(tokens))
    params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.n_threads = params.n_threads_batch = 2
    params.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    for i, token in enumerate(tokens):         # every position asks for logits: no row is dropped before the head
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(tokens)
    status = llama_cpp.llama_decode(ctx, batch)
    llama_cpp.llama_batch_free(batch)
    if status != 0:
        raise SystemExit(f"llama_decode failed ({status})")
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return tensors, order


def main(argv: list[str]) -> None:
    args = [a for a in argv if a != "--no-repack"]
    if len(args) != 3:
        raise SystemExit("usage: python scripts/llama_tensors.py MODEL.gguf OUT.npz ID,ID,... [--no-repack]")
    model_path, out, token_list = args
    tensors, order = dump(model_path, [int(t) for t in token_list.split(",")], repack="--no-repack" not in argv)
    np.savez(out, **tensors)
    Path(out + ".order.txt").write_text("\n".join(order) + "\n")
    print(f"{len(tensors)} tensors -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
