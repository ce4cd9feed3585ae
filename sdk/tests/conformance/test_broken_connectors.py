"""The suite catches each bug class: every deliberately broken connector fails the check meant for it.

The broken connectors live in ``fixtures/kvconn_conformance_fixtures/broken.py``;
each changes one thing in a correct connector, the hook-level reference
(``kvconn.testing.raw_hook_connector.HookReferenceConnector``). It, the store connector over an in-memory
store (``kvconn.testing.memory_connector.MemoryConnector``) and the shipped dummy plugin pass everything.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections import Counter
from collections.abc import Callable

import pytest
from kvconn_conformance_fixtures import broken

from kvconn.testing.conformance import ConnectorReport, Session, list_checks, run_conformance
from kvconn.testing.conformance.catalog import get_check
from kvconn.testing.conformance.checks.data import RESUMED_PREFILL_FIX, compare_tokens, preempted_mid_prefill
from kvconn.testing.conformance.results import NOT_RUN, ConformanceFailure
from kvconn.testing.conformance.runs import PREEMPTED_SAVES, DataRun, Follow, Req, data_run
from kvconn.testing.conformance.scenarios import prompt
from kvconn.testing.conformance.session import METADATA_FIX
from kvconn.testing.conformance.waits import raise_hint
from kvconn.testing.memory_connector import fresh_namespace

BROKEN = "kvconn_conformance_fixtures.broken:"
BROKEN_FILE = inspect.getsourcefile(broken)
INDEXES_LIVE_BLOCKS_LINE = inspect.getsourcelines(broken.IndexesLiveBlocks.transfers)[1] + 5
_COUNT = itertools.count()
STORE = "kvconn.testing.memory_connector:MemoryConnector"
HOOK_REFERENCE = "kvconn.testing.raw_hook_connector:HookReferenceConnector"


def _failed(report: ConnectorReport) -> dict[str, str]:
    assert report.load_error is None, report.load_error
    return {r.id: r.message for r in report.results if r.status == "failed"}


#: Connectors whose failure's fix is the one for the mechanism observed, not the check's own (how it starts).
SPECIFIC_FIXES = {
    "NeverReleases": "report 'r0', 'r1', 'r2' in get_finished's finished_sending (once) as soon as the save that "
    "made request_finished return True no longer reads its blocks",
    "WrongLayerLoad": "key each saved block by its layer as well as its block hash",
    "OverClaims": "claim in get_num_new_matched_tokens only the blocks you hold",
    "ResavesLoaded": "never save a block that was loaded, or whose load failed",
    "PoisonsQuietly": "never save a block that was loaded, or whose load failed",
    "KeepsFirstTableUnnamed": "read the table each step with block_state.get_block_ids(req_id): a request resumed "
    "after preemption has a new table",
    "DeferredSaver": "read a save's bytes out of the KV cache by the end of its step (by wait_for_save)",
    "KeepsCountAcrossPreemption": RESUMED_PREFILL_FIX,
}


@pytest.mark.parametrize(
    ("connector", "check_id", "observed"),
    [
        ("NewBlocksOnly", "KV011", "filled a block without allocating one"),
        ("AccumulatedTables", "KV012", "from its table before preemption"),
        ("AccumulatedTables", "KV011", "not in its live table"),
        ("AssumesOffered", "KV013", "AssertionError: no table for r1"),
        ("BypassesOffered", "KV013", "resolved though not offered"),
        ("BypassesOffered", "KV014", "resolved though not offered"),
        ("EagerResolver", "KV014", "but its metadata uses none of them"),
        ("KeepsResolver", "KV021", "metadata holds a callable (KVCacheManager.get_block_ids)"),
        ("MutatesMetadata", "KV020", "but the worker decoded"),
        ("DenseMask", "KV022", "with 8192 blocks"),
        ("NeverReleases", "KV030", "nothing could be scheduled"),
        ("ReportsTwice", "KV031", "finished_sending reported"),
        ("LeaksRequests", "KV032", "get_num_tracked_requests says {'scheduler': 1}"),
        ("WrongLayerLoad", "KV040", "it ran on wrong KV"),
        ("ResavesLoaded", "KV041", "(its first load failed)"),
        ("IgnoresUnknownOptions", "KV005", "unknown field 'kvconn_no_such_field' was accepted"),
        ("AcceptsAnything", "KV005", "config field 'record_calls' accepts any value"),
        ("NoApiVersion", "KV003", "does not declare api_version"),
        ("TracksSdkVersion", "KV003", "declares api_version = kvconn.API_VERSION, which follows the SDK"),
        ("MisspeltHook", "KV006", "build_connector_metadata is not a hook and is never called: did you mean "
         "build_connector_meta?"),
        ("DeclaresLoadsWithoutHooks", "KV006", "declares loads = True but implements none of "
         "get_num_new_matched_tokens for its scheduler side"),
        ("StripsNullBlocks", "KV015", "the connector changed the table get_block_ids('r0') returned: "
         "[(1, 2, 3, 4), (0, 6, 7, 8)] became [(1, 2, 3, 4), (6, 7, 8)]"),
        ("GrowsHandedTable", "KV015", "in scenario 'chunked-prefill', step 1, the connector changed "
         "update_state_after_alloc 'r0' block_ids: [(1, 2, 3)] became [(1, 2, 3, 4, 5)]"),
        ("RemembersHistory", "KV022", "it grows with history"),
        ("ReportsUndelayedSends", "KV031", "finished_sending reported 'r0', which the engine was not waiting for: "
         "request_finished did not delay its free"),
        ("OverClaims", "KV040", "in the 'chunked-reuse' data run, request 'b' generated"),
        ("OverClaimsReported", "KV040", "reported 2 block(s) failed to load though nothing failed: it claimed "
         "more tokens than it holds"),
        ("SavesTouchedBlocks", "KV042", "in the 'mid-block-chunks' data run, request 'b0' generated"),
        ("KeepsFirstTableUnnamed", "KV043", "in the 'preempted-saves' data run, request 'b3' generated"),
        ("KeepsCountAcrossPreemption", "KV043", "in the 'preempted-prefill-reuse' data run ('a1' was preempted "
         "mid-prefill with 40 of its 64 prompt tokens computed, then resumed), request 'b' generated"),
        # a prompt preempted mid-prefill comes back with another table: the scenario shows it before any data run
        ("KeepsFirstTable", "KV012", "in scenario 'preempted-prefill', step 7: the metadata pairs block 6 with the "
         "hash of block 2 of r1, but position 2 of its live table ([6, 5, 3, 4],) holds [3]"),
        ("DeferredSaver", "KV044", "in the 'fill-step-saves' data run, request 'b0' generated"),
        ("CountsPendingSaves", "KV040", "failed to load though nothing failed: it claimed more tokens than it holds"),
        ("KeysByTokens", "KV047", "in the 'isolation' data run, request 'b' (cache_salt 'tenant-2') loaded 64 tokens "
         "of the prefix 'a' computed under another cache_salt: a block hash carries the cache_salt, so nothing was "
         "there to load for 'b' (a cross-tenant hit, whatever its tokens)"),
        ("PoisonsQuietly", "KV041", "in the 'failed-load-elsewhere' data run (its first load failed; 'b1' then ran "
         "on another engine instance sharing its store), request 'b1' generated"),
        ("RankBlindKeys", "KV048", "on tensor-parallel rank 0, block 5 (position 0, layer 'layer.0') holds rank 1's "
         "shard of it: rank 1's value under rank 0's key (the store key misses the rank)"),
        ("LoadsOncePerRequest", "KV049", "in the 'preempted-loads' data run ('b1' loaded 48 tokens, was preempted, and "
         "resumed with a new table to load again), request 'b1' generated"),
    ],
)  # fmt: skip
def test_broken_connector_fails_its_check(connector: str, check_id: str, observed: str) -> None:
    check = next(c for c in list_checks() if c.id == check_id)
    with _quiet():
        failed = _failed(run_conformance(BROKEN + connector, select=check_id))
    assert check_id in failed, f"{connector} passed {check_id}"
    message = failed[check_id]
    assert observed in message
    assert message.startswith("observed ") and "; fix: " in message
    assert message.split("; fix: ")[-1].startswith(SPECIFIC_FIXES.get(connector, check.fix))


@pytest.mark.parametrize(
    ("connector", "observed", "fix"),
    [
        ("MisspeltSaveOverride", "MisspeltSaveOverride.save_kv_layers is not a hook and is never called: it "
         "misspells save_kv_layer, so the HookReferenceConnector.save_kv_layer it inherits keeps running in its place",
         "rename MisspeltSaveOverride.save_kv_layers to save_kv_layer so that it overrides "
         "HookReferenceConnector.save_kv_layer"),
        ("MisspeltFinishOverride", "MisspeltFinishOverride.request_finish is not a hook and is never called: it "
         "misspells request_finished, so the HookReferenceConnector.request_finished it inherits keeps running",
         "rename MisspeltFinishOverride.request_finish to request_finished"),
        ("DisabledInheritedHook", "DisabledInheritedHook.get_block_ids_with_load_errors = None is not callable: "
         "the HookReferenceConnector.get_block_ids_with_load_errors it inherits is never called",
         "define get_block_ids_with_load_errors as a method, or delete the assignment in DisabledInheritedHook"),
    ],
)  # fmt: skip
def test_a_subclass_misnaming_or_disabling_an_inherited_hook_fails_hook_names(
    connector: str, observed: str, fix: str
) -> None:
    """The first failure is KV006, naming the inherited hook that runs (or never runs) instead."""
    with _quiet():
        report = run_conformance(BROKEN + connector)
    first = next(r for r in report.results if r.status == "failed")
    assert first.id == "KV006"
    assert first.message.count("; fix: ") == 1, first.message
    observed_part, fix_part = first.message.split("; fix: ")
    assert observed in observed_part and fix in fix_part


@pytest.mark.parametrize(
    ("connector", "observed", "fix"),
    [
        ("NeverReportsSave", "request 'r0' waits for finished_sending since step 33, when request_finished returned "
         "True for it (a delayed free): its blocks stay held until finished_sending reports it, and get_finished "
         "never reported it (and 2 more the same way: 'r1', 'r2')",
         "report 'r0', 'r1', 'r2' in get_finished's finished_sending (once)"),
        ("NeverReportsLoad", ("scenario 'preemption', step ", ": nothing could be scheduled for ", " steps and ",
         f" s ({raise_hint()}): request 'r3' "
         "waits for finished_recving since step 34, when get_num_new_matched_tokens returned (48, True) for it (an "
         "async load): it cannot be scheduled until finished_recving reports it, and get_finished never reported it"),
         "report 'r3' in get_finished's finished_recving (once) when the async load started for it"),
        ("IndexesLiveBlocks", "in build_connector_meta: IndexError: list index out of range, at "
         f"{BROKEN_FILE}:{INDEXES_LIVE_BLOCKS_LINE} in transfers: out.append(Transfer(request.request_id, group, "
         "live[i], request.block_hashes[i], i - blocks.start)); that step: the table of 'r0' holds null blocks "
         "(sliding window) at group 1 positions 0-1",
         f"make build_connector_meta ({BROKEN_FILE}:{INDEXES_LIVE_BLOCKS_LINE}) cope with what that step had: the "
         "table of 'r0' holds null blocks (sliding window) at group 1 positions 0-1"),
        ("LoadsOneSlotOff", "in scenario 'preemption', step 34: a load (metadata.loads[0]) pairs block 13 with the "
         "hash of block 0 of r3, but block 13 is at position 1 of its live table ([7, 13, 9, 2],): the bytes saved "
         "for block 0 are written into the block at position 1, 1 position later",
         "in the load, pair the hash of block i with the block id at position i of the table (block_ids[group][i]): "
         "the load takes its block ids 1 position later than their hashes; look for a '+ 1'"),
        # which request, block and step show it first varies from run to run (the order of the data runs' loads)
        ("DeferredCopyDelaysFree", ("it ran on wrong KV: ", " holding the pattern the engine writes into block ",
         " when it frees it: the save at step ", "and read its bytes after the step, once it was freed at step ",
         " (preemption): KV read after its free"),
         "read a save's bytes out of the KV cache by the end of its step (by wait_for_save): a copy deferred to a "
         "later hook (the next step's start_load_kv, a thread) reads blocks the engine freed and reused meanwhile; "
         "preemption frees a request's blocks without calling request_finished"),
        ("KeyWithoutLayer", "it ran on wrong KV: the load of 'b' at step 13: layers ['layer.0'] of the loaded blocks "
         "hold the KV of layer 'layer.1' at the same position: every layer loaded 'layer.1''s bytes (the store key "
         "misses the layer)",
         "key each saved block by its layer as well as its block hash (one entry per layer and block)"),
        ("FirstGroupOnly", "in the 'two-groups-reuse' data run, request 'b' generated",
         "save and load every KV-cache group: for each group g, the blocks block_ids[g]"),
        ("FirstGroupOnly", "it ran on wrong KV: the load of 'b' at step 6: KV-cache group 1 (layer.1) never loaded: "
         "its blocks still hold what they held before the load, while the other groups' blocks are right", ""),
        ("SavesTouchedBlocks", "block 13 (position 1, layer 'layer.0') holds the right KV for its first 8 tokens "
         "only: it was saved before it was full", "save a block only once it is full"),
        # the sum of what a request reads is unchanged: only a model that reads every element in its place sees these
        ("ExchangesKV", ("it ran on wrong KV: the load of 'b' at step ", "holds the right bytes in the wrong places: "
         "its K where V belongs and its V where K belongs (K and V exchanged)"), "copy K to K and V to V, in the "
         "engine's layout (context.kv_layout)"),
        ("ReversesSlots", ("it ran on wrong KV: the load of 'b' at step ", "holds the right bytes in the wrong "
         "places: its token slots in another order"), "copy token slot j of a saved block into slot j"),
        # its count runs ahead of a prompt preempted mid-prefill: the scenario shows the block acted on too early
        ("KeepsCountAcrossPreemption", "in scenario 'preempted-prefill', step 8: r1's block 4 filled, and the metadata "
         "had paired it with its hash to save at step 7 already, before its tokens were all "
         "computed", "act on a block only once the "
         "request's num_computed_tokens"),
    ],
)  # fmt: skip
def test_the_first_failure_names_the_mechanism_and_its_fix(
    connector: str, observed: str | tuple[str, ...], fix: str
) -> None:
    """A request that never progresses names the request, the report awaited and the answer that started the wait;
    a hook that raises shows the connector's own frame and what the step had."""
    with _quiet():
        report = run_conformance(BROKEN + connector, config_factory=fresh_namespace)
    first = next(r for r in report.results if r.status == "failed")
    assert first.message.count("; fix: ") == 1, first.message
    observed_part, fix_part = first.message.split("; fix: ")
    parts = (observed,) if isinstance(observed, str) else observed
    assert all(part in observed_part for part in parts) and fix_part.startswith(fix)


