"""kvconn connectors inside full vLLM engines: the tokens of a connector-less run, and real loads.

Every run sends the same untidy workload (see :mod:`engine_run`) through a real
``vllm.LLM`` (model forwards on vLLM's CPU kernels) and compares every
generated token with the connector-less run. The second pass over the prompts
comes after a flood that evicted them from vLLM's cache, so only a connector
can serve their prefix: each run must have loaded tokens
(``vllm:external_prefix_cache_hits``). The step-contract checker rides along
in the runs that name it: vLLM's own model runner drives the hooks, and the
checker raises (the run fails) at the first hook out of kvconn's order.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
from typing import Any

import pytest

CONTRACT = "kvconn.testing.step_contract:StepContractConnector"

pytestmark = pytest.mark.slow


def assert_exact_with_loads(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    assert result["first"] == baseline["first"], "a connector changed the first pass's tokens"
    assert result["again"] == baseline["again"], "tokens after loading the prefix differ from a connector-less run"
    assert result["external_hits"] > 0, "the connector loaded nothing: the test would not see a wrong load"


def test_the_workload_needs_a_connector_and_is_sensitive_to_kv(baseline: dict[str, Any]) -> None:
    """Without a connector the evicted prefix is recomputed; the tiny model's tokens vary (they can catch bad KV)."""
    assert baseline["external_hits"] == 0 and baseline["preemptions"] > 0
    assert all(len(set(tokens)) > 4 for tokens in baseline["first"] + baseline["again"])


@pytest.mark.parametrize(
    ("connector", "short_name", "config"),
    [
        pytest.param(["offload", CONTRACT], False, None, id="offload"),
        pytest.param("offload", True, None, id="offload-by-vllm-short-name"),
        pytest.param("offload", False, {"load_async": True}, id="offload-async-loads"),  # default: sync on CPU
        pytest.param(["dummy", "mooncake", CONTRACT], False, None, id="dummy+mooncake-embedded"),
    ],
)
def test_in_process_engine_is_exact_and_loads(
    tiny_model: str, baseline: dict[str, Any], run_engine: Any, connector: Any, short_name: bool, config: Any
) -> None:
    """vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker in one process."""
    spec = {"model": tiny_model, "connector": connector, "short_name": short_name, "config": config}
    result = run_engine(spec).ok()
    assert_exact_with_loads(result, baseline)


def test_multiprocess_engine_is_exact_and_loads(tiny_model: str, baseline: dict[str, Any], run_engine: Any) -> None:
    """vLLM's default: the engine core and its worker are separate processes; metadata crosses vLLM's queue."""
    result = run_engine({"model": tiny_model, "connector": ["offload", CONTRACT]}, multiprocess=True).ok()
    assert_exact_with_loads(result, baseline)


def tp2_env() -> dict[str, str]:
    """What vLLM's CPU backend needs for two tensor-parallel workers here, or skip."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"tensor parallelism on vLLM's CPU backend needs a core per worker; this machine allows {cpus}")
    # vLLM binds each CPU worker's threads to a NUMA node; with one node, bind them to a core each by hand.
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}


def test_tensor_parallel_2_is_exact_and_loads(tiny_model: str, baseline: dict[str, Any], run_engine: Any) -> None:
    """Two worker processes, each with its own kvconn worker side; their reports merge in the scheduler."""
    spec = {"model": tiny_model, "connector": ["offload", CONTRACT], "tp": 2}
    assert_exact_with_loads(run_engine(spec, multiprocess=True, env=tp2_env()).ok(), baseline)


def test_mooncake_embedded_store_is_refused_when_workers_run_in_other_processes(
    tiny_model: str, run_engine: Any
) -> None:
    """Run anyway it would get 0 hits in silence: its store would live in the worker process only."""
    run = run_engine({"model": tiny_model, "connector": "mooncake"}, multiprocess=True)
    assert run.rc != 0 and run.result is None
    assert "keep their state in one process" in run.log and "set master_server_address or MOONCAKE_MASTER" in run.log


@pytest.mark.parametrize(
    ("connectors", "tp", "save_async"),
    [
        (["mooncake", CONTRACT], 1, True),
        (["offload", "mooncake"], 1, True),
        (["mooncake", CONTRACT], 2, True),
        (["mooncake", CONTRACT], 1, False),
    ],
    ids=["mooncake", "offload+mooncake", "mooncake-tp2", "mooncake-saves-sync"],
)
def test_mooncake_on_a_real_master_in_a_multiprocess_engine(
    tiny_model: str,
    baseline: dict[str, Any],
    netns_harness: Any,
    run_engine: Any,
    connectors: list[str],
    tp: int,
    save_async: bool,
) -> None:
    """The real store, shared by vLLM's scheduler and worker processes, inside a network namespace.

    With two tensor-parallel ranks each stores its own shard of every block under keys of its own: the shards
    have one layout, so a rank loading another's would pass every check but the tokens. With ``save_async`` (the
    default) the scheduler offers blocks whose put its worker may still be running (the worker lets it land before a
    load); without it each put runs in ``wait_for_save``.
    """
    env = tp2_env() if tp == 2 else None
    h = netns_harness
    with h.netns() as ns, h.mooncake_master(ns) as master:
        mooncake = {
            "master_server_address": master.master_addr,
            "metadata_server": master.metadata_url,
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
            "global_segment_size": 64 << 20,
            "save_async": save_async,
        }
        config = {name: mooncake if name == "mooncake" else None for name in connectors}
        spec = {"model": tiny_model, "connector": connectors, "config": config, "tp": tp}
        result = run_engine(spec, multiprocess=True, netns=ns, env=env)
    assert_exact_with_loads(result.ok(), baseline)


#: A Mooncake client that outlives both engine runs in the namespace: its segment holds the values the first run
#: stored (the engine's own segment goes with it), and once ``WORKDIR/poison`` appears it flips one payload bit of
#: every value the master lists (``/get_all_keys`` on its metrics port; ``upsert`` replaces a value in place).
_KEEPER = """
import os, pathlib, sys, time, urllib.request
from mooncake.store import MooncakeDistributedStore
workdir, metrics = pathlib.Path(sys.argv[1]), sys.argv[2]
client = MooncakeDistributedStore()
code = client.setup(os.environ["MC_LOCAL_HOSTNAME"], os.environ["MC_METADATA_URL"], 512 << 20, 16 << 20, "tcp", "",
                    os.environ["MC_MASTER_ADDR"])
