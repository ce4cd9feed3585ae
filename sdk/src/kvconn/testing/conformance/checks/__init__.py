"""The checks, grouped by what they look at; importing this package registers them.

Only checks live here: the runs they read are :mod:`..scenarios` and :mod:`..runs`,
and ``docs/checks.md`` lists every check by id.
"""

from __future__ import annotations

from . import data, lifecycle, packaging, recovery, store, tables, wire

__all__ = ["data", "lifecycle", "packaging", "recovery", "store", "tables", "wire"]