def test_a_store_nobody_can_reach_is_named_with_the_connector_s_own_stats_and_errors() -> None:
    """Every store call of the connector is refused: KV040 shows its stats and its logged errors, and asks."""
    failed = _failed(run_conformance(BROKEN + "UnreachableStore", select="KV04*"))
    observed, fix = failed["KV040"].split("; fix: ")
    assert observed.startswith(
        "observed in the 'chunked-reuse' data run, requests sharing full blocks with earlier ones, whose local "
        "copies were gone, loaded no token through the connector; its own stats count degraded_events="
    )
    assert "store_errors=" in observed and "failed: [Errno 111] Connection refused" in observed
    assert observed.endswith("its store calls failed (is the store reachable?)")
    assert fix.startswith("make the store reachable: start its server, or point the connector's config at one")


#: Four requests loading ``a``'s two blocks, then growing in a 13-block pool: preempted, resumed, loading again.
RESUMED_LOADS = DataRun(
    "resumed-loads",
    {"num_blocks": 14},
    ((Req("a", prompt(40, 90), 3),), tuple(Req(f"b{i}", Follow("a", 2, 5), 40) for i in range(4))),
    90,
)


def test_two_async_loads_of_a_resumed_request_are_reported_once_each() -> None:
    """vLLM waits for one finished_recving per async load (each puts the request in WAITING_FOR_REMOTE_KVS):
    a request preempted and resumed while its prefix is in the store loads, and is reported, twice.

    Counted within one run, whose request ids are its own: no run of the suite preempts a request that loaded
    (across runs the same names once added up to two), so this test plays a run of its own."""
    session = Session(STORE, config_factory=lambda run: {"store": f"{run}-{next(_COUNT)}", "load_async": True})
    with _quiet():
        assert session.run(get_check("KV031")).status == "passed"
        result = data_run(session, RESUMED_LOADS)
    assert not any(record.unexpected_reports for record in result.records)  # the engine waited for each report
    reports = Counter(
        r for rec in result.records if rec.connector_output for r in rec.connector_output.finished_recving
    )
    loads = Counter(r for rec in result.records for r, n in rec.loaded.items() if n)
    assert reports == loads and max(reports.values()) >= 2, (reports, loads)


