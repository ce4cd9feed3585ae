"""The adapter's config, read and checked, and the :class:`~kvconn.ConnectorHost` it builds: what both roles share.

vLLM hands each connector ``kv_transfer_config.kv_connector_extra_config``; the keys kvconn reads are
:data:`kvconn_vllm.EXTRA_CONFIG_KEYS`::

    {"kvconn_connector": "offload" | ["offload", "mooncake"],
     "kvconn_config": {...},            # one connector: its config; several: {name: config}
     "kvconn_on_error": "degrade"}      # or "raise"

Read by :mod:`.connector` (the shell builds its role's host with :func:`hosted_connectors`, and vLLM's front end
runs :func:`check_extra_config`). A new key goes in ``EXTRA_CONFIG_KEYS`` and docs/vllm.md (``tests/test_docs.py``
checks that the docs name only keys read here).
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from kvconn import load_connector_class
from kvconn.connector import KVConnectorRole
from kvconn.context import ConnectorContext
from kvconn.errors import ConnectorConfigError, ConnectorNotFoundError, KVConnError
from kvconn.host import ConnectorHost, HostOptions
from kvconn.introspection import build_config

from .registration import EXTRA_CONFIG_KEYS, route_logs_to_vllm
from .translate import context_from_vllm

__all__ = ["check_extra_config", "hosted_connectors"]


def _host_options(extra: dict[str, Any]) -> tuple[str | list[str], Any, dict[str, Any]]:
    """The connector name(s), their config, and the host's own options (``kvconn_on_error`` ...).

    A ``kvconn_`` key the adapter does not read is an error: a misspelt one
    would otherwise leave the engine on defaults without a word. So is a bad
    value of a host option, named by its key (checked by :class:`~kvconn.host.HostOptions`).
    """
    unknown = sorted(k for k in extra if k.startswith("kvconn_") and k not in EXTRA_CONFIG_KEYS)
    if unknown:
        hints = [
            f"{key!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(key, EXTRA_CONFIG_KEYS, 1))
            else repr(key)
            for key in unknown
        ]
        raise ConnectorConfigError(
            f"kv_connector_extra_config has unknown kvconn key(s): {', '.join(hints)}; "
            f"the keys kvconn reads are {', '.join(EXTRA_CONFIG_KEYS)}"
        )
    names = extra.get("kvconn_connector")
    if not names or not isinstance(names, (str, list)) or not all(isinstance(n, str) for n in names):
        raise ConnectorConfigError(
            "kv_connector_extra_config must name the kvconn connector(s) to run, e.g. "
            '{"kvconn_connector": "offload"} or {"kvconn_connector": ["offload", "mooncake"]}; '
            f"got kvconn_connector={names!r} (see `kvconn list` for the installed ones)"
        )
    options = {key.removeprefix("kvconn_"): extra[key] for key in EXTRA_CONFIG_KEYS[2:] if key in extra}
    try:
        HostOptions(**options)
    except ValueError as exc:  # its message begins with the option's name: the key without its prefix
        raise ConnectorConfigError(f"kvconn_{exc}") from None
    return names, extra.get("kvconn_config"), options


def _per_connector(names: str | list[str], config: Any) -> dict[str, Any]:
    """Each connector's config (``kvconn_config`` is the one connector's, or ``{name: config}`` for several)."""
    name_list = [names] if isinstance(names, str) else names
    configs = {name_list[0]: config} if len(name_list) == 1 else (config if isinstance(config, dict) else {})
    return {name: configs.get(name) for name in name_list}


def _validate_hint(names: str | list[str], config: Any) -> str:
    """The command that finds a config error in a second, before a launch (one per connector)."""
    commands = [
        f"kvconn validate {name}" + (f" --config '{json.dumps(one)}'" if one else "")
        for name, one in _per_connector(names, config).items()
    ]
    return "; check a kv_connector_extra_config before a launch with: " + " && ".join(commands)


def check_extra_config(extra: dict[str, Any]) -> None:
    """Everything about ``kv_connector_extra_config`` that needs no engine: keys, connector names, their configs.

    Raises a :class:`~kvconn.errors.KVConnError` whose message names what is wrong and the
    ``kvconn validate`` command to check a fix, as the connector's own start-up would, later.
    """
    names, config, _ = _host_options(extra)
    try:
        for name, one in _per_connector(names, config).items():
            build_config(load_connector_class(name), one, name=name)
    except KVConnError as exc:
        raise type(exc)(f"{exc}{_validate_hint(names, config)}") from None


def hosted_connectors(
    vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any], *, worker: bool
) -> tuple[ConnectorHost, ConnectorContext]:
    """The host of one role (a worker's: its tensor-parallel rank's) with the connectors ``extra`` names.

    A config or name error carries the ``kvconn validate`` command that finds it before a launch; connectors whose
    two sides share one process's memory are refused when vLLM runs its workers in other processes. kvconn's log
    records, and each hosted connector's package's, go through vLLM's logging.
    """
    names, config, options = _host_options(extra)
    context = context_from_vllm(vllm_config, kv_cache_config, tp_rank=_tp_rank() if worker else 0)
    try:
        host = ConnectorHost.from_names(
            names,
            role=KVConnectorRole.WORKER if worker else KVConnectorRole.SCHEDULER,
            config=config,
            context=context,
            **options,
        )
    except (ConnectorConfigError, ConnectorNotFoundError) as exc:
        raise type(exc)(f"{exc}{_validate_hint(names, config)}") from None
    _refuse_split_in_process_state(host, vllm_config)
    route_logs_to_vllm({type(c).__module__.partition(".")[0] for c in host.connectors.values()})
    return host, context


#: vLLM executors that run the workers in the scheduler's process.
_IN_PROCESS_EXECUTORS = frozenset({"uni", "external_launcher"})


def _refuse_split_in_process_state(host: ConnectorHost, vllm_config: Any) -> None:
    """Refuse connectors whose two sides share memory when vLLM runs its workers in other processes.

    Run anyway, such a connector's scheduler never sees what its workers store:
    no hit, ever, and no error. Refusing at start-up says what to change.
    """
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend in _IN_PROCESS_EXECUTORS:
        return
    split = [name for name, c in host.connectors.items() if getattr(c, "in_process_state", False)]
    if not split:
        return
    host.shutdown()
    raise ConnectorConfigError(
        f"kvconn connector(s) {split} keep their state in one process (in_process_state, e.g. mooncake's embedded "
        f"store), but this vLLM runs its workers in other processes (distributed_executor_backend={backend!r}), "
        "so the scheduler would never see what the workers store: give the connector a shared backend (mooncake: "
        "set master_server_address or MOONCAKE_MASTER), or run vLLM in one process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size=1)"
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):
        return 0  # no distributed state (single process, tests)
