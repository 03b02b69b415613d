"""Tiny checkpoints on disk, in the layouts and source encodings that real releases use.

Layouts (tensor names):

- ``per-expert``: what transformers' ``save_pretrained`` writes by default: its checkpoint-conversion mapping
  applied in reverse, so routed experts are 2-D per expert (``...mlp.experts.3.gate_proj.weight``; DeepSeek V4's
  transformers save uses the hybrid names ``ffn.experts.3.w1.weight``, ``attn.norm``, ``model.hc_head.*``,
  ``head.weight`` that INTEROP.md describes).
- ``fused``: ``save_pretrained(save_original_format=False)``: transformers' internal names with 3-D experts
  (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``).
- ``official`` (deepseek_v4 only): the upstream release names (``embed.weight``, ``layers.N.attn.wq_a.weight``,
  ``attn.kv_norm``, ``ffn.experts.E.w1.weight``, ``hc_head_fn``, ``head.weight``; :func:`official_name`) and
  DeepSeek's own ``config.json`` keys (``compress_ratios``, ``num_hash_layers``, ``rope_scaling``,
  ``expert_dtype``) instead of transformers' derived ones.

Encodings, applied to the tensors :func:`tensor_role` marks (``"routed"``: routed expert matrices; ``"dense"``:
other 2-D projection weights of the decoder layers; everything else -- embeddings, output head, norms, routers,
hyper-connection and PLE tensors, DeepSeek V4's compressor and indexer-weight projections, the vision tower --
keeps its release dtype, BF16 or F32, as in real FP8/FP4 releases):

============================  ====================================  ============================================
encoding                      dense                                 routed experts
============================  ====================================  ============================================
``bf16`` / ``f32``            release dtype / float32 master        same
``fp8-block``                 F8_E4M3 + F32 ``weight_scale_inv``    same
                              per 128x128 (DeepSeek V3)
``fp8-block-ue8m0``           as ``fp8-block`` with power-of-two    same
                              scales and ``scale_fmt: ue8m0``
                              (DeepSeek V3.1: declared UE8M0,
                              stored F32)
``fp8-e8m0``                  F8_E4M3 + F8_E8M0 per 128x128         same
                              (``scale_fmt: ue8m0``, stored E8M0)
``fp4-experts``               as ``fp8-e8m0``                       I8 packed FP4 + F8_E8M0 per 32
                                                                    (``expert_dtype: fp4``, DeepSeek V4)
``nvfp4-modelopt``            U8 ``weight`` + F8_E4M3 ``weight_scale`` per 16 + F32 ``weight_scale_2`` + F32
                              ``input_scale``; ``hf_quant_config.json``
``nvfp4-compressed-tensors``  U8 ``weight_packed`` + F8_E4M3 ``weight_scale`` + F32 ``weight_global_scale``
                              + F32 ``input_global_scale`` (``format: nvfp4-pack-quantized``)
============================  ====================================  ============================================

Release variants of ``fp4-experts`` in the official layout (:data:`RELEASE_VARIANTS`), as DeepSeek V4 checkpoints
circulate: ``fp4-experts-u8-scales`` stores the routed experts' E8M0 scales as U8 (the same bytes),
``fp4-experts-no-config`` has no ``quantization_config`` in ``config.json`` (DeepSeek's own inference config,
which keeps ``expert_dtype``).  Both hold the same weights as ``fp4-experts``.

Scale names: ``<module>.weight_scale_inv`` in transformers layouts (transformers' FP8 integration stores E8M0
scales under that name too, as ``float8_e8m0fnu``), ``<module>.scale`` in the official layout.
The encoders are :mod:`quantkit.formats.blockscaled`; the values encoded are the BF16 release weights.  NVFP4
global scales are shared by fused groups (q/k/v, gate/up, in_proj_qkv/z, MLA q_a/kv_a), as engines require;
activation scales come from a fixed assumed activation amax (:data:`ASSUMED_ACTIVATION_AMAX`), the tiny models
having no calibration data.  Quantized encodings exist for the ``per-expert`` and ``official`` layouts.

Sharding: ``shards > 1`` writes ``model-0000i-of-0000n.safetensors`` split in name order by count plus
``model.safetensors.index.json``; the scale tensors of the first quantized weight are moved to the next shard so
that at least one scale lives in another shard than its weight.
"""
from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UnsupportedError
from ..formats import blockscaled
from ..formats.minifloat import e8m0_decode
from ..io.safetensors import write_safetensors

