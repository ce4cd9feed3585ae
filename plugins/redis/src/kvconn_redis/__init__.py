"""kvconn-redis: KV-cache blocks in Redis or Valkey, as a :class:`kvconn.store.PartsStore`."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Annotated

import msgspec
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvconn.store import BlockStore, StoreConfig, StoreConnector

__all__ = ["DEFAULT_URL", "RedisConfig", "RedisConnector", "RedisStore", "client", "fresh_namespace"]

#: The server when neither the config nor ``KVCONN_REDIS_URL`` names one (Valkey speaks the same protocol).
DEFAULT_URL = "redis://127.0.0.1:6379/0"


class RedisConfig(StoreConfig, kw_only=True):
    """Options of the ``redis`` connector (and every :class:`~kvconn.store.StoreConfig` option)."""

    url: Annotated[str, msgspec.Meta(description="the server, 'redis://host:port/db' (env KVCONN_REDIS_URL)")] = (
        msgspec.field(default_factory=lambda: os.environ.get("KVCONN_REDIS_URL", DEFAULT_URL))
    )
    socket_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="a call waiting longer on the socket raises (the store is then off); keep it below "
            "timeout_s, so that the client, not the deadline, ends a call to a stalled server",
            gt=0,
        ),
    ] = 1.0


class RedisStore:
    """Batched calls as one pipeline each (no transaction): one round trip per step and direction."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()] if keys else []

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> list[bool]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key, value in zip(keys, values, strict=True):
            pipe.set(key, value, nx=True)  # write-once: an existing key keeps its value (answer None)
        answers = pipe.execute(raise_on_error=False)  # OOM under maxmemory is one key's refusal, not an outage
        connection_lost = [a for a in answers if isinstance(a, redis.ConnectionError | redis.TimeoutError)]
        if connection_lost:
            raise connection_lost[0]
        return [not isinstance(a, Exception) for a in answers]

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """As :meth:`put`, the parts sent as they are, no copy (a RESP bulk string's bytes may follow its length in
        pieces); every SET sent, then every answer read, retried as the client retries a pipeline."""
        if not keys:
            return []
        pool = self.client.connection_pool
        conn: redis.Connection = pool.get_connection()
        try:
            return conn.retry.call_with_retry(lambda: _set_nx(conn, keys, parts), lambda _: conn.disconnect())
        except BaseException:
            conn.disconnect()  # whatever failed mid-batch: never back to the pool half-read
            raise
        finally:
            pool.release(conn)

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int | None]:
        lengths: list[int | None] = []
        answers: list[bytes | None] = self.client.mget(list(keys)) if keys else []  # type: ignore[assignment]
        for value, buffer in zip(answers, buffers, strict=True):
            if value is not None:
                n = min(len(value), len(buffer))
                buffer[:n] = memoryview(value)[:n]
            lengths.append(None if value is None else len(value))
        return lengths

    def close(self) -> None:
        self.client.close()


class RedisConnector(StoreConnector):
    """Saves full KV blocks to Redis/Valkey and loads prefix hits from it (kvconn.store does the rest)."""

    Config = RedisConfig
    config: RedisConfig

    def open_store(self) -> BlockStore:
        return RedisStore(client(self.config.url, self.config.socket_timeout_s))


def client(url: str, socket_timeout_s: float) -> redis.Redis:
    """A client whose every call raises within ``socket_timeout_s``: no retries (redis-py's default retries a
    timed-out call with backoff, 15 s in all for a 1 s timeout, far past the deadline); after a failed call the
    connector probes the server again itself."""
    return redis.Redis.from_url(
        url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0)
    )


def _set_nx(connection: redis.Connection, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
    """Send ``SET key value NX`` per key (the value as its parts), then read each answer as :meth:`RedisStore.put`."""
    chunks: list[bytes | memoryview] = []
    end = b""  # the previous command's end goes out with the next one's start: fewer writes
    for key, value in zip(keys, parts, strict=True):
        size = sum(part.nbytes for part in value)
        chunks += (end + b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size), *value)
        end = b"\r\n$2\r\nNX\r\n"
    connection.send_packed_command([*chunks, end])
    return [_answered(connection) for _ in keys]


def _answered(connection: redis.Connection) -> bool:
    try:
        connection.read_response()  # OK, or nil (it held a value): stored; lost or too slow: raises, disconnected
    except redis.ResponseError:  # OOM under maxmemory is one key's refusal, not an outage
        return False
    return True


def fresh_namespace(run: str) -> dict[str, str]:
    """``kvconn validate --config-factory``: a namespace per run (on the server of ``KVCONN_REDIS_URL``)."""
    return {"namespace": f"{run}-{uuid.uuid4().hex}"}
