"""Alias of :mod:`kvconn_vllm`, the vLLM adapter (distribution ``kvconn-vllm``).

Kept so that vLLM configs naming ``kv_connector_module_path="kvconn.adapters.vllm"``
keep working. Like :mod:`kvconn_vllm` itself, importing this module does not
import vLLM; reading ``KVConnVllmConnector`` does.

The SDK does not depend on the adapter, which is built on it: this module finds
the adapter by its name when it is itself imported, as ``load_connector`` finds a
plugin, and says what to install when it is missing. No import statement names
the adapter, so the import-linter contract that the SDK never imports it
(``pyproject.toml``) holds; ``import kvconn`` never reaches this module.
"""

from __future__ import annotations

import importlib
from typing import Any

_ADAPTER = "kvconn_vllm"

try:
    _adapter = importlib.import_module(_ADAPTER)
except ModuleNotFoundError as exc:
    if exc.name != _ADAPTER:
        raise
    from ..install import install_project

    raise ModuleNotFoundError(
        "kvconn.adapters.vllm is the kvconn-vllm distribution: install it to run kvconn connectors inside vLLM: "
        + install_project("adapters/vllm"),
        name=__name__,
    ) from None

__all__ = list(_adapter.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_adapter, name)
