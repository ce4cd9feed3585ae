"""The connector against a real Mooncake master, inside network namespaces.

The engines run as subprocesses inside the namespaces (the client's transfer
engine must not see this machine's interfaces), executing ``scenarios.py``
with this interpreter (which has the ``store`` extra); they print JSON that
the tests assert on with the same checks as the embedded-backend tests.
Skipped where namespaces or the Mooncake wheel are unavailable; a failure
under ``CI=true`` (see the ``real_store`` fixture).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time
import types
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = str(pathlib.Path(__file__).with_name("scenarios.py"))


def _args(extra: dict[str, Any], *calls: tuple[str, dict[str, Any]]) -> list[str]:
    return [json.dumps(extra)] + [part for name, kwargs in calls for part in (name, json.dumps(kwargs))]


def _run(h: types.ModuleType, ns: Any, env: dict, extra: dict, *calls: tuple[str, dict], timeout: float = 150) -> dict:
    r = h.run_python(ns, script=SCRIPT, args=_args(extra, *calls), env=env, timeout=timeout, python=sys.executable)
    assert r.ok, f"rc={r.rc} timed_out={r.timed_out}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return {
        d["scenario"]: d for d in (json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT "))
    }


def test_save_load_fill_steps_and_isolation(real_store: types.ModuleType, scenarios: types.ModuleType) -> None:
    h = real_store
    with h.netns() as ns, h.mooncake_master(ns) as m:
        results = _run(
            h, ns, m.client_env(), {},
            ("save_then_load", {"block_size": 16}),
            ("fill_steps", {"block_size": 16}),
            ("fill_steps", {"block_size": 256}),
            ("isolation", {}),
        )  # fmt: skip
        block_256 = _run(h, ns, m.client_env(), {}, ("save_then_load", {"block_size": 256}))
        saved_sync = _run(h, ns, m.client_env(), {"save_async": False, "namespace": "sync"},
                          ("save_then_load", {"block_size": 16}))  # fmt: skip
        cold = _run(h, ns, m.client_env(), {"warm_segment": False, "namespace": "cold"},
                      ("save_then_load", {"block_size": 16}))  # fmt: skip
    scenarios.check_save_then_load(results["save_then_load"], 16)
    scenarios.check_save_then_load(block_256["save_then_load"], 256)
    scenarios.check_save_then_load(saved_sync["save_then_load"], 16)
    scenarios.check_save_then_load(cold["save_then_load"], 16)
    scenarios.check_fill_steps(results["fill_steps"])
    scenarios.check_isolation(results["isolation"])


def test_events_name_the_blocks_the_master_holds(real_store: types.ModuleType) -> None:
    """Mooncake declares a remote tier: vLLM's adapter publishes these with medium STORAGE (tests/vllm, Redis)."""
    h = real_store
    with h.netns() as ns, h.mooncake_master(ns) as m:
        r = _run(h, ns, m.client_env(), {"namespace": "events"}, ("events", {}))["events"]
    assert r["first"] == [] and r["kinds"] == ["BlockStored"]
    assert r["stored"] == r["expected"] and len(r["expected"]) == 4


def test_store_too_small_and_lease_expiry(real_store: types.ModuleType, scenarios: types.ModuleType) -> None:
    """A 1 ms lease: whether a load meets an expired lease depends on the master's timing, so the load run is
    repeated (up to 4 times) until one does; every run must keep the tokens exact."""
    h = real_store
    with h.netns() as ns, h.mooncake_master(ns, lease_ttl_ms=1) as m:
        full = _run(h, ns, m.client_env(), {"global_segment_size": 16 << 20}, ("store_full", {}))["store_full"]
        for _ in range(4):
            lease = _run(h, ns, m.client_env(), {}, ("load_failures", scenarios.BIG_KV))["load_failures"]
            assert lease["same_tokens"]
            if lease["stats"].get("load_failed_missing"):  # an expired lease leaves the value undefined: missing
                break
    assert full["same_tokens"]
    assert full["stats"]["save_failed_refused"] > 0 and full["stats"]["hook_errors"] == 0
    scenarios.check_failed_loads(lease, "load_failed_missing")


def _json_after(marker: str, text: str) -> dict:
    line = next(line for line in text.splitlines() if line.startswith(marker + " "))
    return json.loads(line[len(marker) + 1 :])


