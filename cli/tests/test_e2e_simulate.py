"""End to end: the real ``kvconn simulate`` executable."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from kvconn_cli.commands.simulate import setups_from_options

from .conftest import RunKvconn, env_with_path

MEMORY = "kvconn.testing.memory_connector:MemoryConnector"
SMALL = ("--requests", "6", "--no-prefix-cache")


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
        "simulate", "--connector", MEMORY, "--workload", "multi-turn", "--requests", "6", "--plot", str(plot)
    )
    assert proc.returncode == 0, proc.stderr
    for text in ("local prefix cache: 256 blocks", "prompt tokens loaded (connector)", "output verified", "yes"):
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
