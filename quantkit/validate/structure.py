"""Structural checks of a GGUF artifact that need no source: layout, size, padding, scales, metadata, provenance.

:class:`~quantkit.io.gguf_reader.GGUFFile` already refuses, on open, anything malformed (magic, version, counts,
lengths, UTF-8, duplicates, alignment, unknown type ids, rows not a multiple of the block, payloads outside the
file or overlapping): such a file is unreadable input (exit 2), not an invalid artifact.  The checks here run on a
file the reader accepted:

- ``structure.layout``: payloads in declaration order, each at the previous end padded to the alignment (the only
  placement ggml's loader accepts);
- ``structure.file_size``: the file ends exactly at the end of the last payload padded to the alignment, as ggml's
  ``gguf_write_out`` and gguf-py's ``GGUFWriter`` write it (ggml pads the header even without tensors; gguf-py
  does not, and llama.cpp's vocabulary-only files end at the header: either is accepted);
- ``structure.padding``: the padding after the header and after each payload is zero bytes (both writers write
  zeros).  Padding after payloads is read only when payloads are read in full (not in ``sample`` mode);
- ``structure.scales``: every block's scales are finite, as ggml's ``ggml_validate_row_data``
  (:mod:`quantkit.formats.rowdata`), over the bytes the audit reads: every payload byte, or in ``sample`` mode the
  sampled regions only;
- ``structure.metadata``: ``general.architecture`` a non-empty string and ``<arch>.block_count`` present; keys
  llama.cpp reads have the types gguf-py writes (:data:`KEY_TYPES`); tokenizer arrays agree in length and token ids
  lie inside the vocabulary; keys printable without whitespace; string values valid UTF-8 (token and merge lists
  may hold raw bytes); float values finite (token scores excepted);
- ``structure.shapes``: ``blk.N`` tensors for exactly ``block_count`` blocks (a support file's own blocks alone),
  and the tensors the hyperparameters size (embeddings and output by the embedding length and vocabulary, routed
  experts by their count and width, attention projections by the heads) have those sizes
  (:func:`quantkit.convert.consistency.disagreements`, the checks convert makes of a source): llama.cpp creates
  each tensor from the keys and refuses a file they contradict.  A ds4-dialect file is seen under llama.cpp's
  names (:func:`quantkit.arch.gguf_config.llama_cpp_view`), qwen38-next under its own keys;
- ``structure.provenance``: the keys ``quantkit convert`` writes (:mod:`quantkit.convert.provenance`) are present
  with their types, the recipe text hashes to the recorded SHA-256, file and hash lists pair up, hashes are
  64 hex digits, calibration values are known, and imatrix keys are present exactly when an imatrix was used.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType, Keys

from ..arch.dialects import ds4_key_types
from ..arch.gguf_config import llama_cpp_view
from ..convert.consistency import disagreements
from ..errors import QuantkitError, TruncatedFileError
from ..formats.registry import layout as type_layout
from ..imatrix.bootstrap import BOOTSTRAP_KEY, CALIBRATION_KEY
from ..io.gguf import KV, ArrayOf, GGUFTensor, align, type_name
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import plan_layout
from ..recipes.model import text_sha256
from .report import Check, check, skipped
from ..formats.rowdata import check_row_data

#: Payload bytes read and scanned at a time (bounds memory when scanning whole tensors).
SCAN_CHUNK_BYTES = 64 << 20

_S, _U16, _U32, _I32, _F32, _BOOL = (GGUFValueType.STRING, GGUFValueType.UINT16, GGUFValueType.UINT32,
                                     GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL)
#: Keys llama.cpp reads with a fixed type (its loader refuses another), as gguf-py's writer types them.
KEY_TYPES = {
    Keys.General.ARCHITECTURE: _S, Keys.General.TYPE: _S, Keys.General.NAME: _S, Keys.General.FILE_TYPE: _U32,
    Keys.General.QUANTIZATION_VERSION: _U32, Keys.General.ALIGNMENT: _U32,
    Keys.Split.LLM_KV_SPLIT_NO: _U16, Keys.Split.LLM_KV_SPLIT_COUNT: _U16, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT: _I32,
    Keys.Tokenizer.MODEL: _S, Keys.Tokenizer.PRE: _S, Keys.Tokenizer.LIST: ArrayOf(_S),
    Keys.Tokenizer.TOKEN_TYPE: ArrayOf(_I32), Keys.Tokenizer.SCORES: ArrayOf(_F32), Keys.Tokenizer.MERGES: ArrayOf(_S),
    Keys.Tokenizer.CHAT_TEMPLATE: _S, Keys.Tokenizer.ADD_BOS: _BOOL, Keys.Tokenizer.ADD_EOS: _BOOL,
    Keys.Tokenizer.ADD_SEP: _BOOL,
    **{key: _U32 for name, key in vars(Keys.Tokenizer).items() if name.endswith("_ID")},
}
TOKEN_ID_KEYS = tuple(key for name, key in vars(Keys.Tokenizer).items() if name.endswith("_ID"))
#: ``<arch>.``-prefixed keys every llama.cpp model loader reads, and their types.
ARCH_KEY_TYPES = {Keys.LLM.BLOCK_COUNT: _U32, Keys.LLM.CONTEXT_LENGTH: _U32, Keys.LLM.EMBEDDING_LENGTH: _U32}
REQUIRED_ARCH_KEYS = (Keys.LLM.BLOCK_COUNT,)
#: Per-token arrays that must have one entry per token.
TOKEN_ARRAYS = (Keys.Tokenizer.TOKEN_TYPE, Keys.Tokenizer.SCORES)
#: String arrays that may hold raw bytes (byte-level vocabularies), so are exempt from the UTF-8 check.
RAW_STRING_KEYS = frozenset({Keys.Tokenizer.LIST, Keys.Tokenizer.MERGES})
#: Float arrays that may hold -inf (unused tokens' scores).
NONFINITE_OK_KEYS = frozenset({Keys.Tokenizer.SCORES})

_ARRAY_S = ArrayOf(_S)
#: Provenance keys ``quantkit convert`` always writes, and those it writes when an imatrix was used.
PROVENANCE_KEYS = {
    Keys.General.FILE_TYPE: _U32, Keys.General.QUANTIZATION_VERSION: _U32,
    "quantkit.version": _S, "quantkit.recipe.name": _S, "quantkit.recipe.sha256": _S, "quantkit.recipe.text": _S,
    "quantkit.recipe.tag": _S, "quantkit.source.files": _ARRAY_S, "quantkit.source.sha256": _ARRAY_S,
    CALIBRATION_KEY: _S,
}
IMATRIX_PROVENANCE_KEYS = {
    "quantize.imatrix.file": _S, "quantize.imatrix.entries_count": _U32, "quantkit.imatrix.sha256": _S,
    "quantkit.imatrix.chunks": _U32, "quantkit.imatrix.synthetic": _BOOL, "quantkit.imatrix.coverage": _S,
}
OPTIONAL_PROVENANCE_KEYS = {
    "quantize.imatrix.dataset": _S, "quantize.imatrix.chunks_count": _U32, "quantkit.imatrix.datasets": _ARRAY_S,
    "quantkit.source.repo": _S, "quantkit.source.revision": _S, "quantkit.checkpoint_label": _S,
    BOOTSTRAP_KEY: _ARRAY_S,
}
CALIBRATION_CLASS_PREFIX = "quantkit.calibration."
CALIBRATION_VALUES = ("imatrix", "imatrix+bootstrap", "bootstrap", "none")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEY = re.compile(r"^\S+$")


# -- reading payloads -----------------------------------------------------------------------------------------

class ArtifactReader:
    """Reads byte ranges of the artifact with ``pread`` (no memory map) and counts the bytes read.

    ``sequential``: the whole payload is read in order, so the kernel may read ahead generously; otherwise
    (sampled regions) read-ahead is turned off, which would otherwise pull in megabytes past every region."""

    def __init__(self, path: str | os.PathLike, file_size: int, *, sequential: bool = True):
        self.path = Path(path)
        self.file_size = file_size
        self.fd = os.open(self.path, os.O_RDONLY)
        self.bytes_read = 0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL if sequential else os.POSIX_FADV_RANDOM)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise TruncatedFileError(f"EOF reading {nbytes} bytes at offset {offset}: the file shrank while "
                                         f"being validated (it had {self.file_size} bytes)", path=self.path,
                                         offset=offset + done)
            done += got
        self.bytes_read += nbytes
        return buf

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "ArtifactReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def locate(t: GGUFTensor, block: int) -> str:
    """Where block number ``block`` (counted from the start of the payload) lies: expert, row and block in row."""
    fmt = type_layout(t.type)
    per_row = max(1, t.shape[-1] // fmt.block_size)
    row, in_row = divmod(block, per_row)
    if len(t.shape) == 3:
        expert, row = divmod(row, t.shape[1])
        return f"expert {expert}, row {row}, block {in_row}"
    return f"row {row}, block {in_row}" if len(t.shape) > 1 else f"block {in_row}"


class ScaleScan:
    """Collects, per tensor, the blocks ggml_validate_row_data would refuse among the payload bytes scanned."""

    def __init__(self, row_stores: dict[str, int] | None = None):
        self.problems: dict[str, list] = {}   # name -> [first block, count, what]
        self.bytes_scanned = 0
        self.row_stores = dict(row_stores or {})
        """Native Engram row stores (GGUF name -> values per row): their rows are checked for E4M3 NaN codes and
        0xFF scales (:mod:`quantkit.engram.rows`), which ggml's check does not see in an I8 tensor."""
        self.row_problems: dict[str, list] = {}   # name -> [first row, count, what]

    def unit(self, t: GGUFTensor) -> int:
        """Bytes of the smallest piece ``scan`` takes: a block, or a whole row of a row store."""
        return t.row_bytes if t.name in self.row_stores else type_layout(t.type).type_size

    def scan(self, t: GGUFTensor, byte_offset: int, data: np.ndarray) -> None:
        """Scan ``data``, the payload bytes of ``t`` starting ``byte_offset`` bytes into it (whole blocks; whole
        rows of a row store)."""
        ts = type_layout(t.type).type_size
        if t.name in self.row_stores:
            self._scan_rows(t, byte_offset, data)
        problem = check_row_data(t.type, data)
        self.bytes_scanned += data.size
        if problem is None:
            return
        first = byte_offset // ts + problem.first_block
        seen = self.problems.get(t.name)
        if seen is None:
            self.problems[t.name] = [first, problem.count, problem.what]
        else:
            seen[0], seen[1] = min(seen[0], first), seen[1] + problem.count

    def _scan_rows(self, t: GGUFTensor, byte_offset: int, data: np.ndarray) -> None:
        from ..engram.rows import describe_invalid, invalid_rows

        width = t.row_bytes
        rows = np.asarray(data).reshape(-1, width)
        codes, scales = invalid_rows(rows, self.row_stores[t.name])
        bad = np.union1d(codes, scales)
        if not bad.size:
            return
        first_row = byte_offset // width
        what = describe_invalid(rows[bad[:1]], self.row_stores[t.name], first_row + bad[:1])
        seen = self.row_problems.get(t.name)
        if seen is None or first_row + int(bad[0]) < seen[0]:
            self.row_problems[t.name] = [first_row + int(bad[0]), bad.size + (seen[1] if seen else 0), what]
        else:
            seen[1] += bad.size

    def check(self, tensors: dict[str, GGUFTensor], scope: str) -> Check:
        items = [f"{name}: {count} block{'s' if count > 1 else ''} ({what}); first at {locate(tensors[name], first)}"
                 for name, (first, count, what) in self.problems.items()]
        items += [f"Engram table {name}: {count} invalid row{'s' if count > 1 else ''}; first at {what}"
                  for name, (first, count, what) in self.row_problems.items()]
        if not items and not self.bytes_scanned:   # nothing read: no block was shown finite
            return skipped("structure.scales", f"no payload bytes read ({scope}); --payload full scans every block")
        return check("structure.scales", items, passed=f"every block's scales finite ({scope}, "
                                                       f"{self.bytes_scanned:,} payload bytes)")


