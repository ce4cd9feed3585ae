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
* A ``python`` block preceded by ``<!-- pytest -->`` is a test module: pytest runs
  it, in a process of its own, and every test in it must pass.

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
_MARKER = re.compile(r"^<!--\s*(?P<marker>excerpt|pytest|validate:\s*\w+)\s*-->$")
_SHELLS = {"sh", "bash", "shell"}
_LANGUAGES = {"python", "toml", "text", *_SHELLS}


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its code and its marker comment."""

    path: Path
    line: int
    lang: str
    code: str
    marker: str  # "", "excerpt", "pytest" or "validate: ClassName"

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


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in BLOCKS if b.marker == "pytest"])
def test_pytest_blocks_pass(block: Block, tmp_path: Path) -> None:
    (tmp_path / f"{block.module}.py").write_text(block.code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    pytest_args = ["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), f"{block.module}.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{block.name}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout


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


# --- The names a doc's prose gives (`code spans`) exist: a renamed module, hook, key or flag fails here. ---

#: Docs whose every code span is checked against the code.
NAME_CHECKED_DOCS = [REPO / "docs" / "vllm.md"]
_SPAN = re.compile(r"`([^`]+)`")
_LITERAL = re.compile(r'"([^"]*)"')
_NAME = re.compile(r"(?<![\w.:/-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_ENV_VAR = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
_WORD = re.compile(r"[A-Za-z_]\w*")
#: Python's own names, and a doc's placeholders: not looked up.
_NOT_NAMES = {"None", "True", "False", "tuple", "list", "dict", "set", "int", "str", "bytes", "NAME", "MODEL"}
#: Namespaces whose names a doc may use unqualified (``ConnectorContext.block_size``).
_NAMESPACES = ["kvconn", "kvconn.host", "kvconn.testing", "kvconn.testing.conformance", "kvconn_vllm"]


def _prose_spans(path: Path) -> list[str]:
    """The code spans of ``path`` outside its fenced blocks, each with its line breaks joined."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    return [" ".join(span.split()) for span in _SPAN.findall(text)]


def _sources(root: Path, patterns: tuple[str, ...] = ("*.py",)) -> str:
    return "\n".join(
        p.read_text(encoding="utf-8", errors="replace")
        for pattern in patterns
        for p in root.rglob(pattern)
        if not any(part.startswith(".venv") for part in p.relative_to(root).parts) and p != Path(__file__)
    )


@pytest.fixture(scope="module")
def kvconn_code() -> str:
    """The repository's code (packages, tests, scripts, Makefile): not its docs."""
    roots = [REPO / d for d in ("sdk", "cli", "adapters", "plugins", "tests", "scripts", "examples")]
    return "\n".join([*(_sources(r, ("*.py", "*.sh", "*.toml")) for r in roots), (REPO / "Makefile").read_text()])


