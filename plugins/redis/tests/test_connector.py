"""The ``redis`` connector on the reference engine against a real redis-server: exact outputs through faults."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer, free_port

from kvconn.reference import Engine

FAST = {"timeout_s": 1.0, "socket_timeout_s": 0.5, "retry_interval_s": 0.05, "max_backoff_s": 0.2}


def prompts(seed: int = 1, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(32_000) for _ in range(70)]
    return [shared + [rng.randrange(32_000) for _ in range(25 + i)] for i in range(n)]


def run(config: dict[str, Any] | None, batch: list[list[int]]) -> tuple[list[list[int]], Engine]:
    """Each prompt finished before the next, no local prefix cache: every hit comes from Redis."""
    connector = "redis" if config is not None else None
    with Engine(connector, config, num_blocks=128, enable_prefix_caching=False) as engine:
        outputs = [engine.generate([p], max_tokens=8)[0] for p in batch]
    return outputs, engine


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return run(None, prompts())[0]


def test_hits_load_exactly(server: RedisServer, expected: list[list[int]]) -> None:
    outputs, engine = run({"url": server.url}, prompts())
    assert outputs == expected
    assert engine.stats.prompt_tokens_loaded >= 3 * 64
    assert engine.stats.degraded_events == 0


def test_a_server_that_restarts_loses_blocks_not_outputs(server: RedisServer, expected: list[list[int]]) -> None:
    run({"url": server.url}, prompts()[:1])
    server.stop()
    server.start()  # same port, empty
    outputs, engine = run({"url": server.url, **FAST}, prompts())
    assert outputs == expected
    assert engine.stats.failed_load_blocks == 0


def test_a_stalled_server_degrades_and_outputs_stay_exact(server: RedisServer, expected: list[list[int]]) -> None:
    run({"url": server.url}, prompts()[:1])
    server.signal(signal.SIGSTOP)
    outputs, engine = run({"url": server.url, **FAST}, prompts())
    server.signal(signal.SIGCONT)
    assert outputs == expected
    assert engine.stats.prompt_tokens_loaded == 0
    assert engine.stats.degraded_events > 0


def test_a_server_down_at_start(expected: list[list[int]]) -> None:
    outputs, engine = run({"url": f"redis://127.0.0.1:{free_port()}/0", **FAST}, prompts())
    assert outputs == expected
    assert engine.stats.prompt_tokens_loaded == 0
    assert engine.stats.degraded_events > 0


def test_an_evicting_server(server: RedisServer) -> None:
    client = server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 300_000)  # ~130 of the 240 blocks
    rng = random.Random(2)
    many = [[rng.randrange(32_000) for _ in range(200)] for _ in range(20)]
    outputs, _ = run({"url": server.url}, many)
    assert outputs == run(None, many)[0]
    assert client.info("stats")["evicted_keys"] > 0


@pytest.mark.parametrize("damage", ["corrupt", "foreign"])
def test_corrupt_or_foreign_values_never_load(server: RedisServer, expected: list[list[int]], damage: str) -> None:
    run({"url": server.url}, prompts()[:1])
    client = server.client()
    for key in client.keys("kvconn/*"):
        value = client.get(key)
        assert value is not None
        client.set(key, value[:-1] + bytes([value[-1] ^ 1]) if damage == "corrupt" else b"someone else's value")
    outputs, engine = run({"url": server.url}, prompts())
    assert outputs == expected
    assert engine.stats.failed_load_blocks > 0


def test_kvconn_validate_redis_twice_on_one_server_leaves_nothing_behind(server: RedisServer, tmp_path: Path) -> None:
    """The connector declares a fresh store per run (StoreConnector's namespace): a second plain validate against
    the same server stays green (KV045), and neither run leaves a file in the temporary directory."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    kvconn = [sys.executable, "-m", "kvconn_cli", "validate", "redis"]
    env = {**os.environ, "KVCONN_REDIS_URL": server.url, "TMPDIR": str(temp)}
    for attempt in ("first", "second"):
        proc = subprocess.run(kvconn, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{attempt} run: {proc.stdout}{proc.stderr}"
        assert "redis: ok" in proc.stdout and " 0 failed" in proc.stdout
        assert not list(temp.iterdir()), f"the {attempt} run left {sorted(p.name for p in temp.iterdir())}"
    assert server.client().dbsize() > 0  # both runs stored blocks there: the namespace kept them apart


def test_a_server_down_at_start_is_used_once_it_is_up(expected: list[list[int]]) -> None:
    server = RedisServer()
    first, again = prompts()[:2]
    with Engine("redis", {"url": server.url, **FAST}, num_blocks=128, enable_prefix_caching=False) as engine:
        assert engine.generate([first], max_tokens=8)[0] == expected[0]
        server.start()
        try:
            hosts = [h for h in (engine.scheduler_host, engine.worker_host) if h is not None]
            sides = [host.connectors["redis"].side for host in hosts]  # type: ignore[attr-defined]
            deadline = time.monotonic() + 60  # probes back off to max_backoff_s (0.2 s)
            while not all(side.guard.available for side in sides) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.generate([first], max_tokens=8)[0] == expected[0]
            assert engine.generate([again], max_tokens=8)[0] == expected[1]
            assert engine.stats.prompt_tokens_loaded > 0, "the store never came back into use"
        finally:
            server.stop()