@pytest.mark.parametrize(
    ("connector", "decodes_exact", "observed"),
    [
        # its count runs ahead only of blocks a request resumed while decoding has no hash for yet
        ("KeepsCountAcrossPreemption", True, "'b' at step 11: block 3 (position 3, layer 'layer.0') holds the right "
         "KV for its first 8 tokens only: it was saved before it was full"),
        ("KeepsFirstTableUnnamed", False, "'b' loaded block 6 (position 2, layer 'layer.0') holding the KV of "
         "position 0: the save at step 7 (metadata.saves[0]) stored block 5, at position 0 of 'a1''s live table, "
         "under the hash of its block 2: a table kept from before 'a1''s preemption (a stale table)"),
    ],
)  # fmt: skip
def test_a_prompt_preempted_mid_prefill_shows_what_a_connector_keeps_across_the_preemption(
    connector: str, decodes_exact: bool, observed: str
) -> None:
    """KV043's mid-prefill run on its own: a count of tokens kept across preemption (with the live table) and a
    table kept with new_block_ids appended (LMCache's request tracker) each fail it, naming the preemption; the
    count goes unseen where only decodes are preempted (they recompute in one step)."""
    session = Session(BROKEN + connector, config_factory=_fresh_namespaces())
    with _quiet():
        if decodes_exact:
            compare_tokens(session, PREEMPTED_SAVES, data_run(session, PREEMPTED_SAVES))
        with pytest.raises(ConformanceFailure) as failure:
            preempted_mid_prefill(session)
    seen = session.tags.untag(failure.value.observed)  # as the report says it (Session.run untags)
    assert seen.startswith(
        "in the 'preempted-prefill-reuse' data run ('a1' was preempted mid-prefill with 40 of its 64 prompt tokens "
        "computed, then resumed), request 'b' generated "
    )
    assert observed in seen
    assert failure.value.fix is not None and failure.value.fix.startswith(RESUMED_PREFILL_FIX)


