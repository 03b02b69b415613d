"""A tiny DeepSeek V4.1 checkpoint in the release layout (transformers has no V4.1 model to save one).

Layout, as the V4.1 release (``DeepseekV41ForCausalLM``) is published: ``config.json`` with ``model_type
deepseek_v41`` at the root beside ``quantization_config`` (FP8 E4M3 weights with E8M0 block scales, packed FP4
experts), the text model's fields in ``text_config`` including the Engram fields (``engram_layer_ids``,
``engram_num_embeddings``, ``engram_max_ngram_size``, ``engram_n_heads``, ``engram_head_dim``,
``engram_vocab_size``, ``engram_compressed_vocab_size``, ``engram_pad_token_id``); safetensors shards named
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``; the tokenizer files.

The trunk is the tiny DeepSeek V4 model in its official layout and ``fp4-experts`` encoding
(:func:`quantkit.testing.tiny_checkpoints.write_checkpoint`) with V4.1's differences that change tensor names:
no token-id hash routing (``tid2eid`` removed, ``num_hash_layers`` 0).  Intended differences from a real release:
the trunk keeps V4's compression ratios (4/128, whose compressor tensors the tiny V4 model has) and 128x128 FP8
blocks; V4.1's attention changes (shared compressed streams) and its DSpark/vision tensors are not built.

Each Engram layer gets ``layers.L.engram.embed.weight`` F8_E4M3 ``[rows, 256]`` + ``.scale`` F8_E8M0
``[rows, 8]`` (seeded codes, never an E4M3 NaN; scales 2^-8 .. 2^4), ``engram.wkv`` (FP8 + E8M0 per 128x128) and
``engram.q_weight`` / ``k_weight`` (BF16).  The row counts are the sums of the bucket primes above
``engram_vocab_size`` (:func:`quantkit.engram.bucket_primes`), about ``rows_per_layer`` each; the compressed
vocabulary is counted from the tokenizer.  The tables go to their own last shard, written in chunks (a few million rows take
no more memory than a few thousand).
"""
from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from ..engram import bucket_primes, compressed_token_map
from ..engram.rows import E4M3_NAN_MASK
from ..formats import blockscaled
from ..io.atomic import atomic_output
from ..io.checkpoint import open_checkpoint
from ..io.safetensors import safetensors_header, write_safetensors
from .tiny_checkpoints import SAFETENSORS_METADATA, write_checkpoint

HEAD_DIM = 256
PAD_TOKEN_ID = 2
#: Root keys of the release config; every other key of the V4 config moves into ``text_config``.
ROOT_KEYS = ("architectures", "model_type", "quantization_config", "torch_dtype", "bos_token_id", "eos_token_id",
             "pad_token_id", "tie_word_embeddings")
#: Rows generated per chunk of the table shard.
CHUNK_ROWS = 1 << 18


