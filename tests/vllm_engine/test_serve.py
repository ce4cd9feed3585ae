"""vLLM's OpenAI-compatible server with kvconn's offload connector, as an operator runs and watches it.

Two servers of examples/vllm_serve.py's tiny chat model, one after the other
(127.0.0.1, a free port, stopped by process group): without a connector, then
with offload and vLLM's KV-event publisher on. The same four interleaved
multi-turn chats run on each (the `openai` client, greedy): their histories
outgrow vLLM's 64-block cache, so later turns' prefixes come back from
offload. Every reply must match the connector-less server's, and ``/metrics``
(read with Prometheus's text parser) must show kvconn's series moving, offload's
hits under vLLM's ``host`` source, and the events a router would get.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import engine_env, example

START_TIMEOUT_S = 240
TURNS, CHATS, WORDS_PER_TURN = 4, 4, 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One server process group; :meth:`stop` ends the whole tree (API server, engine core, workers)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.port = int(argv[argv.index("--port") + 1])
        self.log_path = log
        self._log = log.open("w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=engine_env(multiprocess=True), start_new_session=True
        )

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
            return str(response.read().decode())

    def wait_ready(self) -> None:
        while time.monotonic() - self.started < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited ({self.proc.returncode}):\n{self.log()[-6000:]}")
            try:
                self.get("/health")
                return
            except OSError:
                time.sleep(1)
        pytest.fail(f"the server did not start in {START_TIMEOUT_S} s:\n{self.log()[-6000:]}")

    def wait_exit(self) -> float:
        """Seconds from the start until the server exited by itself (it must, within the start timeout)."""
        try:
            self.proc.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server kept running:\n{self.log()[-4000:]}")
        return time.monotonic() - self.started

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # what the group left behind (a worker ignoring SIGTERM)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(example("vllm_serve").tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat"))))


def serve(tmp: Path, model: str, name: str, **options: Any) -> Server:
    argv = example("vllm_serve").serve_command(model, port=free_port(), **options)
    return Server(argv, tmp / f"{name}.log")


def run_chats(port: int) -> list[str]:
    """Four chats, interleaved turn by turn; each turn adds 150 new words. Every reply, in order."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    histories: list[list[dict[str, str]]] = [[] for _ in range(CHATS)]
    replies = []
    for turn in range(TURNS):
        for chat, history in enumerate(histories):
            words = [f"w{(chat * 211 + turn * 37 + j * 7) % 1000}" for j in range(WORDS_PER_TURN)]
            history.append({"role": "user", "content": " ".join(words)})
            answer = client.chat.completions.create(
                model="tiny",
                messages=history,
                max_tokens=12,
                temperature=0.0,
                extra_body={"ignore_eos": True},  # type: ignore[arg-type]
            )
            reply = answer.choices[0].message.content or ""
            history.append({"role": "assistant", "content": reply})
            replies.append(reply)
    return replies


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def value(metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and wanted <= ls)