@pytest.mark.parametrize(
    ("connector", "only"),
    [
        ("ResavesLoaded", "KV041"),  # round-trips fine, fails only after a failed load
        ("SavesTouchedBlocks", "KV042"),  # fine while chunks end on block boundaries
        ("KeepsFirstTable", "KV012"),  # its ids are in the live table, at the wrong positions (KV043 not run)
        ("KeepsFirstTableUnnamed", "KV043"),  # the same, with transfers naming no request: only the tokens show it
        ("StripsNullBlocks", "KV015"),
        ("DeferredSaver", "KV044"),  # its preempted-saves run goes wrong too: not run, KV044 is the root cause
        ("WrongLayerLoad", "KV040"),  # every data run goes wrong: the later data checks are not run
        ("ExchangesKV", "KV040"),
        ("ReversesSlots", "KV040"),
        ("KeysByTokens", "KV047"),  # right until two tenants or adapters share tokens
        ("RankBlindKeys", "KV048"),  # right with one rank
        ("PoisonsQuietly", "KV041"),  # its own instance never loads the poison: only another one shows it
    ],
)
def test_broken_saver_fails_only_its_own_check(connector: str, only: str) -> None:
    """Bugs are attributed: each of these connectors fails one check and passes the others."""
    with _quiet():
        failed = _failed(run_conformance(BROKEN + connector))
    assert set(failed) == {only}