def scan_tensor(reader: ArtifactReader, f: GGUFFile, t: GGUFTensor, scan: ScaleScan,
                chunk_bytes: int = SCAN_CHUNK_BYTES) -> None:
    """Read tensor ``t`` in chunks of whole blocks and scan every block's scales."""
    ts = scan.unit(t)
    step = max(ts, chunk_bytes // ts * ts)
    start = f.data_offset + t.offset
    for at in range(0, t.nbytes, step):
        scan.scan(t, at, reader.read(start + at, min(step, t.nbytes - at)))


# -- layout, size, padding ------------------------------------------------------------------------------------

def header_length(f: GGUFFile) -> int:
    """Bytes of the header before its padding (the GGUF encoding of metadata and tensor infos is canonical)."""
    return len(plan_layout(list(f.metadata.items()), list(f.tensors.values())).header)


def layout_checks(f: GGUFFile) -> list[Check]:
    problem = f.ggml_layout_problem()
    end = max((t.offset + t.nbytes for t in f.tensors.values()), default=0)
    expected = f.data_offset + align(end, f.alignment)
    if not f.tensors and f.file_size == header_length(f):
        expected = f.file_size     # gguf-py leaves a file without tensors (a vocabulary) unpadded; llama.cpp loads it
    size = [] if f.file_size == expected else [
        f"the file has {f.file_size:,} bytes; the last payload padded to the alignment {f.alignment} ends at "
        f"{expected:,} ({'trailing bytes' if f.file_size > expected else 'the final padding is missing'})"]
    return [check("structure.layout", [problem] if problem else [],
                  passed=f"{len(f.tensors)} payloads contiguous in declaration order"),
            check("structure.file_size", size, passed=f"{f.file_size:,} bytes, ends at the last payload's padding")]


def padding_check(reader: ArtifactReader, f: GGUFFile, *, payloads: bool) -> Check:
    """Zero bytes after the header and (with ``payloads``) after every payload."""
    problems = []
    start = header_length(f)
    regions = [("header", start, f.data_offset - start)]
    if payloads:
        regions += [(t.name, f.data_offset + t.offset + t.nbytes, align(t.nbytes, f.alignment) - t.nbytes)
                    for t in f.tensors.values()]
    for what, at, n in regions:
        if n > 0 and at + n <= f.file_size:
            data = reader.read(at, n)
            if data.any():
                problems.append(f"padding after {what} holds non-zero bytes at file offset "
                                f"{at + int(np.argmax(data != 0)):,}")
    scope = "after the header and every payload" if payloads else \
        "after the header (padding after payloads is not read in sample mode)"
    return check("structure.padding", problems, passed=f"zero {scope}")


# -- metadata -------------------------------------------------------------------------------------------------

def _has_surrogates(text: str) -> bool:
    # invalid UTF-8 bytes come back from the reader as lone surrogates (surrogateescape)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _kv_problems(key: str, kv: KV) -> list[str]:
    problems = []
    if kv.type is GGUFValueType.STRING and key not in RAW_STRING_KEYS and _has_surrogates(kv.value):
        problems.append(f"{key}: string value is not valid UTF-8")
    if isinstance(kv.type, ArrayOf):
        item = kv.type.item
        if item is GGUFValueType.STRING and key not in RAW_STRING_KEYS:
            bad = next((j for j, v in enumerate(kv.value) if _has_surrogates(v)), None)
            if bad is not None:
                problems.append(f"{key}: item {bad} is not valid UTF-8")
        if item in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) and key not in NONFINITE_OK_KEYS \
                and len(kv.value) and not np.isfinite(kv.value).all():
            problems.append(f"{key}: item {int(np.argmax(~np.isfinite(kv.value)))} is not finite")
        if item is GGUFValueType.ARRAY:
            for j, inner in enumerate(kv.value):
                problems += _kv_problems(f"{key}[{j}]", inner)
    if kv.type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) and not np.isfinite(kv.value):
        problems.append(f"{key}: value {kv.value} is not finite")
    return problems


