"""The registry of checks: stable ids, names, the bug each catches, how to fix it.

Ids are stable once assigned (``KV0xx``); a check is never renumbered, a
retired id is never reused. ``docs/checks.md`` documents every one.

The registry is the bottom of the suite: the checks (:mod:`.checks`) register
themselves with :func:`check` when imported, and this package's ``__init__``
imports them, so every check is registered before anyone can read the list
(importing any module of the package runs its ``__init__`` first).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CAPABILITIES", "IMPORTED", "SCHEDULER_CHECK", "Check", "check", "get_check", "list_checks"]

#: What a check may require of a connector (from its class attributes).
#: ``scheduler``/``worker``: serves that role; ``saves``/``loads``: declares it; ``store``: a ``kvconn.store``
#: ``StoreConnector`` (a store of its own).
CAPABILITIES = frozenset({"scheduler", "worker", "saves", "loads", "store"})

#: A check: called with the :class:`~.session.Session` (built on this registry, so typed loosely here).
CheckFunction = Callable[[Any], None]

#: ``after`` of every check that drives the connector: not run when it does not even import (KV002).
IMPORTED = ("KV002",)
#: ``requires`` and ``after`` of a check of the scheduler side: ``@check(id, name, fix=..., **SCHEDULER_CHECK)``.
SCHEDULER_CHECK: dict[str, Any] = {"requires": ("scheduler",), "after": IMPORTED}


@dataclass(frozen=True)
class Check:
    """One conformance check.

    ``doc`` says which real bug it catches (the function's docstring);
    ``fix`` is the generic advice printed with a failure; ``requires`` lists
    the capabilities a connector must declare for the check to apply;
    ``after`` the ids of the checks it depends on (it is not run when one
    of them fails).
    """

    id: str
    name: str
    doc: str
    fix: str
    requires: frozenset[str]
    function: CheckFunction = field(repr=False, compare=False)
    after: tuple[str, ...] = ()


_CHECKS: dict[str, Check] = {}


def check(
    id: str, name: str, *, fix: str, requires: tuple[str, ...] = (), after: tuple[str, ...] = ()
) -> Callable[[CheckFunction], CheckFunction]:
    """Register a check function under a stable ``id`` and ``name``, run after the checks ``after`` names."""
    unknown = set(requires) - CAPABILITIES
    if unknown:
        raise ValueError(f"check {id}: unknown capabilities {sorted(unknown)}")

    def register(function: CheckFunction) -> CheckFunction:
        if id in _CHECKS or any(c.name == name for c in _CHECKS.values()):
            raise ValueError(f"check {id} ({name}) is registered twice")
        doc = inspect.cleandoc(function.__doc__ or "")
        _CHECKS[id] = Check(id, name, doc, fix, frozenset(requires), function, tuple(after))
        return function

    return register


def list_checks() -> list[Check]:
    """Every registered check, in id order."""
    return sorted(_CHECKS.values(), key=lambda c: c.id)


def get_check(check_id: str) -> Check:
    """The check registered as ``check_id`` (``KeyError`` if none)."""
    return _CHECKS[check_id]
