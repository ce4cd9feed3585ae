"""Fixtures for the CLI tests: the real ``kvconn`` executable, and plugins installed with pip.

Plugins made for the tests are installed with ``pip install --target`` into a
temporary directory and put on ``PYTHONPATH`` of the subprocesses that need
them, so they are real entry points (discovered from installed metadata)
without touching the shared development venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from kvconn.testing.conformance import CheckResult, ConnectorReport

KVCONN = Path(sys.executable).parent / "kvconn"
REPO = Path(__file__).resolve().parents[2]

RunKvconn = Callable[..., subprocess.CompletedProcess[str]]

#: Plugins with the bugs `kvconn list` / `info` / `validate` must survive, one module each.
_BROKEN_MODULES = {
    "import_error": """
        raise ImportError("libfoo.so.1: cannot open shared object file")
    """,
    "exits": """
        import sys

        sys.exit(3)
    """,
    "bad_api": """
        from kvconn_dummy import DummyConnector


        class Connector(DummyConnector):
            api_version = "2.0"
    """,
    "noisy": """
        from kvconn_dummy import DummyConnector

        print("noisy plugin says hello on stdout")


        class Connector(DummyConnector):
            \"\"\"Prints while importing and starting; otherwise the dummy.\"\"\"

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                print("noisy connector started")
    """,
    "fd_writer": """
        import ctypes
        import os

        from kvconn_dummy import DummyConnector

        os.write(1, b"fd-writer: raw bytes on fd 1 at import\\n")
        _libc = ctypes.CDLL(None)


        class Connector(DummyConnector):
            \"\"\"Writes to file descriptor 1 below sys.stdout, as a C extension does, at import and in hooks.\"\"\"

            def start_load_kv(self, metadata):
                os.write(1, b"fd-writer: raw bytes on fd 1 in start_load_kv\\n")
                _libc.printf(b"fd-writer: buffered C stdio in start_load_kv\\n")
                super().start_load_kv(metadata)
    """,
    "leaky": """
        from kvconn_dummy import DummyConnector


        class Connector(DummyConnector):
            \"\"\"Forgets to stop tracking finished requests (a lifecycle bug).\"\"\"

            def request_finished(self, request):
                self._record("request_finished", request.request_id)
                return False
    """,
}

BROKEN_PLUGINS = {f"e2e-{module.replace('_', '-')}": module for module in _BROKEN_MODULES}


def pip_install_target(project: Path, target: Path) -> None:
    """``pip install`` ``project`` into ``target`` (offline: no deps, the venv's hatchling builds it)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(target), str(project)],
        check=True,
        capture_output=True,
        text=True,
    )  # fmt: skip


def env_with_path(path: Path | None = None, **extra: str) -> dict[str, str]:
    """The current environment, with ``path`` first on ``PYTHONPATH`` and ``extra`` set.

    Plugin filters are cleared: a test that wants them passes them in ``extra``.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("KVCONN_PLUGINS", "KVCONN_DISABLE_PLUGINS")}
    env["COLUMNS"] = "200"  # wide tables: assertions on text do not depend on wrapping
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def write_distribution(
    project: Path, name: str, modules: Mapping[str, str], *, version: str = "0.0.1", extra_toml: str = ""
) -> None:
    """Write a hatchling project ``name`` into ``project``: package ``name`` with ``-`` as ``_``, one file per module.

    ``modules`` maps module names (``__init__`` included) to their source; ``extra_toml`` goes
    into ``pyproject.toml`` after ``[project]`` (dependencies, entry points).
    """
    package = name.replace("-", "_")
    (project / "src" / package).mkdir(parents=True)
    for module, source in modules.items():
        (project / "src" / package / f"{module}.py").write_text(textwrap.dedent(source).lstrip())
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\n{extra_toml}\n\n'
        f'[tool.hatch.build.targets.wheel]\npackages = ["src/{package}"]\n'
    )


@pytest.fixture(scope="session")
def broken_plugins_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding an installed distribution with the broken plugins above."""
    project = tmp_path_factory.mktemp("broken-plugins-src")
    entry_points = "\n".join(f'{name} = "kvconn_e2e_broken.{m}:Connector"' for name, m in BROKEN_PLUGINS.items())
    write_distribution(
        project,
        "kvconn-e2e-broken",
        {"__init__": "", **_BROKEN_MODULES},
        extra_toml=f'\n[project.entry-points."kvconn.connectors"]\n{entry_points}',
    )
    site = tmp_path_factory.mktemp("broken-plugins-site")
    pip_install_target(project, site)
    return site


@pytest.fixture
def run_kvconn() -> RunKvconn:
    """Run the installed ``kvconn`` executable: ``run_kvconn("list", "--json", env=..., cwd=...)``.

    The default environment sees only the dummy plugin (``KVCONN_PLUGINS=dummy``): tests do not
    depend on, or pay for importing, whatever other plugins the venv has.
    """

    def run(
        *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(KVCONN), *args],
            capture_output=True,
            text=True,
            env=dict(env) if env is not None else env_with_path(KVCONN_PLUGINS="dummy"),
            cwd=cwd,
            timeout=300,
        )

    return run


@pytest.fixture
def broken_env(broken_plugins_site: Path) -> dict[str, str]:
    """An environment in which the broken plugins are installed next to the dummy (and only they are seen)."""
    return env_with_path(broken_plugins_site, KVCONN_PLUGINS=",".join(["dummy", *BROKEN_PLUGINS]))


@pytest.fixture
def make_env() -> Callable[..., dict[str, str]]:
    """:func:`env_with_path` as a fixture."""
    return env_with_path


@pytest.fixture
def pip_install() -> Callable[[Path, Path], None]:
    """:func:`pip_install_target` as a fixture."""
    return pip_install_target


@pytest.fixture
def sample_reports() -> list[ConnectorReport]:
    """Reports of every kind: a pass, a failure with its fix, a skip, and a connector that did not load."""
    return [
        ConnectorReport(
            "leaky",
            [
                CheckResult("KV001", "found", "passed"),
                CheckResult("KV032", "no-leaks", "failed", "observed 3 tracked; fix: forget finished requests"),
                CheckResult("KV040", "round-trip", "skipped", "does not load"),
            ],
        ),
        ConnectorReport("gone", [], load_error="connector 'gone' failed to import module 'x': ImportError: nope"),
    ]
