"""The hooks a connector implements (pluggy project ``kvconn``).

Names and arguments follow vLLM's KV-connector v1 API. An implementation may
take any subset of a hook's arguments, in any order (pluggy matches them by
name). A connector instance serves one role: the scheduler calls the
scheduler-side hooks on its instance, each worker calls the worker-side hooks
on its own. Methods of :class:`kvconn.KVConnector` subclasses, and of the
sides they declare per role (:attr:`kvconn.KVConnector.scheduler_side`), named like these hooks are
implementations without a decorator; other classes mark them with
``@kvconn.hookimpl``.

Hooks are called by :class:`kvconn.ConnectorHost`, one connector at a time and
in the order the connectors were given, so that one connector's failure never
stops another (see its error policy).

The worker step contract
------------------------
Every engine kvconn runs in (the reference engine, vLLM through
:mod:`kvconn_vllm`) calls a worker-side connector in this order
within one step, whatever order the engine calls its own methods in:

1. ``start_load_kv(metadata)``: exactly once, first, before any layer of the
   step, on every step the scheduler sent this connector metadata for (also
   when it loads nothing and when no token is computed);
2. per layer the model computes this step, in model order:
   ``wait_for_layer_load(layer)``, then the layer writes its KV for the step,
   then ``save_kv_layer(layer, kv_layer, metadata)``; a step without a forward
   has no layer calls;
3. ``wait_for_save()``: exactly once, after the last layer;
4. ``get_finished(finished_req_ids)``, then ``get_block_ids_with_load_errors()``,
   then ``get_kv_connector_stats()``: once each, ending the step.

So a save set up in ``start_load_kv`` is in place before the first
``save_kv_layer``, and a block read by ``save_kv_layer`` still holds this
step's KV until ``wait_for_save`` returns (the engine may overwrite a freed
block right after). :class:`kvconn.testing.step_contract.StepContractConnector`
checks the order in any engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ._plugins.markers import hookspec

if TYPE_CHECKING:
    from .block_state import BlockIds, KVConnectorBlockState
    from .metadata import KVConnectorMetadata
    from .outputs import KVConnectorOutput, SchedulerOutput
    from .request import ConnectorRequest

__all__ = [
    "HOOKS",
    "HOOK_NAMES",
    "ROLES",
    "ROLE_HOOKS",
    "SCHEDULER_HOOKS",
    "WORKER_HOOKS",
    "HookTag",
    "KVConnectorSpec",
]

#: The role values, as :class:`kvconn.KVConnectorRole` spells them (that enum is built on this module).
ROLES = ("scheduler", "worker")


@dataclass(frozen=True)
class HookTag:
    """What the SDK reads off a hook spec besides its arguments.

    ``roles``: the roles it is called in (the plugin manager, the side checks
    and each role's host take their hook sets from here); ``host_call``: the
    :class:`~kvconn.ConnectorHost` method that calls it (monitors watch host
    calls, see :data:`kvconn.host.MONITORED_CALLS`); ``per_step``: whether
    that call is part of an engine's step.
    """

    roles: frozenset[str]
    host_call: str
    per_step: bool


_Spec = TypeVar("_Spec", bound=Callable[..., Any])


def _hook(*roles: str, host_call: str | None = None, per_step: bool = True) -> Callable[[_Spec], _Spec]:
    """``@hookspec``, tagging the spec with its :class:`HookTag` (``host_call`` defaults to the hook's name)."""

    def tag(spec: _Spec) -> _Spec:
        spec.kvconn_tag = HookTag(frozenset(roles), host_call or spec.__name__, per_step)  # type: ignore[attr-defined]
        return hookspec(spec)

    return tag


class KVConnectorSpec:
    """Hook specifications; ``self`` is the connector instance."""

    # ---------------------------------------------------------------- scheduler

    @_hook("scheduler")
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool] | None:
        """How many tokens beyond ``num_computed_tokens`` this connector can load.

        Called for a waiting request before blocks are allocated, possibly on
        several steps for the same request (when the allocation fails, or when
        it returned ``None``). It must have **no side effects**: record nothing
        that a later call would contradict; commit in ``update_state_after_alloc``.

        Returns ``(num_tokens, load_async)``: ``num_tokens`` is ``0`` for no hit,
        or ``None`` for "not known yet, ask again next step"; ``load_async``
        says the load finishes in a later step (reported through
        ``get_finished``). Return only whole blocks. ``None`` means ``(0, False)``.
        """

    @_hook("scheduler")
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; commit the load planned above.

        ``block_ids`` is the request's whole table after allocation. The
        ``num_external_tokens`` to load start at ``request.num_computed_tokens``.
        It is ``0`` for every connector except the one chosen to load (the first
        that reported a hit). Do not keep ``block_ids`` beyond the step: tables
        change (preemption replaces them); read them again from the block state.

        Send the committed load in the next ``build_connector_meta``, whether or
        not ``request`` is scheduled in that step: an engine may hold it back
        until the load is reported (vLLM with several KV-cache groups sees every
        load as async, to recover a failed one per request), and then calls this
        again for it with ``num_external_tokens`` ``0``.
        """

    @_hook("scheduler", host_call="build_connector_meta")
    def on_block_state(self, block_state: KVConnectorBlockState, scheduler_output: SchedulerOutput) -> None:
        """Each step, before ``build_connector_meta``: the tables offered this step.

        ``block_state`` offers every request scheduled this step, *including*
        ones that got no new block (the block-fill step). It is scheduler-local:
        read tables with ``get_block_ids`` now; do not keep the state.
        """

    @_hook("scheduler")
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> KVConnectorMetadata:
        """Build this step's metadata for the worker side.

        Called once per step, after ``on_block_state``. Resolve the tables you
        act on (``block_state.get_block_ids(req_id)``, ``None`` for requests not
        offered) into plain lists in the returned Struct: metadata goes over the
        wire and must hold no callable, tensor or block state. Return an
        instance of the connector's ``Metadata`` class.
        """

    @_hook("scheduler")
    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> bool | tuple[bool, Any] | None:
        """``request`` finished or was aborted; its blocks are about to be freed.

        Called exactly once per request that was added. Return ``True`` to delay
        freeing ``block_ids`` until this connector's worker reports the request
        in ``finished_sending`` (a save still reading them). A vLLM-style
        ``(delay, kv_transfer_params)`` tuple is accepted too.
        """

    @_hook("scheduler")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """This connector's worker-side report for the step that just ran."""

    # ------------------------------------------------------------------- worker

    @_hook("worker", per_step=False)
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Once, before the first step: the KV-cache tensor of each layer.

        In the reference engine each is ``[num_blocks, 2, block_size,
        num_kv_heads, head_dim]`` (layout ``NHD``). Allocate buffers here, not
        per step.
        """

    @_hook("worker")
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start loading this step's blocks into the KV caches (before compute)."""

    @_hook("worker")
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s loads have landed (before it is computed)."""

    @_hook("worker")
    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: KVConnectorMetadata) -> None:
        """``layer_name`` was computed this step; start saving what must be saved.

        ``kv_layer`` is that layer's KV-cache tensor. Do not block: copies may
        run in the background until ``wait_for_save`` or ``get_finished``.
        """

    @_hook("worker")
    def wait_for_save(self) -> None:
        """End of the step: saves that must not outlive it are complete."""

    @_hook("worker")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None] | None:
        """Requests whose async transfers completed since the last call.

        Returns ``(finished_sending, finished_recving)``. Report a request at
        most once in each. ``finished_req_ids`` are requests the scheduler
        finished since the last step.
        """

    @_hook("worker", host_call="get_finished")
    def get_block_ids_with_load_errors(self) -> set[int] | None:
        """Blocks whose load failed or was partial since the last call.

        The engine recomputes them (and every later block of the same
        request): report rather than leave wrong KV in place.
        """

    @_hook("worker", host_call="get_finished")
    def get_kv_connector_stats(self) -> dict[str, float] | None:
        """Counters since the last call (``blocks_saved``, ``bytes_loaded``, ...).

        Engines sum counters over steps and workers; ``degraded_events`` counts work
        the connector dropped itself (a store error degraded to "no save" or
        "recompute") and is added to the engine's degraded events. A key starting with ``_``
        is private: it reaches this connector's scheduler side (in
        ``update_connector_output``) but is neither summed nor shown, so use it
        for gauges and state such as a pool size or a sequence number.
        """

    # -------------------------------------------------------------------- both

    @_hook("scheduler", "worker", host_call="num_tracked_requests", per_step=False)
    def get_num_tracked_requests(self) -> int | None:
        """How many requests this instance still holds state for.

        Used by conformance checks: once every request has ended it must be 0.
        """

    @_hook("scheduler", "worker", per_step=False)
    def shutdown(self) -> None:
        """Release resources (connections, buffers). Called once, last."""


#: Every hook, in the order of the specs above, with its tag: the one list the SDK's hook sets derive from.
HOOKS: dict[str, HookTag] = {
    name: spec.kvconn_tag
    for name, spec in vars(KVConnectorSpec).items()
    if isinstance(getattr(spec, "kvconn_tag", None), HookTag)
}
HOOK_NAMES = frozenset(HOOKS)
#: The hooks called in each role, by role value (``"scheduler"``, ``"worker"``).
ROLE_HOOKS = {role: frozenset(name for name, tag in HOOKS.items() if role in tag.roles) for role in ROLES}
SCHEDULER_HOOKS = ROLE_HOOKS["scheduler"]
WORKER_HOOKS = ROLE_HOOKS["worker"]
