"""The save cursor: which of a request's blocks a saving connector still owes its store.

Every connector that saves full blocks keeps, per request, the first block it
has not saved yet. :class:`SaveCursor` is that bookkeeping, once: each step it
drops back to the first block the step (re)computes, so blocks recomputed after
a failed load or a preemption are saved again, and it yields the range each
request may save now; the caller moves it on with :meth:`SaveCursor.advance`
once the blocks are planned (a request whose table is not offered this step
keeps its range for a later step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .filled import FilledBlocks, filled_blocks
from .outputs import SchedulerOutput

__all__ = ["SaveCursor"]


class SaveCursor:
    """Per request, the first block not saved yet (blocks before it are saved, loaded, or not to be saved)."""

    def __init__(self) -> None:
        self._upto: dict[str, int] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._upto

    def __len__(self) -> int:
        return len(self._upto)

    def start(self, req_id: str, upto: int) -> None:
        """Track ``req_id``: its first ``upto`` blocks need no save (a local or loaded hit)."""
        self._upto[req_id] = upto

    def upto(self, req_id: str) -> int | None:
        """The first unsaved block of ``req_id``, ``None`` when it is not tracked."""
        return self._upto.get(req_id)

    def forget(self, req_id: str) -> int | None:
        """Stop tracking ``req_id``; its first unsaved block, ``None`` when it was not tracked."""
        return self._upto.pop(req_id, None)

    def advance(self, req_id: str, upto: int) -> None:
        """Blocks before ``upto`` are planned for saving."""
        if req_id in self._upto:
            self._upto[req_id] = upto

    def due(
        self,
        scheduler_output: SchedulerOutput,
        block_size: int,
        limit: Callable[[FilledBlocks], int] | None = None,
    ) -> Iterator[tuple[str, int, int]]:
        """``(req_id, start, end)``: the blocks each tracked request may save once this step is computed.

        ``limit(filled)`` bounds the end (default ``filled.end``: every block the
        step fills), e.g. to blocks that have a hash. Ranges are yielded only
        where non-empty; the cursor itself moves only with :meth:`advance`.
        """
        for filled in filled_blocks(scheduler_output, block_size):
            upto = self._upto.get(filled.req_id)
            if upto is None:
                continue
            upto = self._upto[filled.req_id] = min(upto, filled.start)
            end = filled.end if limit is None else limit(filled)
            if end > upto:
                yield filled.req_id, upto, end
