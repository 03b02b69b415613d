"""The sidecars beside a checkpoint: find them, check them against the checkpoint, classify, and clean up.

**Finding** (:func:`scan`).  A sidecar is named by a file stem ``<name>`` with ``<name>.safetensors`` and/or
``<name>.json`` in the checkpoint directory: every ``.safetensors`` file that is not one of the checkpoint's shards,
and every ``.json`` that claims the swapset schema.  A non-manifest ``<name>.json`` next to such a safetensors file
(a sidecar made by another tool) belongs to it.  ``*.partial`` files are writes in progress and are ignored.

**Checking** (:func:`verify`).  *Damaged*: the payload is missing, or its size (always) or SHA-256 (``full``)
differs from the manifest.  *Stale*: the checkpoint's identity (config and quantization-config hashes, revision,
shard headers) differs from the one recorded, or (``full``) a replaced checkpoint tensor's bytes or a source
tensor's bytes changed.  A source checkpoint at another path that is no longer there is noted, not stale: its
tensors were copied into the sidecar.

**Classifying** (:func:`status`), first match wins:

1. ``unknown``: no valid manifest (another tool's sidecar, a malformed or newer-schema manifest, a damaged
   payload) -- unless a current sidecar's ``supersedes`` names it, then ``obsolete``;
2. ``stale``: see above;
3. ``required``: named by the record (``--record FILE``);
4. ``obsolete``: named in ``supersedes`` of another sidecar with a valid manifest, unless both are in one
   supersede cycle (A supersedes B, B supersedes A, directly or through others);
5. ``unknown``: in a supersede cycle, where which sidecar is current cannot be told (``make`` never writes one:
   the newest manifest wins, see :mod:`.build`);
6. ``optional`` when a record was given (a record names everything it needs), otherwise ``optional`` or
   ``required`` as the manifest's ``optional`` flag says.

A record is a JSON object with ``"sidecars"``: a list of names, or of ``{"name", "sha256"}`` objects (the
sidecar safetensors' SHA-256, checked against the manifest); names it lists that are absent are reported as
``missing``.

**Removing** (:func:`gc`).  Only files quantkit made, and only of ``obsolete`` sidecars: a valid quantkit manifest,
and the payload it records when the payload's SHA-256 still equals the recorded one.  A superseded sidecar
without a quantkit manifest (another tool's, or a user's file that ``--supersedes`` happened to name) and a
payload whose bytes are not the ones recorded are kept and reported, never deleted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FormatError, QuantkitError
from ..io.atomic import sha256_file
from ..io.checkpoint import Checkpoint, open_checkpoint
from .manifest import (checkpoint_identity, identity_differences, is_manifest, read_json, read_manifest,
                       shard_files, write_manifest)
from .tensors import source_hash, tensor_sha256

STATES = ("required", "optional", "obsolete", "stale", "unknown")
PARTIAL_SUFFIX = ".partial"


def sidecar_paths(model_dir: str | Path, name: str) -> tuple[Path, Path]:
    """(``<name>.safetensors``, ``<name>.json``) beside the checkpoint."""
    d = Path(model_dir)
    return d / f"{name}.safetensors", d / f"{name}.json"


@dataclass
class Candidate:
    """Files of one sidecar name; ``manifest`` is set when its manifest is valid."""

    name: str
    files: list[Path]
    manifest: dict | None
    manifest_claimed: bool
    problem: str | None

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def scan(model_dir: str | Path) -> list[Candidate]:
    """Every sidecar beside the checkpoint (see the module docstring), sorted by name."""
    d = Path(model_dir)
    shards = set(shard_files(d))
    stems = {p.stem for p in d.glob("*.safetensors") if p.name not in shards}
    stems |= {p.stem for p in d.glob("*.json") if is_manifest(p)}
    out = []
    for name in sorted(stems):
        st, js = sidecar_paths(d, name)
        claimed = js.is_file() and is_manifest(js)
        files = [p for p in (st, js) if p.is_file()]
        manifest, problem = None, None
        if claimed:
            try:
                manifest = read_manifest(js)
            except (FormatError, OSError) as e:
                problem = f"unreadable manifest: {e}"
        else:
            problem = "no quantkit manifest"
        out.append(Candidate(name, files, manifest, claimed, problem))
    return out


def superseded_closure(manifests: dict[str, dict], names) -> set[str]:
    """``names`` and every name reachable from them through the ``supersedes`` of ``manifests`` (name -> manifest)."""
    seen, todo = set(names), list(names)
    while todo:
        manifest = manifests.get(todo.pop())
        for old in manifest["supersedes"] if manifest is not None else ():
            if old not in seen:
                seen.add(old)
                todo.append(old)
    return seen


def supersessions(manifests: dict[str, dict]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(superseded name -> a name that supersedes it, name -> the members of its supersede cycle) over the valid
    ``manifests`` (name -> manifest).  Supersessions inside a cycle are left out: they cannot all hold, and
    honouring them would make every member obsolete."""
    reach = {name: superseded_closure(manifests, m["supersedes"]) for name, m in manifests.items()}
    cycles = {name: sorted(n for n in reachable if name in reach.get(n, ()))
              for name, reachable in reach.items() if name in reachable}
    superseded_by = {old: new for new, m in manifests.items() for old in m["supersedes"]
                     if old not in cycles.get(new, ())}
    return superseded_by, cycles


