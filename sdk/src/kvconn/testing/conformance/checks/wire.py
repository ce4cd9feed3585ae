"""KV020-KV022: the metadata on the wire."""

from __future__ import annotations

from ....errors import BlockStateSerializationError, ConnectorError, WireError
from ....wire import encode_metadata
from ..catalog import check
from ..observe import non_plain_data
from ..results import Violation
from ..scenarios import Arrival, Scenario, Trace, prompt
from ..session import Session

_PLAIN_FIX = (
    "build metadata from plain data only: resolve tables with block_state.get_block_ids(req_id) into "
    "lists of ints; never store the block state, a resolver, a request or the scheduler output"
)


def _wire_errors(session: Session) -> None:
    for trace in session.standard_traces():
        exc = trace.exception
        if isinstance(exc, (WireError, BlockStateSerializationError)) or (
            isinstance(exc, ConnectorError) and isinstance(exc.__cause__, TypeError) and "not an instance" in str(exc)
        ):
            raise Violation(f"in {trace.error}")


@check(
    "KV020",
    "metadata-roundtrip",
    fix="type every Metadata field precisely (list[int], not Any; tuples where you build tuples), and build "
    "fresh lists each step instead of handing out your own state",
    requires=("scheduler",),
)
def metadata_roundtrip(session: Session) -> None:
    """Every step's metadata decodes on the worker equal to what the scheduler built, and is never changed after.

    Catches metadata whose fields lose their type over the wire (a tuple in
    an ``Any`` field arrives as a list, a Struct as a dict), and metadata
    that shares a mutable object with the connector's own state: mutating it
    on a later step changes what an in-process worker sees after the fact.
    """
    _wire_errors(session)
    for trace in session.standard_traces():
        for record in trace.records:
            if record.metadata is None:
                continue
            if record.decoded != record.metadata:
                raise Violation(
                    f"in {trace.where()}, step {record.step}: built {record.metadata!r} but the worker decoded "
                    f"{record.decoded!r}"
                )
            if record.encoded is not None and encode_metadata(session.connector, record.metadata) != record.encoded:
                raise Violation(
                    f"in {trace.where()}, step {record.step}: the metadata changed after build_connector_meta "
                    f"returned it (now {record.metadata!r})"
                )


@check("KV021", "metadata-plain", fix=_PLAIN_FIX, requires=("scheduler",))
def metadata_plain(session: Session) -> None:
    """Metadata is plain data: no callable, no block state, nothing that reaches the scheduler.

    Catches the defect the lazy block state invites: keeping the block state
    (or its resolver, bound to the whole KV cache manager) in the metadata to
    resolve tables on the worker. It cannot cross a process boundary, and in
    process it would read tables from the wrong step. Also catches requests,
    the scheduler output and other engine objects in metadata.
    """
    _wire_errors(session)
    for trace in session.standard_traces():
        for record in trace.records:
            found = non_plain_data(record.metadata) if record.metadata is not None else []
            if found:
                raise Violation(f"in {trace.where()}, step {record.step}: {'; '.join(found[:3])}")


SMALL_CACHE, LARGE_CACHE = 32, 8192


def _size_scenario(num_blocks: int) -> Scenario:
    """Requests one after another: a small pool recycles block ids, a large one keeps handing out new ones."""
    seed = 900 + num_blocks  # prompts of their own: neither run may hit what the other saved
    arrivals = tuple(Arrival(f"r{i}", prompt(49, seed + i), 12, at_step=4 * i) for i in range(24))
    return Scenario(
        f"sequential@{num_blocks}-blocks",
        "24 requests arriving one every 4 steps",
        arrivals,
        options={"num_blocks": num_blocks, "enable_prefix_caching": False},
    )


@check(
    "KV022",
    "metadata-size",
    fix="carry only the block ids you act on this step: no per-block bitmaps, free lists or other "
    "state that grows with the cache",
    requires=("scheduler",),
)
def metadata_size(session: Session) -> None:
    """Metadata grows with the block ids it carries, not with the size of the KV cache.

    Catches connectors that ship cache-sized state every step (a bitmap of
    all blocks, the free list, a dense array of per-block flags): harmless in
    a test with 64 blocks, a per-step copy of megabytes in production.
    The same requests run with 32 and with 8192 blocks.
    """
    small, large = (session.trace(_size_scenario(n)) for n in (SMALL_CACHE, LARGE_CACHE))
    for trace in (small, large):
        if trace.error:
            raise Violation(f"the connector raised in {trace.error}")
    small_bytes, large_bytes = _total(small), _total(large)
    allowance = small_bytes // 4 + 16 * len(large.records)
    if large_bytes > small_bytes + allowance:
        raise Violation(
            f"{small_bytes} metadata bytes over {len(small.records)} steps with a {SMALL_CACHE}-block cache, "
            f"{large_bytes} bytes with {LARGE_CACHE} blocks, for the same requests and block ids"
        )


def _total(trace: Trace) -> int:
    return sum(len(r.encoded or b"") for r in trace.records)
