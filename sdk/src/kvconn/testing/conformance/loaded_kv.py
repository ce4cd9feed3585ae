"""What a landed load put in the KV cache, block by block and layer by layer, against what the model computes.

The reference model's KV is a function of the token prefix, so the KV a
load should land is known without running anything. Under ``scrub_freed``
every freed block is filled with a pattern naming it (:func:`freed_value`),
so a block whose bytes were read after its free is recognised when loaded
back, and told apart from a block the load never wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...context import NULL_BLOCK_ID
from ...reference.model import ReferenceModel, prefix_hashes
from .fault_injection import GARBAGE

__all__ = ["FAILED_LOAD_GARBAGE", "FREED_BASE", "LoadedBlock", "audit_load", "freed_block", "freed_value"]

#: A freed block ``b`` holds ``FREED_BASE - (b % 1024) / 128`` in every element: exact in float16 and wider,
#: outside the model's KV range ([-1, 1]) and apart from an injected failure's garbage.
FREED_BASE = -8.0
_IDS = 1024
#: What an injected failed load leaves in a block (:data:`.fault_injection.GARBAGE`).
FAILED_LOAD_GARBAGE = GARBAGE


def freed_value(block_id: int) -> float:
    """The value every element of block ``block_id`` holds once it is freed."""
    return FREED_BASE - (block_id % _IDS) / 128


def freed_block(value: float) -> int | None:
    """The block (modulo 1024) whose free pattern ``value`` is, or ``None``."""
    k = (FREED_BASE - value) * 128
    return round(k) if 0 <= k < _IDS and abs(k - round(k)) < 1e-3 else None


@dataclass(frozen=True)
class LoadedBlock:
    """One layer of one loaded block that does not hold the KV the model computes for its position.

    ``holds`` says what it holds instead: ``"freed:X"`` (block ``X``'s free
    pattern: read after its free when ``X`` is another block, never written
    when it is this one), ``"zeros"`` (never written), ``"garbage"`` (what an
    injected failed load left), ``"partial:N"`` (the KV of its first ``N``
    tokens only: saved before it was full), ``"layer:K"`` (the KV
    of layer ``K`` at this position), ``"position:J"`` (this layer's KV of
    block ``J``), the right bytes in the wrong places (``"rearranged:kv"``:
    K and V exchanged; ``"rearranged:slots"``: its token slots in another
    order; ``"rearranged:heads"``: its heads in another order), ``"rank:R"``
    (tensor-parallel rank ``R``'s shard of this block: its key misses the rank),
    or ``"other"``. ``rank`` is the rank whose cache holds it.
    """

    req_id: str
    step: int
    layer: str
    group: int
    position: int
    block_id: int
    holds: str
    rank: int = 0


def audit_load(
    model: ReferenceModel,
    kv_caches: dict[str, Any],
    layers: Sequence[tuple[str, int]],
    *,
    req_id: str,
    step: int,
    token_ids: Sequence[int],
    table: Sequence[Sequence[int]],
    blocks: range,
    skip: set[int],
    seed: int = 0,
    ranks: Sequence[ReferenceModel] = (),
) -> list[LoadedBlock]:
    """The layers of the blocks at positions ``blocks`` of ``table`` that hold the wrong KV.

    ``layers`` are ``(name, group)`` in model order; blocks in ``skip`` (a
    load reported failed) are not audited; ``seed``: the request's adapter's
    (:func:`~kvconn.reference.model.adapter_seed`); ``ranks``: every tensor-parallel
    rank's model (``model`` among them), to tell another rank's shard.
    """
    block_size = kv_caches[layers[0][0]].shape[2]
    hashes = prefix_hashes(list(token_ids[: blocks.stop * block_size]), [], seed=seed)
    inputs = model.kv_inputs(hashes)
    # per layer: [positions, 2, block_size, heads, dim], the cache's layout
    expected = []
    for index in range(len(layers)):
        values = model.kv_values(inputs, index)
        expected.append(values.view(blocks.stop, block_size, *values.shape[1:]).transpose(1, 2))
    found = []
    rank = model.heads.start // model.num_kv_heads
    for index, (layer, group) in enumerate(layers):
        for position in blocks:
            if position >= len(table[group]):
                continue
            block_id = table[group][position]
            if block_id == NULL_BLOCK_ID or block_id in skip:
                continue
            actual = kv_caches[layer][block_id]
            if actual.equal(expected[index][position]):
                continue
            holds = _other_rank(actual, ranks, rank, inputs, index, position, block_size)
            holds = holds or _what(actual, expected, index, position)
            found.append(LoadedBlock(req_id, step, layer, group, position, block_id, holds, rank))
    return found


def _what(actual: Any, expected: list[Any], index: int, position: int) -> str:
    first = float(actual.flatten()[0])
    if bool((actual == first).all()):
        if first == 0:
            return "zeros"
        if first == FAILED_LOAD_GARBAGE:
            return "garbage"
        freed = freed_block(first)
        if freed is not None:
            return f"freed:{freed}"
    # per token slot: a block saved before it was full has its first tokens' KV only
    right = (actual == expected[index][position]).flatten(2).all(-1).all(0).tolist()
    if right[0] and not all(right):
        filled = right.index(False)
        if not any(right[filled:]):
            return f"partial:{filled}"
    rearranged = _rearranged(actual, expected[index][position])
    if rearranged is not None:
        return f"rearranged:{rearranged}"
    for other, values in enumerate(expected):
        if other != index and actual.equal(values[position]):
            return f"layer:{other}"
    for other in range(len(expected[index])):
        if other != position and actual.equal(expected[index][other]):
            return f"position:{other}"
    return "other"


def _rearranged(actual: Any, expected: Any) -> str | None:
    """Which axis of a block (``[2, block_size, heads, dim]``) holds the right elements in another order, if one does.

    K and V exchanged; the token slots, or the heads, permuted (each slot's, or
    head's, values are some other slot's, or head's, of the block).
    """
    if actual.equal(expected.flip(0)):
        return "kv"
    for axis, name in ((1, "slots"), (2, "heads")):
        found = actual.movedim(axis, 0).flatten(1)
        wanted = expected.movedim(axis, 0).flatten(1)
        if all(any(row.equal(other) for other in wanted) for row in found):
            return name
    return None


def _other_rank(
    actual: Any, ranks: Sequence[ReferenceModel], rank: int, inputs: Any, index: int, position: int, block_size: int
) -> str | None:
    """``"rank:R"`` when ``actual`` is rank ``R``'s shard of the block (another rank's), else ``None``."""
    span = slice(position * block_size, (position + 1) * block_size)
    for other, model in enumerate(ranks):
        if other != rank and actual.equal(model.kv_values(inputs[span], index).transpose(0, 1)):
            return f"rank:{other}"
    return None
