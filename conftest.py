"""Repository-wide pytest configuration."""

from __future__ import annotations

import os

try:
    from hypothesis import settings
except ImportError:  # the vLLM tier's venv has no hypothesis (and no property tests)
    settings = None

if settings is not None:
    # CI replays the same examples every run (a flaky red build helps nobody); locally, hypothesis explores.
    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")
