"""The former name of :mod:`kvconn.testing.raw_hook_connector`, kept importable.

Configs, benchmarks and tests name the connector by path
(``"kvconn.testing.hook_reference:HookReferenceConnector"``); that path still
loads the same class, and :data:`STORE` is the same dict. New code imports
:mod:`kvconn.testing.raw_hook_connector`.
"""

from __future__ import annotations

from .raw_hook_connector import *  # noqa: F403  (exactly raw_hook_connector.__all__)
from .raw_hook_connector import __all__  # noqa: F401
