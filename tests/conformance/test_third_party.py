"""The conformance suite runs outside this repository, as a third party runs it:
a project of its own whose conftest loads the plugin and provides
``store_factory``, and whose test module star-imports a suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFTEST = """
import pytest

from durably.stores import MemoryStore
from durably.testing.conformance import store_factory_from

pytest_plugins = ["durably.testing.conformance.plugin"]


@pytest.fixture
async def store_factory():
    shared = MemoryStore()  # a process-local store: every "other" object is this one
    async with store_factory_from(lambda: shared) as factory:
        yield factory
"""

TESTS = "from durably.testing.conformance.stores.schedules import *  # noqa: F403\n"


def test_a_project_of_its_own_runs_a_suite_through_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_my_store.py").write_text(TESTS)

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout
