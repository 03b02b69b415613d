"""Seeded input corpora for encoder byte-identity tests, and the checks that run them against the references.

:func:`sweep_encoder` encodes every family × imatrix variant × row length with quantkit and with ggml's
``ggml_quantize_chunk`` and reports each differing case block by block (:func:`block_mismatch`);
:func:`sweep_decoder` compares a type's reference decoder bit for bit with ggml and gguf-py;
:func:`draw_case` draws arbitrary inputs for hypothesis; :func:`encode_at_thread_counts` encodes with 1 and
with all numba threads.

Weight families (``family(name, rows, n, seed)`` → float32[rows, n]):

- ``gaussian``: N(0, 1) times a per-row scale around 0.02 (typical trained weights);
- ``heavy_tailed``: Student t with 2 degrees of freedom;
- ``zeros`` / ``signed_zeros``: all +0.0 / a random mix of +0.0 and -0.0;
- ``constant``: one value per row (random sign and magnitude);
- ``outliers``: gaussian with about 1% of weights multiplied by 100…1000;
- ``tiny`` / ``huge``: gaussian times 1e-30 / 1e30 (x² under- and overflows float32);
- ``subnormal``: gaussian times 1e-40 (float32 subnormals);
- ``ties``: multiples of 1/4 in [-8, 8], which land exactly on rounding midpoints;
- ``wide_range``: gaussian with each 32-weight block scaled by 2^k, k uniform in [-140, 120];
- ``mixed_blocks``: every 32-weight block drawn from another family (zero, constant, huge, tiny, gaussian).

Importance-matrix variants (``imatrix(name, n, seed)``): ``none``; ``random`` (positive); ``with_zeros``
(a quarter of the entries zero, plus one all-zero 32-block).  Per-expert slices are built by the tests from
several ``random``/``with_zeros`` vectors.
"""
from __future__ import annotations

import numpy as np

FAMILIES = ("gaussian", "heavy_tailed", "zeros", "signed_zeros", "constant", "outliers", "tiny", "huge",
            "subnormal", "ties", "wide_range", "mixed_blocks")
IMATRIX_VARIANTS = ("none", "random", "with_zeros")
_BLOCK = 32


