"""The storage checks behind ``kvconn validate --engine sglang``, driven through SGLang's own code.

Each check runs a store connector as SGLang's HiCache L3 tier (the factory's
dynamic path, SGLang's host pools, its ``HiCacheController``) and judges what
happens to the pages: the same contract the store layer promises vLLM, in
SGLang's terms. Results are the conformance suite's own types
(:class:`~kvconn.testing.conformance.ConnectorReport`), so the CLI reports,
prints JSON and exits as for the other engines. Kept apart from the suite's
checks (``kvconn.testing.conformance``): only the store contract is shared.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from kvconn.store import HEADER_BYTES
from kvconn.testing.conformance import CheckResult, CheckSkipped, ConformanceFailure, ConnectorReport

from ..spec import StoreSpecError, check_config, load_store_class
from .faults import FaultyStore, faulty_class

__all__ = ["SGLANG_CHECKS", "SGLangCheck", "run_sglang_conformance", "selected"]


@dataclass(frozen=True)
class SGLangCheck:
    id: str
    name: str
    run: Callable[[_Run], None]
    fix: str


@dataclass
class _Run:
    """One check's store: the connector's name and config, with a namespace of the check's own."""

    store: str
    config: dict[str, Any]

    def extra(self) -> dict[str, Any]:
        from .rig import extra

        return extra(self.store, self.config)


#: The checks, in the order they run (each registered by :func:`check`).
SGLANG_CHECKS: list[SGLangCheck] = []


def check(check_id: str, name: str, fix: str) -> Callable[[Callable[[_Run], None]], Callable[[_Run], None]]:
    """Register the decorated function as check ``check_id``; ``fix`` completes a failure that names none."""

    def register(fn: Callable[[_Run], None]) -> Callable[[_Run], None]:
        SGLANG_CHECKS.append(SGLangCheck(check_id, name, fn, fix))
        return fn

    return register


def _tokens(pages: int, start: int = 10_000) -> list[int]:
    from .rig import PAGE

    return list(range(start, start + pages * PAGE))


def _controller(run: _Run, kind: str = "mha", layout: str = "page_first", **kw: Any) -> Any:
    from .rig import Controller

    return Controller.over(run.extra(), kind, layout, **kw)


def _same_pages(ctl: Any, saved: Any, loaded: Any, n: int, what: str) -> None:
    from .rig import same_pages

    bad = same_pages(ctl.host, saved, loaded, n)
    if bad is not None:
        raise ConformanceFailure(f"{what}: page {bad} came back with other bytes than were saved")


@check(
    "SG001",
    "loads as SGLang's dynamic HiCache backend, answers in its shapes",
    "subclass kvconn.store.StoreConnector; answer every batched call, never None",
)
def check_contract(run: _Run) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    ctl = _controller(run)
    try:
        if not isinstance(ctl.backend, HiCacheStorage):
            raise ConformanceFailure(f"SGLang's factory built a {type(ctl.backend).__name__}, not a HiCacheStorage")
        unknown = [f"{i:064x}" for i in range(2)]
        answers = {
            "batch_exists": ctl.backend.batch_exists(unknown),
            "batch_get_v1": ctl.backend.batch_get_v1(unknown, ctl.host.alloc(2 * ctl.host.page_size)),
            "batch_exists([])": ctl.backend.batch_exists([]),
        }
        if answers != {"batch_exists": 0, "batch_get_v1": [False, False], "batch_exists([])": 0}:
            raise ConformanceFailure(f"answers to unknown pages in SGLang's shapes were {answers}")
    finally:
        ctl.close()


