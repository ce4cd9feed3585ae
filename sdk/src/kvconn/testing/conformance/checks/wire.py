"""The metadata on the wire."""

from __future__ import annotations

from ....host.wire import encode_metadata
from ..catalog import SCHEDULER_CHECK, check
from ..metadata_blocks import non_plain_data
from ..results import ConformanceFailure, ScenarioBroken
from ..scenarios import Arrival, Scenario, Trace, prompt
from ..session import METADATA_FIX, Session


@check(
    "KV020",
    "metadata-roundtrip",
    fix="type every Metadata field precisely (list[int], not Any; tuples where you build tuples), and build "
    "fresh lists each step instead of handing out your own state",
    **SCHEDULER_CHECK,
)
def metadata_roundtrip(session: Session) -> None:
    """Every step's metadata decodes on the worker equal to what the scheduler built, and is never changed after.

    Catches metadata whose fields lose their type over the wire (a tuple in
    an ``Any`` field arrives as a list, a Struct as a dict), and metadata
    that shares a mutable object with the connector's own state: mutating it
    on a later step changes what an in-process worker sees after the fact.
    """
    for trace in session.completed_traces():
        for record in trace.records:
            if record.metadata is None:
                continue
            if record.decoded != record.metadata:
                raise ConformanceFailure(
                    f"in {trace.where()}, step {record.step}: built {record.metadata!r} but the worker decoded "
                    f"{record.decoded!r}"
                )
            if record.encoded is not None and encode_metadata(session.connector, record.metadata) != record.encoded:
                raise ConformanceFailure(
                    f"in {trace.where()}, step {record.step}: the metadata changed after build_connector_meta "
                    f"returned it (now {record.metadata!r})"
                )


@check("KV021", "metadata-plain", fix=METADATA_FIX, **SCHEDULER_CHECK)
def metadata_plain(session: Session) -> None:
    """Metadata is plain data: no callable, no block state, nothing that reaches the scheduler.

    Catches the defect the lazy block state invites: keeping the block state
    (or its resolver, bound to the whole KV cache manager) in the metadata to
    resolve tables on the worker. It cannot cross a process boundary, and in
    process it would read tables from the wrong step. Also catches requests,
    the scheduler output and other engine objects in metadata.
    """
    for trace in session.completed_traces():
        for record in trace.records:
            found = non_plain_data(record.metadata) if record.metadata is not None else []
            if found:
                raise ConformanceFailure(f"in {trace.where()}, step {record.step}: {'; '.join(found[:3])}")


SMALL_CACHE, LARGE_CACHE = 32, 8192
NUM_SEQUENTIAL, ARRIVAL_EVERY = 24, 4
#: Steady-state windows of the sequential run (a request arrives every 4 steps until step 92): early and late.
EARLY_STEPS, LATE_STEPS = range(12, 40), range(64, 92)


def _size_scenario(num_blocks: int) -> Scenario:
    """Requests one after another: a small pool recycles block ids, a large one keeps handing out new ones."""
    seed = 900 + num_blocks  # prompts of their own: neither run may hit what the other saved
    arrivals = tuple(
        Arrival(f"r{i}", prompt(49, seed + i), 12, at_step=ARRIVAL_EVERY * i) for i in range(NUM_SEQUENTIAL)
    )
    return Scenario(
        f"sequential@{num_blocks}-blocks",
        "24 requests arriving one every 4 steps",
        arrivals,
        options={"num_blocks": num_blocks, "enable_prefix_caching": False},
    )


@check(
    "KV022",
    "metadata-size",
    fix="carry only the block ids you act on this step: no per-block bitmaps or free lists (they grow with "
    "the cache), no list of every request served (it grows with history)",
    **SCHEDULER_CHECK,
)
def metadata_size(session: Session) -> None:
    """Metadata grows with the block ids it carries, not with the size of the KV cache nor with history.

    Catches connectors that ship cache-sized state every step (a bitmap of
    all blocks, the free list, a dense array of per-block flags): harmless in
    a test with 64 blocks, a per-step copy of megabytes in production.
    The same requests run with 32 and with 8192 blocks. Also catches
    metadata that grows with every request served (ids of every request
    saved so far, a log never pruned): in the same long run of identical
    requests, late steps must not carry more than early ones.
    """
    small, large = (session.trace(_size_scenario(n)) for n in (SMALL_CACHE, LARGE_CACHE))
    for trace in (small, large):
        if trace.error:
            raise ScenarioBroken(trace.error, trace.fix)
    small_bytes, large_bytes = _total(small), _total(large)
    allowance = small_bytes // 4 + 16 * len(large.records)
    if large_bytes > small_bytes + allowance:
        raise ConformanceFailure(
            f"{small_bytes} metadata bytes over {len(small.records)} steps with a {SMALL_CACHE}-block cache, "
            f"{large_bytes} bytes with {LARGE_CACHE} blocks, for the same requests and block ids"
        )
    early, late = (_total(small, steps) for steps in (EARLY_STEPS, LATE_STEPS))
    if late > early + early // 4 + 16 * len(LATE_STEPS):
        raise ConformanceFailure(
            f"{early} metadata bytes over steps {EARLY_STEPS.start}-{EARLY_STEPS.stop - 1} of a steady stream of "
            f"like requests, {late} bytes over steps {LATE_STEPS.start}-{LATE_STEPS.stop - 1}: it grows with history"
        )


def _total(trace: Trace, steps: range | None = None) -> int:
    records = trace.records if steps is None else trace.records[steps.start : steps.stop]
    return sum(len(r.encoded or b"") for r in records)