@pytest.mark.parametrize(
    ("connector", "root", "observed", "fix"),
    [
        ("WrongHookSignature", "KV002", "Argument(s) {'req'} are declared in the hookimpl", "KV002"),
        ("WrongMetadataType", "KV010", "returned OtherMetadata, not an instance of DummyMetadata", METADATA_FIX),
    ],
)
def test_a_root_cause_is_reported_once_and_its_dependents_are_not_run(
    connector: str, root: str, observed: str, fix: str
) -> None:
    with _quiet():
        report = run_conformance(BROKEN + connector)
    assert _failed(report) == {root: report.result(root).message}
    message = report.result(root).message
    assert observed in message and "\n" not in message
    assert message.endswith(f"; fix: {get_check(fix).fix if fix.startswith('KV') else fix}")
    not_run = [r for r in report.results if r.message.startswith(NOT_RUN)]
    assert len(not_run) >= 10
    assert all(r.status == "skipped" and f"{root} " in r.message and "root cause" in r.message for r in not_run)


def test_required_config_fails_config_defaults_when_a_config_is_given() -> None:
    report = run_conformance(BROKEN + "NeedsConfig", config={"address": "here"}, select="KV004")
    assert (
        "NeedsConfig needs option `address`; give it a default (engines load connectors with no options) "
        in (_failed(report)["KV004"])
    )


