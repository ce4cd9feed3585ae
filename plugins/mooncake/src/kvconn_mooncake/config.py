"""The connector's options, and how they resolve against the environment.

Real-store fields left unset are read from the variables Mooncake's own CI
uses (``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``,
``MOONCAKE_PROTOCOL``, ``LOCAL_HOSTNAME``). The real store is used when a
master address is known; otherwise the embedded in-process store is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import msgspec

from kvconn import ConnectorConfigError
from kvconn.store import LoadAsync, MaxBackoff, SaveAsync, SaveDecode, StoreConfig
from kvconn.store.config import MAX_SECONDS

__all__ = ["ENV_VARS", "MooncakeConfig", "RealStoreSettings", "resolve_backend"]

MiB = 1 << 20
#: Upper bound of the byte sizes (16 TiB): beyond it a value is a typo, and Mooncake would fail at start.
MAX_BYTES = 1 << 44

#: Config field -> environment variable consulted when the field is unset.
ENV_VARS = {
    "master_server_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "local_hostname": "LOCAL_HOSTNAME",
}


class MooncakeConfig(StoreConfig, kw_only=True):
    """Options of the ``mooncake`` connector (and every :class:`~kvconn.store.StoreConfig` option)."""

    #: Names before the move onto kvconn.store (a config that still uses one is told the new name).
    renamed_fields: ClassVar[dict[str, str]] = {"store_timeout_s": "timeout_s", "save_decode_cache": "save_decode"}

    backend: Annotated[
        Literal["auto", "mooncake", "embedded"],
        msgspec.Meta(
            description="'mooncake': the real store; 'embedded': the in-process store; 'auto': real iff a master is set"
        ),
    ] = "auto"
    master_server_address: Annotated[
        str | None,
        msgspec.Meta(
            description="Mooncake master 'host:port' (env MOONCAKE_MASTER); setting it selects the real store"
        ),
    ] = None
    metadata_server: Annotated[
        str | None,
        msgspec.Meta(
            description="transfer-engine metadata server, e.g. 'http://host:port/metadata' "
            "(env MOONCAKE_TE_META_DATA_SERVER)"
        ),
    ] = None
    protocol: Annotated[
        str | None, msgspec.Meta(description="transfer protocol: 'tcp' or 'rdma' (env MOONCAKE_PROTOCOL; default tcp)")
    ] = None
    local_hostname: Annotated[
        str | None,
        msgspec.Meta(description="address this client advertises to peers (env LOCAL_HOSTNAME; default localhost)"),
    ] = None
    rdma_devices: Annotated[
        str, msgspec.Meta(description="RDMA devices for protocol 'rdma', comma-separated ('' = auto)")
    ] = ""
    global_segment_size: Annotated[
        int,
        msgspec.Meta(
            description="bytes this client contributes to the store (Mooncake needs >= 16 MiB)",
            ge=16 * MiB,
            le=MAX_BYTES,
        ),
    ] = 256 * MiB
    local_buffer_size: Annotated[
        int, msgspec.Meta(description="bytes of the client's local transfer buffer", ge=0, le=MAX_BYTES)
    ] = 16 * MiB
    warm_segment: Annotated[
        bool,
        msgspec.Meta(
            description="fault in this client's segment's memory at start-up without writing it (madvise "
            "MADV_POPULATE_WRITE; nothing is stored), so that saves never pay its first-touch page faults (a put "
            "into pages never touched took 5-6x as long); costs about 0.3 s per GiB of segment at start-up, and "
            "the segment's memory is taken then rather than as saves fill it"
        ),
    ] = True
    setup_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="give up connecting to the master after this long (the store is off until a probe connects)",
            gt=0,
            le=MAX_SECONDS,
        ),
    ] = 30.0
    embedded_store: Annotated[
        str,
        msgspec.Meta(description="name of the in-process store; connectors in one process with the same name share it"),
    ] = "default"
    embedded_capacity_bytes: Annotated[
        int, msgspec.Meta(description="capacity of the embedded store (LRU eviction beyond)", ge=1, le=MAX_BYTES)
    ] = 1 << 30
    # Mooncake's own defaults for options every store connector has (a master that comes back is used again
    # within max_backoff_s: its client reconnects by itself; a put to another node's segment, or a synchronous
    # one in a busy engine, costs milliseconds the next step need not wait for: benchmarks/history/2026-log.md):
    load_async: LoadAsync = False
    save_decode: SaveDecode = False
    save_async: SaveAsync = True
    max_backoff_s: MaxBackoff = 5.0


@dataclass(frozen=True)
class RealStoreSettings:
    """Everything ``MooncakeDistributedStore.setup`` needs, resolved and checked."""

    master_server_address: str
    metadata_server: str
    protocol: str
    local_hostname: str
    rdma_devices: str
    global_segment_size: int
    local_buffer_size: int
    setup_timeout_s: float
    warm_segment: bool = False

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master_server_address.rpartition(":")
        return host.strip("[]"), int(port)


def _error(field: str, problem: str, env_var: str | None = None) -> ConnectorConfigError:
    where = f"field {field!r}" + (f" (from {env_var})" if env_var else "")
    return ConnectorConfigError(f"invalid config for connector 'mooncake': {where}: {problem}")


def _lookup(config: MooncakeConfig, field: str, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The field's value, else its environment variable's; and that variable's name if it was used."""
    value = getattr(config, field)
    if value is not None:
        return value, None
    var = ENV_VARS[field]
    return env.get(var) or None, var


def resolve_backend(config: MooncakeConfig, env: Mapping[str, str] | None = None) -> RealStoreSettings | None:
    """The real store's settings, or ``None`` for the embedded store.

    Raises :class:`~kvconn.ConnectorConfigError` naming the field (and the
    environment variable it came from) when a value cannot work.
    """
    env = os.environ if env is None else env
    master, master_var = _lookup(config, "master_server_address", env)
    if config.backend == "embedded" or (config.backend == "auto" and not master):
        return None
    if not master:
        raise _error("master_server_address", "backend 'mooncake' needs a master 'host:port' (or MOONCAKE_MASTER)")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _error("master_server_address", f"expected 'host:port', got {master!r}", master_var)
    metadata, _ = _lookup(config, "metadata_server", env)
    if not metadata:
        raise _error(
            "metadata_server",
            "the real store needs the transfer-engine metadata server (e.g. 'http://host:port/metadata'); "
            "set it or MOONCAKE_TE_META_DATA_SERVER",
        )
    protocol, protocol_var = _lookup(config, "protocol", env)
    protocol = (protocol or "tcp").lower()
    if protocol not in ("tcp", "rdma"):
        raise _error("protocol", f"expected 'tcp' or 'rdma', got {protocol!r}", protocol_var)
    hostname, _ = _lookup(config, "local_hostname", env)
    return RealStoreSettings(
        master_server_address=master,
        metadata_server=metadata,
        protocol=protocol,
        local_hostname=hostname or "localhost",
        rdma_devices=config.rdma_devices,
        global_segment_size=config.global_segment_size,
        local_buffer_size=config.local_buffer_size,
        setup_timeout_s=config.setup_timeout_s,
        warm_segment=config.warm_segment,
    )
