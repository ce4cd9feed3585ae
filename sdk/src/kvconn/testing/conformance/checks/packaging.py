"""Packaging and import: finding, importing and configuring the connector, and its hooks' names."""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
from importlib.metadata import entry_points
from typing import Any

import msgspec

from ...._plugins.manager import HOOK_NAMES, hook_object, implemented_hooks
from ...._plugins.registry import ENTRY_POINT_GROUP, build_config, connector_roles
from ...._plugins.sides import side_class
from ....connector import KVConnector, KVConnectorRole, NoConfig
from ....context import ConnectorContext
from ....errors import ConnectorConfigError, KVConnError
from ....host import ConnectorHost
from ....metadata import KVConnectorMetadata
from ..catalog import check
from ..results import ConformanceFailure
from ..session import Session


@check("KV001", "found", fix="give each connector a unique entry-point name in the 'kvconn.connectors' group")
def found(session: Session) -> None:
    """The name resolves to exactly one installed connector.

    Catches two distributions declaring the same entry-point name: the first
    one found silently wins, so which connector an engine loads depends on
    install order.
    """
    if ":" in session.connector:
        return
    targets = {
        (ep.value, ep.dist.name if ep.dist else "?")
        for ep in entry_points(group=ENTRY_POINT_GROUP)
        if ep.name == session.connector
    }
    if len(targets) > 1:
        listed = ", ".join(f"{target} (from {dist})" for target, dist in sorted(targets))
        raise ConformanceFailure(f"{len(targets)} entry points named {session.connector!r}: {listed}")


@check(
    "KV002",
    "imports",
    fix="subclass kvconn.KVConnector, name hook arguments as in kvconn.hookspecs, and declare "
    "Config (a msgspec Struct), Metadata (a KVConnectorMetadata subclass), roles, saves and loads",
)
def imports(session: Session) -> None:
    """The class imports and registers as a valid connector for each role it serves.

    Catches hook implementations whose argument names are not in the spec
    (pluggy would refuse them in an engine), a ``Metadata`` that is not a
    ``KVConnectorMetadata`` Struct (workers could not decode it), a ``Config``
    that is not a msgspec Struct, and an empty ``roles``.
    """
    cls = session.cls
    metadata = getattr(cls, "Metadata", KVConnectorMetadata)
    if not (isinstance(metadata, type) and issubclass(metadata, KVConnectorMetadata)):
        raise ConformanceFailure(f"Metadata is {metadata!r}, not a KVConnectorMetadata subclass")
    config = getattr(cls, "Config", None)
    if config is not None and not (isinstance(config, type) and issubclass(config, msgspec.Struct)):
        raise ConformanceFailure(f"Config is {config!r}, not a msgspec Struct")
    roles = connector_roles(cls)
    if not roles:
        raise ConformanceFailure("roles is empty: the connector serves no side of the engine")
    for attr in ("saves", "loads"):
        if not isinstance(getattr(cls, attr, False), bool):
            raise ConformanceFailure(f"{attr} is {getattr(cls, attr)!r}, not a bool")
    for role in roles:
        instance = _instantiate(session, role)
        try:
            host = ConnectorHost({session.connector: instance}, role=role)
        except KVConnError as exc:  # pluggy refused a hook implementation, say
            raise ConformanceFailure(" ".join(str(exc).split())) from None
        host.shutdown()


@check(
    "KV003",
    "api-version",
    fix="set api_version = '1.0' (the kvconn hook API you wrote against) in your connector class body",
)
def api_version(session: Session) -> None:
    """The class declares the hook API version it was written against, in its own body.

    Catches a connector that inherits ``api_version`` from ``kvconn.KVConnector``,
    or declares it as an expression that follows the SDK
    (``api_version = kvconn.API_VERSION``): it then claims to target whatever
    SDK it runs on, so a future major version loads it instead of refusing it
    with a clear message. (An incompatible declared version is a load error.)
    """
    cls = session.cls
    owners = [klass for klass in cls.__mro__ if "api_version" in vars(klass)]
    if not owners or owners[0] is KVConnector:
        raise ConformanceFailure(
            f"{cls.__qualname__} does not declare api_version (it inherits {getattr(cls, 'api_version', None)!r} "
            "from kvconn.KVConnector)"
        )
    expression = _declared_expression(owners[0], "api_version")
    if expression is not None and not (isinstance(expression, ast.Constant) and isinstance(expression.value, str)):
        raise ConformanceFailure(
            f"{owners[0].__qualname__} declares api_version = {ast.unparse(expression)}, which follows the SDK it "
            f"runs on (now {getattr(cls, 'api_version', None)!r}), not the version it was written against"
        )


