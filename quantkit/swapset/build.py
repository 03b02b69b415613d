"""Make a sidecar: plan (data) first, then execute group by group into ``<name>.safetensors`` + ``<name>.json``.

Planning (:func:`plan_swapset`) opens the checkpoint beside which the sidecar will live (``model_dir``) and the
checkpoint the tensors come from (``source_dir``, default the same), resolves the requested families through the
architecture map, and fixes per module: the source tensor, whether it is copied **natively** (the source already
stores it in the target encoding: same NVFP4 convention, or FP8 with the same 128x128 scale kind; its bytes are
copied, never re-quantized) or **self-quantized** from its float32 decoding, the fused group whose members share
one NVFP4 global scale, the checkpoint tensors it replaces, and every output tensor's name, dtype and shape.  It
refuses, with one error naming the problem and before anything is written: an unknown family, a family that selects
nothing, a module missing from the source or shaped differently there, a row length the encoding cannot take, an
NVFP4 convention different from the checkpoint's, a tensor another current sidecar already covers (unless that
sidecar is listed in ``supersedes``), and a name that collides with checkpoint files.  The newest manifest wins a
supersede cycle: a sidecar that supersedes this one through ``supersedes`` (remaking A with ``--supersedes B``
after B superseded A, a roll-back) stops superseding it, so A is current and B obsolete.

Execution (:func:`build_swapset`) measures activation amax (with ``calibration``) and the draft head's hidden
states (with sample text) on the CPU reference model, then encodes fused group by fused group, writing each
tensor at its planned offset (:mod:`.writer`); NaN/Inf in a source weight stops it, naming the tensor and row.
The safetensors file and then the manifest are renamed into place; on any error neither final name is created.
Then the manifests of the sidecars that superseded this one in a cycle are rewritten without its name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .. import __version__
from ..arch import get_arch
from ..errors import EncodeError, MissingSourceError, OutputExistsError, RecipeError, SourceError
from ..io.atomic import atomic_output, check_output, input_files, sha256_file
from ..io.checkpoint import Checkpoint, open_checkpoint
from . import calibrate, draft
from .encodings import Encoding, get_encoding
from .families import FAMILIES, ROUTED, Family, fused_group
from .tensors import ROW_ROLES, decoded_shape, module_of, source_hash, stored_weight, tensor_sha256
from .inventory import current_sidecars, sidecar_paths, scan, superseded_closure
from .manifest import (KINDS, SCHEMA, SCHEMA_VERSION, TP_LAYOUT_NONE, check_name, checkpoint_identity,
                       manifest_text, read_manifest, shard_files, validate_manifest, write_manifest)
from .writer import Planned, PlannedSafetensors

#: Source scheme (:meth:`Checkpoint.tensor_f32` decoding) whose stored bytes ARE each target encoding.
NATIVE = {"nvfp4-modelopt": "nvfp4-modelopt", "nvfp4-compressed-tensors": "nvfp4-compressed-tensors",
          "fp8-block128": "fp8-block", "fp8-block128-e8m0": "fp8-block-e8m0"}
_NATIVE_BLOCK = (128, 128)
_INPUT_SCALE_ROLES = ("input_scale", "input_global_scale")
_SHARED_MODULE = re.compile(r"^(?P<prefix>.*)\.(shared_experts|shared_expert)\.(?P<proj>[^.]+)$")
SAFETENSORS_METADATA_KEY = "quantkit.swapset"


@dataclass(frozen=True)
class SwapsetRequest:
    """What ``quantkit swapset MODEL_DIR ...`` asks for (paths resolved by the caller)."""

    model_dir: Path
    families: tuple[str, ...] = ()
    fmt: str | None = None
    convention: str | None = None
    name: str | None = None
    source_dir: Path | None = None
    shared_experts: bool = False
    draft_lm_head: bool = False
    vocab_subset: int | None = None
    token_ids_file: Path | None = None
    calibration: Path | None = None
    sample: Path | None = None
    supersedes: tuple[str, ...] = ()
    optional: bool | None = None
    force: bool = False
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OutputTensor:
    name: str
    spec: Planned
    role: str
    source: str


@dataclass(frozen=True)
class ModulePlan:
    module: str
    output_module: str
    family: str
    group: str
    source_weight: str
    source_encoding: str
    origin: str
    shape: tuple[int, ...]
    replaces: tuple[str, ...]
    outputs: tuple[OutputTensor, ...]
    calibrate: bool


@dataclass
class SwapsetPlan:
    name: str
    kind: str
    model_type: str
    families: tuple[str, ...]
    fmt: str
    convention: str | None
    encoding: Encoding
    optional: bool
    supersedes: tuple[str, ...]
    modules: list[ModulePlan]
    token_ids: np.ndarray | None = None
    selection: str | None = None
    shared_expert_index: int | None = None
    calibration_ids: list[int] | None = None
    calibration_sha256: str | None = None
    sample_ids: list[int] | None = None
    overrules: tuple[str, ...] = ()
    """Sidecars that supersede this one through ``supersedes``: their manifests drop this name (newest wins)."""

    def specs(self) -> dict[str, Planned]:
        return {o.name: o.spec for m in self.modules for o in m.outputs}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs().values())

    def summary(self) -> dict:
        """The plan as printable data (``--dry-run``)."""
        return {"name": self.name, "kind": self.kind, "model_type": self.model_type, "families": list(self.families),
                "encoding": self.encoding.name, "optional": self.optional, "supersedes": list(self.supersedes),
                "overrules": list(self.overrules),
                "bytes": self.nbytes, "kept_rows": None if self.token_ids is None else int(len(self.token_ids)),
                "modules": [{"module": m.module, "output_module": m.output_module, "family": m.family,
                             "group": m.group, "origin": m.origin, "source_encoding": m.source_encoding,
                             "shape": list(m.shape), "calibrated": m.calibrate,
                             "tensors": {o.name: [o.spec.dtype, list(o.spec.shape)] for o in m.outputs}}
                            for m in self.modules]}


# ----------------------------------------------------------------------------------------------------------------
# planning

def _families(request: SwapsetRequest, model_type: str) -> tuple[str, tuple[Family, ...]]:
    known = FAMILIES.get(model_type)
    if known is None:
        raise RecipeError(f"no swapset families for model_type {model_type!r}; known architectures: "
                          f"{', '.join(sorted(FAMILIES))}", field="model_type")
    names = request.families or (("lmhead",) if request.draft_lm_head else ())
    if not names:
        raise RecipeError("no family given: pass --family (see --list-families)", field="family")
    if request.draft_lm_head and tuple(names) != ("lmhead",):
        raise RecipeError(f"--draft-lm-head makes a head for the drafter from the lmhead family; got --family "
                          f"{','.join(names)}", field="family")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise RecipeError(f"unknown family {unknown[0]!r} for {model_type}; known: {', '.join(known)}",
                          field="family")
    if len(set(names)) != len(names):
        raise RecipeError(f"family listed twice in {','.join(names)}", field="family")
    kind = KINDS[1] if request.draft_lm_head else KINDS[0]
    return kind, tuple(known[n] for n in names)


def _members(ckpt: Checkpoint, families: tuple[Family, ...]) -> dict[str, tuple[str, str]]:
    """module -> (family name, stored weight name) of every linear weight the families select."""
    amap = get_arch(ckpt.config.get("model_type")).bind(ckpt.config)
    main_layers = amap.hp["num_hidden_layers"]
    members: dict[str, tuple[str, str]] = {}
    for name in ckpt.tensor_names():
        module = module_of(name, len(ckpt.tensor_info(name).shape))   # packing keeps the dimension count
        if module is None:
            continue
        mappings = amap.resolve(name)
        if mappings[0].role != "weight" or len(decoded_shape(ckpt, name)) not in (2, 3):
            continue
        classes = frozenset(m.tensor_class for m in mappings)
        layer = mappings[0].layer
        mtp = "mtp" in classes or (layer is not None and layer >= main_layers)
        canonical = amap.canonical_name(module)
        for family in families:
            if family.admits(canonical, classes, mtp):
                if module in members:
                    raise RecipeError(f"families {members[module][0]!r} and {family.name!r} both select this "
                                      f"tensor; make two sidecars", tensor=name)
                members[module] = (family.name, name)
    return dict(sorted(members.items()))


def select_members(ckpt: Checkpoint, families: tuple[Family, ...]) -> dict[str, tuple[str, str]]:
    """:func:`_members`, refusing a family that selects nothing."""
    members = _members(ckpt, families)
    for family in families:
        if not any(f == family.name for f, _ in members.values()):
            raise RecipeError(f"family {family.name!r} ({family.description}) selects no tensors of this "
                              f"checkpoint", path=ckpt.path, field="family")
    return members


def list_families(model_dir: str | Path) -> list[dict]:
    """The families of the checkpoint's architecture with the tensors and stored bytes each selects here."""
    with open_checkpoint(model_dir) as ckpt:
        model_type = ckpt.config.get("model_type")
        if model_type not in FAMILIES:
            raise RecipeError(f"no swapset families for model_type {model_type!r}; known architectures: "
                              f"{', '.join(sorted(FAMILIES))}", path=ckpt.path, field="model_type")
        out = []
        for family in FAMILIES[model_type].values():
            members = _members(ckpt, (family,))
            stored = sum(ckpt.tensor_info(n).nbytes + sum(ckpt.tensor_info(c).nbytes
                                                          for c in ckpt.companions(n).values())
                         for _, n in members.values())
            out.append({"family": family.name, "description": family.description, "scope": family.scope,
                        "optional": family.optional, "tensors": len(members), "bytes": stored,
                        "first": next(iter(members), None)})
        return out


