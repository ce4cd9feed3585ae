"""Alias of :mod:`kvconn_vllm`, the vLLM adapter (distribution ``kvconn-vllm``).

Kept so that vLLM configs naming ``kv_connector_module_path="kvconn.adapters.vllm"``
keep working. Like :mod:`kvconn_vllm` itself, importing this module does not
import vLLM; reading ``KVConnVllmConnector`` does.
"""

from __future__ import annotations

from typing import Any

try:
    import kvconn_vllm as _adapter
except ModuleNotFoundError as exc:
    if exc.name != "kvconn_vllm":
        raise
    from kvconn._install import install_project

    raise ModuleNotFoundError(
        "kvconn.adapters.vllm is the kvconn-vllm distribution: install it to run kvconn connectors inside vLLM: "
        + install_project("adapters/vllm"),
        name=__name__,
    ) from None

from kvconn_vllm import CONNECTOR_CLASS, SHORT_NAME, register, route_logs_to_vllm

__all__ = ["CONNECTOR_CLASS", "SHORT_NAME", "register", "route_logs_to_vllm", *_adapter.__all__]


def __getattr__(name: str) -> Any:
    return getattr(_adapter, name)