def current_sidecars(model_dir: str | Path) -> list[tuple[str, dict]]:
    """(name, manifest) of the sidecars with a valid manifest that no other valid manifest supersedes."""
    valid = {c.name: c.manifest for c in scan(model_dir) if c.manifest is not None}
    superseded_by, _ = supersessions(valid)
    return [(name, m) for name, m in valid.items() if name not in superseded_by]


@dataclass
class Verification:
    damaged: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def verify(model_dir: Path, manifest: dict, ckpt: Checkpoint, *, full: bool) -> Verification:
    """Check a sidecar's payload and recorded identities against the files on disk (module docstring)."""
    v = Verification()
    st, _ = sidecar_paths(model_dir, manifest["name"])
    if not st.is_file():
        v.damaged.append(f"payload {st.name} is missing")
    elif st.stat().st_size != manifest["sidecar"]["bytes"]:
        v.damaged.append(f"payload is {st.stat().st_size} bytes, the manifest says {manifest['sidecar']['bytes']}")
    elif full and sha256_file(st) != manifest["sidecar"]["sha256"]:
        v.damaged.append("payload SHA-256 differs from the manifest")
    diffs = identity_differences(manifest["checkpoint"], checkpoint_identity(model_dir, ckpt.quantization))
    v.stale += [f"checkpoint {d}" for d in diffs]
    source_path = manifest["source"]["path"]
    src = ckpt if source_path == "." else None
    if src is None and Path(source_path).is_dir():
        try:
            src = open_checkpoint(source_path)
        except QuantkitError as e:
            v.stale.append(f"source checkpoint {source_path} no longer opens: {e}")
    elif src is None:
        v.notes.append(f"source checkpoint {source_path} not found; not checked")
    try:
        if src is not None and src is not ckpt:
            v.stale += [f"source {d}" for d in identity_differences(
                manifest["source"], checkpoint_identity(Path(source_path), src.quantization))]
        if full and not v.stale:
            v.stale += _tensor_changes(manifest, ckpt, src)
    finally:
        if src is not None and src is not ckpt:
            src.close()
    return v


def _tensor_changes(manifest: dict, ckpt: Checkpoint, src: Checkpoint | None) -> list[str]:
    changes = []
    for module in manifest["modules"]:
        for name, sha in module["replaces"].items():
            try:
                if tensor_sha256(ckpt.raw(name)) != sha:
                    changes.append(f"checkpoint tensor {name} changed")
            except QuantkitError:
                changes.append(f"checkpoint tensor {name} is gone")
        if src is not None:
            try:
                if source_hash(src, module["source_tensor"]) != module["source_sha256"]:
                    changes.append(f"source tensor {module['source_tensor']} changed")
            except QuantkitError:
                changes.append(f"source tensor {module['source_tensor']} is gone")
    return changes


# ----------------------------------------------------------------------------------------------------------------
# status and gc

@dataclass
class SidecarStatus:
    name: str
    state: str
    bytes: int
    files: list[str]
    reason: str
    kind: str | None = None
    families: list[str] | None = None
    encoding: str | None = None
    superseded_by: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class StatusReport:
    model_dir: str
    sidecars: list[SidecarStatus]
    needed: list[str] | None
    """The names the record lists (None without a record)."""
    missing: list[str]

    @property
    def record_satisfied(self) -> bool:
        """Every sidecar the record names is present and classified ``required`` (usable as recorded)."""
        states = {s.name: s.state for s in self.sidecars}
        return not self.missing and all(states.get(n) == "required" for n in self.needed or ())

    def to_dict(self) -> dict:
        totals = {state: sum(s.bytes for s in self.sidecars if s.state == state) for state in STATES}
        return {"model_dir": self.model_dir, "sidecars": [s.to_dict() for s in self.sidecars],
                "needed": self.needed, "missing": self.missing, "bytes_by_state": totals,
                "record_satisfied": self.record_satisfied}


def read_record(path: str | Path) -> dict[str, str | None]:
    """name -> expected sidecar SHA-256 (or None) from a record file (module docstring)."""
    path = Path(path)
    record = read_json(path, "record")
    entries = record.get("sidecars") if isinstance(record, dict) else None
    if not isinstance(entries, list):
        raise FormatError('record must be a JSON object with a "sidecars" list', path=path, field="sidecars")
    out: dict[str, str | None] = {}
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            out[entry] = None
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str) and set(entry) <= {"name", "sha256"} \
                and isinstance(entry.get("sha256", ""), str):
            out[entry["name"]] = entry.get("sha256")
        else:
            raise FormatError(f"entry {i} must be a name or {{\"name\", \"sha256\"}}, found {entry!r}", path=path,
                              field=f"sidecars[{i}]")
    return out