def _typed(metadata: dict[str, KV], key: str, expected) -> list[str]:
    kv = metadata.get(key)
    if kv is None or kv.type == expected:
        return []
    return [f"{key} has type {type_name(kv.type)}, expected {type_name(expected)}"]


def metadata_check(f: GGUFFile) -> Check:
    md = f.metadata
    problems = [f"key {k!r} holds whitespace or control characters" for k in md if not _KEY.match(k)
                or not k.isprintable()]
    arch = md.get(Keys.General.ARCHITECTURE)
    if arch is None:
        problems.append(f"{Keys.General.ARCHITECTURE} is missing")
    elif arch.type is not GGUFValueType.STRING or not arch.value:
        problems.append(f"{Keys.General.ARCHITECTURE} must be a non-empty STRING, found {type_name(arch.type)} "
                        f"{arch.value!r}")
    else:
        dialect_types = ds4_key_types(md)     # a ds4-dialect file: ds4's own key types win
        for template, vtype in ARCH_KEY_TYPES.items():
            key = template.format(arch=arch.value)
            problems += _typed(md, key, dialect_types.get(key, vtype))
        problems += [f"{template.format(arch=arch.value)} is missing" for template in REQUIRED_ARCH_KEYS
                     if template.format(arch=arch.value) not in md]
    for key, vtype in KEY_TYPES.items():
        problems += _typed(md, key, vtype)
    tokens = md.get(Keys.Tokenizer.LIST)
    if tokens is not None and tokens.type == ArrayOf(GGUFValueType.STRING):
        n = len(tokens.value)
        for key in TOKEN_ARRAYS:
            if key in md and isinstance(md[key].type, ArrayOf) and len(md[key].value) != n:
                problems.append(f"{key} has {len(md[key].value)} entries for {n} tokens")
        for key in TOKEN_ID_KEYS:
            kv = md.get(key)
            if kv is not None and kv.type is GGUFValueType.UINT32 and kv.value >= n:
                problems.append(f"{key} is {kv.value}, outside the vocabulary of {n} tokens")
    for key, kv in md.items():
        problems += _kv_problems(key, kv)
    return check("structure.metadata", problems, passed=f"{len(md)} keys well formed")


