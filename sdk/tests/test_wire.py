"""The wire format: round trips, and errors that name the connector."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import msgspec
import pytest

from kvconn import KVConnectorBlockState, KVConnectorMetadata, ModelRunnerOutput, WireError
from kvconn.host.wire import (
    decode_model_runner_output,
    decode_scheduler_output,
    encode_metadata,
    encode_model_runner_output,
    encode_scheduler_output,
)
from kvconn.outputs import CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput
from kvconn.reference import Engine


class Tables(KVConnectorMetadata):
    tables: dict[str, list[int]] = msgspec.field(default_factory=dict)


class Other(KVConnectorMetadata):
    count: int


def output(metadata: dict[str, KVConnectorMetadata] | None) -> SchedulerOutput:
    return SchedulerOutput(
        step=3,
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], ([4],), 0)],
        scheduled_cached_reqs=CachedRequestData(["b"], [False], [[9]], [None], [16]),
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        finished_req_ids={"c"},
        kv_connector_metadata=metadata,
    )


def test_scheduler_output_round_trips_with_each_connectors_type() -> None:
    original = output({"x": Tables(tables={"a": [4]}), "y": Other(count=2)})
    decoded = decode_scheduler_output(encode_scheduler_output(original), {"x": Tables, "y": Other})
    assert decoded == original
    assert isinstance(decoded.kv_connector_metadata["y"], Other)  # type: ignore[index]


def test_msgpack_is_much_smaller_than_pickle() -> None:
    original = output({"x": Tables(tables={str(i): list(range(64)) for i in range(64)})})
    assert len(encode_scheduler_output(original)) < len(pickle.dumps(original))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (print, "holds a callable"),
        (Engine, "holds a callable"),
        (object(), "holds a object"),
    ],
)
def test_metadata_that_is_not_plain_data_is_refused_with_the_connector_named(value: Any, expected: str) -> None:
    class Leaky(KVConnectorMetadata):
        thing: Any = None

    with pytest.raises(WireError, match=f"connector 'leaky'.*{expected}") as err:
        encode_metadata("leaky", Leaky(thing=value))
    assert err.value.connector == "leaky"


class ReadOnlyList(Sequence[int]):
    """A read-only view such as an engine adapter hands out instead of its own list."""

    def __init__(self, items: list[int]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]


class Views(KVConnectorMetadata):
    ids: list[int]
    tokens: dict[str, int]


def test_read_only_views_kept_in_metadata_go_as_the_lists_and_dicts_they_show() -> None:
    built = Views(ids=ReadOnlyList([3, 1, 2]), tokens=MappingProxyType({"a": 16}))  # type: ignore[arg-type]
    decoded = msgspec.msgpack.decode(encode_metadata("views", built), type=Views)
    assert decoded == Views(ids=[3, 1, 2], tokens={"a": 16})


def test_the_block_states_legacy_mapping_never_travels() -> None:
    class Leaky(KVConnectorMetadata):
        tables: Any = None

    state = KVConnectorBlockState({"a"}, lambda req_id: ([1],))
    with pytest.warns(DeprecationWarning), pytest.raises(WireError, match="connector 'leaky'"):
        encode_metadata("leaky", Leaky(tables=state.block_ids))


def test_corrupt_or_truncated_bytes_are_a_wire_error() -> None:
    data = encode_scheduler_output(output({"x": Tables()}))
    with pytest.raises(WireError, match="scheduler output could not be decoded"):
        decode_scheduler_output(data[: len(data) // 2], {"x": Tables})
    with pytest.raises(WireError, match="could not be decoded"):
        decode_model_runner_output(b"\x93garbage")


def test_metadata_of_the_wrong_type_or_an_unknown_connector_names_it() -> None:
    data = encode_scheduler_output(output({"x": Tables(tables={"a": [1]})}))
    with pytest.raises(WireError, match="connector 'x' could not be decoded as Other") as err:
        decode_scheduler_output(data, {"x": Other})
    assert err.value.connector == "x"
    with pytest.raises(WireError, match="connector 'x', which this worker does not run"):
        decode_scheduler_output(data, {"y": Tables})


def test_model_runner_output_round_trips() -> None:
    original = ModelRunnerOutput(["a"], {"a": [5]}, {"x": KVConnectorOutput(finished_sending={"a"}, stats={"n": 1.0})})
    assert decode_model_runner_output(encode_model_runner_output(original)) == original
