"""``Engine``: scheduler and worker in one process, wired as a real engine is.

Every ``SchedulerOutput`` goes through the wire encoder and decoder on its way
to the worker (and every ``ModelRunnerOutput`` on its way back), so anything a
connector puts in its metadata that would not survive a process boundary fails
here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ..context import ConnectorContext
from ..host import (
    DEFAULT_HOOK_BUDGET_S,
    DEFAULT_MAX_SLOW_CALLS,
    DEFAULT_STALL_S,
    DEFAULT_STALL_STEPS,
    ConnectorHost,
    OnError,
    SchedulerHost,
    WorkerHost,
)
from ..host.wire import (
    decode_model_runner_output,
    decode_scheduler_output,
    encode_model_runner_output,
    encode_scheduler_output,
)
from .model import check_dtype
from .ranks import TensorParallelWorkers
from .request import Request
from .scheduler import Scheduler
from .shape import EngineShape
from .stats import EngineStats
from .worker import ReferenceWorker

__all__ = ["Engine"]

_Host = TypeVar("_Host", bound=ConnectorHost)


class Engine:
    """The reference engine.

    Args:
        connector: a connector name, ``"pkg.mod:Class"``, a list of them (several
            connectors: every one saves, the first with a hit loads), or ``None``.
        config: the connector's config (with several: ``{name: config}``).
        worker_config: the worker side's config where it differs from ``config``
            (a test giving the worker a fresh store namespace, say).
        on_error: the hosts' error policy (``"degrade"`` or ``"raise"``).
        stall_steps, stall_s, hook_budget_s, max_slow_calls: the hosts' bounds on a stalling
            or slow connector (:class:`~kvconn.ConnectorHost`). The engine's steps take
            microseconds, as a real engine's empty steps do, so a stall counts only past
            ``stall_s`` seconds too; ``stall_s=0`` bounds it by ``stall_steps`` alone.
        model, dtype: engine facts connectors may namespace keys with.
        tp_size: tensor-parallel ranks to run (default: ``shape.tp_size``), each a worker with its shard
            of the heads and a connector worker side whose context names its rank (:mod:`.ranks`).
        tp_rank: the scheduler's rank, always 0 (the engine runs every rank).
        device: where the KV caches live (``"cuda"`` runs connectors against accelerator memory).
        shape: the engine's KV cache and batch limits (default: :class:`EngineShape`'s defaults).
        **scheduler_options: fields of :class:`EngineShape` to change in ``shape``
            (``num_blocks=64``, ``num_kv_heads=4``...).
    """

    def __init__(
        self,
        connector: str | Sequence[str] | None = None,
        config: Mapping[str, Any] | None = None,
        *,
        worker_config: Mapping[str, Any] | None = None,
        on_error: OnError = "degrade",
        stall_steps: int = DEFAULT_STALL_STEPS,
        stall_s: float = DEFAULT_STALL_S,
        hook_budget_s: float | None = DEFAULT_HOOK_BUDGET_S,
        max_slow_calls: int | None = DEFAULT_MAX_SLOW_CALLS,
        model: str = "kvconn-reference",
        dtype: str = "float16",
        tp_rank: int = 0,
        tp_size: int | None = None,
        device: str = "cpu",
        shape: EngineShape | None = None,
        **scheduler_options: Any,
    ) -> None:
        if tp_size is not None:
            scheduler_options["tp_size"] = tp_size
        self.shape = shape = EngineShape.from_options(shape, **scheduler_options)
        if tp_rank != 0:
            raise ValueError(f"tp_rank must be 0, got {tp_rank}: the reference engine runs every rank of tp_size")
        check_dtype(dtype)  # before any connector is loaded for it
        #: each rank's context (rank 0's is the scheduler's)
        self.contexts = [
            ConnectorContext(
                model=model,
                dtype=dtype,
                block_size=shape.block_size,
                kv_cache_groups=shape.kv_cache_groups,
                tp_rank=rank,
                tp_size=shape.tp_size,
                num_kv_heads=shape.heads_per_rank,
                head_dim=shape.head_dim,
            )
            for rank in range(shape.tp_size)
        ]
        self.context = self.contexts[0]

        def host(cls: type[_Host], role_config: Any, context: ConnectorContext) -> _Host:
            assert connector
            return cls.from_names(
                connector,
                config=role_config,
                context=context,
                on_error=on_error,
                stall_steps=stall_steps,
                stall_s=stall_s,
                hook_budget_s=hook_budget_s,
                max_slow_calls=max_slow_calls,
            )

        self.scheduler_host = host(SchedulerHost, config, self.context) if connector else None
        worker_config = config if worker_config is None else worker_config
        #: each rank's worker host (rank 0's is ``worker_host``); none without a connector
        self.worker_hosts = [host(WorkerHost, worker_config, c) for c in self.contexts] if connector else []
        self.worker_host: WorkerHost | None = self.worker_hosts[0] if connector else None
        self.scheduler = Scheduler(shape, host=self.scheduler_host, context=self.context)
        #: each rank's worker; ``worker`` is rank 0's
        self.workers = [
            ReferenceWorker(
                context,
                num_blocks=shape.num_blocks,
                host=self.worker_hosts[context.tp_rank] if connector else None,
                num_kv_heads=shape.heads_per_rank,
                head_dim=shape.head_dim,
                device=device,
            )
            for context in self.contexts
        ]
        self.worker = self.workers[0]
        #: what steps the model: the one worker, or every rank as one (a test may put another worker here)
        self.executor: ReferenceWorker | TensorParallelWorkers = (
            self.worker if shape.tp_size == 1 else TensorParallelWorkers(self.workers)
        )
        # Decode every connector's metadata, even one with no worker side (its workers ignore it).
        self._metadata_types = self.scheduler_host.metadata_types if self.scheduler_host else {}
        self._ids = itertools.count()
        # the model's vocabulary decides which prompts are valid, whichever worker (or process) steps them
        self._check_token_ids = self.worker.model.check_token_ids

    @property
    def stats(self) -> EngineStats:
        """The scheduler's counters; degraded events: both hosts' failed hooks and what connectors report dropping."""
        stats = self.scheduler.stats
        hosts = sum(h.degraded_events for h in (self.scheduler_host, *self.worker_hosts) if h)
        stats.degraded_events = hosts + self.scheduler.connector_degraded_events
        return stats

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int = 16,
        request_id: str | None = None,
        *,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request; ``ValueError`` for a prompt of token ids outside the model's vocabulary.

        ``adapter`` (a LoRA adapter's name: its KV differs) and ``cache_salt`` (a tenant: its
        cached prefixes are its own) go into the request's block hashes as vLLM puts them.
        """
        self._check_token_ids(prompt, "prompt token ids")
        request = Request(
            request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt,
            max_tokens,
            self.scheduler.block_size,
            adapter=adapter,
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(request)
        return request

    def abort(self, *req_ids: str) -> None:
        """Abort requests, waiting or running (connectors get ``request_finished``); unknown ids are ignored."""
        self.scheduler.finish_requests(req_ids)

    def step(self) -> None:
        """One engine step: schedule, send, execute, send back, update."""
        output = self.scheduler.schedule()
        wire = encode_scheduler_output(output)
        worker_output = self.executor.execute_model(decode_scheduler_output(wire, self._metadata_types))
        returned = decode_model_runner_output(encode_model_runner_output(worker_output))
        self.scheduler.update_from_output(output, returned)

    def run_until_done(self, *, max_steps: int = 100_000, drain_steps: int = 256) -> None:
        """Step until every request finished, then until held blocks are released.

        Raises ``RuntimeError`` if requests are still unfinished after
        ``max_steps`` (a connector that never completes a load, say).
        """
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        else:
            raise RuntimeError(
                f"{self.scheduler.get_num_unfinished_requests()} requests unfinished after {max_steps} steps"
            )
        for _ in range(drain_steps):
            if not self.scheduler.has_work():
                break
            self.step()

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16) -> list[list[int]]:
        """Run ``prompts`` to completion; each request's generated tokens, in order."""
        requests = [self.add_request(prompt, max_tokens) for prompt in prompts]
        self.run_until_done()
        return [list(r.output_token_ids) for r in requests]

    def close(self) -> None:
        for host in (self.scheduler_host, *self.worker_hosts):
            if host is not None:
                host.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
