"""The reference scheduler's second half: applying what a step's workers reported.

:class:`~.scheduler.Scheduler` decides a step (which requests run, what each
computes, which blocks each gets); this is what it does with the step's
results, in ``update_from_output``: advance each request, append its sampled
token, finish it, and apply the connectors' reports: loads that landed, sends
that let a delayed free go, and loads that failed, which roll requests back to
their first failed block (vLLM's recompute policy). The scheduler inherits it;
the fields below are the scheduler's, shared by both halves.
"""

from __future__ import annotations

import logging
from collections import deque

from ..host import SchedulerHost
from ..outputs import ModelRunnerOutput, SchedulerOutput
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus
from .stats import EngineStats

__all__ = ["SchedulerUpdate"]

logger = logging.getLogger("kvconn.reference")


class SchedulerUpdate:
    """``update_from_output`` and what finishing a request holds or frees; see the module docstring."""

    # The scheduler's state (set by Scheduler.__init__, which says what each holds).
    block_size: int
    kv_cache_manager: KVCacheManager
    host: SchedulerHost | None
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    stats: EngineStats
    connector_degraded_events: int
    _finished_for_workers: set[str]
    _tokens_on_worker: dict[str, int]
    _sync_loads: dict[str, tuple[int, int]]
    _held: dict[str, tuple[Request, set[str]]]

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> None:
        """Apply a step's results: advance, sample, finish, free, recover from failed loads."""
        update = self.host.update_connector_output(model_runner_output.kv_connector_output) if self.host else None
        discarded: set[str] = set()
        if update is not None:
            for key in ("blocks_saved", "blocks_loaded", "bytes_saved", "bytes_loaded"):
                setattr(self.stats, key, getattr(self.stats, key) + int(update.stats.get(key, 0)))
            self.connector_degraded_events += int(update.stats.get("degraded_events", 0))
            if update.invalid_block_ids:
                discarded = self._recover_invalid_blocks(update.invalid_block_ids)
        for req_id, (start, loaded) in self._sync_loads.items():  # what survived recovery counts as loaded
            if req_id in self.requests:
                self._count_loaded(self.requests[req_id], start, loaded)
        self._sync_loads.clear()

        kv = self.kv_cache_manager
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING or req_id in discarded:
                continue
            start = request.num_computed_tokens
            self.stats.prompt_tokens_computed += max(0, min(start + num_tokens, request.num_prompt_tokens) - start)
            request.num_computed_tokens = start + num_tokens
            kv.cache_blocks(request, request.num_computed_tokens)
            sampled = model_runner_output.sampled_token_ids.get(req_id)
            if sampled and request.num_computed_tokens >= request.num_tokens:
                request.append_output_token(sampled[0])
                self.stats.generated_tokens += 1
                if len(request.output_token_ids) >= request.max_tokens:
                    self._finish(request, RequestStatus.FINISHED_LENGTH)

        if update is not None:
            for req_id in update.finished_recving:
                self._remote_load_done(req_id)
            for req_id in update.finished_sending:
                self._release(req_id, "send")
        self.stats.steps += 1

    def _recover_invalid_blocks(self, invalid: set[int]) -> set[str]:
        """Roll requests back to their first failed block; returns those whose step is void.

        Follows vLLM 0.33's recompute policy (``kv_load_failure_policy="recompute"``):
        ``Scheduler._handle_invalid_blocks`` and ``_update_requests_with_invalid_blocks``
        truncate a running request's computed tokens to its first invalid block and
        skip its step's output, and cut an async load (``WAITING_FOR_REMOTE_KVS``)
        at that block; when that load is reported, ``_update_waiting_for_remote_kv``
        keeps the valid prefix, or, with none, frees the blocks so that the request
        is scheduled afresh and the connector asked again (:meth:`_remote_load_done`).
        Unlike vLLM, blocks after the first failed one leave the prefix cache at once
        (vLLM's recompute policy leaves them cached), and several KV-cache groups are
        handled (vLLM 0.33 raises on invalid blocks with more than one group).
        """
        self.stats.failed_load_blocks += len(invalid)
        discarded: set[str] = set()
        for request in self.requests.values():
            table = self.kv_cache_manager.get_block_ids(request.request_id)
            first = min((i for group in table for i, b in enumerate(group) if b in invalid), default=None)
            if first is None:
                continue
            valid_tokens = first * self.block_size
            self.kv_cache_manager.invalidate_from(request, first)
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.num_external_tokens = max(
                    0, min(request.num_external_tokens, valid_tokens - request.num_computed_tokens)
                )
            elif request.status is RequestStatus.RUNNING:
                logger.info("request %s: load failed from block %d; recomputing", request.request_id, first)
                request.num_computed_tokens = min(request.num_computed_tokens, valid_tokens)
                discarded.add(request.request_id)
                if request.request_id in self._sync_loads:
                    start, loaded = self._sync_loads[request.request_id]
                    self._sync_loads[request.request_id] = (start, max(0, min(loaded, valid_tokens - start)))
        return discarded

    def _remote_load_done(self, req_id: str) -> None:
        request = self.requests.get(req_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._release(req_id, "recv")
            return
        self._count_loaded(request, request.num_computed_tokens, request.num_external_tokens)
        request.num_computed_tokens += request.num_external_tokens
        request.num_external_tokens = 0
        request.status = RequestStatus.WAITING
        if not request.num_computed_tokens:
            # A failed load left no valid prefix: as vLLM 0.33's Scheduler._update_waiting_for_remote_kv, free
            # the blocks; the request is scheduled afresh and the connector is asked again.
            logger.info("request %s: its async load failed from the first block; asking again", req_id)
            self.kv_cache_manager.free(request)
            return
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)

    def _count_loaded(self, request: Request, start: int, num_tokens: int) -> None:
        """Count the prompt positions among ``num_tokens`` loaded from ``start``."""
        self.stats.prompt_tokens_loaded += max(0, min(start + num_tokens, request.num_prompt_tokens) - start)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        was_loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        self.stats.requests_finished += 1
        self._tokens_on_worker.pop(request.request_id, None)
        # Every finished request, scheduled or not, as vLLM's Scheduler._free_request: a worker side that reports
        # a delayed free when it hears a request ended hears of one aborted while it waited too.
        self._finished_for_workers.add(request.request_id)
        table = self.kv_cache_manager.get_block_ids(request.request_id)
        delay = self.host.request_finished(request, table) if self.host else False
        reasons = {"send"} if delay else set()
        if was_loading:
            reasons.add("recv")  # the worker may still be writing into its blocks
        if reasons:
            self._held[request.request_id] = (request, reasons)
        else:
            self.kv_cache_manager.free(request)

    def _release(self, req_id: str, reason: str) -> None:
        held = self._held.get(req_id)
        if held is None:
            return
        request, reasons = held
        reasons.discard(reason)
        if not reasons:
            del self._held[req_id]
            self.kv_cache_manager.free(request)

    @property
    def held_requests(self) -> set[str]:
        """Finished requests whose blocks are still held for a connector."""
        return set(self._held)