def _declared_expression(cls: type, name: str) -> ast.expr | None:
    """The expression assigned to ``name`` in ``cls``'s own body, or ``None`` when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for statement in body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in statement.targets
        ):
            return statement.value
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and statement.target.id == name
        ):
            return statement.value
    return None


#: What declaring ``saves`` / ``loads`` takes, per role: at least one of these hooks.
_NEEDED_HOOKS = {
    ("saves", KVConnectorRole.SCHEDULER): ("build_connector_meta",),
    ("saves", KVConnectorRole.WORKER): ("save_kv_layer", "wait_for_save"),
    ("loads", KVConnectorRole.SCHEDULER): ("get_num_new_matched_tokens",),
    ("loads", KVConnectorRole.WORKER): ("start_load_kv", "wait_for_layer_load"),
}


@check(
    "KV006",
    "hook-names",
    fix="name each hook exactly as in kvconn.hookspecs (a method with another name is never called), put it on "
    "the side of its role (scheduler_side / worker_side, whose path must import), and implement the hooks that "
    "what you declare (saves, loads) needs",
)
def hook_names(session: Session) -> None:
    """Every method named like a hook is one, each role's hooks are where that role calls them, and what the
    class declares it does, it has hooks for.

    Catches misspelt hooks (``save_kv_layers``, ``build_connector_metadata``,
    ``request_finish``): pluggy ignores them silently, so the connector never
    saves, or never frees. Also catches a side (``scheduler_side`` /
    ``worker_side``) whose path does not import or that implements a hook of
    the other role, and a class declaring ``saves`` or ``loads`` without any
    hook that could do it (for a role it serves).
    """
    cls = session.cls
    for role in sorted(connector_roles(cls), key=lambda r: r.value):
        try:
            side = side_class(cls, role.value)  # a path is imported here: the checks run the connector anyway
        except KVConnError as exc:
            raise ConformanceFailure(str(exc)) from None
        owner = cls if side is None else side
        _check_spelling(owner)
        hooks = set(implemented_hooks(owner, by_name=side is not None or None))
        for attr in ("saves", "loads"):
            needed = _NEEDED_HOOKS[(attr, role)]
            if getattr(cls, attr, False) and not hooks & set(needed):
                by = "" if side is None else f"its {role.value}_side {side.__qualname__} "
                raise ConformanceFailure(
                    f"{cls.__qualname__} declares {attr} = True but {by}implements none of {', '.join(needed)} "
                    f"for its {role.value} side"
                )


def _check_spelling(owner: type) -> None:
    """A public method of ``owner`` (a connector or a side class) named almost like a hook is a misspelt hook,
    and a hook name bound to something that is not callable disables that hook.

    A subclass of a working connector that misspells an override (``save_kv_layers``) still has the hook it
    meant to replace, from its base: the misspelling counts unless the class defining it defines the hook too.
    """
    mro = [klass for klass in owner.__mro__ if klass not in (KVConnector, object)]
    for name in sorted(HOOK_NAMES):
        holder = next((klass for klass in mro if name in vars(klass)), None)
        if holder is not None and not callable(vars(holder)[name]):
            inherited = next((k for k in mro[mro.index(holder) + 1 :] if callable(vars(k).get(name))), None)
            lost = f"the {inherited.__qualname__}.{name} it inherits" if inherited else "the hook"
            raise ConformanceFailure(
                f"{holder.__qualname__}.{name} = {vars(holder)[name]!r} is not callable: {lost} is never called",
                f"define {name} as a method, or delete the assignment in {holder.__qualname__} to keep the "
                "inherited hook",
            )
    own = {name for klass in mro for name in vars(klass)}
    for name in sorted(own - HOOK_NAMES):
        if name.startswith("_") or not callable(getattr(owner, name, None)):
            continue
        near = difflib.get_close_matches(name, HOOK_NAMES, n=1, cutoff=0.8)
        if not near:
            continue
        definer = next(klass for klass in mro if name in vars(klass))
        hook_owner = next((klass for klass in mro if near[0] in vars(klass)), None)
        if hook_owner is None:
            raise ConformanceFailure(
                f"{owner.__qualname__}.{name} is not a hook and is never called: did you mean {near[0]}?"
            )
        if mro.index(hook_owner) > mro.index(definer):
            raise ConformanceFailure(
                f"{definer.__qualname__}.{name} is not a hook and is never called: it misspells {near[0]}, so "
                f"the {hook_owner.__qualname__}.{near[0]} it inherits keeps running in its place",
                f"rename {definer.__qualname__}.{name} to {near[0]} so that it overrides "
                f"{hook_owner.__qualname__}.{near[0]}",
            )


@check(
    "KV004",
    "config-defaults",
    fix="give every Config field a default that works, so that the connector loads with no config",
)
def config_defaults(session: Session) -> None:
    """With no config at all, the connector configures and starts for every role it serves.

    Catches required config fields and defaults that fail at start-up: engines
    and ``kvconn validate`` load a connector by name first, with no options.
    With a fresh-store factory the instances start on the factory's store once
    the defaults configure, so that validating never writes the default store.
    """
    try:
        config = build_config(session.cls, None, name=session.connector)
    except ConnectorConfigError as exc:
        required = [f.name for f in msgspec.structs.fields(getattr(session.cls, "Config", NoConfig)) if f.required]
        if not required:
            raise ConformanceFailure(f"an empty config is rejected: {exc}") from None
        options = ", ".join(f"`{name}`" for name in required)
        example = ", ".join(f'"{name}": ...' for name in required)
        default = "them defaults" if len(required) > 1 else "it a default"
        given = session.config is not None and set(required) <= set(session.config)
        or_pass = " (the config under test gives it)" if given else f" or pass --config '{{{example}}}'"
        raise ConformanceFailure(
            f"connector {session.connector} needs option{'s' if len(required) > 1 else ''} {options}; give "
            f"{default} (engines load connectors with no options){or_pass}"
        ) from None
    start = None if session.config_factory is not None else config  # None: on the run's store (_instantiate)
    for role in connector_roles(session.cls):
        instance = _instantiate(session, role, start)
        shutdown = getattr(hook_object(instance), "shutdown", None)
        if callable(shutdown):
            shutdown()


_WRONG_VALUES: tuple[Any, ...] = ("kvconn-not-a-valid-value", 12345, [["kvconn"]], {"kvconn": [1]})


@check(
    "KV005",
    "bad-config",
    fix="declare Config with forbid_unknown_fields=True and give every field a precise type (not Any)",
)
def bad_config(session: Session) -> None:
    """A config with an unknown field, or a field of the wrong type, raises ``ConnectorConfigError``.

    Catches configs that silently ignore a misspelt option (no
    ``forbid_unknown_fields``) and fields typed ``Any`` that accept anything
    and fail later, inside the engine, far from the user's mistake.
    """
    cls, name = session.cls, session.connector
    config_type: type[msgspec.Struct] = getattr(cls, "Config", msgspec.Struct)
    _expect_rejected(cls, name, {"kvconn_no_such_field": 1}, "an unknown field 'kvconn_no_such_field'")
    for field in msgspec.structs.fields(config_type):
        wrong = next((v for v in _WRONG_VALUES if not _accepts(field.type, v)), None)
        if wrong is None:
            raise ConformanceFailure(f"config field {field.name!r} accepts any value (type {field.type!r})")
        _expect_rejected(cls, name, {field.name: wrong}, f"{field.name}={wrong!r}")


def _accepts(annotation: Any, value: Any) -> bool:
    try:
        msgspec.convert(value, annotation, strict=False)
    except (msgspec.ValidationError, TypeError):
        return False
    return True


def _expect_rejected(cls: type, name: str, config: dict[str, Any], what: str) -> None:
    try:
        build_config(cls, config, name=name)
    except ConnectorConfigError:
        return
    raise ConformanceFailure(f"a config with {what} was accepted")


def _instantiate(session: Session, role: KVConnectorRole, config: Any = None) -> Any:
    cls = session.cls
    if config is None:  # with a fresh-store factory, a store of its own: checks never write the default store
        start = session.memo("config:start", lambda: session.config_for("start"))  # one run: asked for once
        config = build_config(cls, start, name=session.connector)
    try:
        return cls(config, role=role, context=ConnectorContext())
    except Exception as exc:
        raise ConformanceFailure(
            f"the connector failed to start as {role.value}: {type(exc).__name__}: {exc}",
            "raise ConnectorConfigError for bad options; otherwise start without error from a valid config",
        ) from None
