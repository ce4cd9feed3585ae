"""The scheduler-local view of block tables offered to connectors each step.

Why this exists: in a paged KV cache a request's table grows only on steps that
need a new block. A connector that saves *full* blocks saves on the step that
*fills* a block, and that step allocates nothing. Offering connectors only the
tables of requests that got new blocks leaves exactly that request out. So the
scheduler offers **every request scheduled this step**, and tables are resolved
lazily, on access, from the live KV cache manager: nothing is copied for
requests the connector never reads, and what it reads is never stale.

The state is bound to the scheduler's cache manager and must never travel to
workers: pickling or msgspec-encoding it raises
:class:`~kvconn.errors.BlockStateSerializationError` telling the author to
resolve what they need into plain data in their metadata.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

from .context import NULL_BLOCK_ID
from .errors import BlockStateSerializationError

__all__ = ["BlockIds", "KVConnectorBlockState", "block_ids_in_range"]

#: One list of block ids per KV-cache group.
BlockIds = tuple[list[int], ...]


def block_ids_in_range(block_ids: BlockIds, start: int, end: int, block_size: int) -> list[int]:
    """Ids of the blocks holding tokens ``[start, end)``, over all groups, null blocks left out."""
    first, last = start // block_size, -(-end // block_size)
    return [b for table in block_ids for b in table[first:last] if b != NULL_BLOCK_ID]


_SERIALIZATION_HELP = (
    "KVConnectorBlockState is scheduler-local and cannot be pickled or encoded: "
    "it holds a resolver bound to the KV cache manager. In build_connector_meta, "
    "call block_state.get_block_ids(req_id) for the requests you act on and put "
    "the resulting lists (plain ints) in your metadata Struct instead."
)


class KVConnectorBlockState:
    """Block tables of the requests offered to connectors this step.

    Args:
        req_ids: the offered requests: every request scheduled this step, plus
            requests with a boundary-state hand-off.
        resolve_block_ids: returns a request's live table; bound to the KV
            cache manager's ``get_block_ids``.
        boundary_state_offloads: per request, exact boundary-state hand-offs
            (``(group, block_index, num_tokens)`` triples) for state-space layers.
    """

    __slots__ = ("boundary_state_offloads", "req_ids", "resolve_block_ids")

    def __init__(
        self,
        req_ids: set[str],
        resolve_block_ids: Callable[[str], BlockIds],
        boundary_state_offloads: dict[str, list[tuple[int, int, int]]] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.resolve_block_ids = resolve_block_ids
        self.boundary_state_offloads = boundary_state_offloads or {}

    def get_block_ids(self, req_id: str) -> BlockIds | None:
        """The live table of ``req_id``, or ``None`` if it is not offered.

        The resolver is called on every call for an offered request (the table
        may have grown since the last call) and never for any other request.
        """
        if req_id not in self.req_ids:
            return None
        return self.resolve_block_ids(req_id)

    @property
    def block_ids(self) -> Mapping[str, BlockIds]:
        """Deprecated eager-dict view, kept for connectors written against it.

        Read-only and lazy: each access resolves through :meth:`get_block_ids`.
        """
        warnings.warn(
            "KVConnectorBlockState.block_ids is deprecated: call "
            "block_state.get_block_ids(req_id), which returns None for requests "
            "that are not offered this step",
            DeprecationWarning,
            stacklevel=2,
        )
        return _LegacyBlockIdsView(self)

    @classmethod
    def from_block_ids(
        cls,
        block_ids: Mapping[str, BlockIds],
        boundary_state_offloads: dict[str, list[tuple[int, int, int]]] | None = None,
    ) -> KVConnectorBlockState:
        """Build a state from an eager ``{req_id: table}`` dict (old constructors)."""
        tables = dict(block_ids)
        return cls(set(tables), tables.__getitem__, boundary_state_offloads)

    def __repr__(self) -> str:
        return f"KVConnectorBlockState(req_ids={sorted(self.req_ids)!r})"

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise self.serialization_error()

    def __copy__(self) -> KVConnectorBlockState:
        return type(self)(self.req_ids, self.resolve_block_ids, self.boundary_state_offloads)

    @staticmethod
    def serialization_error() -> BlockStateSerializationError:
        """The error raised wherever a block state is about to leave the scheduler."""
        return BlockStateSerializationError(_SERIALIZATION_HELP)


class _LegacyBlockIdsView(Mapping[str, BlockIds]):
    """Read-only ``Mapping`` over the offered requests, resolved on access."""

    __slots__ = ("_state",)

    def __init__(self, state: KVConnectorBlockState) -> None:
        self._state = state

    def __getitem__(self, req_id: str) -> BlockIds:
        table = self._state.get_block_ids(req_id)
        if table is None:
            raise KeyError(req_id)
        return table

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._state.req_ids

    def __iter__(self) -> Iterator[str]:
        return iter(self._state.req_ids)

    def __len__(self) -> int:
        return len(self._state.req_ids)
