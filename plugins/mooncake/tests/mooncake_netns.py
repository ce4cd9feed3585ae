"""Test harness: run a real Mooncake master + clients inside throw-away
network namespaces.

Why: the Mooncake transfer engine refuses to start without a non-loopback
IPv4 address and otherwise binds to the machine's real interface. Tests must
never touch real interfaces, so everything runs inside namespaces that this
module creates (``ip netns add kvconn-<hex>``) with a private veth pair
(10.77.<n>.1 / 10.77.<n>.2) whose both ends live inside our namespaces. The
root namespace is never modified.

Standard library only. Requires root, ``ip`` (iproute2) and veth support.

Typical use (pytest)::

    from mooncake_netns import (netns_unavailable_reason,
        mooncake_unavailable_reason, netns, mooncake_master, run_python)

    reason = netns_unavailable_reason() or mooncake_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns() as ns, mooncake_master(ns) as m:
        r = run_python(ns, CLIENT_CODE, env=m.client_env(), timeout=60)
        assert r.rc == 0, r.stderr

Client code reads ``MC_LOCAL_HOSTNAME``, ``MC_METADATA_URL`` and
``MC_MASTER_ADDR`` (see ``MasterHandle.client_env``) and calls
``store.setup(host, metadata_url, seg, buf, "tcp", "", master_addr)``.

Two nodes::

    with two_node_netns() as (a, b), mooncake_master(a, host=a.addr) as m:
        run_python(a, PUT_CODE, env=m.client_env(a))
        run_python(b, GET_CODE, env=m.client_env(b))
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence

NS_PREFIX = "kvconn-"
SUBNET_PREFIX = "10.77"
_LOCK_PATH = "/tmp/kvconn-netns.lock"
_IP_TIMEOUT = 10.0

__all__ = [
    "CmdResult",
    "NetNS",
    "MasterHandle",
    "NetnsProcess",
    "netns_unavailable_reason",
    "mooncake_unavailable_reason",
    "find_mooncake_master",
    "default_python",
    "netns",
    "two_node_netns",
    "mooncake_master",
    "run_in_netns",
    "run_python",
    "spawn_in_netns",
    "spawn_python",
    "free_ports_in_netns",
    "tcp_sink",
]


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


@dataclasses.dataclass
class CmdResult:
    rc: int | None  # None when it timed out (process group was killed)
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def check(self) -> CmdResult:
        if not self.ok:
            raise RuntimeError(
                f"command failed rc={self.rc} timed_out={self.timed_out}\n"
                f"--- stdout ---\n{self.stdout[-4000:]}\n"
                f"--- stderr ---\n{self.stderr[-4000:]}"
            )
        return self


def _ip_path() -> str:
    """The iproute2 ``ip`` executable (``/usr/sbin`` is not on every PATH)."""
    return shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str, check: bool = True, timeout: float = _IP_TIMEOUT) -> subprocess.CompletedProcess:
    cp = subprocess.run([_ip_path(), *args], capture_output=True, text=True, timeout=timeout)
    if check and cp.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {cp.stderr.strip()}")
    return cp


def _killpg(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kill the whole process group of a Popen started with start_new_session."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _stop(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    if proc.poll() is None:
        _killpg(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    _killpg(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def default_python() -> str:
    """Interpreter used for in-namespace clients: ``$KVCONN_MOONCAKE_PYTHON``
    (e.g. a venv that has mooncake installed) or ``sys.executable``."""
    return os.environ.get("KVCONN_MOONCAKE_PYTHON") or sys.executable


# --------------------------------------------------------------------------
# availability checks
# --------------------------------------------------------------------------

_NETNS_REASON: list[str | None] = []


def netns_unavailable_reason() -> str | None:
    """None when namespaces + veth can be created here, else a reason string.

    The result is cached for the process. The probe really creates (and
    deletes) a namespace with a veth pair, which is the only reliable check.
    """
    if _NETNS_REASON:
        return _NETNS_REASON[0]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0:
        reason = "network namespaces need root"
    elif not shutil.which("ip"):
        reason = "iproute2 'ip' not found (apt-get install iproute2)"
    else:
        name = f"{NS_PREFIX}probe-{secrets.token_hex(3)}"
        try:
            _ip("netns", "add", name)
            try:
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
            finally:
                _ip("netns", "del", name, check=False)
        except Exception as exc:
            reason = f"cannot create network namespace with veth: {exc}"
    _NETNS_REASON.append(reason)
    return reason


def find_mooncake_master(python: str | None = None) -> str | None:
    """Path of ``mooncake_master``: next to the interpreter, else on PATH."""
    candidates = []
    for exe in (python, default_python(), sys.executable):
        if exe:
            candidates.append(os.path.join(os.path.dirname(exe), "mooncake_master"))
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return shutil.which("mooncake_master")


def mooncake_unavailable_reason(python: str | None = None, timeout: float = 60.0) -> str | None:
    """None when mooncake_master exists and ``python`` (default:
    :func:`default_python`) can import mooncake.store."""
    python = python or default_python()
    if not find_mooncake_master(python):
        return "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
    try:
        cp = subprocess.run(
            [python, "-c", "import mooncake.store"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return "importing mooncake.store timed out"
    if cp.returncode != 0:
        tail = (cp.stderr.strip().splitlines() or ["?"])[-1]
        return f"cannot import mooncake.store ({tail}); needs libibverbs1 librdmacm1 from apt"
    return None


# --------------------------------------------------------------------------
# namespaces
# --------------------------------------------------------------------------


@dataclasses.dataclass
class NetNS:
    name: str
    addr: str  # this namespace's non-loopback (veth) IPv4 address
    peer_addr: str  # other end of the veth pair (same ns, or the other node)
    subnet: int  # the <n> in 10.77.<n>.0/24

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return _exec_argv(self.name, argv)


def _exec_argv(ns: NetNS | str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``ns`` (a namespace or its name) by ``ip netns exec``."""
    name = ns.name if isinstance(ns, NetNS) else ns
    return [_ip_path(), "netns", "exec", name, *argv]


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    with open(_LOCK_PATH, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _used_subnets() -> set[int]:
    used: set[int] = set()
    cp = _ip("netns", "list", check=False)
    for line in cp.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NS_PREFIX):
            continue
        a = _ip("-n", name, "-4", "-o", "addr", check=False)
        for tok in a.stdout.split():
            if tok.startswith(SUBNET_PREFIX + "."):
                with contextlib.suppress(ValueError, IndexError):
                    used.add(int(tok.split(".")[2]))
    return used