@check(
    "SG002",
    "round trip of known bytes, every host layout (MHA and MLA)",
    "a get must return exactly the bytes put under the key (BlockStore contract)",
)
def check_round_trip(run: _Run) -> None:
    from .rig import MHA_LAYOUTS, MLA_LAYOUTS, fill_known

    for kind, layouts in (("mha", MHA_LAYOUTS), ("mla", MLA_LAYOUTS)):
        for layout in layouts:
            ctl = _controller(run, kind, layout)
            try:
                fill_known(ctl.host, seed=hash((kind, layout)) & 0xFFFF)
                tokens = _tokens(3, start=20_000 + 100 * len(layout))
                saved = ctl.host.alloc(len(tokens))
                stored = ctl.backup(tokens, saved)
                if stored != len(tokens):
                    raise ConformanceFailure(f"{kind} {layout}: the backup stored {stored} of {len(tokens)} tokens")
                got = ctl.prefetch(tokens)
                if got.loaded_tokens != len(tokens):
                    raise ConformanceFailure(f"{kind} {layout}: the prefetch loaded {got.loaded_tokens} tokens")
                _same_pages(ctl, saved, got.host_indices, 3, f"{kind} {layout}")
            finally:
                ctl.close()


@check("SG003", "partial hit: the stored prefix, no more", "contains must say missing for keys never stored")
def check_partial_hit(run: _Run) -> None:
    from .rig import PAGE, fill_known

    ctl = _controller(run)
    try:
        fill_known(ctl.host, seed=31)
        tokens = _tokens(5, start=30_000)
        saved = ctl.host.alloc(2 * PAGE)
        ctl.backup(tokens[: 2 * PAGE], saved)
        got = ctl.prefetch(tokens)
        if (got.hit_tokens, got.loaded_tokens) != (2 * PAGE, 2 * PAGE):
            raise ConformanceFailure(f"2 of 5 pages stored; the prefetch hit {got.hit_tokens} and loaded "
                                     f"{got.loaded_tokens} tokens (page size {PAGE})")  # fmt: skip
        _same_pages(ctl, saved, got.host_indices, 2, "a partial hit")
    finally:
        ctl.close()


@check(
    "SG004",
    "a corrupt value is a miss, the prefetch stops before it",
    "put must be write-once and get must return the stored length",
)
def check_corrupt_value(run: _Run) -> None:
    import torch

    from .rig import PAGE, fill_known, page

    ctl = _controller(run, "mha", "layer_first")
    try:
        fill_known(ctl.host, seed=41)
        tokens = _tokens(4, start=40_000)
        tier = ctl.backend.tier
        bad = tier.key(ctl.hashes(tokens)[1])
        junk = b"\xa5" * (HEADER_BYTES + tier.views.page_bytes)
        tier.guard.call("put", lambda store: store.put([bad], [junk]))
        ctl.backup(tokens, ctl.host.alloc(len(tokens)))
        got = ctl.prefetch(tokens)
        if got.loaded_tokens != PAGE:
            raise ConformanceFailure(f"page 1 held a foreign value; the prefetch loaded {got.loaded_tokens} tokens, "
                                     f"not the {PAGE} before it")  # fmt: skip
        if got.host_indices is not None and page(ctl.host, got.host_indices, 1).view(torch.uint8).eq(0xA5).all():
            raise ConformanceFailure("the foreign value's bytes reached the host pool")
    finally:
        ctl.close()


def _faulty(run: _Run, ctl: Any) -> FaultyStore:
    stores: list[FaultyStore] = []
    ctl.swap_store_class(faulty_class(load_store_class(run.store), stores))
    ctl.backend.tier.guard.call("contains", lambda store: store.contains([b"kvconn/validate-open"]))
    return stores[-1]


@check(
    "SG005",
    "a hung store costs the deadline, not SGLang's prefetch",
    "leave inline_calls False for a store that can wait",
)
def check_deadline(run: _Run) -> None:
    ctl = _controller(run)
    try:
        tokens = _tokens(3, start=50_000)
        store = _faulty(run, ctl)
        ctl.backup(tokens, ctl.host.alloc(len(tokens)))
        store.mode = "hang"
        deadline = float(ctl.backend.tier.connector.config.timeout_s)
        start = time.monotonic()
        got = ctl.prefetch(tokens, timeout=deadline + 30)
        took = time.monotonic() - start
        store.released.set()
        if got.hit_tokens != 0:
            raise ConformanceFailure(f"a hung store gave a hit of {got.hit_tokens} tokens")
        if took > deadline + 2.0:
            raise ConformanceFailure(f"a hung store held SGLang's prefetch {took:.1f} s (deadline {deadline:g} s)")
    finally:
        ctl.close()


