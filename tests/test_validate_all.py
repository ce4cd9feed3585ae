"""The operator's command, twice: `kvconn validate --all` stays green run after run, and leaves no file behind.

Every shipped connector, redis against the project's throw-away server (scripts/with-redis-server.sh, as `make demo`
runs it): both runs against one server, so a store that kept the first run's blocks would fail KV045 in the second.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KVCONN = Path(sys.executable).parent / "kvconn"
SHIPPED = ("dummy", "mooncake", "offload", "redis")


def test_validate_all_twice_against_one_redis_server_is_green_and_leaves_no_file(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        reason = "redis-server is not installed: make install (scripts/install-system-deps.sh) installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KVCONN_PLUGINS", "KVCONN_DISABLE_PLUGINS")}
    env["TMPDIR"] = str(temp)
    twice = f"{KVCONN} validate --all; echo '-- exit' $?; {KVCONN} validate --all; echo '-- exit' $?"
    proc = subprocess.run(
        [str(REPO / "scripts" / "with-redis-server.sh"), "bash", "-c", twice],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    runs = proc.stdout.split("-- exit")
    assert re.findall(r"-- exit (\d+)", proc.stdout) == ["0", "0"], proc.stdout + proc.stderr
    for number, run in enumerate(runs[:2], start=1):
        verdicts = dict(re.findall(r"^(\w+): (ok|FAILED) ", run, flags=re.MULTILINE))
        assert set(verdicts) >= set(SHIPPED), f"run {number}: {verdicts}"
        assert set(verdicts.values()) == {"ok"}, f"run {number}:\n{run}"
    assert not list(temp.iterdir()), f"validate left {sorted(p.name for p in temp.iterdir())} in the temp directory"
