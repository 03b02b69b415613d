"""Tiny checkpoints with MTP blocks (GLM-5.3-Flash, DeepSeek V4) and a DeepSeek V4 DSpark drafter, for main files
keeping the blocks and for support (drafter) GGUFs.

transformers' tiny GLM-5 model has no MTP block (``num_nextn_predict_layers`` 0), so one is added the way the
release lays it out: block ``num_hidden_layers`` (``model.language_model.layers.N.*``) holds a decoder layer --
here a copy of the last layer's tensors, perturbed by a seeded factor so it is not a byte copy -- plus the NextN
tensors ``eh_proj`` ``[hidden, 2 * hidden]``, ``enorm``, ``hnorm`` and ``shared_head.norm``; ``config.json``
says ``num_nextn_predict_layers`` 1.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from ..formats import blockscaled
from ..io.checkpoint import open_checkpoint
from ..io.safetensors import write_safetensors
from .tiny_checkpoints import SAFETENSORS_METADATA, write_checkpoint

PREFIX = "model.language_model.layers."


def write_glm_with_nextn(out: Path, seed: int = 0) -> Path:
    """Write the tiny GLM-5 checkpoint with one NextN block into directory ``out`` (module docstring)."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="quantkit-mtp-") as tmp:
        write_checkpoint("glm5_next", Path(tmp), seed=seed)
        config = json.loads((Path(tmp) / "config.json").read_text())
        text = config["text_config"]
        n, hidden = text["num_hidden_layers"], text["hidden_size"]
        with open_checkpoint(tmp) as ckpt:
            tensors = {name: np.array(ckpt.raw(name)) for name in ckpt.tensor_names()}
            dtypes = {name: ckpt.tensor_info(name).dtype for name in tensors}
        shutil.copytree(tmp, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "config.json"),
                        dirs_exist_ok=True)
    rng = np.random.default_rng([seed, 3])
    last = f"{PREFIX}{n - 1}."
    for name in [k for k in tensors if k.startswith(last)]:
        copy = f"{PREFIX}{n}." + name[len(last):]
        scale = np.float32(1 + 0.05 * rng.standard_normal())
        tensors[copy] = (tensors[name].astype(np.float32) * scale).astype(tensors[name].dtype)
        dtypes[copy] = dtypes[name]
    block = f"{PREFIX}{n}."
    extra = {"eh_proj.weight": rng.standard_normal((hidden, 2 * hidden)) * 0.02,
             "enorm.weight": 1 + 0.1 * rng.standard_normal(hidden),
             "hnorm.weight": 1 + 0.1 * rng.standard_normal(hidden),
             "shared_head.norm.weight": 1 + 0.1 * rng.standard_normal(hidden)}
    for leaf, values in extra.items():
        tensors[block + leaf] = values.astype(ml_dtypes.bfloat16)
        dtypes[block + leaf] = "BF16"
    write_safetensors(out / "model.safetensors", tensors, SAFETENSORS_METADATA, dtypes=dtypes, overwrite=True)
    text["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _editable_copy(src: Path, out: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """``src``'s config, raw tensors and their safetensors dtypes, read into memory, and its other files (tokenizer,
    generation config) copied to ``out``: the start of a checkpoint written again with edits."""
    config = json.loads((src / "config.json").read_text())
    with open_checkpoint(src) as ckpt:
        tensors = {name: np.array(ckpt.raw(name)) for name in ckpt.tensor_names()}
        dtypes = {name: ckpt.tensor_info(name).dtype for name in tensors}
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "config.json"),
                    dirs_exist_ok=True)
    return config, tensors, dtypes


def write_v4_with_mtp(out: Path, seed: int = 0) -> Path:
    """The tiny DeepSeek V4 checkpoint (official layout, FP8 + FP4 experts: the release encoding llama.cpp's
    converter reads) with one MTP block as the release lays it out: ``mtp.0.*`` holds an uncompressed decoder
    block (a copy of the last layer's tensors but its compressor and indexer, the float ones perturbed), ``e_proj``
    / ``h_proj`` ``[hidden, hidden]`` (FP8 with E8M0 block scales), ``enorm``, ``hnorm``, ``norm`` and its own
    ``hc_head_{fn,base,scale}``; ``num_nextn_predict_layers`` 1 and one more compression ratio, 0 (ds4.c's
    ``mtp_weights_bind`` binds no compressor)."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="quantkit-mtp-") as tmp:
        write_checkpoint("deepseek_v4", Path(tmp), layout="official", encoding="fp4-experts", seed=seed)
        config, tensors, dtypes = _editable_copy(Path(tmp), out)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    rng = np.random.default_rng([seed, 4])

    def put(name: str, values: np.ndarray, like: str) -> None:
        tensors[name] = values.astype(tensors[like].dtype)
        dtypes[name] = dtypes[like]

    last = f"layers.{n - 1}."
    for name in [k for k in tensors if k.startswith(last) and ".compressor." not in k and ".indexer." not in k]:
        values = tensors[name]
        if dtypes[name] in ("F32", "BF16"):
            values = values.astype(np.float32) * (1 + 0.05 * rng.standard_normal())
        put("mtp.0." + name[len(last):], values, name)
    for leaf in ("e_proj", "h_proj"):
        codes, scales = blockscaled.fp8_block_quantize_e8m0(rng.standard_normal((hidden, hidden)) * 0.02)
        tensors[f"mtp.0.{leaf}.weight"], tensors[f"mtp.0.{leaf}.scale"] = codes, scales
        dtypes[f"mtp.0.{leaf}.weight"], dtypes[f"mtp.0.{leaf}.scale"] = "F8_E4M3", "F8_E8M0"
    for leaf in ("enorm", "hnorm", "norm"):
        put(f"mtp.0.{leaf}.weight", 1 + 0.1 * rng.standard_normal(hidden), "norm.weight")
    for leaf in ("fn", "base", "scale"):
        put(f"mtp.0.hc_head_{leaf}", tensors[f"hc_head_{leaf}"].astype(np.float32) * 1.1, f"hc_head_{leaf}")
    write_safetensors(out / "model.safetensors", tensors, SAFETENSORS_METADATA, dtypes=dtypes, overwrite=True)
    config["num_nextn_predict_layers"] = 1
    config["compress_ratios"] = list(config["compress_ratios"]) + [0]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


#: The DSpark settings of the tiny drafter (llama.cpp's ``DeepseekV4DSparkModel`` reads these config keys).
DSPARK_SETTINGS = {"dspark_block_size": 4, "dspark_target_layer_ids": [0, 2], "dspark_noise_token_id": 5}
DSPARK_MARKOV_RANK = 32


def write_v4_dspark(out: Path, seed: int = 0) -> Path:
    """The tiny DeepSeek V4 checkpoint carrying a two-stage DSpark drafter where the MTP block would be, as llama.cpp's
    ``DeepseekV4DSparkModel`` reads one (conversion/deepseek.py: ``mtp.K.*`` are the stages; stage 0 also holds
    ``main_proj`` ``[hidden, len(target layers) * hidden]`` (FP8 with E8M0 block scales), ``main_norm``, the Markov
    head ``markov_head.markov_w{1,2}`` ``[vocab, rank]``, ``confidence_head.proj`` ``[1, hidden + rank]``, ``norm``
    and ``hc_head_*``), with the ``dspark_*`` settings of :data:`DSPARK_SETTINGS` in ``config.json``.  Each stage
    is the MTP block of :func:`write_v4_with_mtp` (stage 1 a perturbed copy)."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="quantkit-dspark-") as tmp:
        config, tensors, dtypes = _editable_copy(write_v4_with_mtp(Path(tmp) / "v4", seed=seed), out)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    rng = np.random.default_rng([seed, 5])
    for leaf in ("e_proj.weight", "e_proj.scale", "h_proj.weight", "h_proj.scale", "enorm.weight", "hnorm.weight"):
        del tensors[f"mtp.0.{leaf}"], dtypes[f"mtp.0.{leaf}"]
    roots = ("norm.weight", "hc_head_")
    for name in [n for n in tensors if n.startswith("mtp.0.") and not n[len("mtp.0."):].startswith(roots)]:
        values = tensors[name]
        if dtypes[name] in ("F32", "BF16"):
            values = (values.astype(np.float32) * (1 + 0.05 * rng.standard_normal())).astype(values.dtype)
        tensors["mtp.1." + name[len("mtp.0."):]], dtypes["mtp.1." + name[len("mtp.0."):]] = values, dtypes[name]
    targets = len(DSPARK_SETTINGS["dspark_target_layer_ids"])
    codes, scales = blockscaled.fp8_block_quantize_e8m0(rng.standard_normal((hidden, targets * hidden)) * 0.02)
    tensors["mtp.0.main_proj.weight"], tensors["mtp.0.main_proj.scale"] = codes, scales
    dtypes["mtp.0.main_proj.weight"], dtypes["mtp.0.main_proj.scale"] = "F8_E4M3", "F8_E8M0"
    rank = DSPARK_MARKOV_RANK
    for leaf, values in (("main_norm.weight", 1 + 0.1 * rng.standard_normal(hidden)),
                         ("markov_head.markov_w1.weight", 0.02 * rng.standard_normal((vocab, rank))),
                         ("markov_head.markov_w2.weight", 0.02 * rng.standard_normal((vocab, rank))),
                         ("confidence_head.proj.weight", 0.02 * rng.standard_normal((1, hidden + rank)))):
        tensors[f"mtp.0.{leaf}"], dtypes[f"mtp.0.{leaf}"] = values.astype(ml_dtypes.bfloat16), "BF16"
    write_safetensors(out / "model.safetensors", tensors, SAFETENSORS_METADATA, dtypes=dtypes, overwrite=True)
    config.update(DSPARK_SETTINGS)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