@check(
    "SG006",
    "a store that is down: misses and skipped backups, counted",
    "raise from a store that cannot answer; never answer 'missing' for 'don't know'",
)
def check_store_down(run: _Run) -> None:
    ctl = _controller(run, "mla", "page_first")
    try:
        tokens = _tokens(3, start=60_000)
        store = _faulty(run, ctl)
        store.mode = "down"
        stored = ctl.backup(tokens, ctl.host.alloc(len(tokens)))
        hit = ctl.prefetch(tokens).hit_tokens
        stats = ctl.backend.get_stats() or {}
        if stored or hit:
            raise ConformanceFailure(f"a store that is down stored {stored} and hit {hit} tokens")
        if not stats.get("save_failed_store_off"):
            raise ConformanceFailure(f"the skipped backups were not counted: {stats}")
    finally:
        ctl.close()


@check(
    "SG007",
    "deployments that differ never read each other's pages",
    "never rewrite the keys kvconn.store hands the store",
)
def check_namespace(run: _Run) -> None:
    from .rig import fill_known

    tokens = _tokens(2, start=70_000)
    writer = _controller(run, model="kvconn/validate-a")
    try:
        fill_known(writer.host, seed=71)
        writer.backup(tokens, writer.host.alloc(len(tokens)))
    finally:
        writer.close()
    for what, kw in {
        "another model": {"model": "kvconn/validate-b"},
        "another host layout": {"layout": "layer_first", "model": "kvconn/validate-a"},
        "MLA": {"kind": "mla", "model": "kvconn/validate-a"},
    }.items():
        reader = _controller(run, **kw)
        try:
            hit = reader.prefetch(tokens).hit_tokens
        finally:
            reader.close()
        if hit:
            raise ConformanceFailure(f"a deployment with {what} hit {hit} tokens another deployment saved")


def selected(select: str | None) -> list[SGLangCheck]:
    """The checks ``--check PATTERN`` selects (an id glob, or part of a name), all without one."""
    return [c for c in SGLANG_CHECKS if not select or fnmatch(c.id, select) or select.lower() in c.name.lower()]


def run_sglang_conformance(
    store: str,
    *,
    config: Mapping[str, Any] | None = None,
    select: str | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ConnectorReport:
    """Every selected check against store connector ``store``; a load error for one that cannot serve SGLang."""
    try:
        import sglang.srt.managers.cache_controller  # noqa: F401
    except ImportError as exc:
        return ConnectorReport(store, load_error=f"--engine sglang needs SGLang installed (make test-sglang builds "
                                                 f".venv-sglang): {exc}")  # fmt: skip
    config = dict(config or {})
    try:
        check_config(load_store_class(store), store, config)
    except StoreSpecError as exc:
        return ConnectorReport(store, load_error=str(exc))
    except Exception as exc:
        return ConnectorReport(store, load_error=f"{type(exc).__name__}: {exc}")
    from .rig import init_sglang

    init_sglang()
    base = config.get("namespace", "")
    results = []
    for check in selected(select):
        run = _Run(store, {**config, "namespace": f"{base}validate-{check.id}-{uuid.uuid4().hex}"})
        try:
            check.run(run)
            result = CheckResult(check.id, check.name, "passed")
        except CheckSkipped as exc:
            result = CheckResult(check.id, check.name, "skipped", str(exc))
        except ConformanceFailure as exc:
            result = CheckResult(check.id, check.name, "failed", exc.report(check.fix))
        except Exception as exc:
            result = CheckResult(
                check.id, check.name, "failed", f"observed {type(exc).__name__}: {exc}; fix: {check.fix}"
            )
        results.append(result)
        if on_result is not None:
            on_result(result)
    return ConnectorReport(store, results)
