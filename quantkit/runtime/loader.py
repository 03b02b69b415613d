"""Load a GGUF (or a safetensors checkpoint) into the matching transformers model, weights kept packed.

:func:`load_model`:

1. opens the weights (:mod:`.weights`) and builds the transformers config from the source ``config.json``; the
   model class is the one the config names (``architectures[0]``), as ``from_pretrained`` would pick;
2. constructs the model with every parameter on the meta device (no memory, no random init) and buffers real, so
   values the model computes at construction (rotary frequencies, n-gram hash constants) are transformers' own;
   routed experts run as grouped products on CUDA (:mod:`.experts`: tokens sorted by expert, a layer's experts
   decoded together) and, on the CPU, as per-expert products over rows sorted by expert once (one expert's
   weights read at a time, so a model larger than memory streams; with ``ggml-cpu`` arithmetic transformers'
   eager per-expert loop, whose products ggml runs); ``experts=`` overrides;
   attention is transformers' SDPA (``attn_implementation="sdpa"``) wherever the model's code supports it (all
   but DeepSeek V4 among the seed architectures), kept off the O(n^2) math kernel in float32 (:mod:`.attention`);
3. resolves every parameter and persistent buffer through the architecture map (:meth:`quantkit.arch.ArchMap.resolve`)
   to the GGUF tensors it comes from and plans its inverse (:mod:`.inverse`).  Matrices become
   :class:`~quantkit.runtime.packed.PackedTensor` (bytes stay in the file or on the device, decoded per use);
   vectors, convolutions and integer tables are decoded once.  Parameters of parts the GGUF does not carry (a
   vision tower, MTP blocks) stay on the meta device; tied parameters share one tensor;
4. checks the file: every GGUF tensor is used, and every hyperparameter the config implies
   (:meth:`quantkit.arch.ArchMap.metadata`) equals the file's value, so a wrong config cannot run silently.

:func:`logits` runs one sequence and returns float32 logits, raising on token ids outside the vocabulary, on
weights that decode to NaN/inf (naming the GGUF tensor) and on non-finite logits (naming the first module whose
output was not finite).  On CUDA in float32 (payloads resident), a shape of at most :data:`GRAPH_MAX_TOKENS` that
repeats is captured as a CUDA graph and replayed (:func:`_forward`: the pass's launches without Python; the same
kernels, so the same logits).  The compute dtype is float32 unless ``dtype=`` says otherwise.  ``arithmetic="ggml-cpu"``
computes as llama.cpp's CPU backend does (:mod:`.ggml_arithmetic`: products, SiLU and sigmoid in libggml-cpu
itself when llama-cpp-python is installed, else activations rounded as ggml rounds them), to score a GGUF with the
engine's own figures; the default, ``"float32"``, multiplies the decoded weights in float32.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..arch import ArchMap, get_arch
from ..arch.dialects import relaid_mappings
from ..errors import FixtureError, FormatError, UnsupportedError, ValidationError
from ..io.gguf import KV
from .attention import causal_chunks, install as install_sdpa, one_sequence_per_row, replace_method
from .experts import EXPERTS_MODES, GROUPED, SORTED, register as register_experts
from .indexer import install as install_indexers
from .inverse import TensorPlan, plan_tensor
from .gdn import install as install_gdn
from .hyper import install as install_hyper_connections
from .kda import install as install_kda
from .packed import FUSED_DTYPES, Assembler, PackedTensor, WeightStore, finite_flag, scale_companion
from .sliding import install as install_sliding_attention
from .weights import SOURCE_CONFIG_KEY, open_weights

#: Metadata prefixes the consistency check skips: the writer's own keys and the tokenizer (not the forward pass).
UNCHECKED_KEY_PREFIXES = ("general.", "tokenizer.", "quantkit.", "quantize.", "GGUF.")
EXPERTS_IMPLEMENTATION = "eager"
#: Values of ``load_model(arithmetic=)``.
ARITHMETICS = ("float32", "ggml-cpu")


@dataclass
class RuntimeModel:
    """A transformers model whose weights live in a :class:`~quantkit.runtime.packed.WeightStore`."""

    module: Any
    """The transformers model (``...ForCausalLM`` / ``...ForConditionalGeneration``), in eval mode."""
    store: WeightStore
    config: dict
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    packed: dict[str, TensorPlan] = field(default_factory=dict)
    """Model tensor name -> plan, for every weight kept packed."""
    arithmetic: str = "float32"
    """How products are computed: ``float32`` or ``ggml-cpu`` (see the module doc)."""
    graphs: bool = False
    """Whether :func:`logits_batch` replays repeated input shapes as CUDA graphs (:class:`_Graph`)."""
    _graph: "_Graph | None" = None
    _repeat_candidate: tuple | None = None
    """The last pass's input shape, if that pass decoded nothing for the first time (captured if it comes again
    next)."""

    def forward_mode(self):
        """The context every forward pass of this model runs in (its :attr:`arithmetic`)."""
        if self.arithmetic == "ggml-cpu":
            from .ggml_arithmetic import ggml_activations
            return ggml_activations(self.module)
        return contextlib.nullcontext()

    @property
    def path(self):
        return self.store.weights.path

    @property
    def output_width(self) -> int | None:
        """Columns of the logits, read off the output head's weight (no pass needed); None for a model whose
        head is not a module with a weight."""
        head = self.module.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return int(weight.shape[0]) if weight is not None else None

    def close(self) -> None:
        self.store.weights.close()


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    """Construct modules with parameters on the meta device and buffers real (accelerate's init_empty_weights)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def model_skeleton(config: Mapping[str, Any], dtype: torch.dtype = torch.float32,
                   experts_implementation: str = EXPERTS_IMPLEMENTATION):
    """The transformers model ``config`` describes, parameters on the meta device (see the module doc)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedError(f"transformers {transformers.__version__} has no model type {model_type!r}",
                               field="model_type")
    hf_config = CONFIG_MAPPING[model_type].from_dict(dict(config))
    if experts_implementation in (GROUPED, SORTED):
        register_experts()
    install_sdpa()
    hf_config._experts_implementation = experts_implementation
    names = list(config.get("architectures") or []) or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)]
    cls = getattr(transformers, names[0] or "", None)
    if cls is None:
        raise UnsupportedError(f"transformers has no model class {names[0]!r} for {model_type!r}",
                               field="architectures")
    with _meta_parameters():
        model = cls._from_config(hf_config, dtype=dtype)
    install_indexers(model)
    install_sliding_attention(model)
    install_kda()
    install_gdn()
    return model.eval()


def _named_tensors(model) -> dict[int, list[tuple[Any, str, str, bool]]]:
    """id -> [(module, attribute, full name, is_parameter)] for parameters and persistent buffers (tied ones
    share an id)."""
    found: dict[int, list] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attr, tensor in module._parameters.items():
            if tensor is not None:
                found.setdefault(id(tensor), []).append((module, attr, prefix + attr, True))
        for attr, tensor in module._buffers.items():
            if tensor is not None and attr not in module._non_persistent_buffers_set:
                found.setdefault(id(tensor), []).append((module, attr, prefix + attr, False))
    return found


def _set(module, attr: str, value: torch.Tensor, is_parameter: bool) -> None:
    if is_parameter and not isinstance(value, PackedTensor):
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
        return
    module._parameters.pop(attr, None)
    module._buffers[attr] = value
    if is_parameter:
        module._non_persistent_buffers_set.add(attr)


def _keep_packed(plan: TensorPlan, tensor: torch.Tensor, stored: Mapping) -> bool:
    """Matrices stay packed; vectors, convolutions (stored 4-D by the map) and integer tables are decoded."""
    return (tensor.is_floating_point() and len(plan.shape) >= 2
            and all(len(stored[name]) in (2, 3) for name in plan.gguf_names))


def _compare(key: str, expected: KV, found: KV) -> bool:
    a, b = expected.value, found.value
    if isinstance(a, (list, tuple, np.ndarray)) or isinstance(b, (list, tuple, np.ndarray)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if a.dtype.kind == "f" or b.dtype.kind == "f":
            return np.array_equal(a.astype(np.float32), b.astype(np.float32))
        return np.array_equal(a, b)
    if isinstance(a, float) or isinstance(b, float):
        return np.float32(a) == np.float32(b)
    return a == b


def _check_metadata(weights, amap: ArchMap, model) -> None:
    """Every hyperparameter the config implies must equal the file's (keys the file lacks are not checked)."""
    if weights.metadata is None:
        return
    state = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    expected = amap.metadata(None, tensor_values=lambda name: state[name].detach().cpu().numpy(),
                             tensor_shapes=shapes)
    for key, kv in expected:
        if key.startswith(UNCHECKED_KEY_PREFIXES) or key not in weights.metadata:
            continue
        if not _compare(key, kv, weights.metadata[key]):
            found = weights.metadata[key].value
            raise FormatError(f"the config gives {str(kv.value)[:80]}, the file holds {str(found)[:80]}: the "
                              f"config does not describe this file (check {SOURCE_CONFIG_KEY} or config=)",
                              path=weights.path, field=key)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", *,
               config: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.float32,
               stream: bool = False, cache_bytes: int | None = None, keep_bytes: int = 0,
               replace: Mapping[str, Callable[[], np.ndarray]] | None = None,
               arithmetic: str = "float32", experts: str = "auto") -> RuntimeModel:
    """A GGUF file (made by quantkit) or a safetensors checkpoint as a runnable transformers model.

    ``config``: the source ``config.json`` as a dict, overriding the file's.  ``stream=True`` (CUDA) keeps the
    payloads in host memory (the mapped file) and copies each to the device per use, for models larger than the
    device.  ``cache_bytes`` and ``replace`` apply to a checkpoint (:class:`.weights.CheckpointWeights`).
    ``keep_bytes``: packed weights decoded on use are kept, up to this many bytes (:class:`.packed.Assembler`),
    for a model run many times (a calibration run).  ``arithmetic``: ``float32`` or ``ggml-cpu`` (module doc).
    ``experts``: ``grouped`` or ``sorted`` (:mod:`.experts`), ``eager`` (transformers' per-expert loop) or ``auto``
    (with float32 arithmetic grouped on CUDA and sorted on the CPU; eager otherwise).
    """
    if arithmetic not in ARITHMETICS:
        raise UnsupportedError(f"unknown arithmetic {arithmetic!r} (one of {', '.join(ARITHMETICS)})")
    if experts not in EXPERTS_MODES:
        raise UnsupportedError(f"unknown experts mode {experts!r} (one of {', '.join(EXPERTS_MODES)})")
    device = torch.device(device)
    if experts == "auto":
        experts = "eager" if arithmetic != "float32" else "grouped" if device.type == "cuda" else "sorted"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"device {str(device)!r} requested but torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UnsupportedError(f"device {str(device)!r} requested but torch sees {torch.cuda.device_count()} CUDA "
                               f"device(s)")
    weights = open_weights(path, config, cache_bytes=cache_bytes, replace=replace)
    try:
        implementation = {"grouped": GROUPED, "sorted": SORTED}.get(experts, "eager")
        model = _load(weights, device, dtype, stream, keep_bytes, implementation)
    except BaseException:
        weights.close()
        raise
    model.arithmetic = arithmetic
    return model


