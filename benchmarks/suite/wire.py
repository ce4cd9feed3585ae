"""Wire: encode + decode of a realistic ``SchedulerOutput`` with metadata, msgspec against pickle.

The output is a busy decode step: 256 running requests (one new token each,
a new block for every sixteenth), 4 new requests with 1024-token prompts, 8
finished ids, and one connector's metadata listing 64 block saves and 64
block loads (request id, 32-byte block hash, group, block id).

Two more rows put the ratio in context. "pickle, vLLM-style dataclasses"
pickles the same data held in plain dataclasses, as vLLM's ``SchedulerOutput``
is. "object floor" decodes the same bytes with no schema at all: it only
creates the lists, ints and strings any decoder of this output must create,
so pickle / (msgspec encode + floor) is the best ratio any codec could reach.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import sys
from functools import cache
from typing import Any

import msgspec
from benchlib import Bench, median_times, parse_args

from kvconn import CachedRequestData, KVConnectorMetadata, NewRequestData, SchedulerOutput
from kvconn.host.wire import decode_scheduler_output, encode_scheduler_output

__all__ = ["BenchMetadata", "Transfer", "as_dataclasses", "main", "realistic_output"]


class Transfer(msgspec.Struct, array_like=True):
    """One block to save or load, as offload/store connectors describe it."""

    req_id: str
    block_hash: bytes
    group: int
    block_id: int


class BenchMetadata(KVConnectorMetadata):
    saves: list[Transfer] = msgspec.field(default_factory=list)
    loads: list[Transfer] = msgspec.field(default_factory=list)


def realistic_output(num_running: int = 256, num_new: int = 4, num_transfers: int = 64) -> SchedulerOutput:
    cached = CachedRequestData()
    for i in range(num_running):
        cached.req_ids.append(f"req-{i}")
        cached.resumed_from_preemption.append(False)
        cached.new_token_ids.append([1000 + i])
        cached.new_block_ids.append(([50_000 + i],) if i % 16 == 0 else None)
        cached.num_computed_tokens.append(1024 + i)
    new = [
        NewRequestData(f"new-{i}", list(range(i, i + 1024)), (list(range(i * 64, i * 64 + 64)),), 0)
        for i in range(num_new)
    ]
    scheduled = {r: 1 for r in cached.req_ids} | {r.req_id: 1024 for r in new}

    def transfer(i: int) -> Transfer:
        return Transfer(f"req-{i}", hashlib.sha256(str(i).encode()).digest(), 0, i + 1)

    meta = BenchMetadata(
        saves=[transfer(i) for i in range(num_transfers)], loads=[transfer(-i) for i in range(num_transfers)]
    )
    return SchedulerOutput(
        step=1000,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids={f"done-{i}" for i in range(8)},
        kv_connector_metadata={"store": meta},
    )


@cache
def _dataclass_twin(struct_type: type[msgspec.Struct]) -> Any:
    fields = [(f.name, Any) for f in msgspec.structs.fields(struct_type)]
    twin = dataclasses.make_dataclass(f"{struct_type.__name__}DC", fields)
    twin.__module__ = __name__
    setattr(sys.modules[__name__], twin.__name__, twin)  # so that pickle finds the class by name
    return twin


def as_dataclasses(value: Any) -> Any:
    """The same data with every Struct replaced by a plain dataclass of the same fields."""
    if isinstance(value, msgspec.Struct):
        names = [f.name for f in msgspec.structs.fields(value)]
        return _dataclass_twin(type(value))(*(as_dataclasses(getattr(value, n)) for n in names))
    if isinstance(value, list | tuple):
        return type(value)(as_dataclasses(v) for v in value)
    if isinstance(value, dict):
        return {k: as_dataclasses(v) for k, v in value.items()}
    return value


def _pickle_round_trip(obj: object) -> object:
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    output = realistic_output(*((16, 1, 4) if args.quick else (256, 4, 64)))
    repeat = 3 if args.quick else 9
    types = {"store": BenchMetadata}
    assert decode_scheduler_output(encode_scheduler_output(output), types) == output  # the round trip is exact
    assert _pickle_round_trip(output) == output
    twin = as_dataclasses(output)
    data = encode_scheduler_output(output)
    wire_s, pickle_s, twin_s, encode_s, floor_s = median_times(
        lambda: decode_scheduler_output(encode_scheduler_output(output), types),
        lambda: _pickle_round_trip(output),
        lambda: _pickle_round_trip(twin),
        lambda: encode_scheduler_output(output),
        lambda: msgspec.msgpack.decode(data),
        repeat=repeat,
    )
    pickled = len(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))
    bench = Bench("wire: SchedulerOutput encode + decode", ["format", "bytes", "encode+decode us", "vs msgspec"])
    bench.row("msgspec (kvconn.host.wire)", len(data), wire_s * 1e6, 1.0)
    bench.row("pickle (highest protocol)", pickled, pickle_s * 1e6, pickle_s / wire_s)
    bench.row("pickle, vLLM-style dataclasses", len(pickle.dumps(twin, protocol=pickle.HIGHEST_PROTOCOL)),
              twin_s * 1e6, twin_s / wire_s)  # fmt: skip
    bench.row("object floor (msgspec encode + schema-less decode)", len(data), (encode_s + floor_s) * 1e6,
              (encode_s + floor_s) / wire_s)  # fmt: skip
    bench.target("msgspec >= 5x faster than pickle", pickle_s / wire_s >= 5, f"{pickle_s / wire_s:.1f}x")
    bench.notes.append(
        f"ceiling: pickle / (encode + object floor) = {pickle_s / (encode_s + floor_s):.1f}x; "
        f"against vLLM-style dataclasses: {twin_s / wire_s:.1f}x"
    )
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
