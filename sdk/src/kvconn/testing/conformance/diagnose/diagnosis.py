"""What a diagnosis says: what a failed run observed, and the fix for that mechanism."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Diagnosis"]


@dataclass(frozen=True)
class Diagnosis:
    """What a failed run observed, and the fix for that mechanism (``None``: the check's own)."""

    observed: str
    fix: str | None = None
