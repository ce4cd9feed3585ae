"""Role objects: a connector's ``scheduler_side`` / ``worker_side`` are its hook implementations."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kvconn
from kvconn import (
    ConnectorContext,
    ConnectorHost,
    ConnectorLoadError,
    KVConnector,
    KVConnectorBlockState,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    SchedulerOutput,
    load_connector,
    load_connector_class,
)
from kvconn.reference import Engine
from kvconn.testing.conformance import run_conformance

HERE = __name__
MARKER = "kvconn_sides_test_worker"  # a module written by the lazy_module fixture, imported only by a worker


class SidesConfig(msgspec.Struct, forbid_unknown_fields=True):
    hits: int = 0


class Sent(KVConnectorMetadata):
    step: int = 0


class Scheduler:
    """A scheduler side that records what it is called with."""

    def __init__(self, config: SidesConfig, context: ConnectorContext) -> None:
        self.config, self.context = config, context
        self.calls: list[str] = []
        self.outputs: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append("get_num_new_matched_tokens")
        return self.config.hits, False

    def build_connector_meta(self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState) -> Sent:
        self.calls.append("build_connector_meta")
        return Sent(step=len(self.calls))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.outputs.append(connector_output)

    def get_num_tracked_requests(self) -> int:
        return 0


class Worker:
    """A worker side that records the metadata it is handed."""

    def __init__(self, config: SidesConfig, context: ConnectorContext) -> None:
        self.seen: list[int] = []

    def start_load_kv(self, metadata: Sent) -> None:
        self.seen.append(metadata.step)

    def get_kv_connector_stats(self) -> dict[str, float]:
        return {"worker_steps": float(len(self.seen))}


class Sided(KVConnector):
    Config = SidesConfig
    Metadata = Sent
    api_version = "1.0"
    scheduler_side = Scheduler
    worker_side = f"{HERE}:Worker"


def test_each_role_gets_its_side_built_from_config_and_context() -> None:
    context = ConnectorContext(block_size=4)
    scheduler = load_connector(f"{HERE}:Sided", role="scheduler", config={"hits": 8}, context=context)
    worker = load_connector(f"{HERE}:Sided", role="worker", context=context)
    assert isinstance(scheduler, Sided) and isinstance(scheduler.side, Scheduler)
    assert scheduler.side.config == SidesConfig(hits=8) and scheduler.side.context is context
    assert isinstance(worker, Sided) and isinstance(worker.side, Worker)


def test_the_side_is_the_plugin_and_its_methods_are_the_hooks() -> None:
    with Engine(f"{HERE}:Sided") as engine:
        engine.generate([list(range(10))], max_tokens=3)
        assert engine.scheduler_host is not None and engine.worker_host is not None
        scheduler = engine.scheduler_host.connectors[f"{HERE}:Sided"]
        worker = engine.worker_host.connectors[f"{HERE}:Sided"]
    assert isinstance(scheduler, Sided) and isinstance(scheduler.side, Scheduler)
    assert isinstance(worker, Sided) and isinstance(worker.side, Worker)
    steps = scheduler.side.calls.count("build_connector_meta")
    assert steps >= 3 and "get_num_new_matched_tokens" in scheduler.side.calls
    assert worker.side.seen == [i for i, c in enumerate(scheduler.side.calls, 1) if c == "build_connector_meta"]
    assert sum(o.stats.get("worker_steps", 0) for o in scheduler.side.outputs) == sum(range(1, steps + 1))


def test_a_host_registers_the_side_not_the_connector() -> None:
    connector = load_connector(f"{HERE}:Sided", role="scheduler", config={"hits": 0})
    host = ConnectorHost({"s": connector}, role="scheduler")
    assert host.connectors["s"] is connector
    assert host.num_tracked_requests() == {"s": 0}  # Scheduler.get_num_tracked_requests: the connector has none
    assert not hasattr(connector, "get_num_tracked_requests")


@pytest.fixture
def lazy_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    (tmp_path / f"{MARKER}.py").write_text(
        textwrap.dedent(
            """
            class Worker:
                def __init__(self, config, context):
                    self.context = context

                def wait_for_save(self):
                    pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(MARKER, None)
    yield
    sys.modules.pop(MARKER, None)


class LazyWorker(KVConnector):
    api_version = "1.0"
    scheduler_side = Scheduler
    worker_side = f"{MARKER}:Worker"


