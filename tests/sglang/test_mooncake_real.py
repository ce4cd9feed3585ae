"""The tier over a real Mooncake master, inside a network namespace (plugins/mooncake/tests/mooncake_netns.py).

SGLang's controller runs in a subprocess inside the namespace (Mooncake's transfer engine must not see this
machine's interfaces), executing ``mooncake_cycles.py`` with this interpreter. Skipped where namespaces or the
Mooncake wheel are unavailable; a failure under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HARNESS = HERE.parent.parent / "plugins" / "mooncake" / "tests" / "mooncake_netns.py"


def _harness() -> object:
    spec = importlib.util.spec_from_file_location("mooncake_netns", HARNESS)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mooncake_netns", module)
    spec.loader.exec_module(module)
    return module


def test_sglang_controller_over_a_real_mooncake_master() -> None:
    h: object = _harness()
    reason = h.netns_unavailable_reason() or h.mooncake_unavailable_reason()  # type: ignore[attr-defined]
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real Mooncake tier cannot run under CI: {reason}")
        pytest.skip(reason)
    with h.netns() as ns, h.mooncake_master(ns) as master:  # type: ignore[attr-defined]
        run = h.run_python(  # type: ignore[attr-defined]
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
