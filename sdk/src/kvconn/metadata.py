"""Per-step metadata, the only thing a connector sends to its workers.

Metadata is a msgspec ``Struct`` of plain data (ints, strings, lists, nested
Structs). It crosses a process boundary every step, so it must not hold
callables, tensors or anything reaching the scheduler: the wire encoder
rejects those with an error naming the connector. Unknown fields are refused
on decode, so metadata meant for another connector is never mistaken for
this connector's (empty) metadata.
"""

from __future__ import annotations

import msgspec

__all__ = ["KVConnectorMetadata"]


class KVConnectorMetadata(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base class of connector metadata; subclass it and add plain-data fields."""
