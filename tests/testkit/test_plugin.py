"""The pytest plugin: its fixtures, and that installing durably is enough to get them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import durably
from durably.testing import TestEnv


async def test_the_engine_fixtures_are_open_and_run_workflows(
    durably_engine: durably.Engine, durably_sqlite_engine: durably.Engine
) -> None:
    for engine in (durably_engine, durably_sqlite_engine):

        @engine.workflow("hello")
        async def hello(ctx: durably.WorkflowContext, name: str) -> str:
            return await ctx.local_step("greet", lambda: f"hello {name}")

        assert engine.is_open
        run = await engine.start("hello", "ada")
        result = await engine.wait_for_run(run.run_id, terminal=True, timeout=30)
        assert result.output == "hello ada"
    assert "sqlite" in type(durably_sqlite_engine.store).__name__.lower()


async def test_the_test_env_fixture_skips_time(test_env: TestEnv) -> None:
    @test_env.engine.workflow("later")
    async def later(ctx: durably.WorkflowContext) -> str:
        await ctx.sleep("30d")
        return "done"

    run_id = await test_env.start("later")
    await test_env.advance("30d")
    await test_env.assert_completed(run_id, output="done")


def test_the_plugin_loads_from_its_entry_point_in_another_project(tmp_path: Path) -> None:
    """A project with only durably installed gets the fixtures, next to the
    conformance plugin this repository loads through addopts."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    (tmp_path / "test_app.py").write_text(
        textwrap.dedent(
            """
            async def test_env_is_there(test_env, durably_engine):
                assert test_env.engine.is_open and durably_engine.is_open
            """
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "durably.testing.conformance.plugin",
            "test_app.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