def test_required_config_without_one_fails_config_defaults_and_skips_the_rest() -> None:
    report = run_conformance(BROKEN + "NeedsConfig")
    assert report.load_error is None and not report.ok
    expected = (
        "needs option `address`; give it a default (engines load connectors with no options) "
        "or pass --config '{\"address\": ...}'"
    )
    assert expected in _failed(report)["KV004"]
    assert report.failed == 1 and report.skipped == len(list_checks()) - 1


@pytest.mark.parametrize("connector", [STORE, HOOK_REFERENCE])
def test_correct_saver_and_loader_passes_everything(connector: str) -> None:
    report = run_conformance(connector, config_factory=_fresh_namespaces())
    assert report.ok, report.to_dict()
    skipped = {r.id for r in report.results if r.status == "skipped"}
    assert skipped == (set() if "memory" in connector else {"KV007"})  # the hook-level one is no store connector
    assert report.passed == len(list_checks()) - len(skipped)


def test_a_load_skipping_missing_blocks_fails_when_the_store_loses_them() -> None:
    """With a config_factory the suite empties the worker's store (a fresh namespace)."""
    with _quiet():
        failed = _failed(run_conformance(BROKEN + "SkipsMissing", config_factory=_fresh_namespaces()))
    assert set(failed) == {"KV041"}
    assert failed["KV041"].startswith(
        "observed in the 'lost-blocks' data run the connector claimed 64 tokens for 'b', its worker's store (a fresh "
        "namespace) had none of them, it reported no block failed to load, and 'b' ran on wrong KV; fix: report "
        "every block"
    )


