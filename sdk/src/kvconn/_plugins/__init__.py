"""kvconn's plugin machinery (private): how connectors are found, loaded and called.

* :mod:`.markers` — the pluggy project name and the ``hookspec`` / ``hookimpl``
  markers (re-exported as :data:`kvconn.hookspec` / :data:`kvconn.hookimpl`).
* :mod:`.manager` — the pluggy ``PluginManager`` subclass that registers a
  connector's hook methods without markers.
* :mod:`.registry` — discovery through the ``kvconn.connectors`` entry points,
  ``load_connector``, config validation and the API-version check.
* :mod:`.sides` — a connector's per-role side objects: importing a declared
  path, building the side, refusing hooks written where their role is never
  served. Below :mod:`kvconn.connector`, which builds a side with it; the
  manager (above it) registers the side and refuses a host the wrong one.

Read by: :mod:`kvconn.connector` (sides), :mod:`kvconn.host` (the manager and
registry), :mod:`kvconn.introspection` and the packaging checks of the
conformance suite. A change here updates the ``kvconn`` layers contract in
``pyproject.toml`` (these modules sit in four layers: markers, sides, manager,
registry) and the private-module list that contract's neighbour forbids to
other packages (``tests/test_layering.py`` checks it).

Authors and engines use the names :mod:`kvconn` re-exports, never these
modules: their layout may change between releases.
"""

from __future__ import annotations

__all__: list[str] = []
