"""Mooncake store return codes, shared by both backends.

Batch calls return one int per key: ``0`` (put) or the number of bytes read
(get) on success, ``1``/``0`` for exists/missing (``batch_is_exist``), and a
negative code on failure. The embedded store returns the same codes as the
real one, so the connector handles a single vocabulary.
"""

from __future__ import annotations

__all__ = [
    "INVALID_PARAMS",
    "INTERNAL_ERROR",
    "LEASE_EXPIRED",
    "NOT_FOUND",
    "OK",
    "RPC_FAIL",
    "STORE_FULL",
    "TRANSFER_FAIL",
    "code_name",
]

OK = 0
INTERNAL_ERROR = -1
STORE_FULL = -200  # NO_AVAILABLE_HANDLE: no segment has room for the value
INVALID_PARAMS = -600  # an empty value, a destination smaller than the value, a key repeated in a batch
NOT_FOUND = -704  # OBJECT_NOT_FOUND
LEASE_EXPIRED = -707  # the lease ran out before the transfer completed: contents undefined
TRANSFER_FAIL = -800  # a transfer failed; a multi-buffer get into buffers larger than the value also says this
RPC_FAIL = -900  # the master is unreachable (or the client is disconnected)

_NAMES = {
    INTERNAL_ERROR: "internal_error",
    STORE_FULL: "store_full",
    INVALID_PARAMS: "invalid_params",
    NOT_FOUND: "not_found",
    LEASE_EXPIRED: "lease_expired",
    TRANSFER_FAIL: "transfer_fail",
    RPC_FAIL: "rpc_fail",
}


def code_name(code: int) -> str:
    """A short stat-friendly name for a negative code (``"error_-800"`` when unknown)."""
    return _NAMES.get(code, f"error_{code}")