def _convention(request: SwapsetRequest, ckpt: Checkpoint) -> str | None:
    if request.fmt != "nvfp4":
        return request.convention
    on_disk = ckpt.quantization.removeprefix("nvfp4-") if ckpt.quantization.startswith("nvfp4-") else None
    if request.convention is None and on_disk is None:
        raise SourceError(f"the checkpoint holds no NVFP4 tensors ({ckpt.quantization!r} quantization) to infer "
                          f"an NVFP4 convention from: pass --convention modelopt or compressed-tensors", path=ckpt.path,
                          field="convention")
    if request.convention is not None and on_disk is not None and request.convention != on_disk:
        raise SourceError(f"convention mismatch: the checkpoint's tensors are NVFP4 {on_disk} but "
                          f"--convention {request.convention} was asked for; an engine reads one convention per "
                          f"checkpoint", path=ckpt.path, field="convention")
    return request.convention or on_disk


def _scale_naming(*checkpoints: Checkpoint) -> str:
    """``scale`` when the checkpoint or the source names E8M0 block scales ``<module>.scale`` (DeepSeek V4's
    upstream layout), else ``weight_scale_inv`` (transformers)."""
    for ckpt in checkpoints:
        for name in ckpt.tensor_names():
            if name.endswith(".scale") and ckpt.tensor_info(name).dtype == "F8_E8M0":
                return "scale"
    return "weight_scale_inv"


