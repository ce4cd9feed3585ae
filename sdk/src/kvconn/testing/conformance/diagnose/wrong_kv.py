"""Loaded KV that is wrong: which save or load paired which block with which hash, and why.

From the layers of the loaded blocks that hold the wrong bytes (what
:func:`~..loaded_kv.audit_load` found), the steps' metadata and the live
tables: a block read after its free, a stale table kept across a preemption,
an index off by some positions, a partial block, a failed load saved back, a
store key that misses the layer, a KV-cache group never loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..driver import StepRecord
from ..loaded_kv import LoadedBlock
from ..metadata_blocks import HashedBlock, hashed_blocks
from .diagnosis import Diagnosis

__all__ = ["RANK_KEY_FIX", "explain_wrong_kv", "shifted_pairing", "transfer_kind"]

#: The fix for a store key without the tensor-parallel rank (the check's own, and the diagnosis's).
RANK_KEY_FIX = (
    "key each block by the tensor-parallel rank as well as its hash (context.tp_rank; "
    "kvconn.hashing.context_namespace(context) covers it): each rank holds its own shard of the heads"
)


def transfer_kind(path: str) -> str:
    """``"load"``, ``"save"`` or ``"transfer"``: what the metadata field at ``path`` (``metadata.loads[2]``) is."""
    lowered = path.lower()
    if "load" in lowered or "recv" in lowered:
        return "load"
    if any(word in lowered for word in ("save", "store", "put", "send")):
        return "save"
    return "transfer"


def shifted_pairing(
    where: str, path: str, req_id: str, block_id: int, index: int, table: Sequence[Sequence[int]]
) -> Diagnosis | None:
    """A block id paired with the hash of block ``index`` that sits at another position of the live table.

    For a request whose table was never replaced (no preemption), that is an
    index off by the distance between the two positions, in a load (the
    bytes saved for block ``index`` land in another block) or in a save (the
    bytes of another block are stored under block ``index``'s hash).
    """
    at = next((j for group in table for j, b in enumerate(group) if b == block_id), None)
    if at is None:
        return None
    kind, shift = transfer_kind(path), at - index
    direction = f"{abs(shift)} position{'s' if abs(shift) != 1 else ''} {'later' if shift > 0 else 'earlier'}"
    what = {
        "load": f"the bytes saved for block {index} are written into the block at position {at}, {direction}",
        "save": f"the bytes of the block at position {at} are stored under the hash of block {index}, {direction}",
        "transfer": f"block {index}'s hash travels with the block at position {at}, {direction}",
    }[kind]
    observed = (
        f"{where}: a {kind} ({path}) pairs block {block_id} with the hash of block {index} of {req_id}, but block "
        f"{block_id} is at position {at} of its live table {table}: {what}"
    )
    sign = "+" if shift > 0 else "-"
    fix = (
        f"in the {kind}, pair the hash of block i with the block id at position i of the table "
        f"(block_ids[group][i]): the {kind} takes its block ids {direction} than their hashes; look for a "
        f"'{sign} {abs(shift)}' in the index where the {kind}'s block ids are taken from the table"
    )
    return Diagnosis(observed, fix)


def explain_wrong_kv(
    wrong: Sequence[LoadedBlock],
    groups: Sequence[Sequence[str]],
    records: Sequence[StepRecord],
    block_hashes: Mapping[str, Sequence[bytes]],
    freed_at: Mapping[int, Sequence[int]],
) -> Diagnosis | None:
    """Why the loaded KV differs from the connector-less run's, from the layers of the loaded blocks that hold
    the wrong bytes (:func:`~.loaded_kv.audit_load`); ``None`` when every load landed the right KV.

    ``groups``: each KV-cache group's layer names; ``records``, ``block_hashes`` (per request) and ``freed_at``
    (the steps each block was freed) say when a block read after its free was saved, and from which table.
    """
    if not wrong:
        return None
    first = wrong[0]
    where = f"the load of {first.req_id!r} at step {first.step}"
    for moved in (w for w in wrong if w.holds.startswith("position:") or _freed_id(w) not in (None, w.block_id % 1024)):
        traced = _traced(moved, records, block_hashes, freed_at)
        if traced is not None:
            return traced
    partial = next((w for w in wrong if w.holds.startswith("partial:")), None)
    if partial is not None:
        filled = partial.holds.split(":")[1]
        return Diagnosis(
            f"{_loaded(partial)} holds the right KV for its first {filled} tokens only: it was saved before it was "
            "full",
            "save a block only once it is full: blocks below (num_computed_tokens + num_scheduled_tokens) // "
            "block_size; a prefill chunk may end in the middle of a block, which a later step completes",
        )
    garbage = next((w for w in wrong if w.holds == "garbage"), None)
    if garbage is not None:
        return Diagnosis(
            f"{_loaded(garbage)} holds what a failed load left in a block: a block whose load failed (reported in "
            "get_block_ids_with_load_errors) was saved and loaded back",
            "never save a block that was loaded, or whose load failed: save only blocks the engine computed "
            "(from num_computed_tokens on, after any rollback)",
        )
    shard = next((w for w in wrong if w.holds.startswith("rank:")), None)
    if shard is not None:
        other = shard.holds.split(":")[1]
        return Diagnosis(
            f"{_loaded(shard)} holds rank {other}'s shard of it: rank {other}'s value under rank {shard.rank}'s key "
            "(the store key misses the rank)",
            RANK_KEY_FIX,
        )
    rearranged = next((w for w in wrong if w.holds.startswith("rearranged:")), None)
    if rearranged is not None:
        observed, fix = _REARRANGED[rearranged.holds.split(":")[1]]
        return Diagnosis(
            f"{_loaded(rearranged)} holds the right bytes in the wrong places: {observed}",
            f"{fix}, in the engine's layout (context.kv_layout): a model reads every element in its place",
        )
    layers = [layer for group in groups for layer in group]
    holds = {w.holds for w in wrong}
    if len(holds) == 1 and first.holds.startswith("layer:"):
        source = layers[int(first.holds.split(":")[1])]
        wrong_layers = sorted({w.layer for w in wrong})
        return Diagnosis(
            f"{where}: layers {wrong_layers} of the loaded blocks hold the KV of layer {source!r} at the same "
            f"position: every layer loaded {source!r}'s bytes (the store key misses the layer)",
            "key each saved block by its layer as well as its block hash (one entry per layer and block), and load "
            "each layer's own bytes",
        )
    unwritten = [w for w in wrong if w.holds == "zeros" or w.holds.startswith("freed:")]
    bad_groups = sorted({w.group for w in unwritten})
    if len(unwritten) == len(wrong) and len(bad_groups) < len(groups):
        names = "; ".join(f"{g} ({', '.join(groups[g])})" for g in bad_groups)
        return Diagnosis(
            f"{where}: KV-cache group {names} never loaded: its blocks still hold what they held before the load, "
            "while the other groups' blocks are right",
            "save and load every KV-cache group: for each group g, the blocks block_ids[g] of the layers "
            "context.kv_cache_groups[g].layer_names, not only group 0",
        )
    if len(unwritten) == len(wrong):
        return Diagnosis(
            f"{where}: the blocks it claimed ({sorted({w.block_id for w in wrong})}) were never written",
            "claim in get_num_new_matched_tokens only the blocks you hold, copy each block you claimed into the "
            "table given to update_state_after_alloc, and report one you could not load in "
            "get_block_ids_with_load_errors",
        )
    shifts = {int(w.holds.split(":")[1]) - w.position for w in wrong if w.holds.startswith("position:")}
    if len(shifts) == 1 and all(w.holds.startswith("position:") for w in wrong):
        shift = shifts.pop()
        return Diagnosis(
            f"{where}: the block at position {first.position} holds the KV of position {first.position + shift} "
            f"(every wrong block is {abs(shift)} position{'s' if abs(shift) != 1 else ''} off)",
            f"pair block i's hash with the block at position i of the table: the transfer is off by {shift:+d}",
        )
    return Diagnosis(
        f"{where}: block {first.block_id} (position {first.position}, layer {first.layer!r}) holds "
        f"{_HOLDS.get(first.holds.split(':')[0], first.holds)} ({len(wrong)} layer-block(s) wrong in all)"
    )


_HOLDS = {"other": "bytes that are no KV of this prompt", "position": "the KV of another position"}
#: What a block whose elements are all there, in other places, holds (``rearranged:<axis>``), and the fix.
_REARRANGED = {
    "kv": ("its K where V belongs and its V where K belongs (K and V exchanged)", "copy K to K and V to V"),
    "slots": ("its token slots in another order", "copy token slot j of a saved block into slot j"),
    "heads": ("its heads in another order", "copy head h of a saved block into head h"),
}


def _loaded(wrong: LoadedBlock) -> str:
    """Where a wrong layer-block landed: the load, its step, the rank (when there are several), block and layer."""
    rank = f"on tensor-parallel rank {wrong.rank}, " if wrong.holds.startswith("rank:") else ""
    return (
        f"the load of {wrong.req_id!r} at step {wrong.step}: {rank}block {wrong.block_id} (position "
        f"{wrong.position}, layer {wrong.layer!r})"
    )


def _freed_id(loaded: LoadedBlock) -> int | None:
    return int(loaded.holds.split(":")[1]) if loaded.holds.startswith("freed:") else None


def _saved_from(
    loaded: LoadedBlock, records: Sequence[StepRecord], block_hashes: Mapping[str, Sequence[bytes]]
) -> tuple[StepRecord, HashedBlock, str | None, int | None, bool] | None:
    """The save of the hash ``loaded`` should hold: its step, the metadata entry, the request whose table it was
    read from, that block's position in that request's live table then (``None``: not in it), and whether the
    request had been preempted by then."""
    block_hash = block_hashes[loaded.req_id][loaded.position]
    owners = [r for r, hashes in block_hashes.items() if loaded.position < len(hashes) and
              hashes[loaded.position] == block_hash]  # fmt: skip
    preempted: set[str] = set()
    for record in records:
        preempted |= record.preempted
        for hashed in hashed_blocks(record.metadata, (), named=False) if record.metadata is not None else ():
            if hashed.block_hash != block_hash or _transfer_is_load(hashed.path):
                continue
            for owner in owners:
                table = record.tables.get(owner)
                group = table[loaded.group] if table is not None and loaded.group < len(table) else []
                if hashed.block_id in group:
                    return record, hashed, owner, group.index(hashed.block_id), owner in preempted
            return record, hashed, owners[0] if owners else None, None, bool(set(owners) & preempted)
    return None


def _transfer_is_load(path: str) -> bool:
    return transfer_kind(path) == "load"


def _traced(
    loaded: LoadedBlock,
    records: Sequence[StepRecord],
    block_hashes: Mapping[str, Sequence[bytes]],
    freed_at: Mapping[int, Sequence[int]],
) -> Diagnosis | None:
    """A loaded block holding another block's bytes (its free pattern, or the KV of another position), explained
    by the save that stored them.

    A save naming the block at its live position whose bytes are another
    block's free pattern read the block after its free (after the step); a
    save naming a block at another position, or not in the table, used a
    stale table (after preemption) or an index off by the distance.
    """
    found = _saved_from(loaded, records, block_hashes)
    if found is None:
        return None
    record, hashed, owner, at, preempted = found
    step, save = record.step, f"the save at step {record.step} ({hashed.path})"
    if loaded.holds.startswith("freed:") and at == loaded.position:
        frees = [f for f in freed_at.get(hashed.block_id, ()) if f >= step]
        by_preemption = bool(frees) and any(owner in r.preempted for r in records if r.step == frees[0])
        freed = f"it was freed at step {frees[0]}{' (preemption)' if by_preemption else ''}" if frees else "freed"
        fix = (
            "read a save's bytes out of the KV cache by the end of its step (by wait_for_save): a copy deferred to "
            "a later hook (the next step's start_load_kv, a thread) reads blocks the engine freed and reused "
            "meanwhile; "
            + (
                "preemption frees a request's blocks without calling request_finished, so delaying the free does not "
                "cover it"
                if by_preemption
                else "or return True from request_finished while the copy is pending and report the request in "
                "finished_sending once it is done"
            )
        )
        return Diagnosis(
            f"{_seen(loaded)}: {save} named block {hashed.block_id} at position {at} of {owner!r}'s live table, "
            f"and read its bytes after the step, once {freed}: KV read after its free",
            fix,
        )
    if at == loaded.position:
        return None  # the save was right: the load is not
    if preempted or at is None:
        where = f"position {at} of" if at is not None else "no position of"
        return Diagnosis(
            f"{_seen(loaded)}: {save} stored block {hashed.block_id}, at {where} {owner!r}'s live table, under the "
            f"hash of its block {loaded.position}: a table kept from before {owner!r}'s preemption (a stale table)",
            "read the table each step with block_state.get_block_ids(req_id): a request resumed after preemption "
            "has a new table (new_block_ids on resume is the whole table); never keep one across steps",
        )
    shift = at - loaded.position
    return Diagnosis(
        f"{_seen(loaded)}: {save} stored block {hashed.block_id}, at position {at} of {owner!r}'s live table, "
        f"under the hash of its block {loaded.position}",
        f"in the save, pair the hash of block i with the block at position i of the table (block_ids[group][i]): "
        f"it is off by {shift:+d}",
    )


def _seen(loaded: LoadedBlock) -> str:
    what = (
        f"the pattern the engine writes into block {_freed_id(loaded)} when it frees it"
        if loaded.holds.startswith("freed:")
        else f"the KV of position {loaded.holds.split(':')[1]}"
    )
    return (
        f"{loaded.req_id!r} loaded block {loaded.block_id} (position {loaded.position}, layer {loaded.layer!r}) "
        f"holding {what}"
    )
