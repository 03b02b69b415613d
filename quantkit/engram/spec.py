"""The Engram hash spec: how DeepSeek V4.1 turns token n-grams into rows of its Engram tables.

An Engram layer holds one table of ``rows`` rows (``layers.{L}.engram.embed.weight``).  A token's n-grams of
orders 2 .. ``max_ngram_size`` are hashed by ``n_heads`` heads each; head ``h`` of order ``n`` owns a bucket of a
prime number of rows, and the buckets of one layer are laid side by side: the layer's row count is the sum of its
primes.  The spec (what an engine needs besides the table, and what quantkit writes as GGUF metadata):

- ``token_map``: tokenizer id -> compressed id (tokens that differ only by case, accents, NFKC form or spacing
  share an id); its distinct values number ``compressed_vocab_size``.
- ``primes``: per layer, ``(max_ngram_size - 1) * n_heads`` bucket sizes in (order, head) order, drawn as one
  ascending sequence over (layer, order, head): for every (layer, order) the search restarts just below
  ``vocab_size`` and takes the next prime not used before.
- ``multipliers``: per layer ``max_ngram_size`` odd 64-bit factors, ``2 * k + 1`` for ``k`` drawn by numpy's
  PCG64 seeded ``10007 * layer_id`` below ``(int64 max // compressed_vocab_size) // 2``.
- ``pad_id``: the token whose compressed id stands in before the first token.

Sources: the config fields (``engram_layer_ids``, ``engram_num_embeddings``, ``engram_max_ngram_size``,
``engram_n_heads``, ``engram_head_dim``, ``engram_vocab_size``, ``engram_compressed_vocab_size``,
``engram_pad_token_id``) and the bucket, multiplier and token-map rules are read from public V4.1 engine ports
(sglang's ``EngramLayout.from_config`` description, and V4.1 ports' ``HashLayout``/``compressed_token_map``);
the checks below are the ones those ports make at load time (bucket sums equal the table rows; the token map's
distinct values equal the compressed vocabulary), made here before anything is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from gguf.constants import GGUFValueType

from ..errors import SourceError, ValidationError

#: Multiplier seed stride per layer id (the ports' ``10007 * layer``).
MULTIPLIER_SEED_STRIDE = 10007
#: Largest bucket: row indices within a bucket are computed modulo a prime below 2^32.
MAX_PRIME = 1 << 32
#: Bucket primes a file's spec may hold for validation to re-derive them (V4.1: 2 layers x 3 orders x 8 heads);
#: a larger count is reported, never searched for (the count comes from the file).
MAX_SPEC_PRIMES = 4096
#: The E4M3 values of one scale (E8M0 per 32 values, as the release's other FP8 weights).
SCALE_BLOCK = 32
KEY = "{arch}.engram."
CONFIG_FIELDS = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads",
                 "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size", "engram_pad_token_id")


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the first 13 prime bases)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> np.ndarray:
    """``int64[layers, (max_ngram_size - 1) * n_heads]``: the bucket sizes (module docstring)."""
    used: set[int] = set()
    out = np.empty((layers, (max_ngram_size - 1) * n_heads), dtype=np.int64)
    for layer in range(layers):
        column = 0
        for _order in range(max_ngram_size - 1):
            candidate = vocab_size - 1
            for _head in range(n_heads):
                candidate += 1
                while candidate in used or not is_prime(candidate):
                    candidate += 1
                if candidate >= MAX_PRIME:
                    raise SourceError(f"bucket prime {candidate} is not below 2^32", field="engram_vocab_size")
                used.add(candidate)
                out[layer, column] = candidate
                column += 1
    return out


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """``int64[layers, max_ngram_size]`` odd multipliers (module docstring)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    return np.stack([np.random.default_rng(MULTIPLIER_SEED_STRIDE * int(layer)).integers(
        0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1 for layer in layer_ids])


def compressed_token_map(tokenizer_json: str | Path) -> np.ndarray:
    """``int32[vocab]``: each token id's compressed id, numbered by first appearance of its normalized text
    (NFKC, NFD, accents stripped, lower case, whitespace runs to one space, stripped unless the token is a
    space); a token whose text is a partial UTF-8 sequence keeps its raw token string as key."""
    from tokenizers import Regex, Tokenizer, normalizers

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:   # the tokenizers library raises its own exception types
        raise SourceError(f"cannot read the tokenizer for the Engram token map: {exc}", path=tokenizer_json) from None
    space = "\ue000"   # a lone space survives Strip under this stand-in
    normalize = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), space),
        normalizers.Strip(), normalizers.Replace(space, " ")])
    keys: dict[str, int] = {}
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    out = np.empty(vocab, dtype=np.int32)
    for token_id in range(vocab):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        raw = tokenizer.id_to_token(token_id)
        key = (raw if raw is not None else text) if "\ufffd" in text else (normalize.normalize_str(text) or text)
        out[token_id] = keys.setdefault(key, len(keys))
    return out