#: Architectures quantkit converts and validates but cannot run: model_type -> what running it needs.
UNRUNNABLE = {
    "deepseek_v41": "a DeepSeek V4.1 forward pass (Engram n-gram hashing, table lookup and gating; shared "
                    "compressed attention streams): transformers has no V4.1 model and quantkit implements none; "
                    "score V4.1 files with a V4.1 engine",
}


def _load(weights, device: torch.device, dtype: torch.dtype, stream: bool, keep_bytes: int,
          experts_implementation: str) -> RuntimeModel:
    model_type = weights.config.get("model_type")
    if model_type in UNRUNNABLE:
        raise UnsupportedError(f"scoring {model_type} needs {UNRUNNABLE[model_type]}", path=weights.path,
                               field="model_type")
    amap = get_arch(model_type).bind(weights.config)
    gguf_arch = weights.metadata.get("general.architecture") if weights.metadata is not None else None
    mtp = _mtp_tensors(weights, amap)
    if gguf_arch is not None and gguf_arch.value != amap.arch.gguf_arch:
        raise FormatError(f"the file is a {gguf_arch.value!r} model, the config a {model_type!r} one "
                          f"({amap.arch.gguf_arch!r})", path=weights.path, field="general.architecture")
    model = model_skeleton(weights.config, dtype, experts_implementation)
    _check_metadata(weights, amap, model)
    store = WeightStore(weights, device, stream=stream)
    assembler = Assembler(store, keep_bytes)
    stored = {name: t.shape for name, t in weights.tensors.items()}
    used: set[str] = set()
    packed: dict[str, TensorPlan] = {}
    for owners in _named_tensors(model).values():
        tensor = getattr(owners[0][0], owners[0][1])
        source = None
        for _, _, name, _ in owners:
            mappings = [m for m in amap.resolve(name) if m.role == "weight"]
            if mappings and all(m.gguf_name is not None for m in mappings):
                if getattr(weights, "relaid_table", None) is not None:     # ds4's Qwen3.8 layout
                    mappings = relaid_mappings(mappings, weights.relaid_table)
                source = (name, mappings)
                break
        if source is None:      # dropped by the map: vision tower, MTP, constants the model computes itself
            continue
        plan = plan_tensor(source[0], tuple(tensor.shape), source[1], amap.hp, stored)
        for name in plan.gguf_names:
            if name not in used:
                used.add(name)
                store.place(name)
        if _keep_packed(plan, tensor, stored):
            value = PackedTensor(assembler, plan, dtype)
            packed[plan.name] = plan
        else:
            value = assembler.build(plan, dtype if tensor.is_floating_point() else tensor.dtype)
        for module, attr, _, is_parameter in owners:
            _set(module, attr, value, is_parameter)
    unused = sorted(set(weights.tensors) - used - mtp - {scale_companion(n) for n in used})
    if unused:
        raise FormatError(f"{len(unused)} GGUF tensors match no parameter of the {model_type} model: "
                          f"{', '.join(unused[:8])}", path=weights.path)
    for module in model.modules():
        for attr, buffer in list(module._buffers.items()):
            if buffer is not None and not isinstance(buffer, PackedTensor) and buffer.device != device:
                module._buffers[attr] = buffer.to(device)
    store.check()
    if device.type == "cuda" and dtype == torch.float32:
        _fuse_rms_norms(model)
        install_hyper_connections(model)
    return RuntimeModel(model, store, weights.config, device, dtype, _vocab_size(model), packed,
                        graphs=device.type == "cuda" and not stream and dtype in FUSED_DTYPES)


