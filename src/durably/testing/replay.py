"""The replay checker: does changed workflow code still replay the histories
of the runs in production?

Export a run's history with ``durably runs export RUN_ID > history.json``,
keep it with the tests, and check every change against it::

    await assert_replayable(app.engine, "tests/histories/order.json")

The history is replayed by the engine's own replay (the same position checks
that fail a run with :class:`~durably.NondeterminismError`) on a throwaway
in-memory engine: recorded results are returned, and whatever comes after the
history parks instead of executing, so no step, timer or child runs for real.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._history import history_from_json
from .._replay import TurnEnd
from ..engine import Engine
from ..errors import NondeterminismError, WorkflowNotRegistered
from ..model import Checkpoint, Run, RunStatus
from .clock import VirtualClock

__all__ = ["ReplayMismatch", "ReplayReport", "assert_replayable", "check_replay"]

History = str | os.PathLike[str] | Mapping[str, Any]
"""A history file's path, or its parsed JSON."""


class ReplayMismatch(AssertionError):
    """The current code does not replay a recorded history.

    ``seq`` is the first position where they differ (``None`` when the body
    raised instead), ``history`` the ``(kind, name)`` recorded there and
    ``found`` what the body calls there now (``None``: nothing).
    """

    def __init__(
        self,
        message: str,
        *,
        seq: int | None = None,
        history: tuple[str, str] | None = None,
        found: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.seq = seq
        self.history = history
        self.found = found


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """A history that replays: which run, and how many positions were matched."""

    run_id: str
    workflow: str
    version: str
    positions: int
    """Recorded positions the body reached, every one matching its history."""
    parked: bool
    """The body went on past the history (new code after it) and parked there."""


async def assert_replayable(app: Any, history: History) -> ReplayReport:
    """Replay ``history`` against the current code; raise :class:`ReplayMismatch`
    naming the first diverging position if a running run of it would break.

    ``app`` is the application's engine (the body registered for the run's
    workflow and version is used), the workflow function itself, or a function
    that registers the workflows on the engine it is given. Adding operations
    after the recorded history passes; inserting, removing or renaming one
    before its end fails, unless guarded with ``ctx.patched``.
    """
    return await check_replay(app, history)


async def check_replay(app: Any, history: History, *, label: str | None = None) -> ReplayReport:
    """:func:`assert_replayable` (``label`` names the history in messages)."""
    run, checkpoints, where = _load(history, label)
    engine = Engine("memory://", clock=VirtualClock(_last_time(run, checkpoints)), drive=False)
    try:
        _register(engine, app, run, where)
        await engine.open()
        # The run is inserted as leased to the replaying engine, so a write the
        # replay makes (a new ctx.patched marker) lands in the throwaway store.
        held = copy.deepcopy(run)
        held.status = RunStatus.RUNNING
        held.locked_by, held.locked_until = engine.instance_id, 2**62
        held.cancel_requested = None
        await engine.store.create_run(held)
        for checkpoint in checkpoints.values():
            await engine.store.save_checkpoint(copy.deepcopy(checkpoint), engine.instance_id)
        outcome, turn = await engine._turns.replay_only(held, copy.deepcopy(checkpoints))
    finally:
        await engine.close()
    head = f"{where}: run {run.run_id!r} ({run.workflow} v{run.workflow_version})"
    failure = turn.failure
    if isinstance(failure, NondeterminismError):
        raise ReplayMismatch(
            f"{head} does not replay: {failure}",
            seq=failure.seq,
            history=failure.history,
            found=failure.found,
        )
    unreached = sorted(seq for seq in checkpoints if seq >= turn.next_seq)
    if unreached:
        missing = checkpoints[unreached[0]]
        ended = "ended" if outcome.end in (TurnEnd.COMPLETED, TurnEnd.FAILED) else "stopped"
        raise ReplayMismatch(
            f"{head} does not replay: position {missing.seq} holds {missing.kind} "
            f"{missing.name!r} in the history, but the workflow now {ended} before it",
            seq=missing.seq,
            history=(str(missing.kind), missing.name),
        )
    if outcome.end is TurnEnd.FAILED and run.status is not RunStatus.FAILED:
        error = outcome.error or {}
        raise ReplayMismatch(
            f"{head} does not replay: the workflow raised {error.get('type')}: "
            f"{error.get('message')} while replaying its history"
        )
    if outcome.end is TurnEnd.CLOSED:
        raise ReplayMismatch(f"{head}: the replay was stopped ({turn.close_reason})")
    return ReplayReport(
        run.run_id,
        run.workflow,
        run.workflow_version,
        positions=len(checkpoints),
        parked=outcome.end is TurnEnd.SUSPENDED,
    )


def _load(history: History, label: str | None) -> tuple[Run, dict[int, Checkpoint], str]:
    if isinstance(history, Mapping):
        data: Any = dict(history)
        where = label or "history"
    else:
        path = Path(history)
        where = label or str(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{where}: cannot read a history: {exc}") from None
    try:
        run, checkpoints = history_from_json(data)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return run, checkpoints, where


def _register(engine: Engine, app: Any, run: Run, where: str) -> None:
    if isinstance(app, Engine):
        try:
            definition = app._registry.get(run.workflow, run.workflow_version)
        except WorkflowNotRegistered as exc:
            raise ReplayMismatch(
                f"{where}: run {run.run_id!r} cannot replay: {exc}; its running runs "
                "would wait, blocked, for an instance that registers it"
            ) from None
        engine.register(
            run.workflow, definition.fn, version=run.workflow_version, input=definition.input_type
        )
    elif inspect.iscoroutinefunction(app):
        engine.register(run.workflow, app, version=run.workflow_version)
    elif callable(app):
        setup: Callable[[Engine], object] = app
        setup(engine)
        try:
            engine._registry.get(run.workflow, run.workflow_version)
        except WorkflowNotRegistered as exc:
            raise ReplayMismatch(f"{where}: run {run.run_id!r} cannot replay: {exc}") from None
    else:
        raise TypeError(
            f"assert_replayable takes an Engine, a workflow function or a setup function, "
            f"not {app!r}"
        )


def _last_time(run: Run, checkpoints: dict[int, Checkpoint]) -> int:
    times = [run.updated_at, run.created_at]
    for checkpoint in checkpoints.values():
        times += [t for t in (checkpoint.finished_at, checkpoint.started_at) if t is not None]
    return max(t for t in times if isinstance(t, int)) or 1
