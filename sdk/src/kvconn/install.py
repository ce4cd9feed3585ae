"""Install commands for the hints kvconn prints: each one works as printed.

kvconn is installed from a checkout, not from a package index, so a hint such as
``pip install kvconn-vllm`` cannot work. A hint names instead:

* the interpreter running kvconn (``<python> -m pip``), so the package lands in
  the environment that needs it even when the ``pip`` on ``PATH`` is another's;
* for one of kvconn's own distributions, its directory in the checkout this kvconn
  runs from (an absolute path), or relative to a checkout's root when kvconn was
  installed some other way (from wheels built from it);
* for a third-party extra, the requirements that extra declares, read from the
  installed distribution's metadata, which any index serves.

Public, for the tools and plugins built on kvconn as much as for the SDK: every
hint that says what to install (``kvconn new``'s next step, the CLI's warning about
a forgotten entry point, the vLLM adapter's conformance driver, a plugin's missing
extra) builds its command here, so all of them name the same interpreter and paths.
"""

from __future__ import annotations

import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["checkout_path", "install_extra", "install_project", "pip_install"]

#: ``<checkout>/sdk/src/kvconn/install.py``: the checkout's root, when this file is in one.
_CHECKOUT = Path(__file__).resolve().parents[3]


def pip_install(*args: str) -> str:
    """``<this interpreter> -m pip install ARGS``, quoted for a POSIX shell."""
    return shlex.join([sys.executable, "-m", "pip", "install", *args])


def checkout_path(relative: str) -> str | None:
    """``relative`` (e.g. ``"adapters/vllm"``) as an absolute path in this kvconn's checkout; ``None`` if not there."""
    path = _CHECKOUT / relative
    return str(path) if path.exists() and (_CHECKOUT / "sdk" / "pyproject.toml").is_file() else None


def install_project(relative: str, extra: str = "") -> str:
    """The command installing kvconn's project at ``relative`` (editable, with ``extra``), as it works where printed."""
    path = checkout_path(relative)
    suffix = f"[{extra}]" if extra else ""
    if path is not None:
        return pip_install("-e", path + suffix)
    return f"{pip_install('-e', relative + suffix)} (at the root of a kvconn checkout)"


def install_extra(distribution: str, extra: str, project: str) -> str:
    """The command installing what ``distribution``'s ``extra`` adds: its requirements, which an index serves.

    Without the distribution's metadata (its sources on ``PYTHONPATH``), the
    project at ``project`` in the checkout, with the extra.
    """
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    try:
        declared = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        declared = []
    requirements = [r.partition(";")[0].strip() for r in declared if marker.search(r.partition(";")[2])]
    return pip_install(*requirements) if requirements else install_project(project, extra)
