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
        stall_steps, hook_budget_s, max_slow_calls: the hosts' bounds on a stalling
            or slow connector (:class:`~kvconn.ConnectorHost`).
        model, dtype, tp_rank, tp_size: engine facts connectors may namespace keys with
            (the engine is rank ``tp_rank`` of ``tp_size``).
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
        hook_budget_s: float | None = DEFAULT_HOOK_BUDGET_S,
        max_slow_calls: int | None = DEFAULT_MAX_SLOW_CALLS,
        model: str = "kvconn-reference",
        dtype: str = "float16",
        tp_rank: int = 0,
        tp_size: int = 1,
        device: str = "cpu",
        shape: EngineShape | None = None,
        **scheduler_options: Any,
    ) -> None:
        self.shape = shape = EngineShape.from_options(shape, **scheduler_options)
        check_dtype(dtype)  # before any connector is loaded for it
        self.context = ConnectorContext(
            model=model,
            dtype=dtype,
            block_size=shape.block_size,
            kv_cache_groups=shape.kv_cache_groups,
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
        )
        self.scheduler_host: SchedulerHost | None = None
        self.worker_host: WorkerHost | None = None
        if connector:

            def host(cls: type[_Host], role_config: Any) -> _Host:
                return cls.from_names(
                    connector,
                    config=role_config,
                    context=self.context,
                    on_error=on_error,
                    stall_steps=stall_steps,
                    hook_budget_s=hook_budget_s,
                    max_slow_calls=max_slow_calls,
                )

            self.scheduler_host = host(SchedulerHost, config)
            self.worker_host = host(WorkerHost, config if worker_config is None else worker_config)
        self.scheduler = Scheduler(shape, host=self.scheduler_host, context=self.context)
        self.worker = ReferenceWorker(
            self.context,
            num_blocks=shape.num_blocks,
            host=self.worker_host,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            device=device,
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
        hosts = sum(h.degraded_events for h in (self.scheduler_host, self.worker_host) if h)
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
        worker_output = self.worker.execute_model(decode_scheduler_output(wire, self._metadata_types))
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
        for host in (self.scheduler_host, self.worker_host):
            if host is not None:
                host.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