def engram_geometry(rows_per_layer: int, layers: int, max_ngram_size: int, n_heads: int) -> tuple[int, list[int]]:
    """(``engram_vocab_size``, exact row counts) for about ``rows_per_layer`` rows per layer."""
    vocab = max(2, rows_per_layer // ((max_ngram_size - 1) * n_heads))
    return vocab, [int(s) for s in bucket_primes(layers, max_ngram_size, n_heads, vocab).sum(axis=1)]


def table_chunk(rng: np.random.Generator, rows: int, head_dim: int = HEAD_DIM) -> tuple[np.ndarray, np.ndarray]:
    """Seeded ``uint8`` E4M3 codes ``[rows, head_dim]`` (no NaN code) and E8M0 scales ``[rows, head_dim/32]``."""
    codes = rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8)
    codes[(codes & E4M3_NAN_MASK) == E4M3_NAN_MASK] ^= 1      # 0x7F/0xFF -> 0x7E/0xFE
    scales = rng.integers(119, 132, size=(rows, head_dim // 32), dtype=np.uint8)
    return codes, scales


def _write_table_shard(path: Path, tables: dict[int, int], seed: int) -> None:
    """The Engram tables' shard, streamed: header from zero-stride stand-ins, then each table's rows by chunk."""
    names = {}
    for layer, rows in tables.items():
        names[f"layers.{layer}.engram.embed.weight"] = np.broadcast_to(np.zeros(1, np.uint8), (rows, HEAD_DIM))
        names[f"layers.{layer}.engram.embed.scale"] = np.broadcast_to(np.zeros(1, np.uint8), (rows, HEAD_DIM // 32))
    dtypes = {n: ("F8_E4M3" if n.endswith(".weight") else "F8_E8M0") for n in names}
    header, order = safetensors_header(names, SAFETENSORS_METADATA, dtypes=dtypes)
    with atomic_output(path, overwrite=True) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        offsets, pos = {}, f.tell()
        for name in order:
            offsets[name] = pos
            pos += names[name].nbytes
        for layer, rows in tables.items():
            rng = np.random.default_rng([seed, layer])
            weight, scale = f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"
            for r0 in range(0, rows, CHUNK_ROWS):
                codes, scales = table_chunk(rng, min(CHUNK_ROWS, rows - r0))
                f.seek(offsets[weight] + r0 * HEAD_DIM)
                f.write(codes.tobytes())
                f.seek(offsets[scale] + r0 * (HEAD_DIM // 32))
                f.write(scales.tobytes())
        f.seek(pos)
        f.truncate(pos)


def write_v41_checkpoint(out: Path, *, rows_per_layer: int = 4096, engram_layer_ids=(1, 2), max_ngram_size: int = 3,
                         n_heads: int = 2, seed: int = 0) -> Path:
    """Write a tiny V4.1 release checkpoint into directory ``out`` (module docstring)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quantkit-v41-") as tmp:
        write_checkpoint("deepseek_v4", Path(tmp), layout="official", encoding="fp4-experts", seed=seed)
        v4_config = json.loads((Path(tmp) / "config.json").read_text())
        with open_checkpoint(tmp) as ckpt:
            tensors = {n: np.array(ckpt.raw(n)) for n in ckpt.tensor_names() if not n.endswith(".tid2eid")}
            dtypes = {n: ckpt.tensor_info(n).dtype for n in tensors}
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(tmp) / name).is_file():
                (out / name).write_bytes((Path(tmp) / name).read_bytes())
    token_map = compressed_token_map(out / "tokenizer.json")
    layers = list(engram_layer_ids)
    vocab, rows = engram_geometry(rows_per_layer, len(layers), max_ngram_size, n_heads)
    hidden, hc = v4_config["hidden_size"], v4_config["hc_mult"]
    rng = np.random.default_rng([seed, 41])
    for layer in layers:
        wkv = rng.standard_normal((hidden * (hc + 1), (max_ngram_size - 1) * n_heads * HEAD_DIM)).astype(np.float32)
        codes, scales = blockscaled.fp8_block_quantize_e8m0(wkv * 0.02)
        tensors[f"layers.{layer}.engram.wkv.weight"], tensors[f"layers.{layer}.engram.wkv.scale"] = codes, scales
        dtypes[f"layers.{layer}.engram.wkv.weight"], dtypes[f"layers.{layer}.engram.wkv.scale"] = "F8_E4M3", "F8_E8M0"
        for gain in ("q_weight", "k_weight"):
            name = f"layers.{layer}.engram.{gain}"
            tensors[name] = (1 + 0.1 * rng.standard_normal((hc, hidden))).astype(ml_dtypes.bfloat16)
            dtypes[name] = "BF16"

    trunk_shard, table_shard = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    write_safetensors(out / trunk_shard, tensors, SAFETENSORS_METADATA, dtypes=dtypes, overwrite=True)
    _write_table_shard(out / table_shard, dict(zip(layers, rows)), seed)
    weight_map = dict.fromkeys(tensors, trunk_shard)
    for layer in layers:
        weight_map[f"layers.{layer}.engram.embed.weight"] = table_shard
        weight_map[f"layers.{layer}.engram.embed.scale"] = table_shard
    total = (out / trunk_shard).stat().st_size + (out / table_shard).stat().st_size
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")

    text = {k: v for k, v in v4_config.items() if k not in ROOT_KEYS}
    text.update(num_hash_layers=0, engram_layer_ids=layers, engram_num_embeddings=rows,
                engram_max_ngram_size=max_ngram_size, engram_n_heads=n_heads, engram_head_dim=HEAD_DIM,
                engram_vocab_size=vocab, engram_compressed_vocab_size=int(np.unique(token_map).size),
                engram_pad_token_id=PAD_TOKEN_ID)
    config = {k: v4_config[k] for k in ROOT_KEYS if k in v4_config}
    config.update(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", text_config=text)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
