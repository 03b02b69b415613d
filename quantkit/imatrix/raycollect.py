"""``quantkit imatrix collect --executor ray``: calibration chunks run on Ray actors, folded here in order.

Each actor (one per cluster CPU, or per GPU with ``device="cuda"``) loads the model once, as a single process
does (:func:`~quantkit.imatrix.collect.load_collection_model`), and runs the forward passes it is sent (the
groups of chunks a single process forms: :func:`~quantkit.imatrix.collect.forward_passes`) one at a time,
returning each pass's float64 sums and counts (:meth:`~quantkit.imatrix.collect.Collector.run_chunks_alone`).
The driver folds them into the totals strictly in order, holding the few that arrive early
(:meth:`~quantkit.imatrix.collect.Accumulators.fold`): a single-process collection adds the same per-pass sums in
the same order, so the merged imatrix has the same bits (each pass being the same computation in either process:
same chunks, code, dtype and device kind, and torch threads per
:attr:`~quantkit.imatrix.collect.CollectOptions.threads`).  The resume state is saved by the driver as in a single
process, so ``--restart``/resume behave the same.

An actor whose process dies is restarted (it loads the model again) and its pass retried
(:data:`quantkit.cluster.TASK_RETRIES` times).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..cluster import TASK_RETRIES, cluster_cpus, ray_session, task_result
from .collect import Accumulators, CollectOptions, Collector, accumulate, collection_threads, load_collection_model


class CollectWorker:
    """One model and one collector per actor."""

    def __init__(self, source: str, config: dict, opts: CollectOptions):
        from ..arch import get_arch

        amap = get_arch(config.get("model_type", "")).bind(config)
        self.model = load_collection_model(Path(source), config, opts)
        self.collector = Collector(self.model.module, amap, all_experts=opts.all_experts,
                                   process_output=opts.process_output)
        self.opts = opts

    def run(self, index: int, chunks: list[list[int]]) -> tuple[int, dict]:
        import torch

        with collection_threads(self.model, self.opts):
            stats = self.collector.run_chunks_alone(torch.tensor(chunks, dtype=torch.long))
        self.model.store.check()
        return index, {name: (sums.cpu().numpy(), counts.cpu().numpy()) for name, (sums, counts) in stats.items()}


def collect_on_ray(source: Path, config: dict, amap, chunks: list[list[int]], out: Path,
                   identity: Callable[[], dict[str, str]], opts: CollectOptions, text_path):
    """The collection of :func:`quantkit.imatrix.collect.collect_imatrix` with its chunks run on Ray."""
    with ray_session(opts.address, opts.workers, "quantkit imatrix collect --executor ray") as ray:
        resources = {"num_gpus": 1, "num_cpus": 1} if opts.device.startswith("cuda") else {"num_cpus": 1}
        slots = cluster_cpus(ray) if not opts.device.startswith("cuda") else max(1, int(ray.cluster_resources().get("GPU", 0)))
        actor = ray.remote(max_restarts=TASK_RETRIES, max_task_retries=TASK_RETRIES, **resources)(CollectWorker)
        n_passes = -(-len(chunks) // opts.chunks_per_pass)
        actors = [actor.remote(str(source), config, opts) for _ in range(max(1, min(slots, n_passes)))]

        def run(passes):
            queue = list(enumerate(passes))[::-1]
            pending, idle, early = {}, list(actors), {}
            next_index = 0
            while queue or pending:
                while queue and idle:
                    worker = idle.pop()
                    index, indices = queue.pop()
                    pending[worker.run.remote(index, [chunks[i] for i in indices])] = worker
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    idle.append(pending.pop(ref))
                    index, stats = task_result(ray, ref, "collection actor")
                    early[index] = stats
                while next_index in early:   # fold in order
                    acc.fold(early.pop(next_index))
                    yield passes[next_index]
                    next_index += 1

        acc = Accumulators("cpu")
        try:
            return accumulate(acc, amap, len(chunks), run, out, identity, opts, source, text_path)
        finally:
            for worker in actors:
                ray.kill(worker)


__all__ = ["CollectWorker", "collect_on_ray"]
