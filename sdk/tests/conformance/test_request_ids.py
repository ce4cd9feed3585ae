"""Every run gives the engine request ids of its own, and reports still name requests as the scenarios do.

A connector whose state outlives a run (a server keyed by request id, as LMCache's multi-process one) must never
meet an id twice, across runs or validate invocations; the user reads 'a' and 'r0', never the engine's ids.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
from kvconn_conformance_fixtures import request_server

from kvconn.testing.conformance import Session, run_conformance
from kvconn.testing.conformance.catalog import get_check
from kvconn.testing.conformance.request_ids import RequestTags
from kvconn.testing.conformance.runs import ISOLATION, data_run
from kvconn.testing.conformance.scenarios import OFFERED_ONLY
from kvconn.testing.memory_connector import fresh_namespace

SERVER = "kvconn_conformance_fixtures.request_server:PerRequestServer"
BROKEN = "kvconn_conformance_fixtures.broken:"


@pytest.fixture
def quiet() -> Iterator[None]:
    """The host logs what a broken connector does wrong; these tests read the reports."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def test_a_connector_whose_server_outlives_every_run_never_meets_a_request_id_twice() -> None:
    """Two validate invocations against one server: every scenario and data run, each request id new to it."""
    for _ in range(2):
        report = run_conformance(SERVER, config_factory=fresh_namespace)
        assert report.ok, {r.id: r.message for r in report.results if r.status == "failed"}
        assert report.result("KV040").status == report.result("KV010").status == "passed"
    assert not {"r0", "a", "b"} & request_server.FINISHED  # the engine never saw a bare scenario name


def test_request_ids_are_the_names_tagged_per_run_and_per_session_keeping_their_order() -> None:
    first, second = RequestTags(), RequestTags()
    runs = [first.next_run(), first.next_run(), second.next_run()]
    ids = [run.engine_id("a") for run in runs]
    assert len(set(ids)) == 3 and ids[0] == f"a-{first.token}.1" and ids[1] == f"a-{first.token}.2"
    assert first.untag(f"loaded {{{ids[1]!r}: 48}} for {runs[1].engine_id('b1')!r}") == "loaded {'a': 48} for 'b1'"
    assert first.untag(ids[2]) == ids[2]  # another session's ids are not this one's to rename
    names = ["b1", "a", "b", "a1", "r0"]
    assert [first.untag(i) for i in sorted(runs[0].engine_ids(names))] == sorted(names)


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize(
    ("connector", "check_id", "named"),
    [
        ("AssumesOffered", "KV013", "AssertionError: no table for r1,"),  # the connector's own exception
        ("ReportsTwice", "KV031", "finished_sending reported 'r0' a second time"),  # the driver's observation
        # the stall's diagnosis, or the host's exception when the wait bound passes later than its step bound
        ("NeverReleases", "KV030", r"request 'r0' waits for finished_sending|frees of \['r0'\] in finished_sending"),
        ("WrongLayerLoad", "KV040", "request 'b' generated "),  # a data run's observation
    ],
)
def test_a_failure_names_requests_as_the_scenarios_do_though_the_engine_saw_tagged_ids(
    connector: str, check_id: str, named: str
) -> None:
    session = Session(BROKEN + connector)
    try:
        result = session.run(get_check(check_id))
        engine_ids = {r for trace in session.standard_traces() for record in trace.records for r in record.tables}
    finally:
        session.close()
    assert result.status == "failed" and re.search(named, result.message), result.message
    assert session.tags.token not in result.message
    assert engine_ids and all(r.split("-")[1].startswith(session.tags.token) for r in engine_ids)


def test_the_records_of_a_run_carry_the_engines_ids_and_its_tokens_the_names() -> None:
    session = Session(SERVER, config_factory=fresh_namespace)
    try:
        trace = session.trace(OFFERED_ONLY)
        result = data_run(session, ISOLATION)
    finally:
        session.close()
    assert trace.request_ids == [trace.tag.engine_id(r) for r in ("r0", "r1", "r2")]
    assert set(trace.finished_calls) == set(trace.request_ids)
    assert set(result.tokens) == {r.req_id for phase in ISOLATION.phases for r in phase}
    assert result.loaded("a1") > 0 and result.loaded("b") == 0  # a1 shares a's tenant; b is another tenant
