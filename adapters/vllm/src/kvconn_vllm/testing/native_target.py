"""Which vLLM connector ``kvconn validate --vllm-connector NAME`` judges: a name in vLLM's registry, or a class.

Read by the native suite (:mod:`.native`, :mod:`.native_session` and its drivers); the names it accepts are those
docs/vllm.md gives for ``--vllm-connector``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconn.errors import ConnectorLoadError

__all__ = ["NativeTarget", "native_target"]


@dataclass(frozen=True)
class NativeTarget:
    """A vLLM connector to validate: how vLLM's config names it, and its class."""

    name: str
    cls: type
    kv_connector: str
    module_path: str | None


def native_target(name: str) -> NativeTarget:
    """``name`` in vLLM's ``KVConnectorFactory``, or ``"pkg.module:Class"``; :class:`ConnectorLoadError` otherwise."""
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    module_path, _, class_name = name.rpartition(":")
    if module_path:
        try:
            cls = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConnectorLoadError(f"cannot import vLLM connector {name!r}: {type(exc).__name__}: {exc}") from None
    else:
        registry = KVConnectorFactory._registry
        if name not in registry:
            raise ConnectorLoadError(
                f"no connector named {name!r} in this vLLM's KVConnectorFactory "
                f"(known: {', '.join(sorted(registry))}); or give 'package.module:Class'"
            )
        cls = registry[name]()
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ConnectorLoadError(f"{name!r} is {cls!r}, not a KVConnectorBase_V1 subclass")
    return NativeTarget(name, cls, class_name if module_path else name, module_path or None)