@pytest.mark.usefixtures("lazy_module")
def test_a_lazy_side_is_imported_only_for_its_role() -> None:
    load_connector(f"{HERE}:LazyWorker", role="scheduler")
    load_connector_class(f"{HERE}:LazyWorker")
    assert MARKER not in sys.modules
    worker = load_connector(f"{HERE}:LazyWorker", role="worker")
    assert MARKER in sys.modules and type(worker.side).__module__ == MARKER


def test_offload_scheduler_and_kvconn_info_do_not_import_torch() -> None:
    code = (
        "import sys, kvconn; from kvconn_cli.inspection import describe; "
        "c = kvconn.load_connector('offload', role='scheduler'); d = describe('offload'); "
        "print(type(c.side).__name__, d.sides['worker'], d.lazy_sides, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["OffloadScheduler", "kvconn_offload.worker:OffloadWorker", "['worker']", "False"]


# -------------------------------------------------------------- wrong role


class SchedulerWithWorkerHook(Scheduler):
    def save_kv_layer(self, layer_name: str) -> None:
        pass


class WrongSide(KVConnector):
    api_version = "1.0"
    scheduler_side = SchedulerWithWorkerHook


class LazyWrongSide(KVConnector):
    api_version = "1.0"
    worker_side = f"{HERE}:Scheduler"


class OnlyScheduler(KVConnector):
    api_version = "1.0"
    roles = frozenset({KVConnectorRole.SCHEDULER})

    def build_connector_meta(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def wait_for_save(self) -> None:
        pass


class HookBesideItsSide(KVConnector):
    api_version = "1.0"
    scheduler_side = Scheduler

    def request_finished(self, request: Any) -> bool:
        return False


class BothRoles(KVConnector):
    """Serves both roles itself: hooks of either role are called on it."""

    api_version = "1.0"

    def build_connector_meta(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def wait_for_save(self) -> None:
        pass


class SchedulerOnlyNarrowing(BothRoles):
    roles = frozenset({KVConnectorRole.SCHEDULER})


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (
            "WrongSide",
            "SchedulerWithWorkerHook implements save_kv_layer (worker-side), never called on it: it is the "
            "scheduler side of WrongSide. Move each hook to the object serving its role",
        ),
        ("OnlyScheduler", "OnlyScheduler implements wait_for_save (worker-side), never called on it: it serves only "),
        ("HookBesideItsSide", "HookBesideItsSide implements request_finished (scheduler-side), never called on it"),
    ],
)
def test_a_hook_where_its_role_is_never_served_is_refused_at_load(cls: str, expected: str) -> None:
    with pytest.raises(ConnectorLoadError) as info:
        load_connector_class(f"{HERE}:{cls}")
    assert expected in str(info.value)


def test_a_lazy_side_with_a_hook_of_the_other_role_is_refused_when_built() -> None:
    load_connector(f"{HERE}:LazyWrongSide", role="scheduler")  # the worker side is not imported here
    with pytest.raises(ConnectorLoadError, match=r"Scheduler implements build_connector_meta \(scheduler-side\)"):
        load_connector(f"{HERE}:LazyWrongSide", role="worker")


def test_a_subclass_may_narrow_roles_under_hooks_it_inherits() -> None:
    assert load_connector_class(f"{HERE}:SchedulerOnlyNarrowing") is SchedulerOnlyNarrowing
    with pytest.raises(ConnectorLoadError, match="does not serve the worker role"):
        load_connector(f"{HERE}:SchedulerOnlyNarrowing", role="worker")


# ------------------------------------------------------------- bad declarations


def _sided(**attrs: Any) -> type:
    return type("BadSides", (KVConnector,), {"api_version": "1.0", "__qualname__": "BadSides", **attrs})


@pytest.mark.parametrize(
    ("attrs", "role", "expected"),
    [
        (
            {"worker_side": "no_such_module_kvconn:Worker"},
            "worker",
            "BadSides.worker_side = 'no_such_module_kvconn:Worker' (fix the 'package.module:ClassName' path) "
            "failed to import module 'no_such_module_kvconn': ModuleNotFoundError",
        ),
        (
            {"worker_side": f"{HERE}:NoSuchClass"},
            "worker",
            f"BadSides.worker_side = '{HERE}:NoSuchClass' (fix the 'package.module:ClassName' path): module "
            f"'{HERE}' has no attribute 'NoSuchClass'",
        ),
        (
            {"worker_side": "no_colon"},
            "worker",
            "BadSides.worker_side = 'no_colon' (fix the 'package.module:ClassName' path): 'no_colon' is not a path",
        ),
        (
            {"scheduler_side": f"{HERE}:_sided"},
            "scheduler",
            f"BadSides.scheduler_side = '{HERE}:_sided' names function",
        ),
    ],
)
def test_a_bad_side_declaration_is_a_clear_load_error(attrs: dict[str, Any], role: str, expected: str) -> None:
    with pytest.raises(ConnectorLoadError) as info:
        _sided(**attrs)(role=role)
    assert expected in str(info.value)


class SideForUnservedRole(KVConnector):
    api_version = "1.0"
    roles = frozenset({KVConnectorRole.SCHEDULER})
    scheduler_side = Scheduler
    worker_side = Worker


def test_a_side_for_a_role_the_connector_does_not_serve_is_refused() -> None:
    with pytest.raises(ConnectorLoadError, match=r"declares worker_side = .* but its roles are \['scheduler'\]"):
        load_connector_class(f"{HERE}:SideForUnservedRole")


def test_validate_reports_a_lazy_side_of_the_wrong_role_in_kv006() -> None:
    report = run_conformance(f"{HERE}:LazyWrongSide", select="KV006")
    assert report.load_error is None
    (result,) = report.results
    assert result.status == "failed"
    assert "Scheduler implements build_connector_meta (scheduler-side), " in result.message
    assert "never called on it: it is the worker side of LazyWrongSide" in result.message


class SkipsBaseInit(Sided):
    """Its own __init__ never calls KVConnector's, so no side is ever built."""

    def __init__(self, config: SidesConfig | None = None, *, role: Any, context: Any = None) -> None:
        self.config = config


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_host_refuses_a_connector_whose_declared_side_was_never_built(role: str) -> None:
    # Registered as its own hooks, it would have none for this role: every save and load silently skipped.
    with pytest.raises(ConnectorLoadError, match=r"declares a .*_side but has no side built.*super\(\).__init__"):
        ConnectorHost.from_names(f"{HERE}:SkipsBaseInit", role=role)


def test_a_host_refuses_a_connector_built_for_the_other_role() -> None:
    # The scheduler's side on a worker host would be the plugin: the worker hooks never run, silently.
    connector = load_connector(f"{HERE}:Sided", role="scheduler")
    with pytest.raises(ConnectorLoadError, match="was built for the scheduler role, not the worker role"):
        ConnectorHost({"s": connector}, role="worker")


class PlainWithSide:
    """Not a KVConnector: nothing would ever build its declared side."""

    api_version = "1.0"
    worker_side = Worker

    def __init__(self, config: Any = None, *, role: Any, context: Any = None) -> None:
        self.role = role

    @kvconn.hookimpl
    def build_connector_meta(self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState) -> Sent:
        return Sent()


def test_a_side_on_a_class_that_is_not_a_kvconnector_is_refused() -> None:
    # Loaded, it would run with no worker hooks at all: its declared side is built only by KVConnector.__init__.
    with pytest.raises(ConnectorLoadError, match=r"PlainWithSide declares worker_side .* subclass kvconn.KVConnector"):
        load_connector_class(f"{HERE}:PlainWithSide")
    with pytest.raises(ConnectorLoadError, match=r"PlainWithSide declares worker_side .* subclass kvconn.KVConnector"):
        ConnectorHost({"p": PlainWithSide(role="worker")}, role="worker")


def test_a_lazy_side_whose_module_lacks_a_dependency_is_not_blamed_on_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The path is right (offload's worker side without torch, say): the error names the missing module, and does
    # not send the author to fix the declaration.
    (tmp_path / "kvconn_sides_needs_dep.py").write_text("import no_such_dependency_kvconn\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvconn_sides_needs_dep", raising=False)
    with pytest.raises(ConnectorLoadError) as info:
        _sided(worker_side="kvconn_sides_needs_dep:Worker")(role="worker")
    message = str(info.value)
    assert "failed to import module 'kvconn_sides_needs_dep'" in message
    assert "No module named 'no_such_dependency_kvconn'" in message
    assert "fix the" not in message
