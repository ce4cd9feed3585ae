"""The worker step contract (kvconn.hookspecs): the reference engine keeps it, and the checker sees breaks."""

from __future__ import annotations

import pytest

from kvconn import KVConnectorRole
from kvconn.reference import Engine
from kvconn.testing import memory_connector
from kvconn.testing.step_contract import StepContractConnector, StepContractError, StepContractMetadata

CONTRACT = "kvconn.testing.step_contract:StepContractConnector"
MEMORY = f"{memory_connector.__name__}:MemoryConnector"


@pytest.mark.parametrize("load_async", [False, True])
def test_the_reference_engine_keeps_the_contract_with_loads_preemption_and_chunks(load_async: bool) -> None:
    shared = list(range(1, 75))  # a prefix ending mid-block (block size 16)
    prompts = [shared + [100 + i] * (9 + i) for i in range(4)]
    config = {MEMORY: {"load_async": load_async}, CONTRACT: None}
    # A pool small enough to preempt, a budget that ends chunks mid-block.
    with Engine(
        [MEMORY, CONTRACT],
        config,
        on_error="raise",
        num_blocks=20,
        max_num_batched_tokens=40,
        enable_prefix_caching=False,
    ) as engine:
        engine.generate(prompts, max_tokens=20)
        engine.generate(prompts, max_tokens=20)  # loads from the memory connector
        stats = engine.stats
    assert stats.prompt_tokens_loaded > 0 and stats.preemptions > 0
    checker = engine.worker_host.connectors[CONTRACT]  # type: ignore[union-attr]
    assert isinstance(checker, StepContractConnector) and checker.steps == stats.steps


def test_the_checker_refuses_a_save_before_the_step_started() -> None:
    """The order vLLM uses for steps without sync loads, which the adapter must reorder."""
    worker = StepContractConnector(role=KVConnectorRole.WORKER)
    with pytest.raises(StepContractError, match=r"'wait_for_layer_load:layer.0' after \[\]"):
        worker.wait_for_layer_load("layer.0")
    worker = StepContractConnector(role=KVConnectorRole.WORKER)
    worker.start_load_kv(StepContractMetadata())
    worker.wait_for_save()
    with pytest.raises(StepContractError, match="'wait_for_save' after"):
        worker.wait_for_save()
