"""The tier over a real Mooncake master, inside a network namespace (plugins/mooncake/tests/mooncake_netns.py).

SGLang's controller runs in a subprocess inside the namespace (Mooncake's transfer engine must not see this
machine's interfaces), executing ``mooncake_cycles.py`` with this interpreter. Skipped where namespaces or the
Mooncake wheel are unavailable; a failure under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_sglang_controller_over_a_real_mooncake_master() -> None:
    import mooncake_netns as h  # plugins/mooncake/tests, on the path (conftest.py)

    reason = h.netns_unavailable_reason() or h.mooncake_unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real Mooncake tier cannot run under CI: {reason}")
        pytest.skip(reason)
    with h.netns() as ns, h.mooncake_master(ns) as master:
        run = h.run_python(
            ns, script=str(HERE / "mooncake_cycles.py"), env=master.client_env(), timeout=240, python=sys.executable
        )
    assert run.ok, f"rc={run.rc} timed_out={run.timed_out}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    page = 4
    assert result["backed_up"] == 3 * page
    assert result["partial"] == [3 * page, 3 * page] and result["exact"] is True
    assert result["corrupt"] == [3 * page, page]  # every key exists; the prefetch stops before the foreign value
    assert result["mla_reads_mha"] == 0
