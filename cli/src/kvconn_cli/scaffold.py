"""What ``kvconn new NAME`` writes: a plugin distribution that installs and passes ``kvconn validate``.

The templates live in ``kvconn_cli/templates`` (``string.Template`` syntax,
``${name}``); :func:`plan` maps them to paths so the command can report what
it writes, and :func:`write` refuses to touch a non-empty directory.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from .errors import UsageError

__all__ = ["Scaffold", "check_name", "plan", "write"]

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
_MAX_NAME = 40

#: template file -> path in the generated distribution (may use the same ``${...}`` fields).
_COMMON = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "test_conformance.py.tmpl": "tests/test_conformance.py",
}
#: the store connector (the default), or the raw-hook connector (``--hooks``)
_STORE = {"store_init.py.tmpl": "src/${package}/__init__.py", "store_test_store.py.tmpl": "tests/test_store.py"}
_HOOKS = {"__init__.py.tmpl": "src/${package}/__init__.py"}
_README_LAYOUT = {
    False: "`${prefix}Store` (four batched calls) is what moves bytes and `${prefix}Connector`, a "
    "`kvconn.store.StoreConnector`, does the rest; as generated the store is a directory of files, replace it "
    "with your store's client. `tests/test_store.py` checks the store contract",
    True: "`${prefix}Connector` declares it, `${prefix}Scheduler` and `${prefix}Worker` (its `scheduler_side` and "
    "`worker_side`) implement the hooks of each role. It already finds the blocks each step fills, resolves only "
    "those requests' tables, sends the workers the blocks to save and load, and tracks requests; fill in the TODOs "
    "to save and load KV, and set `saves` / `loads` to `True` as you do, so the save/load checks run against it",
}


@dataclass(frozen=True)
class Scaffold:
    """The names one connector's distribution is generated with."""

    name: str  # entry-point name: `kvconn validate <name>`
    package: str  # import name: kvconn_<name>
    distribution: str  # pip name: kvconn-<name>
    prefix: str  # class-name prefix: <Prefix>Connector
    hooks: bool = False  # the raw-hook template instead of a store connector

    @property
    def layout(self) -> dict[str, str]:
        """Template file -> path in the generated distribution."""
        return {**_COMMON, **(_HOOKS if self.hooks else _STORE)}

    @classmethod
    def for_name(cls, name: str, *, hooks: bool = False) -> Scaffold:
        check_name(name)
        parts = re.split(r"[-_]", name)
        return cls(
            name=name,
            package="kvconn_" + "_".join(parts),
            distribution="kvconn-" + "-".join(parts),
            prefix="".join(p.capitalize() for p in parts),
            hooks=hooks,
        )

    def fields(self) -> dict[str, str]:
        from kvconn import API_VERSION, __version__

        fields = {
            "name": self.name,
            "package": self.package,
            "distribution": self.distribution,
            "prefix": self.prefix,
            "api_version": API_VERSION,
            "sdk_version": __version__,
        }
        fields["layout"] = string.Template(_README_LAYOUT[self.hooks]).substitute(fields)
        return fields


def check_name(name: str) -> None:
    """Raise :class:`UsageError` unless ``name`` is a usable connector name (a lowercase slug)."""
    if not name:
        raise UsageError("the connector name is empty: pass a name such as 'mystore'")
    if len(name) > _MAX_NAME:
        raise UsageError(f"connector name {name!r} is {len(name)} characters long: use at most {_MAX_NAME}")
    if not _NAME.match(name):
        suggestion = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        hint = f"; try {suggestion!r}" if suggestion and _NAME.match(suggestion) else ""
        raise UsageError(
            f"connector name {name!r} is not a lowercase slug: start with a letter, then use a-z, 0-9, "
            f"and single '-' or '_' between parts{hint}"
        )


def plan(scaffold: Scaffold, directory: Path) -> dict[Path, str]:
    """Each file to write under ``directory`` and its content."""
    fields = scaffold.fields()
    templates = files(__package__).joinpath("templates")
    return {
        directory / string.Template(target).substitute(fields): string.Template(
            templates.joinpath(source).read_text(encoding="utf-8")
        ).substitute(fields)
        for source, target in scaffold.layout.items()
    }


def write(scaffold: Scaffold, directory: Path) -> list[Path]:
    """Write the distribution into ``directory`` (created; must not exist or be empty); the paths written."""
    if directory.exists():
        if not directory.is_dir():
            raise UsageError(f"{str(directory)!r} exists and is not a directory: pass --dir with a new directory")
        if any(directory.iterdir()):
            raise UsageError(
                f"directory {str(directory)!r} already exists and is not empty: "
                "pass --dir with a new or empty directory"
            )
    contents = plan(scaffold, directory)
    try:
        for path, text in contents.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {str(directory)!r}: {exc.strerror or exc}") from None
    return list(contents)