def _shared_as_expert(module: str, ckpt: Checkpoint, amap_experts: int) -> str:
    match = _SHARED_MODULE.match(module)
    if match is None:
        raise RecipeError("--shared-experts serves shared experts as an extra routed expert; this is not a "
                          "shared expert module", tensor=module)
    prefix, proj = match.group("prefix"), match.group("proj")
    names = set(ckpt.tensor_names())
    if any(n.startswith(prefix + ".shared_expert_gate.") for n in names):
        raise RecipeError("a gated shared expert (shared_expert_gate) cannot be served as a plain routed expert",
                          tensor=module)
    routed = stored_weight(ckpt, f"{prefix}.experts.0.{proj}")
    if routed is None:
        raise RecipeError(f"--shared-experts needs per-expert routed weights named {prefix}.experts.E.{proj}.weight "
                          f"to take the shared expert's place among", tensor=module)
    shared = stored_weight(ckpt, module)
    if decoded_shape(ckpt, routed) != decoded_shape(ckpt, shared):
        raise RecipeError(f"the shared expert's shape {list(decoded_shape(ckpt, shared))} differs from a routed "
                          f"expert's {list(decoded_shape(ckpt, routed))}; it cannot be served as an extra expert",
                          tensor=module)
    return f"{prefix}.experts.{amap_experts}.{proj}"


