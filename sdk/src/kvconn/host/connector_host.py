"""``ConnectorHost``: one or several connectors of one role behind one typed facade.

Engines talk to connectors only through a host; nothing else touches
``pm.hook``. The host calls each connector in turn, in the order they were
given, so that it can

* route results: the first connector that reports matched tokens loads the
  request; every connector may save; metadata is a ``{name: metadata}`` dict and
  each worker-side connector sees only its own;
* contain failures: under ``on_error="degrade"`` (the default) a connector that
  raises loses its work for that step and nothing else. Its loads in flight are
  reported as failed so the engine recomputes them (never runs on wrong KV),
  frees it was delaying are released, the error is logged once per
  (connector, hook) with the plugin's name and counted. Under ``"raise"`` the
  error surfaces as :class:`~kvconn.errors.ConnectorError`;
* check answers: what a per-step hook returns is validated here (types, whole-block
  hits, load errors and finished loads that belong to the connector's own loads);
  a bad answer is handled as if the hook had raised, with an error naming the
  connector, the hook and the value. The per-layer hooks return nothing and are
  not checked (they are the hot path);
* bound what a connector can stall: a request it keeps asking to be asked
  again about, or a free it delays, for more than ``stall_steps`` steps and
  more than ``stall_s`` seconds, is failed as above (both: an engine waiting
  on transfers spins through empty steps, so steps alone are no measure of
  how long a remote store has had), and a hook call longer than
  ``hook_budget_s`` is warned about once per (connector, hook) and counted.
  A connector whose calls of one hook overrun the budget ``max_slow_calls``
  times in a row is degraded for the rest of the run: the host calls it no
  more, so later steps do not wait on it (a worker side sits out every step,
  its loads recompute). One call that blocks cannot be cut short: Python
  cannot interrupt a running function, and abandoning a worker call that may
  still write into the KV cache could put wrong KV in front of a request; a
  connector bounds its own blocking work (kvconn-mooncake puts a deadline on
  every store call). An async load it never reports is not bounded either:
  its worker may still be writing into those blocks, so handing them to
  another request could put wrong KV in front of it.

``ConnectorHost(connectors, role=...)`` builds the host of that role, a
:class:`~.scheduler_host.SchedulerHost` or a :class:`~.worker_host.WorkerHost`
(both are ``ConnectorHost``): an engine that knows its role may name the
class itself. What both roles share lives beside them: :mod:`.dispatch`
(registering connectors, calling their hooks, failure accounting),
:mod:`.answers` (checks of what a hook returns) and :mod:`.monitors`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from time import monotonic
from typing import Any, ClassVar, Self

from .._plugins.registry import connector_roles, instantiate_connector, load_connector_class
from ..connector import KVConnectorRole
from ..context import ConnectorContext
from .answers import count
from .dispatch import HostCore, HostOptions, OnError
from .monitors import Monitored, _Monitor

__all__ = ["ConnectorHost"]


class ConnectorHost(HostCore, Monitored):
    """Runs connectors of one role for an engine; constructing it builds the host of ``role``.

    Args:
        connectors: ``{name: connector}`` or ``[(name, connector), ...]``, in
            priority order (the first with a hit loads).
        role: the side of the engine this host serves (may be left out on a
            role's class: ``SchedulerHost(connectors)``).
        context: the engine facts (block size is used to map loads to blocks).
        on_error: ``"degrade"`` (default) or ``"raise"``.
        stall_steps: steps without progress a connector may cause (see the module docstring).
        stall_s: seconds without progress a connector may cause, beside ``stall_steps``: a
            stall counts only past both (default :data:`~kvconn.host.DEFAULT_STALL_S`, which says
            why); ``0``: ``stall_steps`` alone.
        clock: the monotonic clock ``stall_s`` is measured on (a test passes a fake one).
        hook_budget_s: seconds a hook call may take before it is warned about and
            counted in :attr:`slow_calls`; ``None``: no budget.
        max_slow_calls: calls of one hook in a row over ``hook_budget_s`` after which
            the connector is degraded for the rest of the run (its hooks are no longer
            called; counted as a failure of that hook); ``None``: only warn and count.
    """

    #: the role a subclass serves (``None`` here: ``ConnectorHost`` picks the class by role)
    serves: ClassVar[KVConnectorRole | None] = None
    _by_role: ClassVar[dict[KVConnectorRole, type[ConnectorHost]]] = {}

    def __init_subclass__(cls, *, role: KVConnectorRole | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if role is not None:
            cls.serves = role
            ConnectorHost._by_role[role] = cls

    def __new__(cls, *args: Any, role: KVConnectorRole | str | None = None, **kwargs: Any) -> ConnectorHost:
        return super().__new__(ConnectorHost._by_role[cls._role(role)] if cls.serves is None else cls)

    def __init__(
        self,
        connectors: Mapping[str, object] | Sequence[tuple[str, object]],
        *,
        role: KVConnectorRole | str | None = None,
        context: ConnectorContext | None = None,
        # The defaults are HostOptions' own: its fields hold them as class attributes.
        on_error: OnError = HostOptions.on_error,
        stall_steps: int = HostOptions.stall_steps,
        stall_s: float = HostOptions.stall_s,
        hook_budget_s: float | None = HostOptions.hook_budget_s,
        max_slow_calls: int | None = HostOptions.max_slow_calls,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        options = HostOptions(
            on_error=on_error,
            stall_steps=stall_steps,
            stall_s=stall_s,
            hook_budget_s=hook_budget_s,
            max_slow_calls=max_slow_calls,
        )
        super().__init__(connectors, role=self._role(role), context=context, options=options, clock=clock)
        self._monitors: list[_Monitor] = []
        self._init_role()

    @classmethod
    def _role(cls, role: KVConnectorRole | str | None) -> KVConnectorRole:
        """``role`` as a role, defaulting to (and required to match) the one ``cls`` serves."""
        if role is None:
            if cls.serves is None:
                raise TypeError(
                    "ConnectorHost needs role='scheduler' or role='worker' (or build a SchedulerHost or a WorkerHost)"
                )
            return cls.serves
        role = KVConnectorRole(role)
        if cls.serves is not None and role is not cls.serves:
            raise ValueError(
                f"{cls.__name__} serves the {cls.serves.value} role, not {role.value}: build a "
                f"ConnectorHost(..., role={role.value!r}) or leave role out"
            )
        return role

    def _init_role(self) -> None:
        """Set up the role's own state (its subclass's), once the connectors are registered."""

    @classmethod
    def from_names(
        cls,
        names: str | Sequence[str],
        *,
        role: KVConnectorRole | str | None = None,
        config: Mapping[str, Any] | None = None,
        context: ConnectorContext | None = None,
        **options: Any,
    ) -> Self:
        """Load connectors by name (or ``"pkg.mod:Class"``) and host them.

        ``options`` are the host's (``on_error``, ``stall_steps``, ``stall_s``, ...), as for
        :class:`ConnectorHost`. With one name, ``config`` is that connector's config; with several, it
        maps each name to its config. Connectors that do not serve ``role``
        (a scheduler-only connector on a worker) are left out. ``role`` may
        be left out on a role's class (``SchedulerHost.from_names(...)``).
        """
        host_options = HostOptions(**options)  # an unknown or bad option is refused before anything loads
        name_list = [names] if isinstance(names, str) else list(names)
        configs: Mapping[str, Any] = {name_list[0]: config} if len(name_list) == 1 else (config or {})
        unknown = set(configs) - set(name_list)
        if unknown:
            raise ValueError(f"config given for connectors that are not loaded: {sorted(unknown)}")
        ctx = context or ConnectorContext()
        role = cls._role(role)
        classes = [(n, load_connector_class(n)) for n in name_list]
        loaded = [
            (n, instantiate_connector(c, n, role=role, config=configs.get(n), context=ctx))
            for n, c in classes
            if role in connector_roles(c)
        ]
        return cls(loaded, role=role, context=ctx, **dataclasses.asdict(host_options))

    def num_tracked_requests(self) -> dict[str, int]:
        """Per connector, how many requests it still tracks (if it says; an answer that is not an int >= 0 is bad)."""
        return {name: n for name, n in self._each("get_num_tracked_requests", (), count) if n is not None}

    def shutdown(self) -> None:
        self._notify("shutdown")
