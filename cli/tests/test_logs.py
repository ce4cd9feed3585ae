"""Logs while connectors run: one line per record unless debugging."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvconn_cli.logs import configure_logging


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def _log_failure() -> None:
    try:
        raise ValueError("store unreachable")
    except ValueError:
        logging.getLogger("kvconn.host").exception("connector 'x' failed in save_kv_layer; degrading")
    logging.getLogger("kvconn.host").debug("a debug detail")


def test_one_line_without_debug(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(debug=False)
    _log_failure()
    assert capsys.readouterr().err == "kvconn: ERROR kvconn.host: connector 'x' failed in save_kv_layer; degrading\n"


def test_tracebacks_and_debug_records_with_debug(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(debug=True)
    _log_failure()
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: store unreachable" in err
    assert "a debug detail" in err