def _vllm_source() -> Path | None:
    """vLLM's package directory: this interpreter's, else a vLLM venv of this checkout (read, never imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    found = sorted(REPO.glob(".venv-vllm*/lib/python*/site-packages/vllm/envs.py"))
    return found[0].parent if found else None


def _resolve(dotted: str) -> bool:
    """``dotted`` is an importable module, or an attribute path under one (a lazy name counts if exported)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name == "vllm" and cut == len(parts) and importlib.util.find_spec(dotted) is not None:
                return True  # a kvconn_vllm module that imports vLLM at its top (absent here): it exists
            continue
        except ImportError:
            continue
        for attr in parts[cut:]:
            if attr in getattr(obj, "__all__", ()) and attr == parts[-1]:
                return True  # exported (kvconn_vllm's classes are imported lazily, with vLLM)
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _check_span(span: str, code: str, names_for_vllm: set[str]) -> list[str]:
    """What in ``span`` names nothing that exists; names only vLLM can confirm go to ``names_for_vllm``."""
    entry_point = re.fullmatch(r'(\w+) = "([\w.]+):(\w+)"', span)
    if entry_point:  # an entry-point line: declared by one of the projects, and its target exists
        ok = span in code and _resolve(f"{entry_point[2]}.{entry_point[3]}")
        return [] if ok else [f"`{span}`: no project declares this entry point, or its target is missing"]
    argv = span.split()
    if argv[0] == "kvconn" and len(argv) > 1:
        try:
            _parse_kvconn(shlex.split(span)[1:])
        except Exception as exc:
            return [f"`{span}`: {exc}"]
        return []
    if argv[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
        return [f"`{span}`: no make target {t!r}" for t in argv[1:] if t not in targets]
    if argv[:2] == ["pip", "install"]:
        paths = [argv[i + 1].split("[")[0] for i, a in enumerate(argv) if a == "-e"]
        return [f"`{span}`: no project at {p}" for p in paths if not (REPO / p / "pyproject.toml").is_file()]
    if "::" in span:
        file, _, test = span.partition("::")
        ok = (REPO / file).is_file() and f"def {test}(" in (REPO / file).read_text()
        return [] if ok else [f"`{span}`: no such test"]
    first = argv[0]
    if "/" in first or re.search(r"\.(py|sh|json|toml)$", first) or first.startswith(".venv"):
        if first.startswith(("$", "/", "~")):
            return []  # a path on the user's machine
        if (REPO / first).is_file() and first.endswith(".sh"):  # its arguments are modes its `case` handles
            script = (REPO / first).read_text()
            return [f"`{span}`: {first} has no mode {a!r}" for a in argv[1:] if not re.search(rf"\b{a}\)", script)]
        exists = (REPO / first).exists() or first in code or any(REPO.glob(f"*/**/{first}"))
        return [] if exists else [f"`{span}`: no file {first}"]
    problems = []
    for literal in _LITERAL.findall(span):
        if literal and not re.search(r"[<:{ ]", literal) and f'"{literal}"' not in code and f"'{literal}'" not in code:
            names_for_vllm.add(f'"{literal}"')
    for dotted in _NAME.findall(_LITERAL.sub("", span)):
        head = dotted.split(".")[0]
        if dotted in _NOT_NAMES or len(dotted) == 1:
            continue
        if head.startswith("kvconn") and head != "kvconn_" and importlib.util.find_spec(head) is None:
            import kvconn_vllm

            if dotted not in kvconn_vllm.EXTRA_CONFIG_KEYS:
                problems.append(f"`{span}`: {dotted} is neither a module nor a key kvconn_vllm reads")
        elif head.startswith("kvconn"):
            if not _resolve(dotted):
                problems.append(f"`{span}`: {dotted} does not exist")
        elif ns := next((ns for ns in _NAMESPACES if head in importlib.import_module(ns).__all__), None):
            if not _resolve(f"{ns}.{dotted}"):
                problems.append(f"`{span}`: {ns}.{dotted} does not exist")
        elif dotted.startswith("VLLM_") and _ENV_VAR.fullmatch(dotted):
            names_for_vllm.add(dotted)  # vLLM's environment variables are vLLM's to define
        else:
            names_for_vllm.update(w for w in dotted.split(".") if not re.search(rf"\b{w}\b", code))
    return problems


@pytest.mark.parametrize("path", NAME_CHECKED_DOCS, ids=lambda p: p.name)
def test_names_in_prose_exist(path: Path, kvconn_code: str) -> None:
    """Module paths, config keys, commands, files and kvconn names in the prose resolve (vLLM's: next test)."""
    problems = [p for span in _prose_spans(path) for p in _check_span(span, kvconn_code, set())]
    for alias, target in re.findall(r"`([\w.]+)`[^`]{0,60}? is an alias of `([\w.]+)`", path.read_text()):
        exported = set(importlib.import_module(target).__all__)
        if alias == target or not exported <= set(importlib.import_module(alias).__all__):
            problems.append(f"`{alias}` is said to be an alias of `{target}`, and is not")
    assert not problems, f"{path.name} names what the code does not have:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", NAME_CHECKED_DOCS, ids=lambda p: p.name)
