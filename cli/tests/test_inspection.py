"""What ``list`` and ``info`` read from a connector class: capabilities, config schema, status."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest

import kvconn
from kvconn_cli.inspection import config_fields, describe, summarize, type_name

Port = Annotated[int, msgspec.Meta(ge=1, le=65535, description="TCP port of the store.")]


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Options of a store."""

    host: Annotated[str, msgspec.Meta(description="Store host name.")]
    port: Port = 7000
    mode: Literal["sync", "async"] = "sync"
    tags: list[str] = msgspec.field(default_factory=lambda: ["a"])
    timeout: float | None = None
    secret: Annotated[str, msgspec.Meta(min_length=16, description="A shared secret.")] | None = None


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (int, "int"),
        (list[str], "list[str]"),
        (dict[str, tuple[int, ...]], "dict[str, tuple[int, ...]]"),
        (float | None, "float | None"),
        (Literal["a", "b"], "Literal['a', 'b']"),
        (Port, "int"),
        (StoreConfig, "StoreConfig"),
    ],
)
def test_type_name(annotation: object, expected: str) -> None:
    assert type_name(annotation) == expected


def test_config_fields_read_types_defaults_docs_and_constraints() -> None:
    fields = {f.name: f for f in config_fields(StoreConfig)}
    assert list(fields) == ["host", "port", "mode", "tags", "timeout", "secret"]
    host, port = fields["host"], fields["port"]
    assert (host.type, host.required, host.default, host.doc) == ("str", True, None, "Store host name.")
    # A documented type alias carries its description and constraints along.
    assert (port.type, port.default, port.doc) == ("int", 7000, "TCP port of the store.")
    assert port.constraints == {"ge": 1, "le": 65535}
    assert fields["mode"].type == "Literal['sync', 'async']"
    assert fields["tags"].default == ["a"]  # a default factory's value
    assert (fields["timeout"].type, fields["timeout"].default, fields["timeout"].doc) == ("float | None", None, "")
    # An optional field documented on its member (as StoreConfig.integrity_secret): the doc is found there.
    secret = fields["secret"]
    assert (secret.type, secret.doc, secret.constraints) == ("str | None", "A shared secret.", {"min_length": 16})


def test_config_fields_of_no_config() -> None:
    assert config_fields(kvconn.NoConfig) == []


@pytest.fixture
def plugin_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importable modules: a documented connector, and one that cannot import."""
    (tmp_path / "inspect_good.py").write_text(
        textwrap.dedent(
            '''
            """A module docstring."""
            from typing import Annotated

            import msgspec

            import kvconn


            class Config(msgspec.Struct):
                """Tuning."""

                size: Annotated[int, msgspec.Meta(description="Bytes.")] = 4


            class Good(kvconn.KVConnector):
                """Saves to nowhere."""

                Config = Config
                roles = frozenset({kvconn.KVConnectorRole.SCHEDULER})
                saves = True

                def build_connector_meta(self, scheduler_output, block_state):
                    return None


            class Undocumented(Good):
                pass
            '''
        )
    )
    (tmp_path / "inspect_bad.py").write_text("import does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.usefixtures("plugin_modules")
def test_summary_and_details_of_a_class_path() -> None:
    summary, cls = summarize("inspect_good:Good")
    assert cls is not None and cls.__name__ == "Good"
    assert summary.to_dict() == {
        "name": "inspect_good:Good",
        "target": "inspect_good:Good",
        "distribution": None,
        "version": None,
        "status": "ok",
        "roles": ["scheduler"],
        "saves": True,
        "loads": False,
        "api_version": kvconn.API_VERSION,
    }
    details = describe("inspect_good:Good")
    assert details.description == "Saves to nowhere."
    assert details.config_doc == "Tuning."
    assert [(f.name, f.default, f.doc) for f in details.config] == [("size", 4, "Bytes.")]
    assert details.hooks == ["build_connector_meta"]
    # A subclass without a docstring does not borrow its base's: the module's docstring describes it.
    assert describe("inspect_good:Undocumented").description == "A module docstring."


@pytest.mark.usefixtures("plugin_modules")
def test_a_class_path_that_does_not_import_is_broken() -> None:
    summary, cls = summarize("inspect_bad:Connector")
    assert cls is None
    assert summary.status.startswith("broken: ") and "does_not_exist_anywhere" in summary.status
    assert summary.roles is None
    with pytest.raises(kvconn.ConnectorLoadError, match="does_not_exist_anywhere"):
        describe("inspect_bad:Connector")


def test_unknown_names_raise_not_found() -> None:
    with pytest.raises(kvconn.ConnectorNotFoundError, match="did you mean 'dummy'"):
        summarize("dummmy")