LAYOUTS = ("per-expert", "fused", "official")
ENCODINGS = ("bf16", "f32", "fp8-block", "fp8-block-ue8m0", "fp8-e8m0", "fp4-experts", "nvfp4-modelopt",
             "nvfp4-compressed-tensors")
PLAIN_ENCODINGS = ("bf16", "f32")
OFFICIAL_ENCODINGS = ("bf16", "f32", "fp8-e8m0", "fp4-experts")
#: Variant -> the encoding whose weights it holds (module doc); official layout only.
RELEASE_VARIANTS = {"fp4-experts-u8-scales": "fp4-experts", "fp4-experts-no-config": "fp4-experts"}
FP8_BLOCK = [128, 128]
#: NVFP4 activation amax assumed for the static input scales (no calibration data exists for tiny models).
ASSUMED_ACTIVATION_AMAX = 16.0
SAFETENSORS_METADATA = {"format": "pt"}
EMULATED_PRODUCER = {"name": "modelopt", "version": "emulated-by-quantkit"}

_ROUTED = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# 2-D decoder weights real FP8/FP4 releases keep in BF16/F32 (names of every layout).
_KEEP = re.compile("|".join((
    r"\.(mlp|ffn)\.gate\.weight$",                               # routers
    r"shared_expert_gate\.",                                     # Qwen shared-expert gate (one row)
    r"norm",
    r"\.ple\.",                                                  # Qwen4Exp PLE: table and projections
    r"hyper_connection",                                         # Qwen4Exp hyper-connections
    r"\.in_proj_[ab]\.", r"\.b_proj\.",                          # one row per head (GDN a/b, KDA beta)
    r"weights_proj",                                             # indexer head weights
    r"compressor\.(wkv|wgate|kv_proj|gate_proj)\.", r"compressor\.indexer\.(kv_proj|gate_proj)\.",  # V4
)))
_VISION = re.compile(r"(^|\.)visual\.")
# Fused groups that engines run as one matmul: one NVFP4 global scale each.
_FUSED_GROUPS = (
    (re.compile(r"\.(q_proj|k_proj|v_proj)\.weight$"), ".qkv_proj"),
    (re.compile(r"\.(gate_proj|up_proj)\.weight$"), ".gate_up_proj"),
    (re.compile(r"\.(in_proj_qkv|in_proj_z)\.weight$"), ".in_proj_qkvz"),
    (re.compile(r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"), ".fused_qkv_a_proj"),
)


def tensor_role(name: str, ndim: int) -> str | None:
    """``"routed"``, ``"dense"`` or ``None`` (kept in its release dtype) for a tensor of any layout."""
    if ndim != 2 or not name.endswith(".weight") or "layers." not in name or _VISION.search(name):
        return None
    if _ROUTED.search(name):
        return "routed"
    return None if _KEEP.search(name) else "dense"


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek V4 official names

_V4_ROOT = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
            "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
            "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
# transformers-internal layer suffix -> upstream suffix (most specific first)
_V4_LAYER = (
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"), ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"), ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"), ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
)
_V4_LAYER_MAP = dict(_V4_LAYER)
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# config.json keys that only transformers derives; the upstream config carries their legacy sources instead
_V4_TRANSFORMERS_ONLY_KEYS = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters",
                              "partial_rotary_factor", "dtype", "transformers_version")


def official_name(name: str) -> str:
    """Upstream DeepSeek V4 name of a transformers-internal tensor name (experts excluded: see below)."""
    if name in _V4_ROOT:
        return _V4_ROOT[name]
    match = _LAYER_NAME.match(name)
    if match is None or match.group(2) not in _V4_LAYER_MAP:
        raise UnsupportedError(f"no upstream DeepSeek V4 name for transformers tensor {name!r}")
    return f"layers.{match.group(1)}.{_V4_LAYER_MAP[match.group(2)]}"


