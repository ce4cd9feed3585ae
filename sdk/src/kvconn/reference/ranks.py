"""Tensor parallelism in the reference engine: every rank's worker, one step, one answer.

Each rank holds its shard of the heads (:mod:`.model`), with a connector
worker side of its own whose context names its rank; all ranks see the same
scheduler output. Their reads add up (an all-reduce) before rank 0 samples,
so the tokens are the single-rank model's, and a connector that mixes the
ranks' shards (a store key without the rank) changes them.

The connectors' reports are combined as vLLM's ``KVOutputAggregator``
(``vllm/distributed/kv_transfer/kv_connector/utils.py``) combines its
workers' for the scheduler: a request is finished sending, or receiving,
once *every* rank has reported it (in any step); failed blocks are the union
of the ranks'; a connector failed if it failed on any rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from .worker import ReferenceWorker

__all__ = ["RankOutputs", "TensorParallelWorkers"]


class RankOutputs:
    """Combine the ranks' per-connector reports of each step into the one the scheduler gets."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: per connector and report kind: how many ranks reported each request so far
        self._seen: dict[tuple[str, str], Counter[str]] = {}

    def combine(self, outputs: Sequence[dict[str, KVConnectorOutput]]) -> dict[str, KVConnectorOutput]:
        combined: dict[str, KVConnectorOutput] = {}
        for name in {name for output in outputs for name in output}:
            mine = [output[name] for output in outputs if name in output]
            merged = KVConnectorOutput(
                finished_sending=self._done(name, "sending", [o.finished_sending for o in mine]),
                finished_recving=self._done(name, "recving", [o.finished_recving for o in mine]),
                invalid_block_ids=set().union(*(o.invalid_block_ids for o in mine)),
                failed=any(o.failed for o in mine),
                stats=dict(sum((Counter(o.stats) for o in mine), Counter())),
            )
            if not merged.is_empty():
                combined[name] = merged
        return combined

    def _done(self, name: str, kind: str, reports: list[set[str]]) -> set[str]:
        seen = self._seen.setdefault((name, kind), Counter())
        for report in reports:
            seen.update(report)
        done = {req_id for req_id, n in seen.items() if n >= self.world_size}
        for req_id in done:
            del seen[req_id]
        return done


class TensorParallelWorkers:
    """The ranks' :class:`~.worker.ReferenceWorker` s stepped as one worker (``execute_model``), rank 0 first."""

    def __init__(self, workers: Sequence[ReferenceWorker]) -> None:
        self.ranks = list(workers)
        self.model = self.ranks[0].model  # samples; every rank's reads add up to the single-rank model's
        self._outputs = RankOutputs(len(self.ranks))

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        steps = [worker.forward(output) for worker in self.ranks]
        sampled = {}
        for req_id in steps[0].reads:
            per_layer = zip(*(step.reads[req_id] for step in steps), strict=True)  # each layer: every rank's read
            sampled[req_id] = [self.model.next_token([sum(reads) for reads in per_layer])]
        return ModelRunnerOutput(
            req_ids=list(output.num_scheduled_tokens),
            sampled_token_ids=sampled,
            kv_connector_output=self._outputs.combine([s.connector_output for s in steps]),
        )

    def num_requests(self) -> int:
        return self.ranks[0].num_requests()
