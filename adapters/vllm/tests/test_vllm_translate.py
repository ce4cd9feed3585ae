"""The vLLM adapter's parts that need no vLLM: KV-cache checks, logging, merging worker reports, translation."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvconn import ConnectorContext
from kvconn_vllm import route_logs_to_vllm
from kvconn_vllm.translate import check_kv_caches

CONTEXT = ConnectorContext(block_size=32)


def test_block_contiguous_layer_tensors_are_passed_through_unchanged() -> None:
    kv = torch.zeros(8, 2, 32, 64)  # [blocks, heads, block_size, 2 * head]: vLLM's CPU layout
    assert check_kv_caches({"layer.0": kv}, CONTEXT)["layer.0"] is kv


def test_a_layout_whose_blocks_are_not_contiguous_is_refused_naming_layer_and_strides() -> None:
    head_major = torch.zeros(2, 8, 32, 64).transpose(0, 1)  # same shape, heads outermost in memory
    with pytest.raises(ValueError, match=r"layer 'layer.0' .* strides \[2048, 16384, 64, 1\]: its blocks are not"):
        check_kv_caches({"layer.0": head_major}, CONTEXT)


def test_mla_shaped_caches_are_refused() -> None:
    with pytest.raises(ValueError, match="MLA and state-space layers are not supported"):
        check_kv_caches({"layer.0": torch.zeros(8, 32, 576)}, CONTEXT)


def route_as_under_vllm(names: set[str] | None = None) -> None:
    """``route_logs_to_vllm`` with no root handler, as in a vLLM process (pytest gives the root its own)."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        route_logs_to_vllm(names or set())
    finally:
        root.handlers[:] = saved


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger, logging.Logger]]:
    names = ("vllm", "kvconn", "kvconn_someplugin")
    saved = [(logging.getLogger(n), list(logging.getLogger(n).handlers), logging.getLogger(n).level) for n in names]
    yield tuple(logger for logger, _, _ in saved)  # type: ignore[misc]
    for logger, handlers, level in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = True


def test_kvconn_and_plugin_logs_go_to_vllms_handlers_at_vllms_level(
    loggers: tuple[logging.Logger, logging.Logger, logging.Logger],
) -> None:
    vllm_logger, kvconn_logger, plugin_logger = loggers
    handler = logging.Handler()
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)
    route_as_under_vllm({"kvconn_someplugin"})
    for logger in (kvconn_logger, plugin_logger):
        assert logger.handlers == [handler] and logger.level == logging.INFO and not logger.propagate


def test_nothing_is_routed_when_the_process_configured_the_root_logger(
    loggers: tuple[logging.Logger, logging.Logger, logging.Logger],
) -> None:
    vllm_logger, kvconn_logger, _ = loggers
    vllm_logger.addHandler(logging.Handler())
    route_logs_to_vllm()  # pytest has given the root logger its handlers
    assert logging.getLogger().handlers and kvconn_logger.handlers == [] and kvconn_logger.propagate


def test_loggers_the_operator_configured_are_left_alone(
    loggers: tuple[logging.Logger, logging.Logger, logging.Logger],
) -> None:
    vllm_logger, kvconn_logger, _ = loggers
    vllm_logger.addHandler(logging.Handler())
    own = logging.NullHandler()
    kvconn_logger.addHandler(own)
    route_as_under_vllm()
    assert kvconn_logger.handlers == [own]


def test_reports_of_several_workers_sum_counters_and_take_the_smallest_private_gauge() -> None:
    """Tensor parallelism: offload's store sequence number must be one every worker has reached, not a sum."""
    from kvconn import KVConnectorOutput
    from kvconn_vllm.reports import ReportCollector, WorkerReport, encode_report

    def report(saved: int, stores_done: int) -> bytes:
        stats = {"blocks_saved": saved, "_stores_done": stores_done, "_pool_slots": 64}
        return encode_report(WorkerReport({"offload": KVConnectorOutput(stats=stats)}))

    merged, _ = ReportCollector(["offload"], world_size=2).collect([report(3, 7), report(3, 5)])
    assert merged["offload"].stats == {"blocks_saved": 6, "_stores_done": 5, "_pool_slots": 64}


class _ReadCountingTable(list[int]):
    """One of vLLM's block-id lists, counting how often it is read."""

    reads = 0

    def __iter__(self) -> Iterator[int]:
        _ReadCountingTable.reads += 1
        return super().__iter__()