def official_tensors(model) -> dict:
    """The model's tensors under upstream names; fused experts split into ``ffn.experts.E.w1/w3/w2.weight``."""
    out = {}
    for name, tensor in model.state_dict().items():
        match = _LAYER_NAME.match(name)
        suffix = match.group(2) if match else ""
        if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            prefix = f"layers.{match.group(1)}.ffn.experts"
            for expert, matrix in enumerate(tensor):
                if suffix.endswith("gate_up_proj"):
                    gate, up = matrix.chunk(2, dim=0)   # transformers concatenates [w1; w3]
                    out[f"{prefix}.{expert}.w1.weight"] = gate.contiguous()
                    out[f"{prefix}.{expert}.w3.weight"] = up.contiguous()
                else:
                    out[f"{prefix}.{expert}.w2.weight"] = matrix.contiguous()
        else:
            out[official_name(name)] = tensor
    return out


def official_config(hf_config: dict, converter_keys: dict, encoding: str) -> dict:
    """DeepSeek's own ``config.json`` for the official layout, from transformers' saved one."""
    config = {k: v for k, v in hf_config.items() if k not in _V4_TRANSFORMERS_ONLY_KEYS}
    config.update(converter_keys)
    config["torch_dtype"] = "float32" if encoding == "f32" else "bfloat16"
    if encoding in ("fp8-e8m0", "fp4-experts"):
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "scale_fmt": "ue8m0", "weight_block_size": FP8_BLOCK}
        if encoding == "fp4-experts":
            config["expert_dtype"] = "fp4"
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------------------------
# encoding