def _draft_rows(request: SwapsetRequest, rows: int, calibration_ids: list[int] | None
                ) -> tuple[np.ndarray | None, str]:
    if request.vocab_subset is not None and request.token_ids_file is not None:
        raise RecipeError("give --vocab-subset or --token-ids, not both", field="vocab-subset")
    counts = None if calibration_ids is None else draft.token_counts(calibration_ids, rows, "calibration text")
    token_ids = None if request.token_ids_file is None else draft.read_token_ids(request.token_ids_file)
    kept, selection = draft.kept_rows(rows, subset=request.vocab_subset, token_ids=token_ids, counts=counts)
    full = request.vocab_subset is None and request.token_ids_file is None
    return (None if full else kept), selection


def _native_outputs(enc: Encoding, src: Checkpoint, weight: str, module: str, output_module: str,
                    rows: int | None) -> tuple[OutputTensor, ...]:
    """The source's own tensors of a module (weight, the scales that decode it, its activation scale), renamed
    onto ``output_module``; with ``rows`` the weight and block scales keep only those rows."""
    _, roles = src.scheme(weight)
    comps = src.companions(weight)
    names = [weight] + [comps[r] for r in roles] + [comps[r] for r in _INPUT_SCALE_ROLES if r in comps]
    out = []
    for name in names:
        info = src.tensor_info(name)
        role = enc.roles.get(name[len(module) + 1:], "input_scale")
        shape = (rows,) + info.shape[1:] if rows is not None and role in ROW_ROLES else info.shape
        out.append(OutputTensor(output_module + name[len(module):], Planned(info.dtype, shape), role, name))
    return tuple(out)


def _quantized_outputs(enc: Encoding, shape: tuple[int, ...], output_module: str, weight: str, calibrate_it: bool
                       ) -> tuple[OutputTensor, ...]:
    out = [OutputTensor(f"{output_module}.{suffix}", Planned(dtype, tuple(s)), enc.roles[suffix], weight)
           for suffix, (s, dtype) in enc.output_specs(shape).items()]
    if calibrate_it and enc.input_suffix is not None:
        s, dtype = enc.input_spec()
        out.append(OutputTensor(f"{output_module}.{enc.input_suffix}", Planned(dtype, tuple(s)), "input_scale",
                                weight))
    return tuple(out)


@dataclass(frozen=True)
class _Context:
    """What every module of one request is planned with."""

    request: SwapsetRequest
    kind: str
    encoding: Encoding
    amap: object
    ckpt: Checkpoint
    src: Checkpoint
    calibration_ids: list[int] | None


def _plan_module(ctx: _Context, module: str, family: str, weight: str
                 ) -> tuple[ModulePlan, np.ndarray | None, str | None]:
    """One module's plan, and for a draft head its kept rows and how they were chosen."""
    src, enc = ctx.src, ctx.encoding
    src_weight = stored_weight(src, module)
    if src_weight is None:
        raise MissingSourceError(f"the source checkpoint has no {module}.weight (or .weight_packed)",
                                 path=src.path, tensor=weight)
    shape = decoded_shape(src, src_weight)
    if shape != decoded_shape(ctx.ckpt, weight):
        raise SourceError(f"shape {list(shape)} in the source differs from {list(decoded_shape(ctx.ckpt, weight))} "
                          f"in the checkpoint", path=src.path, tensor=src_weight)
    enc.check_shape(shape, src_weight)
    scheme = src.scheme(src_weight)[0]
    native = NATIVE.get(enc.name) == scheme and (not scheme.startswith("fp8") or src.block == _NATIVE_BLOCK)
    token_ids = selection = None
    if ctx.kind == "draft-lm-head":
        if len(shape) != 2:
            raise SourceError(f"the output head must be 2-D, found shape {list(shape)}", tensor=src_weight)
        token_ids, selection = _draft_rows(ctx.request, shape[0], ctx.calibration_ids)
        # NVFP4 scales are per row and the global scale is shared: rows slice without re-quantizing
        native = native and (token_ids is None or enc.name.startswith("nvfp4"))
        output_module = draft.DRAFT_PREFIX + module
        replaces: tuple[str, ...] = ()
    else:
        output_module = _shared_as_expert(module, ctx.ckpt, ctx.amap.expert_count) if ctx.request.shared_experts \
            else module
        replaces = (weight, *sorted(ctx.ckpt.companions(weight).values()))
    rows = None if token_ids is None else len(token_ids)
    calibrate_it = (not native and ctx.calibration_ids is not None and enc.input_suffix is not None
                    and len(shape) == 2 and not ({m.tensor_class for m in ctx.amap.resolve(weight)} & ROUTED))
    if native:
        outputs = _native_outputs(enc, src, src_weight, module, output_module, rows)
    else:
        out_shape = shape if rows is None else (rows,) + shape[1:]
        outputs = _quantized_outputs(enc, out_shape, output_module, src_weight, calibrate_it)
    if token_ids is not None:
        outputs += (OutputTensor(f"{output_module}.{draft.TOKEN_IDS_SUFFIX}", Planned("I32", (rows,)), "token_ids",
                                 src_weight),)
    plan = ModulePlan(module, output_module, family, fused_group(ctx.amap.canonical_name(module)), src_weight, scheme,
                      "native" if native else "self-quantized", shape, replaces, outputs, calibrate_it)
    return plan, token_ids, selection