def provenance_check(f: GGUFFile) -> Check:
    md = f.metadata
    problems = [f"{key} is missing" for key in PROVENANCE_KEYS if key not in md]
    for key, vtype in {**PROVENANCE_KEYS, **IMATRIX_PROVENANCE_KEYS, **OPTIONAL_PROVENANCE_KEYS}.items():
        problems += _typed(md, key, vtype)
    if problems:
        return check("structure.provenance", problems)
    text, recorded = md["quantkit.recipe.text"].value, md["quantkit.recipe.sha256"].value
    if text_sha256(text) != recorded:
        problems.append(f"quantkit.recipe.text does not hash to quantkit.recipe.sha256 ({recorded[:16]}…)")
    files, hashes = md["quantkit.source.files"].value, md["quantkit.source.sha256"].value
    if len(files) != len(hashes):
        problems.append(f"quantkit.source.files lists {len(files)} files, quantkit.source.sha256 {len(hashes)} hashes")
    problems += [f"quantkit.source.sha256 item {j} is not 64 hex digits: {h!r}" for j, h in enumerate(hashes)
                 if not _HEX64.match(h)]
    calibrations = {key: kv.value for key, kv in md.items()
                    if key == CALIBRATION_KEY or key.startswith(CALIBRATION_CLASS_PREFIX)}
    problems += [f"{key} is {value!r}, expected one of {CALIBRATION_VALUES}" for key, value in calibrations.items()
                 if value not in CALIBRATION_VALUES]
    with_imatrix = [key for key in IMATRIX_PROVENANCE_KEYS if key in md]
    if with_imatrix and len(with_imatrix) != len(IMATRIX_PROVENANCE_KEYS):
        problems += [f"{key} is missing (an imatrix is recorded)" for key in IMATRIX_PROVENANCE_KEYS if key not in md]
    if "imatrix" in md[CALIBRATION_KEY].value and not with_imatrix:
        problems.append(f"{CALIBRATION_KEY} is {md[CALIBRATION_KEY].value!r} but no imatrix is recorded")
    if "quantkit.imatrix.sha256" in md and not _HEX64.match(md["quantkit.imatrix.sha256"].value):
        problems.append("quantkit.imatrix.sha256 is not 64 hex digits")
    return check("structure.provenance", problems,
                 passed=f"recipe {md['quantkit.recipe.name'].value!r}, {len(files)} source files, calibration "
                        f"{md[CALIBRATION_KEY].value!r}")


