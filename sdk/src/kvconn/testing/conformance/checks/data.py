"""KV040-KV041: what a saving and loading connector does to the generated tokens.

These run on the reference engine whatever the driver (they need the
worker side and a model): a first request computes and saves a prefix, a
second request sharing it (its local blocks gone: prefix caching is off)
must load it through the connector, and every token must equal a run
without the connector. The reference model's next token depends on the KV it
reads, so a wrong, stale or missing block changes the output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ....engine import Engine
from ..catalog import check
from ..driver import DriverSpec
from ..reference import ReferenceDriver
from ..results import Violation
from ..scenarios import MAX_STEPS, TWO_GROUPS, prompt
from ..session import Session


@dataclass(frozen=True)
class PrefixReuse:
    """Request ``a`` runs alone; then ``b``, whose prompt starts with ``shared_blocks`` of ``a``'s tokens.

    ``a`` generates past the shared blocks' end, so the last shared block is
    filled by a decode step (a block-fill step). ``repeats`` more requests
    with ``b``'s prompt follow it.
    """

    name: str
    options: Mapping[str, Any]
    a_len: int
    a_max: int
    shared_blocks: int
    b_suffix: int
    b_max: int = 4
    repeats: int = 0
    seed: int = 0


ROUND_TRIPS = (
    PrefixReuse("chunked", {"max_num_batched_tokens": 32}, a_len=53, a_max=12, shared_blocks=4, b_suffix=7, seed=11),
    PrefixReuse("two-groups", {"kv_cache_groups": TWO_GROUPS}, a_len=60, a_max=6, shared_blocks=4, b_suffix=9, seed=12),
    PrefixReuse("large-blocks", {"block_size": 256, "num_blocks": 16}, 262, 8, shared_blocks=1, b_suffix=10, seed=13),
)
FAILED_LOAD = PrefixReuse("failed-load", {}, a_len=70, a_max=3, shared_blocks=4, b_suffix=5, repeats=1, seed=14)


class _Run:
    """Add requests and run them to completion; the same calls on an engine or a driver."""

    def __init__(
        self, add: Callable[[str, Sequence[int], int], None], step: Callable[[], object], busy: Callable[[], bool]
    ):
        self.add, self._step, self._busy = add, step, busy

    def finish(self) -> None:
        for _ in range(MAX_STEPS):
            if not self._busy():
                return
            self._step()
        raise RuntimeError(f"requests still unfinished after {MAX_STEPS} steps (a load never reported finished?)")


def _play(case: PrefixReuse, run: _Run, generated: Callable[[str], list[int]], block_size: int) -> dict[str, list[int]]:
    a = prompt(case.a_len, case.seed)
    run.add("a", a, case.a_max)
    run.finish()
    shared = (a + tuple(generated("a")))[: case.shared_blocks * block_size]
    if len(shared) < case.shared_blocks * block_size:
        raise RuntimeError(f"scenario {case.name!r} is misconfigured: 'a' is shorter than the shared prefix")
    b = prompt(len(shared) + case.b_suffix, case.seed + 1, shared)
    names = ["b", *(f"b{i}" for i in range(1, case.repeats + 1))]
    for name in names:
        run.add(name, b, case.b_max)
        run.finish()
    return {name: generated(name) for name in ["a", *names]}


_EXPECTED: dict[str, dict[str, list[int]]] = {}


def _expected(case: PrefixReuse) -> dict[str, list[int]]:
    """The tokens without a connector: one run per case and process (the model is deterministic)."""
    if case.name not in _EXPECTED:
        _EXPECTED[case.name] = _baseline(case)
    return _EXPECTED[case.name]


def _baseline(case: PrefixReuse) -> dict[str, list[int]]:
    engine = Engine(None, **{"enable_prefix_caching": False, **case.options})
    requests: dict[str, Any] = {}

    def add(req_id: str, tokens: Sequence[int], max_tokens: int) -> None:
        requests[req_id] = engine.add_request(tokens, max_tokens, request_id=req_id)

    run = _Run(add, engine.step, engine.scheduler.has_work)
    return _play(case, run, lambda r: list(requests[r].output_token_ids), engine.scheduler.block_size)


def _with_connector(
    session: Session, case: PrefixReuse, *, fail_first_load: bool
) -> tuple[dict[str, list[int]], ReferenceDriver]:
    spec = replace(DriverSpec(session.connector, session.config, enable_prefix_caching=False), **case.options)
    driver = ReferenceDriver(spec, fail_first_load=fail_first_load)
    try:
        run = _Run(driver.add_request, driver.step, driver.has_work)
        try:
            return _play(case, run, driver.generated, spec.block_size), driver
        except Exception as exc:
            raise Violation(
                f"in the {case.name!r} prefix-reuse run the connector raised: {type(exc).__name__}: {exc}"
            ) from None
    finally:
        driver.close()


def _compare(case: PrefixReuse, got: Mapping[str, list[int]], want: Mapping[str, list[int]], when: str) -> None:
    for req_id, tokens in want.items():
        if got[req_id] != tokens:
            raise Violation(
                f"in the {case.name!r} prefix-reuse run{when}, request {req_id!r} generated {got[req_id]}, "
                f"but {tokens} without the connector: it ran on wrong KV"
            )


@check(
    "KV040",
    "round-trip",
    fix="save each full block (every KV-cache group, every layer) on the step that fills it, keyed by its "
    "block hash, and load it into the block ids of the live table given to update_state_after_alloc",
    requires=("scheduler", "worker", "saves", "loads"),
)
def round_trip(session: Session) -> None:
    """A prefix saved by one request loads into another, and the tokens are exact.

    Catches connectors that load into the wrong blocks, load another
    prefix's data, miss a KV-cache group or layer, save a stale table on the
    block-fill step, or mishandle 256-token blocks and sliding-window null
    blocks; and savers whose prefix never loads back at all.
    """
    for case in ROUND_TRIPS:
        got, driver = _with_connector(session, case, fail_first_load=False)
        if driver.stats.prompt_tokens_loaded == 0:
            raise Violation(
                f"in the {case.name!r} prefix-reuse run, request 'b' shared {case.shared_blocks} full block(s) "
                "with 'a', whose local copies were gone, and the connector loaded no token"
            )
        _compare(case, got, _expected(case), "")


@check(
    "KV041",
    "load-failure",
    fix="do not save blocks that were loaded (or whose load failed); after the engine rolls a request back "
    "(num_computed_tokens decreases), keep going without asserting on progress",
    requires=("scheduler", "worker", "saves", "loads"),
)
def load_failure(session: Session) -> None:
    """A load reported failed is recomputed, and every token stays exact, for that request and later ones.

    The driver makes the connector's first load land garbage in its last
    block and reports that block failed to the engine, which rolls the
    request back and recomputes it. Catches connectors that crash when a
    request's computed tokens go backwards, that save the garbage they loaded
    (poisoning the store for the next request with the same prefix), and that
    lose track of the request afterwards.
    """
    got, driver = _with_connector(session, FAILED_LOAD, fail_first_load=True)
    if not driver.injected_failure:
        raise Violation(
            f"in the {FAILED_LOAD.name!r} run the connector loaded nothing, so no load could be made to fail"
        )
    _compare(FAILED_LOAD, got, _expected(FAILED_LOAD), " (its first load failed)")
    tracked = {role: n for role, n in driver.num_tracked_requests().items() if n}
    if tracked:
        raise Violation(f"after a failed load and every request ending, get_num_tracked_requests says {tracked}")
