"""A real ``redis-server`` (Debian package) for the tests: 127.0.0.1, a free port, started and stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import redis

__all__ = ["RedisServer", "free_port", "require_redis_server"]


def require_redis_server() -> None:
    """Skip the calling test when redis-server is not installed (fail under ``CI=true``: make install installs it)."""
    if shutil.which("redis-server") is None:
        import pytest

        reason = "redis-server is not installed: make install (scripts/install-system-deps.sh) installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` process, no persistence; ``args`` are extra ``--option value`` pairs."""

    def __init__(self, port: int | None = None, *args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: make install (scripts/install-system-deps.sh)")
        self.binary = binary
        self.port = port or free_port()
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        command = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([*command, *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)
        client.close()
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5.0)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)  # a stalled server must run to die
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