def _with_faults(h: types.ModuleType, scenario: str, faults: list[tuple[str, float, str, str]]) -> Any:
    """Run ``scenario`` against a master in a namespace, applying faults when it asks for them.

    Each fault is ``(marker, seconds, method, flag)``: once the scenario prints
    ``marker`` (within ``seconds``, else the test fails), call the master
    handle's ``method`` and create ``workdir/flag`` so the scenario goes on.
    """
    with tempfile.TemporaryDirectory() as workdir, h.netns() as ns, h.mooncake_master(ns) as m:
        args = _args({}, (scenario, {"workdir": workdir}))
        with h.spawn_python(ns, script=SCRIPT, args=args, env=m.client_env(), python=sys.executable) as proc:
            for marker, seconds, method, flag in faults:
                assert proc.wait_for_output(marker, seconds), f"no {marker!r}: " + proc.wait(1).stderr[-4000:]
                getattr(m, method)()
                pathlib.Path(workdir, flag).touch()
            result = proc.wait(120)
    assert result.ok, result.stderr[-4000:]
    return result


def test_master_killed_mid_run_then_restarted(real_store: types.ModuleType) -> None:
    result = _with_faults(
        real_store, "master_fault", [("MID", 60, "kill", "killed"), ("DOWN ", 90, "restart", "restarted")]
    )
    down, up = _json_after("DOWN", result.stdout), _json_after("UP", result.stdout)
    print(json.dumps({"max_step_s_after_kill": down["max_step_s"]}))
    assert down["same_tokens"]  # every request finished with the right output while the master was away
    assert down["fresh"]["prompt_tokens_loaded"] == 0 and down["fresh"]["blocks_saved"] == 0
    assert down["fresh"]["save_failed_store_off"] > 0 and down["fresh"]["scheduler_lookup_failed"] > 0
    # The failed saves and loads reach the engine as degraded events, not as silence (figure: max_step_s).
    assert down["reported"]["degraded_events"] > 0, down
    assert up["same_tokens"]
    assert up["writer"]["blocks_saved"] > down["first"]["blocks_saved"]  # saves resumed
    assert up["reader"]["prompt_tokens_loaded"] > 0  # and what was saved after the restart loads


def test_two_nodes_consumer_loads_the_producers_prefix(real_store: types.ModuleType) -> None:
    h = real_store
    with tempfile.TemporaryDirectory() as workdir, h.two_node_netns() as (a, b), h.mooncake_master(a, host=a.addr) as m:
        done = str(pathlib.Path(workdir, "done"))
        args = _args({}, ("producer", {"wait_file": done}))
        with h.spawn_python(a, script=SCRIPT, args=args, env=m.client_env(a), python=sys.executable) as producer:
            assert producer.wait_for_output('{"tokens"', 90), producer.wait(1).stderr[-4000:]
            produced = json.loads(producer.stdout_so_far().strip().splitlines()[-1])
            consumed = _run(h, b, m.client_env(b), {}, ("consumer", {}))["consumer"]
            pathlib.Path(done).touch()
    assert produced["stats"]["blocks_saved"] > 0
    assert consumed["tokens"] == produced["tokens"]
    assert consumed["stats"]["prompt_tokens_loaded"] > 0 and consumed["stats"]["failed_load_blocks"] == 0


def test_conformance_suite_passes_on_the_real_store(real_store: types.ModuleType) -> None:
    """kvconn's conformance suite, run in the namespace against a real master (the report is printed)."""
    h = real_store
    with h.netns() as ns, h.mooncake_master(ns) as m:
        result = _run(h, ns, m.client_env(), {}, ("conformance", {}), timeout=120)["conformance"]
    report = result["report"]
    print(json.dumps(report, indent=1))
    assert result["backend"] == "mooncake"
    assert "load_error" not in report, report["load_error"]
    assert report["failed"] == 0, [c for c in report["checks"] if c["status"] == "failed"]
    assert report["passed"] > 0
    # A check may skip only for a capability the connector lacks (it has them all: it saves and loads).
    assert [c for c in report["checks"] if c["status"] == "skipped"] == []


