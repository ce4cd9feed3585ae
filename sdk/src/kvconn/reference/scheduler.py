"""The reference scheduler: continuous batching over a paged KV cache.

Each step it decides which requests run and how many tokens each computes
(token budget, ``max_num_seqs``, chunked prefill, decode), preempting the
lowest-priority running request when blocks run out. Connectors are consulted
through a :class:`~kvconn.host.ConnectorHost`: for external prefix hits (sync
or async loads), and every step with a :class:`~kvconn.KVConnectorBlockState`
offering **every scheduled request**, so a request on its block-fill step (no
new block) is offered too.

This module decides a step (``add_request``, ``schedule``); what the scheduler
does with the step's results (``update_from_output``: sampled tokens, finished
requests, the connectors' reports, failed-load recovery) is its other half,
:class:`~.scheduler_update.SchedulerUpdate`, which it inherits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import cast

from ..block_state import KVConnectorBlockState
from ..context import ConnectorContext
from ..host import NO_LOAD, LoadPlan, SchedulerHost
from ..outputs import CachedRequestData, NewRequestData, SchedulerOutput
from .block_pool import Block
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus
from .scheduler_update import SchedulerUpdate
from .shape import MAX_NUM_BLOCKS, EngineShape
from .stats import EngineStats

__all__ = ["MAX_NUM_BLOCKS", "Scheduler", "SchedulerConfig"]

#: The scheduler's config is the engine shape (the name stays importable).
SchedulerConfig = EngineShape


class Scheduler(SchedulerUpdate):
    """Schedules requests step by step; see the module docstring.

    Args:
        config: the engine shape (or pass its fields as keyword options); the scheduler
            reads all but the worker's KV shape (``num_kv_heads``, ``head_dim``).
        host: scheduler-side connector host, or ``None`` for no connector.
        context: engine facts; derived from ``config`` when omitted.
    """

    def __init__(
        self,
        config: EngineShape | None = None,
        *,
        host: SchedulerHost | None = None,
        context: ConnectorContext | None = None,
        **options: object,
    ) -> None:
        self.config = config or EngineShape.from_options(**options)
        self.context = context or ConnectorContext(
            block_size=self.config.block_size, kv_cache_groups=self.config.kv_cache_groups
        )
        self.block_size = self.config.block_size
        self.kv_cache_manager = KVCacheManager(
            self.config.kv_cache_groups,
            num_blocks=self.config.num_blocks,
            block_size=self.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        self.host = host
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = EngineStats()
        #: work the connectors report they dropped themselves (their ``degraded_events`` stat)
        self.connector_degraded_events = 0
        self._step = 0
        self._finished_for_workers: set[str] = set()
        self._tokens_on_worker: dict[str, int] = {}
        # sync loads of the step in flight: request -> (first loaded token, tokens loaded)
        self._sync_loads: dict[str, tuple[int, int]] = {}
        # finished requests whose blocks are held, and why ("send", "recv")
        self._held: dict[str, tuple[Request, set[str]]] = {}

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self._held:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens + request.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: {request.num_tokens} prompt tokens + max_tokens "
                f"{request.max_tokens} exceed max_model_len {self.config.max_model_len}"
            )
        needed, usable = self._min_blocks(request), self.config.num_blocks - 1  # block 0 is the null block
        if needed > usable:
            raise ValueError(
                f"request {request.request_id!r} can never fit the KV cache: its {request.num_tokens} prompt tokens "
                f"+ max_tokens {request.max_tokens} need at least {needed} blocks of {self.block_size} tokens, and the "
                f"pool holds {usable} (num_blocks {self.config.num_blocks}, one is the null block); "
                "shorten the request or raise num_blocks"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.stats.prompt_tokens += request.num_prompt_tokens

    def _min_blocks(self, request: Request) -> int:
        """A lower bound of the blocks ``request`` holds at once: every group's table at its last computed token."""
        tokens = request.num_tokens + request.max_tokens - 1  # the last sampled token is never computed
        return sum(
            -(-min(tokens, spec.sliding_window or tokens) // self.block_size) for spec in self.config.kv_cache_groups
        )

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or finish) requests; unknown ids are ignored.

        Aborting a finished request whose free a connector is still delaying
        gives up on that send and frees its blocks (a send that never finishes
        must not leak them). A hold for an async load in flight stays: the
        worker may still be writing into those blocks.
        """
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, status)
            elif req_id in self._held:
                if self.host is not None:
                    self.host.abandon_send(req_id)
                self._release(req_id, "send")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones whose blocks are still held."""
        return bool(self.requests or self._held)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -------------------------------------------------------------------- step

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()

        preemptions_before = self.stats.preemptions
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            self.kv_cache_manager.remove_skipped_blocks(request)
            new_ids = self._allocate_or_preempt(request, num_new)
            if new_ids is None:
                continue
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self._add_cached(cached, request, new_ids if any(new_ids) else None, resumed=False)

        if self.stats.preemptions == preemptions_before:  # after a preemption, no room for waiting ones
            self._schedule_waiting(budget, num_scheduled, new_reqs, cached)

        output = SchedulerOutput(
            step=self._step,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_for_workers,
        )
        self._finished_for_workers = set()
        for req_id in num_scheduled:
            self._tokens_on_worker[req_id] = self.requests[req_id].num_tokens
        if self.host is not None:
            # Every scheduled request is offered, with or without new blocks.
            state = KVConnectorBlockState(set(num_scheduled), self.kv_cache_manager.get_block_ids)
            output.kv_connector_metadata = self.host.build_connector_meta(output, state)
        self._step += 1
        return output

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[list[int], ...] | None:
        """Grow the table, preempting from the back of ``running`` until it fits.

        Returns ``None`` when ``request`` itself had to be preempted.
        """
        while True:
            new_ids = self.kv_cache_manager.allocate_slots(
                request, request.num_computed_tokens + num_new, num_computed_tokens=request.num_computed_tokens
            )
            if new_ids is not None:
                return new_ids
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self._drop_blocks(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _drop_blocks(self, request: Request) -> None:
        """Free all of ``request``'s blocks: it will recompute (or reload) from scratch."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1

    def _schedule_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
    ) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)
                continue
            scheduled = self._schedule_one_waiting(request, budget)
            if scheduled is None and not self.running and self._free_loaded_waiting():
                scheduled = self._schedule_one_waiting(request, budget)
            if scheduled is None:
                self.waiting.appendleft(request)
                break
            if scheduled == 0:
                skipped.append(request)
                continue
            budget -= scheduled
            num_scheduled[request.request_id] = scheduled
            resumed = request.request_id in self._tokens_on_worker
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            table = self.kv_cache_manager.get_block_ids(request.request_id)
            if resumed:
                self._add_cached(cached, request, table, resumed=True)
            else:
                new_reqs.append(
                    NewRequestData(
                        request.request_id,
                        request.all_token_ids[:],
                        table,
                        request.num_computed_tokens,
                        request.adapter,
                    )
                )
        self.waiting.extendleft(reversed(skipped))

    def _free_loaded_waiting(self) -> bool:
        """Preempt waiting requests that hold blocks from a finished async load.

        With nothing running, they may hold the whole pool while none of them
        fits: without this the engine would stop making progress.
        """
        loaded = [
            r
            for r in self.waiting
            if r.status is RequestStatus.WAITING and self.kv_cache_manager.has_request(r.request_id)
        ]
        for request in loaded:
            self._drop_blocks(request)
        return bool(loaded)

    def _schedule_one_waiting(self, request: Request, budget: int) -> int | None:
        """Allocate for a waiting request; tokens to compute, 0 to skip it, None if no room."""
        kv = self.kv_cache_manager
        if kv.has_request(request.request_id):  # back from an async load: blocks are in place
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            ids = kv.allocate_slots(
                request, request.num_computed_tokens + num_new, num_computed_tokens=request.num_computed_tokens
            )
            return None if ids is None else num_new

        computed_blocks, num_local = kv.get_computed_blocks(request)
        plan = self.host.get_num_new_matched_tokens(request, num_local) if self.host else NO_LOAD
        if plan.num_tokens is None:
            return 0  # the connector asks to be asked again
        # Load whole blocks only, and always leave the last token to compute.
        max_external = ((request.num_tokens - 1) // self.block_size) * self.block_size - num_local
        plan = LoadPlan(max(0, min(plan.num_tokens, max_external)), plan.load_async, plan.connector)
        allocated = self._allocate_waiting(request, computed_blocks, num_local, plan, budget)
        if allocated is None:
            return None
        num_new = allocated
        loading = self.host is not None and self.host.update_state_after_alloc(
            request, kv.get_block_ids(request.request_id), plan
        )
        if plan.num_tokens and not loading:  # the loader failed: compute instead of loading
            kv.free(request)
            plan = NO_LOAD
            allocated = self._allocate_waiting(request, computed_blocks, num_local, plan, budget)
            if allocated is None:
                return None
            num_new = allocated
        num_external = plan.num_tokens or 0
        self.stats.prompt_tokens_cached += min(num_local, request.num_prompt_tokens)
        if loading and plan.load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_external_tokens = num_external
            return 0
        request.num_computed_tokens = num_local + num_external
        if num_external:
            self._sync_loads[request.request_id] = (num_local, num_external)
        return num_new

    def _allocate_waiting(
        self, request: Request, computed_blocks: list[list[Block]], num_local: int, plan: LoadPlan, budget: int
    ) -> int | None:
        """Allocate the table of a request about to load and/or compute; tokens to compute."""
        num_external = plan.num_tokens or 0
        num_new = 0 if plan.load_async and num_external else min(request.num_tokens - num_local - num_external, budget)
        ids = self.kv_cache_manager.allocate_slots(
            request,
            num_local + num_external + num_new,
            num_computed_tokens=num_local + num_external,
            computed_blocks=computed_blocks,
        )
        if ids is None:
            return None
        request.num_computed_tokens = num_local
        return num_new

    def _add_cached(
        self, cached: CachedRequestData, request: Request, block_ids: tuple[list[int], ...] | None, *, resumed: bool
    ) -> None:
        # The engine fills the fields' defaults, lists; plugins see them as read-only sequences.
        cast("list[str]", cached.req_ids).append(request.request_id)
        cast("list[bool]", cached.resumed_from_preemption).append(resumed)
        on_worker = self._tokens_on_worker.get(request.request_id, 0)
        cast("list[list[int]]", cached.new_token_ids).append([] if resumed else request.all_token_ids[on_worker:])
        cast("list[tuple[list[int], ...] | None]", cached.new_block_ids).append(block_ids)
        cast("list[int]", cached.num_computed_tokens).append(request.num_computed_tokens)
        if resumed:
            cached.all_token_ids[request.request_id] = request.all_token_ids[:]
