"""kvconn's adapter on vLLM 0.29.0's scheduler: the dict block state (only the requests with new blocks).

The adapter offers every scheduled request anyway: vLLM's own tables where the dict has them, tracked
ones otherwise (the block-fill step's request), as on 0.30+ with the lazy block state (``tests/vllm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvconn_vllm.testing.harness import VllmLoop, make_request, make_scheduler

TEST_CONNECTORS = Path(__file__).parent.parent / "vllm"


@pytest.fixture
def tables_connector(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.syspath_prepend(str(TEST_CONNECTORS))
    return "kvconn_test_connectors:TablesConnector"


def test_this_vllm_sends_the_dict_form() -> None:
    from vllm.v1.core.sched.output import KVConnectorBlockState

    assert "block_ids" in KVConnectorBlockState.__annotations__
    assert "req_ids" not in KVConnectorBlockState.__annotations__


def test_every_scheduled_request_is_offered_its_live_table_through_block_fill_and_preemption(
    tables_connector: str,
) -> None:
    from kvconn_test_connectors import TablesMetadata

    # 11 usable blocks; requests growing to 5 blocks each: someone is preempted and resumed. 40-token prompts
    # under a 64-token budget: chunks and decodes fill blocks on steps that allocate none.
    scheduler = make_scheduler(tables_connector, num_blocks=12)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", list(range(100 * i, 100 * i + 40)), max_tokens=40))
    loop = VllmLoop(scheduler)
    seen = {"block_fill": 0, "preempted": 0}

    def check(output: Any) -> None:
        encoded = scheduler.connector.sent_metadata(output.kv_connector_metadata, tables_connector)
        tables = msgspec.msgpack.decode(encoded, type=TablesMetadata).tables
        live = {r: scheduler.kv_cache_manager.get_block_ids(r) for r in output.num_scheduled_tokens}
        assert tables == live  # every scheduled request, with its current table
        cached = output.scheduled_cached_reqs
        seen["block_fill"] += sum(b is None for b in cached.new_block_ids)
        seen["preempted"] += len(output.preempted_req_ids or ())

    loop.run(inspect=check)
    assert scheduler.connector.connector_scheduler._tracker is not None  # the dict's gaps were filled by the tracker
    assert seen["block_fill"] > 0 and seen["preempted"] > 0
