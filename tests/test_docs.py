"""Every code block of README.md and docs/*.md runs as written, so the docs cannot rot.

* ``python`` blocks run (each as a module of its own, in a temporary directory);
  one preceded by ``<!-- validate: ClassName -->`` must also pass the whole
  conformance suite as ``module:ClassName``.
* ``sh`` / ``bash`` blocks: every command parses as a shell line; ``kvconn``
  commands parse against the real CLI (options, arguments, choices), ``make``
  targets exist in the Makefile.
* ``toml`` blocks parse; ``text`` blocks (diagrams, listings, synopses) are not code.
* A block preceded by ``<!-- excerpt -->`` is a fragment: it must still compile
  (python) or parse, but does not run.

The README's author snippet is also built into a plugin with the README's
entry-point lines, pip-installed, and validated by name with the real CLI.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from kvconn.testing.conformance import run_conformance

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KVCONN = Path(sys.executable).parent / "kvconn"

_FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*(?P<marker>excerpt|validate:\s*\w+)\s*-->$")
_SHELLS = {"sh", "bash", "shell"}
_LANGUAGES = {"python", "toml", "text", *_SHELLS}


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its code and its marker comment."""

    path: Path
    line: int
    lang: str
    code: str
    marker: str  # "", "excerpt" or "validate: ClassName"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def module(self) -> str:
        return "doc_" + re.sub(r"\W", "_", f"{self.path.stem}_{self.line}")


def extract(path: Path) -> list[Block]:
    """The fenced code blocks of ``path``, each with the marker comment on the line before it, if any."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, i = i, i + 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        assert i < len(lines), f"{path.name}:{start + 1}: code block never closed"
        previous = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        marker = _MARKER.match(previous)
        code = textwrap.dedent("\n".join(lines[start + 1 : i])) + "\n"
        blocks.append(Block(path, start + 1, fence["lang"], code, marker["marker"] if marker else ""))
        i += 1
    return blocks


BLOCKS = [block for path in DOCS for block in extract(path)]


def _blocks(*langs: str, excerpts: bool = False) -> list[pytest.param]:
    return [pytest.param(b, id=b.name) for b in BLOCKS if b.lang in langs and (b.marker == "excerpt") == excerpts]


def test_every_block_says_what_it_is() -> None:
    unknown = [f"{b.name} ({b.lang or 'no language'})" for b in BLOCKS if b.lang not in _LANGUAGES]
    assert not unknown, f"give these blocks one of the languages {sorted(_LANGUAGES)}: {unknown}"
    # the blocks this test file promises to cover are there
    assert {b.lang for b in BLOCKS} >= {"python", "sh", "toml", "text"}
    assert any(b.marker.startswith("validate:") for b in BLOCKS if b.path.name == "README.md")


def _import_block(block: Block, directory: Path) -> None:
    (directory / f"{block.module}.py").write_text(block.code, encoding="utf-8")
    importlib.import_module(block.module)


@pytest.mark.parametrize("block", _blocks("python"))
def test_python_blocks_run(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _import_block(block, tmp_path)
    if block.marker.startswith("validate:"):
        class_name = block.marker.partition(":")[2].strip()
        report = run_conformance(f"{block.module}:{class_name}")
        failures = {r.id: r.message for r in report.results if r.status == "failed"}
        assert report.ok, f"{block.name}: {report.load_error or failures}"
        assert report.passed > 0


@pytest.mark.parametrize("block", _blocks("python", excerpts=True))
def test_python_excerpts_compile(block: Block) -> None:
    compile(block.code, block.name, "exec")


def _commands(code: str) -> list[list[str]]:
    """Each command of a shell block, split as the shell would (comments dropped, continuations and quotes joined)."""
    commands, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quoted string goes on over the next line
            continue
        pending = ""
        if argv:
            commands.append(argv)
    assert not pending, f"unclosed quote in {pending!r}"
    return commands


def _parse_kvconn(args: list[str]) -> None:
    """Parse ``kvconn ARGS`` with the real command line (raises click's usage errors), without running it."""
    import typer

    from kvconn_cli.app import app

    group = typer.main.get_command(app)
    with group.make_context("kvconn", args[:1]) as context:
        command = group.get_command(context, args[0])  # type: ignore[attr-defined]
        assert command is not None, f"kvconn has no command {args[0]!r}"
        command.make_context(args[0], args[1:], parent=context)


@pytest.mark.parametrize("block", _blocks(*_SHELLS) + _blocks(*_SHELLS, excerpts=True))
def test_shell_blocks_parse(block: Block) -> None:
    commands = _commands(block.code)
    assert commands, f"{block.name}: an empty shell block"
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    for argv in commands:
        if argv[0] == "kvconn":
            _parse_kvconn(argv[1:])
        elif argv[0] == "make":
            assert set(argv[1:]) <= targets, f"{block.name}: no make target {argv[1:]}"


@pytest.mark.parametrize("block", _blocks("toml") + _blocks("toml", excerpts=True))
def test_toml_blocks_parse(block: Block) -> None:
    tomllib.loads(block.code)


def test_readme_author_snippet_validates_as_an_installed_plugin(tmp_path: Path) -> None:
    """The README's connector, packaged with the README's entry-point lines: `kvconn validate NAME` passes."""
    readme = [b for b in BLOCKS if b.path.name == "README.md"]
    snippet = next(b for b in readme if b.marker.startswith("validate:"))
    declared = next(b for b in readme if b.lang == "toml")
    ((name, target),) = tomllib.loads(declared.code)["project"]["entry-points"]["kvconn.connectors"].items()
    package = target.partition(":")[0]
    project = tmp_path / "project"
    (project / package).mkdir(parents=True)
    (project / package / "__init__.py").write_text(snippet.code)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "kvconn-readme-example"\nversion = "0.1.0"\ndependencies = ["kvconn-sdk"]\n\n'
        + declared.code
        + f'\n[tool.hatch.build.targets.wheel]\npackages = ["{package}"]\n'
    )
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(site), str(project)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    env["KVCONN_PLUGINS"] = name
    proc = subprocess.run(
        [str(KVCONN), "validate", name, "--json"], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = json.loads(proc.stdout)["connectors"]
    assert report["name"] == name and report["failed"] == 0 and report["passed"] > 0