#: transformers RMSNorm classes computing ``x / sqrt(mean(x²) + eps) * (1 + weight)``, over groups of
#: ``group_size`` values of the last axis where set (Qwen3.8 Flash Next's, also over its hyper-connection streams).
OFFSET_RMS_NORMS = ("Qwen4ExpTextRMSNorm",)


def _fuse_rms_norms(model) -> None:
    """Run the plain RMSNorms (:data:`.ggml_arithmetic.PLAIN_RMS_NORMS`) and the ``1 + weight`` ones
    (:data:`OFFSET_RMS_NORMS`) of a float32 CUDA model as one Triton launch each
    (:func:`quantkit.kernels.triton_rmsnorm.rms_norm`) where the activations are float32 (a slice, such as
    the query heads of a wider projection, copied contiguous first: one copy instead of transformers' six passes);
    transformers' kernels otherwise."""
    from ..kernels.triton_rmsnorm import rms_norm
    from .ggml_arithmetic import PLAIN_RMS_NORMS

    def fits(module, hidden_states) -> bool:
        w = module.weight
        return (hidden_states.is_cuda and hidden_states.dtype == torch.float32
                and type(w) is torch.nn.Parameter and w.dtype == torch.float32 and w.is_contiguous()
                and tuple(w.shape) == tuple(hidden_states.shape[-1:]))

    def plain(module, theirs, hidden_states):
        if fits(module, hidden_states):
            return rms_norm(hidden_states.contiguous(), module.weight, module.variance_epsilon)
        return theirs(hidden_states)

    def offset(module, theirs, hidden_states):
        if fits(module, hidden_states):
            return rms_norm(hidden_states.contiguous(), module.weight, module.eps, group=module.group_size,
                            plus_one=True)
        return theirs(hidden_states)

    for m in model.modules():
        if type(m).__name__ in PLAIN_RMS_NORMS:
            replace_method(m, "forward", plain)
        elif type(m).__name__ in OFFSET_RMS_NORMS:
            replace_method(m, "forward", offset)


