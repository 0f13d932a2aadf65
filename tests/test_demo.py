"""``durably demo`` end to end, and the examples."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console

from durably import Run, RunStatus
from durably._demo import EFFECTS, _Demo

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DURABLY_DATABASE_URL"}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def test_demo_survives_sigkill_and_runs_every_effect_once(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "durably", "demo", "--dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
        cwd=tmp_path,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert "Traceback" not in out + result.stderr
    assert "SIGKILL worker #1" in out
    assert "started worker #2" in out
    # The ledger table: every effect ran exactly once, reserve and charge by the
    # killed worker, ship by its replacement.
    for effect, worker in (("reserve-stock", 1), ("charge-card", 1), ("ship", 2)):
        assert re.search(
            rf"^\s*{effect}\s+1\s+worker #{worker}\s.*exactly once", out, re.MULTILINE
        ), out
    assert "Every effect ran exactly once" in out

    # The files are kept with --dir, and the ledger itself agrees.
    lines = (folder / "effects.jsonl").read_text().splitlines()
    counts = Counter(json.loads(line)["effect"] for line in lines)
    assert counts == dict.fromkeys(EFFECTS, 1)
    assert (folder / "demo.db").exists()
    assert (folder / "worker-1.log").exists()
    assert "exited with code 0" in out  # worker #2 drained on SIGTERM


def test_demo_fails_when_an_effect_ran_twice(tmp_path: Path) -> None:
    demo = _Demo(tmp_path, Console(file=io.StringIO(), width=200))
    now = time.time()
    with demo.ledger.open("w") as fh:
        for effect in (*EFFECTS, "ship"):
            fh.write(json.dumps({"effect": effect, "order": "A-1", "pid": 1, "at": now}) + "\n")
    run = Run("order-A-1", "order-fulfilment", "1", RunStatus.COMPLETED, created_at=int(now * 1000))
    assert demo.report(run, [], "A-1", worker_exit=0) == 1
    with demo.ledger.open("w") as fh:
        for effect in EFFECTS:
            fh.write(json.dumps({"effect": effect, "order": "A-1", "pid": 1, "at": now}) + "\n")
    assert demo.report(run, [], "A-1", worker_exit=0) == 0
    assert demo.report(run.replace(status=RunStatus.FAILED), [], "A-1", worker_exit=0) == 1


def test_quickstart_example_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "completed" in result.stdout
    assert "'total': 120.0" in result.stdout
    assert "'approved_by': 'ada'" in result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing left behind in the working directory
