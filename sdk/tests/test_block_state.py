"""KVConnectorBlockState: offered-only lazy resolution, the legacy view, and its refusal to travel."""

from __future__ import annotations

import copy
import pickle
import warnings
from unittest.mock import MagicMock

import msgspec
import pytest

from kvconn import BlockStateSerializationError, KVConnectorBlockState, KVConnectorMetadata
from kvconn.host.wire import encode_metadata


def make_state(offered: set[str]) -> tuple[KVConnectorBlockState, MagicMock]:
    tables = {"a": ([1, 2],), "b": ([3],)}
    resolver = MagicMock(side_effect=tables.__getitem__)
    return KVConnectorBlockState(offered, resolver), resolver


def test_request_outside_the_offered_set_is_none_and_never_resolved() -> None:
    state, resolver = make_state({"a"})
    assert state.get_block_ids("b") is None
    resolver.assert_not_called()
    assert state.get_block_ids("a") == ([1, 2],)
    resolver.assert_called_once_with("a")


def test_resolver_is_called_on_every_access_because_tables_grow() -> None:
    table = [1]
    state = KVConnectorBlockState({"a"}, lambda req_id: (list(table),))
    assert state.get_block_ids("a") == ([1],)
    table.append(7)
    assert state.get_block_ids("a") == ([1, 7],)


def test_pickling_and_deepcopy_raise_the_explanatory_error() -> None:
    state, _ = make_state({"a"})
    for attempt in (pickle.dumps, copy.deepcopy):
        with pytest.raises(BlockStateSerializationError, match="get_block_ids"):
            attempt(state)
    assert copy.copy(state).req_ids == {"a"}


def test_metadata_holding_the_state_cannot_be_encoded() -> None:
    class LeakyMetadata(KVConnectorMetadata):
        state: object = None

    state, _ = make_state({"a"})
    with pytest.raises(BlockStateSerializationError, match=r"connector .leaky.*get_block_ids"):
        encode_metadata("leaky", LeakyMetadata(state=state))
    with pytest.raises(TypeError):  # plain msgspec refuses it too
        msgspec.msgpack.encode(state)


def test_legacy_mapping_view_is_lazy_read_only_and_warns_at_the_callers_line() -> None:
    state, resolver = make_state({"a"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        view = state.block_ids
    assert caught[0].category is DeprecationWarning
    assert caught[0].filename == __file__
    assert "get_block_ids" in str(caught[0].message)
    resolver.assert_not_called()
    assert "a" in view and "b" not in view
    assert len(view) == 1 and list(view) == ["a"]
    assert view["a"] == ([1, 2],) and view.get("b") is None
    with pytest.raises(KeyError):
        view["b"]
    with pytest.raises(TypeError):
        view["a"] = ([9],)  # type: ignore[index]
    assert dict(view) == {"a": ([1, 2],)}


def test_from_block_ids_builds_an_equivalent_state_for_old_callers() -> None:
    state = KVConnectorBlockState.from_block_ids({"x": ([4, 5],)})
    assert state.req_ids == {"x"}
    assert state.get_block_ids("x") == ([4, 5],)
    assert state.get_block_ids("y") is None
