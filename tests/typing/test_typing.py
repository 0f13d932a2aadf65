"""The public types hold under ``mypy --strict``: ``handles_typed.py`` is checked
here (an unused ``type: ignore`` is an error too, so the expected errors must occur)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_handles_are_typed_from_the_workflow_function() -> None:
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            str(HERE / "handles_typed.py"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
