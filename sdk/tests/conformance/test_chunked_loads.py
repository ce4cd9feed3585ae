"""The load-failure runs share more than a 256-token chunk: a connector that loads only whole chunks (LMCache's
default) loads something there, so the failure checks fail a load of its instead of finding nothing to fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconn.testing.conformance import Session, run_conformance
from kvconn.testing.conformance.checks.data import failed_load_recomputed
from kvconn.testing.conformance.checks.recovery import persistent_load_failure
from kvconn.testing.conformance.fault_injection import FailureMode
from kvconn.testing.conformance.runs import (
    FAILED_LOAD,
    FAILED_LOAD_ELSEWHERE,
    LOAD_CHUNK_TOKENS,
    PERSISTENT_FAILURE,
    PERSISTENT_FAILURE_TWO_GROUPS,
    DataRun,
    Follow,
    data_run,
)
from kvconn.testing.memory_connector import fresh_namespace

CHUNKED = "kvconn_conformance_fixtures.chunked:LoadsWholeChunks"
STAGGERED = "kvconn_conformance_fixtures.chunked:StaggeredLookups"
FAILURE_RUNS = (FAILED_LOAD, FAILED_LOAD_ELSEWHERE, PERSISTENT_FAILURE, PERSISTENT_FAILURE_TWO_GROUPS)


@pytest.mark.parametrize("case", FAILURE_RUNS, ids=lambda c: c.name)
def test_every_later_request_of_a_failure_run_shares_more_than_one_chunk(case: DataRun) -> None:
    block_size = case.options.get("block_size", 16)
    for phase in case.phases[1:]:
        for req in phase:
            assert isinstance(req.prompt, Follow)
            assert req.prompt.blocks * block_size > LOAD_CHUNK_TOKENS


@pytest.fixture
def session() -> Iterator[Session]:
    opened = Session(CHUNKED, config_factory=fresh_namespace)
    yield opened
    opened.close()


@pytest.mark.parametrize(("case", "mode"), [(FAILED_LOAD, "first"), (PERSISTENT_FAILURE, "persistent")])
def test_a_connector_loading_whole_chunks_claims_a_chunk_and_has_a_load_failed(
    session: Session, case: DataRun, mode: FailureMode
) -> None:
    result = data_run(session, case, fail_loads=mode)
    assert result.driver.injected_failure
    assert result.loaded("b") >= LOAD_CHUNK_TOKENS


def test_a_correct_connector_loading_whole_chunks_passes_the_failure_checks(session: Session) -> None:
    """KV041's failed load and KV046's persistent one, called directly: KV040 (which they follow) fails such a
    connector by design, since its round trips share less than a chunk and a kvconn connector must load there."""
    failed_load_recomputed(session)
    persistent_load_failure(session)


def test_a_connector_whose_lookups_stagger_the_requests_has_the_preemption_check_skipped_saying_why() -> None:
    """Nothing preempted is the connector's timing, not a misconfigured suite: KV012 says what it needs."""
    report = run_conformance(STAGGERED, select="KV01[02]", config_factory=fresh_namespace)
    results = {r.id: r for r in report.results}
    assert results["KV010"].status == "passed", report.results
    assert results["KV012"].status == "skipped"
    assert results["KV012"].message.startswith("the preemption scenario preempted nothing, so no table was replaced")
    assert "it needs a run in which a request is preempted" in results["KV012"].message
