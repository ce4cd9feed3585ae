"""The checks, grouped by what they look at. Importing this package registers them."""

from __future__ import annotations

from . import data, lifecycle, loading, recovery, tables, wire

__all__ = ["data", "lifecycle", "loading", "recovery", "tables", "wire"]
