"""What the CLI reports about a connector, read from its class without running it.

Discovery (name, distribution, version, entry-point target) comes from
entry-point metadata. Everything else (roles, saves/loads, API version, config
schema, hooks) is declared on the connector class, so the class is imported —
plugins keep that import cheap by importing torch and their backends lazily.
A plugin that fails to import (or even calls ``sys.exit``) is reported as
broken with a one-line reason; it never takes the command down.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

import kvconn
from kvconn.introspection import connector_roles, declared_side, implemented_hooks

__all__ = [
    "ConfigField",
    "ConnectorDetails",
    "ConnectorSummary",
    "config_fields",
    "describe",
    "import_connector_class",
    "one_line",
    "plugin_output_to_stderr",
    "reason",
    "summarize",
    "summarize_all",
]


@dataclass(frozen=True)
class ConnectorSummary:
    """One row of ``kvconn list``; the capability fields are ``None`` when the plugin is broken."""

    name: str
    target: str
    distribution: str | None
    version: str | None
    status: str
    roles: list[str] | None = None
    saves: bool | None = None
    loads: bool | None = None
    api_version: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ConfigField:
    """One option of a connector's ``Config`` Struct.

    ``doc`` comes from ``Annotated[T, msgspec.Meta(description=...)]`` on the
    field (the convention ``kvconn new`` generates); ``constraints`` from the
    same ``Meta`` (``ge``, ``max_length``...). ``default`` is the JSON form of
    the default (a factory's result); ``None`` with ``required=True`` when the
    field has none.
    """

    name: str
    type: str
    required: bool
    default: Any
    doc: str
    constraints: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConnectorDetails:
    """What ``kvconn info`` shows."""

    summary: ConnectorSummary
    description: str
    config_doc: str
    config: list[ConfigField]
    #: hooks of the connector class and of its sides declared as classes (a path is not imported)
    hooks: list[str]
    #: role -> ``"module:Class"`` of the side that implements its hooks, for the roles that have one
    sides: dict[str, str] = field(default_factory=dict)
    #: the roles whose side is declared as a path: not imported, so its hooks are not in ``hooks``
    lazy_sides: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.summary.to_dict(),
            "description": self.description,
            "config_doc": self.config_doc,
            "config": [asdict(f) for f in self.config],
            "hooks": self.hooks,
            "sides": self.sides,
            "lazy_sides": self.lazy_sides,
        }


def one_line(message: str) -> str:
    """The first non-empty line of ``message`` (messages from plugins may be long)."""
    return next((line.strip() for line in message.splitlines() if line.strip()), "")


def reason(exc: BaseException) -> str:
    """An exception as one line for a user: its first message line, or its type when it has none."""
    return one_line(str(exc)) or type(exc).__name__


@contextlib.contextmanager
def plugin_output_to_stderr() -> Iterator[None]:
    """Keep stdout for our data: whatever a plugin prints (importing, running) goes to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def import_connector_class(name: str) -> type:
    """``kvconn.load_connector_class`` with plugin output kept off stdout and ``SystemExit`` contained.

    Raises the registry's errors (``ConnectorNotFoundError``, ``ConnectorLoadError``).
    """
    with plugin_output_to_stderr():
        try:
            return kvconn.load_connector_class(name)
        except SystemExit as exc:
            raise kvconn.ConnectorLoadError(
                f"connector {name!r} called sys.exit({exc.code!r}) while importing; a plugin must raise instead"
            ) from exc


def _capabilities(cls: type) -> dict[str, Any]:
    return {
        "roles": sorted(r.value for r in connector_roles(cls)),
        "saves": bool(getattr(cls, "saves", False)),
        "loads": bool(getattr(cls, "loads", False)),
        "api_version": str(getattr(cls, "api_version", "")),
    }


def _summary_for(name: str, entry: kvconn.ConnectorEntry | None) -> tuple[ConnectorSummary, type | None]:
    def summary(status: str, **capabilities: Any) -> ConnectorSummary:
        return ConnectorSummary(
            name=name,
            target=entry.target if entry else name,
            distribution=entry.distribution if entry else None,
            version=entry.version if entry else None,
            status=status,
            **capabilities,
        )

    try:
        cls = import_connector_class(name)
        capabilities = _capabilities(cls)
    except kvconn.ConnectorNotFoundError:
        raise
    except Exception as exc:
        return summary(f"broken: {reason(exc)}"), None
    return summary("ok", **capabilities), cls


def summarize(name: str) -> tuple[ConnectorSummary, type | None]:
    """The summary of an installed connector or a ``"pkg.mod:Class"`` path, and its class when it loads.

    Raises ``ConnectorNotFoundError`` for a name that is not installed.
    """
    entry = None if ":" in name else kvconn.available_connectors().get(name)
    return _summary_for(name, entry)


def summarize_all() -> list[ConnectorSummary]:
    """Every installed connector (after ``KVCONN_PLUGINS`` / ``KVCONN_DISABLE_PLUGINS``), sorted by name."""
    return [_summary_for(name, entry)[0] for name, entry in kvconn.available_connectors().items()]


def describe(name: str) -> ConnectorDetails:
    """Everything ``kvconn info`` shows about ``name``.

    Raises ``ConnectorNotFoundError`` for an unknown name and
    ``ConnectorLoadError`` when the connector does not load.
    """
    summary, cls = summarize(name)
    if cls is None:
        raise kvconn.ConnectorLoadError(summary.status.removeprefix("broken: "))
    config_type = getattr(cls, "Config", kvconn.NoConfig)
    return ConnectorDetails(
        summary=summary,
        description=_doc(cls) or _doc(sys.modules.get(cls.__module__)),
        config_doc=_doc(config_type) if config_type is not kvconn.NoConfig else "",
        config=config_fields(config_type),
        hooks=_hooks(cls),
        sides={role: _path(side) for role in _ROLES if (side := declared_side(cls, role)) is not None},
        lazy_sides=[role for role in _ROLES if isinstance(declared_side(cls, role), str)],
    )


#: The role values, in the order ``kvconn info`` shows the sides.
_ROLES = [role.value for role in kvconn.KVConnectorRole]


def _hooks(cls: type) -> list[str]:
    """The hooks of ``cls`` and of its sides declared as classes; a side's path is not imported (torch, say)."""
    sides = [side for role in _ROLES if isinstance(side := declared_side(cls, role), type)]
    return sorted(
        {*implemented_hooks(cls), *(hook for side in sides for hook in implemented_hooks(side, by_name=True))}
    )


def _path(side: type | str) -> str:
    return side if isinstance(side, str) else f"{side.__module__}:{side.__qualname__}"


def _doc(obj: object) -> str:
    """``obj``'s own docstring (not one inherited from a base class), cleaned."""
    own = getattr(obj, "__dict__", {}).get("__doc__") if obj is not None else None
    return inspect.cleandoc(own) if isinstance(own, str) else ""


_CONSTRAINTS = ("gt", "ge", "lt", "le", "multiple_of", "pattern", "min_length", "max_length", "tz")


def config_fields(config_type: type) -> list[ConfigField]:
    """The fields of a msgspec ``Config`` Struct: name, type, default, doc and constraints."""
    if not (isinstance(config_type, type) and issubclass(config_type, msgspec.Struct)):
        return []
    schema_docs = _schema_descriptions(config_type)
    fields = []
    for info in msgspec.structs.fields(config_type):
        base, metas = _unwrap_annotated(info.type)
        doc = next((m.description for m in metas if m.description), None) or schema_docs.get(info.encode_name, "")
        constraints = {
            key: value for m in metas for key in _CONSTRAINTS if (value := getattr(m, key, None)) is not None
        }
        fields.append(
            ConfigField(
                name=info.name,
                type=type_name(base),
                required=info.required,
                default=None if info.required else _default_json(info),
                doc=doc,
                constraints=constraints,
            )
        )
    return fields


def _unwrap_annotated(tp: Any) -> tuple[Any, list[msgspec.Meta]]:
    """``tp`` without its ``Annotated`` layers, and their Metas; also inside an optional field's union
    (``Annotated[str, Meta(...)] | None``: the description sits on the member, since msgspec refuses a
    length constraint on the union)."""
    metas: list[msgspec.Meta] = []
    while typing.get_origin(tp) is typing.Annotated:
        metas.extend(m for m in tp.__metadata__ if isinstance(m, msgspec.Meta))
        tp = tp.__origin__
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [_unwrap_annotated(member) for member in typing.get_args(tp)]
        metas.extend(meta for _, member_metas in members for meta in member_metas)
        tp = functools.reduce(operator.or_, (member for member, _ in members))
    return tp, metas


def _schema_descriptions(config_type: type) -> dict[str, str]:
    """Field descriptions msgspec puts in the JSON schema (covers aliases like ``Port = Annotated[...]``)."""
    try:
        schema = msgspec.json.schema(config_type)
    except Exception:  # a field type JSON schema cannot express: no descriptions from here
        return {}
    ref = schema.get("$ref", "").rsplit("/", 1)[-1]
    properties = schema.get("$defs", {}).get(ref, schema).get("properties", {})
    return {name: prop["description"] for name, prop in properties.items() if "description" in prop}


def _default_json(info: msgspec.structs.FieldInfo) -> Any:
    value = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
    try:
        return msgspec.to_builtins(value)
    except Exception:
        return repr(value)


def type_name(tp: Any) -> str:
    """A readable name for a type annotation: ``int``, ``list[str]``, ``str | None``, ``Literal['a', 'b']``."""
    if tp is None or tp is type(None):
        return "None"
    if tp is Ellipsis:
        return "..."
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None and args:
        return f"{type_name(origin)}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(tp, type):
        return tp.__qualname__
    return repr(tp).replace("typing.", "")