def _plan(request: SwapsetRequest, ckpt: Checkpoint, src: Checkpoint) -> SwapsetPlan:
    model_type = ckpt.config.get("model_type")
    if src is not ckpt and src.config.get("model_type") != model_type:
        raise SourceError(f"the source checkpoint is model_type {src.config.get('model_type')!r}, the checkpoint "
                          f"{model_type!r}", path=src.path, field="model_type")
    kind, families = _families(request, model_type)
    fmt = request.fmt or ("nvfp4" if request.draft_lm_head else None)
    if fmt is None:
        raise RecipeError("no format given: pass --format", field="format")
    convention = _convention(replace(request, fmt=fmt), ckpt)
    encoding = get_encoding(fmt, convention, e8m0_scale_suffix=_scale_naming(ckpt, src))
    if request.shared_experts and [f.name for f in families] != ["shared"]:
        raise RecipeError("--shared-experts applies to the shared family alone", field="shared-experts")
    members = select_members(ckpt, families)
    amap = get_arch(model_type).bind(ckpt.config)

    calibration_ids = calibration_sha = sample_ids = None
    if request.calibration is not None:
        text, calibration_sha = calibrate.read_text(request.calibration)
        calibration_ids = calibrate.tokenize(ckpt.path, text)
    if request.sample is not None:
        sample_ids = calibrate.tokenize(ckpt.path, calibrate.read_text(request.sample)[0])
    elif kind == "draft-lm-head":
        sample_ids = calibration_ids

    ctx = _Context(request, kind, encoding, amap, ckpt, src, calibration_ids)
    modules, token_ids, selection = [], None, None
    for module, (family, weight) in members.items():
        planned, token_ids, selection = _plan_module(ctx, module, family, weight)
        modules.append(planned)

    # fp8 encodings differ in layout, so each gets its own default name: fp8-swapset-attn-block128, ...-channel
    variant = "" if fmt == "nvfp4" else "-" + fmt.removeprefix("fp8-")
    default_name = f"{'nvfp4' if fmt == 'nvfp4' else 'fp8'}-swapset-" + (
        "draft-lmhead" if kind == "draft-lm-head" else "-".join(f.name for f in families)) + variant
    name = request.name or default_name
    check_name(name)
    optional = request.optional if request.optional is not None else any(f.optional for f in families)
    plan = SwapsetPlan(name, kind, model_type, tuple(f.name for f in families), fmt, convention, encoding, optional,
                       tuple(request.supersedes), modules, token_ids, selection,
                       amap.expert_count if request.shared_experts else None, calibration_ids, calibration_sha,
                       sample_ids)
    _check_outputs(plan, request, ckpt)
    return plan