print("READY", code, flush=True)
while not (workdir / "poison").exists():
    time.sleep(0.1)
keys = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/get_all_keys", timeout=10).read().decode().split()
flipped = 0
for key in keys:
    value = client.get(key)
    if value and client.upsert(key, value[:-1] + bytes([value[-1] ^ 1])) == 0:
        flipped += 1
print("POISONED", flipped, len(keys), flush=True)
while not (workdir / "stop").exists():
    time.sleep(0.1)
"""


@pytest.mark.parametrize("load_async", [False, True], ids=["sync-staged", "async-in-place"])
def test_mooncake_values_that_fail_verification_never_reach_vllm(
    tiny_model: str, baseline: dict[str, Any], netns_harness: Any, run_engine: Any, load_async: bool
) -> None:
    """Every stored value poisoned on the real master between two runs: the second run's tokens are exact.

    Sync loads verify in staging; async loads read straight into vLLM's blocks and verify there, reporting a
    bad value with its request, before vLLM schedules it (``Scheduler._update_waiting_for_remote_kv``).

    The second run's hits on the first run's values all fail verification (load_failure_policy
    ``recompute``: vLLM recomputes the blocks), so a token equal to the connector-less run's cannot have
    come from those bytes. A connector that offered a failed block again would livelock vLLM (the run would
    time out).
    """
    h = netns_harness
    with tempfile.TemporaryDirectory() as workdir, h.netns() as ns, h.mooncake_master(ns) as master:
        env = master.client_env()
        args = [workdir, str(master.metrics_port)]
        with h.spawn_python(ns, _KEEPER, args=args, env=env, python=sys.executable) as keeper:
            assert keeper.wait_for_output("READY 0", 60), keeper.wait(1).stderr[-4000:]
            mooncake = {
                "master_server_address": master.master_addr,
                "metadata_server": master.metadata_url,
                "local_hostname": "127.0.0.1",
                "protocol": "tcp",
                "global_segment_size": 16 << 20,
                "load_async": load_async,
            }
            spec = {"model": tiny_model, "connector": ["mooncake", CONTRACT], "config": {"mooncake": mooncake}}
            run_engine(spec, multiprocess=True, netns=ns).ok()
            pathlib.Path(workdir, "poison").touch()
            assert keeper.wait_for_output("POISONED", 60), keeper.wait(1).stderr[-4000:]
            flipped = int(keeper.stdout_so_far().split("POISONED")[1].split()[0])
            assert flipped > 0, "the first run left no value in the keeper's segment to poison"
            spec["load_failure_policy"] = "recompute"
            result = run_engine(spec, multiprocess=True, netns=ns).ok()
            pathlib.Path(workdir, "stop").touch()
    assert result["first"] == baseline["first"] and result["again"] == baseline["again"]
    assert result["external_hits"] > 0, "the second run loaded nothing: its hits on the poisoned values were not tried"


def test_redis_in_a_multiprocess_engine(
    tiny_model: str, baseline: dict[str, Any], redis_server: Any, run_engine: Any
) -> None:
    """kvconn-redis (a kvconn.store connector) shared by vLLM's scheduler and worker processes through a real server."""
    spec = {"model": tiny_model, "connector": ["redis", CONTRACT], "config": {"redis": {"url": redis_server.url}}}
    assert_exact_with_loads(run_engine(spec, multiprocess=True).ok(), baseline)


def test_redis_values_that_fail_verification_never_reach_vllm(
    tiny_model: str, baseline: dict[str, Any], redis_server: Any, run_engine: Any
) -> None:
    """Every stored value poisoned: vLLM re-asks after each failed load, the blocks are not offered again, tokens exact.

    A connector that offered a failed block again would livelock vLLM's scheduler (the run would time out).
    """
    spec = {"model": tiny_model, "connector": ["redis", CONTRACT], "config": {"redis": {"url": redis_server.url}}}
    run_engine(spec, multiprocess=True).ok()
    spec["load_failure_policy"] = "recompute"  # every load of the second run fails verification: vLLM recomputes
    client = redis_server.client()
    keys = client.keys("kvconn/*")
    assert keys, "the first run stored nothing"
    for key in keys:
        value = client.get(key)
        client.set(key, value[:-1] + bytes([value[-1] ^ 1]))  # one flipped bit, in the payload
    result = run_engine(spec, multiprocess=True).ok()
    assert result["first"] == baseline["first"] and result["again"] == baseline["again"]
