"""What vLLM's ``MessageQueue`` would carry of a vLLM connector's metadata: the scheduler-side objects in it.

Metadata crosses to vLLM's workers with ``pickle``; a pickler that watches every object
(:func:`pickled_engine_objects`) reports the block state, the cache manager, a request or the scheduler output
found in it (the seed's serialization concern: KV021 for a vLLM connector), and a metadata that does not pickle.

Read by :mod:`.native_observer` (each step's metadata) and :mod:`.native_session` (KV021's verdict).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["UNPICKLABLE", "MetadataDoesNotPickle", "pickled_engine_objects"]

#: vLLM's lazy block state (0.30+) has ``req_ids``; 0.29's is a dict of the requests that got new blocks.
_ENGINE_OBJECTS = {
    "vllm.v1.core.sched.output.KVConnectorBlockState": "the KVConnectorBlockState (scheduler-local: it holds "
    "the KV cache manager's resolver, or tables of this step only)",
    "vllm.v1.core.sched.output.SchedulerOutput": "the SchedulerOutput",
    "vllm.v1.core.kv_cache_manager.KVCacheManager": "the KVCacheManager",
    "vllm.v1.core.block_pool.BlockPool": "the BlockPool",
    "vllm.v1.request.Request": "a Request",
    "vllm.v1.core.sched.scheduler.Scheduler": "the Scheduler",
}


def pickled_engine_objects(obj: object) -> list[str]:
    """Pickle ``obj`` as vLLM's ``MessageQueue`` does; the scheduler-side objects found on the way.

    A metadata that cannot pickle is reported too (vLLM would fail the step).
    """
    found: list[str] = []
    failure: list[str] = []

    class Watcher(pickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            key = f"{type(value).__module__}.{type(value).__qualname__}"
            if key in _ENGINE_OBJECTS:
                found.append(_ENGINE_OBJECTS[key])
            return NotImplemented

    try:
        Watcher(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:
        failure.append(f"{UNPICKLABLE} ({type(exc).__name__}: {str(exc)[:200]})")
    return sorted(set(found)) + failure


#: How :func:`pickled_engine_objects` says the metadata does not pickle at all (its last entry).
UNPICKLABLE = "it does not pickle"


class MetadataDoesNotPickle(Exception):
    """Raised from the observed ``build_connector_meta``: vLLM could not send this metadata to its workers."""
