"""Every install hint kvconn prints is a command that works for someone who installed from the checkout.

A scratch venv gets kvconn as the README installs it (``pip install -e sdk -e cli``
from the checkout), then each test makes kvconn print a hint, runs the command
the hint names exactly as printed, and checks that what was missing now works.
pip reaches only the local index and cache here, so this runs offline.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with kvconn-sdk and kvconn-cli installed editable from this checkout, as the README says."""
    root = tmp_path_factory.mktemp("scratch") / "venv"
    made = _run(sys.executable, "-m", "venv", root)
    assert made.returncode == 0, made.stderr
    installed = _run(root / "bin" / "python", "-m", "pip", "install", "-q", "-e", REPO / "sdk", "-e", REPO / "cli")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return root / "bin"


def run_hint(text: str, venv: Path) -> list[str]:
    """Find the ``<venv python> -m pip install ...`` command in ``text``, run it as printed, return its argv."""
    match = re.search(re.escape(str(venv / "python")) + r" -m pip install(?: (?:'[^']*'|[^\s'()]+))+", text)
    assert match, f"no install command for this venv in:\n{text}"
    argv = shlex.split(match[0].rstrip(":"))
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, f"the hint {match[0]!r} failed:\n{ran.stdout}{ran.stderr}"
    return argv


def test_the_plot_hint_installs_matplotlib(venv: Path, tmp_path: Path) -> None:
    argv = [venv / "kvconn", "simulate", "--connector", "dummy", "--plot", tmp_path / "p.png"]
    refused = _run(*argv)
    assert refused.returncode == 2 and "--plot needs matplotlib" in refused.stderr, refused.stderr
    run_hint(refused.stderr, venv)
    probe = _run(venv / "python", "-c", "from kvconn_cli.simulate_plot import require_matplotlib; require_matplotlib()")
    assert probe.returncode == 0, probe.stderr


def test_the_vllm_adapter_hints_install_the_adapter(venv: Path) -> None:
    alias = _run(venv / "python", "-c", "import kvconn.adapters.vllm")
    driver = _run(venv / "python", "-c", "from kvconn.testing.conformance import get_driver; get_driver('vllm')")
    assert alias.returncode == driver.returncode == 1
    assert "install it to run kvconn connectors inside vLLM" in alias.stderr
    assert "install kvconn-vllm, which ships it" in driver.stderr
    assert run_hint(alias.stderr, venv) == run_hint(driver.stderr, venv)
    imported = _run(venv / "python", "-c", "import kvconn.adapters.vllm as a; print(a.SHORT_NAME)")
    assert imported.returncode == 0 and imported.stdout.strip() == "kvconn", imported.stderr
    # Now the driver is found and asks for vLLM itself: a script of this checkout, named by its path.
    driver = _run(venv / "python", "-c", "from kvconn.testing.conformance import get_driver; get_driver('vllm')")
    script = re.search(r"build a venv with it: (\S+) scheduler", driver.stderr)
    assert script and Path(script[1]) == REPO / "scripts" / "install-vllm-venv.sh", driver.stderr


def test_the_scaffold_hint_installs_the_new_plugin(venv: Path, tmp_path: Path) -> None:
    created = _run(venv / "kvconn", "new", "hinted", "--dir", "kvconn-hinted", cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    run_hint(created.stderr, venv)
    listed = _run(venv / "python", "-c", "import kvconn; print(kvconn.available_connectors())")
    assert "'hinted'" in listed.stdout, listed.stderr


def test_the_forgotten_entry_point_hint_reinstalls_the_plugin(venv: Path, tmp_path: Path) -> None:
    project = tmp_path / "kvconn-forgot"
    (project / "kvconn_forgot").mkdir(parents=True)
    (project / "kvconn_forgot" / "__init__.py").write_text(
        "import kvconn\n\n\nclass Forgot(kvconn.KVConnector):\n    api_version = '1.0'\n"
    )
    pyproject = (
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "kvconn-forgot"\nversion = "0.1.0"\ndependencies = ["kvconn-sdk"]\n'
    )
    (project / "pyproject.toml").write_text(pyproject)
    installed = _run(venv / "python", "-m", "pip", "install", "-q", "-e", project)
    assert installed.returncode == 0, installed.stderr
    warned = _run(venv / "kvconn", "list")
    lines = re.search(r"add these lines to its pyproject.toml.*?:\n((?:    .*\n)+)", warned.stderr)
    assert lines, warned.stderr
    (project / "pyproject.toml").write_text(pyproject + "\n" + "\n".join(x.strip() for x in lines[1].splitlines()))
    run_hint(warned.stderr, venv)
    listed = _run(venv / "kvconn", "list")
    assert "looks like a kvconn connector" not in listed.stderr and "forgot" in listed.stdout, listed.stderr


def test_the_mooncake_client_hint_installs_the_client(venv: Path) -> None:
    installed = _run(venv / "python", "-m", "pip", "install", "-q", "-e", REPO / "plugins" / "mooncake")
    assert installed.returncode == 0, installed.stderr
    code = "from kvconn_mooncake.mooncake_store import import_client; print(import_client().__name__)"
    missing = _run(venv / "python", "-c", code)
    assert missing.returncode == 1 and "the real Mooncake store needs its client" in missing.stderr
    run_hint(missing.stderr, venv)
    found = _run(venv / "python", "-c", code)
    assert found.returncode == 0 and found.stdout.strip() == "MooncakeDistributedStore", found.stderr