def test_without_a_config_factory_the_store_loses_the_blocks_in_a_worker_process() -> None:
    """No factory: the second request's worker side runs in another process, where a process-memory store is
    empty; a load skipping the missing blocks fails, and so do sides meeting in process memory undeclared."""
    with _quiet():
        skips = _failed(run_conformance(BROKEN + "SkipsMissing", select="KV041"))
        undeclared = _failed(run_conformance(BROKEN + "UndeclaredProcessState", select="KV041"))
        declared = run_conformance(STORE, select="KV041")
    assert skips["KV041"].startswith(
        "observed in the 'lost-blocks' data run with its worker side in another process (as vLLM's multiprocess "
        "engine runs it), the connector claimed 64 tokens for 'b', the worker side did not have them, it reported no "
        "block failed to load, and 'b' ran on wrong KV; fix: report every block"
    )
    observed, fix = undeclared["KV041"].split("; fix: ")
    assert observed.endswith(
        "the connector claimed 64 tokens for 'b' and every block of them failed to load (4): its scheduler side "
        "finds blocks its worker side can reach only in the same process"
    )
    assert fix.startswith("declare in_process_state = True")
    assert declared.ok, declared.to_dict()


def test_a_config_factory_that_isolates_nothing_is_no_false_failure() -> None:
    """Every run gets the same namespace: the worker's store still holds the blocks, every load succeeds."""
    with _quiet():
        report = run_conformance(STORE, select="KV041", config_factory=lambda run: {"store": "one-for-all"})
    assert report.ok, report.to_dict()


def test_dummy_plugin_passes_and_skips_only_by_capability() -> None:
    report = run_conformance("dummy")
    assert report.ok, report.to_dict()
    skipped = {r.id: r.message for r in report.results if r.status == "skipped"}
    assert set(skipped) == {c.id for c in list_checks() if {"saves", "store"} & c.requires} >= {"KV007", "KV040"}
    assert all("does not save (saves = False)" in m for c, m in skipped.items() if c != "KV007")
    assert skipped["KV007"].startswith("not a kvconn.store connector")


