"""The upstream's own Python worker, ``durable-worker`` 0.26.1, in a virtualenv of its own.

Its ``[redis]`` extra pins bullmq 2.17 (durably uses bullmq 3), so it cannot
live in ``.venv``: the session fixture below creates ``.interop-venv`` at the
repository root from PyPI the first time (about 15 s) and reuses it after.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO

import pytest

from on_redis.redis_fixtures import delete_prefix

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".interop-venv"
REQUIREMENT = "durable-worker[redis]==0.26.1"
REDIS_URL = "redis://127.0.0.1:6379/0"
STEPS_APP = Path(__file__).with_name("dw_steps.py")
WORKFLOWS_APP = Path(__file__).with_name("dw_workflows.py")
_CHECK = (
    "import importlib.metadata as m, durable_worker.redis_runner; "
    "print(m.version('durable-worker'), m.version('bullmq'))"
)


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _ready() -> bool:
    if not _venv_python().exists():
        return False
    found = subprocess.run(
        [str(_venv_python()), "-c", _CHECK], capture_output=True, text=True, check=False
    )
    return found.returncode == 0 and found.stdout.startswith("0.26.1 ")


@pytest.fixture(scope="session")
def interop_python() -> Path:
    """The interpreter of a virtualenv holding ``durable-worker[redis]==0.26.1``."""
    if not _ready():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        install = subprocess.run(
            [
                str(_venv_python()),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                REQUIREMENT,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if install.returncode != 0 or not _ready():
            pytest.fail(f"could not install {REQUIREMENT} into {VENV}:\n{install.stderr[-2000:]}")
    return _venv_python()


class StepWorker:
    """A running ``dw_steps.py`` process and the lines it printed."""

    def __init__(self, process: asyncio.subprocess.Process, stderr: IO[bytes]) -> None:
        self.process = process
        self.stderr = stderr
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.lines.append(line.decode().rstrip("\n"))

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    def errors(self) -> str:
        """The tail of what the worker wrote on stderr."""
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-3000:]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix of the test's own (Redis is shared); its keys are deleted after."""
    name = f"durably-interop-{uuid.uuid4().hex[:10]}"
    yield name
    await delete_prefix(REDIS_URL, name)


@asynccontextmanager
async def step_worker(
    python: Path,
    prefix: str,
    namespace: str = "default",
    partition: str | None = None,
    *,
    concurrency: int = 4,
) -> AsyncIterator[StepWorker]:
    """Start ``dw_steps.py`` under ``python`` and wait for its READY line."""
    args = [str(STEPS_APP), REDIS_URL, prefix, str(concurrency), namespace]
    if partition is not None:
        args.append(partition)
    async with worker_process(python, args) as worker:
        yield worker


@asynccontextmanager
async def workflow_worker(
    python: Path, prefix: str, partition: str | None = None
) -> AsyncIterator[StepWorker]:
    """Start ``dw_workflows.py`` (remote workflows and their steps) and wait for READY."""
    args = [str(WORKFLOWS_APP), REDIS_URL, prefix, *([partition] if partition else [])]
    async with worker_process(python, args) as worker:
        yield worker


@asynccontextmanager
async def worker_process(python: Path, args: list[str]) -> AsyncIterator[StepWorker]:
    """Start a durable-worker app under ``python`` and wait for its READY line."""
    with tempfile.TemporaryFile() as stderr:
        process = await asyncio.create_subprocess_exec(
            str(python), *args, stdout=asyncio.subprocess.PIPE, stderr=stderr
        )
        worker = StepWorker(process, stderr)
        try:
            for _ in range(600):
                if "READY" in worker.lines or process.returncode is not None:
                    break
                await asyncio.sleep(0.05)
            if "READY" not in worker.lines:
                await worker.stop()
                pytest.fail(f"durable-worker did not start:\n{worker.errors()}")
            yield worker
        finally:
            await worker.stop()
