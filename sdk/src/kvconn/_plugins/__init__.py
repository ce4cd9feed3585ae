"""kvconn's plugin machinery (private): how connectors are found, loaded and called.

* :mod:`.markers` — the pluggy project name and the ``hookspec`` / ``hookimpl``
  markers (re-exported as :data:`kvconn.hookspec` / :data:`kvconn.hookimpl`).
* :mod:`.manager` — the pluggy ``PluginManager`` subclass that registers a
  connector's hook methods without markers.
* :mod:`.registry` — discovery through the ``kvconn.connectors`` entry points,
  ``load_connector``, config validation and the API-version check.

Authors and engines use the names :mod:`kvconn` re-exports, never these
modules: their layout may change between releases.
"""

from __future__ import annotations

__all__: list[str] = []
