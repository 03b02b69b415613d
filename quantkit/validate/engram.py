"""Engram audit of a GGUF file: the hash spec against the tables, and which tensors are native row stores.

``engram.spec`` (every mode, no source needed): the spec the metadata holds (:class:`quantkit.engram.EngramSpec`)
is complete and self-consistent (bucket primes and multipliers re-derived from its scalar keys, bucket sums equal
the declared row counts, the token map's distinct values equal the compressed vocabulary), and every Engram layer
has its table ``blk.L.engram_embd.weight`` with exactly the declared rows: a table with fewer rows (truncated) or
more is named with the first row missing or extra.

The rows themselves are checked where they are read: :class:`~.structure.ScaleScan` flags E4M3 NaN codes and
0xFF scales in the row stores :func:`row_stores` lists (every row in ``full`` and ``none`` modes, the sampled rows
in ``sample`` mode), and the payload audit compares them with the source, naming a row that holds another source
row (reordered or duplicated rows).
"""
from __future__ import annotations

from ..engram import EngramSpec
from ..engram.rows import row_bytes
from ..errors import ValidationError
from ..io.gguf_reader import GGUFFile
from .report import Check, check

TABLE = "blk.{layer}.engram_embd.weight"


def _spec(f: GGUFFile) -> EngramSpec | None:
    arch = f.metadata.get("general.architecture")
    arch = getattr(arch, "value", arch)
    if not isinstance(arch, str):
        return None
    values = {k: getattr(kv, "value", kv) for k, kv in f.metadata.items()}
    return EngramSpec.from_gguf(values, arch)


def row_stores(f: GGUFFile) -> dict[str, int]:
    """GGUF name -> values per row of each native Engram row store the file declares (I8, ``head_dim +
    head_dim / 32`` bytes per row); empty when the file has no (readable) Engram spec."""
    try:
        spec = _spec(f)
    except ValidationError:
        return {}
    if spec is None:
        return {}
    out = {}
    for layer in spec.layer_ids:
        t = f.tensors.get(TABLE.format(layer=layer))
        if t is not None and t.type.name == "I8" and len(t.shape) == 2 and t.shape[-1] == row_bytes(spec.head_dim):
            out[t.name] = spec.head_dim
    return out


def spec_check(f: GGUFFile) -> Check | None:
    """``engram.spec`` (module docstring); None for a file without Engram keys or tables."""
    tables = sorted(n for n in f.tensors if n.endswith(".engram_embd.weight"))
    try:
        spec = _spec(f)
    except ValidationError as exc:
        return check("engram.spec", [str(exc)], passed="")
    if spec is None:
        if not tables:
            return None
        return check("engram.spec", [f"{len(tables)} Engram tables ({tables[0]}, ...) but no Engram hash spec in the "
                                     f"metadata: an engine cannot address their rows"], passed="")
    problems = [f"hash spec: {p}" for p in spec.problems()]
    width = row_bytes(spec.head_dim)
    for layer, rows in zip(spec.layer_ids, spec.rows):
        name = TABLE.format(layer=layer)
        t = f.tensors.get(name)
        if t is None:
            problems.append(f"Engram layer {layer}: no table {name}")
            continue
        if t.type.name == "I8":
            if len(t.shape) != 2 or t.shape[-1] != width:
                problems.append(f"Engram table {name}: rows of {t.shape[-1]} bytes, the spec's key length "
                                f"{spec.head_dim} needs {width}")
                continue
        elif t.shape[-1] != spec.head_dim:
            problems.append(f"Engram table {name}: rows of {t.shape[-1]} values, the spec says {spec.head_dim}")
            continue
        got = int(t.shape[0])
        buckets = int(spec.primes[spec.layer_ids.index(layer)].sum())
        if buckets != got:
            problems.append(f"Engram table {name}: the hash buckets address {buckets:,} rows, the table has {got:,} "
                            f"(first {'missing' if got < buckets else 'unaddressed'} row {min(got, buckets)})")
        if got < rows:
            problems.append(f"Engram table {name}: truncated, {got:,} rows of the spec's {rows:,} (first missing row "
                            f"{got})")
        elif got > rows:
            problems.append(f"Engram table {name}: {got:,} rows, the spec's buckets address {rows:,} (first extra "
                            f"row {rows})")
    extra = sorted(set(tables) - {TABLE.format(layer=layer) for layer in spec.layer_ids})
    problems += [f"Engram table {name} belongs to no layer of the spec's {list(spec.layer_ids)}" for name in extra]
    return check("engram.spec", problems,
                 passed=f"{len(spec.layer_ids)} Engram tables, {sum(spec.rows):,} rows, match the hash spec "
                        f"({spec.max_ngram_size - 1} orders x {spec.n_heads} heads, compressed vocabulary "
                        f"{spec.compressed_vocab_size:,}, pad id {spec.pad_id})")
