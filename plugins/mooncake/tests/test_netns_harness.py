"""Smoke tests for the network-namespace Mooncake harness (mooncake_netns.py).

They need root, iproute2 + veth support, and a Python that has
``mooncake-transfer-engine-non-cuda`` (this interpreter, or the one named by
``$KVCONN_MOONCAKE_PYTHON``). Otherwise they skip with the reason. The
harness module comes from the conftest's ``harness`` fixture.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import types

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def need_netns(harness: types.ModuleType) -> None:
    reason = harness.netns_unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def need_mooncake(need_netns: None, harness: types.ModuleType) -> None:
    reason = harness.mooncake_unavailable_reason()
    if reason:
        pytest.skip(reason)


def _ns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def test_netns_created_and_removed(need_netns: None, harness: types.ModuleType) -> None:
    with harness.netns() as ns1, harness.netns() as ns2:
        assert ns1.name != ns2.name
        assert ns1.subnet != ns2.subnet
        assert ns1.name in _ns_list()
        r = harness.run_in_netns(ns1, ["ip", "-4", "-o", "addr"], timeout=10).check()
        assert ns1.addr in r.stdout and ns1.peer_addr in r.stdout and "127.0.0.1" in r.stdout
        r = harness.run_in_netns(ns1, ["ping", "-c1", "-W2", ns1.peer_addr], timeout=10) if _has_ping() else None
        if r is not None:
            assert r.ok, r.stderr
    listing = _ns_list()
    assert ns1.name not in listing and ns2.name not in listing


def _has_ping() -> bool:
    return shutil.which("ping") is not None


def test_run_python_timeout_kills_group(need_netns: None, harness: types.ModuleType) -> None:
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); print('up', flush=True); time.sleep(60)"
    with harness.netns() as ns:
        t0 = time.monotonic()
        r = harness.run_python(ns, code, timeout=2, python=sys.executable)
        assert r.timed_out and r.rc is None
        assert time.monotonic() - t0 < 20
        assert "up" in r.stdout
        pids = subprocess.run(["ip", "netns", "pids", ns.name], capture_output=True, text=True, timeout=10)
        assert pids.stdout.strip() == ""


def test_master_start_kill_restart(need_mooncake: None, harness: types.ModuleType) -> None:
    with harness.netns() as ns, harness.mooncake_master(ns) as m:
        assert m.is_running()
        assert m.master_addr == f"127.0.0.1:{m.rpc_port}"
        assert m.metadata_url == f"http://127.0.0.1:{m.http_port}/metadata"
        ports = (m.rpc_port, m.http_port)
        pid1 = m.proc.pid
        m.restart()
        assert m.is_running() and m.proc.pid != pid1
        assert (m.rpc_port, m.http_port) == ports
        m.kill()
        assert not m.is_running()
        m.start()
        assert m.is_running()
        proc = m.proc
    assert proc.poll() is not None  # killed on context exit


_CLIENT_SETUP = r"""
import os, sys, time, numpy as np
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup(os.environ["MC_LOCAL_HOSTNAME"], os.environ["MC_METADATA_URL"],
             64 << 20, 16 << 20, "tcp", "", os.environ["MC_MASTER_ADDR"])
assert rc == 0, rc
BLK, N = 64 << 10, 8
"""


def _client(body: str) -> str:
    """``body`` after the setup every client script shares: a client from the ``MC_*`` env vars, N blocks of BLK."""
    return _CLIENT_SETUP + body


_E2E_CLIENT = _client(r"""
src = np.random.default_rng(1).integers(0, 255, N * BLK, dtype=np.uint8)
dst = np.zeros_like(src)
assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
keys = [f"blk-{i}" for i in range(N)]
assert s.batch_put_from(keys, [src.ctypes.data + i * BLK for i in range(N)], [BLK] * N) == [0] * N
assert s.batch_is_exist(keys + ["missing"]) == [1] * N + [0]
got = s.batch_get_into(keys + ["missing"], [dst.ctypes.data + i * BLK for i in range(N)] + [dst.ctypes.data],
                       [BLK] * (N + 1))
assert got == [BLK] * N + [-704], got
assert (src == dst).all()
s.unregister_buffer(src.ctypes.data); s.unregister_buffer(dst.ctypes.data)
assert s.close() == 0
print("E2E-OK")
""")


def test_single_node_put_get(need_mooncake: None, harness: types.ModuleType) -> None:
    with harness.netns() as ns, harness.mooncake_master(ns) as m:
        r = harness.run_python(ns, _E2E_CLIENT, env=m.client_env(), timeout=90)
        assert r.ok and "E2E-OK" in r.stdout, r.stderr[-3000:]


_NODE_A = _client(r"""
src = np.random.default_rng(7).integers(0, 255, N * BLK, dtype=np.uint8)
s.register_buffer(src.ctypes.data, src.nbytes)
r = s.batch_put_from([f"x-{i}" for i in range(N)], [src.ctypes.data + i * BLK for i in range(N)], [BLK] * N)
print("PUT", r, flush=True)
time.sleep(float(sys.argv[1]))  # the data lives in THIS process's segment: stay up while B reads
s.close()
""")

_NODE_B = _client(r"""
src = np.random.default_rng(7).integers(0, 255, N * BLK, dtype=np.uint8)
dst = np.zeros_like(src)
s.register_buffer(dst.ctypes.data, dst.nbytes)
keys = [f"x-{i}" for i in range(N)]
assert s.batch_is_exist(keys) == [1] * N
got = s.batch_get_into(keys, [dst.ctypes.data + i * BLK for i in range(N)], [BLK] * N)
assert got == [BLK] * N, got
assert (src == dst).all()
s.close()
print("B-OK")
""")


def test_two_node_transfer(need_mooncake: None, harness: types.ModuleType) -> None:
    with harness.two_node_netns() as (a, b), harness.mooncake_master(a, host=a.addr) as m:
        assert m.master_addr.startswith(a.addr + ":")
        with harness.spawn_python(a, _NODE_A, args=["60"], env=m.client_env(a)) as pa:
            assert pa.wait_for_output("PUT [0, 0, 0, 0, 0, 0, 0, 0]", 60), pa.wait(1).stderr[-3000:]
            r = harness.run_python(b, _NODE_B, env=m.client_env(b), timeout=90)
            assert r.ok and "B-OK" in r.stdout, r.stderr[-3000:]