def _mtp_tensors(weights, amap: ArchMap) -> set[str]:
    """The tensors of the MTP blocks a main file keeps past the model's own (:attr:`~quantkit.arch.base.Arch.
    mtp_rules`; the transformers model has no MTP block): ``blk.N`` from ``num_hidden_layers`` on when the file
    counts them (``nextn_predict_layers``, also counted in the metadata checked), and ds4's ``mtp.K.*``."""
    if not amap.arch.mtp_rules or weights.metadata is None:
        return set()
    arch = amap.arch.gguf_arch
    nextn = weights.metadata.get(f"{arch}.nextn_predict_layers")
    amap.mtp_blocks = int(nextn.value) if nextn is not None else 0
    n = amap.hp["num_hidden_layers"]
    blocks = tuple(f"blk.{n + k}." for k in range(amap.mtp_blocks))
    return {name for name in weights.tensors if name.startswith(blocks) or name.startswith("mtp.")}


def _vocab_size(model) -> int:
    embeddings = model.get_input_embeddings()
    return int(embeddings.weight.shape[0])


def _first_non_finite(model, input_ids: torch.Tensor) -> str:
    """The first module (in call order) whose output holds NaN or infinity."""
    found: list[str] = []

    def hook(name):
        def check(module, args, output):
            tensors = [output] if isinstance(output, torch.Tensor) else \
                [t for t in (output if isinstance(output, (tuple, list)) else getattr(output, "values", lambda: [])())
                 if isinstance(t, torch.Tensor)]
            if not found and any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors):
                found.append(name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else "(no module output)"


def check_token_ids(model: RuntimeModel, token_ids: Sequence[int]) -> np.ndarray:
    """``token_ids`` as a 1-D integer array, refusing an empty sequence and ids outside the vocabulary."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise FixtureError(f"expected a non-empty 1-D sequence of integer token ids, got {ids.dtype}{list(ids.shape)}")
    bad = np.nonzero((ids < 0) | (ids >= model.vocab_size))[0]
    if bad.size:
        raise FixtureError(f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the vocabulary "
                           f"(0..{model.vocab_size - 1})")
    return ids


def logits(model: RuntimeModel, token_ids: Sequence[int]) -> np.ndarray:
    """float32 logits ``[len(token_ids), vocab]`` of one sequence (the whole sequence in one pass, no cache; past
    :data:`LONG_PASS_TOKENS`, a :data:`CHUNKED_ARCHITECTURES` model's in chunks through the cache)."""
    return logits_batch(model, [token_ids])[0]


def logits_batch(model: RuntimeModel, sequences: Sequence[Sequence[int]], first: int = 0) -> list[np.ndarray]:
    """float32 logits ``[len(s) - first, vocab]`` of each sequence (positions ``first``.. only: the output head
    multiplies those rows only, as llama-perplexity asks for the second half of each chunk), all in one forward
    pass (no cache; or in chunks, as :func:`logits`).

    The sequences are right-padded to the longest: in a causal model no position sees a later one, so the padding
    changes no real position's inputs, only the shapes of the products (hence the float32 rounding, within the
    runtime's tolerance)."""
    return start_logits_batch(model, sequences, first).result()


@dataclass
class PendingLogits:
    """A forward pass of :func:`start_logits_batch` whose logits are on their way to the host: :meth:`result`
    waits for them and raises what :func:`logits_batch` raises."""

    model: RuntimeModel
    input_ids: torch.Tensor
    """The pass's (padded) ids, its own copy: a CUDA graph's input buffer is overwritten by the next replay."""
    first: int
    lengths: list[int]
    """Positions of each sequence's logits (``len - first``)."""
    host: torch.Tensor
    """``[sequences, positions, vocab]`` float32 logits (on the host once ``done``)."""
    flags: torch.Tensor
    """On the host once ``done``: each decoded payload's finiteness (``checks``), then each sequence's logits'."""
    checks: list
    done: Any = None
    """CUDA event after the copies to the host (None: already there)."""
    row_stats: tuple = ()
    """``row_stats``' tensors of :func:`start_logits_batch`, ``[sequences, positions]`` each (on the host once
    ``done``)."""

    def result_stats(self) -> list[tuple[np.ndarray, ...]]:
        """After :meth:`result`: each sequence's ``row_stats`` arrays, positions ``first``.. of it."""
        return [tuple(s[row, :n].numpy() for s in self.row_stats) for row, n in enumerate(self.lengths)]

    def result(self) -> list[np.ndarray]:
        if self.done is not None:
            self.done.synchronize()
        n_checks = len(self.checks)
        self.model.store.settle(self.checks, self.flags[:n_checks])
        finite = self.flags[n_checks:].tolist()
        results = []
        for row, n in enumerate(self.lengths):
            result = self.host[row, :n].numpy()
            if not finite[row]:
                position = self.first + int(np.argwhere(~np.isfinite(result))[0][0])
                module = _first_non_finite(self.model.module, self.input_ids[row:row + 1, :self.first + n])
                raise ValidationError(f"non-finite logits at position {position}; first non-finite output: module "
                                      f"{module!r}", path=self.model.path)
            results.append(result)
        return results


#: Side stream per device for the logits' copies to the host.
_copy_streams: dict[torch.device, Any] = {}


def start_logits_batch(model: RuntimeModel, sequences: Sequence[Sequence[int]], first: int = 0,
                       row_stats: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None) -> PendingLogits:
    """:func:`logits_batch` in two steps: queue the forward pass and the logits' copy to the host, then
    (:meth:`PendingLogits.result`) wait for them.  On CUDA nothing here waits for the device, and the copy runs on
    a side stream from a device copy of the logits (a replayed graph's output is overwritten by the next replay),
    so the next pass, started before this one's result is asked for, computes while this one's logits travel
    (4.8 ms of 2048 x 32000 float32 logits on an H200, a pass being ~116 ms).  Memory: per pass not yet
    collected, its logits once more on the device (until copied) and on the host (page-locked).

    ``row_stats``: a function of float32 logits rows ``[rows, vocab]`` returning per-row tensors (scoring's
    log-normalizers), applied where the logits are and copied to the host with them
    (:meth:`PendingLogits.result_stats`)."""
    ids = [check_token_ids(model, s) for s in sequences]
    lengths = [len(i) for i in ids]
    if not 0 <= first < min(lengths):
        raise FixtureError(f"logits from position {first}: the shortest sequence has {min(lengths)} tokens")
    padded = np.zeros((len(ids), max(lengths)), np.int64)    # id 0 pads: any valid id does
    for row, (values, n) in enumerate(zip(ids, lengths)):
        padded[row, :n] = values
    input_ids = torch.as_tensor(padded, device=model.device)
    out = _forward(model, input_ids, max(lengths) - first if first else 0)     # positions first.. of the rows
    checks = model.store.take_checks(0)        # every check queued so far, as logits_batch always made
    lengths = [n - first for n in lengths]
    # one reduction per sequence where the logits are, all flags fetched at once (not a host pass over the logits)
    flags = torch.stack([flag for _, _, flag in checks] + [finite_flag(out[row, :n]) for row, n in enumerate(lengths)])
    values = out.float()
    stats = () if row_stats is None else tuple(
        s.view(values.shape[:2]) for s in row_stats(values.reshape(-1, values.shape[-1])))
    if out.device.type != "cuda":
        return PendingLogits(model, input_ids, first, lengths, values, flags.cpu(), checks, row_stats=stats)
    stream = _copy_streams.setdefault(out.device, torch.cuda.Stream(out.device))
    if model._graph is not None and out is model._graph.logits:
        values = values.clone()             # the graph's output buffer stays free for the next replay
    stream.wait_stream(torch.cuda.current_stream(out.device))
    with torch.cuda.stream(stream):
        # page-locked: torch caches freed pinned blocks, and the copy runs at the link's speed, not the several
        # times slower staged copy into fresh pageable memory
        host, host_flags, *host_stats = (_to_pinned(t) for t in (values, flags, *stats))
        done = torch.cuda.Event()
        done.record(stream)
    for t in (values, flags, *stats):
        t.record_stream(stream)
    return PendingLogits(model, input_ids, first, lengths, host, host_flags, checks, done, tuple(host_stats))


def _to_pinned(values: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of a device tensor, queued on the current stream."""
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return host.copy_(values, non_blocking=True)


#: Architectures whose attention in one pass holds a score for every (query, key) pair: DeepSeek V4's eager
#: attention over its compressed entries, the sparse-attention indexers' scores and masks (GLM-5.3-Flash,
#: Qwen3.8 Flash Next), ``[heads, n, n]``-sized.  Their sequences longer than :data:`LONG_PASS_TOKENS` run in
#: chunks of :data:`LONG_CHUNK` tokens through transformers' cache (:func:`_chunked`), so attention holds
#: ``[heads, LONG_CHUNK, n]`` at most: memory linear in n.  qwen3_moe and deepseek_v3 attend with SDPA's
#: memory-efficient kernel, linear in one pass (:mod:`.attention`).
CHUNKED_ARCHITECTURES = frozenset({"deepseek_v4", "glm5_next", "qwen4_exp"})
LONG_PASS_TOKENS = 4096
#: llama.cpp's default batch (``-b``) too.
LONG_CHUNK = 2048

#: The most tokens (sequences x padded length) of a forward pass replayed as a CUDA graph: the graph keeps its
#: activations allocated between calls, and past a few thousand tokens the device, not the launches, bounds a pass.
GRAPH_MAX_TOKENS = 4096


@dataclass
class _Graph:
    """A forward pass captured as a CUDA graph: its input ids and logits stay allocated; a replay reruns every
    kernel launch of the pass with no Python in between."""

    shape: tuple
    """The input ids' shape and the logits' positions kept (``logits_to_keep``, 0 for all)."""
    graph: Any
    input_ids: torch.Tensor
    logits: torch.Tensor
    checks: list
    """The finiteness checks the pass queues (rows decoded per pass: the token embedding's), flags in place."""


def _eager(model: RuntimeModel, input_ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    # no_grad, not inference_mode: packed weights answer view operations (weight[expert]) with fresh tensors,
    # which inference mode refuses to register as views
    with torch.no_grad(), model.forward_mode(), one_sequence_per_row():
        if keep:
            return model.module(input_ids=input_ids, use_cache=False, logits_to_keep=keep).logits
        return model.module(input_ids=input_ids, use_cache=False).logits


def _chunked(model: RuntimeModel, input_ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """The logits of one forward pass computed :data:`LONG_CHUNK` tokens at a time, each chunk's queries against
    the cached keys before them (the same logits as one pass: tests/test_runtime_long.py); the output head
    multiplies the last ``keep`` positions only, if not 0.  The scoring passes' own paths that need no cache (CUDA
    graphs, V4's band, GLM's pools) give way to transformers'; Qwen3.8's batched indexer serves the chunks too."""
    n = input_ids.shape[1]
    first = n - keep if keep else 0
    pieces, cache = [], None
    with torch.no_grad(), model.forward_mode(), causal_chunks():
        for start in range(0, n, LONG_CHUNK):
            end = min(start + LONG_CHUNK, n)
            wanted = end - max(start, first)        # positions of this chunk whose logits are asked for
            out = model.module(input_ids=input_ids[:, start:end], past_key_values=cache, use_cache=True,
                               logits_to_keep=max(wanted, 1))
            cache = out.past_key_values
            if wanted > 0:
                pieces.append(out.logits[:, -wanted:])
    return torch.cat(pieces, 1)


def _forward(model: RuntimeModel, input_ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """The logits of one forward pass (of the last ``keep`` positions only, if not 0).  With
    :attr:`RuntimeModel.graphs`, a shape of at most :data:`GRAPH_MAX_TOKENS` whose eager pass decoded nothing for
    the first time (every payload's finiteness is then proven; the pass has no host wait) is captured if the next
    pass has the same shape, then replayed while it repeats (chunked scoring, cases sorted by length: the
    512-token 7.6B MoE pass is ~2,250 launches, host-bound when each goes through Python).  Shapes that alternate
    stay eager: a capture costs about a pass.  The checks a pass queues each time (the embedding rows it decodes)
    are queued again after every replay.  One graph is kept per model.  A long sequence of a
    :data:`CHUNKED_ARCHITECTURES` model runs in chunks (:func:`_chunked`)."""
    model_type = model.config.get("model_type")
    if input_ids.shape[1] > LONG_PASS_TOKENS and model_type in CHUNKED_ARCHITECTURES:
        return _chunked(model, input_ids, keep)
    if not model.graphs or input_ids.numel() > GRAPH_MAX_TOKENS:
        return _eager(model, input_ids, keep)
    shape = (tuple(input_ids.shape), keep)
    store = model.store
    graph = model._graph
    if graph is None or graph.shape != shape:
        if shape != model._repeat_candidate:
            before = store.first_checks
            out = _eager(model, input_ids, keep)
            model._repeat_candidate = shape if store.first_checks == before else None
            return out
        model._graph = None         # the previous graph's memory returns to the allocator first
        static_ids = input_ids.clone()
        captured = torch.cuda.CUDAGraph()
        start = store.queued()
        try:
            with torch.cuda.graph(captured):
                logits = _eager(model, static_ids, keep)
        except RuntimeError as exc:     # a model whose pass waits for the device (or copies from the host)
            store.take_checks(start)
            warnings.warn(f"CUDA graph capture failed, forward passes stay eager: {exc}", stacklevel=3)
            model.graphs = False
            return _eager(model, input_ids, keep)
        graph = model._graph = _Graph(shape, captured, static_ids, logits, store.take_checks(start))
    model._repeat_candidate = shape
    graph.input_ids.copy_(input_ids)
    graph.graph.replay()
    store.requeue(graph.checks)
    return graph.logits


def hidden_states(model: RuntimeModel, token_ids: Sequence[int]) -> list[np.ndarray]:
    """float32 hidden states of one sequence, transformers' ``output_hidden_states``: the embeddings, then each
    decoder layer's output (the last one after the final norm, where the model's forward puts it), each
    ``[len(token_ids), ...]`` (``[len, hidden]``, or ``[len, streams, hidden]`` with hyper-connections)."""
    ids = check_token_ids(model, token_ids)
    input_ids = torch.as_tensor(ids.astype(np.int64), device=model.device)[None]
    with torch.no_grad():        # no_grad, not inference_mode: see logits
        out = model.module(input_ids=input_ids, use_cache=False, output_hidden_states=True)
    model.store.check()
    if not out.hidden_states:
        raise UnsupportedError(f"the {model.config.get('model_type')} model returns no hidden states",
                               path=model.path)
    return [h[0].float().cpu().numpy() for h in out.hidden_states]
