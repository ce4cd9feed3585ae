"""The names DESIGN.md promises keep working after the reference engine moved to ``kvconn.reference``."""

from __future__ import annotations

import kvconn.engine
import kvconn.reference


def test_kvconn_engine_is_the_reference_engine_under_its_old_name() -> None:
    assert kvconn.engine.__all__ == kvconn.reference.__all__
    for name in kvconn.reference.__all__:
        assert getattr(kvconn.engine, name) is getattr(kvconn.reference, name), name
