"""The connectors that do nothing: the baselines a connector's cost is measured against, one per layer measured.

* :class:`NoOpConnector`: the kvconn connector that does nothing, the one
  connector the scripts host through kvconn (in vLLM by its path,
  ``"benchlib.connectors:NoOpConnector"``): what hosting kvconn costs with
  the least a connector can do (empty metadata every step, no other hook).
* :func:`bare_connector_class` (``BareConnector``): a vLLM connector that does
  nothing, without kvconn: what vLLM itself spends on any connector. It is
  built on first use, so this module imports without vLLM; an engine loads it
  by module path (``kv_connector_module_path="benchlib.connectors"``).
* :class:`EveryHookConnector`: :class:`NoOpConnector` with every per-step hook
  implemented, each doing nothing, so the host calls every one: what the
  host's dispatch of a whole step costs (``host_dispatch.py``).

``vllm_step_before_after.py`` runs this file against an earlier tree's
``kvconn`` too (its ``from kvconn import`` renamed): it imports nothing else of
kvconn's.
"""

from __future__ import annotations

import functools
from typing import Any

from kvconn import KVConnector, KVConnectorMetadata, KVConnectorRole

__all__ = ["EveryHookConnector", "NoOpConnector", "bare_connector_class"]


class NoOpConnector(KVConnector):
    """Sends empty metadata every step and does nothing else."""

    def build_connector_meta(self, scheduler_output: Any, block_state: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class EveryHookConnector(NoOpConnector):
    """Implements every per-step hook and does nothing in it (built without arguments: it serves either role)."""

    def __init__(self) -> None:
        super().__init__(role=KVConnectorRole.SCHEDULER)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        return None

    def request_finished(self, request: Any, block_ids: Any) -> bool:
        return False

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def start_load_kv(self, metadata: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        return None, None


@functools.cache
def bare_connector_class() -> type:
    """A vLLM connector that does nothing: what vLLM spends on any connector, kvconn or not.

    vLLM calls it like any connector (its per-layer hooks included), so a run with it against one without a
    connector measures vLLM's own cost of having one; a connector's cost over it is what that connector adds.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class BareConnector(KVConnectorBase_V1):  # type: ignore[misc]
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            pass

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            pass

        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            pass

        def wait_for_save(self) -> None:
            pass

    return BareConnector


def __getattr__(name: str) -> Any:
    """``BareConnector``, built on first use: an engine loads it by module path (``kv_connector_module_path=
    "benchlib.connectors"``), and this module must import without vLLM."""
    if name == "BareConnector":
        return bare_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
