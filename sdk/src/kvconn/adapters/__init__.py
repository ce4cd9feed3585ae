"""Engine adapters: run kvconn plugins inside serving engines.

Each adapter lives in its own subpackage and imports its engine only when it
is used, so ``import kvconn.adapters`` costs nothing and needs no engine.

* :mod:`kvconn.adapters.vllm` — a vLLM ``KVConnectorBase_V1`` that hosts kvconn
  connectors (``kv_connector="KVConnVllmConnector"``,
  ``kv_connector_module_path="kvconn.adapters.vllm"``, or the short name
  ``"kvconn"`` registered by the ``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

__all__: list[str] = []