def _vllm_decode_step(new_block_ids: list[Any]) -> Any:
    """A vLLM ``SchedulerOutput`` of decode steps for ``r0``, ``r1``, ... (attributes only, as the adapter reads it)."""
    from types import SimpleNamespace

    req_ids = [f"r{i}" for i in range(len(new_block_ids))]
    cached = SimpleNamespace(
        req_ids=req_ids,
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=new_block_ids,
        num_computed_tokens=[100] * len(req_ids),
    )
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(req_ids, 1),
        total_num_scheduled_tokens=len(req_ids),
        finished_req_ids=set(),
    )


def test_translation_copies_no_table_nobody_reads_and_a_read_table_is_the_readers_own() -> None:
    """kvconn's cost per step must not grow with tables a connector never reads, nor may it hand out vLLM's lists."""
    from kvconn_vllm.translate import translate_scheduler_output

    vllm_tables = [(_ReadCountingTable([4, 5]),), None, (_ReadCountingTable([9]),)]
    _ReadCountingTable.reads = 0
    cached = translate_scheduler_output(_vllm_decode_step(vllm_tables), step=1).scheduled_cached_reqs
    assert _ReadCountingTable.reads == 0
    assert len(cached.new_block_ids) == 3 and cached.new_block_ids == [([4, 5],), None, ([9],)]
    first = cached.new_block_ids[0]
    assert first is not None
    first[0].append(6)  # a connector changing what it was given
    assert vllm_tables[0] is not None and vllm_tables[0][0] == [4, 5]  # vLLM's table, sent to its workers, is intact
    assert cached.new_block_ids[0] == ([4, 5],) and cached.new_block_ids[1:] == [None, ([9],)]
    assert cached.req_ids == ["r0", "r1", "r2"] and cached.resumed_from_preemption == [False] * 3


def test_per_request_lists_are_read_only_views_over_vllms_own() -> None:
    """Nothing per request is copied each step, and a plugin cannot change what vLLM sends its workers."""
    from kvconn_vllm.translate import translate_scheduler_output

    vllm_output = _vllm_decode_step([None, None])
    output = translate_scheduler_output(vllm_output, step=1)
    cached = output.scheduled_cached_reqs
    vllm_output.scheduled_cached_reqs.num_computed_tokens[1] = 101  # vLLM's list, seen through the view
    assert list(cached.num_computed_tokens) == [100, 101] and cached.req_ids[1:] == ["r1"] and "r0" in cached.req_ids
    assert output.num_computed_tokens_by_request() == {"r0": 100, "r1": 101}
    with pytest.raises(TypeError):
        output.num_scheduled_tokens["r0"] = 5  # type: ignore[index]
    with pytest.raises((TypeError, AttributeError)):
        cached.req_ids.append("r2")  # type: ignore[attr-defined]
    assert vllm_output.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert vllm_output.scheduled_cached_reqs.req_ids == ["r0", "r1"]


def test_the_usual_steps_flags_and_token_lists_are_one_value_repeated_and_encode_as_lists() -> None:
    """A step vLLM sends no tokens or resumed flags for costs O(1), and reads as the lists it stands for."""
    from kvconn.host.wire import decode_scheduler_output, encode_scheduler_output
    from kvconn_vllm.translate import ListView, Repeat, translate_scheduler_output

    output = translate_scheduler_output(_vllm_decode_step([None, None, None]), step=4)
    cached = output.scheduled_cached_reqs
    assert isinstance(cached.resumed_from_preemption, Repeat) and isinstance(cached.new_token_ids, Repeat)
    assert cached.resumed_from_preemption == [False] * 3 and cached.new_token_ids == [[], [], []]
    assert cached.resumed_from_preemption != [False] * 2 and cached.resumed_from_preemption != "FFF"
    assert repr(cached.resumed_from_preemption) == "Repeat([False, False, False])"
    with pytest.raises(TypeError):
        hash(cached.resumed_from_preemption)  # equal to a list, so unhashable like one
    assert cached.resumed_from_preemption[-3] is False and cached.new_token_ids[1:] == [[], []]
    assert list(zip(cached.req_ids, cached.resumed_from_preemption, strict=True))[2] == ("r2", False)
    assert False in cached.resumed_from_preemption and True not in cached.resumed_from_preemption
    with pytest.raises(IndexError, match="out of range for 3 requests"):
        cached.resumed_from_preemption[3]
    with pytest.raises((TypeError, AttributeError)):
        cached.new_token_ids.append([1])  # type: ignore[attr-defined]
    wire = decode_scheduler_output(encode_scheduler_output(output)).scheduled_cached_reqs
    assert wire.resumed_from_preemption == [False] * 3 and wire.new_token_ids == [[], [], []]
    assert ListView(Repeat(False, 0)) == [] and False not in Repeat(False, 0) and list(Repeat(0, 2)) == [0, 0]