def _pick_subnet() -> int:
    used = _used_subnets()
    free = [n for n in range(1, 255) if n not in used]
    if not free:
        raise RuntimeError("no free 10.77.x.0/24 subnet (stale kvconn-* namespaces?)")
    return free[secrets.randbelow(len(free))]


def _kill_ns_pids(name: str) -> None:
    """SIGKILL every process still living in one of OUR namespaces."""
    cp = _ip("netns", "pids", name, check=False)
    for tok in cp.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)


def _delete_ns(name: str) -> None:
    for _ in range(3):
        _kill_ns_pids(name)
        time.sleep(0.05)
        _ip("netns", "del", name, check=False)
        if name not in _ip("netns", "list", check=False).stdout.split():
            return
        time.sleep(0.2)


def _setup_link(ns: str, dev: str, cidr: str) -> None:
    _ip("-n", ns, "addr", "add", cidr, "dev", dev)
    _ip("-n", ns, "link", "set", dev, "up")


@contextlib.contextmanager
def netns(prefix: str = NS_PREFIX) -> Iterator[NetNS]:
    """A fresh namespace with lo up and a veth pair (both ends inside it).

    ``ns.addr`` = 10.77.<n>.1 on ``veth0``; ``ns.peer_addr`` = 10.77.<n>.2 on
    ``veth1``. Deleted (with every process in it) on exit.
    """
    name = f"{prefix}{secrets.token_hex(4)}"
    created = False
    try:
        with _subnet_lock():
            n = _pick_subnet()
            _ip("netns", "add", name)
            created = True
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1")
            _setup_link(name, "veth0", f"{SUBNET_PREFIX}.{n}.1/24")
            _setup_link(name, "veth1", f"{SUBNET_PREFIX}.{n}.2/24")
        yield NetNS(name, f"{SUBNET_PREFIX}.{n}.1", f"{SUBNET_PREFIX}.{n}.2", n)
    finally:
        if created:
            _delete_ns(name)


