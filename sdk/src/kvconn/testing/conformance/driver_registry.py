"""The registry of conformance drivers: ``run_conformance(..., driver=name)`` finds its engine here.

The reference engine's driver is registered from the start; another engine's
is registered with :func:`register_driver`, or declared by its distribution
in the ``kvconn.conformance_drivers`` entry-point group and loaded on first use.
The protocol a driver implements is :mod:`.driver`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from ...errors import ConnectorLoadError
from ...install import install_project
from .driver import DriverFactory
from .reference_driver import ReferenceDriver

__all__ = ["DRIVER_ENTRY_POINT_GROUP", "available_drivers", "get_driver", "register_driver"]

#: The registered factories by name: the reference engine's, and those registered or loaded from entry points.
_DRIVERS: dict[str, DriverFactory] = {"reference": ReferenceDriver}


#: Entry-point group through which a distribution ships a driver: ``vllm = "pkg.module:load"``, where
#: ``load()`` returns the factory, or raises ``ConnectorLoadError`` when the driver cannot run here.
DRIVER_ENTRY_POINT_GROUP = "kvconn.conformance_drivers"
#: Drivers kvconn's own distributions ship: name -> (distribution, its directory in a kvconn checkout).
_SHIPPED_BY = {"vllm": ("kvconn-vllm", "adapters/vllm")}


def register_driver(name: str, factory: DriverFactory) -> None:
    """Make ``run_conformance(..., driver=name)`` build drivers with ``factory``."""
    _DRIVERS[name] = factory


def available_drivers() -> list[str]:
    """Registered drivers and those declared in the ``kvconn.conformance_drivers`` entry-point group."""
    return sorted(set(_DRIVERS) | {ep.name for ep in entry_points(group=DRIVER_ENTRY_POINT_GROUP)})


def get_driver(name: str) -> DriverFactory:
    """The factory registered (or declared by entry point) as ``name``; ``LookupError`` otherwise."""
    if name not in _DRIVERS:
        for ep in entry_points(group=DRIVER_ENTRY_POINT_GROUP, name=name):
            try:
                _DRIVERS[name] = ep.load()()
            except ConnectorLoadError as exc:
                raise LookupError(str(exc)) from exc
            except Exception as exc:
                raise LookupError(
                    f"conformance driver {name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}"
                ) from exc
    try:
        return _DRIVERS[name]
    except KeyError:
        fix = (
            f"install {_SHIPPED_BY[name][0]}, which ships it: {install_project(_SHIPPED_BY[name][1])}"
            if name in _SHIPPED_BY
            else "register one with kvconn.testing.conformance.register_driver"
        )
        raise LookupError(
            f"no conformance driver named {name!r} (available: {', '.join(available_drivers())}); {fix}"
        ) from None
