"""Make the connectors under ``fixtures/`` importable as ``kvconn_conformance_fixtures.<module>:<Class>``."""

from __future__ import annotations

import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))