def shapes_check(f: GGUFFile) -> Check:
    """``structure.shapes`` (module doc)."""
    try:
        view = llama_cpp_view(f.metadata, f.tensors)
    except QuantkitError as exc:
        return skipped("structure.shapes", f"the file cannot be seen under llama.cpp's names: {exc}")
    shapes = {name: tuple(f.tensors[stored].shape) for name, stored in view.stored.items() if name not in view.relaid}
    # an architecture ds4 lays out otherwise (qwen38-next) keeps its own keys and names: checked under them
    metadata = f.metadata if view.relaid_table is not None else view.metadata
    problems = [f"the metadata gives {found.detail}: llama.cpp refuses to load it"
                for found in disagreements(metadata.items(), shapes)]
    # a support file (an MTP drafter) holds its own blocks alone, the target's count kept
    problems += _block_problems(metadata, shapes, whole="quantkit.support.kind" not in f.metadata)
    return check("structure.shapes", problems, passed="the blocks and the tensors sized by the hyperparameters "
                                                     "(embeddings, experts, attention heads) agree with them")


_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")


def _and_more(blocks: list[int]) -> str:
    return str(blocks[0]) + (f" (and {len(blocks) - 1} more)" if len(blocks) > 1 else "")


def _block_problems(metadata, shapes, *, whole: bool) -> list[str]:
    """``blk.N`` tensors for exactly the blocks ``<arch>.block_count`` gives (llama.cpp creates each block's tensors
    from it: one past it is "wrong number of tensors", a block without them "not found"; ``whole``: a model, not a
    support file, which holds some blocks alone)."""
    arch = metadata.get("general.architecture")
    count = metadata.get(f"{arch.value}.block_count") if arch is not None else None
    blocks = {int(m.group(1)) for name in shapes if (m := _BLOCK_TENSOR.match(name))}
    if count is None or not isinstance(count.value, int) or not blocks:   # no blk.N names: another layout
        return []
    problems = []
    if beyond := sorted(b for b in blocks if b >= count.value):
        problems.append(f"{arch.value}.block_count is {count.value} but block {_and_more(beyond)} has tensors: "
                        f"llama.cpp refuses to load it")
    if whole and (missing := sorted(set(range(count.value)) - blocks)):
        problems.append(f"{arch.value}.block_count is {count.value} but block {_and_more(missing)} has no tensors: "
                        f"llama.cpp refuses to load it")
    return problems


def header_check(f: GGUFFile) -> Check:
    """What the reader verified on open (an unreadable file never gets here)."""
    return check("structure.header", [], passed=f"GGUF v{f.version}, {len(f.tensors)} tensors, {len(f.metadata)} "
                                                f"keys, alignment {f.alignment}, data at {f.data_offset:,}; every "
                                                f"type known, payloads inside the file and disjoint")


__all__ = ["ArtifactReader", "ScaleScan", "header_check", "header_length", "layout_checks", "locate",
           "metadata_check", "padding_check", "provenance_check", "scan_tensor", "shapes_check"]
