"""The reference model's tokens depend on every element of the KV it reads, in its place.

A request computes its prompt; then its KV cache is changed in one way, and
the tokens it goes on to generate are held to an unchanged run's. Any single
element changed, and any rearrangement that keeps every element but moves it
(K and V exchanged, token slots reversed, heads or two blocks or two layers
exchanged, a block moved between KV-cache groups), changes them. Each
rearrangement keeps the plain sum of what the request reads, which the model
read before it weighed every element by its place: that model saw none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconn.context import KVCacheGroupSpec
from kvconn.reference import Engine

PROMPT = [(7 * i + 3) % 1000 for i in range(40)]  # blocks 0 and 1 full, block 2 partly (16-token blocks)
TWO_GROUPS = (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",)))

Mutation = Callable[[dict[str, Any], list[list[int]]], None]


def _generate(mutate: Mutation | None, **shape: Any) -> tuple[list[int], int]:
    """The tokens of PROMPT's request, with ``mutate(kv_caches, tables)`` applied after its prefill step.

    Also returns the plain sum of the integer bit patterns of the changed
    blocks' KV once mutated, over every layer: what a sum-reading model reads.
    """
    with Engine(None, num_blocks=32, **shape) as engine:
        request = engine.add_request(PROMPT, max_tokens=6, request_id="r")
        engine.step()  # the whole prompt computes (and samples its first token) in one step
        tables = [list(t) for t in engine.scheduler.kv_cache_manager.get_block_ids("r")]
        if mutate is not None:
            mutate(engine.worker.kv_caches, tables)
        blocks = sorted({b for table in tables for b in table[:2]})
        plain_sum = sum(int(kv[blocks].view(_bits(kv)).sum()) for kv in engine.worker.kv_caches.values())
        engine.run_until_done()
        return list(request.output_token_ids), plain_sum


def _bits(kv: Any) -> Any:
    import torch

    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[kv.element_size()]


def _exchange_kv(kv: dict[str, Any], tables: list[list[int]]) -> None:
    block = kv["layer.0"][tables[0][1]]
    block.copy_(block.flip(0))


def _reverse_slots(kv: dict[str, Any], tables: list[list[int]]) -> None:
    block = kv["layer.1"][tables[0][0]]
    block.copy_(block.flip(1))


def _exchange_heads(kv: dict[str, Any], tables: list[list[int]]) -> None:
    block = kv["layer.0"][tables[0][0]]
    block.copy_(block.flip(2))


def _exchange_blocks(kv: dict[str, Any], tables: list[list[int]]) -> None:
    first, second = tables[0][0], tables[0][1]
    for layer in kv.values():
        layer[[first, second]] = layer[[second, first]]


def _exchange_layers(kv: dict[str, Any], tables: list[list[int]]) -> None:
    block = tables[0][0]
    zero, one = kv["layer.0"][block].clone(), kv["layer.1"][block].clone()
    kv["layer.0"][block], kv["layer.1"][block] = one, zero


def _exchange_groups(kv: dict[str, Any], tables: list[list[int]]) -> None:
    """Each group's block 0 holds the other group's (two groups, one layer each)."""
    zero, one = kv["layer.0"][tables[0][0]].clone(), kv["layer.1"][tables[1][0]].clone()
    kv["layer.0"][tables[0][0]], kv["layer.1"][tables[1][0]] = one, zero


REARRANGEMENTS: dict[str, tuple[Mutation, dict[str, Any]]] = {
    "K and V exchanged": (_exchange_kv, {}),
    "token slots reversed": (_reverse_slots, {}),
    "heads exchanged": (_exchange_heads, {}),
    "two blocks exchanged": (_exchange_blocks, {}),
    "two layers exchanged": (_exchange_layers, {}),
    "two groups' blocks exchanged": (_exchange_groups, {"kv_cache_groups": TWO_GROUPS}),
}


@pytest.mark.parametrize("name", REARRANGEMENTS)
def test_a_rearranged_block_changes_the_tokens(name: str) -> None:
    mutate, shape = REARRANGEMENTS[name]
    want, want_sum = _generate(None, **shape)
    got, got_sum = _generate(mutate, **shape)
    assert got_sum == want_sum, "the rearrangement should keep every element (and so the sum) of the blocks"
    assert got[0] == want[0], "the first token is sampled before the mutation"
    assert got[1:] != want[1:], f"{name}: the model did not see it"


@settings(max_examples=40, deadline=None)
@given(
    layer=st.sampled_from(["layer.0", "layer.1"]),
    block=st.integers(0, 1),
    kv_index=st.integers(0, 1),
    slot=st.integers(0, 15),
    head=st.integers(0, 1),
    dim=st.integers(0, 7),
    delta=st.sampled_from([1, -1, 2, 255, -4096]),
)
def test_any_single_element_changed_changes_the_tokens(
    layer: str, block: int, kv_index: int, slot: int, head: int, dim: int, delta: int
) -> None:
    """One element's bit pattern moved by ``delta`` (one ulp, a sign, an exponent bit...): the tokens change."""

    def mutate(kv: dict[str, Any], tables: list[list[int]]) -> None:
        element = kv[layer][tables[0][block], kv_index, slot, head, dim : dim + 1].view(_bits(kv[layer]))
        element += delta

    want, _ = _generate(None)
    got, _ = _generate(mutate)
    assert got[1:] != want[1:]


def test_tensor_parallel_ranks_generate_the_single_rank_tokens() -> None:
    """Each rank holds its shard of the heads; their digests add up to the single-rank model's."""
    import torch

    from kvconn.reference.model import ReferenceModel

    full = ReferenceModel(num_kv_heads=4, head_dim=8, vocab_size=32_000, dtype=torch.float16, device="cpu")
    ranks = [
        ReferenceModel(
            num_kv_heads=2, head_dim=8, vocab_size=32_000, dtype=torch.float16, device="cpu", tp_rank=r, tp_size=2
        )
        for r in range(2)
    ]
    inputs = full.kv_inputs([11, 22, 33])
    for layer in range(2):
        values = full.kv_values(inputs, layer)
        assert torch.equal(torch.cat([m.kv_values(inputs, layer) for m in ranks], dim=2), values)
        weights = full.read_weights(layer)
        assert torch.equal(torch.cat([m.read_weights(layer) for m in ranks], dim=1), weights)


def test_a_tensor_parallel_engine_generates_the_single_rank_engine_s_tokens() -> None:
    """Two ranks, each a worker with half of the heads: their reads add up before sampling."""
    with Engine(None, num_kv_heads=4) as engine:
        want = engine.generate([PROMPT], max_tokens=6)
    with Engine(None, num_kv_heads=4, tp_size=2) as engine:
        assert [w.model.num_kv_heads for w in engine.workers] == [2, 2]
        assert engine.generate([PROMPT], max_tokens=6) == want


def test_a_rank_holding_the_other_rank_s_shard_changes_the_tokens() -> None:
    """Rank 1's cache holding rank 0's shard of a block (a rank-blind store key): the tokens change."""
    with Engine(None, num_kv_heads=4, tp_size=2) as engine:
        want = engine.generate([PROMPT], max_tokens=6)
    with Engine(None, num_kv_heads=4, tp_size=2) as engine:
        request = engine.add_request(PROMPT, max_tokens=6, request_id="r")
        engine.step()
        block = engine.scheduler.kv_cache_manager.get_block_ids("r")[0][0]
        for layer in ("layer.0", "layer.1"):
            engine.workers[1].kv_caches[layer][block] = engine.workers[0].kv_caches[layer][block]
        engine.run_until_done()
        assert request.output_token_ids[1:] != want[0][1:]
