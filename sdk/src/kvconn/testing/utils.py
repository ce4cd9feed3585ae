"""Helpers to drive a scheduler by hand, as vLLM's connector tests do."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from ..context import ConnectorContext
from ..host import OnError, SchedulerHost
from ..outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from ..reference.request import Request
from ..reference.scheduler import Scheduler
from ..reference.shape import EngineShape

__all__ = [
    "assert_scheduler_empty",
    "create_requests",
    "create_scheduler",
    "make_model_runner_output",
    "run_to_completion",
]


def create_scheduler(
    connector: str | Sequence[str] | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    shape: EngineShape | None = None,
    on_error: OnError = "raise",
    context: ConnectorContext | None = None,
    **shape_options: Any,
) -> Scheduler:
    """A reference scheduler with ``connector`` loaded on its scheduler side.

    ``shape`` and ``shape_options`` (``block_size=``, ``num_blocks=``... any
    :class:`~kvconn.reference.EngineShape` field) size it, as for
    :class:`~kvconn.reference.Engine`. Errors raise by default
    (``on_error="raise"``): in a test, a connector failure should fail the
    test, not be degraded away.
    """
    engine_shape = EngineShape.from_options(shape, **shape_options)
    context = context or ConnectorContext(
        block_size=engine_shape.block_size, kv_cache_groups=engine_shape.kv_cache_groups
    )
    host = SchedulerHost.from_names(connector, config=config, context=context, on_error=on_error) if connector else None
    return Scheduler(engine_shape, host=host, context=context)


def create_requests(
    num_requests: int,
    num_tokens: int = 64,
    *,
    block_size: int = 16,
    max_tokens: int = 16,
    common_prefix_len: int = 0,
    seed: int = 0,
    prefix: str = "r",
    vocab_size: int = 32_000,
) -> list[Request]:
    """Requests ``r0, r1, ...`` of ``num_tokens`` deterministic pseudo-random tokens.

    The first ``common_prefix_len`` tokens are shared by all of them.
    """
    rng = random.Random(seed)
    shared = [rng.randrange(vocab_size) for _ in range(common_prefix_len)]
    return [
        Request(
            f"{prefix}{i}",
            shared + [rng.randrange(vocab_size) for _ in range(num_tokens - common_prefix_len)],
            max_tokens,
            block_size,
        )
        for i in range(num_requests)
    ]


def make_model_runner_output(
    scheduler_output: SchedulerOutput,
    *,
    scheduler: Scheduler | None = None,
    sampled_token: int = 1,
    kv_connector_output: Mapping[str, KVConnectorOutput] | None = None,
) -> ModelRunnerOutput:
    """A model runner's answer without running a model: one ``sampled_token`` per request.

    With ``scheduler`` given, requests still in prefill sample nothing, as a
    real runner does; otherwise every scheduled request gets a token (the
    scheduler ignores tokens of requests whose prompt is not done).
    """
    sampled: dict[str, list[int]] = {}
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id) if scheduler else None
        if request is None or request.num_computed_tokens + n >= request.num_tokens:
            sampled[req_id] = [sampled_token]
    return ModelRunnerOutput(
        req_ids=list(scheduler_output.num_scheduled_tokens),
        sampled_token_ids=sampled,
        kv_connector_output=dict(kv_connector_output or {}),
    )


def run_to_completion(scheduler: Scheduler, *, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Schedule and update with fake outputs until no request is left; the outputs."""
    outputs: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        output = scheduler.schedule()
        outputs.append(output)
        scheduler.update_from_output(output, make_model_runner_output(output, scheduler=scheduler))
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_scheduler_empty(scheduler: Scheduler, *, connectors: bool = True) -> None:
    """Nothing leaked: no request, no held or referenced block, no load in flight.

    With ``connectors`` (the default), connectors that report how many requests
    they track must report none.
    """
    assert not scheduler.requests, f"unfinished requests: {sorted(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.running, "waiting/running queues are not empty"
    assert not scheduler.held_requests, f"blocks still held for connectors: {sorted(scheduler.held_requests)}"
    kv = scheduler.kv_cache_manager
    assert kv.num_requests() == 0, f"{kv.num_requests()} requests still have block tables"
    leaked = [b for b in kv.pool.blocks[1:] if b.ref_cnt != 0]
    assert not leaked, f"blocks with ref counts left: {leaked[:8]}"
    assert kv.num_free_blocks == len(kv.pool.blocks) - 1, "free queue does not hold every block"
    host = scheduler.host
    if host is not None:
        loads = {name: reqs for name, reqs in host.pending_loads().items() if reqs}
        assert not loads, f"loads still in flight: {loads}"
        tracked = {name: n for name, n in host.num_tracked_requests().items() if n} if connectors else {}
        assert not tracked, f"connectors still track requests: {tracked}"
