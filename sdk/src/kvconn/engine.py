"""Alias of :mod:`kvconn.reference`, the reference engine.

The reference engine lives in :mod:`kvconn.reference` (beside ``simulate`` and
``workloads``), so that the package tree does not read as if ``kvconn.engine``
were the engine of the person reading it. This module keeps the name that
DESIGN.md promises: ``from kvconn.engine import Engine`` keeps working. New
code imports from :mod:`kvconn.reference`.
"""

from __future__ import annotations

from .reference import *  # noqa: F403  (exactly kvconn.reference.__all__)
from .reference import __all__  # noqa: F401
