"""placeholder: numba decoders, filled by the decoder work."""
FAST_DECODERS = {}
