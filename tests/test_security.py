"""Security properties of block keys and plugin discovery."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconn import ConnectorContext, ConnectorHost, ConnectorNotFoundError
from kvconn.hashing import hash_blocks, namespace_key
from kvconn.store import BlockKeys

BASE = ConnectorContext(model="model-a", dtype="float16", block_size=16, tp_rank=0, tp_size=2)
OTHERS = [
    ConnectorContext(model="model-b", dtype="float16", block_size=16, tp_rank=0, tp_size=2),
    ConnectorContext(model="model-a", dtype="bfloat16", block_size=16, tp_rank=0, tp_size=2),
    ConnectorContext(model="model-a", dtype="float16", block_size=16, tp_rank=1, tp_size=2),
    ConnectorContext(model="model-a", dtype="float16", block_size=16, tp_rank=0, tp_size=2, kv_layout="HND"),
]
tokens = st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=80)


@settings(max_examples=200, deadline=None)
@given(ours=tokens, theirs=tokens, other=st.sampled_from(OTHERS))
def test_no_chosen_prompt_reaches_a_key_of_another_namespace(
    ours: list[int], theirs: list[int], other: ConnectorContext
) -> None:
    """Whatever prompt an attacker picks in one namespace, its keys never name a block of another."""
    mine, foreign = BlockKeys(BASE), BlockKeys(other)
    our_keys = {mine.key(0, h) for h in hash_blocks(ours, 16)}
    their_keys = {foreign.key(0, h) for h in hash_blocks(theirs, 16)}
    assert not our_keys & their_keys


def test_namespace_parts_cannot_be_shifted_into_each_other() -> None:
    assert namespace_key("ab", "c") != namespace_key("a", "bc")


def test_same_block_tokens_under_another_prefix_hash_differently() -> None:
    block = list(range(16))
    assert hash_blocks([1] * 16 + block, 16)[1] != hash_blocks([2] * 16 + block, 16)[1]


def test_the_host_honours_the_plugin_block_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCONN_DISABLE_PLUGINS", "dummy")
    with pytest.raises(ConnectorNotFoundError, match="KVCONN_DISABLE_PLUGINS"):
        ConnectorHost.from_names("dummy", role="scheduler")
    monkeypatch.setenv("KVCONN_DISABLE_PLUGINS", "")
    monkeypatch.setenv("KVCONN_PLUGINS", "offload")
    with pytest.raises(ConnectorNotFoundError, match="KVCONN_PLUGINS"):
        ConnectorHost.from_names(["offload", "dummy"], role="scheduler")
