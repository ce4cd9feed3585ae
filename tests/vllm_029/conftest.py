"""The vLLM 0.29 tier: vLLM's own connectors and the adapter on vLLM 0.29.0's scheduler (the dict block state).

Run it with ``.venv-vllm-029`` (``make test-vllm``). Without vLLM 0.29 it skips, except under ``CI=true``,
where it errors: CI must run it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvconn_vllm.harness import prepare_environment, vllm_import_error

prepare_environment()  # before anything imports vLLM: offline, persistent VLLM_CACHE_ROOT
PROBLEM = vllm_import_error()
if PROBLEM is None:
    import vllm

    if not vllm.__version__.startswith("0.29."):
        PROBLEM = f"this tier needs vLLM 0.29, not {vllm.__version__} (scripts/install-vllm-venv.sh scheduler-029)"
if PROBLEM and os.environ.get("CI") == "true":
    raise RuntimeError(f"CI=true but vLLM 0.29 is not usable here ({PROBLEM}): run this tier with .venv-vllm-029")

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PROBLEM:
        skip = pytest.mark.skip(reason=f"vLLM 0.29 is not usable in this environment: {PROBLEM}")
        for item in items:
            if HERE in Path(item.path).parents:
                item.add_marker(skip)
