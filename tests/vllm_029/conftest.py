"""The vLLM 0.29 tier: vLLM's own connectors and the adapter on vLLM 0.29.0's scheduler (the dict block state).

Run it with ``.venv-vllm-029`` (``make test-vllm``). Without vLLM 0.29 it skips, except under ``CI=true``,
where it errors: CI must run it.
"""

from __future__ import annotations

from pathlib import Path

from kvconn_vllm.testing.harness import prepare_environment, vllm_import_error

from ..conftest import guard_tier

prepare_environment()  # before anything imports vLLM: offline, persistent VLLM_CACHE_ROOT
PROBLEM = vllm_import_error()
if PROBLEM is None:
    import vllm

    if not vllm.__version__.startswith("0.29."):
        PROBLEM = f"this tier needs vLLM 0.29, not {vllm.__version__} (scripts/install-vllm-venv.sh scheduler-029)"

pytest_collection_modifyitems = guard_tier(
    Path(__file__).parent, PROBLEM, needs="vLLM 0.29", fix="run this tier with .venv-vllm-029"
)
