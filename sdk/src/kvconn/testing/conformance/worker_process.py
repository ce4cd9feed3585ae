"""A reference worker in a process of its own, as vLLM's multiprocess engine runs its workers.

The process is a new interpreter (``python -m`` this module), not a fork: it
starts with none of this process's memory, so a connector whose worker side
finds what its scheduler side saw only through process memory (a module-level
dict) finds nothing there. Every scheduler output crosses to it as wire
bytes, and its ``ModelRunnerOutput`` comes back the same way, framed over its
stdin and stdout (what the connector prints goes to stderr): see :func:`main`.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from ...context import ConnectorContext
from ...host import WorkerHost
from ...host.wire import (
    decode_model_runner_output,
    decode_scheduler_output,
    encode_model_runner_output,
    encode_scheduler_output,
)
from ...outputs import ModelRunnerOutput, SchedulerOutput
from ...reference.shape import EngineShape

__all__ = ["WorkerProcess"]

#: How long the worker process may take to start (it imports torch) or to run one step.
_TIMEOUT_S = 120.0
_OK, _ERROR = b"\x00", b"\x01"


class WorkerProcess:
    """``execute_model`` of a :class:`~kvconn.reference.worker.ReferenceWorker` hosting ``connector``'s worker
    side in another process. Errors there raise ``RuntimeError`` here, with the worker's message."""

    def __init__(
        self, connector: str, config: Mapping[str, Any] | None, context: ConnectorContext, shape: EngineShape
    ) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if isinstance(p, str))}
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"import {__name__} as w; w.main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._send = Connection(os.dup(self._process.stdin.fileno()), readable=False)
        self._recv = Connection(os.dup(self._process.stdout.fileno()), writable=False)
        self._process.stdin.close()
        self._process.stdout.close()
        self._send.send_bytes(pickle.dumps((connector, dict(config) if config is not None else None, context, shape)))
        self._reply()  # started

    def _reply(self) -> bytes:
        try:
            ready = self._recv.poll(_TIMEOUT_S)
            data = self._recv.recv_bytes() if ready else b""
        except EOFError:
            raise RuntimeError(f"the worker process exited (status {self._process.wait()})") from None
        if not ready:
            raise RuntimeError(f"the worker process gave no answer in {_TIMEOUT_S:g} s")
        if data[:1] == _ERROR:
            raise RuntimeError(f"in the worker process: {data[1:].decode()}")
        return data[1:]

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self._send.send_bytes(encode_scheduler_output(output))
        return decode_model_runner_output(self._reply())

    def close(self) -> None:
        self._send.close()  # the worker reads EOF and exits
        try:
            self._process.wait(_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._recv.close()


def _serve(recv: Connection, send: Connection) -> None:
    """The worker process: build the worker side and a reference worker, then run each step it is sent."""
    from ...reference.worker import ReferenceWorker

    try:
        connector, config, context, shape = pickle.loads(recv.recv_bytes())
        host = WorkerHost.from_names(connector, config=config, context=context, on_error="raise")
        worker = ReferenceWorker(
            context, num_blocks=shape.num_blocks, host=host, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim
        )
    except Exception as exc:
        send.send_bytes(_ERROR + f"{type(exc).__name__}: {exc}".encode())
        return
    send.send_bytes(_OK)
    try:
        while True:
            data = recv.recv_bytes()
            try:
                out = worker.execute_model(decode_scheduler_output(data, host.metadata_types))
            except Exception as exc:
                send.send_bytes(_ERROR + f"{type(exc).__name__}: {exc}".encode())
                continue
            send.send_bytes(_OK + encode_model_runner_output(out))
    except EOFError:
        pass
    finally:
        host.shutdown()


def main() -> None:
    """The worker process's entry point: frames on stdin and stdout, everything printed goes to stderr."""
    frames = os.dup(1)
    os.dup2(2, 1)  # what the connector prints must not corrupt the frames
    _serve(Connection(0, writable=False), Connection(frames, readable=False))