def _check_outputs(plan: SwapsetPlan, request: SwapsetRequest, ckpt: Checkpoint) -> None:
    """Refuse names that collide with checkpoint files, existing outputs, and overlaps with other sidecars; set
    ``plan.overrules``."""
    st, js = sidecar_paths(ckpt.path, plan.name)
    if st.name in shard_files(ckpt.path):
        raise OutputExistsError("the sidecar name is a checkpoint shard; choose another --name", path=st)
    present = scan(ckpt.path)
    for old in plan.supersedes:
        if old == plan.name or old not in {entry.name for entry in present}:
            raise SourceError(f"--supersedes {old!r}: no other sidecar of that name beside the checkpoint",
                              path=ckpt.path, field="supersedes")
    for path in (st, js):
        if path.exists() and not request.force:
            raise OutputExistsError("output exists; refusing to replace it", path=path)
    if js.exists() and plan.name not in {e.name for e in present if e.manifest_claimed}:
        raise OutputExistsError("a JSON file of this name exists and is not a swapset manifest; choose another "
                                "--name", path=js)
    covered = {key: plan.name for m in plan.modules for key in (*m.replaces, *(o.name for o in m.outputs))}
    for other, manifest in current_sidecars(ckpt.path):
        if other == plan.name or other in plan.supersedes:
            continue
        for module in manifest["modules"]:
            produced = (t["name"] for t in manifest["tensors"] if t["module"] == module["output_module"])
            keys = (*module["replaces"], *produced)
            clash = next((k for k in keys if k in covered), None)
            if clash is not None:
                raise SourceError(f"sidecar {other!r} already covers this tensor; pass --supersedes {other} to "
                                  f"replace it", path=ckpt.path, tensor=clash)
    # the old manifest of this name is being replaced: its supersedes do not count
    others = {e.name: e.manifest for e in present if e.manifest is not None and e.name != plan.name}
    plan.overrules = tuple(sorted(other for other in superseded_closure(others, plan.supersedes)
                                  if other in others and plan.name in others[other]["supersedes"]))


def plan_swapset(request: SwapsetRequest) -> SwapsetPlan:
    """The plan of a sidecar, checked, without encoding or writing anything."""
    with _open(request) as (ckpt, src):
        return _plan(request, ckpt, src)


class _open:
    """Open ``model_dir`` and ``source_dir`` (the same checkpoint object when no source is given)."""

    def __init__(self, request: SwapsetRequest):
        self.request = request

    def __enter__(self) -> tuple[Checkpoint, Checkpoint]:
        if not Path(self.request.model_dir).is_dir():
            raise SourceError("a sidecar lives beside a checkpoint directory; this is not a directory",
                              path=self.request.model_dir)
        self.ckpt = open_checkpoint(self.request.model_dir)
        try:
            same = self.request.source_dir is None or Path(self.request.source_dir).resolve() == \
                Path(self.request.model_dir).resolve()
            self.src = self.ckpt if same else open_checkpoint(self.request.source_dir)
        except BaseException:
            self.ckpt.close()
            raise
        return self.ckpt, self.src

    def __exit__(self, *exc) -> None:
        self.ckpt.close()
        if self.src is not self.ckpt:
            self.src.close()


# ----------------------------------------------------------------------------------------------------------------
# execution

@dataclass
class BuildResult:
    plan: SwapsetPlan
    safetensors: Path
    manifest_path: Path
    manifest: dict


def _finite(w: np.ndarray, tensor: str) -> np.ndarray:
    bad = ~np.isfinite(w)
    if bad.any():
        where = np.argwhere(bad)[0]
        raise EncodeError(f"non-finite weight (NaN or Inf) at index {where.tolist()}", tensor=tensor)
    return w


def _measure(plan: SwapsetPlan, ckpt: Checkpoint) -> tuple[dict[str, float], np.ndarray | None]:
    """(activation amax per checkpoint weight, the head's inputs on the sample text) from the reference model."""
    wanted = [stored_weight(ckpt, m.module) for m in plan.modules if m.calibrate]
    head = plan.kind == "draft-lm-head" and plan.sample_ids is not None
    if not wanted and not head:
        return {}, None
    with calibrate.ReferenceModel(ckpt) as ref:
        if plan.sample_ids is plan.calibration_ids or not head:
            return ref.measure(plan.calibration_ids or [], wanted, head=head)
        amax = ref.measure(plan.calibration_ids, wanted)[0] if wanted else {}
        return amax, ref.measure(plan.sample_ids, head=True)[1]


def _copy_native(plan: SwapsetPlan, src: Checkpoint, m: ModulePlan, writer: PlannedSafetensors
                 ) -> dict[str, np.ndarray]:
    """Write a module's source tensors unchanged (a draft head's rows sliced); returns {suffix: array}."""
    stored = {}
    for out in m.outputs:
        if out.role == "token_ids":
            continue
        array = src.raw(out.source)
        if plan.token_ids is not None and out.role in ROW_ROLES:
            array = array[plan.token_ids]
        writer.write(out.name, array)
        stored[out.name[len(m.output_module) + 1:]] = array
    return stored