def test_vllm_names_in_prose_exist_in_vllm(path: Path, kvconn_code: str) -> None:
    """The names kvconn's code does not define (vLLM's classes, hooks, fields, env vars) are in vLLM's source."""
    source = _vllm_source()
    if source is None:
        pytest.skip("no vLLM source here to check vLLM's names against (make test-vllm builds .venv-vllm)")
    wanted: set[str] = set()
    for span in _prose_spans(path):
        _check_span(span, kvconn_code, wanted)
    text = _sources(source)
    words = set(_WORD.findall(text))
    # a quoted value is in vLLM's code quoted, or is one of its names (a config field given as a JSON key)
    missing = sorted(w for w in wanted if w not in text and f"'{w[1:-1]}'" not in text and w.strip('"') not in words)
    assert not missing, f"{path.name} names what neither kvconn nor vLLM ({source}) has: {missing}"


@pytest.mark.parametrize(
    ("span", "for_vllm"),
    [
        ("kvconn_vllm.tables.TableTrackr", ""),  # a misspelt class
        ("kvconn_conector", ""),  # a config key the adapter does not read
        ("kvconn validate NAME --engin vllm", ""),  # a flag the CLI does not have
        ("ConnectorContext.blocksize", ""),
        ("make test-vlm", ""),
        ("pip install -e sdk -e adapters/vlm", ""),
        ("scripts/install-vllm-venv.sh engines", ""),
        ('kvconn = "kvconn_vllm:regster"', ""),
        ("request_finished_all_group(request, block_ids)", "request_finished_all_group"),  # vLLM's to confirm
        ("VLLM_CPU_KV_CACHE_SPACE", "VLLM_CPU_KV_CACHE_SPACE"),
    ],
)
def test_a_wrong_name_is_caught(span: str, for_vllm: str, kvconn_code: str) -> None:
    wanted: set[str] = set()
    problems = _check_span(span, kvconn_code, wanted)
    assert (problems, wanted) != ([], set())
    if for_vllm:
        assert wanted == {for_vllm} and not problems


def test_the_offline_example_help_gives_the_connector_forms_of_the_vllm_guide() -> None:
    """docs/vllm.md runs examples/vllm_offline.py with a name or "pkg.module:Class": its --help says both."""
    assert '`"pkg.module:Class"`' in (REPO / "docs" / "vllm.md").read_text(encoding="utf-8")
    example = REPO / "examples" / "vllm_offline.py"
    proc = subprocess.run([sys.executable, str(example), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pkg.module:Class" in proc.stdout and "kvconn list" in proc.stdout


def _prose(text: str) -> str:
    """Docstring or Markdown text as words: Sphinx roles and double backticks as Markdown's code, spaces folded."""
    return " ".join(re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`").split())


def test_the_store_contract_in_the_guide_is_the_protocols_word_for_word() -> None:
    """docs/authoring.md gives the store contract of kvconn/store/protocol.py: each rule of the module's docstring,
    and each call's signature and docstring. Either changing alone fails here."""
    import inspect

    from kvconn.store import BlockStore, protocol

    guide = _prose((REPO / "docs" / "authoring.md").read_text(encoding="utf-8"))
    assert protocol.__doc__ is not None
    rules = protocol.__doc__[protocol.__doc__.index("\n* ") :].split("\n* ")[1:]
    assert len(rules) >= 5
    missing = [rule for rule in map(_prose, rules) if rule not in guide]
    calls = ("contains", "put", "get", "close")
    for name in calls:
        method = getattr(BlockStore, name)
        signature = inspect.signature(method)
        params = ", ".join(p for p in signature.parameters if p != "self")
        entry = _prose(f"`{name}({params}) -> {signature.return_annotation}`: {inspect.getdoc(method)}")
        if entry not in guide:
            missing.append(entry)
    assert not missing, "docs/authoring.md does not give these as kvconn.store.protocol does:\n" + "\n".join(missing)
    declared = {name for name, _ in inspect.getmembers(BlockStore, inspect.isfunction) if not name.startswith("_")}
    assert declared == set(calls), "a call of BlockStore the guide does not list"
