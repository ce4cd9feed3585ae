"""What a connector declares, read as the SDK reads it: the inspection API for engines and tools.

The SDK's plugin machinery (:mod:`kvconn._plugins`, private: its layout may
change) answers these questions to find, load and call a connector. An engine
adapter or a tool that needs the same answer asks here, so that it agrees with
the host that will run the connector. Only :func:`build_config` runs the
connector's own code (its ``Config``); nothing here builds a connector or calls
a hook, and a side declared as a path is not imported.

* :data:`ENTRY_POINT_GROUP` — the entry-point group connectors declare
  themselves in (``kvconn.connectors``). A tool that finds a distribution built
  on kvconn without one (``kvconn list`` warns about the forgotten entry point)
  prints the ``pyproject.toml`` lines to add under this group.
* :func:`connector_roles` — the roles a connector class serves. An engine sends
  the scheduler's metadata only to connectors that run on its workers (the vLLM
  adapter); ``kvconn list`` shows the roles.
* :func:`declared_side` — what a connector class declares as its side for a
  role (a :class:`~kvconn.KVConnectorRole` value): a class, a lazy ``"package.module:Class"`` path (left unimported), or
  ``None`` when the connector is its own hooks. ``kvconn info`` shows each
  role's side without importing a worker's torch.
* :func:`implemented_hooks` — the hooks a connector class or a side class
  implements, without an instance. ``kvconn info`` lists them.
* :func:`hook_object` — the object whose methods are a built connector's hooks:
  its side for its role, else the connector itself. An engine that asks whether
  a connector implements a hook (the vLLM adapter: does it build metadata?)
  asks this object, never the connector, whose methods are not its hooks when it
  declares sides.
* :func:`build_config` — a config (a mapping) validated into the connector's
  ``Config`` as :func:`kvconn.load_connector` validates it, with errors naming
  the field. A tool checks an operator's config against every connector before
  a run starts (``kvconn validate --config``).
"""

from __future__ import annotations

from ._plugins.manager import hook_object, implemented_hooks
from ._plugins.registry import ENTRY_POINT_GROUP, build_config, connector_roles
from ._plugins.sides import declared_side

__all__ = [
    "ENTRY_POINT_GROUP",
    "build_config",
    "connector_roles",
    "declared_side",
    "hook_object",
    "implemented_hooks",
]
