"""What the conformance drivers over vLLM's scheduler share: requests in, tables and emptiness out.

:class:`~.driver.VllmDriver` (kvconn plugins) and :class:`~.native.NativeDriver`
(vLLM's own connectors) differ in what they observe; these are the
:class:`~kvconn.testing.conformance.SchedulerDriver` methods that only talk to
vLLM's ``Scheduler``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

from kvconn.block_state import BlockIds
from kvconn.testing.conformance.driver import NO_KEYS, RequestKeys

__all__ = ["Built", "VllmSchedulerMethods"]

#: What a driver's observed ``build_connector_meta`` saw: the step's output, the connector's metadata (as
#: built), the requests the block state offered, and those it resolved.
Built = tuple[Any, Any, frozenset[str], list[str]]


class VllmSchedulerMethods:
    """Driver methods over ``self.scheduler`` (vLLM's), sized ``block_size`` x ``num_blocks``."""

    scheduler: Any
    block_size: int
    num_blocks: int
    _finished_calls: Counter[str]
    loop: Any  # the harness's VllmLoop
    #: what the observed build_connector_meta saw this step: (output, metadata, offered, resolved)
    _built: Built | None
    _withhold: frozenset[str]

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int, keys: RequestKeys = NO_KEYS) -> None:
        from .harness import make_request

        self.scheduler.add_request(make_request(req_id, prompt, max_tokens, self.block_size, **keys._asdict()))

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def _tables(self) -> dict[str, BlockIds]:
        """The live table of every request holding blocks."""
        manager = self.scheduler.kv_cache_manager
        tables = {r: manager.get_block_ids(r) for r in self.scheduler.requests}
        return {r: tuple(list(t) for t in table) for r, table in tables.items() if any(table)}

    def _play_step(
        self, withhold: Collection[str]
    ) -> tuple[tuple[Any, Any, frozenset[str], list[str]], set[str], dict[str, BlockIds]]:
        """Run one step, withholding ``withhold`` from the block state: what the connector's build saw, the
        requests preempted while scheduling, and every live table at build time."""
        self._withhold, self._built = frozenset(withhold), None
        preemptions = self._preemptions()
        tables: dict[str, BlockIds] = {}
        self.loop.step(inspect=lambda _: tables.update(self._tables()))
        assert self._built is not None, "vLLM did not call build_connector_meta"
        return self._built, self._preempted(preemptions), tables

    def _preemptions(self) -> dict[str, int]:
        return {r: req.num_preemptions for r, req in self.scheduler.requests.items()}

    def _preempted(self, before: dict[str, int]) -> set[str]:
        """The requests preempted since ``before`` (:meth:`_preemptions`)."""
        requests = self.scheduler.requests
        return {r for r, n in before.items() if r in requests and requests[r].num_preemptions > n}

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def finished_calls(self) -> dict[str, int]:
        return dict(self._finished_calls)

    def assert_empty(self) -> None:
        scheduler = self.scheduler
        assert not scheduler.requests, f"requests still held by vLLM: {sorted(scheduler.requests)}"
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == self.num_blocks - 1, f"{self.num_blocks - 1 - free} blocks not returned to vLLM's pool"