@dataclass(frozen=True)
class EngramSpec:
    layer_ids: tuple[int, ...]
    rows: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int
    compressed_vocab_size: int
    pad_id: int
    primes: np.ndarray
    multipliers: np.ndarray
    token_map: np.ndarray

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row: ``head_dim`` E4M3 codes then ``head_dim / 32`` E8M0 scales."""
        return self.head_dim + self.head_dim // SCALE_BLOCK

    @property
    def table_bytes(self) -> int:
        return sum(self.rows) * self.row_bytes

    @classmethod
    def from_config(cls, hp: Mapping[str, Any], token_map: np.ndarray) -> "EngramSpec":
        """The spec of a V4.1 config (hyperparameters with ``text_config`` merged) and its tokenizer's token map;
        SourceError naming the field when the config is incomplete or inconsistent."""
        for name in CONFIG_FIELDS:
            if name not in hp:
                raise SourceError("required for the Engram hash spec but missing from config.json", field=name)
        layer_ids = _int_list(hp, "engram_layer_ids")
        rows = _int_list(hp, "engram_num_embeddings")
        if len(rows) != len(layer_ids):
            raise SourceError(f"needs one row count per Engram layer ({len(layer_ids)}), found {len(rows)}",
                              field="engram_num_embeddings")
        ngram, heads, dim = (_positive(hp, k) for k in ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim"))
        vocab, compressed = _positive(hp, "engram_vocab_size"), _positive(hp, "engram_compressed_vocab_size")
        if ngram < 2:
            raise SourceError(f"must be at least 2, found {ngram}", field="engram_max_ngram_size")
        if dim % SCALE_BLOCK:
            raise SourceError(f"must be a multiple of {SCALE_BLOCK} (one E8M0 scale per {SCALE_BLOCK} values), found "
                              f"{dim}", field="engram_head_dim")
        pad = hp["engram_pad_token_id"]
        spec = cls(tuple(layer_ids), tuple(rows), ngram, heads, dim, vocab, compressed, pad,
                   bucket_primes(len(layer_ids), ngram, heads, vocab),
                   hash_multipliers(layer_ids, ngram, compressed), np.asarray(token_map, dtype=np.int32))
        spec.check()
        return spec

    def check(self, table_rows: Mapping[int, int] | None = None) -> None:
        """The consistency the engines rely on: each layer's bucket sum is its row count (and the table's rows,
        when given: layer id -> rows), the token map's distinct values are the compressed vocabulary ``0 ..
        compressed_vocab_size - 1`` and the pad id is a token.  SourceError naming the field."""
        sums = [int(s) for s in self.primes.sum(axis=1)]
        for layer, want, got in zip(self.layer_ids, self.rows, sums):
            if want != got:
                raise SourceError(f"Engram layer {layer}: its {self.primes.shape[1]} hash buckets sum to {got:,} "
                                  f"rows, the config declares {want:,}", field="engram_num_embeddings")
        for layer, want in zip(self.layer_ids, self.rows):
            if table_rows is not None and table_rows.get(layer) != want:
                raise SourceError(f"Engram layer {layer}: the table has {table_rows.get(layer)} rows, the hash "
                                  f"buckets {want:,}", tensor=f"layers.{layer}.engram.embed.weight")
        values = np.unique(self.token_map)
        if values.size != self.compressed_vocab_size or (values.size and (values[0] != 0 or values[-1] !=
                                                                           values.size - 1)):
            raise SourceError(f"the tokenizer's Engram token map has {values.size} distinct compressed ids, the "
                              f"config declares {self.compressed_vocab_size} (a tokenizer of another checkpoint?)",
                              field="engram_compressed_vocab_size")
        if not 0 <= self.pad_id < self.token_map.size:
            raise SourceError(f"pad id {self.pad_id} is not a token id (vocabulary {self.token_map.size})",
                              field="engram_pad_token_id")

    # -- GGUF metadata ----------------------------------------------------------------------------------------

    def metadata(self, meta) -> None:
        """Write the spec into a :class:`quantkit.arch.base.MetadataBuilder`."""
        meta.array(KEY + "layer_ids", list(self.layer_ids), GGUFValueType.INT32)
        meta.array(KEY + "row_counts", list(self.rows), GGUFValueType.UINT64)
        meta.u32(KEY + "max_ngram_size", self.max_ngram_size)
        meta.u32(KEY + "head_count", self.n_heads)
        meta.u32(KEY + "key_length", self.head_dim)
        meta.u32(KEY + "vocab_size", self.vocab_size)
        meta.u32(KEY + "compressed_vocab_size", self.compressed_vocab_size)
        meta.u32(KEY + "pad_token_id", self.pad_id)
        meta.array(KEY + "primes", [int(p) for p in self.primes.reshape(-1)], GGUFValueType.UINT32)
        meta.array(KEY + "multipliers", [int(m) for m in self.multipliers.reshape(-1)], GGUFValueType.INT64)
        meta.array(KEY + "token_map", [int(t) for t in self.token_map], GGUFValueType.INT32)

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any], arch: str) -> "EngramSpec | None":
        """The spec stored in a GGUF file's metadata (key -> value); None when it has none.  ValidationError
        naming the key when a key is missing, not numeric, or its length disagrees with the others."""
        prefix = KEY.format(arch=arch)
        if not any(k.startswith(prefix) for k in fields):
            return None
        try:
            return cls._from_gguf(fields, prefix)
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, ValidationError):
                raise
            raise ValidationError(f"an Engram hash-spec key holds a value of the wrong kind ({exc})",
                                  field=prefix) from None

    @classmethod
    def _from_gguf(cls, fields: Mapping[str, Any], prefix: str) -> "EngramSpec":

        def get(name: str):
            if prefix + name not in fields:
                raise ValidationError("missing Engram hash-spec key", field=prefix + name)
            return fields[prefix + name]

        layer_ids = tuple(int(x) for x in get("layer_ids"))
        ngram, heads = int(get("max_ngram_size")), int(get("head_count"))
        primes = np.asarray(get("primes"), dtype=np.int64)
        multipliers = np.asarray(get("multipliers"), dtype=np.int64)
        per_layer = (ngram - 1) * heads
        if ngram < 2 or heads < 1 or primes.size != len(layer_ids) * per_layer:
            raise ValidationError(f"holds {primes.size} primes, {len(layer_ids)} layers x {max(ngram - 1, 0)} orders "
                                  f"x {heads} heads need {len(layer_ids) * max(per_layer, 0)}", field=prefix + "primes")
        if multipliers.size != len(layer_ids) * ngram:
            raise ValidationError(f"holds {multipliers.size} multipliers, {len(layer_ids)} layers x {ngram} need "
                                  f"{len(layer_ids) * ngram}", field=prefix + "multipliers")
        return cls(layer_ids, tuple(int(x) for x in get("row_counts")), ngram, heads, int(get("key_length")),
                   int(get("vocab_size")), int(get("compressed_vocab_size")), int(get("pad_token_id")),
                   primes.reshape(len(layer_ids), per_layer), multipliers.reshape(len(layer_ids), ngram),
                   np.asarray(get("token_map"), dtype=np.int64))

    def problems(self) -> list[str]:
        """What is wrong with a spec read from a file: the construction rules re-derived from its own scalar
        keys (primes, multipliers), the bucket sums and the token map (empty: consistent)."""
        found = []
        if len(self.rows) != len(self.layer_ids):
            return [f"{len(self.rows)} row counts for {len(self.layer_ids)} layers"]
        if self.primes.size > MAX_SPEC_PRIMES or self.compressed_vocab_size < 1 or self.head_dim % SCALE_BLOCK:
            return [f"{self.primes.size} bucket primes (at most {MAX_SPEC_PRIMES} are re-derived), compressed "
                    f"vocabulary {self.compressed_vocab_size}, key length {self.head_dim}: not a V4.1 geometry"]
        try:
            self.check()
        except SourceError as exc:
            found.append(exc.detail)
        try:
            primes = bucket_primes(len(self.layer_ids), self.max_ngram_size, self.n_heads, self.vocab_size)
        except SourceError as exc:
            primes = None
            found.append(exc.detail)
        if primes is not None and not np.array_equal(self.primes, primes):
            found.append("the bucket primes are not the ones the vocab size and geometry give")
        if any(layer < 0 for layer in self.layer_ids) or not self.layer_ids:
            return found + [f"Engram layer ids must be block indices, found {list(self.layer_ids)}"]
        if not np.array_equal(self.multipliers, hash_multipliers(self.layer_ids, self.max_ngram_size,
                                                                 self.compressed_vocab_size)):
            found.append("the hash multipliers are not the ones the layer ids give")
        return found


def _int_list(hp: Mapping[str, Any], key: str) -> list[int]:
    value = hp[key]
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise SourceError(f"expected a non-empty list of non-negative integers, found {value!r}", field=key)
    return [int(v) for v in value]


def _positive(hp: Mapping[str, Any], key: str) -> int:
    value = hp[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SourceError(f"expected a positive integer, found {value!r}", field=key)
    return value
