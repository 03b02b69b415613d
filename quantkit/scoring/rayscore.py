"""``quantkit score --executor ray``: the fixture's cases scored by Ray actors, merged in case order.

Each actor (one per cluster CPU, or per GPU with ``device="cuda"``) loads the model once, exactly as a single
process does (:func:`~quantkit.scoring.loading.load_source`, sidecars included), and scores the groups of cases it
is sent, one forward pass each, the groups a single process forms (:func:`~quantkit.scoring.score.case_batches`,
:func:`~quantkit.scoring.score.score_group`).  A case's score depends only on its group's forward pass, so the
merged table, in the fixture's case order, is the one a single process writes.  The vocabulary width comes from
one actor; every case's token ids are checked against it before any case runs.

An actor whose process dies is restarted (it loads the model again) and its group retried
(:data:`quantkit.cluster.TASK_RETRIES` times).  ``--kld-base`` and ``--save-logits`` evaluate one token stream in
order and stay single-process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..cluster import TASK_RETRIES, cluster_cpus, ray_session, task_result
from .metrics import CaseScore
from .score import DEFAULT_BATCH_TOKENS, PreparedCase, _check_vocab, case_batches


@dataclass(frozen=True)
class Loaded:
    """What the evidence record says about the source the actors ran (as a loaded source's attributes)."""

    device: str | None
    dtype: str | None
    arithmetic: str


class ScoreWorker:
    """One model per actor."""

    def __init__(self, identity, device: str, sidecars: Sequence[str], arithmetic: str, dtype: str):
        from .loading import load_source, open_sidecars

        replace = open_sidecars(identity.path, sidecars) if sidecars else None
        self.source = load_source(identity, device=device, replace=replace, arithmetic=arithmetic, dtype=dtype)

    def describe(self) -> Loaded:
        s = self.source
        return Loaded(getattr(s, "device", None), getattr(s, "dtype", None), getattr(s, "arithmetic", "float32"))

    def width(self, case: PreparedCase) -> int:
        from .score import vocabulary_width

        return vocabulary_width(self.source, [case])

    def score(self, indices: list[int], cases: list[PreparedCase], width: int) -> list[tuple[int, CaseScore]]:
        from .score import score_group

        return list(zip(indices, score_group(self.source, cases, width)))


def score_on_ray(identity, cases: Sequence[PreparedCase], *, device: str = "cpu", sidecars: Sequence[str] = (),
                 arithmetic: str = "float32", dtype: str = "float32", address: str | None = None, workers: int = 1,
                 progress: Callable[[CaseScore], None] | None = None,
                 batch_tokens: int = DEFAULT_BATCH_TOKENS) -> tuple[list[CaseScore], int, Loaded]:
    """(scores in case order, vocabulary width, what ran) of ``cases`` on the cluster at ``address`` (None: a local
    cluster of ``workers`` CPUs)."""
    with ray_session(address, workers, "quantkit score --executor ray") as ray:
        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        slots = cluster_cpus(ray) if device != "cuda" else max(1, int(ray.cluster_resources().get("GPU", 0)))
        actor = ray.remote(max_restarts=TASK_RETRIES, max_task_retries=TASK_RETRIES, **resources)(ScoreWorker)
        groups = case_batches(cases, batch_tokens)
        actors = [actor.remote(identity, device, tuple(sidecars), arithmetic, dtype)
                  for _ in range(min(slots, len(groups)))]
        try:
            width = task_result(ray, actors[0].width.remote(cases[0]), "scoring actor")
            for case in cases:
                _check_vocab(case, width)
            loaded = task_result(ray, actors[0].describe.remote(), "scoring actor")
            scores: list[CaseScore | None] = [None] * len(cases)
            queue = groups[::-1]
            pending = {}
            idle = list(actors)
            while queue or pending:
                while queue and idle:
                    worker = idle.pop()
                    group = queue.pop()
                    pending[worker.score.remote(group, [cases[i] for i in group], width)] = worker
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    idle.append(pending.pop(ref))
                    for index, score in task_result(ray, ref, "scoring actor"):
                        scores[index] = score
                        if progress is not None:
                            progress(score)
        finally:
            for worker in actors:
                ray.kill(worker)
    return scores, width, loaded


__all__ = ["Loaded", "ScoreWorker", "score_on_ray"]
