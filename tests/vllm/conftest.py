"""The vLLM test tier: kvconn plugins under vLLM's real scheduler, on the CPU.

Run it with the vLLM venv (``make test-vllm``). The main test run leaves this
directory out (``--ignore=tests/vllm``). Without vLLM the tier skips, except
under ``CI=true``, where a missing vLLM is an error: CI must run it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconn_vllm.testing.harness import RUNNER_VARIABLE, RUNNERS, prepare_environment, vllm_import_error

from ..conftest import guard_tier

prepare_environment()  # before anything imports vLLM: offline, persistent VLLM_CACHE_ROOT
HERE = Path(__file__).parent
pytest_collection_modifyitems = guard_tier(
    HERE,
    vllm_import_error(),
    needs="vLLM",
    fix="run this tier with the vLLM venv (make test-vllm, which runs scripts/install-vllm-venv.sh)",
)


@pytest.fixture
def test_connectors(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Make ``kvconn_test_connectors`` importable; yields its module name."""
    monkeypatch.syspath_prepend(str(HERE))
    yield "kvconn_test_connectors"


@pytest.fixture
def old_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM before the lazy block-state fix: ``kv_connector_block_state`` stays ``None``."""
    import vllm.v1.core.sched.scheduler as vllm_scheduler

    monkeypatch.setattr(vllm_scheduler, "KVConnectorBlockState", lambda **kwargs: None)


@pytest.fixture(params=sorted(RUNNERS))
def runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of vLLM 0.33's model runners in turn, chosen as vLLM chooses it (``VLLM_USE_V2_MODEL_RUNNER``).

    The scheduler builds its output for that runner, and ``VllmLoop`` drives the worker as it
    does: V1 through ``KVConnectorModelRunnerMixin``, V2 through ``ActiveKVConnector``.
    """
    monkeypatch.setenv(RUNNER_VARIABLE, RUNNERS[request.param])
    return str(request.param)
