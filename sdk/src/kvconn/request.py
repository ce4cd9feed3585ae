"""What a connector may read of a request (engine-neutral).

The reference engine's ``Request`` and the vLLM adapter's request view both
satisfy this protocol, so connector code never depends on one engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["ConnectorRequest"]


@runtime_checkable
class ConnectorRequest(Protocol):
    """A request as a connector sees it on the scheduler side.

    ``block_hashes[i]`` is the chained SHA-256 hash (see :mod:`kvconn.hashing`)
    of full block ``i`` of ``all_token_ids``, at the engine's block size; only
    full blocks have a hash. ``num_computed_tokens`` counts tokens whose KV is
    in the engine's cache (local prefix hits included, external tokens not yet).
    """

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...
