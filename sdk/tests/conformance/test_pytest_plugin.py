"""The author-facing pytest base class, run in a child pytest (pytester)."""

from __future__ import annotations

import pytest

from kvconn.testing.conformance import list_checks

pytest_plugins = ["pytester"]


def test_one_line_subclass_for_dummy_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from kvconn.testing import ConnectorConformance

        class TestDummy(ConnectorConformance):
            connector = "dummy"
        """
    )
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    data_checks = sum("saves" in c.requires for c in list_checks())
    store_checks = sum("store" in c.requires for c in list_checks())  # the dummy is no store connector
    result.assert_outcomes(passed=len(list_checks()) - data_checks - store_checks, skipped=data_checks + store_checks)
    result.stdout.fnmatch_lines([f"*SKIPPED ?{data_checks}?*the connector does not save (saves = False)*"])


def test_failing_check_shows_observed_and_fix(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "fixtures"))
    pytester.makepyfile(
        """
        from kvconn.testing import ConnectorConformance

        class TestBroken(ConnectorConformance):
            connector = "kvconn_conformance_fixtures.broken:NewBlocksOnly"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "KV011 or KV001")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_conformance?KV011-block-fill?*", "*KV011 block-fill: observed *; fix: *"])


def test_unloadable_connector_fails_every_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from kvconn.testing import ConnectorConformance

        class TestMissing(ConnectorConformance):
            connector = "not-installed"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "KV001")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*connector 'not-installed' did not load: no connector named*"])


def test_config_factory_gives_each_run_its_own_config(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "fixtures"))
    pytester.makepyfile(
        """
        from kvconn.testing import ConnectorConformance

        RUNS = []

        class TestStore(ConnectorConformance):
            connector = "kvconn.testing.memory_connector:MemoryConnector"

            def config_factory(self, run):
                RUNS.append(run)
                return {"store": f"{run}-{len(RUNS)}"}

        class TestStoreAgain(TestStore):
            pass

        def test_every_run_was_asked_for_once():
            assert len(RUNS) == len(set(RUNS)) * 2
            assert {"preemption", "mid-block-chunks", "preempted-saves", "fill-step-saves"} <= set(RUNS)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2 * len(list_checks()) + 1)


def test_config_factory_gets_a_directory_per_run_removed_after_the_class(pytester: pytest.Pytester) -> None:
    """As pytest's tmp_path: each run's directory is empty and its own, and none is left once the class ends."""
    pytester.makepyfile(
        """
        from kvconn.testing import ConnectorConformance

        DIRECTORIES = []

        class TestStore(ConnectorConformance):
            connector = "kvconn.testing.memory_connector:MemoryConnector"

            def config_factory(self, run, directory):
                assert directory.is_dir() and not any(directory.iterdir()) and directory not in DIRECTORIES
                DIRECTORIES.append(directory)
                return {"store": str(directory)}

        def test_the_directories_are_gone():
            assert len(DIRECTORIES) > 10 and not [d for d in DIRECTORIES if d.parent.exists()]
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=len(list_checks()) + 1)
