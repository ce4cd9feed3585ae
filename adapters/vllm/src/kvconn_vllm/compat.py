"""What this vLLM offers a connector, probed once at import: both roles of the adapter read it.

* :data:`HAS_WORKER_META`: workers send per-step metadata to the scheduler (``build_connector_worker_meta``);
  without it the scheduler sees only ``get_finished``'s merged sets.
* :data:`KVConnectorTransferResults`: vLLM 0.33's per-request failed loads (``get_transfer_results``); ``None``
  on vLLM 0.29, where failed loads are invalid blocks only, with any number of KV-cache groups.
* :class:`SupportsHMA`: vLLM's marker of connectors that handle several KV-cache groups (a stand-in class on a
  vLLM without it).

A change here changes what both :mod:`.scheduler` and :mod:`.worker` do on an older vLLM: the vLLM 0.29 tier
(``tests/vllm_029``) is what proves it.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

__all__ = ["HAS_WORKER_META", "KVConnectorTransferResults", "SupportsHMA", "fails_per_request"]

#: vLLM versions without worker metadata only see get_finished's merged sets.
HAS_WORKER_META = hasattr(KVConnectorBase_V1, "build_connector_worker_meta")

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.29: failed loads are invalid blocks only, with any number of groups
    KVConnectorTransferResults = None

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # a vLLM that never runs its hybrid KV cache manager with a connector

    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in for vLLM's marker of connectors that handle several KV-cache groups."""


def fails_per_request(num_kv_cache_groups: int) -> bool:
    """Whether failed loads go to vLLM per request (``failed_recving``), not as invalid blocks.

    So with several KV-cache groups under a vLLM that takes ``failed_recving``: block ids are unique only
    within a group, so vLLM 0.33 takes no invalid blocks there (see :mod:`.connector`).
    """
    return KVConnectorTransferResults is not None and num_kv_cache_groups > 1