class _quiet:
    """Silence the host's warnings about broken connectors (they are the point here)."""

    def __enter__(self) -> None:
        logging.disable(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        logging.disable(logging.NOTSET)


def _fresh_namespaces() -> Callable[[str], dict[str, str]]:
    """A config_factory: a store namespace of its own for every run."""
    count = itertools.count()
    return lambda run: {"store": f"{run}-{next(count)}"}


def test_a_persistent_store_needs_a_namespace_per_run() -> None:
    """The fixtures' store outlives its instances: a store connector declares a namespace per run, so a second suite
    in the process stays green; one declaring none hits the first suite's blocks, which a config_factory fixes."""
    store, undeclared = "kvconn.testing.memory_connector:MemoryConnector", BROKEN + "DeclaresNoFreshStore"
    with _quiet():
        assert run_conformance(store, select="KV045").ok
        assert run_conformance(store, select="KV045").ok
        assert run_conformance(undeclared, select="KV045").ok
        leaked = _failed(run_conformance(undeclared, select="KV045"))
        fresh = run_conformance(undeclared, select="KV04*", config_factory=_fresh_namespaces())
    assert "the store kept blocks from an earlier run" in leaked["KV045"]
    assert "config_factory" in leaked["KV045"]
    assert fresh.ok and fresh.passed == sum(c.id.startswith("KV04") for c in list_checks())


def test_a_store_ignoring_its_namespace_leaks_even_with_a_config_factory() -> None:
    with _quiet():
        run_conformance(BROKEN + "IgnoresNamespace", select="KV045", config_factory=_fresh_namespaces())
        failed = _failed(
            run_conformance(BROKEN + "IgnoresNamespace", select="KV045", config_factory=_fresh_namespaces())
        )
    assert "{'a': 48} tokens were loaded on its first step" in failed["KV045"]


def test_a_sync_load_reported_finished_is_refused_by_the_host_and_reported_once_as_the_root_cause() -> None:
    """The host checks get_finished's answer before KV031 can: the scenario breaks at KV010, naming hook and value."""
    from kvconn.testing.conformance.session import ANSWER_FIX

    with _quiet():
        report = run_conformance(BROKEN + "ReportsSyncLoads")
    failed = _failed(report)
    assert set(failed) == {"KV010"}
    assert "failed in get_finished: BadHookAnswer: reported ['r3'] in finished_recving" in failed["KV010"]
    assert failed["KV010"].endswith(f"; fix: {ANSWER_FIX}")
    assert next(r for r in report.results if r.id == "KV031").status == "skipped"  # not run: KV010 failed first


@pytest.mark.parametrize("late", [False, True])
def test_a_load_error_reported_after_its_finished_load_fails(late: bool) -> None:
    """docs/authoring.md: a load error comes with, or before, the request's finished load; after is too late."""
    connector = BROKEN + "ReportsLoadErrorsLate" if late else STORE
    with _quiet():
        report = run_conformance(
            connector, config={"load_async": True}, select="KV041", config_factory=_fresh_async_namespaces()
        )
    failed = _failed(report)
    if not late:  # the same connector, reporting with its finished load, passes
        assert report.result("KV041").status == "passed", failed
        return
    assert set(failed) == {"KV041"}
    # the host refuses the late report: by then the load had finished and was no longer in flight
    assert "which are not in its loads in flight" in failed["KV041"], failed["KV041"]


def _fresh_async_namespaces() -> Callable[[str], dict[str, object]]:
    fresh = _fresh_namespaces()
    return lambda run: {**fresh(run), "load_async": True}


@pytest.mark.parametrize(
    ("store", "contract", "observed", "fix"),
    [
        ("NextKeysValue", "get() must copy each value into its own buffer, in key order", "its store layer refused 4 "
         "loaded value(s) (load_failed_integrity_other_key): the store returned another key's value",
         "make get() fill each buffer with the value of its own key"),
        ("ShortValues", "get() must answer each value's length in bytes", "its store layer refused 4 loaded value(s) "
         "(load_failed_integrity_short): the store returned fewer bytes than were put",
         "make get() copy the whole value and answer its full length"),
        ("DropsPuts", "contains() must see every key put() stored", "loaded no token through the connector; its stats "
         "count blocks_saved=10 (the store's put() answered True for each), yet no lookup found one of them",
         "make put() answer True only for a value it stored"),
    ],
)  # fmt: skip
def test_a_broken_store_is_named_by_the_store_contract_and_by_the_engine(
    store: str, contract: str, observed: str, fix: str
) -> None:
    """The store contract (KV007) runs first and names the store call; the engine's round trip (KV040) then quotes
    what the store layer counted, in the store's terms, not in hooks."""
    with _quiet():
        report = run_conformance(f"kvconn_conformance_fixtures.broken_stores:{store}", config_factory=fresh_namespace)
    first = next(r for r in report.results if r.status == "failed")
    assert first.id == "KV007" and f"{store}Store, from {store}.open_store()" in first.message
    assert first.message.split("; fix: ")[1].startswith(contract)
    observed_part, fix_part = report.result("KV040").message.split("; fix: ")
    assert observed in observed_part and fix_part.startswith(fix)
