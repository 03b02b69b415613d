"""DeepSeek V4.1 Engram tables: the hash spec (:mod:`.spec`) and the native row store (:mod:`.rows`)."""
from .rows import CHUNK_BYTES, RowSource, decode_rows, describe_invalid, invalid_rows, row_bytes
from .spec import EngramSpec, bucket_primes, compressed_token_map, hash_multipliers, is_prime

__all__ = ["CHUNK_BYTES", "EngramSpec", "RowSource", "bucket_primes", "compressed_token_map", "decode_rows",
           "describe_invalid", "hash_multipliers", "invalid_rows", "is_prime", "row_bytes"]