class EventListener:
    """vLLM's KV-event batches, decoded as a router does, in a thread.

    It binds (127.0.0.1 only) and vLLM's publisher connects to it: vLLM binds
    only a wildcard endpoint (``tcp://*:PORT``) and connects to a host's.
    """

    def __init__(self, port: int) -> None:
        import zmq

        self.batches: list[Any] = []
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.bind(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if self._socket.poll(200):
                *_, payload = self._socket.recv_multipart()
                self.batches.append(decoder.decode(payload))

    def stop(self) -> list[Any]:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        return [event for batch in self.batches for event in batch.events]


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


@pytest.mark.slow
def test_served_chats_match_the_connector_less_server_and_operators_see_kvconn(
    chat_model: str, tmp_path: Path, servers: list[Server]
) -> None:
    baseline = serve(tmp_path, chat_model, "baseline", connector=None)
    servers.append(baseline)
    baseline.wait_ready()
    expected = run_chats(baseline.port)
    baseline.stop()

    events_port = free_port()
    listener = EventListener(events_port)
    server = serve(tmp_path, chat_model, "offload", connector="offload", events_port=events_port)
    servers.append(server)
    server.wait_ready()
    got = run_chats(server.port)
    time.sleep(2)  # the last steps' events
    events = listener.stop()
    metrics = samples(server.get("/metrics"))

    assert got == expected, "a reply differs from the connector-less server's"
    offload = {"connector": "offload", "model_name": "tiny"}
    loaded = value(metrics, "vllm:kvconn_blocks_loaded_total", **offload)
    assert loaded > 0 and value(metrics, "vllm:kvconn_blocks_saved_total", **offload) >= loaded
    assert value(metrics, "vllm:kvconn_bytes_loaded_total", **offload) > 0
    assert value(metrics, "vllm:kvconn_lookups_total", **offload) == TURNS * CHATS
    hit_blocks = value(metrics, "vllm:kvconn_hit_blocks_total", **offload)
    assert hit_blocks > 0 and value(metrics, "vllm:kvconn_missed_blocks_total", **offload) > 0
    assert value(metrics, "vllm:kvconn_load_seconds_count", **offload) > 0
    assert value(metrics, "vllm:kvconn_save_seconds_count", **offload) > 0
    assert value(metrics, "vllm:kvconn_pool_used_blocks", **offload) > 0
    assert value(metrics, "vllm:kvconn_pool_blocks", **offload) >= value(metrics, "vllm:kvconn_pool_used_blocks")
    # vLLM's cached prompt tokens by source: offload's loads are host hits, none unspecified
    host = value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="host")
    assert host > 0 and value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
    assert host <= hit_blocks * 32
    stored_on_host = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    assert stored_on_host and all(e.block_size == 32 for e in stored_on_host)
    assert any(type(e).__name__ == "BlockStored" and e.medium == "GPU" for e in events)  # vLLM's own, beside


@pytest.mark.slow
def test_a_misspelt_kvconn_key_stops_the_server_naming_it(
    chat_model: str, tmp_path: Path, servers: list[Server]
) -> None:
    """Before, ``kvconn_confg`` was ignored and the server ran on defaults. Now it names the key and the fix."""
    argv = example("vllm_serve").serve_command(
        chat_model, port=free_port(), connector="offload", config={"pool_blocks": 64}
    )
    bad = Server([a.replace('"kvconn_config"', '"kvconn_confg"') for a in argv], tmp_path / "misspelt.log")
    servers.append(bad)
    seconds = bad.wait_exit()
    log = bad.log()
    assert bad.proc.returncode != 0
    assert "unknown kvconn key(s): 'kvconn_confg' (did you mean 'kvconn_config'?)" in log
    print(
        f"misspelt key: the server exited after {seconds:.1f} s; the message appears {log.count('kvconn_confg')} times"
    )


@pytest.mark.slow
def test_a_misspelt_connector_name_stops_the_engine_core_before_any_worker_builds_a_connector(
    chat_model: str, tmp_path: Path, servers: list[Server]
) -> None:
    """On a CPU engine vLLM first hands the adapter its config in the engine core, resolving the KV-cache layout.

    kvconn refuses the name there, in that one process, before memory profiling and warm-up: no worker builds
    a connector (before, each worker's connector raised it, and vLLM repeated it in four tracebacks).
    """
    server = serve(tmp_path, chat_model, "misnamed", connector="ofload")
    servers.append(server)
    seconds = server.wait_exit()
    log = server.log()
    assert server.proc.returncode != 0
    message = "no connector named 'ofload' is installed"
    raised = [line for line in log.splitlines() if f"ConnectorNotFoundError: {message}" in line]
    assert raised and not any(line.startswith("(Worker") for line in raised)
    adapter_frames = set(re.findall(r'kvconn_vllm/(?:connector|config).py", line \d+, in (\w+)', log))
    assert adapter_frames == {"get_required_kvcache_layout", "check_extra_config"}  # never a connector's __init__
    print(f"misspelt name: the server exited after {seconds:.1f} s; kvconn's error was raised {len(raised)} times")
