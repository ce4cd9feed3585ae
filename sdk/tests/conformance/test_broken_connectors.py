"""The suite catches each bug class: every deliberately broken connector fails the check meant for it.

The broken connectors live in ``fixtures/kvconn_conformance_fixtures/broken.py``;
each changes one thing in a correct connector. A correct saver/loader
(``store.StoreConnector``) and the shipped dummy plugin pass everything.
"""

from __future__ import annotations

import logging

import pytest

from kvconn.testing.conformance import ConnectorReport, list_checks, run_conformance

BROKEN = "kvconn_conformance_fixtures.broken:"
STORE = "kvconn_conformance_fixtures.store:StoreConnector"


def _failed(report: ConnectorReport) -> dict[str, str]:
    assert report.load_error is None, report.load_error
    return {r.id: r.message for r in report.results if r.status == "failed"}


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
    ],
)
def test_broken_connector_fails_its_check(connector: str, check_id: str, observed: str) -> None:
    check = next(c for c in list_checks() if c.id == check_id)
    with _quiet():
        failed = _failed(run_conformance(BROKEN + connector, select=check_id))
    assert check_id in failed, f"{connector} passed {check_id}"
    message = failed[check_id]
    assert observed in message
    assert message.startswith("observed ") and f"; fix: {check.fix}" in message


def test_broken_saver_passes_the_checks_it_does_not_break() -> None:
    """Bugs are attributed: ResavesLoaded round-trips fine and only fails after a failed load."""
    with _quiet():
        failed = _failed(run_conformance(BROKEN + "ResavesLoaded"))
    assert set(failed) == {"KV041"}


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


def test_correct_saver_and_loader_passes_everything() -> None:
    report = run_conformance(STORE)
    assert report.ok, report.to_dict()
    assert report.skipped == 0 and report.passed == len(list_checks())


def test_dummy_plugin_passes_and_skips_only_by_capability() -> None:
    report = run_conformance("dummy")
    assert report.ok, report.to_dict()
    skipped = {r.id: r.message for r in report.results if r.status == "skipped"}
    assert set(skipped) == {"KV040", "KV041"}
    assert all("does not save (saves = False)" in m for m in skipped.values())


class _quiet:
    """Silence the host's warnings about broken connectors (they are the point here)."""

    def __enter__(self) -> None:
        logging.disable(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        logging.disable(logging.NOTSET)