def _encode_module(plan: SwapsetPlan, m: ModulePlan, w: np.ndarray, group_amax: float | None,
                   group_act: float | None, writer: PlannedSafetensors) -> dict[str, np.ndarray]:
    """Encode and write one module (with its activation scale when calibrated); returns {suffix: array}."""
    if plan.token_ids is not None:
        w = w[plan.token_ids]
    stored = {suffix: array for suffix, (array, _) in plan.encoding.encode(w, group_amax if w.ndim == 2 else None)
              .items()}
    for suffix, array in stored.items():
        writer.write(f"{m.output_module}.{suffix}", array)
    if m.calibrate:
        if not group_act > 0:
            raise EncodeError("activation amax is 0: the calibration text never reached this layer",
                              tensor=m.source_weight)
        writer.write(f"{m.output_module}.{plan.encoding.input_suffix}", plan.encoding.input_scale(group_act))
    return stored


def _write(plan: SwapsetPlan, ckpt: Checkpoint, src: Checkpoint, writer: PlannedSafetensors,
           act_amax: dict[str, float]) -> tuple[dict[str, str], np.ndarray | None]:
    """Copy or encode every module, fused group by fused group (one group decoded at a time).

    Returns (source hash per module, the draft head decoded from what was written, or None)."""
    hashes: dict[str, str] = {}
    draft_head = None
    groups: dict[str, list[ModulePlan]] = {}
    for m in plan.modules:
        groups.setdefault(m.group, []).append(m)
    for members in groups.values():
        decoded = {m.module: _finite(src.tensor_f32(m.source_weight), m.source_weight)
                   for m in members if m.origin == "self-quantized"}
        # NVFP4: one global scale per fused group (the group's amax); activation scales likewise
        group_amax = max((float(np.abs(w).max(initial=0.0)) for w in decoded.values()), default=None)
        group_act = max((act_amax[stored_weight(ckpt, m.module)] for m in members if m.calibrate), default=None)
        for m in members:
            hashes[m.module] = source_hash(src, m.source_weight)
            if m.origin == "native":
                stored = _copy_native(plan, src, m, writer)
            else:
                stored = _encode_module(plan, m, decoded[m.module], group_amax, group_act, writer)
            if plan.token_ids is not None:
                writer.write(f"{m.output_module}.{draft.TOKEN_IDS_SUFFIX}", plan.token_ids)
            if plan.kind == "draft-lm-head":
                draft_head = plan.encoding.decode(stored)
    return hashes, draft_head


def _tensor_entries(plan: SwapsetPlan, src: Checkpoint, hashes: dict[str, str]) -> list[dict]:
    entries = []
    for m in plan.modules:
        for out in m.outputs:
            source_sha = hashes[m.module] if m.origin == "self-quantized" or out.role == "token_ids" \
                else tensor_sha256(src.raw(out.source))
            entries.append({"name": out.name, "shape": list(out.spec.shape), "dtype": out.spec.dtype,
                            "encoding": plan.encoding.name, "role": out.role, "module": m.output_module,
                            "origin": m.origin, "source": out.source, "source_sha256": source_sha})
    return sorted(entries, key=lambda e: e["name"])


def _manifest(plan: SwapsetPlan, request: SwapsetRequest, ckpt: Checkpoint, src: Checkpoint, hashes: dict[str, str],
              sidecar: dict, calibration: dict | None, draft_info: dict | None) -> dict:
    source = checkpoint_identity(src.path, src.quantization)
    source["path"] = "." if src is ckpt else str(Path(src.path).resolve())
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": plan.name, "kind": plan.kind,
        "model_type": plan.model_type, "families": list(plan.families), "format": plan.fmt,
        "convention": plan.convention, "encoding": plan.encoding.name, "optional": plan.optional,
        "tensor_parallel": dict(TP_LAYOUT_NONE), "supersedes": list(plan.supersedes),
        "checkpoint": checkpoint_identity(ckpt.path, ckpt.quantization), "source": source, "sidecar": sidecar,
        "modules": [{"module": m.module, "output_module": m.output_module, "family": m.family, "group": m.group,
                     "origin": m.origin, "source_encoding": m.source_encoding, "source_tensor": m.source_weight,
                     "source_sha256": hashes[m.module],
                     "replaces": {n: tensor_sha256(ckpt.raw(n)) for n in m.replaces}} for m in plan.modules],
        "tensors": _tensor_entries(plan, src, hashes),
        "calibration": calibration, "draft_lm_head": draft_info,
        "shared_as_expert": None if plan.shared_expert_index is None else {"expert_index": plan.shared_expert_index},
        "generator": {"name": "quantkit", "version": __version__, "arguments": dict(request.arguments)},
        "quality": None,
    }