def test_the_store_meets_the_store_contract_on_a_real_master(real_store: types.ModuleType) -> None:
    """kvconn.testing.StoreConformance against MooncakeBlockStore over a real client (missing keys, write-once,
    a value longer than the buffer, concurrent callers, a master that crashed)."""
    h = real_store
    module = pathlib.Path(__file__).with_name("real_store_conformance.py")
    code = f"import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {str(module)!r}]))"
    with h.netns() as ns, h.mooncake_master(ns) as m:
        env = {**m.client_env(), "MC_MASTER_PGID": str(m.proc.pid)}
        r = h.run_python(ns, code=code, env=env, timeout=240, python=sys.executable)
    print(r.stdout[-3000:])
    assert r.ok, f"rc={r.rc}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout and "skipped" not in r.stdout and "failed" not in r.stdout


def test_connect_is_bounded_by_setup_timeout(real_store: types.ModuleType) -> None:
    """A master address that accepts TCP but never answers (a sink, a paused master) costs setup_timeout_s once.

    The client's own setup would retry for ~600 s holding the GIL (no thread
    join can stop it): the subprocess timeout here is what fails without the
    pre-flight probe. ``build_s`` and ``max_step_s`` are printed as figures.
    """
    h = real_store
    with h.netns() as ns, h.mooncake_master(ns) as m, h.tcp_sink(ns) as sink:
        m.pause()
        results = [
            _run(h, ns, m.client_env(), {}, ("connect_deadline", {"master": master}), timeout=60)["connect_deadline"]
            for master in (sink, m.master_addr)
        ]
        m.resume()
    print(json.dumps([{k: r[k] for k in ("build_s", "max_step_s")} for r in results]))
    for r in results:
        assert r["same_tokens"]
        assert r["stats"]["blocks_saved"] == 0 and r["stats"]["save_failed_store_off"] > 0  # the store stayed off


def test_wedged_master_degrades_steps_then_recovers(real_store: types.ModuleType) -> None:
    """SIGSTOP the master mid-run: one call waits out timeout_s, the rest fail fast; SIGCONT: calls resume."""
    # The client's own RPC timeout is 30 s per call: without deadlines the paused phase takes minutes.
    result = _with_faults(
        real_store, "wedged_master", [("SAVED", 60, "pause", "paused"), ("WEDGED ", 25, "resume", "resumed")]
    )
    wedged, resumed = _json_after("WEDGED", result.stdout), _json_after("RESUMED", result.stdout)
    print(json.dumps({k: wedged[k] for k in ("max_step_s", "steps")}))
    assert wedged["same_tokens"]
    assert wedged["stats"]["prompt_tokens_loaded"] == 0 and wedged["stats"]["blocks_saved"] == 0
    assert wedged["reported"]["degraded_events"] > 0
    assert resumed["same_tokens"]
    assert resumed["stats"]["prompt_tokens_loaded"] > 0 and resumed["stats"]["blocks_saved"] > 0


@pytest.mark.parametrize("master_after_s", [1, 20])
def test_an_engine_started_before_its_master_saves_soon_after_it_comes_up(
    real_store: types.ModuleType, master_after_s: int
) -> None:
    """The master starts 1 s / 20 s after the engine: reconnects come every retry_interval_s (1 s), so the first
    save follows the master within a few intervals, not after the first attempt's setup_timeout_s (60 s here).

    The scenario gives up 20 s after the master starts (``first_save_s`` is then ``None``); the seconds from the
    master's start to the first save are printed as the figure.
    """
    h = real_store
    with tempfile.TemporaryDirectory() as workdir, h.netns() as ns, h.mooncake_master(ns) as m:
        m.kill()  # the engine starts with no master on its address
        args = _args({}, ("late_master", {"workdir": workdir}))
        with h.spawn_python(ns, script=SCRIPT, args=args, env=m.client_env(), python=sys.executable) as proc:
            assert proc.wait_for_output("STARTED", 90), proc.wait(1).stderr[-4000:]
            time.sleep(master_after_s)
            # Flagged before the start, not after: the engine retries every second and may save while start()
            # still waits for the master to answer, which is not a save "before up".
            pathlib.Path(workdir, "up").touch()
            m.start()
            result = proc.wait(120)
    assert result.ok, result.stderr[-4000:]
    saved = _json_after("SAVED", result.stdout)
    print(json.dumps({"master_after_s": master_after_s, "first_save_s": saved["first_save_s"]}))
    assert saved["saved_before_up"] == 0 and saved["same_tokens"]
    assert saved["first_save_s"] is not None, saved["stats"]  # saved within 20 s of the master coming up