@dataclass
class Encoded:
    """Tensors to write (numpy), safetensors dtype overrides, and which stored names belong to which weight."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    companions: dict[str, list[str]] = field(default_factory=dict)   # stored weight -> its scale tensors
    unquantized_modules: list[str] = field(default_factory=list)     # 2-D weights kept (modules_to_not_convert)

    def put(self, name: str, array: np.ndarray, dtype: str | None = None) -> None:
        self.arrays[name] = array
        if dtype is not None:
            self.dtypes[name] = dtype


def to_numpy(tensor) -> np.ndarray:
    """torch tensor -> numpy with the same bytes (bfloat16 as ml_dtypes.bfloat16)."""
    import ml_dtypes
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _fused_group(name: str) -> str:
    for pattern, replacement in _FUSED_GROUPS:
        if pattern.search(name):
            return pattern.sub(replacement, name)
    return name


def _module(name: str) -> str:
    return name[: -len(".weight")]


def encode_tensors(tensors: dict, encoding: str, scale_suffix: str) -> Encoded:
    """Encode ``tensors`` (torch, any layout) as ``encoding``; ``scale_suffix`` names FP8/FP4 scales."""
    enc = Encoded()
    roles = {name: tensor_role(name, tensor.ndim) for name, tensor in tensors.items()}
    group_amax: dict[str, float] = {}
    if encoding.startswith("nvfp4"):
        for name, role in roles.items():
            if role is not None:
                group = _fused_group(name)
                amax = float(tensors[name].float().abs().max())
                group_amax[group] = max(group_amax.get(group, 0.0), amax)
    for name in sorted(tensors):
        tensor, role = tensors[name], roles[name]
        if encoding in PLAIN_ENCODINGS or role is None:
            enc.put(name, to_numpy(tensor))
            if tensor.ndim == 2 and name.endswith(".weight") and "embed" not in name:
                enc.unquantized_modules.append(_module(name))
            continue
        w = tensor.float().numpy()
        module = _module(name)
        if encoding.startswith("nvfp4"):
            _put_nvfp4(enc, name, w, encoding.removeprefix("nvfp4-"), group_amax[_fused_group(name)])
        elif role == "routed" and encoding == "fp4-experts":
            packed, scales = blockscaled.fp4_e8m0_quantize(w)
            enc.put(name, packed, "I8")
            enc.put(module + scale_suffix, scales, "F8_E8M0")
            enc.companions[name] = [module + scale_suffix]
        elif encoding == "fp8-block":
            codes, scale_inv = blockscaled.fp8_block_quantize(w, FP8_BLOCK)
            enc.put(name, codes, "F8_E4M3")
            enc.put(module + scale_suffix, scale_inv)
            enc.companions[name] = [module + scale_suffix]
        elif encoding == "fp8-block-ue8m0":
            codes, scales = blockscaled.fp8_block_quantize_e8m0(w, FP8_BLOCK)
            enc.put(name, codes, "F8_E4M3")
            enc.put(module + scale_suffix, e8m0_decode(scales))
            enc.companions[name] = [module + scale_suffix]
        else:   # fp8-e8m0, and the dense tensors of fp4-experts
            codes, scales = blockscaled.fp8_block_quantize_e8m0(w, FP8_BLOCK)
            enc.put(name, codes, "F8_E4M3")
            enc.put(module + scale_suffix, scales, "F8_E8M0")
            enc.companions[name] = [module + scale_suffix]
    return enc


def _put_nvfp4(enc: Encoded, name: str, w: np.ndarray, convention: str, group_amax: float) -> None:
    module = _module(name)
    parts = blockscaled.nvfp4_quantize(w, convention, global_amax=group_amax)
    packed_key, scale_key, global_key = blockscaled.NVFP4_TENSORS[convention]
    act_gs = np.float32(ASSUMED_ACTIVATION_AMAX) / np.float32(6.0 * 448.0)
    if convention == "modelopt":
        act_name, act = module + ".input_scale", np.asarray(act_gs, dtype=np.float32).reshape(())
    else:
        act_name, act = module + ".input_global_scale", (np.float32(1.0) / act_gs).reshape(1)
    stored = f"{module}.{packed_key}"
    enc.put(stored, parts[packed_key], "U8")
    enc.put(f"{module}.{scale_key}", parts[scale_key], "F8_E4M3")
    enc.put(f"{module}.{global_key}", parts[global_key])
    enc.put(act_name, act)
    enc.companions[stored] = [f"{module}.{scale_key}", f"{module}.{global_key}", act_name]


def quantization_config(encoding: str, unquantized: list[str]) -> dict | None:
    """``config.json``'s ``quantization_config`` for a transformers-layout checkpoint of ``encoding``."""
    if encoding in PLAIN_ENCODINGS:
        return None
    if encoding.startswith("fp"):
        config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                  "weight_block_size": FP8_BLOCK, "modules_to_not_convert": unquantized}
        if encoding != "fp8-block":
            config["scale_fmt"] = "ue8m0"
        if encoding == "fp4-experts":
            config["expert_dtype"] = "fp4"
        return config
    if encoding == "nvfp4-modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": blockscaled.NVFP4_BLOCK,
                "kv_cache_quant_algo": None, "exclude_modules": unquantized, "producer": EMULATED_PRODUCER}
    scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": blockscaled.NVFP4_BLOCK,
              "symmetric": True, "observer": "minmax", "actorder": None, "block_structure": None,
              "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": {**scheme, "dynamic": False},
                                          "input_activations": {**scheme, "dynamic": "local"},
                                          "output_activations": None}},
            "ignore": unquantized, "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


# ---------------------------------------------------------------------------------------------------------------
# sharding and writing

