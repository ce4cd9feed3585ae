"""Shared fixtures for the cross-package tests."""

from __future__ import annotations

import kvconn


def installed(*names: str) -> list[str]:
    """The given connector names that are installed here (plugins may be absent in a partial checkout)."""
    available = kvconn.available_connectors()
    return [n for n in names if n in available]
