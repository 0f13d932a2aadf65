"""Fixtures of the observability tests: a real ``durably worker`` subprocess
serving ``tests/apps/observed_app.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"

SpawnWorker = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def observed_worker(tmp_path: Path) -> Iterator[SpawnWorker]:
    """``spawn(url, *flags, **env)`` starts ``durably worker --app
    observed_app:engine``; every one started is stopped at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn(url: str, *flags: str, **extra_env: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, **extra_env)
        env.pop("DURABLY_DATABASE_URL", None)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p
        )
        log = (tmp_path / f"worker-{len(started)}.log").open("wb")
        command = [sys.executable, "-m", "durably", "worker", "--app", "observed_app:engine"]
        process = subprocess.Popen(
            [*command, "--store", url, "--interval", "0.1", *flags],
            cwd=APPS,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        started.append(process)
        return process

    yield spawn
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