def shard_plan(enc: Encoded, shards: int) -> dict[str, str]:
    """Stored name -> shard file: names in order, split into ``shards`` runs of (nearly) equal count; then the
    scales of the first quantized weight move to the shard after their weight's."""
    names = sorted(enc.arrays)
    if shards == 1:
        return dict.fromkeys(names, "model.safetensors")
    if not 1 < shards <= len(names):
        raise UnsupportedError(f"cannot split {len(names)} tensors into {shards} shards")
    plan = {name: position * shards // len(names) for position, name in enumerate(names)}
    if enc.companions:
        weight = min(enc.companions)
        for scale in enc.companions[weight]:
            plan[scale] = (plan[weight] + 1) % shards
    if len(set(plan.values())) != shards:
        raise UnsupportedError(f"{len(names)} tensors are too few to fill {shards} shards")
    return {name: f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for name, i in plan.items()}


def _write_tensors(out: Path, enc: Encoded, shards: int) -> None:
    plan = shard_plan(enc, shards)
    for filename in sorted(set(plan.values())):
        names = [n for n in sorted(plan) if plan[n] == filename]
        write_safetensors(out / filename, {n: enc.arrays[n] for n in names}, metadata=SAFETENSORS_METADATA,
                          dtypes={n: enc.dtypes[n] for n in names if n in enc.dtypes}, overwrite=True)
    if shards > 1:
        index = {"metadata": {"total_size": sum(a.nbytes for a in enc.arrays.values())},
                 "weight_map": dict(sorted(plan.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _check_request(arch: str, layout: str, encoding: str, shards: int) -> None:
    if layout not in LAYOUTS:
        raise UnsupportedError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if encoding in RELEASE_VARIANTS and layout != "official":
        raise UnsupportedError(f"the release variant {encoding!r} exists in the official layout only")
    if encoding not in ENCODINGS and encoding not in RELEASE_VARIANTS:
        raise UnsupportedError(f"unknown encoding {encoding!r}; expected one of {ENCODINGS} or "
                               f"{tuple(RELEASE_VARIANTS)}")
    if layout == "official" and arch != "deepseek_v4":
        raise UnsupportedError(f"the official upstream layout exists for deepseek_v4 only, not {arch!r}")
    if layout == "official" and RELEASE_VARIANTS.get(encoding, encoding) not in OFFICIAL_ENCODINGS:
        raise UnsupportedError(f"the official DeepSeek V4 layout has no {encoding!r} encoding; "
                               f"expected one of {OFFICIAL_ENCODINGS}")
    if layout == "fused" and encoding not in PLAIN_ENCODINGS:
        raise UnsupportedError(f"quantized encodings are written in the per-expert or official layout, "
                               f"not {layout!r}")
    if shards < 1:
        raise UnsupportedError(f"shards must be >= 1, got {shards}")


def _saved_by_transformers(model, fused: bool) -> tuple[dict, dict, dict | None]:
    """(tensors, config.json, generation_config.json) of ``model.save_pretrained``."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="quantkit-tiny-") as tmp:
        model.save_pretrained(tmp, save_original_format=not fused)
        tensors = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(path))
        config = json.loads((Path(tmp) / "config.json").read_text())
        generation = Path(tmp) / "generation_config.json"
        generation_config = json.loads(generation.read_text()) if generation.is_file() else None
    return tensors, config, generation_config


def write_checkpoint(arch: str, out: Path, layout: str = "per-expert", encoding: str = "bf16", shards: int = 1,
                     seed: int = 0) -> Path:
    """Write ``arch``'s tiny checkpoint (weights, config.json, tokenizer) into the directory ``out``."""
    from .tiny_models import build_tiny_model, get_arch

    _check_request(arch, layout, encoding, shards)
    spec = get_arch(arch)
    model, tokenizer = build_tiny_model(arch, seed=seed, dtype="f32" if encoding == "f32" else "bf16")
    tensors, config, generation_config = _saved_by_transformers(model, fused=layout == "fused")
    converter_keys = spec.converter_keys(model.config)
    if layout == "official":
        tensors = official_tensors(model)
        base = RELEASE_VARIANTS.get(encoding, encoding)
        config = official_config(config, converter_keys, base)
        enc = encode_tensors(tensors, base, ".scale")
        if encoding == "fp4-experts-u8-scales":
            for weight, scales in enc.companions.items():
                if enc.dtypes[weight] == "I8":   # packed FP4 experts
                    enc.dtypes.update(dict.fromkeys(scales, "U8"))
        elif encoding == "fp4-experts-no-config":
            del config["quantization_config"]
    else:
        enc = encode_tensors(tensors, encoding, ".weight_scale_inv")
        (config["text_config"] if spec.nested else config).update(converter_keys)
        quant = quantization_config(encoding, sorted(enc.unquantized_modules))
        if quant is not None:
            config["quantization_config"] = quant
    out.mkdir(parents=True, exist_ok=True)
    _write_tensors(out, enc, shards)
    tokenizer.save_pretrained(out)
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    if encoding == "nvfp4-modelopt":
        hf_quant = {"producer": EMULATED_PRODUCER,
                    "quantization": {k: config["quantization_config"][k]
                                     for k in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")}}
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    # config.json last: its presence marks a complete checkpoint (TinyCheckpointCache relies on it)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