def _input_files(request: SwapsetRequest, ckpt, src) -> list[Path]:
    """The files a swapset build reads: the checkpoints' shards and configs, and the files the request names."""
    read = [request.token_ids_file, request.calibration, request.sample]
    for checkpoint in (ckpt, src):
        if checkpoint is not None:
            read += checkpoint.shard_paths()
            read += [Path(checkpoint.path) / name for name in ("config.json", "model.safetensors.index.json")]
    return input_files(read)


def build_swapset(request: SwapsetRequest) -> BuildResult:
    """Plan, encode and write a sidecar beside ``request.model_dir``; returns the paths and the manifest."""
    with _open(request) as (ckpt, src):
        plan = _plan(request, ckpt, src)
        st, js = sidecar_paths(ckpt.path, plan.name)
        # before the long work: a sidecar never replaces a file it is made from (a shard named like it, say)
        inputs = _input_files(request, ckpt, src)
        for path, what in ((st, "sidecar payload"), (js, "sidecar manifest")):
            check_output(path, inputs=inputs, overwrite=request.force, what=what)
        act_amax, hidden = _measure(plan, ckpt)
        renamed = False
        try:
            with atomic_output(js, overwrite=request.force) as js_tmp:
                with atomic_output(st, overwrite=request.force) as st_tmp:
                    with open(st_tmp, "wb") as f:
                        writer = PlannedSafetensors(f, plan.specs(), {SAFETENSORS_METADATA_KEY: plan.name})
                        hashes, draft_head = _write(plan, ckpt, src, writer, act_amax)
                        writer.finish()
                    sidecar = {"file": st.name, "bytes": st_tmp.stat().st_size, "sha256": sha256_file(st_tmp)}
                    calibration = None if plan.calibration_ids is None else {
                        "text_sha256": plan.calibration_sha256, "tokens": len(plan.calibration_ids),
                        "calibrated": sorted(m.module for m in plan.modules if m.calibrate),
                        "uncalibrated": sorted(m.module for m in plan.modules
                                               if not m.calibrate and m.origin == "self-quantized")}
                    draft_info = None
                    if plan.kind == "draft-lm-head":
                        draft_info = _draft_info(plan, ckpt, hidden, draft_head)
                    manifest = _manifest(plan, request, ckpt, src, hashes, sidecar, calibration, draft_info)
                    validate_manifest(manifest, js)
                    js_tmp.write_text(manifest_text(manifest), encoding="utf-8")
                renamed = True
        except BaseException:
            if renamed:
                st.unlink(missing_ok=True)
            raise
        # after the new manifest is in place: an interruption leaves a cycle, which status shows and gc keeps
        for other in plan.overrules:
            path = sidecar_paths(ckpt.path, other)[1]
            old = read_manifest(path)
            write_manifest(path, {**old, "supersedes": [n for n in old["supersedes"] if n != plan.name]},
                           overwrite=True)
        return BuildResult(plan, st, js, manifest)


def _draft_info(plan: SwapsetPlan, ckpt: Checkpoint, hidden: np.ndarray | None, draft_head: np.ndarray) -> dict:
    """The manifest's draft_lm_head block: rows kept and, with sample text, agreement with the served head."""
    (head,) = plan.modules
    kept = np.arange(head.shape[0]) if plan.token_ids is None else plan.token_ids
    report = None
    if hidden is not None:
        served = ckpt.tensor_f32(stored_weight(ckpt, head.module))
        report = draft.agreement(hidden, served, draft_head, kept)
    token_ids = None if plan.token_ids is None else f"{head.output_module}.{draft.TOKEN_IDS_SUFFIX}"
    return {"source_rows": int(head.shape[0]), "kept_rows": int(len(kept)), "selection": plan.selection,
            "token_ids": token_ids, "agreement": report}
