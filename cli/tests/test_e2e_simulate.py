"""End to end: the real ``kvconn simulate`` executable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from kvconn_cli.commands.simulate import setups_from_options

from .conftest import RunKvconn, env_with_path

MEMORY = "kvconn.testing.memory_connector:MemoryConnector"
#: One pass of the workload per timed round: tests check tokens and counters, not times.
ONE_PASS = ("--round-seconds", "0")
SMALL = ("--requests", "6", "--no-prefix-cache", *ONE_PASS)


def test_simulate_json_shows_loads_and_verifies_output(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("simulate", "--connector", MEMORY, "--connector", "dummy", *SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["output_verified"] is True
    memory, dummy = doc["runs"]
    assert memory["label"] == MEMORY and memory["prompt_tokens_loaded"] > 0 and memory["hit_rate"] > 0
    assert memory["prompt_tokens_computed"] < doc["baseline"]["prompt_tokens_computed"]
    assert dummy["prompt_tokens_loaded"] == 0 and dummy["output_verified"] is True
    assert doc["engine"]["enable_prefix_caching"] is False and "off" in doc["engine"]["description"]


def test_simulate_table_says_what_the_engine_could_cache(run_kvconn: RunKvconn, tmp_path: Path) -> None:
    plot = tmp_path / "sim.png"
    proc = run_kvconn(
        "simulate",
        "--connector",
        MEMORY,
        "--workload",
        "multi-turn",
        "--requests",
        "6",
        "--round-seconds",
        "0.2",
        "--plot",
        str(plot),
    )
    assert proc.returncode == 0, proc.stderr
    for text in ("local prefix cache: 256 blocks", "prompt tokens loaded (connector)", "output verified", "yes"):
        assert text in proc.stdout
    # the default clock, CPU time, is named, with the wall figure beside
    for text in ("steps/s by cpu time (min / median / max)", "steps/s by wall time (median)", "0.2 s; clock: CPU"):
        assert text in proc.stdout
    assert "simulating" in proc.stderr  # progress goes to stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_connector_loading_wrong_kv_exits_1(run_kvconn: RunKvconn, tmp_path: Path) -> None:
    (tmp_path / "lying_connector.py").write_text(
        textwrap.dedent(
            """
            from kvconn import KVConnector, KVConnectorMetadata


            class Lying(KVConnector):
                loads = True

                def get_num_new_matched_tokens(self, request, num_computed_tokens):
                    return len(request.block_hashes) * self.context.block_size - num_computed_tokens, False

                def update_state_after_alloc(self, request, num_external_tokens):
                    pass

                def build_connector_meta(self, scheduler_output, block_state):
                    return KVConnectorMetadata()
            """
        )
    )
    proc = run_kvconn("simulate", "--connector", "lying_connector:Lying", *SMALL, env=env_with_path(tmp_path))
    assert proc.returncode == 1
    assert "kvconn: error: lying_connector:Lying: output differs from the run without a connector" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_json_names_the_clock_and_every_round(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn(
        "simulate", "--connector", MEMORY, "--requests", "4", "--repeats", "2", "--clock", "wall", "--round-seconds",
        "0.05", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["timing"]["clock"] == "wall" and doc["timing"]["min_round_s"] == 0.05 and doc["timing"]["repeats"] == 2
    for run in (doc["baseline"], *doc["runs"]):
        assert run["clock"] == "wall" and len(run["rounds"]) == len(run["steps_per_s_repeats"]) == 2
        assert all(r["wall_s"] >= 0.05 and r["passes"] >= 1 for r in run["rounds"])
        assert run["steps_per_s_min"] <= run["steps_per_s"] <= run["steps_per_s_max"]
        assert run["steps_per_s"] == run["steps_per_s_wall"] and run["output_verified"] is True
    assert doc["runs"][0]["steps_per_s_vs_baseline"] > 0


def test_help_shows_the_measurements_defaults_without_importing_the_sdk() -> None:
    # The command once repeated the SDK's round length so that --help need not import the engine; the
    # defaults now live in kvconn_cli.rounds (standard library only), which the measurement uses too.
    from kvconn_cli.rounds import DEFAULT_MIN_ROUND_S

    code = (
        "import sys\n"
        "from kvconn_cli.app import main\n"
        "try:\n    main(['simulate', '--help'])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kvconn', 'torch')), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env_with_path())
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("[]"), proc.stderr
    assert f"[default: {DEFAULT_MIN_ROUND_S}; 0.0<=x<=600.0]" in proc.stdout and "[default: cpu]" in proc.stdout


def test_bad_input_is_a_one_line_usage_error(run_kvconn: RunKvconn) -> None:
    unknown = run_kvconn("simulate", "--connector", "no-such-connector", *SMALL)
    assert unknown.returncode == 2 and "no-such-connector" in unknown.stderr and "Traceback" not in unknown.stderr
    bad_plot = run_kvconn("simulate", "--connector", "dummy", "--plot", "out.svg")
    assert bad_plot.returncode == 2 and "ending in .png" in bad_plot.stderr
    bad_config = run_kvconn("simulate", "--connector", "dummy", "--connector", MEMORY, "--config", '{"x": 1}')
    assert bad_config.returncode == 2 and "must map connector names" in bad_config.stderr


def test_config_goes_to_the_one_connector_or_per_name() -> None:
    (single,) = setups_from_options([MEMORY], {"load_async": True})
    assert single.config == {"load_async": True}
    together, alone = setups_from_options([f"{MEMORY},dummy", "dummy"], {MEMORY: {"load_async": True}})
    assert together.names == (MEMORY, "dummy") and together.config == {MEMORY: {"load_async": True}}
    assert alone.config is None


# Issue 14: bad numbers, plugins that exit or print, failing hooks.


def test_bad_numbers_are_one_usage_error_line_without_running(run_kvconn: RunKvconn) -> None:
    cases = {
        ("--num-blocks", "0"): "--num-blocks must be between 16 and 65536, got 0",
        ("--num-blocks=-5",): "--num-blocks must be between 16 and 65536, got -5",
        ("--num-blocks", str(2**63)): f"--num-blocks must be between 16 and 65536, got {2**63}",
        ("--num-blocks", "16"): "--num-blocks 16 is too small for this workload: its longest request needs",
        ("--requests", "0"): "--requests must be between 1 and 10000, got 0",
        ("--requests", str(10**9)): "--requests must be between 1 and 10000",
        ("--round-seconds", "-1"): "invalid value for '--round-seconds': Input should be greater than or equal to 0",
    }
    for args, message in cases.items():
        proc = run_kvconn("simulate", "--connector", "dummy", *args)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"kvconn: error: {message}"), (args, proc.stderr)


def test_a_plugin_that_exits_at_import_is_a_clear_error(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    proc = run_kvconn("simulate", "--connector", "e2e-exits", *SMALL, env=broken_env)
    assert proc.returncode == 1, proc.stderr
    assert "kvconn: error: connector 'e2e-exits'" in proc.stderr and "called sys.exit(3)" in proc.stderr


def test_a_plugin_printing_at_import_leaves_the_json_intact(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    proc = run_kvconn("simulate", "--connector", "e2e-noisy", "--requests", "2", *ONE_PASS, "--json", env=broken_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["runs"][0]["label"] == "e2e-noisy"
    assert "noisy plugin says hello" in proc.stderr


def test_a_plugin_writing_to_file_descriptor_1_leaves_the_json_intact(
    run_kvconn: RunKvconn, broken_env: dict[str, str]
) -> None:
    # os.write(1) at import and in start_load_kv, and C stdio's printf (buffered until exit) in the hook.
    args = ("simulate", "--connector", "e2e-fd-writer", "--requests", "2", *ONE_PASS, "--json")
    proc = run_kvconn(*args, env=broken_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["runs"][0]["label"] == "e2e-fd-writer"
    for written in ("raw bytes on fd 1 at import", "raw bytes on fd 1 in start_load_kv", "buffered C stdio"):
        assert written in proc.stderr


def test_faults_of_the_warm_up_round_are_reported_in_the_json_and_the_table(
    run_kvconn: RunKvconn, tmp_path: Path
) -> None:
    # A store that is down while the simulation warms up (round 0, pass 0 names its model ...@0.0), fine after.
    (tmp_path / "warm_up_faults.py").write_text(
        textwrap.dedent(
            """
            import msgspec
            from kvconn.testing.raw_hook_connector import HookReferenceConnector


            class DownInTheWarmUp(HookReferenceConnector):
                def __init__(self, config=None, **kwargs):
                    super().__init__(config, **kwargs)
                    if self.context.model.endswith("@0.0"):
                        self.config = msgspec.structs.replace(self.config, fail_from_block=0)
                        self.request_finished = self._injected_failure
            """
        )
    )
    args = ("simulate", "--connector", "warm_up_faults:DownInTheWarmUp", *SMALL, "--repeats", "2")
    proc = run_kvconn(*args, "--json", env=env_with_path(tmp_path))
    assert proc.returncode == 0, proc.stderr  # failed loads are recomputed: exact tokens
    (run,) = json.loads(proc.stdout)["runs"]
    assert run["fault_passes"] == 3 and run["failed_load_blocks"] > 0 and run["degraded_events"] > 0
    (failure,) = run["hook_failures"]
    assert failure["hook"] == "request_finished" and failure["count"] > 0
    assert "failed in request_finished" in proc.stderr
    table = run_kvconn(*args, env=env_with_path(tmp_path))
    rows = [line for line in table.stdout.splitlines() if line.startswith(("degraded events", "failed load"))]
    # the last column is the connector's run (the first the baseline's: no connector, no faults)
    assert [row.split()[-1] for row in rows] == [f"{run['degraded_events']:,}", f"{run['failed_load_blocks']:,}"]
    assert all("(every pass)" in row for row in rows)


def test_failing_hooks_are_summed_up_one_line_each_without_traceback(run_kvconn: RunKvconn) -> None:
    config = json.dumps({"fail_hook": "save_kv_layer"})
    proc = run_kvconn("simulate", "--connector", MEMORY, "--config", config, "--requests", "2", *ONE_PASS)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "save_kv_layer" in line]
    assert line.startswith(f"kvconn: warning: {MEMORY}: connector {MEMORY!r} failed in save_kv_layer ")
    assert "time(s)" in line and "injected failure in save_kv_layer" in line


def test_an_offload_pool_too_small_for_one_block_is_refused(run_kvconn: RunKvconn) -> None:
    env = env_with_path(KVCONN_PLUGINS="offload")
    proc = run_kvconn("simulate", "--connector", "offload", "--config", '{"pool_bytes": 1}', "--requests", "2", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "kvconn: error: invalid config for connector 'offload': field 'pool_bytes': 1 bytes hold no" in proc.stderr
