"""Logs while connectors run: one line per record unless debugging."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from kvconn_cli.logs import WarningSummary, configure_logging


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def _log_failure() -> None:
    try:
        raise ValueError("store unreachable")
    except ValueError:
        logging.getLogger("kvconn.host").exception("connector 'x' failed in save_kv_layer; degrading")
    logging.getLogger("kvconn.host").debug("a debug detail")


def test_one_line_without_debug(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(debug=False)
    _log_failure()
    assert capsys.readouterr().err == "kvconn: ERROR kvconn.host: connector 'x' failed in save_kv_layer; degrading\n"


def test_tracebacks_and_debug_records_with_debug(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(debug=True)
    _log_failure()
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: store unreachable" in err
    assert "a debug detail" in err


def test_a_summary_shows_each_distinct_warning_once_counted_and_counts_the_engines_own(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    configure_logging(debug=False)
    before = logging.getLogger().handlers[:]
    summary = WarningSummary().install()
    store, vllm = logging.getLogger("kvconn.store"), logging.getLogger("vllm.distributed.kv_transfer")
    for tokens in (16, 64, 16):
        store.warning("a block was gone when loaded (%d tokens)", tokens)  # one warning: only a number differs
    store.warning("%s: a block was gone", "RedisConnector")
    store.warning("%s: a block was gone", "MooncakeConnector")  # another connector: another warning
    store.error("the store is off")
    for _ in range(45):
        vllm.warning("Initializing KVConnectorBase_V1. This API is experimental")
    vllm.error("vLLM failed")  # an engine's error is the report's business: shown
    assert capsys.readouterr().err == ""  # nothing while the run goes on: the report comes first
    summary.report()
    assert capsys.readouterr().err.splitlines() == [
        "kvconn: WARNING kvconn.store: a block was gone when loaded (16 tokens) (3 times)",
        "kvconn: WARNING kvconn.store: RedisConnector: a block was gone",
        "kvconn: WARNING kvconn.store: MooncakeConnector: a block was gone",
        "kvconn: ERROR kvconn.store: the store is off",
        "kvconn: ERROR vllm.distributed.kv_transfer: vLLM failed",
        "kvconn: 45 log lines of the engines (vLLM, torch) not shown: -v shows them",
    ]
    assert logging.getLogger().handlers == before
    assert os.environ["TORCH_LOGS"] == "-torch"  # torch's own handler keeps its warnings too


def test_a_summary_of_a_quiet_run_says_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    WarningSummary().install().report()
    assert capsys.readouterr().err == ""


def test_a_summary_names_the_checks_a_warning_was_logged_under(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A green run's warnings often come from the faults a check injects: the summary says which check ran."""
    from kvconn.testing.conformance import CheckResult

    monkeypatch.delenv("TORCH_LOGS", raising=False)
    summary = WarningSummary().install()
    seen: list[str] = []
    on_result = summary.attributing(lambda result: seen.append(result.id))
    store = logging.getLogger("kvconn.store")
    on_result(CheckResult("KV040", "round-trip", "passed"))
    store.warning("a block was gone when loaded")
    store.warning("a block was gone when loaded")
    on_result(CheckResult("KV041", "load-failure", "passed"))
    store.warning("a block was gone when loaded")
    on_result(CheckResult("KV045", "fresh-store", "passed"))
    summary.report()
    assert seen == ["KV040", "KV041", "KV045"]
    assert capsys.readouterr().err == (
        "kvconn: WARNING kvconn.store: a block was gone when loaded (3 times, while KV041, KV045 ran)\n"
    )


def test_a_summary_names_requests_as_the_scenarios_do_not_by_the_engines_tagged_ids(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run gives the engine ``name + tag`` (kvconn.testing.conformance.request_ids); the summary, like the
    report, says ``'b1'``, and the same warning from two runs or two sessions is one."""
    from kvconn.testing.conformance.request_ids import RequestTags

    monkeypatch.delenv("TORCH_LOGS", raising=False)
    summary = WarningSummary().install()
    store = logging.getLogger("kvconn.store")
    for session in (RequestTags(), RequestTags()):
        for _ in range(2):
            store.warning("the load of %r failed", session.next_run().engine_id("b1"))
    store.warning("a key 'blk-0a1b2c' stays as it is")  # no run's tag: six hex digits, but no '.N' after them
    summary.report()
    assert capsys.readouterr().err.splitlines() == [
        "kvconn: WARNING kvconn.store: the load of 'b1' failed (4 times)",
        "kvconn: WARNING kvconn.store: a key 'blk-0a1b2c' stays as it is",
    ]