@contextlib.contextmanager
def two_node_netns(prefix: str = NS_PREFIX) -> Iterator[tuple[NetNS, NetNS]]:
    """Two namespaces A and B joined by one veth pair.

    A has 10.77.<n>.1 (``a.addr``), B has 10.77.<n>.2 (``b.addr``). Each has
    lo up. Both are deleted on exit.
    """
    base = f"{prefix}{secrets.token_hex(4)}"
    na, nb = f"{base}-a", f"{base}-b"
    made: list[str] = []
    try:
        with _subnet_lock():
            n = _pick_subnet()
            for nm in (na, nb):
                _ip("netns", "add", nm)
                made.append(nm)
                _ip("-n", nm, "link", "set", "lo", "up")
            _ip("-n", na, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns", nb)
            _setup_link(na, "veth0", f"{SUBNET_PREFIX}.{n}.1/24")
            _setup_link(nb, "veth0", f"{SUBNET_PREFIX}.{n}.2/24")
        a = NetNS(na, f"{SUBNET_PREFIX}.{n}.1", f"{SUBNET_PREFIX}.{n}.2", n)
        b = NetNS(nb, f"{SUBNET_PREFIX}.{n}.2", f"{SUBNET_PREFIX}.{n}.1", n)
        yield a, b
    finally:
        for nm in made:
            _delete_ns(nm)


# --------------------------------------------------------------------------
# running things inside a namespace
# --------------------------------------------------------------------------


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        e.update({k: str(v) for k, v in env.items()})
    return e


def run_in_netns(
    ns: NetNS | str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    cwd: str | None = None,
    input: str | None = None,
) -> CmdResult:
    """Run ``argv`` inside the namespace; kill its process group on timeout."""
    cmd = _exec_argv(ns, argv)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(env),
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
        return CmdResult(proc.returncode, out, err, False, time.monotonic() - t0)
    except subprocess.TimeoutExpired:
        _killpg(proc)
        out, err = proc.communicate(timeout=10)
        return CmdResult(None, out or "", err or "", True, time.monotonic() - t0)
    finally:
        if proc.poll() is None:
            _killpg(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _code_file(code: str) -> str:
    fd, path = tempfile.mkstemp(prefix="kvconn-netns-", suffix=".py")
    with os.fdopen(fd, "w") as fh:
        fh.write(code)
    return path


def _remove(paths: Sequence[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _python_argv(
    code: str | None, script: str | None, args: Sequence[str], python: str | None
) -> tuple[list[str], list[str]]:
    """The argv running ``code`` (via a temp file) or ``script``, and the temp files to remove after it."""
    if (code is None) == (script is None):
        raise ValueError("pass exactly one of code= or script=")
    python = python or default_python()
    path = script or _code_file(code or "")
    return [python, path, *args], [] if script else [path]


def run_python(
    ns: NetNS | str,
    code: str | None = None,
    *,
    script: str | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    python: str | None = None,
    cwd: str | None = None,
) -> CmdResult:
    """Run a Python snippet (``code``) or file (``script``) inside ``ns``."""
    argv, temp_files = _python_argv(code, script, args, python)
    try:
        return run_in_netns(ns, argv, env=env, timeout=timeout, cwd=cwd)
    finally:
        _remove(temp_files)


class NetnsProcess:
    """A background process in a namespace (own process group).

    stdout/stderr go to temp files (no pipe deadlocks); ``wait()`` returns a
    CmdResult. Always killed (whole group) by ``kill()``/context exit.
    """

    def __init__(
        self,
        ns: NetNS | str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        _cleanup: Sequence[str] = (),
    ):
        self._out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in __exit__
        self._err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._cleanup = list(_cleanup)
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            _exec_argv(ns, argv),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._err,
            text=True,
            env=_env(env),
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def _read(self) -> tuple[str, str]:
        self._out.seek(0)
        self._err.seek(0)
        return self._out.read(), self._err.read()

    def stdout_so_far(self) -> str:
        return self._read()[0]

    def wait_for_output(self, text: str, timeout: float) -> bool:
        """Poll stdout until ``text`` appears (True), the process exits or
        ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.stdout_so_far():
                return True
            if self.proc.poll() is not None:
                return text in self.stdout_so_far()
            time.sleep(0.1)
        return False

    def wait(self, timeout: float) -> CmdResult:
        """Wait at most ``timeout`` s; on timeout the group is killed."""
        timed_out = False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        out, err = self._read()
        rc = None if timed_out else self.proc.returncode
        return CmdResult(rc, out, err, timed_out, time.monotonic() - self._t0)

    def kill(self) -> None:
        _killpg(self.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        _remove(self._cleanup)
        self._cleanup.clear()

    def __enter__(self) -> NetnsProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self._out.close()
        self._err.close()


def spawn_in_netns(
    ns: NetNS | str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> NetnsProcess:
    """Start ``argv`` in the background inside ``ns``. Use as a context manager."""
    return NetnsProcess(ns, argv, env=env, cwd=cwd)


def spawn_python(
    ns: NetNS | str,
    code: str | None = None,
    *,
    script: str | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    cwd: str | None = None,
) -> NetnsProcess:
    """Background variant of :func:`run_python`."""
    argv, temp_files = _python_argv(code, script, args, python)
    return NetnsProcess(ns, argv, env=env, cwd=cwd, _cleanup=temp_files)


_FREE_PORTS_CODE = r"""
import socket, sys
host, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(); s.bind((host, 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
"""


def free_ports_in_netns(ns: NetNS | str, n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports currently free on ``host`` inside the namespace."""
    r = run_in_netns(ns, [sys.executable, "-c", _FREE_PORTS_CODE, host, str(n)], timeout=30).check()
    return [int(p) for p in r.stdout.split()]


_SINK_CODE = r"""
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(64)
print(server.getsockname()[1], flush=True)
held = []
while True:
    held.append(server.accept()[0])
"""


@contextlib.contextmanager
def tcp_sink(ns: NetNS | str, host: str = "127.0.0.1") -> Iterator[str]:
    """A listener in ``ns`` that accepts connections and never answers (not a master); yields its ``host:port``."""
    with spawn_python(ns, _SINK_CODE, args=[host], python=sys.executable) as proc:
        if not proc.wait_for_output("\n", 30):
            raise RuntimeError(f"tcp sink did not start: {proc.wait(1).stderr[-2000:]}")
        yield f"{host}:{int(proc.stdout_so_far().split()[0])}"


_WAIT_READY_CODE = r"""
import socket, sys, time, urllib.request, urllib.error
host, rpc, http, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), time.monotonic() + float(sys.argv[4])
def tcp_ok(p):
    try:
        socket.create_connection((host, p), timeout=0.5).close(); return True
    except OSError:
        return False
def http_ok():
    try:
        urllib.request.urlopen(f"http://{host}:{http}/metadata?key=kvconn_probe", timeout=1)
        return True
    except urllib.error.HTTPError:
        return True   # 404 'metadata not found' == server up
    except Exception:
        return False
while time.monotonic() < deadline:
    if tcp_ok(rpc) and http_ok():
        print("ready"); sys.exit(0)
    time.sleep(0.1)
print("timeout"); sys.exit(1)
"""


# --------------------------------------------------------------------------
# mooncake master
# --------------------------------------------------------------------------


class MasterHandle:
    """A running ``mooncake_master`` inside a namespace.

    Attributes: ``ns``, ``host``, ``rpc_port``, ``http_port``, ``metrics_port``,
    ``master_addr`` ("host:rpc_port"), ``metadata_url``
    ("http://host:http_port/metadata"), ``log_path``.
    """

    def __init__(
        self,
        ns: NetNS,
        binary: str,
        host: str,
        rpc_port: int,
        http_port: int,
        metrics_port: int,
        lease_ttl_ms: int,
        extra_args: Sequence[str],
        ready_timeout: float,
        log_dir: str,
    ):
        self.ns = ns
        self.binary = binary
        self.host = host
        self.rpc_port = rpc_port
        self.http_port = http_port
        self.metrics_port = metrics_port
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_args = list(extra_args)
        self.ready_timeout = ready_timeout
        self.log_path = os.path.join(log_dir, "master.log")
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def argv(self) -> list[str]:
        return [
            self.binary,
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.http_port}",
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
            *self.extra_args,
        ]

    def client_env(self, client_ns: NetNS | None = None) -> dict[str, str]:
        """Env vars for a client script. ``MC_LOCAL_HOSTNAME`` is the address
        the client's transfer engine advertises: 127.0.0.1 for a same-ns
        single-node setup, else the client namespace's veth address."""
        local = self.ns.addr if client_ns is None else client_ns.addr
        if client_ns is None and self.host == "127.0.0.1":
            local = "127.0.0.1"
        return {
            "MC_MASTER_ADDR": self.master_addr,
            "MC_METADATA_URL": self.metadata_url,
            "MC_LOCAL_HOSTNAME": local,
        }

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.is_running():
            raise RuntimeError("master already running")
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"\n===== start #{self.starts} =====\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.ns.exec_argv(self.argv()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=os.path.dirname(self.log_path),
            )
        self.wait_ready()

    def wait_ready(self) -> None:
        r = run_in_netns(
            self.ns,
            [
                sys.executable,
                "-c",
                _WAIT_READY_CODE,
                self.host,
                str(self.rpc_port),
                str(self.http_port),
                str(self.ready_timeout),
            ],
            timeout=self.ready_timeout + 15,
        )
        if not r.ok or not self.is_running():
            self.kill()
            raise RuntimeError(
                f"mooncake_master not ready within {self.ready_timeout}s "
                f"(rc={r.rc}, alive={self.is_running()}):\n{self.log_text()[-4000:]}"
            )

    def pause(self) -> None:
        """Freeze the master (SIGSTOP): its port still accepts connections, nothing answers (a wedged master)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused master run again (SIGCONT)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the master (SIGKILL by default = crash). Idempotent."""
        if self.proc is None:
            return
        if sig == signal.SIGKILL:
            _killpg(self.proc, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        else:
            _stop(self.proc)

    def restart(self, down_s: float = 0.0) -> None:
        """Kill, optionally stay down ``down_s`` seconds, start on the SAME ports."""
        self.kill()
        if down_s > 0:
            time.sleep(down_s)
        deadline = time.monotonic() + 10
        while True:  # ports of the killed master can take a moment to free
            try:
                self.start()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""


@contextlib.contextmanager
def mooncake_master(
    ns: NetNS,
    *,
    host: str = "127.0.0.1",
    lease_ttl_ms: int = 500,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 20.0,
    binary: str | None = None,
    log_dir: str | None = None,
) -> Iterator[MasterHandle]:
    """Start ``mooncake_master`` in ``ns`` on free ports of ``host``.

    ``host`` is 127.0.0.1 for single-node; use the namespace's veth address
    (``ns.addr``) when clients in another namespace must reach it. The master
    is killed (whole process group) on exit. ``log_dir`` defaults to a temp
    dir removed on exit; pass one to keep the log.
    """
    binary = binary or find_mooncake_master()
    if not binary:
        raise RuntimeError("mooncake_master not found")
    tmp = None
    if log_dir is None:
        tmp = tempfile.mkdtemp(prefix="kvconn-mc-master-")
        log_dir = tmp
    rpc, http, metrics = free_ports_in_netns(ns, 3, host)
    m = MasterHandle(ns, binary, host, rpc, http, metrics, lease_ttl_ms, extra_args, ready_timeout, log_dir)
    try:
        m.start()
        yield m
    finally:
        m.kill()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
