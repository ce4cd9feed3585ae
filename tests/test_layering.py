"""The layering contracts of ``pyproject.toml`` cover what docs/architecture.md says they cover."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_private_sdk_module_is_forbidden_outside_the_sdk() -> None:
    """import-linter's wildcards replace whole names only, so the contract lists each ``kvconn._*`` module."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    private = next(c for c in contracts if c["name"].startswith("kvconn's private modules"))
    on_disk = {
        f"kvconn.{path.stem}"
        for path in (REPO / "sdk" / "src" / "kvconn").glob("_*")
        if not path.name.startswith("__") and (path.suffix == ".py" or (path / "__init__.py").is_file())
    }
    assert on_disk, "no private module found: the SDK's layout changed, update this test"
    assert on_disk <= set(private["forbidden_modules"]), f"add {sorted(on_disk - set(private['forbidden_modules']))}"