def test_values_another_client_wrote_under_our_keys_never_load(real_store: types.ModuleType) -> None:
    """Garbage, short values and (with a shared secret) forged well-formed values: refused, exact tokens.

    Also with async loads, which read each value straight into its blocks (``batch_get_into_multi_buffers``)
    and verify it there: a short value is a misfit Mooncake refuses to move, answered as short.
    """
    h = real_store
    with h.netns() as ns, h.mooncake_master(ns) as m:
        plain, keyed, in_place = (
            _run(h, ns, m.client_env(), extra, ("poisoned", kwargs))["poisoned"]
            for extra, kwargs in (
                ({}, {}),
                ({}, {"secret": "kvconn test secret 0123456789"}),
                ({"load_async": True}, {}),
            )
        )
    for r in (plain, keyed, in_place):
        assert set(r["put"]) == {True}  # the other client's values were stored first
        assert r["same_tokens"]
        assert r["stats"]["prompt_tokens_loaded"] == 0 and r["stats"]["failed_load_blocks"] > 0
        assert r["stats"]["load_failed_integrity_foreign"] > 0 and r["stats"]["load_failed_integrity_short"] > 0
        assert r["reported"]["degraded_events"] > 0
    assert keyed["stats"]["load_failed_integrity_unsigned"] > 0


WARM_CODE = """
import json, sys
import msgspec
sys.path.insert(0, {tests!r})
import scenarios
from kvconn_mooncake.config import MooncakeConfig, resolve_backend
from kvconn_mooncake.mooncake_store import _anonymous_mapping, connect, import_client, warm_segment

def resident(start):  # kB of the mapping at ``start`` in memory, from /proc/self/smaps
    lines = iter(open("/proc/self/smaps").read().splitlines())
    for line in lines:
        if line.split()[0].split("-")[0] == format(start, "x"):
            return next(int(l.split()[1]) for l in lines if l.startswith("Rss:"))

config = msgspec.convert({{**scenarios.real_store_config(), "warm_segment": False}}, MooncakeConfig)
settings = resolve_backend(config)
client = connect(settings, import_client())
value = bytes(range(256)) * 4096
kept = client.put("before-the-warm-up", value)
desc = client.get_replica_desc("before-the-warm-up")[0].get_memory_descriptor().buffer_descriptor
start, end = _anonymous_mapping(desc.buffer_address)
before = resident(start)
faulted = warm_segment(client, settings.global_segment_size)
after = resident(start)
stored = client.put("after-the-warm-up", value)
print("RESULT " + json.dumps({{"segment": settings.global_segment_size, "mapping": end - start, "faulted": faulted,
                              "resident_kib": [before, after], "probes_left": client.remove_by_regex("^kvconn-warm"),
                              "own": desc.transport_endpoint == client.get_hostname(), "stored": [kept, stored],
                              "read": [client.get(k) == value for k in ("before-the-warm-up", "after-the-warm-up")]}}))
"""


def test_warm_segment_faults_the_segment_in_without_writing_it(real_store: types.ModuleType) -> None:
    """``warm_segment``: the client's segment is resident afterwards, what it held reads back, nothing is left stored.

    Its speed-up is a benchmark's business (``mooncake_throughput.py --first-touch [--cold]``); here, that the
    mapping holding the segment went from mostly absent to resident (at least the segment's size, at most twice it
    faulted in), that a value stored before it is intact (the advice faults pages in without writing them), and
    that its probe value is gone.
    """
    h = real_store
    code = WARM_CODE.format(tests=str(pathlib.Path(__file__).parent))
    with h.netns() as ns, h.mooncake_master(ns) as m:
        r = h.run_python(ns, code=code, env=m.client_env(), timeout=120, python=sys.executable)
    assert r.ok, f"rc={r.rc}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    result = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["own"] and result["segment"] <= result["faulted"] <= min(result["mapping"], 2 * result["segment"]), (
        result
    )
    before, after = result["resident_kib"]
    assert before < result["segment"] // 2048 and after * 1024 >= result["segment"], result
    assert result["probes_left"] == 0, f"the warm-up's probe value was left in the store: {result}"
    assert result["stored"] == [0, 0] and result["read"] == [True, True], result
