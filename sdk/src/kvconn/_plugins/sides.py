"""Role objects: a connector's scheduler side and worker side.

A connector's two roles share nothing but their config and the metadata the
scheduler sends the workers, so a connector may put each role's hooks on its
own class and declare them on the connector class::

    class OffloadConnector(kvconn.KVConnector):
        scheduler_side = OffloadScheduler                  # a class ...
        worker_side = "kvconn_offload.worker:OffloadWorker"  # ... or a lazy "module:Class" path

The SDK builds the side for the instance's role as ``Side(config, context)``
(the validated ``Config`` instance and the engine's
:class:`~kvconn.ConnectorContext`), keeps it as ``connector.side``, and
registers *the side* with pluggy: its methods named after hooks are the hook
implementations, with no marker and no forwarding method. A path is imported
only when its role is built, so the scheduler process, ``kvconn list`` and
``kvconn info`` never import what only the worker needs (torch, say).

Each role's hooks live on one object: the declared side, else the connector
itself. A hook of the other role on that object is never called in that role
and is rejected (see :func:`check_roles`); ``get_num_tracked_requests``
and ``shutdown`` belong to both roles.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from ..errors import ConnectorLoadError
from ..hookspecs import HOOK_NAMES, ROLE_HOOKS
from .markers import implements

__all__ = [
    "build_side",
    "check_roles",
    "declared_side",
    "import_target",
    "refuse_sides_off_kvconnector",
    "side_class",
    "uncalled_hooks",
]


def import_target(target: str, *, source: str, path_hint: str = "") -> object:
    """The object a ``"package.module:Name"`` path names; every failure is a :class:`ConnectorLoadError`.

    ``source`` says who asked (it starts the message); ``path_hint`` follows
    it where the path itself is at fault (no colon, no such module, no such
    name), not where the module it names failed on its own imports. A plugin
    raising at import, even ``SystemExit``, never takes the engine or the CLI down.
    """
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConnectorLoadError(
            f"{source}{path_hint}: {target!r} is not a path: use the form 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:
        raise ConnectorLoadError(
            f"{source}: importing module {module_name!r} called sys.exit({exc.code!r}); a plugin must not exit"
        ) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plugin raising BaseException must not take the engine or the CLI down
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        named = missing is not None and (module_name == missing or module_name.startswith(f"{missing}."))
        raise ConnectorLoadError(
            f"{source}{path_hint if named else ''} failed to import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConnectorLoadError(f"{source}{path_hint}: module {module_name!r} has no attribute {attr!r}") from None


def declared_side(cls: type, role: str) -> type | str | None:
    """What ``cls`` declares as its side for ``role`` (``"scheduler"`` or ``"worker"``), imported or not."""
    return getattr(cls, f"{role}_side", None)


def side_class(cls: type, role: str) -> type | None:
    """The class of ``cls``'s side for ``role``, importing a path; ``None`` when it declares none.

    Raises :class:`ConnectorLoadError` naming the connector class, the
    declaration and the fix when a path does not import or does not name a
    class, or when the side implements a hook of the other role.
    """
    declared = declared_side(cls, role)
    if declared is None:
        return None
    where = f"{cls.__qualname__}.{role}_side = {declared!r}"
    if isinstance(declared, str):
        target = import_target(declared, source=where, path_hint=" (fix the 'package.module:ClassName' path)")
    else:
        target = declared
    if not isinstance(target, type):
        raise ConnectorLoadError(
            f"{where} names {type(target).__name__} {target!r}, not a class: declare the class whose "
            f"instances implement the {role} hooks (or its 'package.module:ClassName' path)"
        )
    uncalled = uncalled_hooks(target, [role], by_name=True)
    if uncalled:
        raise ConnectorLoadError(_uncalled_message(target, uncalled, f"it is the {role} side of {cls.__qualname__}"))
    return target


def build_side(cls: type, role: str, config: Any, context: Any) -> object | None:
    """``Side(config, context)`` for ``cls``'s side of ``role``, or ``None`` when it declares none."""
    side = side_class(cls, role)
    return None if side is None else side(config, context)


def uncalled_hooks(cls: type, roles: Iterable[str], *, by_name: bool, own: bool = False) -> list[str]:
    """The hooks ``cls`` implements that are called in none of ``roles``, sorted.

    ``by_name``: every method named after a hook counts (a connector or a
    side); otherwise only methods marked ``@hookimpl`` do. ``own``: only those
    written in ``cls``'s own body.
    """
    called = frozenset().union(*(ROLE_HOOKS[r] for r in roles))
    return sorted(
        name
        for name in HOOK_NAMES - called
        if (not own or name in vars(cls)) and implements(cls, name, by_name=by_name)
    )


def check_roles(cls: type, *, by_name: bool) -> None:
    """Reject a connector class with a hook written where that hook's role is never served.

    A connector class serves itself each of its ``roles`` it declares no side
    for; each class of its MRO is judged by what it serves itself, so a
    subclass may narrow ``roles`` under hooks it inherits from a base serving
    both. Sides declared as classes are checked here too (a path when its role
    is built). Raises :class:`ConnectorLoadError` naming the class, the hooks
    and the fix.
    """
    roles = _roles(cls)
    for role in ROLE_HOOKS:
        declared = declared_side(cls, role)
        if declared is not None and role not in roles:
            raise ConnectorLoadError(
                f"{cls.__qualname__} declares {role}_side = {declared!r} but its roles are {sorted(roles)}: "
                f"add {role!r} to roles or remove {role}_side"
            )
        if isinstance(declared, type):
            side_class(cls, role)
    for klass in cls.__mro__:
        own = sorted(r for r in _roles(klass) if declared_side(klass, r) is None)
        uncalled = uncalled_hooks(klass, own, by_name=by_name, own=True)
        if uncalled:
            why = f"it serves only the {' and '.join(own)} role itself" if own else "it declares a side for each role"
            raise ConnectorLoadError(_uncalled_message(klass, uncalled, why))


def refuse_sides_off_kvconnector(cls: type) -> None:
    """Reject a plugin class that is not a ``KVConnector`` but declares a side: nothing would build it.

    Only ``KVConnector.__init__`` builds a side, so such a class would run
    with no hooks for that role at all (no save, no load, no error).
    """
    for role in ROLE_HOOKS:
        declared = declared_side(cls, role)
        if declared is not None:
            raise ConnectorLoadError(
                f"{cls.__qualname__} declares {role}_side = {declared!r} but only a KVConnector builds its sides: "
                "subclass kvconn.KVConnector, or put the hooks on the class itself with @kvconn.hookimpl"
            )


def _roles(cls: type) -> frozenset[str]:
    """The role values ``cls`` declares in ``roles`` (both by default)."""
    return frozenset(getattr(r, "value", r) for r in getattr(cls, "roles", ROLE_HOOKS))


def _uncalled_message(cls: type, hooks: list[str], why: str) -> str:
    def side_of(hook: str) -> str:
        return " and ".join(r for r in ROLE_HOOKS if hook in ROLE_HOOKS[r]) + "-side"

    listed = ", ".join(f"{hook} ({side_of(hook)})" for hook in hooks)
    return (
        f"{cls.__qualname__} implements {listed}, never called on it: {why}. Move each hook to the object "
        "serving its role: the class declared as scheduler_side / worker_side, or the connector class for a "
        "role it declares no side for (add the role to its roles if it should serve it)"
    )
