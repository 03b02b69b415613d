"""How good is an artifact: fixture scoring, llama-perplexity KLD, paired comparison.

:mod:`.source` (the :class:`~.source.LogitSource` protocol and model identity), :mod:`.logprobs` and
:mod:`.metrics` (per-case metrics, summary lines), :mod:`.table` (the per-case TSV), :mod:`.kld` (llama-perplexity's
logits file and KLD statistics), :mod:`.score` (scoring a model on a fixture), :mod:`.compare` (two tables:
deltas, case wins, paired bootstrap, verdict), :mod:`.loading` (models through :mod:`quantkit.runtime`).
"""