def status(model_dir: str | Path, record: str | Path | None = None, *, full: bool = False) -> StatusReport:
    """Classify every sidecar beside the checkpoint (module docstring)."""
    d = Path(model_dir)
    needed = read_record(record) if record is not None else None
    candidates = scan(d)
    superseded_by, cycles = supersessions({c.name: c.manifest for c in candidates if c.manifest is not None})
    out = []
    with open_checkpoint(d) as ckpt:
        for c in candidates:
            m = c.manifest
            info = {} if m is None else {"kind": m["kind"], "families": m["families"], "encoding": m["encoding"]}
            state, reason = _classify(d, c, ckpt, needed, superseded_by, cycles, full)
            out.append(SidecarStatus(c.name, state, c.bytes, [p.name for p in c.files], reason,
                                     superseded_by=superseded_by.get(c.name), **info))
    present = {c.name for c in candidates}
    return StatusReport(str(d), out, None if needed is None else sorted(needed),
                        sorted(set(needed or ()) - present))


def _classify(d: Path, c: Candidate, ckpt: Checkpoint, needed: dict | None, superseded_by: dict[str, str],
              cycles: dict[str, list[str]], full: bool) -> tuple[str, str]:
    if c.manifest is None:
        if c.name in superseded_by:
            return "obsolete", f"superseded by {superseded_by[c.name]} ({c.problem})"
        return "unknown", c.problem or "no manifest"
    v = verify(d, c.manifest, ckpt, full=full)
    if v.damaged:
        return "unknown", "; ".join(v.damaged)
    if v.stale:
        return "stale", "; ".join(v.stale)
    notes = "; ".join(v.notes)
    if needed is not None and c.name in needed:
        expected = needed[c.name]
        if expected is not None and expected != c.manifest["sidecar"]["sha256"]:
            return "stale", "the record names another version of this sidecar (SHA-256 differs)"
        return "required", "named by the record" + (f"; {notes}" if notes else "")
    if c.name in superseded_by:
        return "obsolete", f"superseded by {superseded_by[c.name]}"
    if c.name in cycles:
        return "unknown", (f"supersede cycle among {', '.join(cycles[c.name])}: which is current cannot be told; "
                           f"remake the one to keep with --force --supersedes the others")
    if needed is not None:
        return "optional", "not named by the record" + (f"; {notes}" if notes else "")
    state = "optional" if c.manifest["optional"] else "required"
    return state, ("opt-in sidecar" if c.manifest["optional"] else "in service") + (f"; {notes}" if notes else "")


@dataclass
class GcReport:
    removed: list[SidecarStatus]
    """Obsolete sidecars whose files quantkit made (removed, or to be removed with ``dry_run``)."""
    kept: list[tuple[SidecarStatus, str]]
    """Obsolete sidecars left in place, with why (not made by quantkit, or changed since)."""


def _made_by_quantkit(model_dir: Path, name: str) -> str | None:
    """None when sidecar ``name`` is a quantkit manifest and (if present) the payload it records, byte for byte;
    otherwise why its files are not quantkit's to delete."""
    st, js = sidecar_paths(model_dir, name)
    if not (js.is_file() and is_manifest(js)):
        return "no quantkit manifest records its files: not made by quantkit, remove it by hand if unwanted"
    try:
        manifest = read_manifest(js)
    except (FormatError, OSError) as e:
        return f"its manifest cannot be read ({e})"
    if st.is_file() and (st.stat().st_size != manifest["sidecar"]["bytes"]
                         or sha256_file(st) != manifest["sidecar"]["sha256"]):
        return f"{st.name} is not the file its manifest records (size or SHA-256 differs)"
    return None


def gc(model_dir: str | Path, *, dry_run: bool, record: str | Path | None = None) -> GcReport:
    """Remove (unless ``dry_run``) the files quantkit made of every obsolete sidecar (module docstring)."""
    d = Path(model_dir)
    report = GcReport([], [])
    for s in status(d, record).sidecars:
        if s.state != "obsolete":
            continue
        why = _made_by_quantkit(d, s.name)
        if why is not None:
            report.kept.append((s, why))
            continue
        report.removed.append(s)
        if not dry_run:
            # the manifest goes last: an interrupted removal still shows up as a sidecar
            for path in sidecar_paths(d, s.name):
                path.unlink(missing_ok=True)
    return report


def record_quality(model_dir: str | Path, name: str, quality: dict) -> dict:
    """Store ``quality`` (e.g. ``quantkit compare`` results, a JSON object) in sidecar ``name``'s manifest."""
    if not isinstance(quality, dict):
        raise FormatError(f"quality must be a JSON object, got {type(quality).__name__}", field="quality")
    _, js = sidecar_paths(model_dir, name)
    manifest = read_manifest(js)
    manifest["quality"] = json.loads(json.dumps(quality, allow_nan=False))
    write_manifest(js, manifest, overwrite=True)
    return manifest
