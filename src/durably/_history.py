"""A run's history as one JSON document: what ``durably runs export`` writes
and ``durably.testing.assert_replayable`` reads."""

from __future__ import annotations

import dataclasses
from typing import Any

from .model import Checkpoint, CheckpointStatus, Run, RunStatus

__all__ = ["FORMAT", "history_from_json", "history_to_json"]

FORMAT = "durably.history/1"
"""The ``format`` field of an exported history."""


def history_to_json(run: Run, checkpoints: list[Checkpoint]) -> dict[str, Any]:
    """The run and its checkpoints (seq order) as JSON data, every stored field kept."""
    return {
        "format": FORMAT,
        "run": dataclasses.asdict(run),
        "checkpoints": [dataclasses.asdict(c) for c in sorted(checkpoints, key=lambda c: c.seq)],
    }


def history_from_json(data: Any) -> tuple[Run, dict[int, Checkpoint]]:
    """Read back :func:`history_to_json`'s document; ``ValueError`` says what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a durably history (expected format {FORMAT!r})")
    run_data, checkpoint_data = data.get("run"), data.get("checkpoints")
    if not isinstance(run_data, dict) or not isinstance(checkpoint_data, list):
        raise ValueError("a durably history needs a 'run' object and a 'checkpoints' list")
    try:
        run = Run(**_known(Run, run_data))
        run.status = RunStatus(run.status)
        checkpoints: dict[int, Checkpoint] = {}
        for item in checkpoint_data:
            if not isinstance(item, dict):
                raise ValueError("each checkpoint must be an object")
            checkpoint = Checkpoint(**_known(Checkpoint, item))
            checkpoint.status = CheckpointStatus(checkpoint.status)
            if not isinstance(checkpoint.seq, int) or checkpoint.seq in checkpoints:
                raise ValueError(f"bad or repeated checkpoint seq {checkpoint.seq!r}")
            if checkpoint.run_id != run.run_id:
                raise ValueError(f"checkpoint {checkpoint.seq} belongs to another run")
            checkpoints[checkpoint.seq] = checkpoint
    except TypeError as exc:  # a required field missing
        raise ValueError(f"a durably history with a missing field: {exc}") from None
    return run, checkpoints


def _known(cls: Any, data: dict[str, Any]) -> dict[str, Any]:
    # Fields a later release adds are ignored by this one, not fatal.
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}
