"""How vLLM's config names kvconn, and where kvconn's log records go: what every process of a deployment reads.

The names are public, re-exported by :mod:`kvconn_vllm` (read them from there): :data:`SHORT_NAME`,
:data:`CONNECTOR_CLASS`, :data:`EXTRA_CONFIG_KEYS` and :func:`route_logs_to_vllm`. They sit in this module of
their own, below everything else in the package, so that the adapter's modules read them without importing the
package's ``__init__`` (whose lazy attributes import :mod:`.connector`). A new extra-config key goes in
:data:`EXTRA_CONFIG_KEYS`, is read in :mod:`.config`, and is documented in docs/vllm.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

__all__ = ["CONNECTOR_CLASS", "EXTRA_CONFIG_KEYS", "SHORT_NAME", "route_logs_to_vllm"]

#: The name under which :func:`register` makes the connector known to vLLM.
SHORT_NAME = "kvconn"
#: The class vLLM loads (``kv_connector`` when ``kv_connector_module_path`` is this module).
CONNECTOR_CLASS = "KVConnVllmConnector"
#: The keys of ``kv_connector_extra_config`` the adapter reads: the connector(s), their config, the host's options.
EXTRA_CONFIG_KEYS = (
    "kvconn_connector",
    "kvconn_config",
    "kvconn_on_error",
    "kvconn_stall_steps",
    "kvconn_stall_s",
    "kvconn_hook_budget_s",
    "kvconn_max_slow_calls",
)


def route_logs_to_vllm(names: Iterable[str] = ()) -> None:
    """Send the ``kvconn`` logger's records, and those of ``names``, to vLLM's handlers at vLLM's level.

    kvconn and its plugins log under their package names, outside vLLM's
    ``vllm`` logger; with no handler they reach only Python's last-resort
    handler (warnings and up, bare text), so their INFO lines never show under
    vLLM. A logger that already has handlers was configured by the operator
    and is left alone; so is everything when vLLM's logging is not configured.
    """
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or logging.getLogger().handlers:
        return  # vLLM's logging is off, or the process configured logging itself: records reach the root
    for name in ("kvconn", *names):
        target = logging.getLogger(name)
        if target.handlers:
            continue
        for handler in vllm_logger.handlers:
            target.addHandler(handler)
        target.setLevel(vllm_logger.level)
        target.propagate = False
