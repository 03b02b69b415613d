"""DeepSeek-V4.1 (``deepseek_v41``) -> GGUF ``deepseek41``: DeepSeek V4's map plus the Engram layers.

The release (``DeepseekV41ForCausalLM``) nests the text model's fields in ``text_config`` next to
``vision_config`` and ``quantization_config``, and keeps V4's tensor names for the trunk (embed, head, norms,
hyper-connections, attention, compressor/indexer, shared and routed experts), so the trunk rules, aliases and
input groups are :mod:`deepseek_v4`'s.  What V4.1 adds:

- per Engram layer ``L`` (``engram_layer_ids``): the table ``layers.L.engram.embed.weight`` F8_E4M3
  ``[rows, engram_head_dim]`` with ``.scale`` F8_E8M0 ``[rows, head_dim / 32]`` (class ``engram``: written as a
  native row store by default, :mod:`quantkit.engram.rows`), the value/key projection ``engram.wkv.weight``
  ``[hidden * (hc_mult + 1), (max_ngram - 1) * heads * head_dim]`` (class ``engram_proj``) and the per-stream
  query/key gains ``engram.q_weight`` / ``engram.k_weight`` ``[hc_mult, hidden]`` (class ``norm``);
- the Engram hash spec as metadata (:class:`quantkit.engram.EngramSpec`: token map from the tokenizer, bucket
  primes, multipliers, row counts, compressed vocabulary size, pad id), checked against the tables' row counts
  and the tokenizer before anything is written;
- no token-id hash routing (``num_hash_layers`` 0), compress ratios from {0, 1, 2} (shared compressed streams,
  ``kv_source_layer_ids`` / ``index_source_layer_ids``, written as metadata), the DSpark drafter's tensors and the
  vision tower dropped from the main file.

What is *not* claimed: the exact key set of any V4.1 GGUF engine besides the Engram keys (the trunk keys are
V4's under the ``deepseek41`` prefix), nor a V4.1 forward pass (scoring refuses V4.1, saying what it needs:
:data:`quantkit.runtime.loader.UNRUNNABLE`).  The DSpark drafter (``dspark.*``) and MTP blocks (``mtp.*``) are
dropped from the main file: V4's MTP and DSpark layouts (llama.cpp's nextn / dflash, ds4's ``mtp.K.*``) are not
claimed for V4.1, whose engines publish neither.

Sources: the config fields and the tensor names of the Engram module (``engram.embed.{weight,scale}``,
``engram.wkv``, ``engram.q_weight``/``k_weight``) and the GGUF names ``blk.L.engram_embd`` / ``engram_q`` /
``engram_k`` are read from public V4.1 engine ports and pull requests (llama.cpp #28696, ik_llama.cpp #2455,
sglang #39666, V4.1 ports' config validation); ``engram_kv`` and the ``{arch}.engram.*`` key names are quantkit's.
"""
from __future__ import annotations

from pathlib import Path
from gguf.constants import GGUFValueType

from ..errors import SourceError
from . import deepseek_v4 as v4
from .base import Arch, Hparams, MetadataBuilder, MetadataInputs, drop, require, rule

#: Compression ratios of V4.1's attention layers (0: sliding window only).
COMPRESS_RATIOS = frozenset({0, 1, 2})
L = "layers.{L}"


def engram_layer(hp: Hparams, groups) -> bool:
    """Condition: the block is one of the Engram layers."""
    return groups["layer"] in hp["engram_layer_ids"]


RULES = (
    rule(f"{L}.engram.embed.weight", "blk.{layer}.engram_embd.weight", "engram", when="engram_layer"),
    rule(f"{L}.engram.wkv.weight", "blk.{layer}.engram_kv.weight", "engram_proj", when="engram_layer"),
    rule(f"{L}.engram.q_weight", "blk.{layer}.engram_q.weight", "norm", when="engram_layer"),
    rule(f"{L}.engram.k_weight", "blk.{layer}.engram_k.weight", "norm", when="engram_layer"),
    drop("dspark.{*}", "mtp", "DSpark drafter: written by `convert --support dspark`, not the main file"),
    *v4.RULES,
)


def normalize(config) -> Hparams:
    hp = v4.normalize(config)
    hp.setdefault("num_hash_layers", 0)
    return hp


def check(hp: Hparams) -> None:
    n = require(hp, "num_hidden_layers")
    ratios = hp["compress_ratios"]
    if len(ratios) < n or any(r not in COMPRESS_RATIOS | v4.COMPRESS_RATIOS for r in ratios):
        raise SourceError(f"needs one compression ratio per layer ({n}) from {sorted(COMPRESS_RATIOS)} (V4.1) or "
                          f"{sorted(v4.COMPRESS_RATIOS)} (V4), found {ratios}", field="compress_ratios")
    if hp["hc_mult"] != v4.HC_STREAMS:
        raise SourceError(f"V4.1 has {v4.HC_STREAMS} hyper-connection streams, found {hp['hc_mult']}",
                          field="hc_mult")
    layers = require(hp, "engram_layer_ids", list)
    if any(not isinstance(x, int) or not 0 <= x < n for x in layers):
        raise SourceError(f"Engram layers must be block indices below {n}, found {layers}", field="engram_layer_ids")


def metadata(meta: MetadataBuilder, hp: Hparams, inputs: MetadataInputs) -> None:
    from ..engram import EngramSpec, compressed_token_map

    checked = dict(hp, hc_mult=v4.HC_STREAMS)
    v4.metadata(meta, checked, inputs)
    for key, name in (("{arch}.attention.kv_source_layers", "kv_source_layer_ids"),
                      ("{arch}.attention.index_source_layers", "index_source_layer_ids")):
        if hp.get(name):
            meta.array(key, [int(x) for x in hp[name]], GGUFValueType.INT32)
    if inputs.tokenizer_dir is None or not (Path(inputs.tokenizer_dir) / "tokenizer.json").is_file():
        raise SourceError("the Engram token map is built from tokenizer.json, and the checkpoint has none",
                          path=inputs.tokenizer_dir, field="engram_compressed_vocab_size")
    spec = EngramSpec.from_config(hp, compressed_token_map(Path(inputs.tokenizer_dir) / "tokenizer.json"))
    shapes = inputs.tensor_shapes or {}
    spec.check({layer: shapes.get(f"layers.{layer}.engram.embed.weight", (None,))[0] for layer in spec.layer_ids})
    spec.metadata(meta)


ARCH = Arch(
    model_type="deepseek_v41", gguf_arch="deepseek41", rules=RULES, normalize=normalize, check=check,
    metadata=metadata, block_count=lambda hp: hp["num_hidden_layers"],
    expert_count=lambda hp: hp["n_routed_experts"], aliases=v4.ALIASES,
    conditions={"hash_layer": v4.hash_layer, "engram_layer": engram_layer},
    default_chat_template=v4.default_chat_template, input_groups=v4.INPUT_GROUPS,
)
