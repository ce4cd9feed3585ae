"""Test kit for connector authors and engines.

Mirrors the utilities vLLM connector authors know (``create_scheduler``,
``create_requests``, ``make_model_runner_output``, ``assert_scheduler_empty``).
"""

from __future__ import annotations

from .utils import (
    assert_scheduler_empty,
    create_requests,
    create_scheduler,
    make_model_runner_output,
    run_to_completion,
)

__all__ = [
    "assert_scheduler_empty",
    "create_requests",
    "create_scheduler",
    "make_model_runner_output",
    "run_to_completion",
]