def family(name: str, rows: int, n: int, seed: int = 0) -> np.ndarray:
    """``rows`` × ``n`` float32 weights of family ``name`` (deterministic in name, shape and seed)."""
    rng = np.random.default_rng([FAMILIES.index(name), rows, n, seed])
    g = rng.standard_normal((rows, n))
    if name == "gaussian":
        x = g * (0.02 * np.exp(rng.normal(0, 0.5, (rows, 1))))
    elif name == "heavy_tailed":
        x = rng.standard_t(2, (rows, n))
    elif name == "zeros":
        x = np.zeros((rows, n))
    elif name == "signed_zeros":
        x = np.where(rng.random((rows, n)) < 0.5, -0.0, 0.0)
    elif name == "constant":
        x = np.broadcast_to(rng.choice([-1, 1], (rows, 1)) * 10.0 ** rng.uniform(-3, 3, (rows, 1)), (rows, n))
    elif name == "outliers":
        x = g * 0.02
        spikes = rng.random((rows, n)) < 0.01
        x = np.where(spikes, x * rng.uniform(100, 1000, (rows, n)), x)
    elif name == "tiny":
        x = g * 1e-30
    elif name == "huge":
        x = g * 1e30
    elif name == "subnormal":
        x = g * 1e-40
    elif name == "ties":
        x = rng.integers(-32, 33, (rows, n)) / 4.0
    elif name == "wide_range":
        k = rng.integers(-140, 121, (rows, n // _BLOCK, 1))
        x = (g.reshape(rows, -1, _BLOCK) * np.exp2(k.astype(np.float64))).reshape(rows, n)
    elif name == "mixed_blocks":
        kinds = rng.integers(0, 5, (rows, n // _BLOCK, 1))
        gb = g.reshape(rows, -1, _BLOCK)
        x = np.select([kinds == 0, kinds == 1, kinds == 2, kinds == 3],
                      [0.0 * gb, np.broadcast_to(gb[..., :1], gb.shape), gb * 1e30, gb * 1e-30], gb * 0.02)
        x = x.reshape(rows, n)
    else:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    with np.errstate(over="ignore", under="ignore"):
        return np.ascontiguousarray(x, dtype=np.float32)


def imatrix(name: str, n: int, seed: int = 0) -> np.ndarray | None:
    """An importance vector of length ``n`` for variant ``name`` (``None`` for ``none``)."""
    if name == "none":
        return None
    rng = np.random.default_rng([IMATRIX_VARIANTS.index(name), n, seed])
    im = rng.gamma(0.7, 1.0, n) + 1e-3
    if name == "with_zeros":
        im[rng.random(n) < 0.25] = 0.0
        start = _BLOCK * int(rng.integers(0, n // _BLOCK))
        im[start:start + _BLOCK] = 0.0
    elif name != "random":
        raise ValueError(f"unknown imatrix variant {name!r}; known: {', '.join(IMATRIX_VARIANTS)}")
    return im.astype(np.float32)


def block_mismatch(ours: np.ndarray, ref: np.ndarray, x: np.ndarray, type_size: int, block_size: int,
                   label: str = "") -> str | None:
    """``None`` when the encodings are equal, else a report of the first differing block (bytes and input)."""
    if ours.shape != ref.shape:
        return f"{label}: shape {ours.shape} != reference shape {ref.shape}"
    diff = np.argwhere(ours.reshape(ours.shape[0], -1, type_size) != ref.reshape(ref.shape[0], -1, type_size))
    if diff.size == 0:
        return None
    row, blk = int(diff[0][0]), int(diff[0][1])
    n_bad = len({(int(r), int(b)) for r, b, _ in diff})
    lo = blk * type_size
    xb = x[row, blk * block_size:(blk + 1) * block_size]
    return (f"{label}: {n_bad} block(s) differ; first at row {row}, block {blk}\n"
            f"  ours: {ours[row, lo:lo + type_size].tobytes().hex()}\n"
            f"  ref : {ref[row, lo:lo + type_size].tobytes().hex()}\n"
            f"  x   : {np.array2string(xb, precision=9, max_line_width=120)}")


def row_lengths(block_size: int) -> list[int]:
    """Row lengths to test a type on: odd multiples of its block (3·, 7·) and 256, 1536, 4096, 7168."""
    lengths = [3 * block_size, 7 * block_size] + [n for n in (256, 1536, 4096, 7168) if n % block_size == 0]
    return sorted(set(lengths))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """float32 arrays equal bit for bit (NaN payloads and signed zeros included)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def sweep_encoder(ggml, qtype, families=FAMILIES, variants=IMATRIX_VARIANTS, lengths=None, rows: int = 2,
                  reference: bool = False, seed: int = 0) -> list[str]:
    """Encode every family × imatrix variant × row length with quantkit and with ggml (``ggml_ref``, which gets
    the same imatrix; ggml itself ignores it where the type does).  Returns one report per differing case."""
    from ..formats import encode, get_format

    fmt = get_format(qtype)
    reports = []
    for fam in families:
        for variant in variants:
            for n in lengths or row_lengths(fmt.block_size):
                x = family(fam, rows, n, seed)
                im = imatrix(variant, n, seed)
                ours = encode(x, fmt.qtype, im, reference=reference)
                report = block_mismatch(ours, ggml.quantize(x, fmt.qtype, im), x, fmt.type_size, fmt.block_size,
                                        f"{fmt.name} {'reference' if reference else 'fast'} {fam} "
                                        f"imatrix={variant} n={n}")
                if report:
                    reports.append(report)
    return reports


def sweep_decoder(ggml, qtype, seed: int = 0) -> list[str]:
    """Decode with the type's reference decoder and compare bit for bit with gguf-py's ``quants.dequantize``
    and ggml's ``dequantize_row_<type>``, on every family's encoding and on random bytes (which include NaN,
    inf and subnormal scales).  Returns one report per differing input."""
    import warnings

    from gguf.quants import dequantize as gguf_dequantize

    from ..formats import encode, get_format

    fmt = get_format(qtype)
    n = 4 * max(fmt.block_size, 64)
    rng = np.random.default_rng(seed)
    inputs = {f"encoded {fam}": encode(family(fam, 2, n, seed), fmt.qtype) for fam in FAMILIES}
    inputs["random bytes"] = rng.integers(0, 256, (8, fmt.row_bytes(n)), dtype=np.uint8)
    reports = []
    for label, data in inputs.items():
        ours = fmt.decode_reference(data.reshape(-1, fmt.type_size)).reshape(data.shape[0], n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # gguf-py's NaN/inf arithmetic
            theirs = {"gguf-py": np.asarray(gguf_dequantize(data, fmt.qtype)).reshape(ours.shape),
                      "ggml": np.stack([ggml.dequantize_row(fmt.qtype, row, n) for row in data])}
        for who, ref in theirs.items():
            if not same_bits(ours, ref):
                bad = np.argwhere(ours.view(np.uint32) != ref.view(np.uint32))[0]
                reports.append(f"{fmt.name} {label}: differs from {who} first at {tuple(int(i) for i in bad)}: "
                               f"{ours[tuple(bad)]!r} vs {ref[tuple(bad)]!r}")
    return reports


def encode_at_thread_counts(qtype, x: np.ndarray, im: np.ndarray | None = None) -> list[np.ndarray]:
    """quantkit's encoding of ``x`` with 1 numba thread and with every thread numba has."""
    import numba

    from ..formats import encode

    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            results.append(encode(x, qtype, im))
    finally:
        numba.set_num_threads(before)
    return results


def draw_case(data, block_size: int, max_blocks: int = 4):
    """Draw (x[rows, n], imatrix or None) from hypothesis ``data``: any finite float32 weights (subnormals,
    ±0, extremes) and any finite non-negative importance up to 1e6."""
    from hypothesis import strategies as st
    from hypothesis.extra.numpy import arrays

    n = block_size * data.draw(st.integers(1, max_blocks))
    weights = st.floats(width=32, allow_nan=False, allow_infinity=False)
    importance = st.floats(min_value=0, max_value=1e6, width=32, allow_nan=False, allow_infinity=False)
    x = data.draw(arrays(np.float32, (data.draw(st.integers(1, 3)), n), elements=weights))
    im = data.draw(st.none() | arrays(np.float32, n, elements=importance))
    return x, im


#: Hostile ``config.json`` edits (field, value) for the example model (8 experts, 4 layers, vocabulary 512):
#: counts that would size petabytes, counts the tensors do not hold, values of the wrong type, zero or null, and
#: values at odds with each other or with the engines' asserts.  Each must be refused naming config.json and the
#: field before anything is allocated (``quantkit.io.config``, ``quantkit.convert.consistency``).
MALFORMED_CONFIGS: tuple[tuple[str, object], ...] = (
    ("num_local_experts", 10 ** 12),
    ("num_local_experts", 9),
    ("num_local_experts", 0),
    ("num_local_experts", "8"),
    ("num_hidden_layers", 10 ** 9),
    ("num_hidden_layers", 5),
    ("num_hidden_layers", -1),
    ("num_hidden_layers", 4.0),
    ("vocab_size", 2 ** 40),
    ("vocab_size", 513),
    ("vocab_size", True),
    ("hidden_size", 0),
    ("hidden_size", [256]),
    ("num_attention_heads", 0),
    ("num_key_value_heads", "two"),
    ("moe_intermediate_size", 10 ** 7),
    ("num_experts_per_tok", 0),
    ("num_experts_per_tok", 9),           # more than the 8 routed experts: llama.cpp asserts
    ("num_experts_per_tok", None),
    ("num_hidden_layers", None),
    ("num_attention_heads", None),
    ("num_key_value_heads", 3),           # does not divide the 4 heads
    ("num_attention_heads", 2),           # divisible by the 2 key-value heads, but not the projections' rows
    ("rms_norm_eps", float("nan")),
    ("rms_norm_eps", 10 ** 400),          # past float64: an internal error through math.isfinite
    ("rms_norm_eps", -1.0),
    ("rms_norm_eps", "x"),
)
